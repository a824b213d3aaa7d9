"""The session's explorer cell: ``Session.explore`` (the view is :mod:`rlnb.notebook`'s)."""

from __future__ import annotations

from typing import Any

from rlnb._errors import public_call
from rlnb.runtime import make_view

__all__ = ["ExploreCells"]


class ExploreCells:
    """``explore`` of :class:`~rlnb.Session`, which provides ``_check_open()``."""

    def _check_open(self) -> None:
        raise NotImplementedError  # the session's

    def _check_readable(self, batch: Any, call: str) -> None:
        raise NotImplementedError  # the session's (ExperimentCells)

    @public_call("nothing was changed")
    def explore(self, batch: Any = None) -> Any:
        """A widget to look into a batch of rollouts (:class:`rlnb.notebook.Explorer`):
        its groups side by side, each sample's reward, advantage, finish reason,
        length and version lag, and every completion token coloured by its behaviour
        log-prob, the current policy's log-prob, their importance ratio, its policy
        version or the sample's advantage (hover a token for its numbers); sort,
        filter, and page through :attr:`batches`. Leave it last in a cell.

        ``batch``: None for the last of :attr:`batches`; an int indexes them; one of
        them (a :class:`~rlnb.learn.KeptBatch`); or groups that were not trained on,
        such as ``sess.rollout(4)``. Raises ``RuntimeError`` when ``batch`` is None and
        no step has been trained, ``IndexError`` for an index outside
        :attr:`batches`, ``TypeError`` for anything else, and
        :class:`~rlnb.ConfigError` for a batch kept by a session of another task, seed
        or vocabulary, or groups holding a token id this model does not have (see
        :meth:`what_if`). Blocks while it computes the current policy's log-probs of
        the batch (between two steps, also while training runs in the background);
        the session is not changed."""
        self._check_open()
        if batch is not None and not isinstance(batch, int):
            self._check_readable(batch, "explore")
        return make_view("explorer", self, batch=batch)

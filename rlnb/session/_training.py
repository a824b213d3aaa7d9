"""``sess.training``: training in the background while the kernel stays free.

A :class:`Training` is a part of one :class:`~rlnb.Session`; each call is a short
delegation to the session's :class:`~rlnb.learn.Trainer`. The foreground steps
(``sess.step()``, ``sess.train()``) are the session's own calls.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from rlnb._errors import public_call

if TYPE_CHECKING:
    from rlnb.learn import Trainer

__all__ = ["Training"]


class Training:
    """The session's background training, ``sess.training``: :meth:`start` trains on
    the session's own thread and returns at once, :meth:`stop` ends the run at a step
    boundary, :meth:`wait` waits for it; :attr:`running` says whether it runs."""

    def __init__(
        self,
        *,
        trainer: Trainer,
        check: Callable[[], object],
        check_open: Callable[[], None],
        watch_stalls: Callable[[], None],
    ) -> None:
        self._trainer, self._check, self._check_open, self._watch_stalls = trainer, check, check_open, watch_stalls

    @property
    def running(self) -> bool:
        """Whether training runs in the background (:meth:`start`)."""
        return self._trainer.training

    @public_call("statistics().training says whether it runs")
    def start(self, steps: int | None = None) -> None:
        """Train on the session's own thread and return at once: ``steps`` more steps,
        or until :meth:`stop` (None). The kernel stays free: widgets,
        ``sess.rollouts.pause()``, ``resume()`` and other cells work meanwhile, and
        Ctrl-C in another cell does not touch the run. A failure is raised, chained, at
        the next call on the session. ``sess.step()``, ``train()``, ``warmup()``,
        ``evaluate()`` and ``save()`` raise until the run ends."""
        self._check()
        self._watch_stalls()
        self._trainer.start(steps)

    @public_call("the background run still stops after its step; sess.training.stop() waits again")
    def stop(self, timeout: float | None = None) -> None:
        """End the background run at a step boundary and wait for it (a step that has
        started its update completes; one still waiting trains nothing). Rollouts go on
        as they were: ``sess.rollouts.pause()`` pauses them. Idempotent."""
        self._check_open()
        self._trainer.stop(timeout)
        self._check()

    @public_call(
        "the background run goes on: sess.training.stop() ends it, wait() waits again", waits_for_rollouts=True
    )
    def wait(self, timeout: float | None = None) -> None:
        """Block until the background run has taken its ``steps`` (or was stopped);
        raises its failure. :class:`TimeoutError` after ``timeout`` s."""
        self._check()
        self._trainer.wait(timeout)

    def __bool__(self) -> bool:
        # ``sess.training`` was a bool before it was this part: old code reads it so.
        warnings.warn(
            "Session.training is the session's background training now; use sess.training.running "
            "for whether it runs (reading it as a bool goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.running

    def __repr__(self) -> str:
        state = "running" if self._trainer.training else "not running"
        return f"<rlnb training in the background: {state}, step {self._trainer.version}>"

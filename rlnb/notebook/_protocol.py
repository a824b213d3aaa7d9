"""The session as the notebook layer sees it: the members its widgets read and call.

``rlnb.session`` imports this layer (``Session.dashboard()``, ``Session.explore()``),
so this layer never imports the session back, not even for types: the widgets are
typed by :class:`NotebookSession`, and mypy checks that a ``Session`` is one where
the session hands itself to :func:`~rlnb.notebook.dashboard` and
:class:`~rlnb.notebook.Explorer`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rlnb.config import Change, Config
    from rlnb.learn import Callback, KeptBatch
    from rlnb.runtime import Snapshot
    from rlnb.session.reports import Findings, SessionStatistics

__all__ = ["Decoder", "NotebookSession", "RolloutControls", "TrainingControls"]


class RolloutControls(Protocol):
    """``sess.rollouts``: what the dashboard's pause, resume and stop buttons call."""

    def pause(self, mode: str = ...) -> None: ...

    def resume(self) -> None: ...

    def stop(self) -> None: ...


class TrainingControls(Protocol):
    """``sess.training``: background training, what the start and stop buttons call."""

    @property
    def running(self) -> bool: ...

    def start(self, steps: int | None = ...) -> None: ...

    def stop(self, timeout: float | None = ...) -> None: ...


class Decoder(Protocol):
    """``sess.tokenizer``, as far as the widgets read it."""

    def decode(self, ids: Sequence[int]) -> str: ...


class NotebookSession(Protocol):
    """What a dashboard and an explorer use of an :class:`rlnb.Session`."""

    @property
    def name(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    @property
    def exit_code(self) -> int | None: ...

    @property
    def config(self) -> Config: ...

    @property
    def model_description(self) -> str: ...

    @property
    def tokenizer(self) -> Decoder: ...

    @property
    def baseline(self) -> Snapshot: ...

    @property
    def version(self) -> int: ...

    @property
    def history(self) -> list[dict[str, float]]: ...

    @property
    def evaluations(self) -> list[tuple[int, float]]: ...

    @property
    def changes(self) -> list[Change]: ...

    @property
    def batches(self) -> Sequence[KeptBatch]: ...

    @property
    def callbacks(self) -> list[Callback]: ...

    @property
    def rollouts(self) -> RolloutControls: ...

    @property
    def training(self) -> TrainingControls: ...

    def on_close(self, fn: Callable[..., object], *args: Any) -> None: ...

    def statistics(self, *, raise_errors: bool = ...) -> SessionStatistics: ...

    def diagnose(self, *, track: bool = ..., raise_errors: bool = ...) -> Findings: ...

    def set(self, **changes: Any) -> list[Change]: ...

    def step(self) -> Mapping[str, float]: ...

    def evaluate(self) -> float: ...

    def save(self, path: str) -> Path: ...

    def logprobs(self, groups: Any) -> list[list[list[float]]]: ...

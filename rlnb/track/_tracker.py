"""``rlnb.Tracker``: one run, several backends, always finished.

Each backend is called in turn and in isolation: one that raises is reported (a
warning the first time in ``log``, a :class:`TrackerError` from ``finish`` after
every other backend has finished) and never keeps another from logging or
finishing. ``finish(exit_code)`` is idempotent; the exit code says success (0),
failure (1) or interrupt (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import threading
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rlnb._errors import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    ConfigError,
    RlnbError,
    UnknownNameError,
    exit_code_for,
)
from rlnb.config import TrackConfig
from rlnb.runtime import register_run, unregister_run

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_SIGINT",
    "EXIT_SIGTERM",
    "Backend",
    "Tracker",
    "TrackerError",
    "exit_code_for",
]


_DEFAULT = TrackConfig()


class TrackerError(RlnbError):
    """A backend failed to log or finish; ``.errors`` holds each backend's error."""


@runtime_checkable
class Backend(Protocol):
    """What a tracker backend does. ``name`` identifies it in errors."""

    name: str

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def finish(self, exit_code: int) -> None: ...


class Tracker:
    """Logs metrics for one run to the backends ``config`` (a :class:`~rlnb.TrackConfig`)
    names, from ``"console"``, ``"jsonl"``, ``"wandb"``, ``"plot"``, then to any
    :class:`Backend` objects in ``extra_backends``. The default config tracks nothing.

    ``config.run_dir`` holds the jsonl file, the plot PNG and wandb's files.
    ``metrics.jsonl`` and ``curves.png`` are this run's: another run's already there
    are kept beside them, renamed ``metrics-<its run id>.jsonl`` and
    ``curves-<its run id>.png``, never appended to or replaced. ``config.run_id``
    names the run (None: a new one); a saved one resumes the same run (its jsonl is
    appended to, its wandb run resumed). ``name`` names the wandb run and
    ``run_config`` is recorded with it. Raises :class:`~rlnb.ConfigError`
    for a config that is not a ``TrackConfig`` or an extra backend without
    ``log``/``finish``, before any backend starts; use as a context manager or call
    :meth:`finish`.
    """

    def __init__(
        self,
        config: TrackConfig = _DEFAULT,
        *,
        name: str | None = None,
        run_config: Mapping[str, Any] | None = None,
        extra_backends: Sequence[Backend] = (),
    ) -> None:
        if not isinstance(config, TrackConfig):
            raise ConfigError(
                f"Tracker(config={config!r}) takes a rlnb.TrackConfig, got {type(config).__name__}: "
                "e.g. Tracker(TrackConfig(backends=('console', 'jsonl'), run_dir='runs/demo'))"
            )
        for backend in extra_backends:
            if not isinstance(backend, Backend):
                raise ConfigError(
                    f"Tracker(extra_backends=[..., {backend!r}, ...]): it has no name, log() or finish(); "
                    "pass objects that keep rlnb.track.Backend, or name a built-in one in TrackConfig.backends"
                )
        self.run_id = config.run_id or uuid.uuid4().hex[:8]
        self.run_dir = None if config.run_dir is None else Path(config.run_dir)
        self._lock = threading.Lock()
        self._finished = False
        self._warned: set[str] = set()
        self._backends: list[Backend] = []
        try:
            for kind in config.backends:
                self._backends.append(self._make(kind, config, name, run_config))
            self._backends.extend(extra_backends)
        except BaseException:
            self.finish(EXIT_FAILURE, raise_errors=False)  # the ones already started
            raise
        if any(b.name != "console" for b in self._backends):  # a console line alone is no run to finish
            register_run(self, f"rlnb:{self.run_id}")

    def _make(self, kind: str, config: TrackConfig, name: str | None, run_config: Mapping[str, Any] | None) -> Backend:
        from rlnb.track import _backends

        if kind == "console":
            return _backends.ConsoleBackend(every=config.console_every)
        assert self.run_dir is not None  # TrackConfig checked
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if kind == "jsonl":
            return _backends.JsonlBackend(self.run_dir / "metrics.jsonl", run_id=self.run_id)
        if kind == "plot":
            return _backends.PlotBackend(self.run_dir / "curves.png", run_id=self.run_id)
        from rlnb.track._wandb import WandbBackend

        return WandbBackend(
            run_dir=self.run_dir,
            run_id=self.run_id,
            name=name,
            config=run_config,
            mode=config.wandb_mode,
            project=config.wandb_project,
        )

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(b.name for b in self._backends)

    @property
    def finished(self) -> bool:
        return self._finished

    def backend(self, name: str) -> Backend:
        """The backend called ``name`` (e.g. ``tracker.backend("plot").widget``)."""
        for b in self._backends:
            if b.name == name:
                return b
        raise UnknownNameError(f"this tracker has no {name!r} backend; it has {self.backends}")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Send ``metrics`` at ``step`` to every backend. A backend that fails is
        warned about once and the others still log."""
        self._each("log", "log", metrics, step)

    def log_change(self, change: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> None:
        """Record a live setting changed (``{"step", "field", "old", "new", "time"}``;
        ``config``: the whole config after it) with every backend that records
        changes: the console prints a line, jsonl writes an ``"event": "change"``
        record, wandb updates the run's config and marks the step. A backend that
        fails is warned about once, as in :meth:`log`."""
        self._each("log_change", "record a change", change, config)

    def _each(self, method: str, doing: str, *args: Any) -> None:
        """Call ``method`` on every backend that has it; one that fails is warned about
        once (``doing``: what it failed to do) and the others go on."""
        if self._finished:
            return
        for backend in self._backends:
            call = getattr(backend, method, None)
            if call is None:
                continue
            try:
                call(*args)
            except Exception as exc:
                if backend.name not in self._warned:
                    self._warned.add(backend.name)
                    warnings.warn(
                        f"rlnb tracker backend {backend.name!r} failed to {doing} ({exc!r}); the others go on",
                        RuntimeWarning,
                        stacklevel=3,
                    )

    def finish(self, exit_code: int = EXIT_OK, *, raise_errors: bool = True) -> None:
        """Finish every backend with ``exit_code``; idempotent and thread-safe.

        Each backend finishes even if another fails (or raises ``SystemExit``);
        then one :class:`TrackerError` names those that failed."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
        errors: list[tuple[str, BaseException]] = []
        try:
            for backend in self._backends:
                try:
                    backend.finish(exit_code)
                except (Exception, SystemExit) as exc:
                    errors.append((backend.name, exc))
        finally:
            unregister_run(self)
        if errors and raise_errors:
            names = ", ".join(f"{n} ({e!r})" for n, e in errors)
            err = TrackerError(f"tracker backend(s) failed to finish: {names}; the others finished")
            err.errors = [e for _, e in errors]  # type: ignore[attr-defined]
            raise err from errors[0][1]

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.finish(exit_code_for(exc), raise_errors=exc is None)

    def __repr__(self) -> str:
        state = "finished" if self._finished else "open"
        return f"<rlnb.Tracker {self.run_id} {list(self.backends)} {state}>"

"""``rlnb.Session``: the composition root that owns every part of a training run.

Each part registers its close on one LIFO exit stack the moment it exists, so a
failure half-way through construction releases exactly what was acquired, and
``close()`` releases everything in reverse order even if one part fails to stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading
import time
from typing import Any

from rlnb._errors import ClosedError, ConfigError
from rlnb.buffer import BufferStatistics, ReplayBuffer
from rlnb.config import Config
from rlnb.runtime import AsyncBridge, _registry

__all__ = ["Session", "SessionStatistics"]

log = logging.getLogger("rlnb")


@dataclasses.dataclass(frozen=True)
class SessionStatistics:
    """A snapshot of a session and its parts."""

    name: str
    closed: bool
    buffer: BufferStatistics


class Session:
    """A training run you can drive one notebook cell at a time.

    ``Session(config, name=...)`` closes a live session of the same name first (so
    re-running the cell that made it is safe) and says so on stderr. Use it as a
    context manager or call :meth:`close`; ``rlnb.close_all()`` and a kernel
    restart close it too. Raises :class:`~rlnb.ConfigError` for bad input before
    anything is built or closed.
    """

    # Construction stages, in order; each ``_build_<stage>`` registers its own close.
    _STAGES = ("bridge", "buffer", "registry")

    def __init__(self, config: Config | None = None, *, name: str = "default") -> None:
        if config is None:
            config = Config()
        if not isinstance(config, Config):
            raise ConfigError(
                f"Session(config=...) takes a rlnb.Config, got {type(config).__name__}: build one with rlnb.Config(...)"
            )
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"Session(name={name!r}) is invalid: use a non-empty string, e.g. name='demo'")
        self._config = config
        self._name = name
        self._lock = threading.Lock()
        self._closed = False
        self._deadline: float | None = None
        self._stack = contextlib.ExitStack()
        self._bridge: AsyncBridge | None = None
        self._buffer: ReplayBuffer | None = None
        self._replace_previous()
        try:
            for stage in self._STAGES:
                getattr(self, f"_build_{stage}")()
        except BaseException:
            self._closed = True
            self._stack.close()
            raise

    # -- construction stages ----------------------------------------------------

    def _build_bridge(self) -> None:
        bridge = AsyncBridge(name=f"rlnb-{self._name}")
        self._stack.callback(self._close_part, bridge)
        self._bridge = bridge

    def _build_buffer(self) -> None:
        cfg = self._config.buffer
        buffer = ReplayBuffer(cfg.capacity, partitions=cfg.partitions, max_staleness=cfg.max_staleness)
        self._stack.callback(self._close_part, buffer)
        self._buffer = buffer

    def _build_registry(self) -> None:
        _registry.register(self)
        self._stack.callback(_registry.unregister, self)

    def _replace_previous(self) -> None:
        previous = _registry.lookup(self._name)
        if previous is None or previous is self:
            return
        previous.close()
        print(
            f"rlnb: closed the earlier session {self._name!r} before making its replacement",
            file=sys.stderr,
        )

    def _close_part(self, part: AsyncBridge | ReplayBuffer) -> None:
        remaining = None if self._deadline is None else max(0.01, self._deadline - time.monotonic())
        part.close(timeout=remaining)

    # -- public API ---------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def config(self) -> Config:
        return self._config

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def bridge(self) -> AsyncBridge:
        """The session's event-loop bridge: ``sess.bridge.run(coro)`` from any thread."""
        self._check_open()
        assert self._bridge is not None
        return self._bridge

    @property
    def buffer(self) -> ReplayBuffer:
        """The session's replay buffer."""
        self._check_open()
        assert self._buffer is not None
        return self._buffer

    def statistics(self) -> SessionStatistics:
        """A frozen snapshot of the session's figures."""
        self._check_open()
        assert self._buffer is not None
        return SessionStatistics(name=self._name, closed=self._closed, buffer=self._buffer.statistics())

    def close(self, timeout: float | None = None) -> None:
        """Close every part, newest first; idempotent and thread-safe.

        Blocks for at most about ``timeout`` seconds (``Config.close_timeout`` by
        default); a part that will not stop in time is abandoned with a warning.
        If a part fails to close, the others are still closed and the error raised.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if timeout is None:
            timeout = self._config.close_timeout
        self._deadline = time.monotonic() + timeout
        self._stack.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<rlnb.Session {self._name!r} {'closed' if self._closed else 'open'}>"

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(
                f"session {self._name!r} is closed; make a new one with rlnb.Session(..., name={self._name!r})"
            )

    def __getstate__(self) -> Any:
        raise TypeError("a Session owns threads, loops and files and cannot be pickled")

"""``defer_interrupts()``: make a block all-or-nothing with respect to Ctrl-C.

An optimiser step followed by a weight sync must not be cut in half by the
notebook's stop button. Inside the block a SIGINT is only recorded; it is raised
as KeyboardInterrupt when the block ends. Off the main thread (where Python never
delivers SIGINT) the block runs unchanged.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["Deferred", "defer_interrupts"]


class Deferred:
    """What :func:`defer_interrupts` yields: ``interrupted`` turns true when a SIGINT
    has been held back, so a block that is still only waiting can give up early."""

    def __init__(self) -> None:
        self.received: list[int] = []

    @property
    def interrupted(self) -> bool:
        return bool(self.received)


@contextlib.contextmanager
def defer_interrupts() -> Iterator[Deferred]:
    """Hold back SIGINT until the block ends, then raise KeyboardInterrupt once."""
    deferred = Deferred()
    if threading.current_thread() is not threading.main_thread():
        yield deferred
        return

    def record(signum: int, frame: FrameType | None) -> None:
        deferred.received.append(signum)

    previous = signal.signal(signal.SIGINT, record)
    try:
        yield deferred
    finally:
        signal.signal(signal.SIGINT, previous)
    if deferred.interrupted:
        raise KeyboardInterrupt("interrupted; the step it arrived in was completed first")

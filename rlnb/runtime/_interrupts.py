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

__all__ = ["defer_interrupts"]


@contextlib.contextmanager
def defer_interrupts() -> Iterator[None]:
    """Hold back SIGINT until the block ends, then raise KeyboardInterrupt once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = signal.signal(signal.SIGINT, record)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt("interrupted; the step it arrived in was completed first")

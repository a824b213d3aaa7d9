"""``defer_interrupts()``: make a block all-or-nothing with respect to Ctrl-C.

An optimiser step followed by a weight sync must not be cut in half by the
notebook's stop button. Inside the block a SIGINT is only recorded; it is raised
as KeyboardInterrupt when the block ends. Off the main thread (where Python never
delivers SIGINT) the block runs unchanged.

A block that fails while a SIGINT is held back raises its own error, with a note
that says the Ctrl-C arrived. The error already stops the cell, and it is the news:
callers such as the trainer read a KeyboardInterrupt out of the block as "the step
completed first", which a failed step did not.

``redeliver_lost_interrupts()``: a Ctrl-C is never lost. One that lands while Python
runs a finalizer or a weakref callback raises its KeyboardInterrupt there, where
Python cannot raise it: it prints "Exception ignored in ..." on stderr (a red box in
a notebook) and the press is gone. Any code has that window, whenever the garbage
collector frees an object that something watches through a weak reference (a
thread in ``threading``'s WeakSet, a task in asyncio's).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from rlnb._sigint import press_again

__all__ = ["Deferred", "defer_interrupts", "redeliver_lost_interrupts"]


class Deferred:
    """What :func:`defer_interrupts` yields: ``interrupted`` turns true when a SIGINT
    has been held back, so a block that is still only waiting can give up early."""

    def __init__(self) -> None:
        self.received: list[int] = []

    @property
    def interrupted(self) -> bool:
        return bool(self.received)


_HELD_BACK_NOTE = (
    "KeyboardInterrupt: a Ctrl-C arrived during {what} and was held back so that {what} "
    "would complete; {what} failed with the error above instead"
)


@contextlib.contextmanager
def defer_interrupts(what: str = "the step") -> Iterator[Deferred]:
    """Hold back SIGINT until the block ends, then raise KeyboardInterrupt once.

    If the block raises another error meanwhile, that error propagates with a note
    that the Ctrl-C arrived, so it is not dropped silently. ``what`` names the block
    in those messages ("the step", "close()", ...)."""
    deferred = Deferred()
    if threading.current_thread() is not threading.main_thread():
        yield deferred
        return

    def record(signum: int, frame: FrameType | None) -> None:
        deferred.received.append(signum)

    previous = signal.signal(signal.SIGINT, record)
    failed: BaseException | None = None
    try:
        yield deferred
    except BaseException as exc:
        failed = exc
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
        # A KeyboardInterrupt the block raised itself (it gave up waiting) is the Ctrl-C.
        if deferred.interrupted and failed is not None and not isinstance(failed, KeyboardInterrupt):
            if not any(n.startswith("KeyboardInterrupt: a Ctrl-C arrived") for n in getattr(failed, "__notes__", ())):
                failed.add_note(_HELD_BACK_NOTE.format(what=what))  # once, through nested blocks
    if deferred.interrupted:
        raise KeyboardInterrupt(f"interrupted; held back until {what} was complete")


def redeliver_lost_interrupts() -> None:
    """Make ``sys.unraisablehook`` press a lost Ctrl-C again: a KeyboardInterrupt that
    Python could not raise on the main thread is signalled anew
    (:func:`rlnb._sigint.press_again`, 50 ms later, once the finalizer has returned), and
    not printed. Every other unraisable exception goes to the hook that was there.
    Idempotent; a hook set later (a test's, say) is wrapped in turn on the next call."""
    previous = sys.unraisablehook
    if getattr(previous, "_rlnb_redelivers", False):
        return

    def hook(unraisable: Any) -> None:
        if unraisable.exc_type is KeyboardInterrupt and threading.current_thread() is threading.main_thread():
            press_again()  # from another thread, a moment later: pressed from here, it would land here
            return
        previous(unraisable)

    hook._rlnb_redelivers = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook

"""Ctrl-C where Python cannot take it safely: inside the import machinery.

CPython's importlib takes its global import lock with ``_imp.acquire_lock()`` and
releases it in a ``finally`` entered one instruction later. A KeyboardInterrupt
raised between the two (a Ctrl-C landing there, in an import or in the weakref
callback that drops a module's lock) leaves the lock held by the main thread for
good: the main thread can still import (the lock is reentrant), every other thread
hangs at its next import. A background training step that imports lazily (wandb's
first log does) then never completes.

:func:`import_safe_interrupts` closes that window for a block on the main thread:
a SIGINT that lands while the innermost frame is importlib's own code is pressed
again a moment later (:func:`press_again`), once out of it; any other goes to the
handler that was there. Public calls run inside it (:func:`rlnb._errors.public_call`).
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

__all__ = ["PRESS_AGAIN_AFTER", "import_safe_interrupts", "press_again"]

PRESS_AGAIN_AFTER = 0.05  # seconds: the import's step, or a finalizer, has returned by then
_IMPORT_MACHINERY = frozenset({"<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>"})


def press_again() -> None:
    """Signal SIGINT to the main thread anew, :data:`PRESS_AGAIN_AFTER` seconds from now,
    from a short-lived thread (pressed from where it was held back, it would land there).
    Presses held back meanwhile are one, as the OS makes signals pending at once one."""
    if _pending.is_set():
        return
    _pending.set()
    threading.Thread(target=_press_later, name="rlnb-ctrl-c-again", daemon=True).start()


_pending = threading.Event()


def _press_later() -> None:
    time.sleep(PRESS_AGAIN_AFTER)
    _pending.clear()
    _thread.interrupt_main()  # nothing, if SIGINT is ignored or left to the OS meanwhile


@contextlib.contextmanager
def import_safe_interrupts() -> Iterator[None]:
    """For the block, on the main thread: a Ctrl-C landing in importlib's own frames
    is pressed again once out of them, so it never leaves the import lock held.
    Elsewhere, or when SIGINT has no Python handler, the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous) or getattr(previous, "_rlnb_import_safe", False):
        yield  # ignored, the OS's default, or already guarded by an outer block
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if _unsafe(frame):
            press_again()
            return
        previous(signum, frame)

    handler._rlnb_import_safe = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _unsafe(frame: FrameType | None) -> bool:
    """Whether a KeyboardInterrupt raised in ``frame`` could leave the import lock
    held: the frame is importlib's own, or this module's (a second Ctrl-C inside the
    handler of the first, which would raise out of it into the frame it guards)."""
    if frame is not None and frame.f_code.co_filename in _IMPORT_MACHINERY:
        return True
    while frame is not None:
        if frame.f_code.co_filename == __file__:
            return True
        frame = frame.f_back
    return False

"""The blocking training calls in progress: ``train``, ``step``, ``warmup``,
``evaluate``, ``save`` and ``wait``, made from a cell (or a button) on the caller's
thread; and ``wait``'s progress bar.

While one runs, a notebook kernel's main thread is busy: widget clicks wait until
it returns. The trainer marks each such call here so that ``statistics()`` (and the
dashboard reading it) can say what is running, how far it has got, and when the
last one ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator

from rlnb.learn._background import BackgroundRun
from rlnb.learn._progress import progress_bar

__all__ = ["Foreground", "ForegroundCall", "wait_with_progress"]


@dataclasses.dataclass(frozen=True)
class ForegroundCall:
    """A blocking call: ``call`` as the user would write it (for ``train`` with its
    target: ``"train(until=150)"``), when it ``started`` and, once it has, ``ended``
    (``time.monotonic()`` readings), the name of the thread making it, and for
    ``train`` the policy version it started at (``first``) and the one it stops at
    (``last``)."""

    call: str
    started: float
    thread: str
    first: int | None = None
    last: int | None = None
    ended: float | None = None
    thread_id: int = dataclasses.field(default=0, repr=False, compare=False)

    def progress(self, version: int) -> str:
        """How far a train call has got at policy ``version``, else ``""``: ``"step 41 of
        150 (27 %)"`` from step 0; from another step the call's own count too, which
        the share is of: ``train(300)`` from step 734 is at ``"step 740 of 1034, 6 of
        300 (2 %)"``."""
        if self.first is None or self.last is None or self.last <= self.first:
            return ""
        done, total = version - self.first, self.last - self.first
        share = f"({100 * done // total} %)"
        if self.first == 0:
            return f"step {version} of {self.last} {share}"
        return f"step {version} of {self.last}, {done} of {total} {share}"

    def steps_per_s(self, version: int, now: float | None = None) -> float | None:
        """Policy steps a second since the call started (None before its first step)."""
        if self.first is None or version <= self.first:
            return None
        elapsed = (time.monotonic() if now is None else now) - self.started
        return (version - self.first) / elapsed if elapsed > 0 else None


class Foreground:
    """The foreground calls in progress (``current``: the oldest, or None) and the
    last one that ended (``last``, with its ``ended`` time; None before any). Calls
    nest: one made inside another on the same thread is not counted again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[ForegroundCall] = []
        self.last: ForegroundCall | None = None

    @property
    def current(self) -> ForegroundCall | None:
        calls = self._calls  # replaced whole under the lock: a reader needs no lock
        return calls[0] if calls else None

    @contextlib.contextmanager
    def call(self, call: str, *, first: int | None = None, last: int | None = None) -> Iterator[None]:
        """Mark ``call`` as running on this thread for the ``with`` block."""
        me = threading.current_thread()
        record = ForegroundCall(call, time.monotonic(), me.name, first, last, thread_id=me.ident or 0)
        with self._lock:
            nested = any(c.thread_id == record.thread_id for c in self._calls)
            if not nested:
                self._calls = [*self._calls, record]
        try:
            yield
        finally:
            if not nested:
                with self._lock:
                    self._calls = [c for c in self._calls if c is not record]
                    self.last = dataclasses.replace(record, ended=time.monotonic())


def wait_with_progress(run: BackgroundRun, timeout: float | None, *, progress: bool, desc: str) -> bool:
    """Wait for the background ``run`` to end, up to ``timeout`` s, with a progress bar
    of its steps as they come (toward its ``steps``, or counted when it runs until
    stopped); returns whether it ended."""
    deadline = None if timeout is None else time.monotonic() + timeout
    total = 0 if run.steps is None else run.steps - run.done  # 0: no end known, steps are counted
    first = run.done
    with progress_bar(total, desc, progress) as bar:
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ended = run.wait_ended(0.2 if left is None else min(0.2, left))
            bar.update(run.done - first - bar.n)
            if ended or (left is not None and left <= 0.2):
                return ended or run.wait_ended(0)

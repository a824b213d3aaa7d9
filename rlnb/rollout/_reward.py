"""Reward calls off the event loop: a small pool of daemon threads with a timeout per call.

A reward function is user code. On the loop, a slow one would hold up dispatch,
pause and every other call, and a hung one the whole session; here it runs on a
worker thread ``rlnb-reward-N``. A thread cannot be stopped, so a call that runs
past its timeout (or whose caller is cancelled) is abandoned: its thread ends
whenever the call returns, and another thread takes over the queue at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from rlnb._errors import ClosedError, running_user_code

__all__ = ["CallTimedOut", "PoolFull", "RewardPool", "RunningCall"]

# One thread runs the calls in the order they came, so samples are rewarded, and
# groups reach the buffer, in the order they finished generating (as when rewards ran
# on the loop): runs stay reproducible. A Python reward gains nothing from more
# threads (the GIL), and one that waits on I/O was serial on the loop before too.
REWARD_WORKERS = 1
# Calls abandoned (timed out or cancelled) but still running, each on a thread nothing
# can stop; past this many, new calls fail at once instead of starting more threads.
MAX_ABANDONED = 64
# An idle worker leaves after this long: a session that is not rolling out holds no
# reward thread a second later, while one that trains keeps its thread from step to
# step (a learner step takes well under a second), so the thread gauge holds still.
_IDLE_EXIT_S = 1.0
_thread_ids = itertools.count(1)


class CallTimedOut(Exception):
    """The call ran past its timeout and was abandoned on its ``thread``."""

    def __init__(self, thread: str) -> None:
        super().__init__(thread)
        self.thread = thread


@dataclasses.dataclass(frozen=True)
class RunningCall:
    """A call a worker is running: on ``thread`` (its ``ident`` for a stack), for
    ``seconds``, with ``args``; ``abandoned`` once nobody waits for it any more."""

    thread: str
    ident: int | None
    seconds: float
    args: tuple[Any, ...]
    abandoned: bool


class PoolFull(Exception):
    """Too many abandoned calls are still running to start another."""


class _Call:
    __slots__ = ("abandoned", "args", "finished", "fn", "future", "ident", "started", "thread", "timer")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], future: asyncio.Future[Any]) -> None:
        self.fn, self.args, self.future = fn, args, future
        self.started: float | None = None  # time.monotonic() when a worker took it
        self.thread = ""  # the worker's name
        self.ident: int | None = None  # and its thread id
        self.finished = False  # it returned or raised, or the pool closed before it started
        self.abandoned = False  # nobody waits for it any more: it timed out, or its caller was cancelled
        self.timer: asyncio.TimerHandle | None = None


class RewardPool:
    """Runs calls for one event loop on daemon threads ``rlnb-reward-N``, in order.

    At most ``max_workers`` threads run calls that someone still waits for. A call
    that runs past its timeout, or whose caller is cancelled, is abandoned: its
    thread cannot be stopped and ends when the call returns, but another thread takes
    over the queue at once, so a hung call never holds up later ones. While
    ``max_abandoned`` abandoned calls still run, new calls fail at once instead.
    """

    def __init__(self, *, max_workers: int = REWARD_WORKERS, max_abandoned: int = MAX_ABANDONED) -> None:
        self._max_workers = max_workers
        self._max_abandoned = max_abandoned
        self._cond = threading.Condition()
        self._queue: collections.deque[_Call] = collections.deque()
        self._results: list[tuple[_Call, bool, Any]] = []  # finished, for the loop to settle in order
        self._threads: set[threading.Thread] = set()  # every live worker, abandoned ones too
        self._busy: set[threading.Thread] = set()
        self._workers = 0  # live threads not stuck in an abandoned call
        self._idle = 0  # of those, waiting for a call
        self._starting = 0  # of those, started but not yet waiting
        self._abandoned = 0  # threads still running an abandoned call
        self._running: set[_Call] = set()  # calls a worker runs now, abandoned ones too
        self._closed = False

    async def call(self, fn: Callable[..., Any], /, *args: Any, timeout: float | None) -> Any:
        """``fn(*args)`` on a worker thread; raises what it raises. Raises ``CallTimedOut``
        once it has run ``timeout`` seconds (counted from its start, not from its
        wait for a worker); ``PoolFull``; ClosedError once closed."""
        loop = asyncio.get_running_loop()
        call = _Call(fn, args, loop.create_future())
        self._submit(call)
        if timeout is not None:
            call.timer = loop.call_later(timeout, self._expire, call, timeout)
        try:
            return await call.future
        except BaseException:  # it raised or timed out (no-op), or its caller was cancelled
            self._abandon(call)
            raise
        finally:
            if call.timer is not None:
                call.timer.cancel()

    def running(self) -> list[RunningCall]:
        """The calls workers are running now, the longest-running first (for a stall's
        explanation: which call, for how long, on which thread)."""
        now = time.monotonic()
        with self._cond:
            calls = [(c, now - (c.started or now)) for c in self._running]
        calls.sort(key=lambda pair: -pair[1])
        return [RunningCall(c.thread, c.ident, seconds, c.args, c.abandoned) for c, seconds in calls]

    def close(self, timeout: float = 1.0) -> None:
        """Fail queued calls with ClosedError, let idle workers go, and wait up to
        ``timeout`` s in all for calls in progress to return (a fast reward a close
        caught half-way ends in microseconds). A call still running after that is
        abandoned: its daemon thread ends when the call returns. Idempotent; thread-safe."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for call in self._queue:
                call.finished = True
                self._finished(call, False, ClosedError("the rollouter is closed"))
            self._queue.clear()
            threads = list(self._threads)
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _submit(self, call: _Call) -> None:
        with self._cond:
            if self._closed:
                raise ClosedError("the rollouter is closed")
            if self._abandoned >= self._max_abandoned:
                raise PoolFull(self._abandoned)
            self._queue.append(call)
            self._grow()
            self._cond.notify()

    def _grow(self) -> None:
        """Start workers for queued calls that no idle worker will take (holding the lock)."""
        while not self._closed and len(self._queue) > self._idle + self._starting and self._workers < self._max_workers:
            thread = threading.Thread(target=self._work, name=f"rlnb-reward-{next(_thread_ids)}", daemon=True)
            self._workers += 1
            self._starting += 1
            self._threads.add(thread)
            thread.start()

    def _expire(self, call: _Call, timeout: float) -> None:
        """The call's timer (on the loop): fail it if it has run ``timeout`` s, else look again later."""
        with self._cond:
            if call.finished or call.abandoned:
                return
            left = timeout if call.started is None else call.started + timeout - time.monotonic()
            if left <= 0:
                self._abandon_locked(call)
        if left > 0:  # it waited for a worker: its time counts from its start
            call.timer = asyncio.get_running_loop().call_later(left, self._expire, call, timeout)
        elif not call.future.done():
            call.future.set_exception(CallTimedOut(call.thread))

    def _abandon(self, call: _Call) -> None:
        with self._cond:
            self._abandon_locked(call)

    def _abandon_locked(self, call: _Call) -> None:
        if call.finished or call.abandoned:
            return
        call.abandoned = True
        if call.started is None:
            self._queue.remove(call)
        else:  # its thread is stuck in it until it returns: another takes over the queue
            self._workers -= 1
            self._abandoned += 1
            self._grow()

    def _work(self) -> None:
        me, starting = threading.current_thread(), True
        while True:
            with self._cond:
                if starting:  # from starting to idle in one step: _grow counts it as either
                    self._starting -= 1
                    starting = False
                call = self._next_call()
                if call is None:
                    self._workers -= 1
                    self._threads.discard(me)
                    return
                call.started, call.thread, call.ident = time.monotonic(), me.name, me.ident
                self._busy.add(me)
                self._running.add(call)
            with running_user_code("a reward function"):
                ok, value = _invoke(call)
            with self._cond:
                call.finished = True
                self._busy.discard(me)
                self._running.discard(call)
                if call.abandoned:  # nobody waits for it, and another worker has taken this one's place
                    self._abandoned -= 1
                    self._threads.discard(me)
                    return
                self._finished(call, ok, value)

    def _finished(self, call: _Call, ok: bool, value: Any) -> None:
        """Queue ``call``'s result for the loop; one wake-up takes all queued (holding the lock)."""
        self._results.append((call, ok, value))
        if len(self._results) == 1:  # else the loop has yet to run the _settle already scheduled
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                call.future.get_loop().call_soon_threadsafe(self._settle)

    def _next_call(self) -> _Call | None:
        """The next queued call, waiting up to ``_IDLE_EXIT_S`` for one; None: leave
        (idle that long, or closed). Holding the lock."""
        self._idle += 1
        try:
            while True:
                while not self._queue:
                    if self._closed or (not self._cond.wait(_IDLE_EXIT_S) and not self._queue):
                        return None
                call = self._queue.popleft()
                if not call.future.done():
                    return call
                # Its caller was cancelled and has not yet run to withdraw it (a close
                # cancels every group at once): nobody wants it, so it never starts.
                call.finished = True
        finally:
            self._idle -= 1

    def _settle(self) -> None:
        """On the loop: hand finished calls their results, in the order they finished."""
        with self._cond:
            results, self._results = self._results, []
        for call, ok, value in results:
            if call.future.done():  # timed out or cancelled meanwhile
                continue
            if ok:
                call.future.set_result(value)
            else:
                call.future.set_exception(value)


def _invoke(call: _Call) -> tuple[bool, Any]:
    try:
        return True, call.fn(*call.args)
    except Exception as exc:
        return False, exc
    except BaseException as exc:  # SystemExit and the like must not reach the event loop as such
        error = RuntimeError(f"the call raised {exc!r}")
        error.__cause__ = exc
        return False, error

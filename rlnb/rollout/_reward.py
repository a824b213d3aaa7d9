"""Reward calls off the event loop: a small pool of daemon threads with a timeout per call.

A reward function is user code. On the loop, a slow one would hold up dispatch,
pause and every other call, and a hung one the whole session; here it runs on a
worker thread ``rlnb-reward-N``. A call that runs past its timeout (or whose caller
is cancelled) is abandoned and stopped (:mod:`rlnb.rewards._isolation`): an
isolated function's worker process is killed, an ``async def`` one's task is
cancelled; a plain function cannot be stopped, and its thread ends whenever the
call returns. Either way another thread takes over the queue at once.

A timeout fails more than its own call: the calls with the same ``key`` (the same
function) queued behind it, and every later call of the same ``group``, fail at
once, since each would only wait out a timeout of its own, one after another.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from rlnb._errors import ClosedError, running_user_code
from rlnb.rewards import Scope, Workers, scope_of

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
# What close() waits, past its timeout, for the calls it stopped to return.
_STOPPED_RETURN_S = 0.5
_thread_ids = itertools.count(1)


class CallTimedOut(Exception):
    """The call ran past its timeout and was stopped, or abandoned on its ``thread``;
    ``earlier``: it never ran, since a call with its key or group timed out first."""

    def __init__(self, thread: str, *, stopped: bool = False, earlier: str | None = None) -> None:
        super().__init__(thread)
        self.thread = thread
        self.stopped = stopped  # its process was killed or its task cancelled: no thread is left in it
        # It never ran: a call of its key or group timed out first (that call's label).
        self.earlier = earlier

    def fate(self) -> str:
        """What became of the call, for an error's message."""
        if self.earlier is not None:
            return (
                f"the call for {self.earlier} ran past the timeout first (from the same group, or queued "
                "before this one), and this one would only have waited out a timeout of its own"
            )
        if self.stopped:
            return "it was stopped: its worker process killed, or its task cancelled"
        return (
            f"its thread {self.thread} ends when the call returns; mark a function that may never return "
            "rlnb.rewards.isolated to have it killed at the timeout"
        )


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
    __slots__ = (
        "abandoned", "args", "finished", "fn", "future", "group", "ident", "key", "label", "scope", "started",
        "thread", "timer",
    )  # fmt: skip

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        future: asyncio.Future[Any],
        key: Any,
        group: Any,
        label: str,
    ) -> None:
        self.fn, self.args, self.future = fn, args, future
        self.key, self.group, self.label = key, group, label
        self.scope: Scope | None = None  # how to stop it, once a worker took it
        self.started: float | None = None  # time.monotonic() when a worker took it
        self.thread = ""  # the worker's name
        self.ident: int | None = None  # and its thread id
        self.finished = False  # it returned or raised, or the pool closed before it started
        self.abandoned = False  # nobody waits for it any more: it timed out, or its caller was cancelled
        self.timer: asyncio.TimerHandle | None = None


class RewardPool:
    """Runs calls for one event loop on daemon threads ``rlnb-<name>-N``, in order.

    At most ``max_workers`` threads run calls that someone still waits for. A call
    that runs past its timeout, or whose caller is cancelled, is abandoned: its
    thread cannot be stopped and ends when the call returns, but another thread takes
    over the queue at once, so a hung call never holds up later ones. While
    ``max_abandoned`` abandoned calls still run, new calls fail at once instead.
    """

    def __init__(
        self, *, max_workers: int = REWARD_WORKERS, max_abandoned: int = MAX_ABANDONED, name: str = "reward"
    ) -> None:
        self._max_workers = max_workers
        self._name = name  # its threads are rlnb-<name>-N
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
        # Groups a call of which timed out (by identity, held weakly): their later calls fail at once.
        self._timed_out_groups: dict[int, tuple[weakref.ref[Any], str]] = {}  # and the label of the call
        self._processes = Workers(max_idle=max_workers)  # for isolated functions (rlnb.rewards.isolated)
        self._closed = False

    async def call(
        self,
        fn: Callable[..., Any],
        /,
        *args: Any,
        timeout: float | None,
        key: Any = None,
        group: Any = None,
        label: str = "",
    ) -> Any:
        """``fn(*args)`` on a worker thread; raises what it raises. Raises ``CallTimedOut``
        once it has run ``timeout`` seconds (counted from its start, not from its
        wait for a worker or a worker process), and at once when a call with the same
        ``key`` (hashable) timed out while this one was queued, or a call of the same
        ``group`` (any object that takes a weak reference) timed out before (its
        ``earlier`` is that call's ``label``); ``PoolFull``; ClosedError once closed."""
        loop = asyncio.get_running_loop()
        call = _Call(fn, args, loop.create_future(), key, group, label)
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

    def queued(self) -> int:
        """Calls waiting for a worker thread (all of them busy); does not block."""
        with self._cond:
            return len(self._queue)

    def close(self, timeout: float = 1.0) -> None:
        """Fail queued calls with ClosedError, let idle workers go, and wait up to
        ``timeout`` s in all for calls in progress to return (a fast reward a close
        caught half-way ends in microseconds). A call still running after that is
        stopped (its worker process killed, its task cancelled), or abandoned: a plain
        function's daemon thread ends when the call returns. Every worker process is
        killed and reaped. Idempotent; thread-safe."""
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
        with self._cond:
            late = [call.scope for call in self._running if call.scope is not None]
        for scope in late:
            scope.stop()
        deadline = time.monotonic() + _STOPPED_RETURN_S
        for thread in threads:  # a stopped call returns in milliseconds
            thread.join(max(0.0, deadline - time.monotonic()))
        self._processes.close()

    def _submit(self, call: _Call) -> None:
        with self._cond:
            if self._closed:
                raise ClosedError("the rollouter is closed")
            if call.group is not None and (first := self._group_timed_out(call.group)) is not None:
                raise CallTimedOut("", earlier=first)
            if self._abandoned >= self._max_abandoned:
                raise PoolFull(self._abandoned)
            self._queue.append(call)
            self._grow()
            self._cond.notify()

    def _grow(self) -> None:
        """Start workers for queued calls that no idle worker will take (holding the lock)."""
        while not self._closed and len(self._queue) > self._idle + self._starting and self._workers < self._max_workers:
            thread = threading.Thread(target=self._work, name=f"rlnb-{self._name}-{next(_thread_ids)}", daemon=True)
            self._workers += 1
            self._starting += 1
            self._threads.add(thread)
            thread.start()

    def _expire(self, call: _Call, timeout: float) -> None:
        """The call's timer (on the loop): fail it if it has run ``timeout`` s, else look
        again later; with it, the queued calls of its key and the later calls of its group."""
        with self._cond:
            if call.finished or call.abandoned:
                return
            started = call.started if call.scope is None else call.scope.started
            left = timeout if started is None else started + timeout - time.monotonic()
            behind: list[_Call] = []
            if left <= 0:
                self._abandon_locked(call)
                behind = self._timed_out_locked(call)
        if left > 0:  # it waited for a worker (or a worker process): its time counts from its start
            call.timer = asyncio.get_running_loop().call_later(left, self._expire, call, timeout)
            return
        if not call.future.done():
            call.future.set_exception(
                CallTimedOut(call.thread, stopped=call.scope is not None and call.scope.interrupted)
            )
        for other in behind:
            if not other.future.done():
                other.future.set_exception(CallTimedOut(call.thread, earlier=call.label))

    def _timed_out_locked(self, call: _Call) -> list[_Call]:
        """Note that ``call`` timed out, and withdraw the queued calls it dooms (holding the lock)."""
        if call.group is not None:
            self._timed_out_groups = {k: v for k, v in self._timed_out_groups.items() if v[0]() is not None}
            self._timed_out_groups[id(call.group)] = (weakref.ref(call.group), call.label)
        doomed = [
            c
            for c in self._queue
            if (call.key is not None and c.key == call.key) or (call.group is not None and c.group is call.group)
        ]
        for c in doomed:
            self._abandon_locked(c)
        return doomed

    def _group_timed_out(self, group: Any) -> str | None:
        """The label of the call of ``group`` that timed out, if one did."""
        ref, label = self._timed_out_groups.get(id(group), (None, ""))
        return label if ref is not None and ref() is group else None

    def _abandon(self, call: _Call) -> None:
        with self._cond:
            self._abandon_locked(call)

    def _abandon_locked(self, call: _Call) -> None:
        if call.finished or call.abandoned:
            return
        call.abandoned = True
        if call.started is None:
            self._queue.remove(call)
        else:  # its thread is in it until it returns (at once if it can be stopped): another takes over the queue
            self._workers -= 1
            self._abandoned += 1
            self._grow()
            if call.scope is not None:
                call.scope.stop()

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
                call.scope = Scope(self._processes, call.started)
                self._busy.add(me)
                self._running.add(call)
            with running_user_code("a reward function"), scope_of(call.scope):
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

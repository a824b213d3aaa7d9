"""The sync→async bridge: one event loop on one named thread, shared by every call.

A loop and thread per call costs hundreds of microseconds and leaks three FDs a call
unless the loop is closed; ``asyncio.run`` is impossible inside a Jupyter cell (the
kernel's loop is already running). One long-lived loop thread avoids both.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import enum
import os
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any, TypeVar

from rlnb._errors import BridgeReentryError, ClosedError, InvalidTypeError, WaitTimeoutError
from rlnb.runtime._interrupts import defer_interrupts

__all__ = ["AsyncBridge"]

T = TypeVar("T")

# How long run() waits, after cancelling on Ctrl-C or timeout, for the coroutine's
# own cleanup (its finally blocks) before it re-raises.
_CANCEL_GRACE = 1.0
# run() waits in slices of this many seconds. CPython runs a signal's handler when
# a blocking lock acquire is interrupted, but a signal that lands just before the
# acquire starts does not interrupt it: an unbounded wait would then sit on a
# Ctrl-C until the call ended (seen in about 1 of 400 presses with uvloop on a busy
# machine). Slicing bounds that case to one slice.
_WAIT_SLICE = 0.1
# How many of the loop thread's innermost frames a report of where it is stuck shows.
_STUCK_FRAMES = 4


class _State(enum.Enum):
    IDLE = "idle"  # no loop thread yet: it starts on first use
    RUNNING = "running"
    CLOSED = "closed"


# Every bridge, by weak references without callbacks (pruned as they are read): a
# bridge's collection runs no Python code of ours, where a Ctrl-C would be lost.
_BRIDGES: list[weakref.ref[AsyncBridge]] = []
# Loops inherited across fork(): never closed in the child (see _discard_inherited_loop).
_INHERITED: list[asyncio.AbstractEventLoop] = []


def default_loop_factory() -> asyncio.AbstractEventLoop:
    """A uvloop loop where uvloop is installed, else a plain asyncio loop.

    ``RLNB_EVENT_LOOP=asyncio`` forces the plain one. uvloop wakes its loop through
    an eventfd instead of a self-pipe, which roughly halves the cost of handing a
    call from another thread into the loop (measured: ~37 µs against ~65 µs).
    """
    if os.environ.get("RLNB_EVENT_LOOP", "").lower() != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


_warmed_up = False


def warm_up_loop_backend() -> None:
    """Create and close one default loop, once per process.

    libuv opens a process-wide pipe the first time any loop is made and keeps it for
    the life of the process. Leak checks call this first so that one-time resource is
    not counted against the first session.
    """
    global _warmed_up
    if not _warmed_up:
        default_loop_factory().close()
        _warmed_up = True


class AsyncBridge:
    """Runs coroutines on a private event loop thread, from any other thread.

    The loop thread starts lazily on first use. ``run`` works from plain threads and
    from threads whose own loop is running (every Jupyter cell). Use it as a context
    manager or call :meth:`close`, which is idempotent.
    """

    def __init__(
        self,
        name: str = "rlnb-bridge",
        *,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] = default_loop_factory,
    ) -> None:
        self._name = name
        self._loop_factory = loop_factory
        self._lock = threading.Lock()
        self._state = _State.IDLE
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._thread_ident: int | None = None
        # concurrent future -> its task once started on the loop
        self._calls: dict[concurrent.futures.Future[Any], asyncio.Task[None] | None] = {}
        # No finalizer: a Ctrl-C that lands in one is lost (Python cannot raise its
        # KeyboardInterrupt there), and collection comes at any moment. A running bridge
        # is never collected anyway: its loop thread holds it.
        _BRIDGES[:] = [ref for ref in _BRIDGES if ref() is not None] + [weakref.ref(self)]

    # -- public API -------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def closed(self) -> bool:
        return self._state is _State.CLOSED

    @property
    def started(self) -> bool:
        """Whether the loop thread has been started (it starts on first use)."""
        return self._loop is not None

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop, once started (to look at its tasks; run coroutines with :meth:`run`)."""
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T], /) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the bridge loop and return a future for its result.

        Does not block. The caller's context variables are copied into the task.
        Raises :class:`~rlnb.ClosedError` once the bridge is closed.
        """
        if not asyncio.iscoroutine(coro):
            raise InvalidTypeError(
                f"AsyncBridge.submit() takes a coroutine object, got {type(coro).__name__}; "
                "call the async function first: bridge.submit(fn(*args))"
            )
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._schedule(coro, fut)
        return fut

    def cancel(self, fut: concurrent.futures.Future[Any]) -> None:
        """Cancel the call behind ``fut`` (from :meth:`submit`) without waiting: not yet
        started, it never starts; running, its task is cancelled on the loop (its
        ``finally`` blocks run there, and ``fut`` then holds the CancelledError).
        Nothing once it has ended or the bridge has closed."""
        if fut.cancel():
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def cancel_task() -> None:
            task = self._calls.get(fut)
            if task is not None:
                task.cancel()

        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(cancel_task)

    def _schedule(self, coro: Coroutine[Any, Any, T], fut: concurrent.futures.Future[T]) -> None:
        ctx = contextvars.copy_context()
        with self._lock:
            if self._state is _State.CLOSED:
                coro.close()
                raise ClosedError(f"bridge {self._name!r} is closed")
            try:
                loop = self._ensure_started()
            except BaseException:  # e.g. a Ctrl-C held back while the thread started
                coro.close()
                raise
            self._calls[fut] = None
            loop.call_soon_threadsafe(self._start_call, coro, fut, ctx)

    def run(
        self,
        coro: Coroutine[Any, Any, T],
        /,
        *,
        timeout: float | None = None,
        cancel: threading.Event | None = None,
    ) -> T:
        """Run ``coro`` on the bridge loop and block until it returns its result.

        Raises whatever the coroutine raises; :class:`TimeoutError` after ``timeout``
        seconds; :class:`~rlnb.BridgeReentryError` when called from the bridge's own
        loop thread (``await`` the coroutine there instead); :class:`~rlnb.ClosedError`
        when the bridge is or becomes closed; ``asyncio.CancelledError`` once the
        ``cancel`` event is set (another thread's way to stop the call). On timeout,
        KeyboardInterrupt or ``cancel`` the coroutine is cancelled (and given a
        moment to clean up) before the error propagates.
        """
        if self._in_loop_thread():
            coro.close()
            raise BridgeReentryError(
                f"AsyncBridge.run() was called on bridge {self._name!r}'s own loop thread, "
                "which would deadlock; inside a coroutine on the bridge, use `await coro`"
            )
        if not asyncio.iscoroutine(coro):
            raise InvalidTypeError(f"AsyncBridge.run() takes a coroutine object, got {type(coro).__name__}")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        # Ctrl-C may land on any bytecode: from here on every path cancels the call.
        try:
            self._schedule(coro, fut)
            return _result_in_slices(fut, timeout, cancel)
        except _CancelRequested:
            self._cancel_call(fut, coro)
            raise asyncio.CancelledError(f"the call on bridge {self._name!r} was cancelled by request") from None
        except concurrent.futures.TimeoutError:
            if fut.done():  # the coroutine itself raised TimeoutError, or it just finished
                return fut.result()
            if self._cancel_call(fut, coro):
                raise WaitTimeoutError(
                    f"AsyncBridge.run() timed out after {timeout:.3g} s before the call could start, so it was "
                    f"cancelled: {self._where_stuck()}"
                ) from None
            raise WaitTimeoutError(
                f"AsyncBridge.run() timed out after {timeout} s; the coroutine was cancelled"
            ) from None
        except KeyboardInterrupt:
            self._cancel_call(fut, coro)
            raise

    def close(self, timeout: float | None = 5.0) -> None:
        """Cancel pending calls, finish async generators and the executor, stop the loop.

        Idempotent and thread-safe; callers racing it get :class:`~rlnb.ClosedError`,
        never a hang. Blocks for at most about ``timeout`` seconds. If the loop thread
        does not stop in time (a coroutine blocks it, or ignores cancellation), every
        call not yet finished fails with :class:`~rlnb.ClosedError` and the thread is
        abandoned with a :class:`RuntimeWarning` that says where it is stuck. It is a
        daemon thread; it closes its loop if it ever gets free, and a call that was
        waiting behind it never starts.
        """
        if self._in_loop_thread():
            raise BridgeReentryError(
                f"AsyncBridge.close() was called on bridge {self._name!r}'s own loop thread; "
                "close it from another thread"
            )
        with self._lock:
            if self._state is _State.CLOSED:
                return
            self._state = _State.CLOSED
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            loop.call_soon_threadsafe(self._begin_shutdown)
        except RuntimeError:  # loop already closed
            pass
        thread.join(timeout)
        if thread.is_alive():
            self._fail_pending()
            warnings.warn(
                f"rlnb: bridge {self._name!r} did not stop within {timeout:.3g} s: {self._where_stuck()}\n"
                "Its calls failed with ClosedError; the thread is left to stop by itself and closes its "
                "loop if it does. A coroutine that blocks (time.sleep, a lock, a slow reward function) "
                "holds up every call on the bridge: run such work with `await asyncio.to_thread(fn, ...)`.",
                RuntimeWarning,
                stacklevel=2,
            )

    def __enter__(self) -> AsyncBridge:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<AsyncBridge {self._name!r} {self._state.value}>"

    # -- internals --------------------------------------------------------------

    def _in_loop_thread(self) -> bool:
        return self._thread_ident is not None and threading.get_ident() == self._thread_ident

    def _ensure_started(self) -> asyncio.AbstractEventLoop:
        """Start the loop thread if needed. Called with the lock held."""
        if self._loop is not None:
            return self._loop
        # A Ctrl-C waits until the thread is started and recorded: one that landed while
        # start() waits for the thread to begin would leave a running loop with no owner.
        with defer_interrupts("starting the event loop"):
            loop = self._loop_factory()
            thread = threading.Thread(target=self._serve, args=(loop,), name=self._name, daemon=True)
            try:
                thread.start()
            except BaseException:
                loop.close()
                raise
            self._loop, self._thread, self._thread_ident = loop, thread, thread.ident
            self._state = _State.RUNNING
        return loop

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            # Normally close() stopped us; if anything else did, the bridge cannot serve
            # any more, so it closes rather than leaving callers waiting forever.
            with self._lock:
                self._state = _State.CLOSED
            self._fail_pending()
            asyncio.set_event_loop(None)
            loop.close()  # here, not in close(): a thread that outlived close()'s join still cleans up

    def _start_call(
        self,
        coro: Coroutine[Any, Any, Any],
        fut: concurrent.futures.Future[Any],
        ctx: contextvars.Context,
    ) -> None:
        with self._lock:  # close() may be failing this call from another thread (see _fail_pending)
            claimed = not fut.done() and not fut.running() and fut.set_running_or_notify_cancel()
        if not claimed:  # cancelled, or failed by a close() that gave up on a blocked loop
            coro.close()
            self._calls.pop(fut, None)
            return
        if self._state is _State.CLOSED:
            coro.close()
            self._calls.pop(fut, None)
            _settle(fut, ClosedError(f"bridge {self._name!r} closed before the call started"))
            return
        assert self._loop is not None
        name = getattr(coro, "__qualname__", None)  # names the call in reports of a stuck loop
        self._calls[fut] = self._loop.create_task(self._drive(coro, fut), name=name, context=ctx)

    async def _drive(self, coro: Coroutine[Any, Any, Any], fut: concurrent.futures.Future[Any]) -> None:
        # Setting the result from inside the task saves a loop iteration per call
        # compared with a done-callback.
        try:
            result = await coro
        except asyncio.CancelledError as exc:
            if self._state is _State.CLOSED:
                _settle(fut, ClosedError(f"bridge {self._name!r} closed while the call was running"))
            else:
                _settle(fut, exc)
        except BaseException as exc:  # KeyboardInterrupt/SystemExit too: the caller owns them
            _settle(fut, exc)
        else:
            _settle(fut, None, result)
        finally:
            self._calls.pop(fut, None)

    def _cancel_call(self, fut: concurrent.futures.Future[Any], coro: Coroutine[Any, Any, Any]) -> bool:
        """Cancel a call from the caller's thread and wait briefly for its cleanup.
        Returns whether the call had not started yet."""
        if fut.cancel():  # not started (perhaps not even scheduled): it never will be
            coro.close()
            return True
        loop = self._loop
        if loop is None or loop.is_closed():
            return False

        def cancel_task() -> None:
            task = self._calls.get(fut)
            if task is not None:
                task.cancel()

        try:
            loop.call_soon_threadsafe(cancel_task)
        except RuntimeError:  # closed meanwhile
            return False
        concurrent.futures.wait([fut], timeout=_CANCEL_GRACE)
        return False

    def _begin_shutdown(self) -> None:
        assert self._loop is not None
        self._loop.create_task(self._shutdown(), name=_SHUTDOWN_TASK)

    async def _shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for task, result in zip(tasks, results, strict=True):
                # Our own calls deliver their errors to their callers; report the rest.
                if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                    loop.call_exception_handler(
                        {"message": "task failed while the bridge was closing", "exception": result, "task": task}
                    )
            await loop.shutdown_asyncgens()
            await loop.shutdown_default_executor()
        finally:
            loop.stop()

    def where(self) -> str:
        """Where the loop thread is now (its task, its innermost frames, the tasks it
        has not finished), for a report such as a stall's; safe from any thread."""
        return self._where_stuck()

    def _where_stuck(self) -> str:
        """Where the loop thread is now: its current task, the tasks it has not
        finished, and its innermost frames. Read from another thread, for reports."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or thread.ident is None:
            return "its loop thread has not started"
        frame = sys._current_frames().get(thread.ident)
        if frame is None:
            return f"its loop thread {thread.name!r} has ended"
        current = asyncio.current_task(loop)
        frames: list[tuple[FrameType, int]] = []  # innermost first, down to the bridge's own frames
        while frame is not None and frame.f_code not in _OWN_CODE and len(frames) < _STUCK_FRAMES:
            frames.append((frame, frame.f_lineno))
            frame = frame.f_back
        stack = "".join(traceback.format_list(traceback.StackSummary.extract(reversed(frames)))).rstrip()
        if not frames:
            doing = "waiting for work"
        else:
            doing = "outside any task" if current is None else f"running task {current.get_name()!r}"
            doing += f", at:\n{stack}"
        where = f"its loop thread {thread.name!r} is {doing}"
        others = sorted(t.get_name() for t in asyncio.all_tasks(loop) if t is not current)
        others = [name for name in others if name != _SHUTDOWN_TASK]
        if others:
            more = f" and {len(others) - 5} more" if len(others) > 5 else ""
            where += f"\nTasks not finished: {', '.join(map(repr, others[:5]))}{more}."
        return where

    def _fail_pending(self) -> None:
        """Fail every call not finished yet with ClosedError; safe from any thread."""
        with self._lock:
            calls, self._calls = self._calls, {}
            # Claim the calls not started yet so that _start_call never starts them.
            # Only the claim is made under the lock: settling runs the future's callbacks.
            for fut in calls:
                if not fut.done() and not fut.running():
                    fut.set_running_or_notify_cancel()
        for fut in calls:
            _settle(fut, ClosedError(f"bridge {self._name!r} closed while the call was pending"))

    def _reset_after_fork(self) -> None:
        """In a forked child: forget the parent's loop thread, start afresh on next use."""
        self._lock = threading.Lock()
        self._calls = {}
        loop, self._loop, self._thread, self._thread_ident = self._loop, None, None, None
        if self._state is _State.RUNNING:
            self._state = _State.IDLE
        if loop is not None:
            _discard_inherited_loop(loop)


def _discard_inherited_loop(loop: asyncio.AbstractEventLoop) -> None:
    # Closing the parent's loop here would be wrong: the child shares its epoll
    # instance with the parent, and close() deregisters the loop's self-pipe from it,
    # which leaves the parent's loop deaf to every later wake-up. Keep the object
    # alive (its few FDs stay open in the child) so no finalizer touches it either.
    _INHERITED.append(loop)


def _bridges() -> list[AsyncBridge]:
    return [b for b in (ref() for ref in list(_BRIDGES)) if b is not None]


def _after_fork_in_child() -> None:
    for bridge in _bridges():
        bridge._reset_after_fork()


def live_loops() -> tuple[str, ...]:
    """Names of bridges whose event loop exists and is not closed."""
    return tuple(sorted(b._name for b in _bridges() if b._loop is not None and not b._loop.is_closed()))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _settle(fut: concurrent.futures.Future[Any], exc: BaseException | None, result: Any = None) -> None:
    """Give ``fut`` its outcome, unless it has one already: a close() that gave up on
    a blocked loop failed it, and its caller was told so."""
    try:
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)
    except concurrent.futures.InvalidStateError:
        pass


_SHUTDOWN_TASK = "rlnb-bridge-shutdown"
# Where a report of a stuck loop thread stops walking its stack: the bridge's own frames.
_OWN_CODE = frozenset({AsyncBridge._serve.__code__, AsyncBridge._drive.__code__})


class _CancelRequested(Exception):
    """The ``cancel`` event of a :meth:`AsyncBridge.run` was set while it waited."""


def _result_in_slices(
    fut: concurrent.futures.Future[T], timeout: float | None, cancel: threading.Event | None = None
) -> T:
    """``fut.result(timeout)``, waiting at most ``_WAIT_SLICE`` seconds at a time (see
    there), and a fifth of that when ``cancel`` must be noticed soon."""
    deadline = None if timeout is None else time.monotonic() + timeout
    step = _WAIT_SLICE if cancel is None else _WAIT_SLICE / 5
    while True:
        wait = step if deadline is None else min(step, max(0.0, deadline - time.monotonic()))
        try:
            return fut.result(wait)
        except concurrent.futures.TimeoutError:
            if fut.done():  # finished meanwhile, or raised TimeoutError itself
                return fut.result()
            if cancel is not None and cancel.is_set():
                raise _CancelRequested from None
            if deadline is not None and time.monotonic() >= deadline:
                raise

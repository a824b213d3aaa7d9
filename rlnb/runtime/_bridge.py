"""The sync→async bridge: one event loop on one named thread, shared by every call.

A loop and thread per call costs hundreds of microseconds and leaks three FDs a call
unless the loop is closed; ``asyncio.run`` is impossible inside a Jupyter cell (the
kernel's loop is already running). One long-lived loop thread avoids both.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import enum
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from rlnb._errors import BridgeReentryError, ClosedError

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


class _State(enum.Enum):
    IDLE = "idle"  # no loop thread yet: it starts on first use
    RUNNING = "running"
    CLOSED = "closed"


_BRIDGES: weakref.WeakSet[AsyncBridge] = weakref.WeakSet()
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
        _BRIDGES.add(self)

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

    def submit(self, coro: Coroutine[Any, Any, T], /) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the bridge loop and return a future for its result.

        Does not block. The caller's context variables are copied into the task.
        Raises :class:`~rlnb.ClosedError` once the bridge is closed.
        """
        if not asyncio.iscoroutine(coro):
            raise TypeError(
                f"AsyncBridge.submit() takes a coroutine object, got {type(coro).__name__}; "
                "call the async function first: bridge.submit(fn(*args))"
            )
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._schedule(coro, fut)
        return fut

    def _schedule(self, coro: Coroutine[Any, Any, T], fut: concurrent.futures.Future[T]) -> None:
        ctx = contextvars.copy_context()
        with self._lock:
            if self._state is _State.CLOSED:
                coro.close()
                raise ClosedError(f"bridge {self._name!r} is closed")
            loop = self._ensure_started()
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
            raise TypeError(f"AsyncBridge.run() takes a coroutine object, got {type(coro).__name__}")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        # Ctrl-C may land on any bytecode: from here on every path cancels the call.
        try:
            self._schedule(coro, fut)
            return _result_in_slices(fut, timeout, cancel)
        except _CancelRequested:
            self._cancel_call(fut, coro)
            raise asyncio.CancelledError(f"the call on bridge {self._name!r} was cancelled by request") from None
        except concurrent.futures.TimeoutError:
            if fut.done():  # the coroutine itself raised TimeoutError
                raise
            self._cancel_call(fut, coro)
            raise TimeoutError(f"AsyncBridge.run() timed out after {timeout} s; the coroutine was cancelled") from None
        except KeyboardInterrupt:
            self._cancel_call(fut, coro)
            raise

    def close(self, timeout: float | None = 5.0) -> None:
        """Cancel pending calls, finish async generators and the executor, stop the loop.

        Idempotent and thread-safe; callers racing it get :class:`~rlnb.ClosedError`,
        never a hang. Blocks for at most about ``timeout`` seconds; if the loop thread
        does not stop in time it is abandoned (it is a daemon thread) with a warning.
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
                f"rlnb: bridge {self._name!r} loop thread did not stop within {timeout} s; "
                "a task is ignoring cancellation. Its daemon thread closes the loop if it ever stops.",
                RuntimeWarning,
                stacklevel=2,
            )

    def __enter__(self) -> AsyncBridge:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<AsyncBridge {self._name!r} {self._state.value}>"

    def __del__(self) -> None:
        # Only warn: closing from a finalizer could run on any thread, at any time.
        if getattr(self, "_state", _State.CLOSED) is _State.RUNNING:
            warnings.warn(
                f"unclosed {self!r}; call close() or use it as a context manager",
                ResourceWarning,
                source=self,
                stacklevel=2,
            )

    # -- internals --------------------------------------------------------------

    def _in_loop_thread(self) -> bool:
        return self._thread_ident is not None and threading.get_ident() == self._thread_ident

    def _ensure_started(self) -> asyncio.AbstractEventLoop:
        """Start the loop thread if needed. Called with the lock held."""
        if self._loop is not None:
            return self._loop
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
        if not fut.set_running_or_notify_cancel():  # cancelled before it started
            coro.close()
            self._calls.pop(fut, None)
            return
        if self._state is _State.CLOSED:
            coro.close()
            self._calls.pop(fut, None)
            fut.set_exception(ClosedError(f"bridge {self._name!r} closed before the call started"))
            return
        assert self._loop is not None
        self._calls[fut] = self._loop.create_task(self._drive(coro, fut), context=ctx)

    async def _drive(self, coro: Coroutine[Any, Any, Any], fut: concurrent.futures.Future[Any]) -> None:
        # Setting the result from inside the task saves a loop iteration per call
        # compared with a done-callback.
        try:
            result = await coro
        except asyncio.CancelledError as exc:
            if self._state is _State.CLOSED:
                fut.set_exception(ClosedError(f"bridge {self._name!r} closed while the call was running"))
            else:
                fut.set_exception(exc)
        except BaseException as exc:  # KeyboardInterrupt/SystemExit too: the caller owns them
            fut.set_exception(exc)
        else:
            fut.set_result(result)
        finally:
            self._calls.pop(fut, None)

    def _cancel_call(self, fut: concurrent.futures.Future[Any], coro: Coroutine[Any, Any, Any]) -> None:
        """Cancel a call from the caller's thread and wait briefly for its cleanup."""
        if fut.cancel():  # not started (perhaps not even scheduled): it never will be
            coro.close()
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def cancel_task() -> None:
            task = self._calls.get(fut)
            if task is not None:
                task.cancel()

        try:
            loop.call_soon_threadsafe(cancel_task)
        except RuntimeError:  # closed meanwhile
            return
        concurrent.futures.wait([fut], timeout=_CANCEL_GRACE)

    def _begin_shutdown(self) -> None:
        assert self._loop is not None
        self._loop.create_task(self._shutdown())

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

    def _fail_pending(self) -> None:
        calls, self._calls = self._calls, {}
        for fut in calls:
            if not fut.done():
                try:
                    fut.set_exception(ClosedError(f"bridge {self._name!r} closed while the call was pending"))
                except concurrent.futures.InvalidStateError:
                    pass

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


def _after_fork_in_child() -> None:
    for bridge in list(_BRIDGES):
        bridge._reset_after_fork()


def live_loops() -> tuple[str, ...]:
    """Names of bridges whose event loop exists and is not closed."""
    return tuple(sorted(b._name for b in list(_BRIDGES) if b._loop is not None and not b._loop.is_closed()))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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

"""User code that its timeout can stop, even when it holds the GIL or never returns.

A reward pool thread (:class:`~rlnb.rollout._reward.RewardPool`) runs each call
inside a :class:`Scope`, which the pool stops when the call times out or its caller
gives up. What the call does then depends on how it runs:

- a function marked :func:`isolated` (and the ready rewards that parse model output,
  ``math_answer`` and ``regex_format``) runs in a worker process of the pool's
  :class:`Workers`; stopping the scope kills that process, so a regex that
  backtracks for hours or an integer with a billion digits costs its timeout and no
  more, and no other thread waits on its GIL;
- an ``async def`` function runs as a task on an event loop of the call's own
  (:func:`run_coroutine`); stopping the scope cancels the task, and the loop is
  closed when the call returns;
- a plain function runs on the pool's thread, which nothing can stop: a call that
  never returns keeps its (daemon) thread until it does.

Worker processes follow contract 8, as the prompt loader's do
(``rlnb/data/_loader.py``): they start from multiprocessing's forkserver (a fresh,
single-threaded interpreter) without re-running ``__main__``, ignore SIGINT, get
SIGKILL when this process ends (``PR_SET_PDEATHSIG``), and :meth:`Workers.close`
kills and reaps them. Outside a pool (a direct call in a cell, ``rescore``) an
isolated function runs in the caller, as a plain one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import inspect
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from rlnb._errors import ConfigError, RlnbError
from rlnb._reprs import short_repr
from rlnb.runtime import block_on, spawn_without_main

__all__ = ["Cancelled", "IsolatedError", "Scope", "Workers", "current_scope", "isolated", "run_coroutine", "scope_of"]

_PR_SET_PDEATHSIG = 1
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
# A worker's start and its first import of a function (math-verify imports sympy) are
# not the call's: they are bounded by this instead of the call's timeout.
PREPARE_TIMEOUT = 120.0


class Cancelled(RlnbError):
    """The call was stopped (it timed out, or its caller gave up) before it returned."""


class IsolatedError(RlnbError, RuntimeError):
    """An isolated function's worker process could not run it: the function or its
    arguments could not be sent, its result could not come back, or the process died."""


class _RemoteTraceback(Exception):
    """The worker process's traceback of an exception, as its text (the cause of the
    exception raised here, as ``concurrent.futures`` shows a process's error)."""

    def __str__(self) -> str:
        return str(self.args[0])


# --- the call a pool thread runs -------------------------------------------------------


class Scope:
    """One call on a reward pool thread: how to stop it, and the worker processes it may use.

    :meth:`stop` runs each hook registered with :meth:`on_stop` once, from any thread
    (the pool's event loop, when the call times out); a hook registered after the
    stop runs at once. ``started`` is when the call's clock started: None while a
    worker process starts or imports the function, which the timeout does not count.
    """

    def __init__(self, workers: Workers | None, started: float | None = None) -> None:
        self.workers = workers
        self.started = started
        self._lock = threading.Lock()
        self._hooks: dict[int, Callable[[], None]] = {}
        self._ids = iter(range(1 << 62))
        self._stopped = False
        self.interrupted = False  # the stop ran a hook: a process was killed or a task cancelled

    @property
    def stopped(self) -> bool:
        return self._stopped

    def on_stop(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Run ``hook()`` when the call is stopped (at once if it is); returns a function
        that unregisters it. A hook must be quick and must not block."""
        with self._lock:
            if not self._stopped:
                key = next(self._ids)
                self._hooks[key] = hook
                return lambda: self._forget(key)
        _run_hook(hook)
        return lambda: None

    def _forget(self, key: int) -> None:
        with self._lock:
            self._hooks.pop(key, None)

    def stop(self) -> None:
        """Stop the call: run its hooks (idempotent, thread-safe, never raises)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            hooks, self._hooks = list(self._hooks.values()), {}
            self.interrupted = bool(hooks)
        for hook in hooks:
            _run_hook(hook)

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        """The call's clock stops in the block, and starts again from its end."""
        self.started = None
        try:
            yield
        finally:
            self.started = time.monotonic()


def _run_hook(hook: Callable[[], None]) -> None:
    with contextlib.suppress(Exception):  # e.g. a loop closed meanwhile: nothing is left to stop
        hook()


_current = threading.local()


@contextlib.contextmanager
def scope_of(scope: Scope) -> Iterator[Scope]:
    """Run the block as ``scope``'s call (on this thread)."""
    previous = getattr(_current, "scope", None)
    _current.scope = scope
    try:
        yield scope
    finally:
        _current.scope = previous


def current_scope() -> Scope | None:
    """The call this thread runs for a reward pool; None outside one."""
    return getattr(_current, "scope", None)


# --- async def: a task cancelled at the stop --------------------------------------------


def run_coroutine(awaitable: Awaitable[Any]) -> Any:
    """Run ``awaitable`` to its end on a new event loop (:func:`rlnb.runtime.block_on`:
    in this thread, or on a thread of its own when this one already runs a loop, as a
    notebook's does), closed before it returns; raises :class:`Cancelled` when the
    current scope is stopped first (the task is cancelled: an abandoned call leaves no
    loop, thread or FD behind)."""
    return block_on(_in_scope(current_scope(), awaitable))


async def _in_scope(scope: Scope | None, awaitable: Awaitable[Any]) -> Any:
    """:func:`cancellable` under ``scope``, the caller's: the loop may run on a thread of
    its own, and the same timeout must stop the call there."""
    with scope_of(scope) if scope is not None else contextlib.nullcontext():
        return await cancellable(awaitable)


async def cancellable(awaitable: Awaitable[Any]) -> Any:
    """Await ``awaitable`` in this task, cancelled when the current scope is stopped
    (raising :class:`Cancelled`). The scope is the one of the thread that runs the loop."""
    scope = current_scope()
    if scope is None:
        return await awaitable
    task, loop = asyncio.current_task(), asyncio.get_running_loop()
    assert task is not None

    def cancel() -> None:
        loop.call_soon_threadsafe(task.cancel)

    remove = scope.on_stop(cancel)
    try:
        return await awaitable
    except asyncio.CancelledError:
        if scope.stopped:
            raise Cancelled("the call was stopped: it ran past its timeout, or its caller gave up") from None
        raise
    finally:
        remove()


# --- isolated: a worker process killed at the stop --------------------------------------


class _Isolated:
    """What :func:`isolated` returns: ``fn``, called in a worker process from a reward pool."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        functools.update_wrapper(self, fn)  # __name__, __doc__, __wrapped__ (signatures follow it), marks

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        scope = current_scope()
        if scope is None or scope.workers is None:
            return self.__wrapped__(*args, **kwargs)
        return scope.workers.call(scope, self, args, kwargs)

    def __reduce__(self) -> str | tuple[Any, ...]:
        # As its module holds it (``@isolated def f``): by name, as pickle sends a function.
        module = sys.modules.get(self.__module__)
        if module is not None and getattr(module, self.__qualname__, None) is self:
            return self.__qualname__
        return (isolated, (self.__wrapped__,))

    def __repr__(self) -> str:
        return f"isolated({short_repr(self.__wrapped__)})"

    __wrapped__: Callable[..., Any]
    __module__: str
    __qualname__: str


def isolated(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` (a reward, or a tool or helper an environment calls) to run in a
    worker process when rlnb's reward pool calls it, where its timeout
    (``RolloutConfig.reward_timeout``) can stop it even if it holds the GIL or never
    returns: the process is killed at the deadline and another starts for the next
    call. Returns a callable that takes ``fn``'s arguments, name and signature::

        @rlnb.rewards.isolated
        def sympy_equal(completion, answer): ...

    A call costs a round trip to the process (about 0.1-0.3 ms) and ``fn``, its
    arguments and its result must pickle; ``fn`` must be importable by name, so
    define it in a module (a ``.py`` file), not in a notebook cell. An ``async def``
    ``fn`` runs to its end in the process. Called outside a rollout (in a cell, or
    by ``rescore``) it runs in the caller. ``math_answer`` and ``regex_format`` are
    isolated already.

    Raises :class:`~rlnb.ConfigError` when ``fn`` is not callable or a worker process
    could not import it (a lambda, a local function, or one defined in ``__main__``).
    """
    if isinstance(fn, _Isolated):
        return fn
    if not callable(fn):
        raise ConfigError(f"isolated({short_repr(fn)}) is invalid: pass a function, e.g. @rlnb.rewards.isolated")
    problem = _unimportable(fn)
    if problem is not None:
        raise ConfigError(
            f"isolated({short_repr(fn)}) is invalid: a worker process cannot import it ({problem}); "
            "define it at the top level of a module (a .py file next to the notebook) and import it from there"
        )
    return _Isolated(fn)


def _unimportable(fn: Any) -> str | None:
    """Why a worker process could not get ``fn`` (None: it can)."""
    if inspect.isroutine(fn) or isinstance(fn, type):
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if module in (None, "__main__"):
            return "it is defined in __main__ (a notebook cell or the script being run)"
        if "<" in qualname:  # <lambda>, <locals>
            return f"{qualname} is not a module-level name"
        return None
    finder = _MainFinder()
    try:
        finder.dump(fn)
    except Exception as exc:
        return f"it does not pickle: {exc!r}"
    return f"it refers to {', '.join(finder.found)} of __main__" if finder.found else None


class _MainFinder(pickle.Pickler):
    """Pickles to nowhere, noting the functions and classes of ``__main__`` it meets."""

    def __init__(self) -> None:
        import io

        super().__init__(io.BytesIO())
        self.found: dict[str, None] = {}

    def persistent_id(self, obj: Any) -> None:
        if isinstance(obj, type) or inspect.isfunction(obj):
            if getattr(obj, "__module__", None) == "__main__":
                self.found[obj.__qualname__] = None


class _Worker:
    """One worker process and our end of its pipe."""

    def __init__(self, ctx: Any) -> None:
        ours, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(theirs, START_METHOD), name="rlnb-isolated", daemon=True)
        try:
            with spawn_without_main():
                self.process.start()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the process holds its own copy: its death reads as EOF here
        self.conn: Connection = ours
        self.loaded: set[bytes] = set()  # the functions it has imported
        self._lock = threading.Lock()
        self._reaped = False

    def kill(self) -> None:
        """SIGKILL the process (from any thread, at once; a no-op once reaped)."""
        with self._lock:
            if not self._reaped:
                with contextlib.suppress(OSError, ValueError):
                    self.process.kill()

    def reap(self) -> int | None:
        """Kill the process, wait for it and close our end; its exit code."""
        self.kill()
        with self._lock:
            self._reaped = True
        self.process.join(5.0)
        self.conn.close()
        code = self.process.exitcode
        with contextlib.suppress(ValueError):  # still running 5 s after SIGKILL: nothing more to do
            self.process.close()
        return code

    def request(self, message: bytes, timeout: float | None) -> tuple[bool, Any]:
        """Send ``message``, wait for the reply (``timeout``: TimeoutError); EOFError
        or OSError when the process died or was killed."""
        self.conn.send_bytes(message)
        if timeout is not None and not self.conn.poll(timeout):
            raise TimeoutError
        ok, value, remote = pickle.loads(self.conn.recv_bytes())
        if remote is not None:  # an exception's __cause__ does not pickle: its traceback comes as text
            value.__cause__ = _RemoteTraceback(remote)
        return ok, value


class Workers:
    """The worker processes of one reward pool: each isolated call takes an idle one
    (or starts one), and gives it back when the call returns; a stopped call's process
    is killed. Thread-safe; :meth:`close` kills and reaps them all (contract 1)."""

    def __init__(self, *, max_idle: int = 1) -> None:
        self._max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._closed = False

    @property
    def alive(self) -> int:
        """Worker processes started and not yet reaped."""
        with self._lock:
            return len(self._idle) + len(self._busy)

    def call(self, scope: Scope, fn: _Isolated, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)`` in a worker process; blocks until it returns. Raises
        what it raises, :class:`Cancelled` when ``scope`` is stopped first (the process
        is killed), :class:`IsolatedError` when it cannot run there."""
        name = getattr(fn, "__name__", "the function")
        try:
            function = pickle.dumps(fn)
            message = pickle.dumps((function, args, kwargs))
        except Exception as exc:
            raise IsolatedError(f"isolated {name}() cannot be sent to its worker process: {exc!r}") from None
        worker = self._take(scope, function, name)
        remove = scope.on_stop(worker.kill)
        keep = False
        try:
            try:
                ok, value = worker.request(message, None)
            except (EOFError, OSError):
                if scope.stopped:
                    raise Cancelled(f"isolated {name}() was stopped: its worker process was killed") from None
                raise IsolatedError(
                    f"the worker process running isolated {name}() died (exit code {worker.reap()})"
                ) from None
            keep = not scope.stopped
        finally:
            remove()
            self._give_back(worker, keep)
        if ok:
            return value
        raise value

    def close(self) -> None:
        """Kill and reap every worker process; calls in progress raise :class:`Cancelled`
        (or their own error). Idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for worker in busy:  # its call's thread reaps it once it reads the EOF
            worker.kill()
        for worker in idle:
            worker.reap()

    def _take(self, scope: Scope, function: bytes, name: str) -> _Worker:
        """An idle worker that has imported ``function``, or a new one (neither counted
        against the call's timeout)."""
        with self._lock:
            if self._closed:
                raise Cancelled("the worker processes are closed")
            worker = self._idle.pop() if self._idle else None
            if worker is not None:
                self._busy.add(worker)
        if worker is not None and function in worker.loaded:
            return worker
        with scope.preparing():
            try:
                if worker is None:
                    worker = _Worker(_context())
                    with self._lock:
                        self._busy.add(worker)
                        closed = self._closed
                    if closed:
                        raise Cancelled("the worker processes are closed")
                remove = scope.on_stop(worker.kill)
                try:
                    # With this process's sys.path: a module beside the notebook, or added since the server started.
                    load = pickle.dumps((function, None, list(sys.path)))
                    ok, value = worker.request(load, PREPARE_TIMEOUT)
                finally:
                    remove()
            except BaseException as exc:
                if worker is not None:
                    self._give_back(worker, False)
                if scope.stopped:
                    raise Cancelled(f"isolated {name}() was stopped while its worker process started") from None
                if isinstance(exc, TimeoutError):
                    raise IsolatedError(
                        f"the worker process for isolated {name}() did not import it within {PREPARE_TIMEOUT:g} s"
                    ) from None
                if isinstance(exc, EOFError | OSError):
                    raise IsolatedError(f"the worker process for isolated {name}() died as it started") from None
                raise
        if not ok:
            self._give_back(worker, True)
            raise IsolatedError(f"a worker process cannot import isolated {name}(): {value}") from value
        worker.loaded.add(function)
        return worker

    def _give_back(self, worker: _Worker, keep: bool) -> None:
        with self._lock:
            self._busy.discard(worker)
            keep = keep and not self._closed and len(self._idle) < self._max_idle
            if keep:
                self._idle.append(worker)
        if not keep:
            worker.reap()


def _context() -> Any:
    """The multiprocessing context workers start with: the forkserver (workers fork
    from a clean server instead of this process, whose threads may hold locks)."""
    ctx = multiprocessing.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        from multiprocessing import forkserver

        # Takes effect only if the server is not running yet (another part may have
        # started it): then workers fork with this module imported.
        preload = getattr(forkserver._forkserver, "_preload_modules", None) or []
        if __name__ not in preload:
            ctx.set_forkserver_preload([*(m for m in preload if m != "__main__"), __name__])
    return ctx


# --- in the worker process --------------------------------------------------------------


def _serve(conn: Connection, start_method: str) -> None:
    """A worker process's loop: import a function, or call one, per message, until
    the pipe closes."""
    _die_with_parent(start_method)
    functions: dict[bytes, Any] = {}
    while True:
        try:
            function, args, kwargs = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            if args is None:  # load it, with the caller's sys.path (kwargs)
                sys.path.extend(p for p in kwargs if p not in sys.path)
            fn = functions.get(function)
            if fn is None:
                fn = functions[function] = pickle.loads(function)
            value = None
            if args is not None:
                value = fn(*args, **kwargs)
                if inspect.isawaitable(value):
                    value = block_on(value)
        except BaseException as exc:  # everything goes back to the caller
            data = _with_traceback(exc)
        else:
            try:
                data = pickle.dumps((True, value, None))
            except Exception as exc:
                error = IsolatedError(f"its result {short_repr(value)} cannot be sent back: {exc!r}")
                data = pickle.dumps((False, error, None))
        conn.send_bytes(data)


def _with_traceback(exc: BaseException) -> bytes:
    """``(False, exc, its traceback's text)`` pickled."""
    text = "\n(in the worker process)\n" + "".join(traceback.format_exception(exc))
    if not isinstance(exc, Exception):  # SystemExit and the like are not the caller's to get
        exc = RuntimeError(f"the call raised {exc!r}")
    try:
        return pickle.dumps((False, exc, text))
    except Exception:
        return pickle.dumps((False, IsolatedError(f"it raised {exc!r}"), text))


def _die_with_parent(start_method: str) -> None:
    """Ignore SIGINT (a notebook's interrupt signals the whole process group) and die
    when the parent does (``rlnb/data/_loader.py`` explains the forkserver's case)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if start_method == "forkserver":  # the parent is the server's main thread
        from multiprocessing import forkserver

        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

        server = forkserver._forkserver
        fd = getattr(server, "_forkserver_alive_fd", None)
        if fd is not None:  # while we hold the server's "alive" pipe it outlives our parent
            server._forkserver_alive_fd = None  # type: ignore[attr-defined]
            os.close(fd)
        parent = multiprocessing.parent_process()
        if parent is None or not parent.is_alive():
            os._exit(1)
    # spawn: PDEATHSIG follows the thread that started us (a pool thread that ends when
    # idle), not the process; multiprocessing terminates daemon workers at exit.

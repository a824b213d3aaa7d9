"""The prompt pipeline: a task's prompt stream served by torchdata's ``StatefulDataLoader``.

Worker ``w`` of ``n`` makes prompts ``w, w + n, w + 2n, ...`` and the loader reads
its workers in order, so the stream is ``0, 1, 2, ...`` whatever ``num_workers``
is, and its ``state_dict()`` resumes it at exactly the next prompt.

**Start method** (docs/processes.md has the figures). Workers start with
``forkserver`` (:data:`DEFAULT_START_METHOD`), not ``fork``. A notebook kernel
always has other threads, and torch's own worker loop makes torch calls before
ours run: ``torch.manual_seed`` takes the default generator's mutex, so a worker
forked while another thread draws random numbers can wait on that mutex forever,
and the loader with it. The forkserver is a fresh, single-threaded interpreter
that imports this module (and torch) once and never runs torch work; workers are
forked from it. Start to first prompt, one worker, on a busy 2-core machine:
``fork`` 0.03 s; ``forkserver`` 3.0 s for the first loader in a process (the
server imports torch), 0.07 s after; ``spawn`` 2.7 s every time, and 0.7 s to
close (the others: 0.01 s). :func:`warm_up_workers` starts the server early. Our own
code in a worker is plain Python (the task's ``make_prompt``, or its records), and
only :class:`PromptItem` and dicts of ints cross back, never a tensor. A worker gets
what makes the task's prompts (:meth:`Task.prompt_source`: the records, or
``make_prompt``), never its reward functions, and must import the functions it gets:
a ``make_prompt`` defined in a notebook cell makes its prompts in the kernel instead,
with one line on stdout that says so.

**The main script.** A worker never imports ``__main__``: with ``forkserver`` and
``spawn`` multiprocessing would run the caller's script again in each worker (as
``__mp_main__``), and a script without an ``if __name__ == "__main__":`` guard would
then build another session there and fail the loader. A task whose functions are
defined in the main script therefore makes its prompts in this process, with a
warning that says why; tasks defined in modules keep their workers.

The forkserver and multiprocessing's resource tracker are process-long helpers
of the standard library: started on first use, shared with the rest of the
process, gone when it exits (also on SIGKILL).

Workers follow contract 8:

- they ignore SIGINT (a notebook's interrupt signals the whole process group);
- they get SIGKILL when their parent ends (``PR_SET_PDEATHSIG``). A forkserver
  worker's parent is the forkserver, which exits with this process once the
  workers have dropped their copies of its "alive" pipe, so they die with this
  process whichever thread built the loader. ``fork`` and ``spawn`` workers die
  with the thread that started them, so they get it only when started from the
  main thread; torch's own watchdog ends them otherwise;
- :meth:`PromptLoader.close` shuts them down explicitly: StatefulDataLoader
  keeps its last iterator, so leaving it to the garbage collector leaves them
  running.

A worker that dies (killed, out of memory) fails the loader as a whole: the next
``next()`` raises :class:`PromptLoaderError`, and so does every later one.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import io
import multiprocessing
import multiprocessing.spawn
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import types
import warnings
from collections.abc import Iterator
from multiprocessing.context import BaseContext
from typing import Any

import psutil
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from rlnb._errors import ClosedError, ConfigError, PromptError, RlnbError
from rlnb._samples import PromptItem
from rlnb.data._config import DataConfig
from rlnb.data._records import PromptSource
from rlnb.data._tasks import Task
from rlnb.runtime import spawn_without_main

__all__ = ["DEFAULT_START_METHOD", "PromptLoader", "PromptLoaderError", "PromptStream", "warm_up_workers"]

_PR_SET_PDEATHSIG = 1
SNAPSHOT_EVERY = 64

DEFAULT_START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
"""How :func:`warm_up_workers` starts the forkserver unless told otherwise."""

_DEFAULT = DataConfig()  # what a loader built by hand gets; its defaults are DataConfig's


class PromptLoaderError(RlnbError, RuntimeError):
    """The prompt loader failed as a whole: a worker process died. Every later
    ``next()`` raises it again; close the session and make a new one."""


class PromptStream(IterableDataset["PromptItem | BadPrompt"]):
    """A task's endless prompt stream, sharded over loader workers, with a state. A
    prompt whose ``make_prompt`` raised comes as a :class:`BadPrompt` in its place."""

    def __init__(self, task: Task | PromptSource, seed: int) -> None:
        # Only what makes the prompts goes to the workers, never the reward functions.
        self.source = task.prompt_source() if isinstance(task, Task) else task
        self.seed = seed
        self._next: int | None = None  # the next prompt id this copy (worker) makes

    def __iter__(self) -> Iterator[PromptItem | BadPrompt]:
        info = get_worker_info()
        worker, stride = (info.id, info.num_workers) if info is not None else (0, 1)
        i = self._next if self._next is not None else worker
        while True:
            self._next = i + stride
            try:
                item: PromptItem | BadPrompt = self.source.item(self.seed, i)
            except Exception as exc:  # one bad prompt must not end the stream (a generator that raises is over)
                item = BadPrompt(i, _describe(exc))
            yield item
            i += stride

    def state_dict(self) -> dict[str, Any]:
        return {"next": self._next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._next = state["next"]


@dataclasses.dataclass(frozen=True)
class BadPrompt:
    """What a worker sends for a prompt whose ``make_prompt`` raised (the exception
    itself may not cross processes): its id and a description with the user's line."""

    prompt_id: int
    error: str

    def exception(self, task: str, maker: str = "make_prompt") -> PromptError:
        """The error to raise; ``maker``: what made the prompt (a task made from records has no make_prompt)."""
        return PromptError(
            f"the {task!r} task's {maker} raised for prompt {self.prompt_id}: {self.error}; the stream goes on "
            'with the next prompt (DataConfig(on_bad_prompt="skip") skips such prompts instead)',
            prompt_id=self.prompt_id,
        )


def _describe(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ is not None else []
    at = f" (at {where[0].filename}:{where[0].lineno}, in {where[0].name})" if where else ""
    return f"{exc!r}{at}"


def _keep(item: PromptItem) -> PromptItem:
    """The collate function: items cross as they are (torch's default would convert them)."""
    return item


def _init_worker(start_method: str, die_with_parent: bool, parent_pid: int, worker_id: int) -> None:
    """Runs in each worker process, after torch's own set-up, before its first prompt."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if start_method == "forkserver":
        # The parent is the forkserver, which cannot exit while we hold its "alive"
        # pipe: set PDEATHSIG first, then drop our copy, so this process's exit ends it.
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        _drop_forkserver_alive_fd()
        session = multiprocessing.parent_process()
        if session is None or not session.is_alive():  # it died before the pipe was its alone
            os._exit(1)
    elif die_with_parent:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)


def _drop_forkserver_alive_fd() -> None:
    from multiprocessing import forkserver

    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)  # set in each child the server forks
    if fd is not None:
        server._forkserver_alive_fd = None  # type: ignore[attr-defined]
        os.close(fd)


def warm_up_workers(start_method: str = DEFAULT_START_METHOD) -> None:
    """Start the process-long helpers ``start_method`` needs, if not running yet.

    ``forkserver``: the server (which then imports this module, and torch, in the
    background) and multiprocessing's resource tracker; ``spawn``: the tracker;
    ``fork``: nothing. They are shared with the rest of the process and exit with
    it. Returns at once; the first loader waits for the server's imports. A leak
    check calls this first so that these helpers are not counted against it.
    """
    if start_method == "fork":
        return
    _context(start_method)
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()
    if start_method == "forkserver":
        forkserver.ensure_running()


def _context(start_method: str) -> BaseContext:
    """The multiprocessing context for ``start_method``."""
    if start_method != "forkserver":
        return multiprocessing.get_context(start_method)
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    # Workers then fork with torch imported instead of importing it each (seconds).
    # Not __main__ (the default): a script's module-level code, threads and all, would
    # run in the server (and workers do not import it either: spawn_without_main).
    # Takes effect when the server starts.
    preload = getattr(forkserver._forkserver, "_preload_modules", None) or []
    ctx.set_forkserver_preload([*(m for m in preload if m not in ("__main__", __name__)), __name__])
    return ctx


class _MainFinder(pickle.Pickler):
    """Pickles to nowhere, noting the functions and classes of ``__main__`` that the
    object refers to (pickle sends those by name, for the receiver to import)."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO())
        self.found: dict[str, None] = {}  # their names, in the order met

    def persistent_id(self, obj: Any) -> None:
        if isinstance(obj, type | types.FunctionType) and obj.__module__ == "__main__":
            self.found[obj.__qualname__] = None
        return None  # pickle it as usual


_SENDABLE_FIX = (
    "define the task's functions at the top level of a module (a .py file), or make its prompts "
    "in this process with DataConfig(num_workers=0)"
)


def _workers_for(task: Task, start_method: str, num_workers: int) -> int:
    """How many workers to start for ``task``: ``num_workers``, or 0 (prompts made in this
    process, said on stdout or in a warning) if what makes its prompts refers to
    functions defined in the main script, a notebook cell or the REPL. Only that part
    goes to the workers (:meth:`Task.prompt_source`): a task made from records needs
    none of its functions there.

    Raises ConfigError for a task that no worker can rebuild: a lambda, or a function
    defined inside another."""
    finder = _MainFinder()
    try:
        finder.dump(task.prompt_source())
    except Exception as exc:  # a lambda, or a function defined inside another; or a record's value
        if task.records is not None and (value := task.records.unpicklable()) is not None:
            raise ConfigError(
                f"task {task.name!r} cannot be sent to a {start_method!r} prompt-loader worker: {value}; give "
                "records of data (strings, numbers, lists and dicts), or make its prompts in this process with "
                "DataConfig(num_workers=0)"
            ) from exc
        raise ConfigError(
            f"task {task.name!r} cannot be sent to a {start_method!r} prompt-loader worker, which imports "
            f"what it runs ({exc}): {_SENDABLE_FIX}"
        ) from exc
    if not finder.found:
        return num_workers
    *others, last = finder.found
    names = f"{', '.join(others)} and {last} are" if others else f"{last} is"
    main = sys.modules.get("__main__")
    if getattr(main, "__file__", None) is None and getattr(main, "__spec__", None) is None:
        # A notebook cell: nothing to fix, the prompts are made here (a slow make_prompt
        # then runs between rollouts; a module keeps it in workers).
        print(
            f"rlnb: task {task.name!r} makes its prompts in this process, not in loader workers: its {names} "
            "defined in this notebook, which a worker cannot import (define them in a .py module to use workers)",
            flush=True,
        )
        return 0
    # A worker would import them by running the whole script again: without an
    # ``if __name__ == "__main__":`` guard, another session with its own workers.
    warnings.warn(
        f"rlnb: task {task.name!r} makes its prompts in this process, not in loader workers: its {names} "
        "defined in the main script, which a worker would have to run again to import; to use workers, move "
        "them into a module (a .py file), or set DataConfig(num_workers=0) to say this is meant",
        stacklevel=_caller_outside_rlnb(),
    )
    return 0


def _caller_outside_rlnb() -> int:
    """The ``stacklevel`` (for the function that calls this) of its first caller outside rlnb."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _exited(worker: Any, procs: dict[int, psutil.Process]) -> bool:
    """Whether ``worker`` has exited. A forkserver worker's exit code comes from the
    server only once it has reaped the worker, so look at the process itself too."""
    if not worker.is_alive():
        return True
    try:
        proc = procs.get(worker.pid) or procs.setdefault(worker.pid, psutil.Process(worker.pid))
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class PromptLoader:
    """An iterator of :class:`PromptItem` over a :class:`PromptStream`.

    ``config`` (a :class:`DataConfig`; its ``num_workers``, ``prefetch_factor`` and
    ``multiprocessing_context`` are read): ``num_workers=0`` makes prompts in the
    calling process. Workers start here, in the constructor, which blocks until each
    is up; ``multiprocessing_context`` is the start method (None: the platform's default).
    ``state_dict``/``load_state_dict`` save and restore the position (JSON-safe);
    ``close()`` stops the workers and is idempotent. Use it from one thread at a time.

    Workers never import the main script; a task whose ``make_prompt`` is defined
    there, or in a notebook cell, makes its prompts in this process (``num_workers``
    is then 0), with a warning (a script) or a line on stdout (a notebook).

    Raises :class:`~rlnb.ConfigError` for a ``config`` that is not a ``DataConfig``,
    a saved state of another worker count, or a task that a ``forkserver`` or
    ``spawn`` worker cannot rebuild (a lambda).
    ``next()`` raises :class:`~rlnb.PromptError` for a prompt
    whose ``make_prompt`` raised (the next call goes on with the next prompt), and
    :class:`PromptLoaderError` once a worker has died.
    """

    def __init__(
        self,
        task: Task,
        config: DataConfig = _DEFAULT,
        *,
        seed: int,
        state: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(config, DataConfig):
            raise ConfigError(
                f"PromptLoader(config={config!r}) takes a rlnb.DataConfig, got {type(config).__name__}: "
                "e.g. PromptLoader(task, rlnb.DataConfig(num_workers=2), seed=0)"
            )
        num_workers = config.num_workers
        self._closed = False
        self._task_name = task.name
        self._maker = "make_prompt" if task.records is None else "record reader"
        self._failure: str | None = None  # why every next() fails, once a worker died
        self._procs: dict[int, psutil.Process] = {}  # the workers, as psutil sees them
        self.start_method = config.multiprocessing_context or multiprocessing.get_start_method()
        if num_workers > 0 and self.start_method != "fork":
            num_workers = _workers_for(task, self.start_method, num_workers)
        self.num_workers = num_workers
        with warnings.catch_warnings():  # torchdata 0.11 calls torch's deprecated set_vital
            warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
            self._loader = self._make_loader(task, seed, num_workers, config.prefetch_factor)
        if state is not None:
            self._check_state(state)
            self._loader.load_state_dict(state["loader"])
        with spawn_without_main():  # the workers start here
            self._iterator: Iterator[PromptItem] | None = iter(self._loader)

    def _make_loader(self, task: Task, seed: int, num_workers: int, prefetch_factor: int) -> StatefulDataLoader:
        if num_workers > 0:
            die_with_parent = threading.current_thread() is threading.main_thread()
            init = functools.partial(_init_worker, self.start_method, die_with_parent, os.getpid())
        return StatefulDataLoader(
            PromptStream(task, seed),
            batch_size=None,
            collate_fn=_keep,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            persistent_workers=num_workers > 0,
            worker_init_fn=init if num_workers > 0 else None,
            multiprocessing_context=_context(self.start_method) if num_workers > 0 else None,
            # A snapshot per item costs more than making the prompts; loading replays
            # at most this many from the last snapshot.
            snapshot_every_n_steps=SNAPSHOT_EVERY,
        )

    def _check_state(self, state: dict[str, Any]) -> None:
        saved = state.get("num_workers")
        if saved != self.num_workers:
            raise ConfigError(
                f"the saved prompt-loader state is for DataConfig.num_workers={saved}, not {self.num_workers}: "
                f"load it with num_workers={saved}"
            )

    def __iter__(self) -> PromptLoader:
        return self

    def __next__(self) -> PromptItem:
        """The next prompt; blocks while the workers make it (they keep some ready)."""
        if self._iterator is None:
            raise ClosedError("the prompt loader is closed")
        self._failure = self._failure or self._dead_worker()
        if self._failure is not None:
            raise PromptLoaderError(self._failure)
        try:
            item: PromptItem | BadPrompt = next(self._iterator)
        except RuntimeError as exc:  # torch's "DataLoader worker ... exited unexpectedly"
            self._failure = self._dead_worker()
            if self._failure is None:
                raise
            raise PromptLoaderError(self._failure) from exc
        if isinstance(item, BadPrompt):
            raise item.exception(self._task_name, self._maker)
        return item

    def _dead_worker(self) -> str | None:
        """What to say of a worker that has exited, if one has. The items it queued
        before it died are not served: the stream would have a hole where its next ones go."""
        for w in getattr(self._loader._iterator, "_workers", []):
            if not _exited(w, self._procs):
                continue
            w.join(1.0)  # a forkserver worker's exit code follows once the server has reaped it
            code = w.exitcode
            how = "exited" if code is None else f"exit code {code}" if code >= 0 else signal.Signals(-code).name
            return (
                f"the prompt loader's worker process {w.pid} died ({how}); no more prompts can come from "
                "this loader: close the session and make a new one (or load its last checkpoint)"
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands: the next ``next()`` after loading this gives the
        prompt the next ``next()`` here would have."""
        return {"num_workers": self.num_workers, "loader": self._loader.state_dict()}

    def worker_pids(self) -> list[int]:
        """The worker processes' pids (empty with ``num_workers=0``)."""
        workers = getattr(self._loader._iterator, "_workers", [])
        return [w.pid for w in workers if w.pid is not None]

    def close(self, timeout: float | None = None) -> None:
        """Stop the workers (joined, then terminated if they linger). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._iterator = None
        iterator, self._loader._iterator = self._loader._iterator, None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is None:
            return
        shutdown()
        # torch closes its index queues without joining their feeder threads (a
        # dead worker could leave one blocked); join them, bounded, so none is
        # still running when close() returns.
        deadline = time.monotonic() + (1.0 if timeout is None else timeout)
        for queue in getattr(iterator, "_index_queues", []):
            feeder = getattr(queue, "_thread", None)
            if feeder is not None:
                feeder.join(max(0.0, deadline - time.monotonic()))

"""The prompt pipeline: a task's prompt stream served by torchdata's ``StatefulDataLoader``.

Worker ``w`` of ``n`` makes prompts ``w, w + n, w + 2n, ...`` and the loader reads
its workers in order, so the stream is ``0, 1, 2, ...`` whatever ``num_workers``
is, and its ``state_dict()`` resumes it at exactly the next prompt.

Workers are children of this process, so they follow contract 8:

- they ignore SIGINT (a notebook's interrupt signals the whole process group);
- they get SIGKILL when the thread that started them ends (``PR_SET_PDEATHSIG``;
  only when started from the main thread, which lives as long as the process),
  and torch's own watchdog ends them within seconds otherwise;
- :meth:`PromptLoader.close` shuts them down explicitly: StatefulDataLoader
  keeps its last iterator, so leaving it to the garbage collector leaves them
  running.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from rlnb._errors import ConfigError
from rlnb._samples import PromptItem
from rlnb.data._tasks import Task

__all__ = ["PromptLoader", "PromptStream"]

_PR_SET_PDEATHSIG = 1
SNAPSHOT_EVERY = 64


class PromptStream(IterableDataset[PromptItem]):
    """A task's endless prompt stream, sharded over loader workers, with a state."""

    def __init__(self, task: Task, seed: int) -> None:
        self.task = task
        self.seed = seed
        self._next: int | None = None  # the next prompt id this copy (worker) makes

    def __iter__(self) -> Iterator[PromptItem]:
        info = get_worker_info()
        worker, stride = (info.id, info.num_workers) if info is not None else (0, 1)
        i = self._next if self._next is not None else worker
        while True:
            self._next = i + stride
            yield self.task.item(self.seed, i)
            i += stride

    def state_dict(self) -> dict[str, Any]:
        return {"next": self._next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._next = state["next"]


def _keep(item: PromptItem) -> PromptItem:
    return item


def _init_worker(die_with_parent: bool, parent_pid: int, worker_id: int) -> None:
    """Runs first in each worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if die_with_parent and sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)


class PromptLoader:
    """An iterator of :class:`PromptItem` over a :class:`PromptStream`.

    ``num_workers=0`` makes prompts in the calling process. Workers start here, in
    the constructor. ``state_dict``/``load_state_dict`` save and restore the
    position (JSON-safe); ``close()`` stops the workers and is idempotent. Use it
    from one thread at a time.
    """

    def __init__(
        self,
        task: Task,
        *,
        seed: int,
        num_workers: int = 1,
        prefetch_factor: int = 4,
        multiprocessing_context: str | None = None,
        state: dict[str, Any] | None = None,
    ) -> None:
        self.num_workers = num_workers
        with warnings.catch_warnings():  # torchdata 0.11 calls torch's deprecated set_vital
            warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
            self._loader = self._make_loader(task, seed, num_workers, prefetch_factor, multiprocessing_context)
        if state is not None:
            self._check_state(state)
            self._loader.load_state_dict(state["loader"])
        self._iterator: Iterator[PromptItem] | None = iter(self._loader)
        self._closed = False

    @staticmethod
    def _make_loader(
        task: Task, seed: int, num_workers: int, prefetch_factor: int, multiprocessing_context: str | None
    ) -> StatefulDataLoader:
        die_with_parent = threading.current_thread() is threading.main_thread()
        return StatefulDataLoader(
            PromptStream(task, seed),
            batch_size=None,
            collate_fn=_keep,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            persistent_workers=num_workers > 0,
            worker_init_fn=functools.partial(_init_worker, die_with_parent, os.getpid()) if num_workers > 0 else None,
            multiprocessing_context=multiprocessing_context if num_workers > 0 else None,
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
        if self._iterator is None:
            raise RuntimeError("the prompt loader is closed")
        return next(self._iterator)

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

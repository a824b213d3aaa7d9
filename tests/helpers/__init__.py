"""What the tests share, in one place; never import from a test module.

This module holds the in-process helpers and the small config most tests use.
What starts a process has a module of its own, and tests reach it through the
fixtures of tests/conftest.py, which mark their tier (``tiers.py``): a Jupyter
kernel (``kernel.py``), a notebook run by nbclient (``notebooks.py``), JupyterLab
and Chromium (``browser.py``), Ray (``ray_cluster.py``), Python scripts and the CLI
(``processes.py``).
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import inspect
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import psutil
import pytest

import rlnb
from rlnb.data import get_task
from rlnb.engines import EngineStatistics, GenerateRequest, GenerateResult, PauseMode, TinyEngine
from rlnb.learn import Callback
from rlnb.models import CharTokenizer, TinyPolicy
from rlnb.rollout import RolloutStatistics


def small_config(**changes: Any) -> rlnb.Config:
    """The small config most tests run: a one-layer policy of width 32, four groups
    of four samples a step, prompts made in-process (no loader workers); ``changes``
    replace whole parts or fields, as ``rlnb.Config``'s arguments."""
    parts: dict[str, Any] = {
        "model": rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
        "rollout": rlnb.RolloutConfig(group_size=4, groups_per_step=4),
        "data": rlnb.DataConfig(num_workers=0),
    }
    return rlnb.Config(**{**parts, **changes})


@contextlib.contextmanager
def ctrl_c_once(started: threading.Event, *, timeout: float = 10.0, trip_only: bool = False) -> Iterator[None]:
    """Press Ctrl-C (SIGINT to the main thread, as the notebook's stop button does)
    once ``started`` is set, and expect the block to raise KeyboardInterrupt.

    ``trip_only`` instead trips SIGINT's handler with ``_thread.interrupt_main()``
    a moment later, with no signal: nothing interrupts a blocking wait, as when a
    real Ctrl-C lands just before the main thread starts to block."""

    ended = threading.Event()  # the block is over: a press now would hit pytest itself

    def press() -> None:
        if not started.wait(timeout) or ended.is_set():
            return
        if trip_only:
            time.sleep(0.05)  # let the main thread block first
            if not ended.is_set():
                _thread.interrupt_main()
        else:
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    presser = threading.Thread(target=press, name="press-ctrl-c")
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            try:
                yield
            finally:
                ended.set()
    finally:
        presser.join()


def cause_chain(error: BaseException) -> list[BaseException]:
    """``error``, its ``__cause__``, that one's cause, and so on."""
    chain = []
    current: BaseException | None = error
    while current is not None:
        chain.append(current)
        current = current.__cause__
    return chain


def assert_counts_add_up(s: RolloutStatistics) -> None:
    """Every dispatched sample is finished, kept partial, failed, cancelled or in flight."""
    assert s.dispatched == s.finished + s.kept_partial + s.failed + s.cancelled + s.in_flight, s
    assert min(s.finished, s.kept_partial, s.failed, s.cancelled, s.in_flight) >= 0, s


# Timing figures differ from run to run. The rest match up to float rounding: the
# engine batches requests as they arrive, and a matmul over another batch size may
# round its last bits differently (the sampled tokens are the same).
TIMING_METRICS = frozenset({"train_tokens_per_s"})


def assert_same_metrics(got: list[dict[str, float]], expected: list[dict[str, float]]) -> None:
    assert len(got) == len(expected), f"{len(got)} steps, expected {len(expected)}"
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        a = {k: v for k, v in a.items() if k not in TIMING_METRICS}
        b = {k: v for k, v in b.items() if k not in TIMING_METRICS}
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6), f"step {step} differs"


def wait_until(
    predicate: Callable[[], bool], what: str | Callable[[], str], timeout: float = 20.0, *, every: float = 0.005
) -> None:
    """Wait for ``predicate``, asked every ``every`` seconds on an Event; the deadline
    only turns a hang into a failure, which says ``what`` was waited for (a callable
    is asked then, so that it can say what was seen instead)."""
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what() if callable(what) else what}")
        tick.wait(every)


async def wait_until_async(
    predicate: Callable[[], bool | Awaitable[bool]], what: str, timeout: float = 20.0, *, every: float = 0.001
) -> None:
    """:func:`wait_until` on the running loop, for a coroutine: poll ``predicate``
    (which may return an awaitable, such as a question to an engine) every ``every``
    seconds; the deadline only turns a hang into a failure."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout

    async def holds() -> bool:
        answer = predicate()
        return bool(await answer) if inspect.isawaitable(answer) else bool(answer)

    while not await holds():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(every)


def exited(proc: psutil.Process) -> bool:
    """Whether ``proc`` has exited: gone, or a zombie (also when it goes while we look)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def left_on_disk(procs: Sequence[psutil.Process]) -> set[str]:
    """What killing an engine's ``procs`` would leave on disk: the Unix sockets they
    bound (and the directory they are in) and the shared memory they map. Checks that
    there is some: vLLM's ipc:// endpoints and its message queues' buffers."""
    sockets = {c.laddr for p in procs for c in p.net_connections(kind="unix") if isinstance(c.laddr, str) and c.laddr}
    shm = {m.path for p in procs for m in p.memory_maps() if m.path.startswith("/dev/shm/")}
    assert sockets and shm, (sockets, shm)
    return sockets | shm | {os.path.dirname(s) for s in sockets if "/rlnb-vllm-" in s}


def still_there(paths: set[str]) -> list[str]:
    return sorted(p for p in paths if os.path.lexists(p))


def guard_processes() -> set[int]:
    """The pids of this process's engine guard processes (``rlnb/engines/_guard.py``)."""
    return {p.pid for p in psutil.Process().children() if "_guard.py" in " ".join(p.cmdline())}


def no_wandb_left() -> None:
    """No wandb-core process and no wandb thread outlives the run."""
    cores = [p for p in psutil.Process().children(recursive=True) if "wandb-core" in " ".join(p.cmdline())]
    _, alive = psutil.wait_procs(cores, timeout=3)
    assert not alive, f"wandb-core outlived close(): {alive}"
    threads = [t.name for t in threading.enumerate() if "wandb" in t.name.lower() or "otel" in t.name.lower()]
    assert not threads, f"wandb threads outlived close(): {threads}"


def press_ctrl_c() -> None:
    """SIGINT to the main thread, as the notebook's stop button sends it."""
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


class HookedEngine:
    """A real :class:`TinyEngine` for ``config`` (the session's policy shape and seed)
    whose ``generate`` and ``update_weights`` first await the hooks a test sets:
    ``before_generate(request)`` and ``before_update(version)``. Give it to a session
    with ``rlnb.Session(config, engine=HookedEngine(config))``; the session owns it."""

    def __init__(self, config: rlnb.Config, *, name: str = "rlnb-test-engine") -> None:
        tokenizer = CharTokenizer(get_task(config.task).alphabet)
        policy = TinyPolicy(config.model.replace(vocab_size=tokenizer.vocab_size), seed=config.seed)
        self.inner = TinyEngine(policy, config.engine, eos_id=tokenizer.EOS, name=name)
        self.before_generate: Callable[[GenerateRequest], Awaitable[None]] | None = None
        self.before_update: Callable[[int], Awaitable[None]] | None = None

    def slow_down(self, delay: float) -> threading.Event:
        """Make every generate wait ``delay`` s first; the event is set once one has started."""
        started = threading.Event()

        async def slow(request: GenerateRequest) -> None:
            started.set()
            await asyncio.sleep(delay)

        self.before_generate = slow
        return started

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.before_generate is not None:
            await self.before_generate(request)
        return await self.inner.generate(request)

    async def update_weights(self, state: Mapping[str, Any], version: int) -> None:
        if self.before_update is not None:
            await self.before_update(version)
        await self.inner.update_weights(state, version)

    async def abort(self, request_ids: list[str]) -> None:
        await self.inner.abort(request_ids)

    async def pause(self, mode: PauseMode | str = PauseMode.KEEP) -> None:
        await self.inner.pause(mode)

    async def resume(self) -> None:
        await self.inner.resume()

    def statistics(self) -> EngineStatistics:
        return self.inner.statistics()

    def close(self, timeout: float | None = None) -> None:
        self.inner.close(timeout)


class Recorder(Callback):
    """Records the prompt ids of every batch trained on, and its metrics."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.metrics: list[dict[str, float]] = []
        self._batch: list[int] = []

    def on_batch(self, groups: Sequence[rlnb.Group]) -> None:
        self._batch = [g.prompt_id for g in groups]

    def on_step_end(self, metrics: Mapping[str, float]) -> None:
        self.batches.append(self._batch)
        self.metrics.append(dict(metrics))


class Hooks(Callback):
    """Callbacks a test sets per hook: ``on_batch`` and ``on_step_end`` attributes."""

    def __init__(self) -> None:
        self.batch: Callable[[Sequence[rlnb.Group]], None] | None = None
        self.step_end: Callable[[Mapping[str, float]], None] | None = None

    def on_batch(self, groups: Sequence[rlnb.Group]) -> None:
        if self.batch is not None:
            self.batch(groups)

    def on_step_end(self, metrics: Mapping[str, float]) -> None:
        if self.step_end is not None:
            self.step_end(metrics)


class Ticker:
    """A thread that counts while the block runs: it stops counting if anything holds the GIL."""

    def __init__(self) -> None:
        self.ticks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-ticker")

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.ticks += 1

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

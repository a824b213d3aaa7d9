"""``rlnb bench bridge``: the per-call cost of ``sess.bridge.run(noop())``.

Measured against, in the same run and interleaved round by round:

- the floor: a plain thread handoff through a ``concurrent.futures.Future`` to a
  worker thread waiting on a queue;
- a fresh event loop and thread per call, closed properly (what the bridge
  replaces);
- for reference, ``asyncio.run`` per call and ``run_coroutine_threadsafe`` on a
  plain shared asyncio loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rlnb.bench._common import BenchResult, Target, median, p99, time_calls_us
from rlnb.runtime import snapshot
from rlnb.session import Session


async def _noop() -> None:
    return None


@contextmanager
def _handoff_worker() -> Iterator[Callable[[], None]]:
    jobs: queue.SimpleQueue[concurrent.futures.Future[None] | None] = queue.SimpleQueue()

    def work() -> None:
        while (fut := jobs.get()) is not None:
            fut.set_result(None)

    worker = threading.Thread(target=work, name="bench-handoff")
    worker.start()

    def call() -> None:
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        jobs.put(fut)
        fut.result()

    try:
        yield call
    finally:
        jobs.put(None)
        worker.join()


def _loop_per_call() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(_noop(),))
    thread.start()
    thread.join()
    loop.close()


def _asyncio_run() -> None:
    asyncio.run(_noop())


@contextmanager
def _plain_shared_loop() -> Iterator[Callable[[], None]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="bench-shared-loop")
    thread.start()
    try:
        yield lambda: asyncio.run_coroutine_threadsafe(_noop(), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def _fd_growth(sess: Session, calls: int) -> int:
    """FDs gained over ``calls`` bridge calls with the garbage collector off."""
    gc.collect()
    gc.disable()
    try:
        before = snapshot().num_fds
        for _ in range(calls):
            sess.bridge.run(_noop())
        return snapshot().num_fds - before
    finally:
        gc.enable()


def run(*, rounds: int = 5, calls: int = 2000, slow_calls: int = 200) -> BenchResult:
    """Measure; blocks for a few seconds."""
    samples: dict[str, list[float]] = {k: [] for k in ("handoff", "bridge", "loop_per_call", "asyncio_run", "shared")}
    with Session(name="bench-bridge") as sess, _handoff_worker() as handoff, _plain_shared_loop() as shared:
        bridge_call = lambda: sess.bridge.run(_noop())  # noqa: E731
        bridge_call()  # start the loop thread outside the timing
        for _ in range(rounds):
            samples["handoff"] += time_calls_us(handoff, calls)
            samples["bridge"] += time_calls_us(bridge_call, calls)
            samples["shared"] += time_calls_us(shared, calls)
            samples["loop_per_call"] += time_calls_us(_loop_per_call, slow_calls)
            samples["asyncio_run"] += time_calls_us(_asyncio_run, slow_calls)
        fd_growth = _fd_growth(sess, 1000)
        loop_kind = _loop_kind(sess)
    med = {k: median(v) for k, v in samples.items()}
    figures: dict[str, object] = {f"{k}_median_us": v for k, v in med.items()}
    figures["bridge_p99_us"] = p99(samples["bridge"])
    figures["fd_growth_1000_calls"] = fd_growth
    figures["event_loop"] = loop_kind
    figures["cpus"] = os.cpu_count()
    return BenchResult(
        "bridge",
        figures,
        (
            Target("bridge_over_handoff", med["bridge"] / med["handoff"], "<=", 3.0, "x"),
            Target("loop_per_call_over_bridge", med["loop_per_call"] / med["bridge"], ">=", 2.5, "x"),
            Target("fd_growth_1000_calls", float(fd_growth), "<=", 0.0),
        ),
    )


def _loop_kind(sess: Session) -> str:
    loop = sess.bridge._loop
    return type(loop).__module__.split(".")[0] if loop is not None else "not started"

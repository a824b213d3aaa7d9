"""``rlnb bench soak``: a session made and closed over and over leaves nothing behind.

One cycle is what a person does when they re-run a notebook from the top:
``Session(config, name="soak")`` → ``rollout(1)`` → ``rollouts.pause()`` → ``rollouts.resume()`` →
``step()`` → ``close()``. Four variants, each in its own series in this process:
sync and async mode, each with the prompts made in this process (``num_workers=0``)
and by one torchdata worker process (``num_workers=1``, forked and shut down every
cycle). The sizes are tiny (2 prompts x 2 completions of at most 4 tokens, a
one-layer policy) so that a cycle costs tens of milliseconds and a series measures
the lifecycle, not the model. In async mode ``step()`` starts background rollouts,
so every async close stops generation that is still in flight.

After ``warmup`` cycles (first imports, torch's allocator and thread pool, lazily
made caches) a baseline is taken; after the last cycle, the growth since then:

- open FDs, Python threads, OS threads (those that torch or other C code starts
  included) and child processes (zombies included: an unreaped child is a leak
  too). The target for each is 0. The counts are read again for up to
  :data:`SETTLE_S` seconds while they are above the baseline, since a worker
  that was told to exit may take a moment to be reaped.
- the same counts right after each ``close()`` returns, read at once: the largest
  growth seen is ``*_peak_growth``. ``close()`` joins every thread and worker it
  owns, so the target for FDs, Python threads and children is 0 here too: a part
  that lets its thread wind down on its own after ``close()`` misses it even when
  the end counts are back at the baseline. OS threads are printed, not judged:
  ``Thread.join()`` returns before the OS thread has quite exited.
- resident memory, measured after ``gc.collect()`` and glibc's ``malloc_trim(0)``
  (where the C library is glibc). Without the trim, RSS measures the allocator's
  habits rather than rlnb: every cycle's threads free what they used into
  malloc's per-thread arenas, which keep the pages, so the untrimmed figure
  swings by tens of MiB either way from one series to the next (printed as
  ``*_rss_untrimmed_growth_mib``), while the bytes malloc has handed out and not
  had back stay flat (``*_heap_growth_mib``). The allowance,
  :func:`rss_allowance_mib`, is :data:`RSS_BASE_MIB` plus
  :data:`RSS_PER_1000_MIB` per 1,000 cycles: 12 MiB for 1,000. Measured on the
  2-core CI machine, 1,000 cycles grew the trimmed RSS by 0.2 to 5.2 MiB (pages
  that stay partly used, and the interpreter's bounded caches: its type
  attribute cache, set tables that do not shrink), all of it in the first few
  hundred cycles: a longer async series without workers stood at 327.4, 327.6
  and 327.7 MiB after 300, 900 and 1,800 cycles. The heap grew by at most
  0.2 MiB and Python's own allocations (``tracemalloc``) by about 50 KB, at the
  same sites and by about as much after 400 cycles as after 1,200. A closed
  session that something kept alive holds about 0.9 MiB (an open one 13 MiB),
  so a leak of one per cycle misses the allowance many times over. The base is
  for short series such as the tests' 30 cycles, where a few pages are a large
  part of the growth.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import gc
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from rlnb.bench._common import BenchResult, Target
from rlnb.config import Config, DataConfig, ModelConfig, RolloutConfig
from rlnb.runtime import Snapshot, snapshot
from rlnb.session import Session

__all__ = ["VARIANTS", "Soak", "Variant", "rss_allowance_mib", "run", "soak"]

WARMUP = 10
SETTLE_S = 3.0
RSS_BASE_MIB = 4.0
RSS_PER_1000_MIB = 8.0
_COUNTS = ("fds", "threads", "os_threads", "children")
_AT_CLOSE = ("fds", "threads", "children")  # judged right after each close() as well


@dataclasses.dataclass(frozen=True)
class Variant:
    """One series: the session's ``mode`` and its prompt loader's ``num_workers``."""

    mode: str
    num_workers: int

    @property
    def name(self) -> str:
        return f"{self.mode}_w{self.num_workers}"

    def config(self) -> Config:
        """The tiny config every cycle of this series builds its session from."""
        return Config(
            mode=self.mode,
            model=ModelConfig(d_model=16, n_layers=1, n_heads=2),
            rollout=RolloutConfig(group_size=2, groups_per_step=2, max_new_tokens=4, max_inflight=8),
            data=DataConfig(num_workers=self.num_workers, prefetch_factor=2),
        )


VARIANTS = (Variant("sync", 0), Variant("sync", 1), Variant("async", 0), Variant("async", 1))


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


@functools.cache
def _glibc() -> Any:
    """glibc, for ``malloc_trim`` and ``mallinfo2``; None elsewhere (musl, macOS, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if not (hasattr(libc, "malloc_trim") and hasattr(libc, "mallinfo2")):  # mallinfo2: glibc 2.33+
        return None
    libc.mallinfo2.restype = _MallInfo2
    return libc


def _heap_mib(trim: bool) -> float | None:
    """Bytes malloc has handed out and not had back, in MiB; with ``trim``, first give
    malloc's free pages back to the OS, so that RSS counts only what is in use."""
    libc = _glibc()
    if libc is None:
        return None
    if trim:
        libc.malloc_trim(0)
    info = libc.mallinfo2()
    return float(info.uordblks + info.hblkhd) / 2**20


@dataclasses.dataclass(frozen=True)
class _Counts:
    fds: int
    threads: int
    os_threads: int
    children: int
    probe: Snapshot

    @classmethod
    def now(cls, proc: psutil.Process) -> _Counts:
        probe = snapshot()
        return cls(
            fds=probe.num_fds,
            threads=probe.num_threads,
            os_threads=proc.num_threads(),
            children=len(proc.children(recursive=True)),
            probe=probe,
        )

    def above(self, base: _Counts) -> bool:
        return any(getattr(self, k) > getattr(base, k) for k in _COUNTS)


@dataclasses.dataclass(frozen=True)
class _Memory:
    rss_mib: float  # as the OS sees it
    trimmed_rss_mib: float  # after malloc_trim: what is in use, and fragmentation (rss_mib without glibc)
    heap_mib: float | None  # malloc's bytes in use (None without glibc)

    @classmethod
    def now(cls, proc: psutil.Process) -> _Memory:
        gc.collect()
        rss = proc.memory_info().rss / 2**20
        heap = _heap_mib(trim=True)
        return cls(rss, proc.memory_info().rss / 2**20, heap)


@dataclasses.dataclass(frozen=True)
class Soak:
    """What one series of cycles left behind, measured from after its warm-up.

    ``growth`` maps fds, threads, os_threads and children to their growth at the
    end, ``peak_growth`` to the largest growth seen after any cycle's close;
    ``left_behind`` names what is new since the baseline (empty when nothing is).
    ``rss_growth_mib`` is measured after giving malloc's free pages back to the OS,
    ``rss_untrimmed_growth_mib`` without; ``heap_growth_mib`` is the growth of
    malloc's bytes in use (None where the C library is not glibc).
    """

    variant: Variant
    cycles: int
    seconds: float
    growth: dict[str, int]
    peak_growth: dict[str, int]
    left_behind: dict[str, list[str]]
    rss_growth_mib: float
    rss_untrimmed_growth_mib: float
    heap_growth_mib: float | None

    @property
    def cycles_per_s(self) -> float:
        return self.cycles / self.seconds


def rss_allowance_mib(cycles: int) -> float:
    """How much resident memory ``cycles`` measured cycles may add (see the module docstring)."""
    return RSS_BASE_MIB + RSS_PER_1000_MIB * cycles / 1000


def cycle(config: Config, *, name: str = "soak", before_close: Callable[[Session], object] | None = None) -> None:
    """Make a session, roll out, pause, resume, step and close it; blocks.

    ``before_close(sess)`` runs after the step, with the session still open.
    """
    sess = Session(config, name=name)
    try:
        sess.rollout(1)
        sess.rollouts.pause()
        sess.rollouts.resume()
        sess.step()
        if before_close is not None:
            before_close(sess)
    finally:
        sess.close()


def _settled(base: _Counts, proc: psutil.Process) -> _Counts:
    """The counts now, read again for up to SETTLE_S s while they are above ``base``."""
    deadline = time.monotonic() + SETTLE_S
    tick = threading.Event()
    while True:
        gc.collect()
        now = _Counts.now(proc)
        if not now.above(base) or time.monotonic() >= deadline:
            return now
        tick.wait(0.02)


def soak(
    variant: Variant,
    cycles: int,
    *,
    warmup: int = WARMUP,
    before_close: Callable[[Session], object] | None = None,
) -> Soak:
    """Run ``warmup`` unmeasured cycles, then ``cycles`` measured ones; blocks.

    ``before_close(sess)`` runs in every cycle, warm-up included, before the close.
    """
    config = variant.config()
    proc = psutil.Process()
    for _ in range(warmup):
        cycle(config, before_close=before_close)
    memory = _Memory.now(proc)
    base = _Counts.now(proc)
    peak = dict.fromkeys(_COUNTS, 0)
    seconds = 0.0  # in the cycles, not in counting after them
    for _ in range(cycles):
        start = time.perf_counter()
        cycle(config, before_close=before_close)
        seconds += time.perf_counter() - start
        now = _Counts.now(proc)
        for k in _COUNTS:
            peak[k] = max(peak[k], getattr(now, k) - getattr(base, k))
    end = _settled(base, proc)
    memory_end = _Memory.now(proc)
    heap = None
    if memory.heap_mib is not None and memory_end.heap_mib is not None:
        heap = memory_end.heap_mib - memory.heap_mib
    return Soak(
        variant=variant,
        cycles=cycles,
        seconds=seconds,
        growth={k: getattr(end, k) - getattr(base, k) for k in _COUNTS},
        peak_growth=peak,
        left_behind=end.probe.new_since(base.probe),
        rss_growth_mib=memory_end.trimmed_rss_mib - memory.trimmed_rss_mib,
        rss_untrimmed_growth_mib=memory_end.rss_mib - memory.rss_mib,
        heap_growth_mib=heap,
    )


def _figures(result: Soak) -> dict[str, Any]:
    prefix = result.variant.name
    figures: dict[str, Any] = {
        f"{prefix}_cycles_per_s": round(result.cycles_per_s, 2),
        **{f"{prefix}_{k}_growth": v for k, v in result.growth.items()},
        **{f"{prefix}_{k}_peak_growth": v for k, v in result.peak_growth.items()},
        f"{prefix}_rss_growth_mib": round(result.rss_growth_mib, 2),
        f"{prefix}_rss_untrimmed_growth_mib": round(result.rss_untrimmed_growth_mib, 2),
        f"{prefix}_heap_growth_mib": None if result.heap_growth_mib is None else round(result.heap_growth_mib, 3),
    }
    if result.left_behind:
        figures[f"{prefix}_left_behind"] = result.left_behind
    return figures


def run(*, cycles: int = 1000, warmup: int = WARMUP) -> BenchResult:
    """Soak every variant for ``cycles`` measured cycles; blocks for minutes at the default."""
    figures: dict[str, Any] = {"cycles": cycles, "warmup": warmup}
    targets = []
    allowance = rss_allowance_mib(cycles)
    for variant in VARIANTS:
        result = soak(variant, cycles, warmup=warmup)
        figures.update(_figures(result))
        name = variant.name
        targets += [Target(f"{name}_{k}_growth", float(v), "<=", 0.0) for k, v in result.growth.items()]
        targets += [Target(f"{name}_{k}_peak_growth", float(result.peak_growth[k]), "<=", 0.0) for k in _AT_CLOSE]
        targets.append(Target(f"{name}_rss_growth", result.rss_growth_mib, "<=", allowance, " MiB"))
    figures["rss_allowance_mib"] = allowance
    return BenchResult("soak", figures, tuple(targets))

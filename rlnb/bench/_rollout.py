"""``rlnb bench rollout``: pausing and resuming generation, and continuous batching.

- resume → next dispatch with at least 64 long-tail (lognormal) samples in flight,
  against the floor of a drain that waits for all of them;
- ``sess.rollouts.pause("abort")`` → engine quiescent, on a real session generating
  in the background, its buffer taken from between pauses as a learner would; the full garbage
  collections during the trials are counted and timed (one of 150 ms or more, due
  soon after a session is built and longer as the heap grows, was the tail);
- TinyEngine tokens/s with continuous batching against static batching (each batch
  waits for its longest sequence): same model, same long-tail lengths, one run, one
  torch thread each (``EngineConfig.threads``' default: with torch's default of all
  cores a small batch's step cost 3.5 ms against 1.3 ms, which made static batching
  look worse, and the figure swung with what the process had run before).
  1024 requests (16 batches of 64): a rollouter feeds the engine continuously, so
  the steady state matters more than the final drain, which both modes share.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import random
import threading
import time
from collections.abc import Callable

from rlnb._samples import PromptItem
from rlnb.bench._common import BenchResult, Target, median, p99, time_ms
from rlnb.buffer import ReplayBuffer
from rlnb.config import BufferConfig, Config, DataConfig, EngineConfig, ModelConfig, RolloutConfig
from rlnb.engines import FakeEngine, GenerateRequest, PauseMode, SamplingParams
from rlnb.rollout import Rollouter
from rlnb.runtime import AsyncBridge, block_on
from rlnb.session import Session


def _lognormal_lengths(seed: int, median_len: float, sigma: float, cap: int) -> Callable[[GenerateRequest], int]:
    rng = random.Random(seed)
    cache: dict[str, int] = {}

    def length(request: GenerateRequest) -> int:
        key = request.request_id.rsplit(".", 2)[0]  # the same sample keeps its length across continuations
        if key not in cache:
            cache[key] = max(1, min(cap, round(rng.lognormvariate(0, sigma) * median_len)))
        return cache[key]

    return length


async def _resume_latency(trials: int) -> dict[str, float]:
    """Resume → dispatch with a long tail in flight, and what a wait-for-all drain costs."""
    spread = _lognormal_lengths(0, 60, 1.0, 2000)
    # The first 8 groups are a tail that outlasts the trials (3,000+ tokens); each later
    # group is short, so it is in the buffer by the next trial, and taking it (as the
    # learner would) opens room in the policy-lag budget for one more.
    engine = FakeEngine(
        lengths=lambda request: 3000 + spread(request) if int(request.request_id.split(".")[0]) < 8 else 1,
        token_delay=0.002,
    )
    buffer = ReplayBuffer(BufferConfig(capacity=100_000))
    rollouter = Rollouter(
        engine,
        # groups_per_step: the 8-group tail and one short group live at once
        RolloutConfig(group_size=8, max_inflight=100_000, max_policy_lag=0, groups_per_step=9),
        sampling=SamplingParams(max_new_tokens=5000),
        prompts=(PromptItem(i, "p") for i in itertools.count()),
        encode=lambda text: [3],
        decode=lambda ids: "",
        reward_fn=lambda item, completion: 0.0,
        buffer=buffer,
        seed=0,
        data=DataConfig(),
        max_context=None,
    )
    latencies, in_flight = [], []
    try:
        await rollouter.start()
        while rollouter.statistics().in_flight < 64:
            await asyncio.sleep(0.001)
        for i in range(trials):
            while buffer.size() == 0:
                await asyncio.sleep(0.001)
            await rollouter.pause(PauseMode.KEEP)
            buffer.get_nowait(buffer.size())  # the learner takes what is there
            await rollouter.set_version(1 + i)
            # A person resumes from a later cell: let the pause's own wake-ups settle.
            await asyncio.sleep(0.005)
            in_flight.append(rollouter.statistics().in_flight)
            await rollouter.resume()
            while (ms := rollouter.statistics().last_resume_to_dispatch_ms) is None:
                await asyncio.sleep(0)
            latencies.append(ms)
            rollouter._resume_to_dispatch_ms = None
        # The floor: a drain that waits for every in-flight sample before resuming.
        await rollouter.stop()
        start = time.perf_counter()
        await rollouter.pause(PauseMode.WAIT)
        await rollouter.wait_paused()
        drain_ms = (time.perf_counter() - start) * 1e3
    finally:
        await rollouter.aclose()
        buffer.close()
    return {
        "resume_to_dispatch_median_ms": median(latencies),
        "resume_to_dispatch_p99_ms": p99(latencies),
        "in_flight_at_resume_min": float(min(in_flight)),
        "drain_all_ms": drain_ms,
    }


def _pause_abort_latency(trials: int) -> dict[str, float]:
    config = Config(
        model=ModelConfig(max_len=48),
        rollout=RolloutConfig(max_policy_lag=None, max_new_tokens=40, max_inflight=128),
        buffer=BufferConfig(capacity=100_000),
    )
    rng = random.Random(1)
    latencies, busy = [], []
    collections: list[float] = []  # ms of each full (generation 2) garbage collection
    began = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                began[0] = time.perf_counter()
            else:
                collections.append((time.perf_counter() - began[0]) * 1e3)

    with Session(config, name="bench-rollout-pause") as sess:
        sess.rollouts.start()
        # A session's construction leaves enough new objects for one full collection
        # (150-185 ms of a ~300k-object heap here) soon after: run it now, as timing
        # tools do before they measure, rather than inside one pause; any full
        # collection during the trials is still counted below.
        gc.collect()
        gc.callbacks.append(timed)
        try:
            for _ in range(trials):
                threading.Event().wait(rng.uniform(0.02, 0.05))
                # Take what was made, as a learner would: a buffer that only grows makes
                # every full garbage collection longer (23 ms, then 67, 102, 130, 157 ms
                # within 60 trials, measured), and one of those is what a pause waited for.
                if ready := sess.buffer.size():
                    sess.buffer.get_nowait(ready)
                busy.append(sess.statistics().engine.running)
                latencies.append(time_ms(lambda: sess.rollouts.pause("abort")))
                assert sess.statistics().engine.running == 0, "pause('abort') returned before the engine was quiescent"
                sess.rollouts.resume()
        finally:
            gc.callbacks.remove(timed)
        sess.rollouts.stop()
        stats = sess.statistics().rollout
    return {
        "pause_abort_median_ms": median(latencies),
        "pause_abort_p99_ms": p99(latencies),
        "engine_running_at_pause_median": median([float(b) for b in busy]),
        "partials_continued": float(stats.continuations),
        "full_gc_during_pauses": float(len(collections)),
        "full_gc_max_ms": max(collections, default=0.0),
    }


def _batching_tokens_per_s(requests: int) -> dict[str, float]:
    from rlnb.engines import TinyEngine
    from rlnb.models import TinyPolicy

    policy = TinyPolicy(ModelConfig(vocab_size=16, max_len=256))
    rng = random.Random(2)
    lengths = [max(1, min(240, round(rng.lognormvariate(0, 1.0) * 16))) for _ in range(requests)]

    async def run(engine: TinyEngine, n_requests: int) -> float:
        reqs = [
            GenerateRequest(f"r{i}", (1, 5, 6), SamplingParams(max_new_tokens=n, ignore_eos=True), seed=i)
            for i, n in enumerate(lengths[:n_requests])
        ]
        start = time.perf_counter()
        results = await asyncio.gather(*map(engine.generate, reqs))
        elapsed = time.perf_counter() - start
        return sum(len(r.token_ids) for r in results) / elapsed

    # Alternate the two modes over two rounds and keep each one's best, so that a
    # burst of load from elsewhere on the machine does not decide the ratio.
    best = {"continuous": 0.0, "static": 0.0}
    with AsyncBridge(name="bench-batching") as bridge:
        for _ in range(2):
            for label, continuous in (("continuous", True), ("static", False)):
                engine = TinyEngine(
                    policy,
                    EngineConfig(max_batch=64, threads=1),
                    eos_id=2,
                    continuous=continuous,
                    name=f"bench-{label}",
                )
                try:
                    bridge.run(run(engine, 64))  # warm-up
                    best[label] = max(best[label], bridge.run(run(engine, requests)))
                finally:
                    engine.close()
    figures = {f"{label}_tokens_per_s": value for label, value in best.items()}
    figures["lengths_median"] = median([float(n) for n in lengths])
    figures["lengths_max"] = float(max(lengths))
    return figures


def run(*, trials: int = 200, pause_trials: int = 50, requests: int = 1024) -> BenchResult:
    """Measure; blocks for half a minute or so."""
    figures: dict[str, object] = {}
    figures.update(block_on(_resume_latency(trials)))
    figures.update(_pause_abort_latency(pause_trials))
    figures.update(_batching_tokens_per_s(requests))
    speedup = float(figures["continuous_tokens_per_s"]) / float(figures["static_tokens_per_s"])  # type: ignore[arg-type]
    figures["continuous_over_static"] = speedup
    return BenchResult(
        "rollout",
        figures,
        (
            Target("resume_to_dispatch_p99", float(figures["resume_to_dispatch_p99_ms"]), "<=", 1.0, " ms"),  # type: ignore[arg-type]
            Target("pause_abort_p99", float(figures["pause_abort_p99_ms"]), "<=", 50.0, " ms"),  # type: ignore[arg-type]
            Target("continuous_over_static", speedup, ">=", 1.5, "x"),
        ),
    )

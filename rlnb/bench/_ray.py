"""``rlnb bench ray``: what running engine replicas as Ray actors costs.

On the built-in policy (the demo's size), in one run, against the in-process
``TinyEngine`` on the same policy:

- the actor hop per request: one request at a time, 5 new tokens, median and
  p99 ms, in-process and through a 1-replica ``RayEngine``;
- a weight sync (``update_weights`` with the learner's state dict), median of 5,
  with 1 and 2 replicas;
- tokens/s for 16 prompts x 8 samples x 5 tokens, median of 5, in-process and
  with 1 and 2 replicas, and their ratios ``ray1_over_inprocess_tokens`` (target:
  at least 0.8, the requests of a dispatch going to a replica in one call) and
  ``ray2_over_inprocess_tokens``. On 2 cores this measures the overhead, not a speed-up.

It starts a local Ray cluster of its own (on 127.0.0.1); run it inside a
loopback-only network namespace on a shared machine. The target: the hop adds
at most 10 ms per request at the median (a rollout step of 128 requests shares
the hop; a single request pays it).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rlnb.bench._common import BenchResult, Target, median
from rlnb.engines import Engine, GenerateRequest, SamplingParams
from rlnb.runtime import block_on

PROMPTS, SAMPLES, TOKENS = 16, 8, 5
HOPS = 60


def _requests(round_: int) -> list[GenerateRequest]:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=TOKENS, ignore_eos=True)
    return [
        GenerateRequest(f"{round_}.{p}.{s}", (1, 2 + p % 8, 3), sampling, seed=p * SAMPLES + s)
        for p in range(PROMPTS)
        for s in range(SAMPLES)
    ]


def _measure(engine: Engine, state: dict[str, Any]) -> dict[str, Any]:
    async def one(i: int) -> float:
        request = GenerateRequest(f"hop.{i}", (1, 2, 3), SamplingParams(max_new_tokens=TOKENS, ignore_eos=True))
        t = time.perf_counter()
        await engine.generate(request)
        return (time.perf_counter() - t) * 1000

    async def batch(round_: int) -> float:
        t = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(r) for r in _requests(round_)))
        return sum(len(r.token_ids) for r in results) / (time.perf_counter() - t)

    async def sync(version: int) -> float:
        t = time.perf_counter()
        await engine.update_weights(state, version)
        return (time.perf_counter() - t) * 1000

    async def main() -> dict[str, Any]:
        await batch(-1)  # warm
        hops = sorted([await one(i) for i in range(HOPS)])
        return {
            "hop_median_ms": median(hops),
            "hop_p99_ms": hops[min(len(hops) - 1, int(0.99 * len(hops)))],
            "tokens_per_s": median([await batch(r) for r in range(5)]),
            "sync_ms": median([await sync(v) for v in range(1, 6)]),
        }

    return block_on(main())


def run() -> BenchResult:
    import rlnb
    from rlnb.engines import RayEngine, TinyEngine
    from rlnb.models import TinyPolicy

    policy = TinyPolicy(rlnb.ModelConfig(vocab_size=16))
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    engine_config = rlnb.EngineConfig(max_batch=128, threads=1)
    local = TinyEngine(policy, engine_config, eos_id=15)
    try:
        figures = {f"local_{k}": v for k, v in _measure(local, state).items()}
    finally:
        local.close()
    for replicas in (1, 2):
        started = time.perf_counter()
        config = rlnb.RayConfig(engine_replicas=replicas)
        engine = RayEngine.start(policy, config, engine=engine_config, eos_id=15, name="bench-ray")
        figures[f"ray{replicas}_start_s"] = time.perf_counter() - started
        try:
            figures.update({f"ray{replicas}_{k}": v for k, v in _measure(engine, state).items()})
        finally:
            started = time.perf_counter()
            engine.close()
            figures[f"ray{replicas}_close_s"] = time.perf_counter() - started
    hop = figures["ray1_hop_median_ms"] - figures["local_hop_median_ms"]
    figures["hop_overhead_median_ms"] = hop
    figures["hop_overhead_p99_ms"] = figures["ray1_hop_p99_ms"] - figures["local_hop_p99_ms"]
    for replicas in (1, 2):  # a replica's whole dispatch goes in one streaming call
        figures[f"ray{replicas}_over_inprocess_tokens"] = (
            figures[f"ray{replicas}_tokens_per_s"] / figures["local_tokens_per_s"]
        )
    return BenchResult(
        "ray",
        figures,
        (
            Target("hop_overhead_median_ms", hop, "<=", 10.0, " ms"),
            Target("ray1_over_inprocess_tokens", figures["ray1_over_inprocess_tokens"], ">=", 0.8, "x"),
        ),
    )

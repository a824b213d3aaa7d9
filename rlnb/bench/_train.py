"""``rlnb bench train``: the training loop's throughput, and async against sync.

- **Throughput:** whole RL steps (rollout, update, weight sync) on the demo's
  config (addition, 16 prompts x 8 completions), after two unmeasured steps:
  steps/s and generated tokens/s over the loop.
- **Async vs sync on a long tail:** the ``reverse`` task with a freshly
  initialised policy sampling up to ``max_new_tokens`` tokens: it stops at random,
  so most completions end within a few tokens and a few run to the cap, the long
  tail that makes a synchronous step wait for its slowest sample. The same steps,
  seed and config run in both modes; the target is the ratio of their wall times.
  The learning rate is tiny (every update still runs in full) so that the length
  distribution stays the same in both runs and the ratio measures the system,
  not two diverging policies.
"""

from __future__ import annotations

import time
from typing import Any

from rlnb.bench._common import BenchResult, Target
from rlnb.config import Config, DataConfig, LearnConfig, ModelConfig, RolloutConfig, TrackConfig, WarmupConfig


def _loop(config: Config, steps: int, skip: int = 2) -> dict[str, Any]:
    from rlnb.session import Session

    with Session(config, name="bench-train") as sess:
        for _ in range(skip):
            sess.step()
        tokens = sess.statistics().engine.generated_tokens
        start = time.perf_counter()
        lengths = []
        for _ in range(steps):
            lengths.append(sess.step()["response_length"])
        seconds = time.perf_counter() - start
        generated = sess.statistics().engine.generated_tokens - tokens
    return {
        "seconds": seconds,
        "steps_per_s": steps / seconds,
        "generated_tokens_per_s": generated / seconds,
        "mean_response_length": sum(lengths) / len(lengths),
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


def run(*, steps: int = 40, longtail_steps: int = 20, max_new_tokens: int = 48, rounds: int = 3) -> BenchResult:
    from rlnb.cli import demo_settings

    demo, _ = demo_settings()
    loop = _loop(demo.replace(warmup=WarmupConfig(), track=TrackConfig(backends=())), steps)  # RL steps only

    longtail = Config(
        task="reverse",
        data=DataConfig(num_workers=1),
        learn=LearnConfig(lr=1e-7),
        track=TrackConfig(backends=()),
        model=ModelConfig(max_len=max_new_tokens + 16),  # room for the whole tail after the prompt
        rollout=RolloutConfig(group_size=8, groups_per_step=16, max_new_tokens=max_new_tokens),
    )
    # Interleaved rounds, compared by their medians: this machine's noise swings a
    # single pair of runs by more than the effect being measured.
    syncs, asyncs = [], []
    for _ in range(rounds):
        syncs.append(_loop(longtail.replace(mode="sync"), longtail_steps))
        asyncs.append(_loop(longtail.replace(mode="async"), longtail_steps))
    sync = _median_run(syncs)
    async_ = _median_run(asyncs)
    ratio = sync["seconds"] / async_["seconds"]
    figures = {
        "steps": steps,
        "steps_per_s": round(loop["steps_per_s"], 3),
        "generated_tokens_per_s": round(loop["generated_tokens_per_s"], 1),
        "s_per_step": round(1 / loop["steps_per_s"], 4),
        "longtail_steps": longtail_steps,
        "longtail_rounds": rounds,
        "sync_s_per_step_each": [round(r["seconds"] / longtail_steps, 4) for r in syncs],
        "async_s_per_step_each": [round(r["seconds"] / longtail_steps, 4) for r in asyncs],
        "longtail_max_new_tokens": max_new_tokens,
        "longtail_mean_length": round(sync["mean_response_length"], 2),
        "sync_s_per_step": round(sync["seconds"] / longtail_steps, 4),
        "async_s_per_step": round(async_["seconds"] / longtail_steps, 4),
        "sync_generated_tokens_per_s": round(sync["generated_tokens_per_s"], 1),
        "async_generated_tokens_per_s": round(async_["generated_tokens_per_s"], 1),
    }
    return BenchResult(
        "train",
        figures,
        (Target("async_over_sync_speedup", round(ratio, 3), ">=", 1.3, "x"),),
    )

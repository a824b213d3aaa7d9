"""``rlnb bench train``: the training loop's throughput, and where generation runs.

- **Throughput:** whole RL steps (rollout, update, weight sync) on the demo's
  config (addition, 16 prompts x 8 completions), sync mode, after two unmeasured
  steps: steps/s and generated tokens/s.
- **Modes on a long tail:** the ``reverse`` task with a freshly initialised
  policy sampling up to ``max_new_tokens`` tokens: it stops at random, so most
  completions end within a few tokens and a few run to the cap, the long tail
  that makes a synchronous step wait for its slowest sample. The same steps,
  seed and config run in each mode:

  ========================  =====================================================
  ``sync``                  rollout, then update, in one process
  ``async``                 rollout and update at once, engine on a thread
  ``async_process``         the engine in a process of its own
                            (``EngineConfig(process=True)``)
  ``async_ray1``/``ray2``   one or two Ray replicas (when Ray is installed; a
                            local cluster on 127.0.0.1)
  ========================  =====================================================

  For each: steps/s, generated tokens/s, and the learner's idle share (the time a
  step waits for its batch, over the whole). ``sync``, ``async`` and
  ``async_process`` run ``rounds`` times, interleaved, compared by their medians
  (this machine's noise swings a single pair of runs by more than the effect);
  the Ray modes once each. The learning rate is tiny (every update still runs
  in full) so that the length distribution stays the same in every run and the
  ratios measure the system, not diverging policies.

Targets: ``async_over_sync_speedup`` >= 1.3, ``async_process_over_sync`` >= 1.8
(steps/s), ``ray1_over_inprocess_tokens`` >= 0.8 (tokens/s of one Ray replica
over the in-process engine's, both async).
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from rlnb.bench._common import BenchResult, Target
from rlnb.config import (
    Config,
    DataConfig,
    EngineConfig,
    LearnConfig,
    ModelConfig,
    RayConfig,
    RolloutConfig,
    TrackConfig,
    WarmupConfig,
)

MODES: dict[str, dict[str, Any]] = {
    "sync": {"mode": "sync"},
    "async": {"mode": "async"},
    "async_process": {"mode": "async", "engine": EngineConfig(process=True)},
    "async_ray1": {"mode": "async", "ray": RayConfig(engine_replicas=1)},
    "async_ray2": {"mode": "async", "ray": RayConfig(engine_replicas=2)},
}


def _loop(config: Config, steps: int, skip: int = 2) -> dict[str, Any]:
    from rlnb.learn import Callback
    from rlnb.session import Session

    class Clock(Callback):
        batch_at = 0.0

        def on_batch(self, groups: Any) -> None:
            self.batch_at = time.perf_counter()

    clock = Clock()
    with Session(config, name="bench-train", callbacks=[clock]) as sess:
        for _ in range(skip):
            sess.step()
        tokens = sess.statistics().engine.generated_tokens
        start = time.perf_counter()
        lengths, waited = [], 0.0
        for _ in range(steps):
            asked = time.perf_counter()
            lengths.append(sess.step()["response_length"])
            waited += clock.batch_at - asked
        seconds = time.perf_counter() - start
        generated = sess.statistics().engine.generated_tokens - tokens
    return {
        "seconds": seconds,
        "steps_per_s": steps / seconds,
        "generated_tokens_per_s": generated / seconds,
        "learner_idle": waited / seconds,
        "mean_response_length": sum(lengths) / len(lengths),
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


def longtail_config(max_new_tokens: int = 48) -> Config:
    return Config(
        task="reverse",
        data=DataConfig(num_workers=1),
        learn=LearnConfig(lr=1e-7),
        track=TrackConfig(backends=()),
        model=ModelConfig(max_len=max_new_tokens + 16),  # room for the whole tail after the prompt
        rollout=RolloutConfig(group_size=8, groups_per_step=16, max_new_tokens=max_new_tokens),
    )


def run(
    *, steps: int = 40, longtail_steps: int = 20, max_new_tokens: int = 48, rounds: int = 3, ray: bool | None = None
) -> BenchResult:
    """``ray``: run the Ray modes (None: when Ray is installed)."""
    from rlnb.cli import demo_settings

    demo, _ = demo_settings()
    loop = _loop(demo.replace(warmup=WarmupConfig(), track=TrackConfig(backends=())), steps)  # RL steps only

    longtail = longtail_config(max_new_tokens)
    installed = importlib.util.find_spec("ray") is not None
    with_ray = installed if ray is None else ray
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in ("sync", "async", "async_process"):
            runs[mode].append(_loop(longtail.replace(**MODES[mode]), longtail_steps))
    if with_ray:
        for mode in ("async_ray1", "async_ray2"):
            runs[mode].append(_loop(longtail.replace(**MODES[mode]), longtail_steps))
    median = {mode: _median_run(each) for mode, each in runs.items() if each}
    figures: dict[str, Any] = {
        "steps": steps,
        "steps_per_s": round(loop["steps_per_s"], 3),
        "generated_tokens_per_s": round(loop["generated_tokens_per_s"], 1),
        "s_per_step": round(1 / loop["steps_per_s"], 4),
        "longtail_steps": longtail_steps,
        "longtail_rounds": rounds,
        "longtail_max_new_tokens": max_new_tokens,
        "longtail_mean_length": round(median["sync"]["mean_response_length"], 2),
        "ray": "measured" if with_ray else ("not run" if installed else "not installed: the Ray modes were not run"),
    }
    for mode, run_ in median.items():
        figures[f"{mode}_s_per_step"] = round(run_["seconds"] / longtail_steps, 4)
        figures[f"{mode}_steps_per_s"] = round(run_["steps_per_s"], 3)
        figures[f"{mode}_generated_tokens_per_s"] = round(run_["generated_tokens_per_s"], 1)
        figures[f"{mode}_learner_idle"] = round(run_["learner_idle"], 3)
        if len(runs[mode]) > 1:
            figures[f"{mode}_s_per_step_each"] = [round(r["seconds"] / longtail_steps, 4) for r in runs[mode]]
    sync = median["sync"]
    ratio = {mode: sync["seconds"] / run_["seconds"] for mode, run_ in median.items()}
    figures["async_over_sync_speedup"] = round(ratio["async"], 3)
    figures["async_process_over_sync"] = round(ratio["async_process"], 3)
    targets = [
        Target("async_over_sync_speedup", figures["async_over_sync_speedup"], ">=", 1.3, "x"),
        Target("async_process_over_sync", figures["async_process_over_sync"], ">=", 1.8, "x"),
    ]
    if with_ray:
        inprocess = median["async"]["generated_tokens_per_s"]
        for replicas in (1, 2):
            tokens = median[f"async_ray{replicas}"]["generated_tokens_per_s"]
            figures[f"ray{replicas}_over_inprocess_tokens"] = round(tokens / inprocess, 3)
        targets.append(Target("ray1_over_inprocess_tokens", figures["ray1_over_inprocess_tokens"], ">=", 0.8, "x"))
    return BenchResult("train", figures, tuple(targets))

"""``rlnb bench critic``: PPO's critic as a second LoRA adapter on the policy's frozen
base (``critic="lora"``) against the critic the field runs, a whole copy of the model
(``critic="model"``), and GRPO without a critic, all on one LoRA policy.

**Learning.** A random Llama with a character tokenizer (:func:`rlnb.models.tiny_llama`:
hidden 128, MLP 256, 2 layers of 4 heads, 0.4M parameters) is warmed up once on the
demo's ``reverse`` task (60 supervised steps, every weight; about half the held-out
prompts right after it) and written with ``save_pretrained``. Each variant then trains
a LoRA adapter (``r=8``, all linear layers) on that model for ``LEARN_STEPS`` sync
steps (16 prompts x 8 completions, lr 1e-3, seeds 0, 1, 2), all starting from the
same weights: held-out greedy accuracy (200 prompts) before and after, the gain, and
for the critics their explained variance (``1 - Var(R - V) / Var(R)`` of the returns
by the values before each update; 1 is a perfect critic, 0 a constant) and value
loss, as the mean of the last ``TAIL`` steps. The figures are medians over the seeds,
with their range.

**Memory**, each variant in a fresh Python process (peak RSS never comes down), on a
model of ``rlnb bench lora``'s size (hidden 384, MLP 1024, 6 layers: 10.6M
parameters) with the same adapter: a warm-up step and two more, then the process's
peak RSS, the critic's trained parameters, the bytes of its AdamW state and the
checkpoint's bytes. **Time**: the three sessions in one process, their steps
interleaved, the median s/step after one unmeasured step.

Targets, as ratios within the run: the LoRA critic's optimiser state at most 5 % of
the model critic's and its peak RSS at most the model critic's; its explained
variance at most 0.1 below the model critic's (it learns the values about as well),
and PPO with it gains at least 0.8x what PPO with the model critic gains.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rlnb._errors import BackgroundError
from rlnb.bench._common import BenchResult, ChildFailed, Target, json_from_child, peak_rss_mib

__all__ = ["run", "summarize"]

VARIANTS = ("grpo", "ppo_lora", "ppo_model")
SEEDS = (0, 1, 2)
LEARN_STEPS = 80
TAIL = 10
WARMUP_STEPS = 60
MEMORY_STEPS = 2
CHILD_TIMEOUT_S = 600.0
_CHILD = "import sys; from rlnb.bench._critic import _child_main; _child_main(sys.argv[1])"


def _config(model: str, variant: str, seed: int, *, lora_r: int = 8) -> Any:
    import rlnb
    from rlnb.algorithms import preset

    algorithm = "grpo" if variant == "grpo" else preset("ppo").replace(critic=variant.removeprefix("ppo_"))
    return rlnb.Config(
        task="reverse",
        mode="sync",
        seed=seed,
        model=rlnb.ModelConfig(path=model, max_len=32, lora=rlnb.LoraConfig(r=lora_r, alpha=2 * lora_r)),
        learn=rlnb.LearnConfig(algorithm=algorithm, lr=1e-3),
        data=rlnb.DataConfig(num_workers=0),
        track=rlnb.TrackConfig(backends=()),
    )


def warm_model(directory: Path) -> str:
    """The learning runs' model: a small random Llama warmed up on ``reverse`` (every
    weight), written to ``directory / "warm"``; its path."""
    import rlnb
    from rlnb.data import get_task
    from rlnb.models import tiny_llama

    llama = tiny_llama(directory / "llama", alphabet=get_task("reverse").alphabet)
    config = rlnb.Config(
        task="reverse",
        model=rlnb.ModelConfig(path=str(llama), max_len=32),
        warmup=rlnb.WarmupConfig(steps=WARMUP_STEPS, lr=3e-3),
        data=rlnb.DataConfig(num_workers=0),
        track=rlnb.TrackConfig(backends=()),
    )
    with rlnb.Session(config, name="bench-critic-warmup") as sess:
        sess.warmup(progress=False)
        sess.save_pretrained(directory / "warm")
    return str(directory / "warm")


def learn(model: str, variant: str, seed: int, *, steps: int = LEARN_STEPS) -> dict[str, Any]:
    """One learning run (see the module docstring); its figures."""
    from rlnb.session import Session

    with Session(_config(model, variant, seed), name=f"bench-critic-{variant}") as sess:
        before = sess.evaluate()
        start = time.perf_counter()
        history = sess.train(steps, progress=False)
        seconds = time.perf_counter() - start
        after = sess.evaluate()
    tail = history[-TAIL:]
    out: dict[str, Any] = {"before": before, "after": after, "gain": after - before, "s_per_step": seconds / steps}
    if "explained_variance" in tail[-1]:
        out["explained_variance"] = statistics.fmean(m["explained_variance"] for m in tail)
        out["value_loss"] = statistics.fmean(m["value_loss"] for m in tail)
    return out


def measure_memory(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant's memory figures, in this process (see the module docstring)."""
    import peft  # noqa: F401  (what every variant imports, before the baseline)
    import torch
    import transformers  # noqa: F401

    from rlnb.session import Session

    rss_imports = peak_rss_mib()
    with Session(_config(spec["model"], spec["variant"], 0), name="bench-critic-memory") as sess:
        for _ in range(1 + MEMORY_STEPS):
            sess.step()
        critic = sess._trainer.learner.critic
        trained, optimizer_bytes = 0, 0
        if critic is not None:
            trained = sum(p.numel() for p in critic.parameters())
            optimizer_bytes = sum(
                t.numel() * t.element_size()
                for state in critic.optimizer.state.values()
                for t in state.values()
                if isinstance(t, torch.Tensor)
            )
        checkpoint = sess.save(spec["checkpoint"])
        checkpoint_bytes = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    shutil.rmtree(checkpoint, ignore_errors=True)
    return {
        "critic_trained_parameters": trained,
        "critic_optimizer_state_bytes": optimizer_bytes,
        "checkpoint_bytes": checkpoint_bytes,
        "peak_rss_mib": peak_rss_mib(),
        "rss_after_imports_mib": rss_imports,
    }


def _child_main(spec_json: str) -> None:
    """The memory process's entry point: its figures as the last line of stdout."""
    print(json.dumps(measure_memory(json.loads(spec_json))), flush=True)


def _in_fresh_process(spec: dict[str, Any]) -> dict[str, Any]:
    try:
        return json_from_child(_CHILD, spec, CHILD_TIMEOUT_S)
    except ChildFailed as exc:
        tail = "\n".join(exc.stderr)
        raise BackgroundError(f"rlnb bench critic: the {spec['variant']} variant's process {exc}:\n{tail}") from None


def time_steps(model: str, *, steps: int) -> dict[str, list[float]]:
    """The variants' sessions open in this process, ``steps`` steps each after one
    unmeasured step, interleaved (the order turning each round); each one's step times."""
    import contextlib

    from rlnb.session import Session

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with contextlib.ExitStack() as stack:
        sessions = {
            v: stack.enter_context(Session(_config(model, v, 0), name=f"bench-critic-time-{v}")) for v in VARIANTS
        }
        for sess in sessions.values():
            sess.step()
        for i in range(steps):
            order = VARIANTS[i % len(VARIANTS) :] + VARIANTS[: i % len(VARIANTS)]
            for variant in order:
                start = time.perf_counter()
                sessions[variant].step()
                times[variant].append(time.perf_counter() - start)
    return times


def run(*, steps: int = LEARN_STEPS, seeds: tuple[int, ...] = SEEDS, time_steps_n: int = 10) -> BenchResult:
    """Measure; blocks for about ten minutes on two cores (the warm-up, 9 learning runs,
    3 memory processes, the timed steps)."""
    from rlnb.data import get_task
    from rlnb.models import tiny_llama

    with tempfile.TemporaryDirectory(prefix="rlnb-bench-critic-") as tmp:
        root = Path(tmp)
        warm = warm_model(root)
        learning = {v: [learn(warm, v, seed, steps=steps) for seed in seeds] for v in VARIANTS}
        big = str(
            tiny_llama(
                root / "big",
                alphabet=get_task("reverse").alphabet,
                hidden_size=384,
                intermediate_size=1024,
                num_layers=6,
                num_heads=6,
            )
        )
        memory = {
            v: _in_fresh_process({"model": big, "variant": v, "checkpoint": str(root / f"checkpoint-{v}")})
            for v in VARIANTS
        }
        times = time_steps(big, steps=time_steps_n)
    return summarize(learning, memory, times, steps=steps)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def summarize(
    learning: dict[str, list[dict[str, Any]]],
    memory: dict[str, dict[str, Any]],
    times: dict[str, list[float]],
    *,
    steps: int,
) -> BenchResult:
    """The result: per variant the learning figures' median and range over seeds, its
    memory figures and median s/step; the targets as ratios LoRA critic / model critic."""
    figures: dict[str, Any] = {
        "learning": (
            f"reverse, a 0.4M Llama warmed up {WARMUP_STEPS} steps, then LoRA r=8 RL for {steps} sync steps, "
            f"seeds {len(next(iter(learning.values())))}: median [min, max]"
        ),
        "memory": "10.6M Llama, LoRA r=8; each variant in a fresh process, peak RSS = its VmHWM",
    }
    for v in VARIANTS:
        runs = learning[v]
        for key in ("before", "after", "gain", "explained_variance", "value_loss"):
            if key in runs[0]:
                figures[f"{v}_{key}"] = _spread([r[key] for r in runs])
        figures[f"{v}_critic_trained_parameters"] = memory[v]["critic_trained_parameters"]
        figures[f"{v}_critic_optimizer_state_bytes"] = memory[v]["critic_optimizer_state_bytes"]
        figures[f"{v}_checkpoint_bytes"] = memory[v]["checkpoint_bytes"]
        figures[f"{v}_peak_rss_mib"] = round(memory[v]["peak_rss_mib"], 1)
        figures[f"{v}_s_per_step"] = round(statistics.median(times[v]), 4)

    def median_of(key: str) -> float:
        value: float = figures[key]["median"]
        return value

    lora_gain, model_gain = median_of("ppo_lora_gain"), median_of("ppo_model_gain")
    return BenchResult(
        "critic",
        figures,
        (
            Target(
                "lora_over_model_critic_optimizer_state",
                figures["ppo_lora_critic_optimizer_state_bytes"] / figures["ppo_model_critic_optimizer_state_bytes"],
                "<=",
                0.05,
                "x",
            ),
            Target(
                "lora_over_model_critic_peak_rss",
                figures["ppo_lora_peak_rss_mib"] / figures["ppo_model_peak_rss_mib"],
                "<=",
                1.0,
                "x",
            ),
            Target(
                "lora_minus_model_explained_variance",
                median_of("ppo_lora_explained_variance") - median_of("ppo_model_explained_variance"),
                ">=",
                -0.1,
            ),
            Target("lora_over_model_gain", lora_gain / model_gain if model_gain > 0 else 0.0, ">=", 0.8, "x"),
        ),
    )

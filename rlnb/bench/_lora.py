"""``rlnb bench lora``: a LoRA adapter against training every weight, on one Llama, in one run.

The model is a random Llama with a character tokenizer, built offline into a temporary
directory by :func:`rlnb.models.tiny_llama`: by default hidden size 384, MLP 1024,
6 layers of 6 heads of 64, vocabulary 16: 10.6M parameters. LoRA is
``LoraConfig(r=8, alpha=16)`` on every linear layer but the output head (peft's
"all-linear"): 350K trainable. Both variants run the same config otherwise: the
``addition`` task, sync mode, 8 prompts x 8 completions a step, the ``hf`` engine,
AdamW, no KL term (so neither keeps a reference copy), prompts made in-process.

**Memory**, each variant in a fresh Python process of its own (one after the other):
a process's peak RSS is a high-water mark that never comes down, so it is a variant's
only in a process that ran nothing else. The process makes the session, runs a
warm-up step and two more, and reports

- ``peak_rss``: the process's own peak RSS at the end (``rlnb.bench._common.peak_rss_mib``:
  Linux's ``VmHWM``; ``ru_maxrss`` would hold the bench's own, inherited); and the same after
  the imports, before the model loads (``rss_after_imports``: torch, transformers,
  peft and rlnb, the part both variants pay);
- ``optimizer_state_bytes``: the bytes of every tensor AdamW holds (its two moments
  and step count per trained parameter);
- ``checkpoint_bytes``: the files of the ``Session.save()`` directory.

**Time**, both variants' sessions open side by side in this process, their steps
interleaved one by one (LoRA then full, then full then LoRA, ...) so that the
machine's noise hits both alike: ``s_per_step`` is the median of a whole ``step()``
(rollout, update, weight sync) after one unmeasured warm-up step each, and
``update_s`` the median of the learner's update alone (from the step's
``train_tokens_per_s``). Generation costs the same for both (the engine serves merged
weights), so s/step weighs what LoRA adds (merging the adapter into each adapted
weight at every sync, the adapter's matmuls) against what it saves (the frozen
weights' gradients and AdamW).

The targets are ratios LoRA / full within the run: optimizer state and checkpoint at
most 5 %, peak RSS below full's (at most 1.0x), and s/step at most full's.
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
from rlnb.config import Config

__all__ = ["measure_memory", "run", "summarize", "time_steps"]

VARIANTS = ("lora", "full")
MEMORY_STEPS = 2  # after the warm-up step: AdamW's state exists, a step's peak is reached
CHILD_TIMEOUT_S = 600.0
_CHILD = "import sys; from rlnb.bench._lora import _child_main; _child_main(sys.argv[1])"


def _config(model: str, lora_r: int | None, group_size: int, groups_per_step: int) -> Config:
    from rlnb.config import DataConfig, LoraConfig, ModelConfig, RolloutConfig, TrackConfig

    lora = None if lora_r is None else LoraConfig(r=lora_r, alpha=2 * lora_r)
    return Config(
        task="addition",
        mode="sync",
        model=ModelConfig(path=model, max_len=32, lora=lora),
        rollout=RolloutConfig(group_size=group_size, groups_per_step=groups_per_step),
        data=DataConfig(num_workers=0),
        track=TrackConfig(backends=()),
    )


def measure_memory(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant's memory figures (see the module docstring), measured in this process:
    its RSS figures are the variant's only in a process that has run nothing else.
    Blocks for the session's steps. ``spec``: model (a directory), lora_r (None: train
    every weight), group_size, groups_per_step, checkpoint (a new directory, removed
    again)."""
    import peft  # noqa: F401  (what both variants import, before the baseline)
    import torch
    import transformers  # noqa: F401

    from rlnb.models import HFPolicy
    from rlnb.session import Session

    rss_imports = peak_rss_mib()
    config = _config(spec["model"], spec["lora_r"], spec["group_size"], spec["groups_per_step"])
    with Session(config, name="bench-lora-memory") as sess:
        for _ in range(1 + MEMORY_STEPS):
            sess.step()
        optimizer = sess._trainer.learner.optimizer
        optimizer_bytes = sum(
            t.numel() * t.element_size()
            for state in optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        )
        policy = sess.policy
        assert isinstance(policy, HFPolicy)  # a ModelConfig.path model
        trainable, every = policy.parameter_counts()
        checkpoint = sess.save(spec["checkpoint"])
        checkpoint_bytes = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    shutil.rmtree(checkpoint, ignore_errors=True)
    return {
        "trainable_parameters": trainable,
        "parameters": every,
        "optimizer_state_bytes": optimizer_bytes,
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
        kind = "full" if spec["lora_r"] is None else "LoRA"
        tail = "\n".join(exc.stderr)
        raise BackgroundError(f"rlnb bench lora: the {kind} variant's process {exc}:\n{tail}") from None


def time_steps(model: str, *, steps: int, lora_r: int, group_size: int, groups_per_step: int) -> dict[str, Any]:
    """Both variants' sessions open in this process, ``steps`` steps each after a
    warm-up step, interleaved one by one; each variant's step and update times (s)."""
    from rlnb.session import Session

    times: dict[str, dict[str, list[float]]] = {v: {"step": [], "update": []} for v in VARIANTS}
    with (
        Session(_config(model, lora_r, group_size, groups_per_step), name="bench-lora-lora") as lora,
        Session(_config(model, None, group_size, groups_per_step), name="bench-lora-full") as full,
    ):
        sessions = {"lora": lora, "full": full}
        for sess in sessions.values():
            sess.step()  # warm-up: first calls, AdamW's state made
        for i in range(steps):
            for variant in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
                start = time.perf_counter()
                metrics = sessions[variant].step()
                times[variant]["step"].append(time.perf_counter() - start)
                tokens = metrics["response_length"] * metrics["groups"] * group_size
                times[variant]["update"].append(tokens / metrics["train_tokens_per_s"])
    return times


def run(
    *,
    steps: int = 30,
    hidden_size: int = 384,
    intermediate_size: int = 1024,
    num_layers: int = 6,
    num_heads: int = 6,
    lora_r: int = 8,
    group_size: int = 8,
    groups_per_step: int = 8,
) -> BenchResult:
    """Measure; blocks for about a minute and a half at the defaults on two cores (two
    Python processes, then ``2 * (steps + 1)`` steps here). ``RuntimeError`` with the
    end of its stderr if a variant's process fails."""
    from rlnb.models import tiny_llama

    with tempfile.TemporaryDirectory(prefix="rlnb-bench-lora-") as tmp:
        model = str(
            tiny_llama(
                Path(tmp) / "llama",
                hidden_size=hidden_size,
                intermediate_size=intermediate_size,
                num_layers=num_layers,
                num_heads=num_heads,
            )
        )
        memory = {
            variant: _in_fresh_process(
                {
                    "model": model,
                    "lora_r": lora_r if variant == "lora" else None,
                    "group_size": group_size,
                    "groups_per_step": groups_per_step,
                    "checkpoint": str(Path(tmp) / f"checkpoint-{variant}"),
                }
            )
            for variant in VARIANTS
        }
        times = time_steps(model, steps=steps, lora_r=lora_r, group_size=group_size, groups_per_step=groups_per_step)
    shape_words = (
        f"tiny_llama: hidden {hidden_size}, MLP {intermediate_size}, {num_layers} layers of {num_heads} heads of "
        f"{hidden_size // num_heads}, vocab 16"
    )
    return summarize(memory, times, model=shape_words, lora_r=lora_r)


def summarize(
    memory: dict[str, dict[str, Any]], times: dict[str, dict[str, list[float]]], *, model: str, lora_r: int
) -> BenchResult:
    """The result: each variant's :func:`measure_memory` figures and the medians of its
    :func:`time_steps` times, and the targets as ratios LoRA / full."""
    lora, full = memory["lora"], memory["full"]
    figures: dict[str, Any] = {
        "model": f"{model}, {full['parameters']:,} parameters",
        "lora": f"r={lora_r}, alpha={2 * lora_r}, all-linear: {lora['trainable_parameters']:,} trainable",
        "memory": "each variant in a fresh process; peak RSS is its VmHWM (Linux; ru_maxrss elsewhere)",
        "steps_timed": len(times["lora"]["step"]),
        "timing": "both sessions in one process, steps interleaved one by one, medians",
    }
    for variant in VARIANTS:
        figures[f"{variant}_optimizer_state_bytes"] = memory[variant]["optimizer_state_bytes"]
        figures[f"{variant}_checkpoint_bytes"] = memory[variant]["checkpoint_bytes"]
        figures[f"{variant}_peak_rss_mib"] = round(memory[variant]["peak_rss_mib"], 1)
        figures[f"{variant}_rss_after_imports_mib"] = round(memory[variant]["rss_after_imports_mib"], 1)
        figures[f"{variant}_s_per_step"] = round(statistics.median(times[variant]["step"]), 4)
        figures[f"{variant}_update_s"] = round(statistics.median(times[variant]["update"]), 4)

    def ratio(key: str) -> float:
        return round(figures[f"lora_{key}"] / figures[f"full_{key}"], 4)

    growth = {v: figures[f"{v}_peak_rss_mib"] - figures[f"{v}_rss_after_imports_mib"] for v in VARIANTS}
    figures["lora_over_full_peak_rss_growth"] = (
        round(growth["lora"] / growth["full"], 4) if growth["full"] > 0 else None
    )
    figures["lora_over_full_update_s"] = ratio("update_s")
    return BenchResult(
        "lora",
        figures,
        (
            Target("lora_over_full_optimizer_state", ratio("optimizer_state_bytes"), "<=", 0.05, "x"),
            Target("lora_over_full_checkpoint", ratio("checkpoint_bytes"), "<=", 0.05, "x"),
            Target("lora_over_full_peak_rss", ratio("peak_rss_mib"), "<=", 1.0, "x"),
            Target("lora_over_full_s_per_step", ratio("s_per_step"), "<=", 1.0, "x"),
        ),
    )

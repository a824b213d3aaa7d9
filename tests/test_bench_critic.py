"""``rlnb bench critic`` (rlnb/bench/_critic.py): the LoRA critic against the model
critic and GRPO, in one run. Its parts run here, in this process, on a small model and
a few steps: the figures a user reads, and the ratios that do not depend on the machine."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rlnb.bench import _critic
from rlnb.cli import BENCHES
from rlnb.data import get_task
from rlnb.models import tiny_llama

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="the 'lora' extra (peft) is not installed"),
]


def test_bench_critic_measures_each_variant_and_judges_the_lora_critic_against_the_model_critic(
    tmp_path: Path,
) -> None:
    assert "critic" in BENCHES
    model = str(
        tiny_llama(
            tmp_path / "llama",
            alphabet=get_task("reverse").alphabet,
            hidden_size=32,
            intermediate_size=64,
            num_layers=1,
            num_heads=2,
        )
    )
    learning = {v: [_critic.learn(model, v, seed, steps=1) for seed in (0, 1)] for v in _critic.VARIANTS}
    memory = {
        v: _critic.measure_memory({"model": model, "variant": v, "checkpoint": str(tmp_path / f"ckpt-{v}")})
        for v in _critic.VARIANTS
    }
    assert not any((tmp_path / f"ckpt-{v}").exists() for v in _critic.VARIANTS)
    times = _critic.time_steps(model, steps=1)
    result = _critic.summarize(learning, memory, times, steps=1)

    out = json.loads(result.to_json())
    figures = out["figures"]
    assert out["bench"] == "critic"
    for v in _critic.VARIANTS:
        gain = figures[f"{v}_gain"]
        assert gain["min"] <= gain["median"] <= gain["max"]
        assert figures[f"{v}_s_per_step"] > 0 and figures[f"{v}_peak_rss_mib"] > 0
    # GRPO keeps no critic; the critics report how well they predict the returns
    assert figures["grpo_critic_trained_parameters"] == 0 and "grpo_explained_variance" not in figures
    assert {"ppo_lora_explained_variance", "ppo_model_explained_variance"} <= set(figures)
    # a LoRA critic trains an adapter and a head; the model critic a whole copy
    lora, whole = figures["ppo_lora_critic_trained_parameters"], figures["ppo_model_critic_trained_parameters"]
    assert 0 < lora < whole / 2  # r=8 on a model of width 32: an adapter is large next to it
    targets = out["targets"]
    assert targets["lora_over_model_critic_optimizer_state"]["value"] == pytest.approx(
        figures["ppo_lora_critic_optimizer_state_bytes"] / figures["ppo_model_critic_optimizer_state_bytes"]
    )
    assert set(targets) == {
        "lora_over_model_critic_optimizer_state",
        "lora_over_model_critic_peak_rss",
        "lora_minus_model_explained_variance",
        "lora_over_model_gain",
    }
    assert "rlnb bench critic" in result.report()

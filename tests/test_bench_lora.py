"""``rlnb bench lora`` (rlnb/bench/_lora.py): LoRA against full fine-tuning in one run.

Its parts run here in this process on a small model (the command runs each variant's
memory figures in a fresh process of its own): the figures' shape, and the ratios that
do not depend on the machine; not the timing targets."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rlnb.bench import _lora
from rlnb.cli import BENCHES
from rlnb.models import tiny_llama

# find_spec, not importorskip: importing peft (and transformers) costs every collection seconds
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None, reason="the 'lora' extra (peft) is not installed"
)


def test_bench_lora_gives_both_variants_figures_and_the_ratios_as_targets(tmp_path: Path) -> None:
    model = str(tiny_llama(tmp_path / "llama", hidden_size=64, intermediate_size=128, num_heads=2))
    sizes = {"group_size": 2, "groups_per_step": 2}
    memory = {
        variant: _lora.measure_memory(
            {"model": model, "lora_r": r, "checkpoint": str(tmp_path / f"ckpt-{variant}"), **sizes}
        )
        for variant, r in (("lora", 2), ("full", None))
    }
    assert not (tmp_path / "ckpt-lora").exists() and not (tmp_path / "ckpt-full").exists()
    times = _lora.time_steps(model, steps=2, lora_r=2, **sizes)
    result = _lora.summarize(memory, times, model="tiny_llama: hidden 64", lora_r=2)

    out = json.loads(result.to_json())
    assert out["bench"] == "lora"
    figures = out["figures"]
    assert figures["steps_timed"] == 2
    assert figures["model"].startswith("tiny_llama: hidden 64, ") and "r=2, alpha=4" in figures["lora"]
    for variant in ("lora", "full"):
        for key in ("optimizer_state_bytes", "checkpoint_bytes", "peak_rss_mib", "s_per_step", "update_s"):
            assert figures[f"{variant}_{key}"] > 0, (variant, key)
    targets = out["targets"]
    assert set(targets) == {
        "lora_over_full_optimizer_state",
        "lora_over_full_checkpoint",
        "lora_over_full_peak_rss",
        "lora_over_full_s_per_step",
    }
    # AdamW holds state for the adapter only, and the checkpoint holds the adapter and that state.
    assert 0 < targets["lora_over_full_optimizer_state"]["value"] < 0.1
    assert 0 < targets["lora_over_full_checkpoint"]["value"] < 0.3
    assert "rlnb bench lora" in result.report()
    assert "lora" in BENCHES

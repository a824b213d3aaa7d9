"""``rlnb bench algorithms`` (rlnb/bench/_algorithms.py): every preset from one warm start.

The summary and its table on made-up runs (time to the threshold, never reached,
the spread over seeds, a failed run), and the bench's machinery for real on a few
steps, in this process (the command runs each preset in a fresh process)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlnb.bench import _algorithms
from rlnb.cli import BENCHES


def _run(task: str, preset: str, seed: int, accuracies: list[float], **metrics: float) -> dict[str, Any]:
    """A made-up run: an evaluation every 10 steps, one second per step."""
    return {
        "task": task,
        "seed": seed,
        "preset": preset,
        "evals": [[10 * i, 10.0 * i, acc] for i, acc in enumerate(accuracies)],
        "step_seconds": 10.0 * (len(accuracies) - 1),
        "generated_tokens": 1000,
        "tokens_per_s": 100.0 + seed,
        "metrics": {"grad_norm": 1.0, "groups_dropped": 0.0, **metrics},
        "peak_rss_mib": 400.0 + seed,
        "rss_after_imports_mib": 390.0,
        "error": None,
    }


def test_time_to_is_the_first_evaluation_at_the_threshold_or_none() -> None:
    evals = [[0, 0.0, 0.5], [5, 1.5, 0.79], [10, 3.0, 0.8], [15, 4.5, 0.95]]
    assert _algorithms.time_to(evals) == (10, 3.0)
    assert _algorithms.time_to(evals, 0.9) == (15, 4.5)
    assert _algorithms.time_to(evals, 0.99) is None
    assert _algorithms.time_to([[0, 0.0, 0.85]]) == (0, 0.0)  # already there at the start


def test_summary_gives_the_median_and_range_over_seeds_and_never_reached_as_such() -> None:
    runs = [
        # grpo: reaches 0.8 at steps 10, 20, 20: median 20
        _run("reverse", "grpo", 0, [0.5, 0.8, 0.9]),
        _run("reverse", "grpo", 1, [0.5, 0.7, 0.85]),
        _run("reverse", "grpo", 2, [0.4, 0.6, 0.8]),
        # flat: one seed reaches 0.8, two never do: the median is never
        _run("reverse", "flat", 0, [0.5, 0.5, 0.52], grad_norm=0.0),
        _run("reverse", "flat", 1, [0.5, 0.8, 0.55], grad_norm=0.0),
        _run("reverse", "flat", 2, [0.5, 0.45, 0.45], grad_norm=0.0),
    ]
    result = _algorithms.summarize(runs, setup="made up")
    grpo, flat = (result.figures["summary"]["reverse"][p] for p in ("grpo", "flat"))

    assert grpo["gain"] == {"median": 0.4, "min": 0.35, "max": 0.4}
    assert grpo["steps_to_threshold"] == 20 and grpo["s_to_threshold"] == 20.0
    assert grpo["seeds_reaching_threshold"] == 3 and grpo["verdict"] == "learns"
    assert grpo["tokens_per_s"] == 101.0 and grpo["peak_rss_mib"] == 401.0 and grpo["rss_growth_mib"] == 11.0
    assert grpo["s_per_step"] == 1.0 and grpo["steps"] == 20

    assert flat["gain"] == {"median": 0.02, "min": -0.05, "max": 0.05}
    assert flat["steps_to_threshold"] is None and flat["s_to_threshold"] is None
    assert flat["seeds_reaching_threshold"] == 1
    assert flat["verdict"] == "does not learn" and flat["metrics"]["grad_norm"] == 0.0

    assert result.figures["eval_steps"]["reverse"] == [0, 10, 20]
    assert result.figures["curves"]["reverse"]["grpo"] == [0.5, 0.7, 0.85]  # the median at each step
    assert {t.name: t.ok for t in result.targets} == {"reverse_grpo_gain": True, "runs_failed": True}

    rows = _algorithms.table(result.figures, "reverse").splitlines()
    assert rows[0].startswith("| preset | held-out gain") and len(rows) == 4
    assert rows[2].startswith("| `grpo` | +0.400 [+0.350, +0.400] | 0.500 -> 0.850 | 20 | 20.0 |")
    assert "| not reached (1/3 seeds) | not reached |" in rows[3] and rows[3].endswith("| does not learn |")
    assert "made up" in result.report() and rows[2] in result.report()


def test_a_failed_run_is_a_row_and_a_missed_target_not_an_exception(tmp_path: Path) -> None:
    runs = [
        _run("calculator", "grpo", 0, [0.4, 0.5, 0.6]),
        {"task": "calculator", "seed": 0, "preset": "broken", "error": "ValueError: no"},
    ]
    result = _algorithms.summarize(runs)
    broken = result.figures["summary"]["calculator"]["broken"]
    assert broken == {"verdict": "failed", "seeds": 1, "why": "seed 0: ValueError: no"}
    assert "| `broken` | - | - | - | - | - | - | failed: seed 0: ValueError: no |" in _algorithms.table(
        result.figures, "calculator"
    )
    targets = {t.name: (t.value, t.ok) for t in result.targets}
    assert targets == {"calculator_grpo_gain": (0.2, True), "runs_failed": (1, False)}
    assert not result.ok
    png = _algorithms.plot(json.loads(result.to_json())["figures"], tmp_path / "measured.png")
    assert png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_bench_runs_two_presets_from_one_warm_start_and_reports_what_a_user_reads() -> None:
    result = _algorithms.run(
        presets=["grpo", "cispo"],
        tasks=("reverse",),
        seeds=(0,),
        steps={"reverse": 2},
        eval_every=1,
        eval_prompts=8,
        warmup_steps=2,
        in_process=True,
    )
    out = json.loads(result.to_json())
    assert out["bench"] == "algorithms" and "algorithms" in BENCHES
    figures = out["figures"]
    assert figures["tasks"] == ["reverse"] and figures["eval_steps"]["reverse"] == [0, 1, 2]
    assert "2 presets" in figures["setup"] and "reverse 2 RL steps" in figures["setup"]
    for preset in ("grpo", "cispo"):
        s = figures["summary"]["reverse"][preset]
        assert s["steps"] == 2 and s["seeds"] == 1
        assert s["verdict"] in ("learns", "does not learn")
        assert s["tokens_per_s"] > 0 and s["peak_rss_mib"] > 0 and s["s_per_step"] > 0
        for key in ("gain", "start_accuracy", "end_accuracy"):
            assert set(s[key]) == {"median", "min", "max"}
        assert {"grad_norm", "clip_fraction", "groups_dropped", "entropy"} <= set(s["metrics"])
        assert len(figures["curves"]["reverse"][preset]) == 3
    # both presets start from the same checkpoint: the same held-out accuracy at step 0
    assert figures["curves"]["reverse"]["grpo"][0] == figures["curves"]["reverse"]["cispo"][0]
    assert set(out["targets"]) == {"reverse_grpo_gain", "runs_failed"}
    assert out["targets"]["runs_failed"]["ok"]
    assert "| `cispo` |" in result.report()

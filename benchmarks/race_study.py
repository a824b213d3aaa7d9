"""The race's study: why rlnb's and TRL's per-step curves differ, over seeds.

``vs_trl.py study`` runs the matrix below one run at a time (each a process of its
own, ``--threads`` torch threads each), from one warm-up shared by every run, in the
order below so that a study stopped early has the most informative runs; a run whose
``curve.json`` exists is not run again. After each run ``vs_trl.py report`` rewrites
``study.json`` (every run's curve and figures, and each group's median and range over
seeds), ``study.md`` (the tables) and ``study.png`` (the curves, median and range)::

    .venv/bin/python benchmarks/vs_trl.py study --out runs/race_study --threads 1 --steps 2500
    .venv/bin/python benchmarks/vs_trl.py report --out runs/race_study

Steps to an accuracy do not depend on the machine's load; seconds per step do, so
timings compare only between runs of the same study on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import vs_trl

# (group, side, variant, rlnb's mode, rlnb's std, engine in a process, seed), in the
# order they run: the equal-conventions pairs first, then the std's and asynchrony's
# effects, then another variant.
_GROUPS: dict[str, dict[str, Any]] = {
    "TRL grpo": {"side": "trl", "variant": "grpo"},
    "rlnb sync, bessel": {"side": "rlnb", "variant": "grpo", "mode": "sync", "std": "bessel"},
    "rlnb sync, population": {"side": "rlnb", "variant": "grpo", "mode": "sync", "std": "population"},
    "rlnb async (engine process), bessel": {
        "side": "rlnb",
        "variant": "grpo",
        "mode": "async",
        "std": "bessel",
        "engine_process": True,
    },
    "TRL gspo": {"side": "trl", "variant": "gspo"},
    "rlnb sync gspo, bessel": {"side": "rlnb", "variant": "gspo", "mode": "sync", "std": "bessel"},
}
ORDER: tuple[tuple[str, int], ...] = (
    ("TRL grpo", 0),
    ("rlnb sync, bessel", 0),
    ("TRL grpo", 1),
    ("rlnb sync, bessel", 1),
    ("rlnb sync, population", 0),
    ("rlnb async (engine process), bessel", 0),
    ("TRL grpo", 2),
    ("rlnb sync, bessel", 2),
    ("rlnb sync, population", 1),
    ("rlnb async (engine process), bessel", 1),
    ("TRL gspo", 0),
    ("rlnb sync gspo, bessel", 0),
    ("TRL grpo", 3),
    ("rlnb sync, bessel", 3),
    ("TRL grpo", 4),
    ("rlnb sync, bessel", 4),
    ("rlnb async (engine process), bessel", 2),
    ("TRL gspo", 1),
    ("rlnb sync gspo, bessel", 1),
)


def _run(group: str, seed: int) -> dict[str, Any]:
    spec = {"mode": "sync", "std": "bessel", "engine_process": False} | _GROUPS[group]
    return spec | {"group": group, "seed": seed}


def _dir(out: Path, group: str, seed: int) -> Path:
    slug = "".join(c if c.isalnum() else "-" for c in group.lower()).strip("-")
    return out / "runs" / f"{slug}-seed{seed}"


def study(args: argparse.Namespace) -> int:
    """Runs the matrix (skipping runs already done), reporting after each. Blocks."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    warm = vs_trl._warm(args, env)
    (out / "recipe.json").write_text(json.dumps({"steps": args.steps, "lr": args.lr, "threads": args.threads}))
    for group, seed in ORDER:
        run_dir = _dir(out, group, seed)
        if (run_dir / "curve.json").exists():
            continue
        print(f"{group}, seed {seed}", flush=True)
        with open(out / "log.txt", "a") as log:
            done = subprocess.run(
                vs_trl._command(args, _run(group, seed), run_dir, warm), env=env, stdout=log, stderr=log
            )
        if done.returncode:
            print(f"{group}, seed {seed}: exit {done.returncode} (see {out / 'log.txt'})", flush=True)
        # a fresh process, so that the report's code may change while the study runs
        subprocess.run([sys.executable, vs_trl.__file__, "report", "--out", str(out)], env=env, check=False)
    return 0


def _spread(values: list[float | None]) -> dict[str, Any]:
    """Median and range of per-seed values; None (never reached) counts as the largest."""
    reached = sorted(v for v in values if v is not None)
    missing = len(values) - len(reached)
    ordered: list[float] = reached + [float("inf")] * missing
    median = statistics.median(ordered) if ordered else None
    return {
        "per_seed": values,
        "median": None if median is None or median == float("inf") else median,
        "min": reached[0] if reached else None,
        "max": None if missing or not reached else reached[-1],
    }


def summarise(out: Path) -> dict[str, Any]:
    """Every finished run's figures, and each group's spread over its seeds."""
    runs: dict[str, Any] = {}
    for group, seed in ORDER:
        path = _dir(out, group, seed) / "curve.json"
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        figures = vs_trl._figures(result)
        figures["staleness_mean"] = result.get("staleness_mean")
        runs[f"{group}, seed {seed}"] = _run(group, seed) | {"figures": figures, "result": result}
    groups: dict[str, Any] = {}
    for group in _GROUPS:
        mine = [r for r in runs.values() if r["group"] == group]
        if not mine:
            continue
        per_seed: list[dict[str, Any]] = [r["figures"] for r in mine]
        summary: dict[str, Any] = {"seeds": [r["seed"] for r in mine]}
        for t in vs_trl.THRESHOLDS:
            reached = [f["reached"][f"{t}"] for f in per_seed]
            summary[f"step_to_{t}"] = _spread([None if r is None else r["step"] for r in reached])
        for key in ("final_accuracy", "s_per_step", "generated_tokens_per_s", "staleness_mean"):
            summary[key] = _spread([f[key] for f in per_seed])
        groups[group] = summary
    recipe = json.loads((out / "recipe.json").read_text()) if (out / "recipe.json").exists() else {}
    return {"recipe": recipe, "groups": groups, "runs": runs}


def _cell(spread: dict[str, Any], fmt: str) -> str:
    def one(v: float | None) -> str:
        return "never" if v is None else format(v, fmt)

    values = spread["per_seed"]
    if len(values) == 1:
        return one(values[0])
    return f"{one(spread['median'])} ({one(spread['min'])}-{one(spread['max'])}; {' / '.join(map(one, values))})"


def table(summary: dict[str, Any]) -> str:
    """The groups' figures as Markdown: median (range; per seed)."""
    steps = summary["recipe"].get("steps")
    lines = [
        f"{steps} steps each; median (min-max; per seed in seed order). Steps to an accuracy: the first"
        " evaluation (every 100 steps, 200 held-out prompts) at or above it.",
        "",
        "| run | seeds | step to 0.5 | step to 0.7 | step to 0.8 | final accuracy | s/step | tokens/s | staleness |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for group, g in summary["groups"].items():
        staleness = "-" if g["staleness_mean"]["per_seed"][0] is None else _cell(g["staleness_mean"], ".2f")
        cells = [
            group,
            ", ".join(map(str, g["seeds"])),
            *(_cell(g[f"step_to_{t}"], ".0f") for t in vs_trl.THRESHOLDS),
            _cell(g["final_accuracy"], ".3f"),
            _cell(g["s_per_step"], ".3f"),
            _cell(g["generated_tokens_per_s"], ",.0f"),
            staleness,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> None:
    """Held-out accuracy and the training reward (100-step means) against steps: each
    group's median over seeds, its range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (acc_ax, reward_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, group in enumerate(summary["groups"]):
        mine = [r["result"] for r in summary["runs"].values() if r["group"] == group]
        color = f"C{i}"
        n_points = min(len(r["curve"]) for r in mine)  # runs of one study have the same steps
        acc = np.array([[point[1] for point in r["curve"][:n_points]] for r in mine])
        steps = [point[0] for point in mine[0]["curve"][:n_points]]
        seeds = f"{len(mine)} seed" + ("s" if len(mine) > 1 else "")
        acc_ax.plot(steps, np.median(acc, 0), color=color, label=f"{group} ({seeds})")
        acc_ax.fill_between(steps, acc.min(0), acc.max(0), color=color, alpha=0.15)
        n = min(len(r.get("reward", [])) for r in mine) // 100
        if n:
            rewards = np.array([r["reward"][: n * 100] for r in mine])
            means = rewards[:, : n * 100].reshape(len(rewards), n, 100).mean(-1)
            x = np.arange(n) * 100 + 50
            reward_ax.plot(x, np.median(means, 0), color=color, label=group)
            reward_ax.fill_between(x, means.min(0), means.max(0), color=color, alpha=0.15)
    for t in vs_trl.THRESHOLDS:
        acc_ax.axhline(t, color="grey", lw=0.5, ls=":")
    acc_ax.set_ylabel("held-out greedy accuracy (200 prompts)")
    reward_ax.set_ylabel("training reward, mean of 100 steps")
    for ax in (acc_ax, reward_ax):
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    acc_ax.legend(loc="lower right", fontsize=8)
    fig.suptitle("rlnb vs TRL on the same model and recipe: median over seeds, range shaded")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: Path) -> int:
    """Writes study.json, study.md and study.png from the runs finished so far."""
    summary = summarise(out)
    if not summary["runs"]:
        print("no run has finished yet", flush=True)
        return 0
    (out / "study.json").write_text(json.dumps(summary, indent=1))
    text = table(summary)
    (out / "study.md").write_text(text)
    plot(summary, out / "study.png")
    print(text, flush=True)
    return 0

"""The race: rlnb against Hugging Face TRL's ``GRPOTrainer`` on the identical model.

Both train the same warmed-up 332K-parameter Llama (``trl_baseline.py``'s model,
tokenizer, task and reward; rlnb loads it through its Hugging Face path) with the
same recipe: GRPO, 16 prompts x 8 completions per step, temperature 1, at most 4
new tokens, lr 5e-4 decaying linearly to 0 over ``--steps``, AdamW (0.9, 0.999),
no weight decay, gradient norm clipped at 1, no KL, PPO clip 0.2, one pass per
batch, advantages centred and scaled by the group's std, the loss averaged over
every completion token of the batch (TRL's default ``loss_type="dapo"``). Both are
evaluated the same way, by ``trl_baseline.greedy_accuracy`` on the same 200
held-out prompts, which no training prompt repeats; evaluation time is left out
of both clocks.

TRL runs in a venv of its own (it is not an rlnb dependency)::

    python3.11 -m venv /tmp/trlenv
    /tmp/trlenv/bin/pip install -c .ci/constraints.txt torch "trl==1.16.*" datasets

Then, from the checkout, with rlnb's venv::

    .venv/bin/python benchmarks/vs_trl.py race --trl-python /tmp/trlenv/bin/python --out runs/vs_trl

``loss`` checks one step instead of racing: on one fixed batch of the same model,
each variant both ship (TRL's ``loss_type``s, clip-higher, GSPO, CISPO, SAPO,
``scale_rewards``, KL, the entropy bonus and filter, the mismatch corrections)
gives TRL's loss and gradient norm, by ``GRPOTrainer``'s own code in TRL's venv
(``trl_loss_side.py``), and rlnb's, by ``rlnb.algorithms.functional``
(``vs_trl_loss.py``); the table is in ``docs/algorithms.md``::

    .venv/bin/python benchmarks/vs_trl.py loss --trl-python /tmp/trlenv/bin/python --out runs/vs_trl_loss --threads 1

``race`` warms the model up once (in TRL's venv, as the baseline does) and then
runs the contenders one after the other, ``--rounds`` times, alternating who goes
first, so that both see the same machine. It writes ``race.json`` (every curve
and the figures) and ``race.png`` (held-out accuracy against steps and against
wall time) into ``--out``, and prints the report. ``--seed`` seeds both sides
(TRL's ``GRPOConfig.seed`` and its prompt list, rlnb's ``Config.seed``: its prompt
stream and sampling; the warm-up is the same model whatever the seed), ``--variant``
picks the algorithm on both (``VARIANTS``: grpo, dapo_clip_higher, gspo), ``--std``
rlnb's group std (``bessel``, TRL's, by default).

``study`` runs ``race_study.py``'s matrix over seeds and writes each group's steps
to 0.5/0.7/0.8, final accuracy, s/step and tokens/s with median and range
(``study.json``, ``study.md``, ``study.png``); ``docs/race.md`` has the figures and
what they say. In short: one run's curve is one draw from a wide spread (TRL with a
fixed seed repeats itself bit for bit, so earlier rounds raced one TRL curve against
new rlnb curves), and over seeds the two sides' steps to each accuracy overlap.

Time per step, measured on the 2-core CI machine, shared with other work (``race
--steps 400 --rounds 2 --threads 1``, the sides alternating within minutes;
round 1 / round 2):

==========================  ===================  ===================  ============
figure                      rlnb                 TRL 1.16             rlnb / TRL
==========================  ===================  ===================  ============
s/step, rlnb sync           0.074 / 0.082        0.105 / 0.111        0.70 / 0.74
generated tokens/s, sync    6,226 / 5,617        4,391 / 4,129        1.42 / 1.36
s/step, rlnb async          0.076 / 0.080        0.112 / 0.156        0.68 / 0.51
generated tokens/s, async   5,982 / 5,792        4,125 / 2,944        1.45 / 1.97
==========================  ===================  ===================  ============

(async: ``--mode async --engine-process``; TRL's second async round ran while the
machine was busier, which its own figure shows: compare rounds, not single runs.)
With one thread a side on two shared cores, async overlapping generation with the
update gained nothing over sync; on a quiet machine with two threads a side it took
0.070 s a step against 0.098 in sync (``docs/performance.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import trl_baseline as base  # noqa: E402  (the model, tokenizer, task, reward and evaluation)

THRESHOLDS = (0.5, 0.7, 0.8)
GROUPS, GROUP_SIZE, MAX_NEW = 16, 8, 4
# Each variant both ship: TRL's GRPOConfig fields, and rlnb's preset with its Algorithm
# fields on top (docs/algorithms.md's table checks each pair on one batch). With one
# update per batch every ratio is 1, so clip-higher changes nothing in sync mode (only
# rlnb's async steps, a policy behind, have ratios to clip); GSPO also averages each
# sequence's tokens before the batch (TRL's loss_type="grpo", rlnb's seq_mean_token_mean).
VARIANTS: dict[str, tuple[dict[str, Any], tuple[str, dict[str, Any]]]] = {
    "grpo": ({}, ("grpo", {})),
    "dapo_clip_higher": ({"epsilon_high": 0.28}, ("grpo", {"clip_high": 0.28})),
    "gspo": (
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
        ("gspo", {}),
    ),
}


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


# -- the contenders: each writes curve.json = {"curve": [[step, accuracy, seconds]], "tokens": N, "seconds": S}


def run_trl(out: Path, warm: Path, lr: float, steps: int, eval_every: int, seed: int, variant: str) -> dict[str, Any]:
    """TRL's GRPOTrainer, as in ``trl_baseline.grpo``, timing training apart from evaluation."""
    from datasets import Dataset
    from transformers import LlamaForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    model = LlamaForCausalLM.from_pretrained(warm)
    rows = base.grpo_rows(steps, seed)  # the baseline's recipe, the variant's fields on top
    args = base.grpo_args(out / "trl", lr, steps, seed, **VARIANTS[variant][0])
    curve: list[list[float]] = []
    clock = {"eval": 0.0, "start": 0.0}

    class Evaluate(TrainerCallback):  # type: ignore[misc]
        def _evaluate(self, step: int, model: Any) -> None:
            t = time.perf_counter()
            accuracy = base.greedy_accuracy(model)
            clock["eval"] += time.perf_counter() - t
            elapsed = time.perf_counter() - clock["start"] - clock["eval"]
            curve.append([step, accuracy, elapsed])
            print(f"trl step {step}: accuracy {accuracy:.3f}, {elapsed:.1f} s", flush=True)

        def on_train_begin(self, _args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            clock["start"] = time.perf_counter()
            self._evaluate(0, model)

        def on_step_end(self, _args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            if state.global_step % eval_every == 0:
                self._evaluate(state.global_step, model)

    generated, rewards = [0], []

    def reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kw: Any) -> list[float]:
        generated[0] += sum(len(ids) for ids in completion_ids)  # every completion token, end-of-sequence too
        values = base.reward(prompts, completions, **kw)
        rewards.append(sum(values) / len(values))  # one call per step: the step's 128 completions
        return values

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=base.make_tokenizer(),
        callbacks=[Evaluate()],
    )
    trainer.train()
    seconds = time.perf_counter() - clock["start"] - clock["eval"]
    return {"curve": curve, "tokens": generated[0], "seconds": seconds, "steps": steps, "reward": rewards}


def run_rlnb(
    out: Path,
    warm: Path,
    lr: float,
    steps: int,
    eval_every: int,
    seed: int,
    variant: str,
    std: str,
    mode: str,
    engine_process: bool = False,
) -> dict[str, Any]:
    """rlnb on the same model directory, through its Hugging Face path; with
    ``engine_process`` its engine runs in a process of its own."""
    import rlnb
    from rlnb.algorithms import preset
    from rlnb.data import Task, addition, register_task

    def make_prompt(rng: random.Random) -> tuple[str, str]:
        a, b = base.training_pair(rng)  # never a held-out pair, as in TRL's data
        return f"{a}+{b}=", str(a + b)

    # rlnb's addition reward is the baseline's: 1 for the exact answer, else 0.4 x characters in place
    register_task(Task("race_addition", addition.alphabet, make_prompt, addition.reward, MAX_NEW + 1), replace=True)
    name, fields = VARIANTS[variant][1]
    config = rlnb.Config(
        task="race_addition",
        seed=seed,  # the prompt stream and sampling; the model is the warm-up's whatever the seed
        mode=mode,
        engine=rlnb.EngineConfig(process=engine_process),
        data=rlnb.DataConfig(num_workers=0),  # the task is this script's: the session makes the prompts
        model=rlnb.ModelConfig(path=str(warm), max_len=32),
        rollout=rlnb.RolloutConfig(group_size=GROUP_SIZE, groups_per_step=GROUPS, max_new_tokens=MAX_NEW),
        learn=rlnb.LearnConfig(
            lr=lr,
            lr_decay_steps=steps,
            max_grad_norm=1.0,
            algorithm=preset(name).replace(std=std, **fields),  # no KL and clip 0.2 (GSPO's own) in every preset
        ),
    )
    curve: list[list[float]] = []
    rewards: list[float] = []
    staleness: list[float] = []
    with rlnb.Session(config, name="race") as sess:
        model = sess.policy.model  # the learner's transformers model, evaluated as TRL's is

        def evaluate(step: int, elapsed: float) -> None:
            accuracy = base.greedy_accuracy(model)
            curve.append([step, accuracy, elapsed])
            print(f"rlnb step {step}: accuracy {accuracy:.3f}, {elapsed:.1f} s", flush=True)

        evaluate(0, 0.0)
        tokens_before = sess.statistics().engine.generated_tokens
        seconds = 0.0
        for step in range(1, steps + 1):
            t = time.perf_counter()
            metrics = sess.step()
            seconds += time.perf_counter() - t
            rewards.append(metrics["reward_mean"])
            staleness.append(metrics["staleness"])
            if step % eval_every == 0:
                evaluate(step, seconds)
        tokens = sess.statistics().engine.generated_tokens - tokens_before
    result = {"curve": curve, "tokens": tokens, "seconds": seconds, "steps": steps, "reward": rewards}
    return result | {"staleness_mean": sum(staleness) / len(staleness)}


# -- the race ------------------------------------------------------------------------


def _time_to(curve: list[list[float]], threshold: float) -> tuple[int, float] | None:
    """The first (step, seconds) at which held-out accuracy reached ``threshold``."""
    for step, accuracy, seconds in curve:
        if accuracy >= threshold:
            return int(step), seconds
    return None


def _figures(run: dict[str, Any]) -> dict[str, Any]:
    reached = {f"{t}": _time_to(run["curve"], t) for t in THRESHOLDS}
    return {
        "s_per_step": run["seconds"] / run["steps"],
        "generated_tokens_per_s": run["tokens"] / run["seconds"],
        "final_accuracy": run["curve"][-1][1],
        "reached": {t: None if r is None else {"step": r[0], "seconds": round(r[1], 1)} for t, r in reached.items()},
    }


def _plot(runs: dict[str, list[dict[str, Any]]], path: Path, rlnb_label: str = "rlnb") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors = {"rlnb": "tab:blue", "trl": "tab:orange"}
    for name, rounds in runs.items():
        for i, run in enumerate(rounds):
            steps, accuracy, seconds = zip(*run["curve"], strict=True)
            label = (rlnb_label if name == "rlnb" else "TRL") + (f" (round {i + 1})" if len(rounds) > 1 else "")
            by_step.plot(steps, accuracy, color=colors[name], alpha=1 - 0.35 * i, label=label)
            by_time.plot(seconds, accuracy, color=colors[name], alpha=1 - 0.35 * i, label=label)
    for ax, xlabel in ((by_step, "RL step"), (by_time, "training wall time (s), evaluation excluded")):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        for t in THRESHOLDS:
            ax.axhline(t, color="grey", lw=0.5, ls=":")
    by_step.set_ylabel("held-out greedy accuracy (200 prompts)")
    by_step.legend(loc="lower right")
    fig.suptitle("GRPO on two-digit addition, the same 332K-parameter Llama: rlnb vs TRL")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _warm(args: argparse.Namespace, env: dict[str, str]) -> Path:
    """The warmed-up model, made once in ``--out`` (TRL's venv, ``trl_baseline.py``) and
    shared by every run whatever its seed."""
    warm = args.out / "warm"
    if not (warm / "config.json").exists():
        print("warm-up (TRL's venv, trl_baseline.py)", flush=True)
        warmup = [args.trl_python, str(HERE / "trl_baseline.py"), "warmup", "--out", str(args.out)]
        subprocess.run([*warmup, "--threads", str(args.threads)], check=True, env=env)
    return warm


def _command(args: argparse.Namespace, run: dict[str, Any], out: Path, warm: Path) -> list[str]:
    """One contender's run as a process of its own: TRL's in TRL's venv, rlnb's in this one."""
    common = ["--out", str(out), "--warm", str(warm), "--lr", str(args.lr), "--steps", str(args.steps)]
    common += ["--eval-every", str(args.eval_every), "--threads", str(args.threads)]
    common += ["--seed", str(run["seed"]), "--variant", run["variant"]]
    if run["side"] == "trl":
        return [args.trl_python, __file__, "trl", *common]
    rlnb = [sys.executable, __file__, "rlnb", *common, "--std", run["std"], "--mode", run["mode"]]
    return rlnb + (["--engine-process"] if run["engine_process"] else [])


def race(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    warm = _warm(args, env)
    common = {"seed": args.seed, "variant": args.variant}
    rlnb_run = common | {"side": "rlnb", "std": args.std, "mode": args.mode, "engine_process": args.engine_process}
    commands = {
        "trl": _command(args, common | {"side": "trl"}, out / "trl", warm),
        "rlnb": _command(args, rlnb_run, out / "rlnb", warm),
    }
    runs: dict[str, list[dict[str, Any]]] = {"rlnb": [], "trl": []}
    for r in range(args.rounds):
        order = ["trl", "rlnb"] if r % 2 == 0 else ["rlnb", "trl"]
        for name in order:
            print(f"round {r + 1}: {name}", flush=True)
            subprocess.run(commands[name], check=True, env=env)
            runs[name].append(json.loads((out / name / "curve.json").read_text()))
    figures = {name: [_figures(run) for run in rounds] for name, rounds in runs.items()}
    report = {"recipe": vars(args) | {"out": str(out), "trl_python": args.trl_python}, "figures": figures, "runs": runs}
    (out / "race.json").write_text(json.dumps(report, indent=1, default=str))
    _plot(runs, out / "race.png", _label(args))
    print(json.dumps(figures, indent=1))
    return 0


def loss(args: argparse.Namespace) -> int:
    """One step's loss and gradient norm of every variant both ship, TRL's against
    rlnb's, on one fixed batch (``vs_trl_loss.py``); prints the table and writes it
    (``table.md``, ``table.json``) into ``--out``. Returns 1 if a row without a note
    (a known difference) does not agree within 1e-5 on TRL's advantages."""
    import vs_trl_loss

    _set_threads(args.threads)
    table = vs_trl_loss.compare(args.out, args.trl_python, threads=args.threads)
    print((args.out / "table.md").read_text())
    # a row without a note must agree on the loss code (rlnb's loss on TRL's advantages)
    unexpected = [row["variant"] for row in table if not row["note"] and not row["same_advantages_agree"]]
    if unexpected:
        print(f"not as expected: {', '.join(unexpected)}", flush=True)
    return 1 if unexpected else 0


def _label(args: argparse.Namespace) -> str:
    """rlnb's curve's name: its mode, its std, and where its engine ran."""
    return f"rlnb {args.mode}, {args.std} std" + (", engine in a process" if args.engine_process else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=("race", "study", "report", "trl", "rlnb", "loss"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--warm", type=Path, help="trl/rlnb: the warmed-up model directory")
    parser.add_argument("--trl-python", default="/tmp/trlenv/bin/python", help="race, loss: TRL's venv's python")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--steps", type=int, default=3800, help="RL steps (the lr decays linearly to 0 over them)")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=1, help="race: runs of each, alternating who goes first")
    parser.add_argument("--seed", type=int, default=0, help="both: sampling and the prompts' order (not the model)")
    parser.add_argument("--variant", choices=tuple(VARIANTS), default="grpo", help="the algorithm, on both sides")
    parser.add_argument(
        "--std", choices=("bessel", "population"), default="bessel", help="rlnb's group std (TRL's: bessel)"
    )
    parser.add_argument("--mode", choices=("sync", "async"), default="sync", help="rlnb's mode")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each contender")
    parser.add_argument(
        "--engine-process", action="store_true", help="rlnb's engine in a process of its own (EngineConfig.process)"
    )
    args = parser.parse_args(argv)
    if args.stage == "race":
        return race(args)
    if args.stage == "study":
        import race_study

        return race_study.study(args)
    if args.stage == "report":
        import race_study

        return race_study.report(args.out)
    if args.stage == "loss":
        return loss(args)
    _set_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "trl":
        result = run_trl(args.out, args.warm, args.lr, args.steps, args.eval_every, args.seed, args.variant)
    else:
        result = run_rlnb(
            args.out,
            args.warm,
            args.lr,
            args.steps,
            args.eval_every,
            args.seed,
            args.variant,
            args.std,
            args.mode,
            args.engine_process,
        )
    (args.out / "curve.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``rlnb`` command: ``rlnb demo``, ``rlnb train`` and ``rlnb bench NAME``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

BENCHES = ("bridge", "close", "notebook", "rollout", "train")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlnb", description="Notebook-first RL post-training of language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="train the tiny built-in policy on digit addition on CPU (warm-up, then GRPO)")
    demo.add_argument(
        "--run-dir", default="runs/demo", help="where metrics.jsonl and curves.png go (default: %(default)s)"
    )
    _add_output_options(demo)

    train = sub.add_parser("train", help="train on any task with any settings (the demo's by default)")
    train.add_argument("--task", default="addition", help="a registered task: addition, reverse, sort, ...")
    train.add_argument("--steps", type=int, required=True, help="most RL steps to take")
    train.add_argument("--run-dir", required=True, help="where metrics.jsonl and curves.png go")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--mode", choices=("sync", "async"), default="sync")
    train.add_argument("--warmup-steps", type=int, help="supervised warm-up steps before RL")
    train.add_argument("--lr", type=float, help="RL learning rate")
    train.add_argument(
        "--lr-decay-steps", type=int, help="decay the RL learning rate linearly to 0 over this many steps"
    )
    train.add_argument("--group-size", type=int, help="completions per prompt")
    train.add_argument("--groups-per-step", type=int, help="prompts per RL step")
    train.add_argument("--temperature", type=float, help="sampling temperature of rollouts")
    train.add_argument("--num-workers", type=int, help="prompt-loader worker processes")
    train.add_argument("--eval-every", type=int, default=25, help="RL steps between held-out evaluations")
    train.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts per evaluation")
    train.add_argument("--target-accuracy", type=float, help="stop once held-out accuracy reaches this")
    _add_output_options(train)

    bench = sub.add_parser("bench", help="run a benchmark against a floor measured in the same run")
    bench.add_argument("name", choices=BENCHES, help="which benchmark")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    bench.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    bench.add_argument("--tracker", choices=("wandb",), help="close: also time a session with this tracker")
    return parser


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tracker",
        default="console,jsonl,plot",
        help="tracker backends, comma-separated, from console, jsonl, wandb, plot (default: %(default)s); "
        "wandb follows WANDB_MODE (offline by default) and writes under the run dir",
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line of results")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _train_config(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The config and run options for ``rlnb train``: the demo's, with the flags applied."""
    from rlnb._run import demo_settings

    config, options = demo_settings()
    config = config.replace(task=args.task, seed=args.seed, mode=args.mode)
    changes = {
        "warmup": {"steps": args.warmup_steps},
        "learn": {"lr": args.lr, "lr_decay_steps": args.lr_decay_steps},
        "rollout": {
            "group_size": args.group_size,
            "groups_per_step": args.groups_per_step,
            "temperature": args.temperature,
        },
        "data": {"num_workers": args.num_workers},
    }
    for part, values in changes.items():
        given = {k: v for k, v in values.items() if v is not None}
        if given:
            config = config.replace(**{part: dataclasses.replace(getattr(config, part), **given)})
    options = {
        **options,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "eval_prompts": args.eval_prompts,
        "target_accuracy": args.target_accuracy,
    }
    return config, options


def _train(args: argparse.Namespace) -> int:
    import rlnb
    from rlnb._run import demo_settings, run

    try:
        config, options = _train_config(args) if args.command == "train" else demo_settings()
        trackers = tuple(t.strip() for t in args.tracker.split(",") if t.strip())
        result = run(config, run_dir=args.run_dir, progress=not args.no_progress, trackers=trackers, **options)
    except rlnb.ConfigError as exc:
        print(f"rlnb {args.command}: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(result.to_json())
    return 0


def _bench(name: str, as_json: bool, strict: bool, tracker: str | None = None) -> int:
    import importlib

    if tracker is not None and name != "close":
        print(f"rlnb bench {name}: error: --tracker applies to 'close' only", file=sys.stderr)
        return 2
    module = importlib.import_module(f"rlnb.bench._{name}")
    result = module.run(tracker=tracker) if tracker else module.run()
    print(result.to_json() if as_json else result.report())
    return 1 if strict and not result.ok else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command in ("demo", "train"):
        return _train(args)
    if args.command == "bench":
        return _bench(args.name, args.json, args.strict, args.tracker)
    raise AssertionError(args.command)  # argparse enforces the choices


if __name__ == "__main__":
    sys.exit(main())

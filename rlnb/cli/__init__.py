"""The ``rlnb`` command: ``rlnb demo``, ``rlnb train``, ``rlnb bench NAME`` and
``rlnb make-tiny-llama DIR``.

Bad input (a flag's value, an unknown flag, a setting the config refuses) is one
line on stderr that names the flag and the fix, and exit status 2, before anything
starts.

Where output goes: results, stage lines and the console tracker's lines on stdout;
progress on stderr (a bar in a terminal, a plain line every few seconds in a file or
log). ``--json`` keeps stdout to the one JSON line (the rest goes to stderr);
``--quiet`` prints nothing but errors and that last line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from rlnb._checks import SEED_LIMIT
from rlnb.algorithms import PRESETS
from rlnb.cli._run import demo_settings
from rlnb.config import ENGINE_KINDS, MODEL_DTYPES

__all__ = ["demo_settings", "main"]

ENV_DEMOS = ("calculator",)  # the built-in tasks with an environment that `rlnb demo --env` runs
BENCHES = (
    "algorithms",
    "bridge",
    "close",
    "critic",
    "engines",
    "learner",
    "lora",
    "notebook",
    "ray",
    "rollout",
    "serve",
    "soak",
    "train",
    "turns",
)
# The flags of one benchmark each: flag dest -> the benchmark that takes it.
BENCH_OPTIONS = {
    "tracker": "close",
    "quick": "serve",
    "model": "serve",
    "tokens": "serve",
    "ranks": "learner",
    "strategy": "learner",
}

# Flags that set a config field: flag dest -> (Config part or None, field). Applied in
# this order, so a model's path is set before the engine that has to serve it.
CONFIG_FLAGS = {
    "model": ("model", "path"),
    "dtype": ("model", "dtype"),
    "device": ("model", "device"),
    "max_len": ("model", "max_len"),
    "lora": ("model", "lora"),
    "engine": ("engine", "kind"),
    "engine_process": ("engine", "process"),
    "task": (None, "task"),
    "seed": (None, "seed"),
    "mode": (None, "mode"),
    "warmup_steps": ("warmup", "steps"),
    "warmup_task": ("warmup", "task"),
    "lr": ("learn", "lr"),
    "lr_decay_steps": ("learn", "lr_decay_steps"),
    "algorithm": ("learn", "algorithm"),
    "group_size": ("rollout", "group_size"),
    "groups_per_step": ("rollout", "groups_per_step"),
    "temperature": ("rollout", "temperature"),
    "num_workers": ("data", "num_workers"),
    "micro_batch_size": ("learn", "micro_batch_size"),
    "ray_replicas": ("ray", "engine_replicas"),
    "learner_ranks": ("learn", "ranks"),
    "learner_strategy": ("learn", "strategy"),
    "ray_address": ("ray", "address"),
}


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (the usage is a ``--help`` away), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_from(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int: use an int >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is invalid: use an int >= {minimum}")
        return value

    return parse


def _seed(text: str) -> int:
    """An argparse type: a seed, an int >= 0 and < 2**32 (what every generator it seeds takes)."""
    value = _int_from(0)(text)
    if value >= SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{value} is invalid: use an int >= 0 and < 2**32, e.g. 0")
    return value


def _fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number: use a value in (0, 1], e.g. 0.9") from None
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"{value} is invalid: use a value in (0, 1], e.g. 0.9")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rlnb", description="Notebook-first RL post-training of language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="train the tiny built-in policy to reverse words on CPU: a warm-up that imitates a sloppy teacher, "
        "then GRPO, which unlearns the teacher's slip",
    )
    demo.add_argument(
        "--run-dir", default="runs/demo", help="where metrics.jsonl and curves.png go (default: %(default)s)"
    )
    demo.add_argument("--seed", type=_seed, help="seeds the model, data and sampling (default: 0)")
    demo.add_argument(
        "--env",
        choices=ENV_DEMOS,
        help="the demo of a multi-turn environment instead: 'calculator', where RL teaches the policy to call "
        "a calculator tool for the products it cannot do in its head",
    )
    _add_model_options(demo)
    _add_output_options(demo)

    train = sub.add_parser("train", help="train on any task with any settings (the demo's by default)")
    train.add_argument("--task", help="a registered task: addition, reverse, sort, ... (default: the demo's, reverse)")
    data = train.add_argument_group("your own data (instead of --task)")
    data.add_argument(
        "--data", metavar="FILE", help="train on the records of a .jsonl, .json or .parquet file (Task.from_records)"
    )
    data.add_argument("--prompt-field", default="prompt", help="the records' prompt field (default: %(default)s)")
    data.add_argument("--answer-field", default="answer", help="the records' answer field (default: %(default)s)")
    data.add_argument(
        "--reward",
        default="exact_match",
        help="reward functions of rlnb.rewards, comma-separated: exact_match, math_answer, regex_format:PATTERN, "
        "length_penalty:LIMIT (default: %(default)s)",
    )
    data.add_argument("--reward-weights", metavar="W,W,...", help="one weight per --reward function (default: 1 each)")
    data.add_argument(
        "--eval-size",
        type=float,
        default=200,
        help="records held out for evaluation: a number, or a fraction below 1 (default: %(default)s)",
    )
    train.add_argument("--steps", type=_int_from(0), required=True, help="most RL steps to take")
    train.add_argument("--run-dir", required=True, help="where metrics.jsonl and curves.png go")
    train.add_argument("--seed", type=_seed, default=0, help="seeds the model, data and sampling")
    train.add_argument("--mode", choices=("sync", "async"), default="sync")
    train.add_argument("--warmup-steps", type=int, help="supervised warm-up steps before RL")
    train.add_argument(
        "--warmup-task",
        help="the task whose answers the warm-up imitates, or 'none' for the task's own (default: the demo's "
        "sloppy_reverse with the demo's task, else none)",
    )
    train.add_argument("--lr", type=float, help="RL learning rate")
    train.add_argument(
        "--lr-decay-steps", type=int, help="decay the RL learning rate linearly to 0 over this many steps"
    )
    train.add_argument(
        "--algorithm",
        choices=tuple(PRESETS),
        metavar="NAME",
        help=f"the RL algorithm, a preset of rlnb.algorithms: {', '.join(PRESETS)} (default: grpo)",
    )
    train.add_argument("--group-size", type=int, help="completions per prompt")
    train.add_argument("--groups-per-step", type=int, help="prompts per RL step")
    train.add_argument("--temperature", type=float, help="sampling temperature of rollouts")
    train.add_argument("--num-workers", type=int, help="prompt-loader worker processes")
    train.add_argument(
        "--micro-batch-size", type=int, help="sequences per forward and backward pass (gradients accumulate)"
    )
    train.add_argument(
        "--ray-replicas", type=int, help="engine replicas as Ray actors (a local Ray cluster unless --ray-address)"
    )
    train.add_argument(
        "--learner-ranks",
        type=int,
        help="learner processes as Ray actors, the gradients summed (default: 1, in process)",
    )
    train.add_argument(
        "--learner-strategy",
        choices=("fsdp", "ddp"),
        help="with --learner-ranks: shard the model across the ranks (fsdp, the default) or copy it to each (ddp)",
    )
    train.add_argument("--ray-address", help="attach to this Ray cluster ('auto', HOST:PORT or ray://...)")
    train.add_argument("--eval-every", type=_int_from(1), default=25, help="RL steps between held-out evaluations")
    train.add_argument("--eval-prompts", type=_int_from(1), default=200, help="held-out prompts per evaluation")
    train.add_argument("--target-accuracy", type=_fraction, help="stop once held-out accuracy reaches this")
    _add_model_options(train)
    _add_output_options(train)

    bench = sub.add_parser("bench", help="run a benchmark against a floor measured in the same run")
    bench.add_argument("name", choices=BENCHES, help="which benchmark")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    bench.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    bench.add_argument("--tracker", choices=("wandb",), help="close: also time a session with this tracker")
    bench.add_argument("--quick", action="store_true", help="serve: a small run of a few seconds (1 and 8 clients)")
    bench.add_argument(
        "--model", metavar="DIR", help="serve: a Hugging Face model directory instead of the built-in tiny policy"
    )
    bench.add_argument(
        "--tokens", type=_int_from(1), metavar="N", help="serve: new tokens a call of the tokens/s rounds (default 64)"
    )
    bench.add_argument("--ranks", metavar="N,M", help="learner: the learner's rank counts to compare (default 1,2)")
    bench.add_argument(
        "--strategy", metavar="fsdp,ddp", help="learner: how the N ranks hold the model, one or both (default fsdp,ddp)"
    )

    tiny = sub.add_parser(
        "make-tiny-llama", help="build a small random Llama and its tokenizer into a directory, offline, for --model"
    )
    tiny.add_argument("dir", metavar="DIR", help="a new or empty directory to write it to")
    tiny.add_argument("--seed", type=_seed, default=0, help="seed of its random weights (default: %(default)s)")
    tiny.add_argument(
        "--task",
        default="reverse",
        help="the task whose characters the tokenizer knows (default: %(default)s, the demo's)",
    )
    parser.set_defaults(commands={"demo": demo, "train": train, "bench": bench, "make-tiny-llama": tiny})
    return parser


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="DIR",
        help="train the Hugging Face causal LM in this local directory (nothing is downloaded; "
        "rlnb make-tiny-llama builds one) instead of the built-in tiny policy",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINE_KINDS,
        help="the generation engine: tiny (the built-in policy's), hf (a --model's, on its --device) or vllm "
        "(default: the model's own)",
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        help="run the tiny or hf engine in a process of its own, so that async mode generates and learns at "
        "once on two cores (default: in this process, on a thread)",
    )
    parser.add_argument(
        "--dtype", choices=MODEL_DTYPES, help="the --model's weights: float32 (for CPUs) or bfloat16 (for GPUs)"
    )
    parser.add_argument("--device", help="where the --model learns (and the hf engine runs): cpu, cuda or cuda:N")
    parser.add_argument("--max-len", type=_int_from(1), help="context length in tokens, prompt and completion")
    parser.add_argument(
        "--lora-r", type=int, help="train a LoRA adapter of this rank on the --model instead of all its weights"
    )


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tracker",
        default="console,jsonl,plot",
        help="tracker backends, comma-separated, from console, jsonl, wandb, plot (default: %(default)s); "
        "wandb follows WANDB_MODE (offline by default) and writes under the run dir",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON line of results, and nothing else, on stdout (the rest goes to stderr)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="print nothing but errors and, at the end, one line of results (JSON with --json); "
        "no progress and no console tracker",
    )


def _train_config(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The config and run options for ``rlnb train`` or ``rlnb demo``: the demo's, with
    the command's flags applied one by one, so a ConfigError names the flag that caused it."""
    from rlnb import ConfigError

    config, options = demo_settings(env=getattr(args, "env", None))
    if args.lora_r is not None:
        from rlnb import LoraConfig

        try:
            args.lora = LoraConfig(r=args.lora_r)
        except ConfigError as exc:
            raise ConfigError(f"--lora-r {args.lora_r}: {exc}") from None
    if getattr(args, "data", None) is not None:
        if args.task is not None:
            raise ConfigError(f"--data {args.data} and --task {args.task}: give one, the task or your data")
        args.task = _data_task(args).name
    if args.dtype is not None and args.model is None:
        raise ConfigError(f"--dtype {args.dtype} applies to a --model only: the built-in policy is float32")
    if args.device is not None and args.model is None:
        raise ConfigError(f"--device {args.device} applies to a --model only: the built-in policy runs on the CPU")
    if getattr(args, "task", None) not in (None, config.task):  # the demo's teacher writes the demo's task only
        config = config.replace(warmup=dataclasses.replace(config.warmup, task=None))
    for dest, (part, field) in CONFIG_FLAGS.items():
        value = getattr(args, dest, None)  # the demo has the model flags only
        if value is None:
            continue
        changes = {field: None if dest == "warmup_task" and value == "none" else value}
        if dest == "group_size":  # no flag sets max_inflight: make room for one whole group
            changes["max_inflight"] = max(config.rollout.max_inflight, value)
        try:
            if part is None:
                config = config.replace(**changes)
            else:
                config = config.replace(**{part: dataclasses.replace(getattr(config, part), **changes)})
        except ConfigError as exc:
            shown = repr(value) if dest in ("model", "ray_address") else value  # may be empty or hold spaces
            hint = "; pass --warmup-task none for the task's own answers" if dest == "warmup_task" else ""
            flag = f"--{dest.replace('_', '-')} {shown}" if dest != "lora" else f"--lora-r {args.lora_r}"
            raise ConfigError(f"{flag}: {exc}{hint}") from None
    if args.command == "demo":
        return config, options
    options = {
        **options,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "eval_prompts": args.eval_prompts,
        "target_accuracy": args.target_accuracy,
    }
    return config, options


# The functions of rlnb.rewards --reward names; those after a colon take an argument.
_REWARDS = ("exact_match", "math_answer", "regex_format:", "length_penalty:")


def _data_task(args: argparse.Namespace) -> Any:
    """``--data`` and its flags as a registered task named after the file."""
    from rlnb import ConfigError, rewards
    from rlnb.data import Task, register_task

    functions: list[Any] = []
    for spec in _reward_specs(args.reward):
        name, _, argument = spec.partition(":")
        if name == "regex_format":
            functions.append(rewards.regex_format(argument))
        elif name == "length_penalty":
            try:
                limit = int(argument)
            except ValueError:
                raise ConfigError(
                    f"--reward {spec}: the limit must be a whole number, e.g. length_penalty:200"
                ) from None
            functions.append(rewards.length_penalty(limit))
        else:
            functions.append(getattr(rewards, name))
    weights = None
    if args.reward_weights is not None:
        try:
            weights = [float(w) for w in args.reward_weights.split(",")]
        except ValueError:
            raise ConfigError(
                f"--reward-weights {args.reward_weights}: give numbers, comma-separated, e.g. 1,0.2"
            ) from None
    # A whole number on the command line is a count of records (0: none), anything else a fraction.
    eval_size = int(args.eval_size) if args.eval_size.is_integer() else args.eval_size
    if eval_size == 0:
        raise ConfigError(
            "--eval-size 0: rlnb train measures the policy on held-out records before and after training; "
            "hold out some, e.g. --eval-size 0.1 or --eval-size 200"
        )
    try:
        task = Task.from_records(
            f"data:{Path(args.data).stem}",
            Path(args.data).expanduser(),
            prompt=args.prompt_field,
            answer=args.answer_field,
            reward=functions,
            reward_weights=weights,
            eval_size=eval_size,
        )
    except ConfigError as exc:
        for argument, flag in (
            ("records=", "--data"),
            ("prompt=", "--prompt-field"),
            ("answer=", "--answer-field"),
            ("eval_size=", "--eval-size"),
            ("reward_weights=", "--reward-weights"),
        ):
            if argument in str(exc):
                raise ConfigError(f"{flag}: {exc}") from None
        raise
    return register_task(task, replace=True)


def _reward_specs(text: str) -> list[str]:
    """``--reward``'s functions: split at the commas, but for those inside a
    regex_format pattern; ConfigError naming an unknown one."""
    from rlnb import ConfigError

    specs: list[str] = []
    for piece in text.split(","):
        known = any(piece == r or (r.endswith(":") and piece.startswith(r)) for r in _REWARDS)
        if specs and not known and specs[-1].startswith("regex_format:"):
            specs[-1] += "," + piece  # a comma of the pattern
        else:
            specs.append(piece)
    for spec in specs:
        if not any(spec == r or (r.endswith(":") and spec.startswith(r)) for r in _REWARDS):
            raise ConfigError(
                f"--reward {spec!r} is unknown: use exact_match, math_answer, regex_format:PATTERN or "
                "length_penalty:LIMIT, comma-separated"
            )
    return specs


def _trackers(args: argparse.Namespace) -> tuple[str, ...]:
    """``--run-dir`` and ``--tracker`` checked as the run will use them (a ConfigError naming the flag)."""
    from rlnb import ConfigError, TrackConfig
    from rlnb.track import wandb_mode_from_env

    trackers = tuple(t.strip() for t in args.tracker.split(",") if t.strip())
    checks: list[tuple[str, Any, dict[str, Any]]] = [
        ("--run-dir", args.run_dir, {"run_dir": args.run_dir or None, "backends": ("jsonl",)}),
        ("--tracker", args.tracker, {"backends": trackers}),
        ("WANDB_MODE", os.environ.get("WANDB_MODE"), {"backends": trackers, "wandb_mode": wandb_mode_from_env()}),
    ]
    for flag, value, fields in checks:
        try:
            TrackConfig(**{"run_dir": args.run_dir, **fields})
        except ConfigError as exc:
            raise ConfigError(f"{flag} {value!r}: {exc}") from None
    if not trackers:
        raise ConfigError(f"--tracker {args.tracker!r} names no backend: use some of console, jsonl, wandb, plot")
    return trackers


def _train(args: argparse.Namespace) -> int:
    import rlnb
    from rlnb.cli._run import run

    try:
        config, options = _train_config(args)
        trackers = _trackers(args)
        if args.quiet:
            trackers = tuple(t for t in trackers if t != "console")
        # with --json, stdout holds the results line only: the rest (stage lines, the
        # console tracker's) goes to stderr
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            result = run(
                config,
                run_dir=args.run_dir,
                progress=not (args.no_progress or args.quiet),
                trackers=trackers,
                echo=_silent if args.quiet else print,
                **options,
            )
    except rlnb.ConfigError as exc:
        print(f"rlnb {args.command}: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(result.to_json())
    elif args.quiet:
        print(f"rlnb {args.command}: {result.summary()}")
    return 0


def _silent(*args: object, **kwargs: object) -> None:
    """``--quiet``'s stage lines: none."""


def _bench(name: str, as_json: bool, strict: bool, **options: Any) -> int:
    """``options``: the flags of one benchmark (``BENCH_OPTIONS``), None or False where not given."""
    import importlib

    import rlnb

    given = {option: value for option, value in options.items() if value not in (None, False)}
    for option in given:
        if BENCH_OPTIONS[option] != name:
            return _refuse(f"bench {name}", f"--{option} applies to '{BENCH_OPTIONS[option]}' only")
    module = importlib.import_module(f"rlnb.bench._{name}")
    try:
        with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():  # stdout: the JSON only
            result = module.run(**given)
    except rlnb.ConfigError as exc:  # e.g. a --model that is not a model's directory
        return _refuse(f"bench {name}", str(exc))
    print(result.to_json() if as_json else result.report())
    return 1 if strict and not result.ok else 0


def _make_tiny_llama(args: argparse.Namespace) -> int:
    """``rlnb make-tiny-llama``: refuses a directory with files in it (it would overwrite a model)."""
    import rlnb
    from rlnb.data import get_task
    from rlnb.models import tiny_llama

    directory = Path(args.dir).expanduser()
    try:
        alphabet = get_task(args.task).alphabet
    except rlnb.ConfigError as exc:
        return _refuse(args.command, f"--task {args.task}: {exc}")
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        return _refuse(args.command, f"{str(directory)!r} is not an empty directory: pass a new or empty one")
    try:
        print(tiny_llama(directory, alphabet=alphabet, seed=args.seed))
    except rlnb.CheckpointError as exc:  # it says which path and why
        return _refuse(args.command, str(exc))
    except (rlnb.ConfigError, OSError) as exc:
        return _refuse(args.command, f"cannot write {str(directory)!r}: {exc}")
    return 0


def _refuse(command: str, message: str) -> int:
    print(f"rlnb {command}: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args, unknown = _build_parser().parse_known_args(argv)
    if unknown:  # reported by the command's own parser, which lists its flags in --help
        args.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in ("demo", "train"):
        return _train(args)
    if args.command == "bench":
        options = {
            "tracker": args.tracker,
            "quick": args.quick,
            "model": args.model,
            "tokens": args.tokens,
            "ranks": args.ranks,
            "strategy": args.strategy,
        }
        return _bench(args.name, args.json, args.strict, **options)
    if args.command == "make-tiny-llama":
        return _make_tiny_llama(args)
    raise AssertionError(args.command)  # argparse enforces the choices


if __name__ == "__main__":
    sys.exit(main())

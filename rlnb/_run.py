"""A whole training run from the command line: ``rlnb demo`` and ``rlnb train``.

Stages, each shown on its own: build the session, evaluate the initial policy,
the supervised warm-up (when configured), then RL with a held-out evaluation every
``eval_every`` steps until ``steps`` or ``target_accuracy``. The session's tracker
writes every step's metrics to ``run_dir/metrics.jsonl`` as they happen and the
reward/accuracy curves to ``run_dir/curves.png`` (and wandb's files under
``run_dir/wandb`` with the "wandb" backend). Stage lines go through ``echo``;
progress bars go to stderr (see :func:`rlnb.learn.progress_bar`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from rlnb.config import Config

__all__ = ["RunResult", "run"]


@dataclasses.dataclass
class RunResult:
    """What a run reached; ``to_json()`` is the CLI's last line with ``--json``."""

    task: str
    mode: str
    model: str | None  # the Hugging Face model's directory; None: the built-in policy
    engine: str
    eval_accuracy_init: float
    eval_accuracy_start: float
    eval_accuracy_end: float
    steps: int
    warmup_steps: int
    seconds: float
    warmup_seconds: float
    rl_seconds: float
    steps_per_s: float
    generated_tokens_per_s: float
    peak_rss_mib: float
    run_dir: str
    reached_target: bool | None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def summary(self) -> str:
        """One line for ``--quiet``: steps, time, held-out accuracy and the run dir."""
        warmup = f" after {self.warmup_steps} warm-up steps" if self.warmup_steps else ""
        accuracy = f"{self.eval_accuracy_start:.3f} -> {self.eval_accuracy_end:.3f}"
        if self.warmup_steps:
            accuracy = f"{self.eval_accuracy_init:.3f} -> {accuracy}"
        return (
            f"{self.steps} RL steps{warmup} in {self.seconds:.1f} s; held-out accuracy {accuracy}; "
            f"run dir {self.run_dir}"
        )


def run(
    config: Config,
    *,
    steps: int,
    run_dir: str | Path,
    eval_every: int = 25,
    eval_prompts: int = 200,
    target_accuracy: float | None = None,
    progress: bool = True,
    trackers: tuple[str, ...] = ("console", "jsonl", "plot"),
    echo: Any = print,
) -> RunResult:
    """Train ``config`` for up to ``steps`` RL steps; see the module docstring.

    ``trackers`` are the session's tracker backends ("wandb" follows ``WANDB_MODE``,
    offline by default); they all write under ``run_dir``."""
    import rlnb
    from rlnb._assembly import engine_kind, model_shape
    from rlnb.config import TrackConfig
    from rlnb.data import get_task
    from rlnb.learn import progress_bar
    from rlnb.track import wandb_mode_from_env

    if not isinstance(steps, int) or steps < 0:
        raise rlnb.ConfigError(f"steps={steps!r} is invalid: use an int >= 0")
    if not isinstance(eval_every, int) or eval_every < 1:
        raise rlnb.ConfigError(f"eval_every={eval_every!r} is invalid: use an int >= 1")
    if target_accuracy is not None and not 0 < target_accuracy <= 1:
        raise rlnb.ConfigError(f"target_accuracy={target_accuracy!r} is invalid: use a value in (0, 1]")
    root = Path(run_dir)
    config = config.replace(
        track=TrackConfig(
            backends=trackers, run_dir=str(root), wandb_mode=wandb_mode_from_env(), console_every=eval_every
        )
    )  # validated here, before anything starts
    model_shape(config, get_task(config.task))  # a model directory and max_len too (a Session checks them again)
    root.mkdir(parents=True, exist_ok=True)
    (root / "metrics.jsonl").unlink(missing_ok=True)  # this run's records only
    started = time.perf_counter()
    with rlnb.Session(config, name="run") as sess:
        echo(f"rlnb: task {config.task!r}, {config.mode} mode, {_describe_model(config)}; run dir {root}")
        acc_init = sess.evaluate(eval_prompts)
        echo(f"[eval] initial policy: held-out accuracy {acc_init:.3f}")

        t0 = time.perf_counter()
        warmup_steps = config.warmup.steps
        if warmup_steps:
            echo(f"[warm-up] supervised, {warmup_steps} steps of {config.warmup.batch_size} answers")
            sess.warmup(progress=progress)
        warmup_seconds = time.perf_counter() - t0
        acc_start = sess.evaluate(eval_prompts) if warmup_steps else acc_init
        if warmup_steps:
            echo(f"[warm-up] done in {warmup_seconds:.1f} s: held-out accuracy {acc_start:.3f}")

        echo(f"[rl] GRPO, up to {steps} steps" + (f", until accuracy {target_accuracy}" if target_accuracy else ""))
        t1 = time.perf_counter()
        tokens_before = sess.statistics().engine.generated_tokens
        acc_end, done = acc_start, 0
        with progress_bar(steps, "rlnb rl", progress) as bar:
            while done < steps:
                metrics = sess.step()
                done += 1
                evaluated = done % eval_every == 0 or done == steps
                if evaluated:
                    acc_end = sess.evaluate(eval_prompts)
                    bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", eval_acc=f"{acc_end:.3f}")
                bar.update(1)
                if target_accuracy is not None and evaluated and acc_end >= target_accuracy:
                    break
        rl_seconds = time.perf_counter() - t1
        tokens = sess.statistics().engine.generated_tokens - tokens_before
    seconds = time.perf_counter() - started
    echo(f"[rl] {done} steps in {rl_seconds:.1f} s: held-out accuracy {acc_start:.3f} -> {acc_end:.3f}")
    echo(f"wrote {root / 'metrics.jsonl'} and {root / 'curves.png'}; {seconds:.1f} s in all")
    return RunResult(
        task=config.task,
        mode=config.mode,
        model=config.model.path,
        engine=engine_kind(config),
        eval_accuracy_init=acc_init,
        eval_accuracy_start=acc_start,
        eval_accuracy_end=acc_end,
        steps=done,
        warmup_steps=warmup_steps,
        seconds=round(seconds, 3),
        warmup_seconds=round(warmup_seconds, 3),
        rl_seconds=round(rl_seconds, 3),
        steps_per_s=round(done / rl_seconds, 3) if rl_seconds > 0 else 0.0,
        generated_tokens_per_s=round(tokens / rl_seconds, 1) if rl_seconds > 0 else 0.0,
        peak_rss_mib=round(_peak_rss_mib(), 1),
        run_dir=str(root),
        reached_target=None if target_accuracy is None else acc_end >= target_accuracy,
    )


def _describe_model(config: Config) -> str:
    from rlnb._assembly import engine_kind

    m = config.model
    if m.path is None:
        return f"tiny policy (d_model {m.d_model}, {m.n_layers} layers) on CPU"
    return f"Hugging Face model {m.path!r} ({m.dtype}) on the {engine_kind(config)!r} engine"


def _peak_rss_mib() -> float:
    import resource

    # this process's peak (KiB on Linux); loader workers are children, counted apart
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def demo_settings() -> tuple[Config, dict[str, Any]]:
    """``rlnb demo``'s config and run options (``rlnb train`` starts from them too)."""
    from rlnb.config import LearnConfig, RolloutConfig, WarmupConfig

    # RL after the warm-up is stable only with AdamW steps about as small as the
    # warm-up's last ones (~1e-4); at 2e-4 it loses ground and at 5e-4 it collapses.
    config = Config(
        task="addition",
        seed=0,
        warmup=WarmupConfig(steps=380, batch_size=128, lr=1e-3),
        learn=LearnConfig(lr=1e-4, betas=(0.9, 0.999)),
        rollout=RolloutConfig(group_size=8, groups_per_step=16),
    )
    return config, {"steps": 125, "eval_every": 25, "eval_prompts": 200, "target_accuracy": None}

"""``rlnb.Config``: one frozen dataclass per component, validated when it is made.

Every error names the field and the fix, and is raised before any work starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlnb._errors import ConfigError
from rlnb.data import get_task

__all__ = [
    "BufferConfig",
    "Config",
    "DataConfig",
    "EngineConfig",
    "LearnConfig",
    "ModelConfig",
    "RolloutConfig",
    "WarmupConfig",
]


def _require(ok: bool, field: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{field}={value!r} is invalid: {fix}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class BufferConfig:
    """The replay buffer.

    capacity: groups held per partition before ``put`` blocks.
    max_staleness: evict groups more than this many policy versions behind the
        learner (counted in statistics); ``None`` keeps every group.
    partitions: the names of the buffer's partitions.
    """

    capacity: int = 1024
    max_staleness: int | None = None
    partitions: tuple[str, ...] = ("train", "val")

    def __post_init__(self) -> None:
        _require(
            _is_int(self.capacity) and self.capacity >= 1,
            "BufferConfig.capacity",
            self.capacity,
            "use a positive number of groups, e.g. capacity=256",
        )
        _require(
            self.max_staleness is None or (_is_int(self.max_staleness) and self.max_staleness >= 0),
            "BufferConfig.max_staleness",
            self.max_staleness,
            "use None for no bound or an int >= 0, e.g. max_staleness=1",
        )
        parts = self.partitions
        _require(
            isinstance(parts, tuple)
            and len(parts) > 0
            and all(isinstance(p, str) and p for p in parts)
            and len(set(parts)) == len(parts),
            "BufferConfig.partitions",
            parts,
            'use a tuple of distinct names, e.g. ("train", "val")',
        )
        _require("train" in parts, "BufferConfig.partitions", parts, 'include "train": the learner reads it')


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The prompt pipeline (torchdata's ``StatefulDataLoader``).

    num_workers: worker processes making prompts (0: in this process). The prompt
        order is the same for any number.
    prefetch_factor: prompts each worker keeps ready.
    multiprocessing_context: ``None`` (the platform's default), "fork",
        "forkserver" or "spawn".
    """

    num_workers: int = 1
    prefetch_factor: int = 8
    multiprocessing_context: str | None = None

    def __post_init__(self) -> None:
        _require(
            _is_int(self.num_workers) and self.num_workers >= 0,
            "DataConfig.num_workers",
            self.num_workers,
            "use an int >= 0, e.g. num_workers=1",
        )
        _require(
            _is_int(self.prefetch_factor) and self.prefetch_factor >= 1,
            "DataConfig.prefetch_factor",
            self.prefetch_factor,
            "use an int >= 1, e.g. prefetch_factor=8",
        )
        _require(
            self.multiprocessing_context in (None, "fork", "forkserver", "spawn"),
            "DataConfig.multiprocessing_context",
            self.multiprocessing_context,
            'use None, "fork", "forkserver" or "spawn"',
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The built-in tiny policy (a decoder-only transformer).

    d_model, n_layers, n_heads: width, depth and attention heads.
    max_len: context length in tokens (prompt and completion together).
    """

    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 32

    def __post_init__(self) -> None:
        for field in ("d_model", "n_layers", "n_heads", "max_len"):
            value = getattr(self, field)
            _require(_is_int(value) and value >= 1, f"ModelConfig.{field}", value, "use a positive int")
        _require(
            self.d_model % self.n_heads == 0,
            "ModelConfig.n_heads",
            self.n_heads,
            f"use a divisor of d_model={self.d_model}, e.g. n_heads=4",
        )


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The generation engine.

    kind: "tiny" (the built-in continuous-batching CPU engine).
    max_batch: sequences decoded together (KV-cache slots).
    threads: torch intra-op threads of the engine's own thread (the setting is
        per thread: the learner keeps the process's). Decoding a tiny model is
        bound by per-op overhead, not arithmetic, so one thread decodes about as
        fast as two and leaves the other core to the learner in async mode.
    """

    kind: str = "tiny"
    max_batch: int = 128
    threads: int = 1

    def __post_init__(self) -> None:
        _require(self.kind in ("tiny",), "EngineConfig.kind", self.kind, 'use "tiny"')
        _require(
            _is_int(self.max_batch) and self.max_batch >= 1,
            "EngineConfig.max_batch",
            self.max_batch,
            "use a positive int, e.g. max_batch=128",
        )
        _require(
            _is_int(self.threads) and self.threads >= 1,
            "EngineConfig.threads",
            self.threads,
            "use a positive int, e.g. threads=1",
        )


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How prompts become groups of samples.

    group_size: samples per prompt (GRPO's G).
    max_inflight: samples generating at once (the rollouter's capacity).
    max_staleness: policy versions a sample may lag the learner; None for no bound.
    groups_per_step: groups the learner takes per step (sets the staleness budget).
    temperature, top_p, top_k: sampling (top_k 0 and top_p 1.0: no truncation).
    max_new_tokens: completion length limit; None takes the task's.
    max_continuations: times a partial rollout is continued after pauses.
    max_retries: retries of a failing generation or reward before it is reported.
    """

    group_size: int = 8
    max_inflight: int = 128
    max_staleness: int | None = 1
    groups_per_step: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int | None = None
    max_continuations: int = 4
    max_retries: int = 2

    def __post_init__(self) -> None:
        for field in ("group_size", "max_inflight", "groups_per_step"):
            value = getattr(self, field)
            _require(_is_int(value) and value >= 1, f"RolloutConfig.{field}", value, "use a positive int")
        _require(
            self.max_inflight >= self.group_size,
            "RolloutConfig.max_inflight",
            self.max_inflight,
            f"use at least group_size={self.group_size}: a whole group is dispatched at once",
        )
        _require(
            self.max_staleness is None or (_is_int(self.max_staleness) and self.max_staleness >= 0),
            "RolloutConfig.max_staleness",
            self.max_staleness,
            "use None or an int >= 0",
        )
        _require(
            _is_number(self.temperature) and self.temperature >= 0,
            "RolloutConfig.temperature",
            self.temperature,
            "use a number >= 0 (0 is greedy)",
        )
        _require(
            _is_number(self.top_p) and 0 < self.top_p <= 1, "RolloutConfig.top_p", self.top_p, "use a number in (0, 1]"
        )
        _require(
            _is_int(self.top_k) and self.top_k >= 0, "RolloutConfig.top_k", self.top_k, "use an int >= 0 (0: no limit)"
        )
        _require(
            self.max_new_tokens is None or (_is_int(self.max_new_tokens) and self.max_new_tokens >= 1),
            "RolloutConfig.max_new_tokens",
            self.max_new_tokens,
            "use None (the task's) or a positive int",
        )
        for field in ("max_continuations", "max_retries"):
            value = getattr(self, field)
            _require(_is_int(value) and value >= 0, f"RolloutConfig.{field}", value, "use an int >= 0")


@dataclasses.dataclass(frozen=True)
class LearnConfig:
    """lr, betas, weight_decay: AdamW. max_grad_norm: gradient clipping.
    clip_eps: PPO clip range. is_cap: truncation of the off-policy importance weight.
    kl_coef: weight of the KL to the frozen initial policy (0: no reference kept).
    epochs, minibatches: passes over each batch and the groups split per pass.
    scale_advantages: divide each group's centred rewards by their std (GRPO);
        False only centres them (Dr. GRPO).
    lr_decay_steps: None keeps ``lr`` constant; N decays it linearly to 0 over
        the first N learner steps (TRL's and verl's default schedule), after
        which it stays at 0."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_eps: float = 0.2
    is_cap: float = 2.0
    kl_coef: float = 0.0
    epochs: int = 1
    minibatches: int = 1
    scale_advantages: bool = True
    lr_decay_steps: int | None = None

    def __post_init__(self) -> None:
        checks = (
            ("lr", self.lr > 0, "use a learning rate > 0, e.g. lr=1e-4"),
            (
                "lr_decay_steps",
                self.lr_decay_steps is None or (_is_int(self.lr_decay_steps) and self.lr_decay_steps >= 1),
                "use None (constant lr) or an int >= 1, e.g. lr_decay_steps=3000",
            ),
            ("weight_decay", self.weight_decay >= 0, "use a value >= 0"),
            ("max_grad_norm", self.max_grad_norm > 0, "use a norm > 0, e.g. max_grad_norm=1.0"),
            ("clip_eps", 0 < self.clip_eps < 1, "use a value in (0, 1), e.g. clip_eps=0.2"),
            ("is_cap", self.is_cap >= 1, "use a cap >= 1, e.g. is_cap=2.0"),
            ("kl_coef", self.kl_coef >= 0, "use 0 (no KL) or a positive weight"),
            ("epochs", isinstance(self.epochs, int) and self.epochs >= 1, "use an int >= 1"),
            ("minibatches", isinstance(self.minibatches, int) and self.minibatches >= 1, "use an int >= 1"),
        )
        for field, ok, fix in checks:
            if not ok:
                raise ConfigError(f"LearnConfig.{field}={getattr(self, field)!r} is invalid: {fix}")


@dataclasses.dataclass(frozen=True)
class WarmupConfig:
    """A supervised warm-up before RL (``Session.warmup()``): teacher-forced
    cross-entropy on the task's answers, with its own AdamW.

    steps: how many steps ``warmup()`` takes by default (0: none).
    batch_size: prompts per step. lr: its learning rate."""

    steps: int = 0
    batch_size: int = 128
    lr: float = 1e-3

    def __post_init__(self) -> None:
        checks = (
            ("steps", _is_int(self.steps) and self.steps >= 0, "use an int >= 0, e.g. steps=300"),
            ("batch_size", _is_int(self.batch_size) and self.batch_size >= 1, "use an int >= 1, e.g. 128"),
            ("lr", _is_number(self.lr) and self.lr > 0, "use a learning rate > 0, e.g. lr=1e-3"),
        )
        for field, ok, fix in checks:
            if not ok:
                raise ConfigError(f"WarmupConfig.{field}={getattr(self, field)!r} is invalid: {fix}")


@dataclasses.dataclass(frozen=True)
class TrackConfig:
    """The session's tracker (``rlnb.track``).

    backends: any of "console", "jsonl", "wandb", "plot" (the default, none, tracks nothing).
    run_dir: where "jsonl", "plot" and "wandb" write (needed by them).
    wandb_mode: "offline" (default), "online" (needs an API key) or "disabled".
    wandb_project: the wandb project. console_every: steps between console lines.
    run_id: resume this run (a loaded checkpoint sets it); None starts a new one.
    """

    backends: tuple[str, ...] = ()
    run_dir: str | None = None
    wandb_mode: str = "offline"
    wandb_project: str = "rlnb"
    console_every: int = 10
    run_id: str | None = None

    def __post_init__(self) -> None:
        from rlnb.track._tracker import BACKENDS

        _require(
            isinstance(self.backends, tuple) and all(b in BACKENDS for b in self.backends),
            "TrackConfig.backends",
            self.backends,
            f"use a tuple of names from {BACKENDS}, e.g. backends=('console', 'jsonl')",
        )
        _require(
            len(set(self.backends)) == len(self.backends),
            "TrackConfig.backends",
            self.backends,
            "name each backend once",
        )
        needs_dir = [b for b in self.backends if b != "console"]
        _require(
            not needs_dir or self.run_dir is not None,
            "TrackConfig.run_dir",
            self.run_dir,
            f"backends {needs_dir} write files: give a directory, e.g. run_dir='runs/demo'",
        )
        _require(
            self.wandb_mode in ("offline", "online", "disabled"),
            "TrackConfig.wandb_mode",
            self.wandb_mode,
            "use 'offline', 'online' or 'disabled'",
        )
        if "wandb" in self.backends and self.wandb_mode == "online":
            import os

            has_key = os.environ.get("WANDB_API_KEY") or os.path.exists(os.path.expanduser("~/.netrc"))
            _require(
                bool(has_key),
                "TrackConfig.wandb_mode",
                self.wandb_mode,
                "'online' needs a wandb API key (WANDB_API_KEY or `wandb login`); use 'offline' and "
                "`wandb sync` the run directory later",
            )
        _require(
            _is_int(self.console_every) and self.console_every >= 1,
            "TrackConfig.console_every",
            self.console_every,
            "use an int >= 1",
        )


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a :class:`~rlnb.Session` is built from.

    task: the name of a registered task (``rlnb.data.task_names()``).
    seed: seeds every random number generator the session owns.
    data, model, engine, rollout, learn, warmup, buffer, track: the parts (see each class).
    mode: "sync" (each step rolls out its batch, then trains on it: deterministic
        for a seed) or "async" (rollouts run in the background within the
        staleness bound and each step takes its batch from the buffer).
    step_timeout: seconds an async ``step()`` waits for its batch before a
        ``TimeoutError`` that says what it waited for.
    close_timeout: seconds ``Session.close()`` may spend in all before it gives up
        on a part that will not stop (it then warns and abandons it).
    """

    task: str = "addition"
    seed: int = 0
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    learn: LearnConfig = dataclasses.field(default_factory=LearnConfig)
    warmup: WarmupConfig = dataclasses.field(default_factory=WarmupConfig)
    buffer: BufferConfig = dataclasses.field(default_factory=BufferConfig)
    track: TrackConfig = dataclasses.field(default_factory=TrackConfig)
    mode: str = "sync"
    step_timeout: float = 120.0
    close_timeout: float = 5.0

    def __post_init__(self) -> None:
        _require(_is_int(self.seed) and self.seed >= 0, "Config.seed", self.seed, "use an int >= 0, e.g. seed=0")
        for field, cls in PARTS.items():
            value = getattr(self, field)
            _require(
                isinstance(value, cls),
                f"Config.{field}",
                value,
                f"pass a rlnb.{cls.__name__}, e.g. {field}=rlnb.{cls.__name__}(...)",
            )
        _require(isinstance(self.task, str), "Config.task", self.task, 'use a task name, e.g. task="addition"')
        get_task(self.task)  # an unknown name fails here, naming the known ones
        _require(self.mode in ("sync", "async"), "Config.mode", self.mode, 'use "sync" or "async"')
        _require(
            _is_number(self.step_timeout) and self.step_timeout > 0,
            "Config.step_timeout",
            self.step_timeout,
            "use a number of seconds > 0, e.g. step_timeout=120.0",
        )
        _require(
            _is_number(self.close_timeout) and self.close_timeout > 0,
            "Config.close_timeout",
            self.close_timeout,
            "use a number of seconds > 0, e.g. close_timeout=5.0",
        )

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


# Config's fields that are configs of their own, and their classes.
PARTS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "engine": EngineConfig,
    "rollout": RolloutConfig,
    "learn": LearnConfig,
    "warmup": WarmupConfig,
    "buffer": BufferConfig,
    "track": TrackConfig,
}

"""``rlnb.Config``: one frozen dataclass per component, validated when it is made.

Every error names the field and the fix, and is raised before any work starts.
Each class checks its own fields in ``__post_init__``, beside their documentation
(with the helpers of :mod:`rlnb._checks` that the parts built without a config share);
the parts these configs build take them validated and do not check them again.
``DataConfig`` is defined beside the prompt loader that reads it (``rlnb.data``, a
layer below this one) and re-exported here.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import time
from typing import Any

from rlnb import _reprs
from rlnb._checks import (
    RENAMED,
    SAMPLES_PER_STEP_MAX,
    check_buffer,
    check_int,
    check_number,
    check_reward_weights,
    check_sampling,
    check_seed,
    check_tracking,
    is_int,
    plain,
    require,
)
from rlnb._checks import keywords as _keywords
from rlnb._errors import ConfigError
from rlnb.algorithms import Algorithm, algorithms, describe, preset
from rlnb.data import DataConfig, get_task

ENGINE_KINDS = ("tiny", "hf", "vllm")
MODEL_DTYPES = ("float32", "bfloat16")

__all__ = [
    "LIVE_FIELDS",
    "live_value",
    "BufferConfig",
    "Change",
    "Config",
    "DataConfig",
    "EngineConfig",
    "LearnConfig",
    "LoraConfig",
    "ModelConfig",
    "RayConfig",
    "RolloutConfig",
    "TrackConfig",
    "WarmupConfig",
    "config_from_dict",
    "config_to_dict",
    "describe_model",
    "engine_kind",
]


@_keywords()
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
        check_buffer("BufferConfig", self.capacity, self.partitions, self.max_staleness)
        parts = self.partitions
        require("train" in parts, "BufferConfig.partitions", parts, 'include "train": the learner reads it')


@_keywords()
@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA (through peft, ``pip install 'rlnb[lora]'``) for a Hugging Face model:
    ``ModelConfig(path=DIR, lora=LoraConfig())``. Only the adapter trains and the
    optimiser holds only its state; the model's own weights stay as they were. Engines
    serve, and ``Session.save_pretrained`` writes, the merged weights;
    ``save_pretrained(dir, adapter_only=True)`` writes the PEFT adapter, and a
    checkpoint holds the adapter, not the model.

    r: the adapter's rank. alpha: its scale: an adapted weight is
        ``W + (alpha / r) * B @ A`` (peft's ``lora_alpha``).
    dropout: dropout on the adapter's input while the learner trains, in [0, 1)
        (the model's own dropout stays off; engines serve merged weights, without it).
    target_modules: "all-linear" (every linear layer but the output head, as peft
        means it) or a tuple of module names, each matching the modules whose name is
        it or ends with ``.`` and it, e.g. ``("q_proj", "v_proj")``.
    """

    r: int = 8
    alpha: float = 16
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, list):  # as JSON gives it back
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        check_int("LoraConfig.r", self.r, minimum=1, example="r=8")
        check_number("LoraConfig.alpha", self.alpha, gt=0, fix="use a number > 0, e.g. alpha=16 (twice r is usual)")
        check_number("LoraConfig.dropout", self.dropout, ge=0, lt=1, fix="use a probability in [0, 1), e.g. 0.0")
        names = self.target_modules
        require(
            names == "all-linear"
            or (
                isinstance(names, tuple)
                and len(names) > 0
                and all(isinstance(n, str) and n.strip() != "" for n in names)
            ),
            "LoraConfig.target_modules",
            names,
            'use "all-linear" or a tuple of module names, e.g. target_modules=("q_proj", "v_proj")',
        )


@_keywords()
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model: the built-in tiny policy (a decoder-only transformer), or a
    Hugging Face causal LM from a local directory.

    path: a local directory of a causal LM that transformers loads (config.json,
        weights, tokenizer), e.g. one :func:`rlnb.models.tiny_llama` built; nothing
        is downloaded. None (the default): the built-in policy, of the shape below.
    dtype, device: a ``path`` model's weights: "float32" or "bfloat16" (for GPUs),
        on "cpu" or "cuda" ("cuda:N" for GPU N); the engine's copy shares the device.
    vocab_size: token ids; ``None`` (the default) takes the task's tokenizer's.
    d_model, n_layers, n_heads: width, depth and attention heads (``d_model`` a
        multiple of ``n_heads``); the built-in policy only.
    max_len: context length in tokens (prompt and completion together).
    mlp_ratio: the MLP's hidden width is ``mlp_ratio * d_model``.
    gradient_checkpointing: transformers' gradient checkpointing for the learner's
        ``path`` model: each decoder layer runs again in the backward pass instead
        of keeping its activations (less memory, about a third more compute; the
        same loss and gradients).
    lora: a :class:`LoraConfig` to train a LoRA adapter of the ``path`` model
        instead of all its weights; None (the default) trains them all.
    """

    vocab_size: int | None = None
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 32
    mlp_ratio: int = 4
    path: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    gradient_checkpointing: bool = False
    lora: LoraConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.path, os.PathLike):
            object.__setattr__(self, "path", os.fspath(self.path))
        if isinstance(self.lora, dict):  # as config_from_dict gives it back from JSON
            object.__setattr__(self, "lora", LoraConfig(**self.lora))
        require(
            self.path is None or (isinstance(self.path, str) and self.path.strip() != ""),
            "ModelConfig.path",
            self.path,
            "use None (the built-in policy) or the local directory of a Hugging Face causal LM",
        )
        require(self.dtype in MODEL_DTYPES, "ModelConfig.dtype", self.dtype, f"use one of {MODEL_DTYPES}")
        require(
            self.path is not None or self.dtype == "float32",
            "ModelConfig.dtype",
            self.dtype,
            "the built-in policy trains in float32; dtype applies to a Hugging Face model (ModelConfig.path)",
        )
        require(
            isinstance(self.device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
            "ModelConfig.device",
            self.device,
            'use "cpu", "cuda" or "cuda:N" (GPU N)',
        )
        require(
            self.path is not None or self.device == "cpu",
            "ModelConfig.device",
            self.device,
            "the built-in policy runs on the CPU; device applies to a Hugging Face model (ModelConfig.path)",
        )
        require(
            isinstance(self.gradient_checkpointing, bool),
            "ModelConfig.gradient_checkpointing",
            self.gradient_checkpointing,
            "use True or False",
        )
        require(
            self.path is not None or not self.gradient_checkpointing,
            "ModelConfig.gradient_checkpointing",
            self.gradient_checkpointing,
            "it is for Hugging Face models (ModelConfig.path); the built-in policy keeps its activations: "
            "use gradient_checkpointing=False, or a smaller LearnConfig.micro_batch_size to save memory",
        )
        require(
            self.lora is None or isinstance(self.lora, LoraConfig),
            "ModelConfig.lora",
            self.lora,
            "use None or a rlnb.LoraConfig, e.g. lora=rlnb.LoraConfig(r=8)",
        )
        require(
            self.path is not None or self.lora is None,
            "ModelConfig.lora",
            self.lora,
            "LoRA adapts a Hugging Face model (ModelConfig.path); the built-in policy trains all its weights: "
            "use lora=None, or set ModelConfig(path=...) to a model's local directory",
        )
        check_int("ModelConfig.vocab_size", self.vocab_size, minimum=1, optional=True, example="vocab_size=16")
        for field, example in (("d_model", 128), ("n_layers", 2), ("n_heads", 4), ("max_len", 32), ("mlp_ratio", 4)):
            check_int(f"ModelConfig.{field}", getattr(self, field), minimum=1, example=f"{field}={example}")
        require(
            self.d_model % self.n_heads == 0,
            "ModelConfig.n_heads",
            self.n_heads,
            f"use a divisor of d_model={self.d_model}, e.g. n_heads=4",
        )

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``d_model // n_heads``."""
        return self.d_model // self.n_heads

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


@_keywords()
@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The generation engine.

    kind: None (the default) picks the model's own: "tiny" for the built-in
        policy, "hf" for a ``ModelConfig.path`` model. "tiny" and "hf" are the
        built-in continuous-batching CPU engine, on the built-in policy or on the
        transformers model; "vllm" serves a ``ModelConfig.path`` model with vLLM.
    max_batch: sequences decoded together (KV-cache slots).
    threads: torch intra-op threads of the engine's own thread (the setting is
        per thread: the learner keeps the process's). Decoding a tiny model is
        bound by per-op overhead, not arithmetic, so one thread decodes about as
        fast as two and leaves the other core to the learner in async mode.
    gpu_memory_utilization: the share of a GPU vLLM may take, leaving the rest
        to a learner on the same GPU (unused on a CPU).
    process: run the "tiny" or "hf" engine in a process of its own
        (:class:`~rlnb.engines.ProcessEngine`), with the weights passed through
        shared memory. In one process the engine's thread and the learner's share
        the interpreter's lock; in two they run at once, so async mode overlaps
        generation and learning for real. Costs a child process that imports torch
        at the session's start (a few seconds). vLLM and Ray replicas already run
        in processes of their own.
    """

    kind: str | None = None
    max_batch: int = 128
    threads: int = 1
    gpu_memory_utilization: float = 0.3
    process: bool = False

    def __post_init__(self) -> None:
        require(
            self.kind is None or self.kind in ENGINE_KINDS,
            "EngineConfig.kind",
            self.kind,
            f"use None or one of {ENGINE_KINDS}",
        )
        check_int("EngineConfig.max_batch", self.max_batch, minimum=1, example="max_batch=128")
        check_int("EngineConfig.threads", self.threads, minimum=1, example="threads=1")
        check_number(
            "EngineConfig.gpu_memory_utilization",
            self.gpu_memory_utilization,
            gt=0,
            le=1,
            fix="use a fraction in (0, 1], e.g. gpu_memory_utilization=0.3",
        )
        require(isinstance(self.process, bool), "EngineConfig.process", self.process, "use True or False")
        require(
            not (self.process and self.kind == "vllm"),
            "EngineConfig.process",
            self.process,
            "vLLM already runs in processes of its own: use process=False with kind='vllm'",
        )


@_keywords()
@dataclasses.dataclass(frozen=True)
class RayConfig:
    """Engine replicas as Ray actors (``engine_replicas`` > 0; the default, 0, runs the
    engine in the session's process). Each replica runs the engine ``EngineConfig.kind``
    names ("tiny", "hf" or "vllm") on a copy of the policy; rollouts go to the replica
    with the fewest in flight.

    address: None starts a local Ray cluster that the session owns and shuts down;
        "auto", "HOST:PORT" or "ray://..." attaches to a running one, which the
        session never shuts down (it removes only its own actors).
    engine_replicas, num_cpus, num_gpus: how many replicas, and each one's resources.
    strategy: how the placement group packs them: "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD".
    max_restarts: replicas remade after one dies, in all, before the engine gives up.
    start_timeout: seconds to wait for Ray and the replicas to start (vLLM replicas start
        their engines in it: allow a few minutes on a busy CPU).
    log_dir: where a local cluster keeps its logs (Ray's temp dir). None:
        ``<TrackConfig.run_dir>/ray`` when the session has a run dir, else Ray's
        default, ``/tmp/ray``. An attached cluster keeps its own."""

    address: str | None = None
    engine_replicas: int = 0
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    strategy: str = "PACK"
    max_restarts: int = 3
    start_timeout: float = 120.0
    log_dir: str | None = None

    def __post_init__(self) -> None:
        require(
            self.address is None or (isinstance(self.address, str) and self.address.strip() != ""),
            "RayConfig.address",
            self.address,
            'use None (a local cluster of the session\'s own), "auto", "HOST:PORT" or "ray://HOST:PORT"',
        )
        check_int("RayConfig.engine_replicas", self.engine_replicas, minimum=0, example="engine_replicas=2")
        check_number("RayConfig.num_cpus", self.num_cpus, gt=0, fix="use a number of CPUs > 0, e.g. num_cpus=1")
        check_number("RayConfig.num_gpus", self.num_gpus, ge=0, fix="use a number of GPUs >= 0, e.g. num_gpus=1")
        strategies = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
        require(self.strategy in strategies, "RayConfig.strategy", self.strategy, f"use one of {strategies}")
        check_int("RayConfig.max_restarts", self.max_restarts, minimum=0, example="max_restarts=3")
        check_number("RayConfig.start_timeout", self.start_timeout, gt=0, fix="use seconds > 0, e.g. 120.0")
        require(
            self.log_dir is None or (isinstance(self.log_dir, str) and self.log_dir.strip() != ""),
            "RayConfig.log_dir",
            self.log_dir,
            "use None (under the run dir) or a directory path",
        )
        require(
            self.log_dir is None or self.address is None,
            "RayConfig.log_dir",
            self.log_dir,
            "it applies to a local cluster (address=None); an attached cluster keeps its logs where it was started",
        )


@_keywords(max_staleness="max_policy_lag")
@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How prompts become groups of samples.

    group_size: samples per prompt (GRPO's G).
    max_inflight: samples generating at once (the rollouter's capacity).
    max_policy_lag: how far background rollouts may run ahead of the learner, in
        policy versions: a sample is trained on by a policy at most this many
        versions newer than the one that started it. None: no bound (only the
        buffer's capacity stops dispatch). Not to be confused with
        ``BufferConfig.max_staleness``, which evicts groups already made.
    groups_per_step: groups the learner takes per step (sets the dispatch budget).
    temperature, top_p, top_k: sampling (top_k 0 and top_p 1.0: no truncation).
    max_new_tokens: completion length limit; None takes the task's.
    max_continuations: times a partial rollout is continued after pauses.
    max_retries: retries of a failing generation, or of a reward function that
        raises, before the sample fails.
    reward_timeout: seconds one call of the reward function may take, counted from
        its start. Rewards run on worker threads (``rlnb-reward-N``; one at a
        time, in order, unless ``reward_workers`` says more), off the session's
        event loop, so a slow one holds up
        neither pause nor any other call. A call that takes longer fails its sample
        and is not retried; its thread cannot be stopped and ends whenever the call
        returns (also after the session has closed: close does not wait for it),
        while the next reward starts on a new thread at once. None: no limit (a
        hung reward then holds up every later one). A reward must return a finite
        number: an int, a float, a bool (0.0 or 1.0) or a numpy/torch scalar; None,
        a string, a list, NaN or inf fails its sample at once (not retried).
    reward_weights: one weight per reward function of the task, in place of its own
        (``Task.reward_weights``); None (the default) keeps the task's.
    reward_workers: reward calls that may run at once. 1 (the default) keeps runs
        reproducible: samples are rewarded, and groups reach the buffer, in the
        order they finished. A reward that waits (a judge model behind an API, a
        sandbox) gains by more, up to one per sample in flight; a pure-Python
        reward gains nothing (the GIL), and it must be thread-safe.
    env_workers: calls of a task's environments (``Task.env``: ``reset``, ``step``,
        ``close``, the tool calls) that may run at once, on threads ``rlnb-env-N``
        of their own. Each sample has an environment of its own, so their order
        changes nothing a sync-mode run trains on; a tool that waits (a sandbox, an
        API) gains by more, up to one per sample in flight. 1: one at a time (a
        3 s tool then makes 128 samples in flight take minutes a turn; the
        rollouts' ``env_calls_queued`` counts the calls waiting for a thread).
    """

    group_size: int = 8
    max_inflight: int = 128
    max_policy_lag: int | None = 1
    groups_per_step: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int | None = None
    max_continuations: int = 4
    max_retries: int = 2
    reward_timeout: float | None = 10.0
    reward_workers: int = 1
    env_workers: int = 8
    reward_weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.reward_weights, list):  # as JSON, or a user, gives it
            object.__setattr__(self, "reward_weights", tuple(self.reward_weights))
        if self.reward_weights is not None:
            example = "None (the task's own) or reward_weights=(1.0, 0.5)"
            check_reward_weights("RolloutConfig.reward_weights", self.reward_weights, example)
        require(
            is_int(self.group_size) and self.group_size >= 2,
            "RolloutConfig.group_size",
            self.group_size,
            "use an int >= 2: a sample's advantage is its reward against its group's, so a group of one learns nothing",
        )
        for field in ("max_inflight", "groups_per_step", "reward_workers", "env_workers"):
            check_int(f"RolloutConfig.{field}", getattr(self, field), minimum=1)
        samples = self.group_size * self.groups_per_step
        require(
            samples <= SAMPLES_PER_STEP_MAX,
            "RolloutConfig.groups_per_step",
            self.groups_per_step,
            f"with group_size={self.group_size} a step would roll out {samples:,} samples, more than "
            f"{SAMPLES_PER_STEP_MAX:,}; use groups_per_step <= {SAMPLES_PER_STEP_MAX // self.group_size:,}",
        )
        require(
            self.max_inflight >= self.group_size,
            "RolloutConfig.max_inflight",
            self.max_inflight,
            f"use at least group_size={self.group_size}: a whole group is dispatched at once",
        )
        check_int("RolloutConfig.max_policy_lag", self.max_policy_lag, optional=True, example="max_policy_lag=1")
        check_sampling("RolloutConfig", self.temperature, self.top_p, self.top_k)
        check_int(
            "RolloutConfig.max_new_tokens", self.max_new_tokens, minimum=1, optional=True, example="None (the task's)"
        )
        for field in ("max_continuations", "max_retries"):
            check_int(f"RolloutConfig.{field}", getattr(self, field), minimum=0)
        if self.reward_timeout is not None:
            check_number(
                "RolloutConfig.reward_timeout", self.reward_timeout, gt=0, fix="use seconds > 0, or None for no limit"
            )


@_keywords()
@dataclasses.dataclass(frozen=True)
class LearnConfig:
    """lr, betas, weight_decay: AdamW. max_grad_norm: gradient clipping.
    algorithm: the RL update: a preset's name (``rlnb.algorithms.algorithms()``
        lists them: "grpo", the default, "dr_grpo", "dapo", "gspo", "cispo", "rloo",
        "reinforce_pp", ...) or an :class:`rlnb.algorithms.Algorithm` (its parts,
        your own functions included). :attr:`resolved_algorithm` is the one in
        force, with the four settings below applied.
    clip_eps: None (the algorithm's clip range), or a number that sets both of its
        bounds (``clip_low = clip_high = clip_eps``).
    is_cap: None (the algorithm's), or the upper bound of the mismatch weight
        between the engine's and the learner's policy (``correction_high``).
    kl_coef: None (the algorithm's: 0 in every preset), or the weight of the KL to
        the frozen initial policy; a session keeps that reference only when the
        weight is > 0 at its start.
    scale_advantages: None (the algorithm's), or False to only centre each group's
        rewards (Dr. GRPO's advantages; ``advantage="dr_grpo"``) where the
        algorithm's advantage is "grpo"; True leaves "grpo" as it is.
    epochs, minibatches: passes over each batch and the groups split per pass.
    lr_decay_steps: None keeps ``lr`` constant; N decays it linearly to 0 over
        the first N learner steps (TRL's and verl's default schedule), after
        which it stays at 0.
    micro_batch_size: None (the default) runs each update's samples through the
        model at once; N runs them N sequences at a time and accumulates the
        gradients: the same update (the loss is still the mean over all the
        update's completion tokens), with activations for N sequences at most.
    keep_batches: the last N batches trained on are kept, frozen, for
        ``Session.batches``, ``what_if`` and ``rescore`` (0: none).
    threads: torch intra-op threads of the thread that runs each update (set
        there for the update and restored after it). None (the default): in
        async mode with the engine on this machine's CPU (the tiny or hf engine,
        on a thread, in a process or as local Ray replicas), the threads torch
        would use less the engine's, at least 1: generation and learning run at
        once, and more threads than cores slowed both (measured in the README's
        "Async training" section); otherwise torch's default.
    ranks: the learner's processes. 1 (the default): in the session's process. N > 1:
        N Ray actors on the session's Ray cluster (:class:`RayConfig`: a local one,
        or ``address``'s), one CPU each, placed as ``RayConfig.strategy`` says, on a
        gloo process group; each takes its share of every update's samples and the
        gradients are summed, so a step is the one a single process takes (the
        session's process keeps a copy of the weights, which the engines get). A
        critic (``advantage="gae"``) is split likewise.
    strategy: how ranks > 1 hold the model. "fsdp" (the default): sharded with
        torch's FSDP2, each rank keeping 1/N of every weight, gradient and optimiser
        moment (the weights gathered a block at a time for each pass); "ddp": the
        whole model and optimiser on every rank, the gradients summed after the
        backward passes (fewer, larger messages: faster where the model fits).
    rank_timeout: seconds a rank waits for the others in a collective (torch.distributed's
        timeout). A rank that hangs (a loss function that never returns, a stopped
        process) makes the others' step fail after it; if it has not answered
        ``rank_timeout`` + 10 s after another rank finished, the group is stopped and
        the step fails with an error naming it (``Session.restart_learner()`` starts
        new ranks)."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    algorithm: str | Algorithm = "grpo"
    clip_eps: float | None = None
    is_cap: float | None = None
    kl_coef: float | None = None
    epochs: int = 1
    minibatches: int = 1
    scale_advantages: bool | None = None
    lr_decay_steps: int | None = None
    micro_batch_size: int | None = None
    keep_batches: int = 8
    threads: int | None = None
    ranks: int = 1
    strategy: str = "fsdp"
    rank_timeout: float = 300.0

    def __post_init__(self) -> None:
        check_number("LearnConfig.lr", self.lr, gt=0, fix="use a learning rate > 0, e.g. lr=1e-4")
        betas = self.betas
        require(
            isinstance(betas, tuple) and len(betas) == 2 and all(isinstance(b, int | float) for b in betas),
            "LearnConfig.betas",
            betas,
            "use two numbers in [0, 1), e.g. betas=(0.9, 0.999)",
        )
        for beta in betas:
            check_number("LearnConfig.betas", beta, ge=0, lt=1, fix="use two numbers in [0, 1), e.g. (0.9, 0.999)")
        check_number("LearnConfig.weight_decay", self.weight_decay, ge=0, fix="use a value >= 0")
        check_number("LearnConfig.max_grad_norm", self.max_grad_norm, gt=0, fix="use a norm > 0, e.g. 1.0")
        if self.clip_eps is not None:
            check_number(
                "LearnConfig.clip_eps", self.clip_eps, gt=0, lt=1, fix="use None (the algorithm's) or a value in (0, 1)"
            )
        if self.is_cap is not None:
            check_number("LearnConfig.is_cap", self.is_cap, ge=1, fix="use None (the algorithm's) or a cap >= 1")
        if self.kl_coef is not None:
            check_number("LearnConfig.kl_coef", self.kl_coef, ge=0, fix="use None, 0 (no KL) or a positive weight")
        check_int("LearnConfig.epochs", self.epochs, minimum=1)
        check_int("LearnConfig.threads", self.threads, minimum=1, optional=True, example="threads=1")
        check_int("LearnConfig.minibatches", self.minibatches, minimum=1)
        require(
            self.scale_advantages is None or isinstance(self.scale_advantages, bool),
            "LearnConfig.scale_advantages",
            self.scale_advantages,
            "use None (the algorithm's), True (GRPO) or False (Dr. GRPO)",
        )
        object.__setattr__(self, "_resolved", self._resolve())
        check_int(
            "LearnConfig.lr_decay_steps", self.lr_decay_steps, minimum=1, optional=True, example="lr_decay_steps=3000"
        )
        check_int(
            "LearnConfig.micro_batch_size",
            self.micro_batch_size,
            minimum=1,
            optional=True,
            example="None (the whole batch at once) or micro_batch_size=8",
        )
        check_int("LearnConfig.keep_batches", self.keep_batches, minimum=0, example="keep_batches=8")
        check_int("LearnConfig.ranks", self.ranks, minimum=1, example="ranks=2")
        require(
            self.strategy in ("fsdp", "ddp"),
            "LearnConfig.strategy",
            self.strategy,
            'use "fsdp" (the model sharded across the ranks) or "ddp" (a whole copy on each)',
        )
        check_number("LearnConfig.rank_timeout", self.rank_timeout, gt=0, fix="use seconds > 0, e.g. rank_timeout=300")
        require(
            not (self.ranks > 1 and self.strategy == "fsdp" and self.resolved_algorithm.critic == "lora"),
            "LearnConfig.strategy",
            self.strategy,
            'a LoRA critic shares the policy\'s base weights, which "fsdp" shards: use strategy="ddp", '
            'or Algorithm(critic="model")',
        )

    @property
    def resolved_algorithm(self) -> Algorithm:
        """The :class:`~rlnb.algorithms.Algorithm` in force: :attr:`algorithm` (a
        preset's, by name) with ``clip_eps``, ``is_cap``, ``kl_coef`` and
        ``scale_advantages`` applied where they are not None."""
        resolved: Algorithm = self.__dict__["_resolved"]
        return resolved

    @property
    def why_no_clip(self) -> str | None:
        """Why no clip acts in a step under these settings, or None where one can:
        "ratio 1: one update per batch" (``epochs=1`` and ``minibatches=1``: the update
        starts from the proximal policy itself, so the ratio is 1 by construction), or
        "the loss 'sapo' has no clip" (a built-in loss other than ppo_clip, gspo and
        cispo), or, for a loss function, that rlnb does not measure a clip inside it."""
        if self.epochs == 1 and self.minibatches == 1:
            return ONE_UPDATE
        loss = self.resolved_algorithm.loss
        if callable(loss):  # it may clip or not: only the built-in losses' clips are measured
            return f"the loss {describe(loss)!r} is a function: a clip inside it is not measured"
        return None if loss in CLIPPED_LOSSES else f"the loss {describe(loss)!r} has no clip"

    def _resolve(self) -> Algorithm:
        if isinstance(self.algorithm, str):
            try:
                base = preset(self.algorithm)
            except LookupError as exc:
                raise ConfigError(f"LearnConfig.algorithm={self.algorithm!r} is invalid: {exc}") from None
        elif isinstance(self.algorithm, Algorithm):
            base = self.algorithm
        else:
            raise ConfigError(
                f"LearnConfig.algorithm={self.algorithm!r} is invalid: use a preset's name "
                '(rlnb.algorithms.algorithms() lists them), e.g. algorithm="dapo", or an rlnb.algorithms.Algorithm(...)'
            )
        changes: dict[str, Any] = {}
        if self.clip_eps is not None:
            changes.update(clip_low=self.clip_eps, clip_high=self.clip_eps)
        if self.is_cap is not None:
            changes["correction_high"] = self.is_cap
        if self.kl_coef is not None:
            changes["kl_coef"] = self.kl_coef
        if self.scale_advantages is False and base.advantage == "grpo":
            changes["advantage"] = "dr_grpo"
        if not changes:
            return base
        try:
            return base.replace(**changes)
        except ConfigError as exc:
            raise ConfigError(f"LearnConfig: {exc}") from None


@_keywords()
@dataclasses.dataclass(frozen=True)
class WarmupConfig:
    """A supervised warm-up before RL (``Session.warmup()``): teacher-forced
    cross-entropy on demonstrations, with its own AdamW.

    steps: how many steps ``warmup()`` takes by default (0: none).
    batch_size: prompts per step. lr: its learning rate.
    task: the registered task whose prompts and answers are the demonstrations;
        None (the default) takes the session's task, whose answers are correct.
        Another task imitates another teacher, e.g. "sloppy_reverse" (reversals
        that often drop the last letter) for ``task="reverse"``, so that RL has
        the slip to unlearn. Its characters must be the session task's."""

    steps: int = 0
    batch_size: int = 128
    lr: float = 1e-3
    task: str | None = None

    def __post_init__(self) -> None:
        check_int("WarmupConfig.steps", self.steps, minimum=0, example="steps=300")
        check_int("WarmupConfig.batch_size", self.batch_size, minimum=1, example="batch_size=128")
        check_number("WarmupConfig.lr", self.lr, gt=0, fix="use a learning rate > 0, e.g. lr=1e-3")
        if self.task is not None:
            require(
                isinstance(self.task, str),
                "WarmupConfig.task",
                self.task,
                'use a task name or None, e.g. task="reverse"',
            )
            try:
                get_task(self.task)
            except ConfigError as exc:
                raise ConfigError(str(exc).replace("Config.task=", "WarmupConfig.task=", 1)) from None


@_keywords()
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
        require(
            isinstance(self.backends, tuple),
            "TrackConfig.backends",
            self.backends,
            "use a tuple of names, e.g. backends=('console', 'jsonl')",
        )
        check_tracking(
            "TrackConfig", self.backends, self.run_dir, self.wandb_mode, self.wandb_project, self.console_every
        )
        require(
            self.run_id is None or (isinstance(self.run_id, str) and bool(self.run_id)),
            "TrackConfig.run_id",
            self.run_id,
            "use None (a new run) or a saved run's id",
        )


@_keywords()
@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a :class:`~rlnb.Session` is built from.

    task: the name of a registered task (``rlnb.data.task_names()``).
    seed: seeds every random number generator the session owns; an int in [0, 2**32).
    data, model, engine, rollout, learn, warmup, buffer, track, ray: the parts (see each class).
    mode: "sync" (each step rolls out its batch, then trains on it: deterministic
        for a seed) or "async" (rollouts run in the background within the
        staleness bound and each step takes its batch from the buffer).
    step_timeout: seconds an async ``step()`` waits for its batch, a call made in
        a cell (``step``, ``rollout``, ``evaluate``, ``complete``) waits out a pause
        that lands while it runs, and ``save()``/``rollouts.wait_paused()`` wait for a pause
        to settle, before a ``TimeoutError`` that says what it waited for.
    close_timeout: seconds ``Session.close()`` may spend in all before it gives up
        on a part that will not stop (it then warns and abandons it).
    stall_after: seconds without a completed step, while one runs, after which the
        session says where it waits (``statistics().stall``, one stdout line, the
        dashboard, ``diagnose()``). None (the default): ``max(30, 10 x the median
        step time)``.
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
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)
    mode: str = "sync"
    step_timeout: float = 120.0
    close_timeout: float = 5.0
    stall_after: float | None = None

    def __post_init__(self) -> None:
        check_seed("Config.seed", self.seed)
        for field, cls in PARTS.items():
            value = getattr(self, field)
            require(
                isinstance(value, cls),
                f"Config.{field}",
                value,
                f"pass a rlnb.{cls.__name__}, e.g. {field}=rlnb.{cls.__name__}(...)",
            )
        require(isinstance(self.task, str), "Config.task", self.task, 'use a task name, e.g. task="addition"')
        task = get_task(self.task)  # an unknown name fails here, naming the known ones
        if self.warmup.task is not None:
            outside = "".join(sorted(set(get_task(self.warmup.task).alphabet) - set(task.alphabet)))
            require(
                not outside,
                "WarmupConfig.task",
                self.warmup.task,
                f"its answers may hold {outside!r}, which task {self.task!r} has no tokens for; "
                "use a task of the same characters, or None for the session task's own answers",
            )
        weights = self.rollout.reward_weights
        if weights is not None:
            names = task.rewards.names
            require(
                len(weights) == len(names),
                "RolloutConfig.reward_weights",
                weights,
                f"task {self.task!r} has {len(names)} reward function(s), {', '.join(names)}: give one weight each",
            )
        require(self.mode in ("sync", "async"), "Config.mode", self.mode, 'use "sync" or "async"')
        require(
            self.mode == "sync" or self.rollout.groups_per_step <= self.buffer.capacity,
            "RolloutConfig.groups_per_step",
            self.rollout.groups_per_step,
            f"an async step takes its batch from the buffer, which holds at most BufferConfig.capacity="
            f"{self.buffer.capacity} groups: use groups_per_step <= {self.buffer.capacity}, or a larger capacity",
        )
        kind, path = self.engine.kind, self.model.path
        require(
            not (kind == "tiny" and path is not None),
            "EngineConfig.kind",
            kind,
            f"the 'tiny' engine serves the built-in policy, and ModelConfig.path={path!r} is a Hugging Face model; "
            "use kind='hf' (or None) or kind='vllm'",
        )
        require(
            not (kind in ("hf", "vllm") and path is None),
            "EngineConfig.kind",
            kind,
            f"the {kind!r} engine serves a Hugging Face model: set ModelConfig(path=...) to its local directory, "
            "or use kind=None for the built-in policy",
        )
        require(
            not (self.engine.process and self.ray.engine_replicas),
            "EngineConfig.process",
            self.engine.process,
            f"RayConfig.engine_replicas={self.ray.engine_replicas} already runs the engine in Ray's processes: "
            "use process=False with Ray replicas, or engine_replicas=0",
        )
        require(
            not (self.engine.process and self.model.device != "cpu"),
            "EngineConfig.process",
            self.engine.process,
            f"the engine process serves on the CPU and ModelConfig.device={self.model.device!r}: "
            "use process=False (the engine shares the GPU in this process) or kind='vllm'",
        )
        algorithm = self.learn.resolved_algorithm
        require(
            not (algorithm.has_critic and algorithm.critic == "lora" and self.model.lora is None),
            "Algorithm.critic",
            algorithm.critic,
            "a LoRA critic is an adapter on the policy's frozen base weights, and this policy trains every weight "
            '(ModelConfig.lora=None): use critic="model", or a Hugging Face model with lora=rlnb.LoraConfig()',
        )
        check_number(
            "Config.step_timeout", self.step_timeout, gt=0, fix="use a number of seconds > 0, e.g. step_timeout=120.0"
        )
        check_number(
            "Config.close_timeout", self.close_timeout, gt=0, fix="use a number of seconds > 0, e.g. close_timeout=5.0"
        )
        if self.stall_after is not None:
            check_number(
                "Config.stall_after",
                self.stall_after,
                gt=0,
                fix="use seconds > 0, or None for max(30, 10 x the median step time)",
            )

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def _check_fixed_bounds(self, changes: dict[str, Any]) -> None:
        """The live settings bounded by settings a running session cannot change: refused
        with a fix that only a live change makes (or a new session)."""
        size, per_step = changes.get("group_size"), changes.get("groups_per_step")
        inflight, capacity = self.rollout.max_inflight, self.buffer.capacity
        new_session = "needs a new session: rlnb.Session(config.replace(...))"
        require(
            not (is_int(size) and plain(size) > inflight),
            "RolloutConfig.group_size",
            size,
            f"a group is dispatched whole, and this session generates at most RolloutConfig.max_inflight="
            f"{inflight} samples at once; use group_size <= {inflight} (a larger max_inflight {new_session})",
        )
        require(
            not (self.mode == "async" and is_int(per_step) and plain(per_step) > capacity),
            "RolloutConfig.groups_per_step",
            per_step,
            f"an async step takes its batch from the buffer, which holds at most BufferConfig.capacity={capacity} "
            f"groups; use groups_per_step <= {capacity} (a larger capacity {new_session})",
        )

    def _changed_algorithm(self, learn: dict[str, Any], knobs: dict[str, Any]) -> Algorithm:
        """The algorithm ``set()`` gives ``learn`` (the learner's changes) with ``knobs``,
        the algorithm's own fields, changed: a ConfigError where a LearnConfig setting
        would hide one (``clip_eps`` sets both clip bounds)."""
        clip_eps = learn.get("clip_eps", self.learn.clip_eps)
        if clip_eps is not None and {"clip_low", "clip_high"} & set(knobs):
            raise ConfigError(
                f"set({', '.join(f'{k}={v!r}' for k, v in knobs.items())}): LearnConfig.clip_eps={clip_eps!r} "
                "sets both clip bounds and would hide it: set clip_eps=None with it, e.g. "
                "sess.set(clip_eps=None, clip_high=0.28)"
            )
        named = learn.get("algorithm", self.learn.algorithm)
        base = LearnConfig(algorithm=named).algorithm if isinstance(named, str) else named
        if isinstance(base, str):
            base = preset(base)
        try:
            return base.replace(**knobs)
        except ConfigError as exc:
            raise ConfigError(f"set(): {exc}") from None

    def with_live(self, **changes: Any) -> tuple[Config, list[tuple[str, Any, Any]]]:
        """A copy with the live settings ``changes`` (:data:`LIVE_FIELDS`, by field name:
        ``lr=1e-3``, ``temperature=0.7``) applied and validated, and the ``(field, old,
        new)`` of each value that differs. :class:`ConfigError` for a field that is not
        live (naming the live ones) or a value the config refuses, before anything changes;
        where the bound is a setting that is not live, the error says so."""
        parts: dict[str, dict[str, Any]] = {}
        for field, value in changes.items():
            part = LIVE_FIELDS.get(field)
            if part is None:
                raise ConfigError(_not_live(field))
            parts.setdefault(part, {})[field] = value
        if knobs := {f: parts["learn"].pop(f) for f in ALGORITHM_FIELDS if f in parts.get("learn", {})}:
            parts["learn"]["algorithm"] = self._changed_algorithm(parts["learn"], knobs)
        self._check_fixed_bounds(changes)
        replaced = {part: dataclasses.replace(getattr(self, part), **values) for part, values in parts.items()}
        config = dataclasses.replace(self, **replaced)
        diff = []
        for field in LIVE_FIELDS:
            old, new = live_value(self, field), live_value(config, field)
            if field in changes and old != new:
                diff.append((field, old, new))
        return config, diff


# The settings a running session may change (``Session.set``), and the part of the config
# each lives in. Learner settings take effect in the next update (lr and max_grad_norm at
# its optimiser step); rollout settings for the
# groups dispatched after the change.
LIVE_FIELDS: dict[str, str] = {
    "lr": "learn",
    "lr_decay_steps": "learn",
    "algorithm": "learn",
    "clip_low": "learn",
    "clip_high": "learn",
    "entropy_coef": "learn",
    "kl_coef": "learn",
    "clip_eps": "learn",
    "is_cap": "learn",
    "max_grad_norm": "learn",
    "temperature": "rollout",
    "top_p": "rollout",
    "top_k": "rollout",
    "max_new_tokens": "rollout",
    "max_policy_lag": "rollout",
    "groups_per_step": "rollout",
    "group_size": "rollout",
    "reward_weights": "rollout",
}


# Why a step's ratio cannot be clipped with one update per batch (LearnConfig.why_no_clip).
ONE_UPDATE = "ratio 1: one update per batch"
CLIPPED_LOSSES = ("ppo_clip", "gspo", "cispo")  # the built-in losses a clip range acts on
# A learner setting left None takes the algorithm's value: the value in force, by field.
_FROM_ALGORITHM = {"clip_eps": "clip_high", "is_cap": "correction_high", "kl_coef": "kl_coef"}
# Live settings that are the algorithm's own fields: set() makes LearnConfig.algorithm an
# Algorithm with them changed (a preset's name becomes its Algorithm).
ALGORITHM_FIELDS = ("clip_low", "clip_high", "entropy_coef")


def live_value(config: Config, field: str) -> Any:
    """The value of live setting ``field`` in force under ``config``: its field's, or
    for ``clip_eps``, ``is_cap`` and ``kl_coef`` left None, the resolved algorithm's
    (``clip_high``, ``correction_high``, ``kl_coef``); for the algorithm's own
    (``clip_low``, ``clip_high``, ``entropy_coef``), the resolved algorithm's."""
    if field in ALGORITHM_FIELDS:
        return getattr(config.learn.resolved_algorithm, field)
    value = getattr(getattr(config, LIVE_FIELDS[field]), field)
    if value is None and field in _FROM_ALGORITHM:
        return getattr(config.learn.resolved_algorithm, _FROM_ALGORITHM[field])
    return value


def algorithm_label(algorithm: str | Algorithm) -> str:
    """A name for ``algorithm``: a preset's name, the name of the preset it equals, or
    ``"custom"`` with what differs from GRPO's."""
    if isinstance(algorithm, str):
        return algorithm
    for name, _ in algorithms():
        if preset(name) == algorithm:
            return name
    base = preset("grpo")
    differs = [
        f"{f.name}={describe(v) if callable(v := getattr(algorithm, f.name)) else v!r}"
        for f in dataclasses.fields(algorithm)
        if getattr(algorithm, f.name) != getattr(base, f.name)
    ]
    return f"custom ({', '.join(differs)})"


def _not_live(field: str) -> str:
    live = ", ".join(LIVE_FIELDS)
    where = [cls.__name__ for cls in PARTS.values() if field in {f.name for f in dataclasses.fields(cls)}]
    if where or field in {f.name for f in dataclasses.fields(Config)}:
        owner = f"{where[0]}.{field}" if where else f"Config.{field}"
        return (
            f"{owner} cannot change in a running session: it needs a new one (rlnb.Session(config.replace(...)), "
            f"or save() and edit the checkpoint); the live settings are {live}"
        )
    near = difflib.get_close_matches(field, list(LIVE_FIELDS), n=1)
    hint = f"did you mean {near[0]}=...? " if near else ""
    return f"{field!r} is not a setting: {hint}the live settings are {live}"


@dataclasses.dataclass(frozen=True)
class Change:
    """One live setting changed in a session: at policy version ``step``, ``field``
    went from ``old`` to ``new``, at ``time`` (seconds since the epoch)."""

    step: int
    field: str
    old: Any
    new: Any
    time: float = dataclasses.field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe: tuples become lists, an :class:`~rlnb.algorithms.Algorithm` its label."""
        data = {"step": self.step, "field": self.field, "old": self.old, "new": self.new, "time": self.time}
        for key in ("old", "new"):
            if isinstance(data[key], tuple):
                data[key] = list(data[key])
            elif isinstance(data[key], Algorithm):
                data[key] = algorithm_label(data[key])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Change:
        def value(v: Any) -> Any:
            return tuple(v) if isinstance(v, list) else v

        return cls(int(data["step"]), str(data["field"]), value(data["old"]), value(data["new"]), float(data["time"]))

    def __str__(self) -> str:
        return f"step {self.step}: {self.field} {_reprs.setting(self.old)} -> {_reprs.setting(self.new)}"

    def __repr__(self) -> str:  # the time as a person reads it, not seconds since the epoch
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.time))
        return f"Change(step={self.step}, field={self.field!r}, old={self.old!r}, new={self.new!r}, time='{when}')"


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
    "ray": RayConfig,
}


def describe_model(config: Config, parameters: tuple[int, int] | None = None) -> str:
    """The model, where it learns and what serves it, in words (``rlnb train``'s header,
    the dashboard's "model" row); ``parameters``, (trainable, all) of the built model,
    adds its counts to a LoRA model's words."""
    m, r = config.model, config.ray
    if m.path is None:
        text = f"tiny policy (d_model {m.d_model}, {m.n_layers} layer{'s' * (m.n_layers != 1)}) on CPU"
    else:
        text = f"Hugging Face model {m.path!r} ({m.dtype}, learner on {m.device}"
        if m.lora is not None:
            where = m.lora.target_modules
            text += f", LoRA r={m.lora.r} on {where if isinstance(where, str) else ', '.join(where)}"
            if parameters is not None:
                text += f", {parameters[0]:,} trainable of {parameters[1]:,} parameters"
        text += f") on the {engine_kind(config)!r} engine"
    if r.engine_replicas:
        where = "a local Ray cluster of its own" if r.address is None else f"the Ray cluster at {r.address}"
        text += f", {r.engine_replicas} engine replicas on {where}"
    return text


def engine_kind(config: Config) -> str:
    """The engine ``config`` asks for: ``EngineConfig.kind``, or the model's own."""
    if config.engine.kind is not None:
        return config.engine.kind
    return "tiny" if config.model.path is None else "hf"


def config_to_dict(config: Config) -> dict[str, Any]:
    """``config`` as JSON-safe data (paths become strings; tuples become lists in JSON)."""
    algorithm = config.learn.algorithm
    if not isinstance(algorithm, str):
        # asdict deep-copies every value, and a function part may not copy (a bound method
        # of an object that holds a lock): the algorithm is written below, field by field
        config = dataclasses.replace(config, learn=dataclasses.replace(config.learn, algorithm="grpo"))
    data = dataclasses.asdict(config)
    data["track"]["run_dir"] = None if config.track.run_dir is None else os.fspath(config.track.run_dir)
    if not isinstance(algorithm, str):  # its fields; a function part by its qualified name (code is not saved)
        data["learn"]["algorithm"] = {
            f.name: _function_name(value) if callable(value := getattr(algorithm, f.name)) else value
            for f in dataclasses.fields(algorithm)
        }
    return data


def _function_name(fn: Any) -> dict[str, str]:
    return {"function": f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"}


class SavedFunctionError(ConfigError):
    """A saved config's algorithm had function parts, which data cannot bring back."""


def _algorithm_from_dict(data: dict[str, Any]) -> Algorithm:
    """The :class:`~rlnb.algorithms.Algorithm` :func:`config_to_dict` saved; a part that
    was a function cannot come back from data: ConfigError naming it and the fix."""
    functions = {k: v["function"] for k, v in data.items() if isinstance(v, dict) and "function" in v}
    if functions:
        named = ", ".join(f"{part}={name}" for part, name in functions.items())
        raise SavedFunctionError(
            f"LearnConfig.algorithm was an Algorithm with function parts ({named}); code is not saved: "
            "pass the algorithm again, e.g. Session.load(path, algorithm=rlnb.algorithms.Algorithm(...))"
        )
    try:
        fields: dict[str, Any] = dict(data)
        return Algorithm(**fields)
    except TypeError as exc:
        raise ConfigError(f"LearnConfig.algorithm: {exc}") from None


def config_from_dict(data: dict[str, Any]) -> Config:
    """The :class:`Config` of :func:`config_to_dict`; ConfigError for unknown fields.
    Fields renamed since the config was saved are read under their new names."""
    data = dict(data)
    parts = {}
    for field, cls in PARTS.items():
        values = dict(data.pop(field, {}))
        for old, new in RENAMED.get(cls.__name__, {}).items():
            if old in values and new not in values:
                values[new] = values.pop(old)
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(values) - set(known)
        if unknown:
            raise ConfigError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
        for name, value in values.items():
            if isinstance(value, list):  # JSON has no tuples
                values[name] = tuple(value)
        if isinstance(values.get("algorithm"), dict):
            values["algorithm"] = _algorithm_from_dict(values["algorithm"])
        parts[field] = cls(**values)
    unknown = set(data) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        raise ConfigError(f"Config has no field(s) {sorted(unknown)}")
    return Config(**data, **parts)

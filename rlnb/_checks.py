"""The checks every config shares, the names that more than one layer reads, and
what a tokenizer's ids mean (:func:`vocabulary`), which checkpoints record.

Each config dataclass validates its own fields once, with these helpers; the
component it configures takes the validated config and trusts it. Every error is
a :class:`~rlnb.ConfigError` that names the field and the fix, so a string given
for a number is a ``ConfigError`` too, never a ``TypeError`` from a comparison.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import math
import os
import re
from collections.abc import Callable
from typing import Any, TypeGuard, TypeVar

from rlnb._errors import ConfigError

__all__ = [
    "ENGINE_KINDS",
    "MODEL_DTYPES",
    "RENAMED",
    "SEED_LIMIT",
    "TRACKER_BACKENDS",
    "WANDB_MODES",
    "check_buffer",
    "check_engine",
    "check_int",
    "check_model",
    "check_number",
    "check_ray",
    "check_sampling",
    "check_seed",
    "check_tracking",
    "is_int",
    "is_number",
    "keywords",
    "require",
    "vocabulary",
    "vocabulary_change",
]

# Names read by both the configs and the parts they select (the configs must not
# import those parts): tracker backends, engine kinds, wandb modes.
TRACKER_BACKENDS = ("console", "jsonl", "wandb", "plot")
ENGINE_KINDS = ("tiny", "hf", "vllm")
MODEL_DTYPES = ("float32", "bfloat16")
WANDB_MODES = ("offline", "online", "disabled")
# Seeds are ints below this: numpy's seeding (through vLLM's) takes 32 bits, torch's 64.
SEED_LIMIT = 2**32


def require(ok: bool, field: str, value: Any, fix: str) -> None:
    """Raise ``ConfigError("{field}={value!r} is invalid: {fix}")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{field}={value!r} is invalid: {fix}")


def is_int(value: Any) -> TypeGuard[int]:
    """An int, and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float, and not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_int(field: str, value: Any, *, minimum: int = 0, optional: bool = False, example: Any = None) -> None:
    """``value`` is an int >= ``minimum`` (or None when ``optional``)."""
    if optional and value is None:
        return
    fix = f"use {'None or ' if optional else ''}an int >= {minimum}"
    require(
        is_int(value) and value >= minimum, field, value, fix + (f", e.g. {example}" if example is not None else "")
    )


def check_number(
    field: str,
    value: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    fix: str,
) -> None:
    """``value`` is a finite number within the given bounds; ``fix`` says what to use."""
    ok = (
        is_number(value)
        and (gt is None or value > gt)
        and (ge is None or value >= ge)
        and (lt is None or value < lt)
        and (le is None or value <= le)
    )
    require(ok, field, value, fix)


def check_seed(field: str, value: Any) -> None:
    """``value`` is a seed every generator it reaches takes: an int >= 0 and < :data:`SEED_LIMIT`."""
    require(is_int(value) and 0 <= value < SEED_LIMIT, field, value, "use an int >= 0 and < 2**32, e.g. seed=0")


def check_sampling(owner: str, temperature: Any, top_p: Any, top_k: Any) -> None:
    """The sampling fields that ``RolloutConfig`` and ``SamplingParams`` share."""
    check_number(f"{owner}.temperature", temperature, ge=0, fix="use a number >= 0 (0 is greedy)")
    check_number(f"{owner}.top_p", top_p, gt=0, le=1, fix="use a number in (0, 1], e.g. top_p=1.0 (no truncation)")
    check_int(f"{owner}.top_k", top_k, minimum=0, example="top_k=0 (no limit)")


def check_buffer(owner: str, capacity: Any, partitions: Any, max_staleness: Any) -> None:
    """The replay buffer's shape, for ``BufferConfig`` and ``ReplayBuffer``."""
    check_int(f"{owner}.capacity", capacity, minimum=1, example="capacity=256")
    check_int(f"{owner}.max_staleness", max_staleness, optional=True, example="max_staleness=1")
    require(
        isinstance(partitions, tuple)
        and len(partitions) > 0
        and all(isinstance(p, str) and p for p in partitions)
        and len(set(partitions)) == len(partitions),
        f"{owner}.partitions",
        partitions,
        'use a tuple of distinct, non-empty names, e.g. ("train", "val")',
    )


def _not_a_directory(path: str) -> str | None:
    """Why ``path`` cannot be (made into) a directory, if a file stands in the way."""
    current = os.path.abspath(path)
    while not os.path.exists(current):
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent
    if os.path.isdir(current):
        return None
    return "it is a file" if current == os.path.abspath(path) else f"{current} is a file"


def check_tracking(
    owner: str, backends: tuple[Any, ...], run_dir: Any, wandb_mode: Any, wandb_project: Any, console_every: Any
) -> None:
    """A tracker's settings, for ``TrackConfig`` and ``Tracker`` (``backends``: the names)."""
    unknown = [b for b in backends if b not in TRACKER_BACKENDS]
    require(
        not unknown,
        f"{owner}.backends",
        backends,
        f"unknown backend(s) {unknown}: use names from {TRACKER_BACKENDS}, e.g. ('console', 'jsonl')",
    )
    require(len(set(backends)) == len(backends), f"{owner}.backends", backends, "name each backend once")
    require(
        run_dir is None or (isinstance(run_dir, str | os.PathLike) and os.fspath(run_dir) != ""),
        f"{owner}.run_dir",
        run_dir,
        "use None or a directory path (str or pathlib.Path), e.g. run_dir='runs/demo'",
    )
    if run_dir is not None:
        problem = _not_a_directory(os.fspath(run_dir))
        require(problem is None, f"{owner}.run_dir", run_dir, f"{problem}; give a directory (it is made if missing)")
    needs_dir = [b for b in backends if b != "console"]
    require(
        not needs_dir or run_dir is not None,
        f"{owner}.run_dir",
        run_dir,
        f"backends {needs_dir} write files: give a directory, e.g. run_dir='runs/demo'",
    )
    require(wandb_mode in WANDB_MODES, f"{owner}.wandb_mode", wandb_mode, "use 'offline', 'online' or 'disabled'")
    if "wandb" in backends and wandb_mode == "online":
        has_key = os.environ.get("WANDB_API_KEY") or os.path.exists(os.path.expanduser("~/.netrc"))
        require(
            bool(has_key),
            f"{owner}.wandb_mode",
            wandb_mode,
            "'online' needs a wandb API key (WANDB_API_KEY or `wandb login`); use 'offline' and "
            "`wandb sync` the run directory later",
        )
    require(
        isinstance(wandb_project, str) and bool(wandb_project),
        f"{owner}.wandb_project",
        wandb_project,
        "use a non-empty name, e.g. wandb_project='rlnb'",
    )
    check_int(f"{owner}.console_every", console_every, minimum=1, example="console_every=10")


def check_ray(config: Any) -> None:
    """``RayConfig``'s fields."""
    require(
        config.address is None or (isinstance(config.address, str) and config.address.strip() != ""),
        "RayConfig.address",
        config.address,
        'use None (a local cluster of the session\'s own), "auto", "HOST:PORT" or "ray://HOST:PORT"',
    )
    check_int("RayConfig.engine_replicas", config.engine_replicas, minimum=0, example="engine_replicas=2")
    check_number("RayConfig.num_cpus", config.num_cpus, gt=0, fix="use a number of CPUs > 0, e.g. num_cpus=1")
    check_number("RayConfig.num_gpus", config.num_gpus, ge=0, fix="use a number of GPUs >= 0, e.g. num_gpus=1")
    strategies = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
    require(config.strategy in strategies, "RayConfig.strategy", config.strategy, f"use one of {strategies}")
    check_int("RayConfig.max_restarts", config.max_restarts, minimum=0, example="max_restarts=3")
    check_number("RayConfig.start_timeout", config.start_timeout, gt=0, fix="use seconds > 0, e.g. 120.0")
    require(
        config.log_dir is None or (isinstance(config.log_dir, str) and config.log_dir.strip() != ""),
        "RayConfig.log_dir",
        config.log_dir,
        "use None (under the run dir) or a directory path",
    )
    require(
        config.log_dir is None or config.address is None,
        "RayConfig.log_dir",
        config.log_dir,
        "it applies to a local cluster (address=None); an attached cluster keeps its logs where it was started",
    )


def check_engine(config: Any) -> None:
    """``EngineConfig``'s fields."""
    require(config.kind is None or config.kind in ENGINE_KINDS, "EngineConfig.kind", config.kind,
            f"use None or one of {ENGINE_KINDS}")  # fmt: skip
    check_int("EngineConfig.max_batch", config.max_batch, minimum=1, example="max_batch=128")
    check_int("EngineConfig.threads", config.threads, minimum=1, example="threads=1")
    check_number("EngineConfig.gpu_memory_utilization", config.gpu_memory_utilization, gt=0, le=1,
                 fix="use a fraction in (0, 1], e.g. gpu_memory_utilization=0.3")  # fmt: skip


def check_model(config: Any) -> None:
    """``ModelConfig``'s fields (``path`` already a str or None)."""
    require(
        config.path is None or (isinstance(config.path, str) and config.path.strip() != ""),
        "ModelConfig.path",
        config.path,
        "use None (the built-in policy) or the local directory of a Hugging Face causal LM",
    )
    require(config.dtype in MODEL_DTYPES, "ModelConfig.dtype", config.dtype, f"use one of {MODEL_DTYPES}")
    require(
        config.path is not None or config.dtype == "float32",
        "ModelConfig.dtype",
        config.dtype,
        "the built-in policy trains in float32; dtype applies to a Hugging Face model (ModelConfig.path)",
    )
    require(
        isinstance(config.device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", config.device) is not None,
        "ModelConfig.device",
        config.device,
        'use "cpu", "cuda" or "cuda:N" (GPU N)',
    )
    require(
        config.path is not None or config.device == "cpu",
        "ModelConfig.device",
        config.device,
        "the built-in policy runs on the CPU; device applies to a Hugging Face model (ModelConfig.path)",
    )
    check_int("ModelConfig.vocab_size", config.vocab_size, minimum=1, optional=True, example="vocab_size=16")
    for field, example in (("d_model", 128), ("n_layers", 2), ("n_heads", 4), ("max_len", 32), ("mlp_ratio", 4)):
        check_int(f"ModelConfig.{field}", getattr(config, field), minimum=1, example=f"{field}={example}")
    require(
        config.d_model % config.n_heads == 0,
        "ModelConfig.n_heads",
        config.n_heads,
        f"use a divisor of d_model={config.d_model}, e.g. n_heads=4",
    )


_C = TypeVar("_C")


def keywords(**renames: str) -> Callable[[type[_C]], type[_C]]:
    """A config that refuses a keyword it does not have with a ConfigError naming the
    nearest field, and whose fields ``old=new`` were renamed: the old keyword gives
    the new name (checkpoints of older versions are migrated by
    :func:`rlnb.checkpoint.config_from_dict` through ``RENAMED``). For ``rlnb.config``'s classes."""

    def decorate(cls: type[_C]) -> type[_C]:
        init = cls.__init__
        fields = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            for key in kwargs:
                if key in renames:
                    raise ConfigError(
                        f"{cls.__name__}.{key} was renamed: use {cls.__name__}({renames[key]}={kwargs[key]!r})"
                    )
                if key not in fields:
                    near = difflib.get_close_matches(key, fields, n=1)
                    hint = f"did you mean {near[0]}=...? " if near else ""
                    raise ConfigError(f"{cls.__name__} has no field {key!r}: {hint}its fields are {', '.join(fields)}")
            init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[method-assign]
        if renames:
            RENAMED[cls.__name__] = dict(renames)
        return cls

    return decorate


# class name -> {old field: new field}, for configs saved by older versions
RENAMED: dict[str, dict[str, str]] = {}


def vocabulary(tokenizer: Any) -> dict[str, Any]:
    """What ``tokenizer``'s ids mean: its size, the SHA-256 of its tokens in id order, and
    the tokens themselves where there are at most 4096 (a Hugging Face tokenizer's own
    tokens; for rlnb's character tokenizer, each id's text)."""
    ids = list(range(tokenizer.vocab_size))
    hf = getattr(tokenizer, "tokenizer", None)
    tokens = [str(t) for t in hf.convert_ids_to_tokens(ids)] if hf is not None else [tokenizer.decode([i]) for i in ids]
    digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
    return {"size": len(tokens), "sha256": digest, **({"tokens": tokens} if len(tokens) <= 4096 else {})}


def vocabulary_change(saved: dict[str, Any], here: dict[str, Any]) -> str | None:
    """How the :func:`vocabulary` ``here`` differs from ``saved`` ("id 3 was ['0'], is
    ['9']"), or None where it does not."""
    if saved["sha256"] == here["sha256"]:
        return None
    tokens = saved.get("tokens")
    was: list[Any] = tokens if isinstance(tokens, list) else []
    now: list[Any] = here.get("tokens", [])
    i = next((i for i in range(max(len(was), len(now))) if was[i : i + 1] != now[i : i + 1]), None)
    if i is None:
        return f"{saved['size']} tokens then, {here['size']} now"
    return f"id {i} was {was[i : i + 1]}, is {now[i : i + 1]}"

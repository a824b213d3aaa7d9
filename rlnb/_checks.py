"""Validation helpers shared by the configs and by the parts that can be built
without one (``SamplingParams``, ``TinyPolicy``, the tasks), the names both sides
read (tracker backends, wandb modes, the seed limit), and the decorator every config
class has (:func:`keywords`), here so that a config of a layer below ``rlnb.config``
(``rlnb.data.DataConfig``) has it too.

Every error is a :class:`~rlnb.ConfigError` that names the field and the fix, so a
string given for a number is a ``ConfigError`` too, never a ``TypeError`` from a
comparison. A numpy scalar or a 0-d torch tensor counts as the number it holds
(:func:`plain` turns it into one); a bool is never a number.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import sys
from collections.abc import Callable
from typing import Any, TypeGuard, TypeVar

from rlnb._errors import ConfigError

__all__ = [
    "RENAMED",
    "REWARD_WEIGHT_MAX",
    "SAMPLES_PER_STEP_MAX",
    "SEED_LIMIT",
    "TRACKER_BACKENDS",
    "WANDB_MODES",
    "check_buffer",
    "check_int",
    "check_number",
    "check_reward_weights",
    "check_sampling",
    "check_seed",
    "check_tracking",
    "is_int",
    "is_number",
    "keywords",
    "plain",
    "require",
]

# Names read by both the configs and the parts they select (the configs must not
# import those parts): tracker backends, engine kinds, wandb modes.
TRACKER_BACKENDS = ("console", "jsonl", "wandb", "plot")
WANDB_MODES = ("offline", "online", "disabled")
# Seeds are ints below this: numpy's seeding (through vLLM's) takes 32 bits, torch's 64.
SEED_LIMIT = 2**32
# A reward weight's size: each reward is at most 3.4e38 (float32's range), so a weighted
# sum of any number of them stays far inside float64's (1.8e308); a larger weight is a slip.
REWARD_WEIGHT_MAX = 1e6
# Samples a step may roll out and train on (group_size x groups_per_step): 4 to 8 times
# the largest published GRPO batches; more holds the kernel for hours before any error.
SAMPLES_PER_STEP_MAX = 2**16


def require(ok: bool, field: str, value: Any, fix: str) -> None:
    """Raise ``ConfigError("{field}={value!r} is invalid: {fix}")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{field}={value!r} is invalid: {fix}")


def plain(value: Any) -> Any:
    """The Python scalar a numpy scalar (or 0-d array) or a 0-d torch tensor holds
    (``np.int64(4)`` -> 4, ``np.bool_(True)`` -> True); anything else as it is."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()
    torch = sys.modules.get("torch")  # a tensor exists only where torch was imported
    if torch is not None and isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    return value


def is_int(value: Any) -> TypeGuard[int]:
    """An int (or a numpy or 0-d torch integer), and not a bool."""
    value = plain(value)
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float (or a numpy or 0-d torch one), and not a bool."""
    value = plain(value)
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_int(field: str, value: Any, *, minimum: int = 0, optional: bool = False, example: Any = None) -> None:
    """``value`` is an int >= ``minimum`` (or None when ``optional``)."""
    if optional and value is None:
        return
    value = plain(value)
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
    value = plain(value)
    ok = (
        is_number(value)
        and (gt is None or value > gt)
        and (ge is None or value >= ge)
        and (lt is None or value < lt)
        and (le is None or value <= le)
    )
    require(ok, field, value, fix)


def check_reward_weights(field: str, weights: Any, example: str) -> None:
    """``weights`` is a non-empty list or tuple of finite numbers within
    ±:data:`REWARD_WEIGHT_MAX`; ``example`` is a good value, e.g. "reward_weights=(1.0, 0.5)"."""
    require(
        isinstance(weights, list | tuple) and len(weights) > 0,
        field,
        weights,
        f"give one number per reward function, e.g. {example}",
    )
    for w in weights:
        require(
            is_number(w), field, weights, f"use one finite number per reward function ({w!r} is not), e.g. {example}"
        )
        require(
            abs(plain(w)) <= REWARD_WEIGHT_MAX,
            field,
            weights,
            f"{w!r} is beyond ±{REWARD_WEIGHT_MAX:g}: a reward may be up to 3.4e38, and its weighted sum must stay "
            f"finite; scale the reward function instead, e.g. {example}",
        )


def check_seed(field: str, value: Any) -> None:
    """``value`` is a seed every generator it reaches takes: an int >= 0 and < :data:`SEED_LIMIT`."""
    require(is_int(value) and 0 <= plain(value) < SEED_LIMIT, field, value, "use an int >= 0 and < 2**32, e.g. seed=0")


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


_C = TypeVar("_C")

# class name -> {old field: new field}, for configs saved by older versions
RENAMED: dict[str, dict[str, str]] = {}


def keywords(**renames: str) -> Callable[[type[_C]], type[_C]]:
    """A config class that refuses a keyword it does not have with a ConfigError naming
    the nearest field, and whose fields ``old=new`` were renamed: the old keyword gives
    the new name (checkpoints of older versions are migrated by
    :func:`rlnb.checkpoint.config_from_dict` through ``RENAMED``). A numpy scalar or
    0-d torch tensor given for a field (or in a list or tuple) is kept as the Python
    number it holds, so configs compare, print and save as plain data. For the
    classes of ``rlnb.config`` and of the layers below it that it re-exports
    (``rlnb.data.DataConfig``)."""

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
            init(self, *map(_plain_field, args), **{k: _plain_field(v) for k, v in kwargs.items()})

        cls.__init__ = __init__  # type: ignore[method-assign]
        if renames:
            RENAMED[cls.__name__] = dict(renames)
        return cls

    return decorate


def _plain_field(value: Any) -> Any:
    """``value`` with numpy and 0-d torch scalars (its own, or a list's or tuple's) as Python numbers."""
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    return plain(value)

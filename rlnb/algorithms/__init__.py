"""RL algorithms as parts that compose: an :class:`Algorithm` (advantage estimator,
policy loss, aggregation, mismatch correction, KL and entropy regularisers, filters),
the published variants as presets, and your own parts as functions.

``preset(name)`` gives a preset's :class:`Algorithm`, ``algorithms()`` (also
``rlnb.algorithms()``: the package called) lists them with one line each,
``PRESETS`` holds each one's formula and source::

    from rlnb.algorithms import Algorithm, preset
    dapo = preset("dapo")
    mine = preset("grpo").replace(clip_high=0.28, std="bessel")
    custom = Algorithm(loss=lambda inputs: -(inputs.advantages[:, None] * inputs.logp))

The torch code (advantages, the policy loss, aggregation, the dry-run check) is in
:mod:`rlnb.algorithms.functional`, imported on first use: ``import rlnb.algorithms``
loads no torch.

The default, ``"grpo"``, is rlnb's loss as it has always been, bit for bit (the
population std, token-level PPO-clip at 0.2, the mismatch weight truncated at 2,
token-mean), so that runs made before keep their meaning. TRL's ``GRPOTrainer``
defaults to Bessel's std, ``loss_type="dapo"`` (token-mean over the global batch)
and, with vLLM, ``sequence_mask`` correction at 3; verl's to Bessel's std,
token-mean and dual clip at c=3.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from rlnb.algorithms._algorithm import Algorithm
from rlnb.algorithms._parts import (
    ADVANTAGES,
    AGGREGATIONS,
    CORRECTIONS,
    CRITICS,
    KL_ESTIMATORS,
    LOSSES,
    STDS,
    describe,
)
from rlnb.algorithms._presets import DEFAULT, PRESETS, Preset, algorithms, preset

if TYPE_CHECKING:
    from rlnb.algorithms import functional

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "CORRECTIONS",
    "CRITICS",
    "DEFAULT",
    "KL_ESTIMATORS",
    "LOSSES",
    "PRESETS",
    "STDS",
    "Algorithm",
    "Preset",
    "algorithms",
    "check",
    "describe",
    "functional",
    "has_signal",
    "preset",
]


def has_signal(rewards: Any) -> bool:
    """Whether a group's rewards (a sequence of numbers) are not all equal: a flat
    group has zero advantage under every group baseline, and ``drop_flat_groups``
    drops it. No torch: the trainer's dynamic sampling calls it per group."""
    values = [float(r) for r in rewards]
    return len(values) > 1 and min(values) != max(values)


def check(algorithm: Algorithm) -> None:
    """Run ``algorithm``'s function parts on a small dry batch (CPU, float32): a
    wrong shape, a NaN or inf, a loss without gradient, or an exception is a
    :class:`~rlnb.ConfigError` naming the function. Built-in parts pass. Loads torch."""
    from rlnb.algorithms.functional import check as _check

    _check(algorithm)


class _CallableModule(types.ModuleType):
    """``rlnb.algorithms`` is the package and, called, the list of its presets."""

    def __call__(self) -> list[tuple[str, str]]:
        """``rlnb.algorithms()``: each preset's name and one line (:func:`algorithms`)."""
        return algorithms()


sys.modules[__name__].__class__ = _CallableModule


def __getattr__(name: str) -> Any:
    if name == "functional":  # torch: loaded on first use
        import importlib

        return importlib.import_module("rlnb.algorithms.functional")
    raise AttributeError(f"module 'rlnb.algorithms' has no attribute {name!r}")

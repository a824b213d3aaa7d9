"""The built-in parts' names, a part's name, and what the torch side reads of an
algorithm (:class:`Settings`, which :class:`~rlnb.algorithms.Algorithm` is): a module
of its own, so that the algorithm (which tries a function part through
:mod:`rlnb.algorithms.functional`) and the functions import no cycle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "CORRECTIONS",
    "CRITICS",
    "KL_ESTIMATORS",
    "KL_PLACES",
    "LOSSES",
    "STDS",
    "Settings",
    "describe",
]

# The built-in parts, by name (each is described in rlnb.algorithms.functional).
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "opo", "gpg", "reinforce_pp", "reinforce_pp_baseline", "gae")
CRITICS = ("model", "lora")  # what learns the value function of advantage="gae"
LOSSES = ("ppo_clip", "gspo", "cispo", "sapo", "reinforce")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")
STDS = ("population", "bessel")
KL_PLACES = ("loss", "reward")


def describe(part: str | Callable[..., Any]) -> str:
    """A part's name: the built-in's, or a function's qualified name (``module.qualname``)."""
    if isinstance(part, str):
        return part
    module = getattr(part, "__module__", None) or "?"
    return f"{module}.{getattr(part, '__qualname__', type(part).__qualname__)}"


class Settings(Protocol):
    """An algorithm's settings as the functions read them: :class:`Algorithm`'s fields."""

    @property
    def advantage(self) -> str | Callable[..., Any]: ...

    @property
    def std(self) -> str: ...

    @property
    def loss(self) -> str | Callable[..., Any]: ...

    @property
    def clip_low(self) -> float: ...

    @property
    def clip_high(self) -> float: ...

    @property
    def dual_clip(self) -> float | None: ...

    @property
    def sapo_tau_pos(self) -> float: ...

    @property
    def sapo_tau_neg(self) -> float: ...

    @property
    def aggregation(self) -> str: ...

    @property
    def correction(self) -> str: ...

    @property
    def correction_low(self) -> float: ...

    @property
    def correction_high(self) -> float: ...

    @property
    def kl_coef(self) -> float: ...

    @property
    def kl_estimator(self) -> str: ...

    @property
    def kl_in(self) -> str: ...

    @property
    def entropy_coef(self) -> float: ...

    @property
    def drop_flat_groups(self) -> bool: ...

    @property
    def dynamic_sampling(self) -> bool: ...

    @property
    def mask_truncated(self) -> bool: ...

    @property
    def top_entropy_quantile(self) -> float: ...

    @property
    def critic(self) -> str: ...

    @property
    def gamma(self) -> float: ...

    @property
    def lam(self) -> float: ...

    @property
    def value_clip(self) -> float | None: ...

    @property
    def critic_lr(self) -> float | None: ...

"""``Algorithm``: the parts of an RL update that compose (advantage estimator, policy
loss, aggregation, mismatch correction, KL and entropy regularisers, filters), each a
flat field so that it can become a live setting (``sess.set(clip_high=0.28)``).

No torch here: ``rlnb.config`` holds an ``Algorithm`` and ``import rlnb`` stays light.
A part given as a function is tried on a small dry batch when the ``Algorithm`` is
made (that imports torch: the function needs it anyway)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from rlnb._checks import check_number, keywords, plain, require
from rlnb.algorithms._parts import (
    ADVANTAGES,
    AGGREGATIONS,
    CORRECTIONS,
    CRITICS,
    KL_ESTIMATORS,
    KL_PLACES,
    LOSSES,
    STDS,
    describe,
)

__all__ = ["Algorithm"]


@keywords()
@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One RL update, part by part. The default is rlnb's loss as it has always been
    (``preset("grpo")``): GRPO advantages with the population std, token-level
    PPO-clip at 0.2, the engine/learner mismatch weight truncated at 2, token-mean.

    advantage: a built-in estimator's name (``ADVANTAGES``: "grpo", "dr_grpo",
        "rloo", "opo", "gpg", "reinforce_pp", "reinforce_pp_baseline", or "gae":
        GAE(gamma, lam) per token on a learned value function, whitened over the
        batch's tokens, which makes the learner keep a critic) or a function
        ``fn(rewards, **context)``: ``rewards`` a float tensor [groups, G], the context
        ``per_function`` ([groups, G, F] or None), ``lengths`` ([groups, G], the tokens
        trained on), ``mask`` ([groups, G, T] bool) and ``groups`` (the rlnb Groups, or
        None); it returns [groups, G] (per sample) or [groups, G, T] (per token).
    std: the standard deviation the estimator divides by: "population" (rlnb's,
        divides by G) or "bessel" (TRL's and verl's, divides by G - 1).
    loss: a built-in policy loss's name (``LOSSES``: "ppo_clip", "gspo", "cispo",
        "sapo", "reinforce") or a function ``fn(inputs)`` of a
        :class:`rlnb.algorithms.functional.LossInputs`, returning a scalar or
        per-token losses [N, T] (aggregated by ``aggregation``).
    clip_low, clip_high: the ratio's clip range [1 - clip_low, 1 + clip_high]
        (ppo_clip, gspo: of the sequence ratio; cispo: of its detached IS weight).
    dual_clip: None, or c > 1: a negative-advantage token's loss is at most
        c * |A| (dual-clip PPO; ppo_clip only).
    sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures for A > 0 and A <= 0.
    aggregation: how per-token losses become the update's loss (``AGGREGATIONS``):
        "token_mean" (over all the update's tokens), "seq_mean_token_mean",
        "seq_mean_token_sum", "seq_mean_token_sum_norm" (the constant normaliser:
        samples x the longest a completion may be).
    correction: the weight for the mismatch between the learner's policy at the
        step's start and the engine's that sampled (``CORRECTIONS``): "none", or
        per "token" or per "sequence", "truncate" (clamp into [correction_low,
        correction_high]) or "mask" (0 outside it).
    correction_low, correction_high: that range (0 < high; low < high).
    kl_coef: weight of the KL to the frozen reference (0: none).
    kl_estimator: "k1" (log ratio), "k2" (half its square), "k3" (exp(-x) + x - 1,
        >= 0, verl's "low_var_kl"), "k3+" (k3's value, k2's gradient).
    kl_in: "loss" (a term of the loss) or "reward" (subtracted from each sample's
        reward before advantages).
    entropy_coef: weight of the entropy bonus (the loss subtracts it).
    drop_flat_groups: drop groups whose rewards are all equal (no signal; their
        tokens would dilute the token-mean).
    dynamic_sampling: keep generating groups until the batch is full of groups
        with signal (DAPO); needs ``drop_flat_groups``.
    mask_truncated: completions cut at the length limit are not trained on.
    top_entropy_quantile: train only on the tokens whose entropy is in this top
        share (1.0: all; 0.2: the 20% of highest entropy).
    critic: what learns the value function of ``advantage="gae"`` (``CRITICS``),
        each with a scalar value head on the last hidden state and an AdamW of its
        own, starting from the policy as it is when the critic is first needed:
        "model", a whole copy of the policy, every weight trained (what the field
        runs); "lora", for a LoRA policy (``ModelConfig.lora``), a second adapter on
        the policy's own frozen base weights (shared, not copied): the critic costs
        an adapter, not a model. Read only with ``advantage="gae"``.
    gamma, lam: GAE's discount and trace decay, in [0, 1] (per policy token).
    value_clip: None, or the range of the clipped value loss: each value may move
        at most this far from the one the step started with (PPO's clipped value
        loss, ``0.5 max((V - R)^2, (clip(V, V_old +- value_clip) - R)^2)``).
    critic_lr: the critic's learning rate (None: the policy's, with its schedule).

    Raises :class:`~rlnb.ConfigError` naming the field and the fix for a bad value,
    or for a function that fails on a small dry batch (a wrong shape, a NaN or inf,
    a loss without gradient).
    """

    advantage: str | Callable[..., Any] = "grpo"
    std: str = "population"
    loss: str | Callable[..., Any] = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    aggregation: str = "token_mean"
    correction: str = "token_truncate"
    correction_low: float = 0.0
    correction_high: float = 2.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in: str = "loss"
    entropy_coef: float = 0.0
    drop_flat_groups: bool = False
    dynamic_sampling: bool = False
    mask_truncated: bool = False
    top_entropy_quantile: float = 1.0
    critic: str = "model"
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float | None = 0.2
    critic_lr: float | None = None

    def __post_init__(self) -> None:
        _choice("advantage", self.advantage, ADVANTAGES, functions=True, example='advantage="rloo"')
        _choice("std", self.std, STDS, example='std="bessel"')
        _choice("loss", self.loss, LOSSES, functions=True, example='loss="gspo"')
        check_number(
            "Algorithm.clip_low",
            self.clip_low,
            gt=0,
            le=1,
            fix="use a number in (0, 1]: the ratio is clipped below at 1 - clip_low, e.g. clip_low=0.2",
        )
        check_number(
            "Algorithm.clip_high",
            self.clip_high,
            gt=0,
            fix="use a number > 0: the ratio is clipped above at 1 + clip_high, e.g. clip_high=0.28",
        )
        if self.dual_clip is not None:
            check_number(
                "Algorithm.dual_clip", self.dual_clip, gt=1, fix="use None (no dual clip) or c > 1, e.g. dual_clip=3.0"
            )
            require(
                self.loss == "ppo_clip",
                "Algorithm.dual_clip",
                self.dual_clip,
                f'it bounds the PPO-clip loss, and loss={describe(self.loss)!r}: use loss="ppo_clip" or dual_clip=None',
            )
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            check_number(f"Algorithm.{name}", getattr(self, name), gt=0, fix=f"use a temperature > 0, e.g. {name}=1.0")
        _choice("aggregation", self.aggregation, AGGREGATIONS, example='aggregation="seq_mean_token_mean"')
        _choice("correction", self.correction, CORRECTIONS, example='correction="sequence_mask"')
        check_number(
            "Algorithm.correction_low",
            self.correction_low,
            ge=0,
            le=1,
            fix="use a bound in [0, 1] (0: none below), e.g. correction_low=0.0",
        )
        check_number(
            "Algorithm.correction_high",
            self.correction_high,
            ge=1,
            fix="use a bound >= 1, e.g. correction_high=2.0",
        )
        require(
            plain(self.correction_high) > plain(self.correction_low),
            "Algorithm.correction_high",
            self.correction_high,
            f"it must exceed correction_low={self.correction_low!r}",
        )
        check_number("Algorithm.kl_coef", self.kl_coef, ge=0, fix="use 0 (no KL) or a positive weight, e.g. 0.001")
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS, example='kl_estimator="k3"')
        _choice("kl_in", self.kl_in, KL_PLACES, example='kl_in="loss"')
        check_number(
            "Algorithm.entropy_coef", self.entropy_coef, fix="use a finite number (0: none), e.g. entropy_coef=0.001"
        )
        for name in ("drop_flat_groups", "dynamic_sampling", "mask_truncated"):
            value = getattr(self, name)
            require(isinstance(value, bool), f"Algorithm.{name}", value, "use True or False")
        require(
            not self.dynamic_sampling or self.drop_flat_groups,
            "Algorithm.dynamic_sampling",
            self.dynamic_sampling,
            "it refills the batch with groups that have signal: set drop_flat_groups=True too",
        )
        check_number(
            "Algorithm.top_entropy_quantile",
            self.top_entropy_quantile,
            gt=0,
            le=1,
            fix="use a share in (0, 1] (1.0: every token), e.g. top_entropy_quantile=0.2",
        )
        _choice("critic", self.critic, CRITICS, example='critic="model"')
        for name in ("gamma", "lam"):
            check_number(
                f"Algorithm.{name}", getattr(self, name), ge=0, le=1, fix=f"use a number in [0, 1], e.g. {name}=1.0"
            )
        if self.value_clip is not None:
            check_number(
                "Algorithm.value_clip",
                self.value_clip,
                gt=0,
                fix="use None (an unclipped value loss) or a range > 0, e.g. value_clip=0.2",
            )
        if self.critic_lr is not None:
            check_number(
                "Algorithm.critic_lr", self.critic_lr, gt=0, fix="use None (the policy's lr) or a rate > 0, e.g. 1e-4"
            )
        if callable(self.advantage) or callable(self.loss):
            from rlnb.algorithms.functional import check  # torch: a function part needs it anyway

            check(self)

    @property
    def has_critic(self) -> bool:
        """Whether the learner keeps a value function for this algorithm (``advantage="gae"``)."""
        return self.advantage == "gae"

    @property
    def functions(self) -> tuple[str, ...]:
        """The qualified names of the parts given as functions (empty for built-ins only)."""
        return tuple(describe(p) for p in (self.advantage, self.loss) if callable(p))

    def replace(self, **changes: Any) -> Algorithm:
        """This algorithm with ``changes`` (checked like the constructor's)."""
        return dataclasses.replace(self, **changes)


def _choice(field: str, value: Any, names: tuple[str, ...], *, example: str, functions: bool = False) -> None:
    if functions and callable(value) and not isinstance(value, str):
        return
    either = " or a function" if functions else ""
    require(
        isinstance(value, str) and value in names,
        f"Algorithm.{field}",
        value,
        f"use one of {', '.join(repr(n) for n in names)}{either}, e.g. {example}",
    )

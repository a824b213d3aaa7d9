"""GRPO advantages and the token-level PPO-clip loss with off-policy correction.

For completion token t of sample i, with current log-prob ``logp``, the proximal
log-prob ``prox`` (the policy at the start of this step, no gradient), the
behaviour log-prob ``behav`` the engine recorded, and the frozen reference ``ref``::

    r_t  = exp(logp_t - prox_t)                      # the PPO ratio
    w_t  = min(exp(prox_t - behav_t), is_cap)        # truncated importance weight:
                                                     # corrects stale or mismatched samples
    pg_t = -w_t * min(r_t * A_i, clip(r_t, 1 - eps, 1 + eps) * A_i)
    kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1   # k3 estimator, >= 0

    loss = sum_t (pg_t + kl_coef * kl_t) / (number of completion tokens)

and ``A_i`` is the group-normalised reward (GRPO): ``(R_i - mean_g) / (std_g + eps)``.
A group whose rewards are all equal carries no signal: its advantages are 0.
"""

from __future__ import annotations

import dataclasses

import torch

from rlnb._errors import InvalidValueError

__all__ = ["FLOAT32_SAFE", "LossTerms", "grpo_advantages", "policy_loss"]


# Beyond this, float32's group statistics can overflow (the sum of a group of rewards
# near 3.4e38, the square of a deviation past 1.8e19): such groups are read in float64.
FLOAT32_SAFE = 2.0**60


def grpo_advantages(rewards: torch.Tensor, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages: ``rewards`` [groups, G] -> [groups, G].

    ``scale=True`` divides by the population standard deviation of each group
    (GRPO); ``scale=False`` only subtracts the group mean (Dr. GRPO), so a group
    whose rewards barely differ pushes barely. Groups with a single sample or
    identical rewards get zero advantage.

    Computed in float32, except for a group with a reward beyond ``FLOAT32_SAFE``
    (2**60) in size: that group is computed in float64 (and the result is float64),
    so that no reward within float64's range gives an inf or NaN here. With
    ``scale=False`` such a group's advantages may not fit float32.
    """
    if rewards.dim() != 2:
        raise InvalidValueError(f"rewards must be [groups, group_size], got shape {tuple(rewards.shape)}")
    narrow = _advantages(rewards.to(torch.float32), scale, eps)
    wide = rewards.abs().amax(dim=1, keepdim=True) > FLOAT32_SAFE if rewards.numel() else None
    if wide is None or not bool(wide.any()):
        return narrow
    return torch.where(wide, _advantages(rewards.to(torch.float64), scale, eps), narrow.to(torch.float64))


def _advantages(rewards: torch.Tensor, scale: bool, eps: float) -> torch.Tensor:
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    centred = (rewards - mean) / (std + eps) if scale else rewards - mean
    return torch.where(std > eps, centred, torch.zeros_like(rewards))


@dataclasses.dataclass(frozen=True)
class LossTerms:
    """The loss to minimise and its parts, averaged over completion tokens (floats are detached)."""

    loss: torch.Tensor
    policy: float
    kl: float
    clip_fraction: float
    is_weight_mean: float
    is_truncated_fraction: float


def policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    is_cap: float = 2.0,
    kl_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
) -> LossTerms:
    """The loss above. ``logp``, ``prox_logp``, ``behav_logp``, ``mask`` are [N, T]
    (mask marks completion tokens), ``advantages`` is [N]. ``ref_logp`` is needed
    when ``kl_coef > 0``. Raises ``ValueError`` on mismatched shapes."""
    if not (logp.shape == prox_logp.shape == behav_logp.shape == mask.shape):
        raise InvalidValueError(
            "logp, prox_logp, behav_logp and mask must share a shape, got "
            f"{tuple(logp.shape)}, {tuple(prox_logp.shape)}, {tuple(behav_logp.shape)}, {tuple(mask.shape)}"
        )
    if advantages.shape != logp.shape[:1]:
        raise InvalidValueError(f"advantages must be [N]={tuple(logp.shape[:1])}, got {tuple(advantages.shape)}")
    if kl_coef > 0 and ref_logp is None:
        raise InvalidValueError("kl_coef > 0 needs ref_logp (the frozen reference policy's log-probs)")
    mask_f = mask.to(logp.dtype)
    n_tokens = mask_f.sum().clamp_min(1.0)
    adv = advantages[:, None].to(logp.dtype)

    prox = prox_logp.detach()
    ratio = torch.exp(logp - prox)
    raw_weight = torch.exp(prox - behav_logp.detach())
    weight = raw_weight.clamp(max=is_cap)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    pg = -weight * torch.minimum(unclipped, clipped)
    total = pg
    kl_value = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None:
        diff = ref_logp.detach() - logp
        kl_tok = torch.exp(diff) - diff - 1
        kl_value = (kl_tok * mask_f).sum() / n_tokens
        if kl_coef > 0:
            total = total + kl_coef * kl_tok
    loss = (total * mask_f).sum() / n_tokens

    with torch.no_grad():
        outside = ((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)).to(logp.dtype)
        return LossTerms(
            loss=loss,
            policy=float((pg * mask_f).sum() / n_tokens),
            kl=float(kl_value),
            clip_fraction=float((outside * mask_f).sum() / n_tokens),
            is_weight_mean=float((weight * mask_f).sum() / n_tokens),
            is_truncated_fraction=float(((raw_weight > is_cap).to(logp.dtype) * mask_f).sum() / n_tokens),
        )

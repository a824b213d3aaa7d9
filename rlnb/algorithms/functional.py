"""The torch side of :mod:`rlnb.algorithms`: advantages, the policy loss and its
aggregation, the KL estimators, and the dry-run check of a function part. Pure
functions of tensors; nothing here keeps state.

The learner's step, in order (N samples of the update, T their padded width)::

    from rlnb.algorithms import functional as F

    # 1. filters and KL in the reward, on the whole batch, before advantages
    keep = [has_signal(r) for r in group_rewards]                   # drop_flat_groups
    mask = F.train_mask(alg, mask, truncated=truncated)            # mask_truncated
    if alg.kl_coef > 0 and alg.kl_in == "reward":
        rewards = rewards - F.kl_penalty(alg, prox_logp, ref_logp, mask)
    # 2. advantages, [N] or [N, T]
    adv = F.advantages(alg, rewards, group_of, lengths=mask.sum(1), mask=mask)
    # 3. per update (minibatch): the denominator of the whole update, once
    denom = F.normaliser(alg, mask[rows], max_length=max_new_tokens)
    tokens = int(mask[rows].sum())
    # 4. per chunk (micro-batch) of the update: this chunk's part of its loss
    terms = F.policy_loss(F.LossInputs(algorithm=alg, logp=logp, prox_logp=None, ...,
                                       normaliser=denom, update_tokens=tokens))
    terms.loss.backward()        # the chunks' losses add up to the update's loss

**Advantages.** ``advantages(algorithm, rewards, group_of, *, lengths=None,
mask=None, per_function=None, groups=None) -> Tensor``: ``rewards`` [N] (float64
from the learner: a weighted sum of rewards may pass float32's range), ``group_of``
[N] the group index of each sample (groups may differ in size; a sample's order
within its group is kept), ``lengths`` [N] the tokens each sample trains on
(default: ``mask.sum(1)``, else 1), ``mask`` [N, T] bool (needed for a function
that returns per-token advantages), ``per_function`` [N, F] the reward functions'
values, ``groups`` the rlnb ``Group`` objects by group index. Returns [N] float32 (a
group with a reward beyond :data:`FLOAT32_SAFE` is computed in float64, and the
result is then float64), or [N, T] when a function returns per-token advantages.
The group statistics run on [groups, G] tensors, one per group size, the way
``rlnb.learn``'s ``grpo_advantages`` did. Built-in estimators (``1e-6`` is
:data:`GROUP_EPS`, ``1e-8`` :data:`WHITEN_EPS`):

- ``grpo``: ``(R_i - mean_g) / (std_g + 1e-6)``, std by ``Algorithm.std``; 0 where
  ``std_g <= 1e-6`` (a flat group, or a group of one).
- ``dr_grpo``: ``R_i - mean_g``; 0 for a flat group.
- ``rloo``: ``R_i - mean_{j != i} R_j``; 0 for a flat group or a group of one.
- ``opo``: ``R_i - sum_j l_j R_j / sum_j l_j`` (``l``: ``lengths``).
- ``gpg``: ``alpha (R_i - mean_g)``, ``alpha = N / (N - M)``, M the samples in flat groups.
- ``reinforce_pp``: ``(R_i - mu) / sqrt(var + 1e-8)``, mu and var over the batch,
  each sample weighted by its ``lengths`` (verl's ``masked_whiten`` over tokens),
  var divided by ``sum l`` or ``sum l - 1`` (``Algorithm.std``).
- ``reinforce_pp_baseline``: the same whitening of ``R_i - mean_g``.
- ``gae``: per token, from a learned value function (``values=`` [N, T]: the
  critic's value of the state before each token; None: a critic that says 0).
  :func:`gae` gives ``A_t = sum_l (gamma lam)^l delta_{t+l}``, ``delta_t = r_t +
  gamma V_{t+1} - V_t``, over the policy's tokens only (an environment's tokens in a
  conversation are skipped, not discounted), the reward ``R_i`` at the last policy
  token; then :func:`whiten` over the batch's tokens, as verl and TRL do. The
  learner also trains the critic toward the returns ``A_t + V_t`` with
  :func:`value_loss`.

A function part is called as ``fn(rewards, per_function=..., lengths=..., mask=...,
groups=...)`` once per group size, with ``rewards`` [groups, G] and the context
likewise [groups, G, ...] (``mask`` [groups, G, T]; ``per_function``, ``mask`` and
``groups`` may be None); it returns [groups, G] or [groups, G, T]. Accept
``**context``: keys may be added.

**Policy loss.** ``policy_loss(inputs: LossInputs) -> LossTerms`` for one chunk of
an update. With ``r_t = exp(logp_t - prox_t)`` and ``w_t`` the mismatch weight
(``mismatch_weight``; from ``prox - behav``, per token or per sequence, truncated or
masked into ``[correction_low, correction_high]``), the per-token policy losses:

- ``ppo_clip``: ``-w_t min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A)``; with
  ``dual_clip=c``, for ``A < 0`` at most ``-w_t c A``.
- ``gspo``: as ppo_clip with the sequence ratio ``s_i = exp(mean_t (logp - prox))``
  in its token form ``sg[s_i] exp(logp_t - sg[logp_t])``.
- ``cispo``: ``-w_t sg[clip(r_t, 1 - clip_low, 1 + clip_high)] A logp_t``.
- ``sapo``: ``-w_t (4 / tau) sigmoid(tau (r_t - 1)) A``, tau by the sign of A.
- ``reinforce``: ``-w_t A logp_t`` (no ratio).

With ``top_entropy_quantile < 1`` only the tokens whose entropy is at least that
quantile of the chunk's trained tokens' keep their policy loss. The KL estimator
times ``kl_coef`` is added per token (``kl_in="loss"``) and ``entropy_coef`` times
the entropy subtracted; then the aggregation: the chunk's numerator (``token_mean``,
``seq_mean_token_sum``, ``seq_mean_token_sum_norm``: the sum of its tokens' losses;
``seq_mean_token_mean``: the sum over its samples of their token-means) divided by
``inputs.normaliser``, the whole update's denominator (``normaliser()``; None: the
chunk is the whole update). So each chunk's ``loss`` is its share, and their sum is
the update's loss, however the update is split.

A function part ``fn(inputs)`` returns per-token losses [N, T], aggregated as
above (KL and entropy terms added), or a scalar: this chunk's loss, weighted by its
share of the update's tokens (``update_tokens``), to which the KL and entropy terms
are added. Its losses are taken as they are: multiply by
``mismatch_weight(inputs)`` to correct for the engine's mismatch.

``LossTerms``' floats are means over the chunk's trained tokens (weight them by
``tokens`` to combine chunks): ``policy``, ``kl``, ``entropy``, ``clip_fraction``
(the ratio outside the clip range), ``clip_low_fraction``/``clip_high_fraction``
(the clip acting: below with A < 0, above with A > 0), ``is_weight_mean``,
``is_corrected_fraction`` (the mismatch weight outside its range: truncated or
masked), ``kept_fraction`` (kept by ``top_entropy_quantile``). ``clippable`` is
False where the ratio is 1 by construction (``prox_logp=None``: the proximal
policy is the current one) or the loss has no clip: clip fractions then mean nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlnb._errors import ConfigError, InvalidValueError
from rlnb.algorithms._parts import Settings as Algorithm  # what is read of an rlnb.algorithms.Algorithm
from rlnb.algorithms._parts import describe

__all__ = [
    "FLOAT32_SAFE",
    "GROUP_EPS",
    "WHITEN_EPS",
    "LossInputs",
    "LossTerms",
    "advantages",
    "check",
    "gae",
    "kl_divergence",
    "kl_penalty",
    "mismatch_weight",
    "normaliser",
    "policy_loss",
    "train_mask",
    "value_loss",
    "whiten",
]

# Beyond this, float32's group statistics can overflow (the sum of a group of rewards
# near 3.4e38, the square of a deviation past 1.8e19): such groups are read in float64.
FLOAT32_SAFE = 2.0**60
GROUP_EPS = 1e-6  # GRPO's: a group whose std is at most this is flat
WHITEN_EPS = 1e-8  # verl's masked_whiten
# exp of a summed log-ratio past this overflows float32; the bounds are far inside it
_LOG_CAP = 30.0


# --- advantages --------------------------------------------------------------------


def advantages(
    algorithm: Algorithm,
    rewards: torch.Tensor,
    group_of: torch.Tensor,
    *,
    lengths: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    per_function: torch.Tensor | None = None,
    groups: Sequence[Any] | None = None,
    values: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages [N] (or [N, T]) of ``rewards`` [N] by ``algorithm.advantage``; see
    the module's docstring (``values``: the critic's, for ``gae``). Raises
    ``ValueError`` for mismatched shapes, or for a function's result of the wrong
    shape (naming the function)."""
    rewards = torch.as_tensor(rewards)
    group_of = torch.as_tensor(group_of)
    if rewards.dim() != 1 or group_of.shape != rewards.shape:
        raise InvalidValueError(
            f"rewards and group_of must be [N], got {tuple(rewards.shape)} and {tuple(group_of.shape)}"
        )
    if mask is not None and (mask.dim() != 2 or mask.shape[0] != len(rewards)):
        raise InvalidValueError(f"mask must be [N={len(rewards)}, T], got {tuple(mask.shape)}")
    if lengths is None:
        lengths = mask.sum(1) if mask is not None else torch.ones(len(rewards))
    lengths = torch.as_tensor(lengths)
    if lengths.shape != rewards.shape:
        raise InvalidValueError(f"lengths must be [N={len(rewards)}], got {tuple(lengths.shape)}")
    if len(rewards) == 0:
        return torch.zeros(0)
    part = algorithm.advantage
    if part == "gae":
        token_mask = mask if mask is not None else torch.ones(len(rewards), 1, dtype=torch.bool)
        zero = torch.zeros(token_mask.shape, dtype=torch.float32)
        raw, _ = gae(rewards, zero if values is None else values, token_mask, algorithm.gamma, algorithm.lam)
        return whiten(raw, token_mask)
    if callable(part):
        return _function_advantages(part, rewards, group_of, lengths, mask, per_function, groups)
    assert isinstance(part, str)
    buckets = _buckets(group_of)
    parts = [_group_stage(part, algorithm.std, rewards[rows], lengths[rows].to(torch.float64)) for rows in buckets]
    out = torch.zeros(len(rewards), dtype=functools.reduce(torch.promote_types, [p.dtype for p in parts]))
    for rows, values in zip(buckets, parts, strict=True):
        out[rows.flatten()] = values.flatten().to(out.dtype)
    return _batch_stage(part, algorithm.std, out, rewards, lengths, buckets)


def _buckets(group_of: torch.Tensor) -> list[torch.Tensor]:
    """The rows of each group, as one [groups, G] index tensor per group size."""
    groups = group_of.long()
    sizes = torch.bincount(groups)
    rows = torch.argsort(groups, stable=True).split(sizes.tolist())
    by_size: dict[int, list[torch.Tensor]] = {}
    for r in rows:
        if len(r):
            by_size.setdefault(len(r), []).append(r)
    return [torch.stack(found) for _, found in sorted(by_size.items())]


def _group_stage(name: str, std: str, rewards: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[groups, G] -> [groups, G] in float32, or float64 for a group beyond FLOAT32_SAFE
    (``rlnb.learn``'s grpo_advantages, whose bits the default keeps)."""
    narrow = _group_values(name, std, rewards.to(torch.float32), lengths)
    wide = rewards.abs().amax(dim=1, keepdim=True) > FLOAT32_SAFE if rewards.numel() else None
    if wide is None or not bool(wide.any()):
        return narrow
    return torch.where(wide, _group_values(name, std, rewards.to(torch.float64), lengths), narrow.to(torch.float64))


def _group_values(name: str, std: str, r: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    size = r.shape[1]
    zero = torch.zeros_like(r)
    if name == "reinforce_pp":
        return r
    mean = r.mean(dim=1, keepdim=True)
    if name == "grpo":
        if size == 1:
            return zero
        sd = r.std(dim=1, keepdim=True, unbiased=std == "bessel")
        return torch.where(sd > GROUP_EPS, (r - mean) / (sd + GROUP_EPS), zero)
    flat = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)) | (size == 1)
    if name == "dr_grpo":
        population = r.std(dim=1, keepdim=True, unbiased=False)
        return torch.where(population > GROUP_EPS, r - mean, zero)
    if name == "rloo":
        return zero if size == 1 else torch.where(flat, zero, r - (r.sum(dim=1, keepdim=True) - r) / (size - 1))
    if name == "opo":
        weights = lengths.to(r.dtype)
        total = weights.sum(dim=1, keepdim=True)
        baseline = torch.where(total > 0, (weights * r).sum(dim=1, keepdim=True) / total.clamp_min(1e-30), mean)
        return torch.where(flat, zero, r - baseline)
    # gpg, reinforce_pp_baseline: centred here, scaled over the batch
    return torch.where(flat, zero, r - mean)


def _batch_stage(
    name: str,
    std: str,
    values: torch.Tensor,
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    buckets: list[torch.Tensor],
) -> torch.Tensor:
    if name == "gpg":
        flat = 0  # samples in groups whose rewards are all equal (a group of one included)
        for rows in buckets:
            r = rewards[rows]
            flat += rows.shape[1] * int((r.amax(dim=1) == r.amin(dim=1)).sum())
        n = len(values)
        return values * (n / max(n - flat, 1))
    if name not in ("reinforce_pp", "reinforce_pp_baseline"):
        return values
    # REINFORCE++ whitens the rewards themselves: read them at full precision
    x = rewards.to(torch.float64) if name == "reinforce_pp" else values.to(torch.float64)
    weights = lengths.to(torch.float64)
    total = weights.sum()
    count = total - (1.0 if std == "bessel" else 0.0)
    if float(count) <= 0:
        return torch.zeros_like(values, dtype=torch.float32)
    mu = (weights * x).sum() / total
    var = (weights * (x - mu) ** 2).sum() / count
    out = (x - mu) * torch.rsqrt(var + WHITEN_EPS)
    wide = bool((rewards.abs() > FLOAT32_SAFE).any())
    return out if wide else out.to(torch.float32)


def _function_advantages(
    fn: Callable[..., Any],
    rewards: torch.Tensor,
    group_of: torch.Tensor,
    lengths: torch.Tensor,
    mask: torch.Tensor | None,
    per_function: torch.Tensor | None,
    groups: Sequence[Any] | None,
) -> torch.Tensor:
    buckets = _buckets(group_of)
    results: list[tuple[torch.Tensor, torch.Tensor]] = []
    for rows in buckets:
        ids = group_of[rows[:, 0]].tolist()
        out = fn(
            rewards[rows],
            per_function=None if per_function is None else per_function[rows],
            lengths=lengths[rows],
            mask=None if mask is None else mask[rows],
            groups=None if groups is None else [groups[i] for i in ids],
        )
        shape = tuple(rows.shape)
        per_token = None if mask is None else (*shape, mask.shape[1])
        if not isinstance(out, torch.Tensor) or tuple(out.shape) not in (shape, per_token):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            want = f"{shape}" + ("" if per_token is None else f" or {per_token}")
            raise InvalidValueError(
                f"advantage function {describe(fn)} returned {got} for rewards {shape}: return a tensor of shape {want}"
            )
        results.append((rows, out))
    token_level = any(out.dim() == 3 for _, out in results)
    dtype = functools.reduce(torch.promote_types, [out.dtype for _, out in results])
    if not dtype.is_floating_point:
        dtype = torch.float32
    n = len(rewards)
    assert not token_level or mask is not None
    merged = torch.zeros((n, mask.shape[1]) if token_level and mask is not None else (n,), dtype=dtype)
    for rows, out in results:
        flat = out.reshape(rows.numel(), *out.shape[2:]).to(dtype)
        if token_level and flat.dim() == 1:
            flat = flat[:, None].expand(-1, merged.shape[1])
        merged[rows.flatten()] = flat
    return merged


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438) of
    outcome rewards: ``rewards`` [N] (given at each row's last ``mask`` token),
    ``values`` [N, T] (the value of the state before each token), ``mask`` [N, T]
    (the policy's tokens). Returns the advantages and the returns ``A + V``, both
    [N, T] float32 and 0 off the mask. The recursion runs over the policy's tokens
    only: an environment's tokens between two turns are skipped, not discounted."""
    mask = mask.to(torch.bool)
    n, width = mask.shape
    if values.shape != mask.shape or rewards.shape != (n,):
        raise InvalidValueError(
            f"gae needs rewards [N], values and mask [N, T] alike, got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)} and {tuple(mask.shape)}"
        )
    v = values.detach().to(torch.float32) * mask
    r = rewards.detach().to(torch.float32)
    last = torch.where(mask.any(dim=1), width - 1 - mask.flip(1).to(torch.int8).argmax(dim=1), -1)
    adv = torch.zeros(n, width)
    next_value, next_adv = torch.zeros(n), torch.zeros(n)
    for t in range(width - 1, -1, -1):
        on = mask[:, t]
        reward = torch.where(last == t, r, 0.0)
        delta = reward + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(on, a, 0.0)
        next_value = torch.where(on, v[:, t], next_value)
        next_adv = torch.where(on, a, next_adv)
    return adv, (adv + v) * mask


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` [N, T] centred and scaled over its ``mask`` tokens (Bessel's variance, eps
    :data:`WHITEN_EPS`: verl's ``masked_whiten``); 0 off the mask, and all 0 where
    fewer than two tokens count."""
    mask = mask.to(torch.bool)
    count = int(mask.sum())
    if count < 2:
        return torch.zeros_like(x, dtype=torch.float32)
    xs = x.to(torch.float64)[mask]
    mu, var = xs.mean(), xs.var(unbiased=True)
    out = (x.to(torch.float64) - mu) * torch.rsqrt(var + WHITEN_EPS)
    return (out * mask).to(torch.float32)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    normaliser: float,
) -> tuple[torch.Tensor, float]:
    """PPO's value loss of one chunk: ``sum 0.5 max((V - R)^2, (V_clip - R)^2) /
    normaliser`` over ``mask``, ``V_clip = V_old + clamp(V - V_old, -clip, clip)``
    (``clip`` None: the plain squared error); and the share of the chunk's tokens
    whose clipped error was the larger (where the clip acted)."""
    m = mask.to(values.dtype)
    error = (values - returns) ** 2
    if clip is None:
        return 0.5 * (error * m).sum() / normaliser, 0.0
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    error_clipped = (clipped - returns) ** 2
    acted = (error_clipped > error) & mask.to(torch.bool)
    loss = 0.5 * (torch.maximum(error, error_clipped) * m).sum() / normaliser
    return loss, float(acted.sum()) / max(1, int(mask.sum()))


# --- the update's tokens and its normaliser ----------------------------------------


def train_mask(algorithm: Algorithm, mask: torch.Tensor, *, truncated: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens trained on: ``mask`` [N, T] less the rows of completions cut at the
    length limit (``truncated`` [N] bool) when ``algorithm.mask_truncated``."""
    if not algorithm.mask_truncated or truncated is None:
        return mask
    return mask & ~truncated.to(torch.bool)[:, None]


def normaliser(algorithm: Algorithm, mask: torch.Tensor, *, max_length: int | None = None) -> float:
    """The denominator of the whole update's loss, from its ``mask`` [N, T] (of all its
    chunks): the tokens (``token_mean``), the samples with a token
    (``seq_mean_token_mean``, ``seq_mean_token_sum``), or N x ``max_length``
    (``seq_mean_token_sum_norm``: the longest a completion may be, e.g.
    ``RolloutConfig.max_new_tokens``; None: the longest row's last trained token, so
    that padding changes nothing). At least 1."""
    agg = algorithm.aggregation
    if agg == "token_mean":
        return max(1.0, float(mask.sum()))
    if agg in ("seq_mean_token_mean", "seq_mean_token_sum"):
        return max(1.0, float(mask.any(dim=1).sum()))
    if max_length is None:
        used = mask.any(dim=0).nonzero()
        max_length = int(used.max()) + 1 if len(used) else 1
    return float(max(1, mask.shape[0] * max_length))


# --- KL ------------------------------------------------------------------------------


def kl_divergence(estimator: str, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's): "k1"
    ``logp - ref``; "k2" ``(logp - ref)^2 / 2``; "k3" ``exp(ref - logp) - (ref - logp) - 1``
    (>= 0, unbiased, low variance; verl's "low_var_kl"); "k3+" k3's value with k2's
    gradient (verl's "k3+")."""
    ref = ref_logp.detach()
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref).square()
    diff = ref - logp
    k3 = torch.exp(diff) - diff - 1
    if estimator == "k3":
        return k3
    if estimator == "k3+":
        k2 = 0.5 * (logp - ref).square()
        return k2 + (k3 - k2).detach()
    raise InvalidValueError(f"kl estimator {estimator!r} is unknown: use 'k1', 'k2', 'k3' or 'k3+'")


def kl_penalty(algorithm: Algorithm, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sample KL penalty [N] to subtract from the rewards (``kl_in="reward"``):
    ``kl_coef * sum_t kl_t`` over the trained tokens, no gradient. ``logp`` is the
    sampling policy's (the proximal or behaviour log-probs)."""
    with torch.no_grad():
        kl = kl_divergence(algorithm.kl_estimator, logp.detach(), ref_logp)
        return algorithm.kl_coef * (kl * mask.to(kl.dtype)).sum(dim=1)


# --- the policy loss -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """What a policy loss sees, for one chunk of N samples of width T.

    algorithm: the :class:`Algorithm` (its settings: ``clip_low``, ``kl_coef``, ...).
    logp: [N, T] the current policy's log-probs of the sampled tokens, with gradient.
    prox_logp: [N, T] the proximal policy's (the policy at the step's start), or
        None when it is the current one (one update per batch): the ratio is then 1.
    behav_logp: [N, T] the behaviour log-probs the engine recorded.
    ref_logp: [N, T] the frozen reference's, or None (needed for ``kl_coef > 0``
        with ``kl_in="loss"``).
    advantages: [N] per sample or [N, T] per token.
    mask: [N, T] bool, the tokens trained on (a conversation's environment tokens
        and the padding are False).
    versions: [N] or [N, T] the policy version that sampled each sample (its oldest
        token) or token, or None.
    lengths: [N] each row's tokens (trained or not).
    entropy: [N, T] the current policy's entropy at each token (with gradient for an
        entropy bonus), or None (needed for ``entropy_coef`` or ``top_entropy_quantile``).
    normaliser: the whole update's denominator (:func:`normaliser`); None: this
        chunk is the whole update.
    update_tokens: the tokens trained on in the whole update; None: this chunk's.
    """

    algorithm: Algorithm
    logp: torch.Tensor
    prox_logp: torch.Tensor | None
    behav_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logp: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    normaliser: float | None = None
    update_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class LossTerms:
    """One chunk's loss (``loss``: its part of the update's loss, to backpropagate)
    and, as floats, means over its trained tokens (``tokens`` of them): ``policy``,
    ``kl``, ``entropy``, ``clip_fraction``, ``clip_low_fraction``,
    ``clip_high_fraction``, ``is_weight_mean``, ``is_corrected_fraction``,
    ``kept_fraction``; ``clippable``: whether the ratio can differ from 1 and a clip
    act on it (see the module's docstring)."""

    loss: torch.Tensor
    policy: float
    kl: float
    entropy: float
    clip_fraction: float
    clip_low_fraction: float
    clip_high_fraction: float
    is_weight_mean: float
    is_corrected_fraction: float
    kept_fraction: float
    tokens: int
    clippable: bool


def mismatch_weight(inputs: LossInputs) -> torch.Tensor:
    """The engine/learner mismatch weight of ``inputs`` ([N, T], or [N, 1] per
    sequence; no gradient) by ``algorithm.correction``."""
    return _mismatch(inputs)[0]


def _mismatch(inputs: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, outside its range) for ``inputs``."""
    alg, logp = inputs.algorithm, inputs.logp
    prox = (logp if inputs.prox_logp is None else inputs.prox_logp).detach()
    if alg.correction == "none":
        return torch.ones_like(prox), torch.zeros_like(prox, dtype=torch.bool)
    level, how = alg.correction.split("_")
    if level == "token":
        raw = torch.exp(prox - inputs.behav_logp.detach())
    else:  # the sequence's weight: the product of its tokens'
        log_w = ((prox - inputs.behav_logp.detach()) * inputs.mask.to(prox.dtype)).sum(dim=1, keepdim=True)
        raw = torch.exp(log_w.clamp(-_LOG_CAP, _LOG_CAP))
    low, high = alg.correction_low, alg.correction_high
    outside = (raw < low) | (raw > high)
    if how == "truncate":
        # only an upper clamp when there is no lower bound: rlnb's weight as it was, bit for bit
        weight = raw.clamp(min=low, max=high) if low > 0 else raw.clamp(max=high)
    else:
        weight = torch.where(outside, torch.zeros_like(raw), raw)
    return weight, outside


def _builtin_loss(
    alg: Algorithm, logp: torch.Tensor, prox: torch.Tensor, adv: torch.Tensor, mask_f: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss before the mismatch weight, the ratio, clip acting below, above)."""
    low, high = 1 - alg.clip_low, 1 + alg.clip_high
    if alg.loss == "gspo":
        seq = ((logp - prox) * mask_f).sum(dim=1, keepdim=True) / mask_f.sum(dim=1, keepdim=True).clamp_min(1.0)
        ratio = torch.exp((logp - logp.detach() + seq.detach()).clamp(max=10.0))
    else:
        ratio = torch.exp(logp - prox)
    below, above = (ratio < low) & (adv < 0), (ratio > high) & (adv > 0)
    if alg.loss in ("ppo_clip", "gspo"):
        unclipped = ratio * adv
        clipped = ratio.clamp(low, high) * adv
        core = -torch.minimum(unclipped, clipped)
        if alg.dual_clip is not None:
            core = torch.where(adv < 0, torch.minimum(core, -adv * alg.dual_clip), core)
    elif alg.loss == "cispo":
        core = -ratio.clamp(low, high).detach() * adv * logp
        below, above = ratio < low, ratio > high
    elif alg.loss == "sapo":
        pos, neg = (torch.tensor(t, dtype=logp.dtype, device=logp.device) for t in (alg.sapo_tau_pos, alg.sapo_tau_neg))
        tau = torch.where(adv > 0, pos, neg)
        core = -(torch.sigmoid(tau * (ratio - 1)) * 4 / tau) * adv
        below = above = torch.zeros_like(below)
    else:  # reinforce
        core = -adv * logp
        below = above = torch.zeros_like(below)
    return core, ratio, below, above


def _validate(inputs: LossInputs) -> None:
    alg, logp = inputs.algorithm, inputs.logp
    if logp.dim() != 2:
        raise InvalidValueError(f"logp must be [N, T], got {tuple(logp.shape)}")
    for name in ("prox_logp", "behav_logp", "mask", "ref_logp", "entropy"):
        value = getattr(inputs, name)
        if value is not None and value.shape != logp.shape:
            raise InvalidValueError(f"{name} must be [N, T]={tuple(logp.shape)} like logp, got {tuple(value.shape)}")
    if inputs.advantages.shape not in (logp.shape[:1], logp.shape):
        raise InvalidValueError(
            f"advantages must be [N]={tuple(logp.shape[:1])} or [N, T]={tuple(logp.shape)}, "
            f"got {tuple(inputs.advantages.shape)}"
        )
    if alg.kl_coef > 0 and alg.kl_in == "loss" and inputs.ref_logp is None:
        raise InvalidValueError("kl_coef > 0 needs ref_logp (the frozen reference policy's log-probs)")
    if (alg.entropy_coef != 0 or alg.top_entropy_quantile < 1) and inputs.entropy is None:
        raise InvalidValueError("entropy_coef != 0 and top_entropy_quantile < 1 need the entropy of each token")


def policy_loss(inputs: LossInputs) -> LossTerms:
    """This chunk's loss and its parts by ``inputs.algorithm``; see the module's
    docstring. Raises ``ValueError`` for mismatched shapes or missing inputs, or for a
    function's result that is neither a scalar nor [N, T] (naming the function); an
    exception of the function itself propagates."""
    _validate(inputs)
    alg, logp = inputs.algorithm, inputs.logp
    mask_f = inputs.mask.to(logp.dtype)
    n_tokens = mask_f.sum().clamp_min(1.0)
    adv = inputs.advantages.to(logp.dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv
    prox = logp.detach() if inputs.prox_logp is None else inputs.prox_logp.detach()
    weight, corrected = _mismatch(inputs)
    keep = _high_entropy(inputs)
    scalar: torch.Tensor | None = None
    if callable(alg.loss):
        out = alg.loss(inputs)
        if not isinstance(out, torch.Tensor) or (out.dim() != 0 and out.shape != logp.shape):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise InvalidValueError(
                f"loss function {describe(alg.loss)} returned {got}: return a scalar or per-token losses "
                f"[N, T]={tuple(logp.shape)}"
            )
        with torch.no_grad():
            ratio = torch.exp(logp - prox)
        below = above = torch.zeros_like(inputs.mask)
        pg = out if out.dim() else torch.zeros_like(logp)
        scalar = out if out.dim() == 0 else None
    else:
        core, ratio, below, above = _builtin_loss(alg, logp, prox, adv, mask_f)
        pg = weight * core
    if keep is not None and scalar is None:
        pg = pg * keep
    total = pg
    kl_tok = None
    if inputs.ref_logp is not None:
        kl_tok = kl_divergence(alg.kl_estimator, logp, inputs.ref_logp)
        if alg.kl_coef > 0 and alg.kl_in == "loss":
            total = total + alg.kl_coef * kl_tok
    if alg.entropy_coef != 0 and inputs.entropy is not None:
        total = total - alg.entropy_coef * inputs.entropy
    denominator = n_tokens if inputs.normaliser is None and alg.aggregation == "token_mean" else None
    if denominator is None:
        value = normaliser(alg, inputs.mask) if inputs.normaliser is None else inputs.normaliser
        denominator = torch.tensor(value, dtype=logp.dtype, device=logp.device)
    loss = _numerator(alg.aggregation, total, mask_f) / denominator
    if scalar is not None:
        share = float(mask_f.sum()) / (inputs.update_tokens or max(1.0, float(mask_f.sum())))
        loss = loss + scalar * share

    with torch.no_grad():

        def mean(x: torch.Tensor) -> float:
            return float((x.to(logp.dtype) * mask_f).sum() / n_tokens)

        ones = torch.ones_like(logp)
        low, high = 1 - alg.clip_low, 1 + alg.clip_high
        return LossTerms(
            loss=loss,
            policy=float(scalar.detach()) if scalar is not None else mean(pg),
            kl=0.0 if kl_tok is None else mean(kl_tok),
            entropy=0.0 if inputs.entropy is None else mean(inputs.entropy),
            clip_fraction=mean((ratio < low) | (ratio > high)),
            clip_low_fraction=mean(below),
            clip_high_fraction=mean(above),
            is_weight_mean=mean(weight * ones),
            is_corrected_fraction=mean(corrected & inputs.mask),
            kept_fraction=1.0 if keep is None else mean(keep),
            tokens=int(inputs.mask.sum()),
            clippable=inputs.prox_logp is not None and alg.loss in ("ppo_clip", "gspo", "cispo"),
        )


def _numerator(aggregation: str, total: torch.Tensor, mask_f: torch.Tensor) -> torch.Tensor:
    if aggregation == "seq_mean_token_mean":
        return ((total * mask_f).sum(dim=1) / mask_f.sum(dim=1).clamp_min(1.0)).sum()
    return (total * mask_f).sum()


def _high_entropy(inputs: LossInputs) -> torch.Tensor | None:
    """1.0 at the trained tokens whose entropy is in the top ``top_entropy_quantile``
    of the chunk's (TRL's ``get_high_entropy_mask``), else 0.0; None to keep all."""
    q = inputs.algorithm.top_entropy_quantile
    if q >= 1 or inputs.entropy is None:
        return None
    entropy = inputs.entropy.detach()
    chosen = entropy[inputs.mask]
    if chosen.numel() == 0:
        return None
    threshold = torch.quantile(chosen.float(), 1 - q)
    return ((entropy >= threshold) & inputs.mask).to(inputs.logp.dtype)


# --- the dry run -------------------------------------------------------------------


def check(algorithm: Algorithm) -> None:
    """Try ``algorithm``'s function parts on a small dry batch (CPU, float32: 2 groups
    of 4, mixed lengths, a masked token inside a row, stale tokens). Raises
    :class:`~rlnb.ConfigError` naming the function for an exception, a result of the
    wrong shape, a NaN or inf, or a loss without gradient."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([6, 3, 5, 1, 6, 4, 2, 6])
    n, width = len(lengths), int(lengths.max())
    mask = torch.arange(width)[None, :] < lengths[:, None]
    mask[0, 2] = False  # an environment's token inside a conversation
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25])
    group_of = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv: torch.Tensor = torch.tensor([0.9, -1.2, 0.0, 0.9, -0.6, -0.6, 1.5, -0.3])
    if callable(algorithm.advantage):
        name = f"Algorithm.advantage={describe(algorithm.advantage)}"
        try:
            adv = advantages(algorithm, rewards, group_of, lengths=mask.sum(1), mask=mask)
        except Exception as exc:
            raise ConfigError(f"{name} failed on a dry batch of 2 groups of 4: {exc}") from exc
        if not bool(torch.isfinite(adv).all()):
            raise ConfigError(
                f"{name} returned a NaN or inf on a dry batch of 2 groups of 4 (rewards {rewards.tolist()})"
            )
    if not callable(algorithm.loss):
        return
    name = f"Algorithm.loss={describe(algorithm.loss)}"
    logits = torch.randn(n, width, 5, generator=gen, requires_grad=True)
    targets = torch.randint(0, 5, (n, width), generator=gen)
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    old = logp.detach()
    inputs = LossInputs(
        algorithm=algorithm,
        logp=logp,
        prox_logp=old + 0.05 * torch.randn(n, width, generator=gen),
        behav_logp=old + 0.1 * torch.randn(n, width, generator=gen),
        advantages=adv.float(),
        mask=mask,
        ref_logp=old - 0.1,
        versions=torch.tensor([3, 3, 2, 3, 3, 1, 3, 3]),
        lengths=lengths,
        entropy=entropy,
    )
    try:
        terms = policy_loss(inputs)
    except Exception as exc:
        raise ConfigError(f"{name} failed on a dry batch of 8 samples: {exc}") from exc
    if not bool(torch.isfinite(terms.loss).all()):
        raise ConfigError(f"{name} gave a loss of {float(terms.loss.detach())} on a dry batch: it must be finite")
    if not terms.loss.requires_grad:
        raise ConfigError(f"{name} gave a loss without gradient: compute it from inputs.logp (it has one)")
    (grad,) = torch.autograd.grad(terms.loss, logits, allow_unused=True)
    if grad is None or not bool(torch.isfinite(grad).all()):
        what = "no gradient reaches the policy" if grad is None else "its gradient has a NaN or inf"
        raise ConfigError(f"{name}: {what} on a dry batch: compute the loss from inputs.logp")

"""Each preset against a float64 reference written from its formula, one token at a
time (none of rlnb.algorithms' helpers), on batches with padding, mixed lengths,
multi-turn masks and stale tokens; the invariants the estimators and losses keep;
the default against rlnb's loss as it was, bit for bit."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlnb.algorithms import AGGREGATIONS, PRESETS, Algorithm, preset
from rlnb.algorithms import functional as F
from rlnb.learn import grpo_advantages, policy_loss

F64 = torch.float64


@dataclasses.dataclass
class Batch:
    logits: torch.Tensor  # the leaf the gradient is taken against
    prox: torch.Tensor
    behav: torch.Tensor
    ref: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor

    def logp(self) -> torch.Tensor:
        return self.logits.log_softmax(-1)[..., 0]


def make_batch(seed: int = 0, *, dtype: torch.dtype = F64, stale: float = 0.3) -> Batch:
    """8 rows of mixed lengths, padded to 7, two with an environment's tokens inside,
    and log-probs of the proximal and behaviour policies that differ from the current."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4, 2, 7])
    mask = torch.arange(7)[None, :] < lengths[:, None]
    mask[0, 2:4] = False
    mask[4, 1] = False
    logits = torch.randn(8, 7, 3, generator=gen, dtype=dtype).requires_grad_()
    logp = logits.detach().log_softmax(-1)[..., 0]
    return Batch(
        logits=logits,
        prox=logp + stale * torch.randn(8, 7, generator=gen, dtype=dtype),
        behav=logp + stale * torch.randn(8, 7, generator=gen, dtype=dtype),
        ref=logp + 0.2 * torch.randn(8, 7, generator=gen, dtype=dtype),
        adv=torch.randn(8, generator=gen, dtype=dtype),
        mask=mask,
    )


def run(alg: Algorithm, b: Batch, *, prox: bool = True, **extra: object) -> tuple[F.LossTerms, torch.Tensor]:
    logp = b.logp()
    terms = F.policy_loss(
        F.LossInputs(
            algorithm=alg,
            logp=logp,
            prox_logp=b.prox if prox else None,
            behav_logp=b.behav,
            advantages=b.adv,
            mask=b.mask,
            ref_logp=b.ref,
            **extra,  # type: ignore[arg-type]
        )
    )
    (grad,) = torch.autograd.grad(terms.loss, b.logits)
    return terms, grad


# --- the references: scalar arithmetic, token by token ----------------------------


def reference_loss(alg: Algorithm, b: Batch, *, max_length: int = 10) -> torch.Tensor:
    logp = b.logp()
    rows: list[list[torch.Tensor]] = []
    for i in range(logp.shape[0]):
        tokens = [t for t in range(logp.shape[1]) if b.mask[i, t]]
        a = b.adv[i]
        seq_ratio = None
        if alg.loss == "gspo" and tokens:
            seq_ratio = torch.exp(torch.stack([logp[i, t] - b.prox[i, t] for t in tokens]).mean())
        row = []
        for t in tokens:
            w = min(math.exp(float(b.prox[i, t] - b.behav[i, t])), alg.correction_high)
            r = torch.exp(logp[i, t] - b.prox[i, t])
            lo, hi = 1 - alg.clip_low, 1 + alg.clip_high
            if alg.loss == "ppo_clip":
                loss = -torch.minimum(r * a, r.clamp(lo, hi) * a)
                if alg.dual_clip is not None and a < 0:
                    loss = torch.minimum(loss, -alg.dual_clip * a)
            elif alg.loss == "gspo":
                assert seq_ratio is not None
                s = seq_ratio.detach() * torch.exp(logp[i, t] - logp[i, t].detach())  # GSPO-token
                loss = -torch.minimum(s * a, s.clamp(lo, hi) * a)
            elif alg.loss == "cispo":
                loss = -float(r.detach().clamp(lo, hi)) * a * logp[i, t]
            elif alg.loss == "sapo":
                tau = alg.sapo_tau_pos if a > 0 else alg.sapo_tau_neg
                loss = -(4 / tau) * torch.sigmoid(tau * (r - 1)) * a
            else:
                loss = -a * logp[i, t]
            diff = b.ref[i, t] - logp[i, t]
            row.append(w * loss + alg.kl_coef * (torch.exp(diff) - diff - 1))
        rows.append(row)
    zero = torch.zeros((), dtype=F64)
    sums = [sum(row, zero) for row in rows]
    total = sum(sums, zero)
    count = sum(len(row) for row in rows)
    if alg.aggregation == "token_mean":
        return total / count
    if alg.aggregation == "seq_mean_token_mean":
        means = [s / len(row) for s, row in zip(sums, rows, strict=True) if row]
        return sum(means, zero) / len(means)
    if alg.aggregation == "seq_mean_token_sum":
        return total / sum(1 for row in rows if row)
    return total / (len(rows) * max_length)


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("seed", [0, 1])
def test_each_preset_matches_its_formula(name: str, seed: int) -> None:
    alg = preset(name).replace(kl_coef=0.05, kl_estimator="k3", kl_in="loss")
    b = make_batch(seed)
    terms, grad = run(alg, b, normaliser=F.normaliser(alg, b.mask, max_length=10))
    want = reference_loss(alg, b)
    (want_grad,) = torch.autograd.grad(want, b.logits)
    torch.testing.assert_close(terms.loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    assert terms.clippable == (alg.loss in ("ppo_clip", "gspo", "cispo"))


# --- advantages ---------------------------------------------------------------------

REWARDS = [[1.0, 0.0, 0.5, 1.0], [0.0, 0.0, 0.0], [2.0, -1.0], [0.25, 0.75, 0.5, 0.5, 1.0], [3.0]]
LENGTHS = [[4, 9, 2, 5], [3, 3, 1], [7, 2], [1, 2, 3, 4, 5], [6]]


def flat(groups: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = torch.tensor([r for g in groups for r in g], dtype=F64)
    group_of = torch.tensor([i for i, g in enumerate(groups) for _ in g])
    return rewards, group_of


def std(xs: list[float], bessel: bool) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - (1 if bessel else 0)))


def whiten(xs: list[float], ls: list[float], bessel: bool) -> list[float]:
    total = sum(ls)
    mu = sum(n * x for n, x in zip(ls, xs, strict=True)) / total
    var = sum(n * (x - mu) ** 2 for n, x in zip(ls, xs, strict=True)) / (total - (1 if bessel else 0))
    return [(x - mu) / math.sqrt(var + 1e-8) for x in xs]


def reference_advantages(name: str, bessel: bool) -> list[float]:
    out: list[float] = []
    ls = [float(x) for g in LENGTHS for x in g]
    flat_samples = sum(len(g) for g in REWARDS if len(set(g)) == 1)
    for g, lg in zip(REWARDS, LENGTHS, strict=True):
        m = sum(g) / len(g)
        flat_group = len(set(g)) == 1
        for i, r in enumerate(g):
            if flat_group and name != "reinforce_pp":
                out.append(0.0)
            elif name == "grpo":
                s = std(g, bessel)
                out.append((r - m) / (s + 1e-6))
            elif name in ("dr_grpo", "reinforce_pp_baseline"):
                out.append(r - m)
            elif name == "gpg":
                n = sum(len(x) for x in REWARDS)
                out.append((r - m) * n / (n - flat_samples))
            elif name == "rloo":
                out.append(r - sum(x for j, x in enumerate(g) if j != i) / (len(g) - 1))
            elif name == "opo":
                out.append(r - sum(n * x for n, x in zip(lg, g, strict=True)) / sum(lg))
            else:
                out.append(r)
    if name in ("reinforce_pp", "reinforce_pp_baseline"):
        return whiten(out, ls, bessel)
    return out


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "opo", "gpg", "reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("std_kind", ["population", "bessel"])
def test_each_estimator_matches_its_formula_on_groups_of_mixed_sizes(name: str, std_kind: str) -> None:
    rewards, group_of = flat(REWARDS)
    lengths = torch.tensor([x for g in LENGTHS for x in g])
    got = F.advantages(Algorithm(advantage=name, std=std_kind), rewards, group_of, lengths=lengths)
    assert got.dtype == torch.float32
    want = torch.tensor(reference_advantages(name, std_kind == "bessel"), dtype=F64)
    torch.testing.assert_close(got.to(F64), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "gpg"])
def test_group_advantages_sum_to_zero(name: str) -> None:
    rewards, group_of = flat(REWARDS)
    got = F.advantages(Algorithm(advantage=name, std="bessel"), rewards, group_of).to(F64)
    sums = torch.zeros(len(REWARDS), dtype=F64).index_add_(0, group_of, got)
    torch.testing.assert_close(sums, torch.zeros_like(sums), atol=1e-5, rtol=0)


def test_opo_advantages_sum_to_zero_weighted_by_length() -> None:
    rewards, group_of = flat(REWARDS)
    lengths = torch.tensor([x for g in LENGTHS for x in g], dtype=F64)
    got = F.advantages(Algorithm(advantage="opo"), rewards, group_of, lengths=lengths).to(F64)
    sums = torch.zeros(len(REWARDS), dtype=F64).index_add_(0, group_of, got * lengths)
    torch.testing.assert_close(sums, torch.zeros_like(sums), atol=1e-5, rtol=0)


def test_rloo_is_the_reward_less_the_mean_of_the_others() -> None:
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(5, 6, generator=gen, dtype=F64)
    got = F.advantages(Algorithm(advantage="rloo"), rewards.flatten(), torch.arange(5).repeat_interleave(6))
    for g in range(5):
        for i in range(6):
            others = [float(rewards[g, j]) for j in range(6) if j != i]
            assert float(got[g * 6 + i]) == pytest.approx(float(rewards[g, i]) - sum(others) / 5, abs=1e-6)


def test_a_group_beyond_float32_safe_is_computed_in_float64() -> None:
    rewards = torch.tensor([1e300, -1e300, 0.0, 1.0, 0.0, 1.0], dtype=F64)
    got = F.advantages(Algorithm(), rewards, torch.tensor([0, 0, 0, 1, 1, 1]))
    assert got.dtype == F64 and bool(torch.isfinite(got).all())


# --- the default is rlnb's loss as it was, bit for bit -----------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("single_update", [True, False])
def test_the_default_is_the_old_loss_bit_for_bit(seed: int, kl_coef: float, single_update: bool) -> None:
    b = make_batch(seed, dtype=torch.float32, stale=0.5)
    logp = b.logp()
    prox = logp.detach() if single_update else b.prox
    old = policy_loss(logp, prox, b.behav, b.adv, b.mask, clip_eps=0.2, is_cap=2.0, kl_coef=kl_coef, ref_logp=b.ref)
    (old_grad,) = torch.autograd.grad(old.loss, b.logits)
    new, new_grad = run(Algorithm(kl_coef=kl_coef), b, prox=not single_update)
    assert torch.equal(new.loss, old.loss)
    assert torch.equal(new_grad, old_grad)
    assert (new.policy, new.kl, new.clip_fraction, new.is_weight_mean, new.is_corrected_fraction) == (
        old.policy,
        old.kl,
        old.clip_fraction,
        old.is_weight_mean,
        old.is_truncated_fraction,
    )
    assert new.clippable == (not single_update)


@pytest.mark.parametrize("seed", range(4))
def test_the_default_advantages_are_the_old_ones_bit_for_bit(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    same = (torch.randint(0, 3, (6, 8), generator=gen) * 0.5).to(F64)
    same[0] = 1.0  # a flat group
    same[1, 0] = 2.0**70  # a group read in float64
    got = F.advantages(Algorithm(), same.flatten(), torch.arange(6).repeat_interleave(8))
    assert torch.equal(got, grpo_advantages(same).flatten())
    mixed = [torch.randn(n, generator=gen, dtype=F64).tolist() for n in (3, 8, 1, 5, 8)]
    rewards, group_of = flat(mixed)
    old = torch.cat([grpo_advantages(torch.tensor([r], dtype=F64))[0] for r in mixed])
    assert torch.equal(F.advantages(Algorithm(), rewards, group_of), old)
    dr = F.advantages(Algorithm(advantage="dr_grpo"), rewards, group_of)
    assert torch.equal(dr, torch.cat([grpo_advantages(torch.tensor([r], dtype=F64), scale=False)[0] for r in mixed]))


# --- invariants of the losses --------------------------------------------------------


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo", "sapo", "reinforce"])
def test_with_the_ratio_at_one_the_gradient_is_minus_a_grad_logp(loss: str) -> None:
    b = make_batch(5)
    alg = Algorithm(loss=loss, correction="none", clip_low=3e-4, clip_high=4e-4)
    logp = b.logp()
    terms = F.policy_loss(
        F.LossInputs(algorithm=alg, logp=logp, prox_logp=None, behav_logp=b.behav, advantages=b.adv, mask=b.mask)
    )
    (grad,) = torch.autograd.grad(terms.loss, logp)
    want = -b.adv[:, None] * b.mask / b.mask.sum()
    torch.testing.assert_close(grad, want.to(F64), rtol=1e-12, atol=1e-14)
    assert not terms.clippable and terms.clip_fraction == 0.0


def test_the_dual_clip_bounds_a_negative_advantage_s_loss() -> None:
    logp = torch.tensor([[0.0, 0.0]], dtype=F64, requires_grad=True)
    prox = torch.tensor([[-3.0, -0.1]], dtype=F64)  # ratios e^3 = 20 and e^0.1
    mask = torch.tensor([[True, False]])
    adv = torch.tensor([-1.5], dtype=F64)

    def token_loss(alg: Algorithm) -> float:
        inputs = F.LossInputs(algorithm=alg, logp=logp, prox_logp=prox, behav_logp=prox, advantages=adv, mask=mask)
        return float(F.policy_loss(inputs).loss.detach())

    assert token_loss(Algorithm()) == pytest.approx(math.exp(3) * 1.5)
    assert token_loss(Algorithm(dual_clip=3.0)) == pytest.approx(3.0 * 1.5)
    b = make_batch(2, stale=2.0)
    b.adv = -b.adv.abs()
    for c in (1.5, 3.0):
        alg = Algorithm(dual_clip=c, correction="none")
        for i in range(8):
            for t in range(7):
                if b.mask[i, t]:
                    one = torch.zeros_like(b.mask)
                    one[i, t] = True
                    inputs = F.LossInputs(
                        algorithm=alg, logp=b.logp(), prox_logp=b.prox, behav_logp=b.behav, advantages=b.adv, mask=one
                    )
                    assert float(F.policy_loss(inputs).loss.detach()) <= c * float(-b.adv[i]) + 1e-12


def test_the_constant_normaliser_does_not_change_with_padding() -> None:
    alg = preset("dr_grpo")
    b = make_batch(4)
    padded = torch.nn.functional.pad(b.mask, (0, 9))
    assert F.normaliser(alg, b.mask) == F.normaliser(alg, padded) == 8 * 7
    assert F.normaliser(alg, b.mask, max_length=64) == F.normaliser(alg, padded, max_length=64) == 8 * 64
    wide = Batch(
        logits=torch.nn.functional.pad(b.logits.detach(), (0, 0, 0, 9)).requires_grad_(),
        prox=torch.nn.functional.pad(b.prox, (0, 9)),
        behav=torch.nn.functional.pad(b.behav, (0, 9)),
        ref=torch.nn.functional.pad(b.ref, (0, 9)),
        adv=b.adv,
        mask=padded,
    )
    assert float(run(alg, b)[0].loss.detach()) == pytest.approx(float(run(alg, wide)[0].loss.detach()), rel=1e-12)


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("correction", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_mismatch_weights_of_one_change_nothing(name: str, correction: str) -> None:
    b = make_batch(6)
    b.behav = b.prox.clone()
    base = preset(name)
    none, none_grad = run(base.replace(correction="none"), b)
    corrected, grad = run(base.replace(correction=correction, correction_low=0.5), b)
    assert float(corrected.loss.detach()) == pytest.approx(float(none.loss.detach()), rel=1e-12)
    torch.testing.assert_close(grad, none_grad, rtol=1e-12, atol=1e-14)
    assert corrected.is_weight_mean == pytest.approx(1.0) and corrected.is_corrected_fraction == 0.0


def test_mask_correction_drops_the_tokens_outside_its_bounds() -> None:
    b = make_batch(7, stale=1.0)
    terms, _ = run(Algorithm(correction="token_mask", correction_low=0.5, correction_high=2.0), b)
    raw = torch.exp(b.prox - b.behav)[b.mask]
    outside = ((raw < 0.5) | (raw > 2.0)).to(F64)
    assert terms.is_corrected_fraction == pytest.approx(float(outside.mean()))
    assert terms.is_weight_mean == pytest.approx(float((raw * (1 - outside)).mean()))
    seq, _ = run(Algorithm(correction="sequence_truncate", correction_high=1.5), b)
    assert seq.is_weight_mean <= 1.5


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "custom_scalar", "custom_tokens"])
def test_chunks_add_up_to_the_update_s_loss(aggregation: str, loss: str) -> None:
    def scalar(inputs: F.LossInputs) -> torch.Tensor:
        return -(inputs.advantages[:, None] * inputs.logp * inputs.mask).sum() / inputs.mask.sum().clamp_min(1)

    def tokens(inputs: F.LossInputs) -> torch.Tensor:
        return -(inputs.advantages[:, None] * inputs.logp)

    part = {"custom_scalar": scalar, "custom_tokens": tokens}.get(loss, loss)
    alg = Algorithm(loss=part, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01)
    b = make_batch(8)
    logp_all = b.logits.log_softmax(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    logp = logp_all[..., 0]
    denom = F.normaliser(alg, b.mask, max_length=12)
    update_tokens = int(b.mask.sum())

    def inputs(rows: slice) -> F.LossInputs:
        return F.LossInputs(
            algorithm=alg,
            logp=logp[rows],
            prox_logp=b.prox[rows],
            behav_logp=b.behav[rows],
            advantages=b.adv[rows],
            mask=b.mask[rows],
            ref_logp=b.ref[rows],
            entropy=entropy[rows],
            normaliser=denom,
            update_tokens=update_tokens,
        )

    whole = F.policy_loss(inputs(slice(0, 8))).loss
    parts = [F.policy_loss(inputs(rows)).loss for rows in (slice(0, 3), slice(3, 4), slice(4, 8))]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "k3+"])
def test_kl_estimators(estimator: str) -> None:
    logp = torch.tensor([-1.0, -0.2, -3.0], dtype=F64, requires_grad=True)
    ref = torch.tensor([-1.5, -0.2, -1.0], dtype=F64)
    kl = F.kl_divergence(estimator, logp, ref)
    x = (logp - ref).detach()
    values = {"k1": x, "k2": x**2 / 2, "k3": torch.exp(-x) + x - 1, "k3+": torch.exp(-x) + x - 1}
    grads = {"k1": torch.ones_like(x), "k2": x, "k3": 1 - torch.exp(-x), "k3+": x}
    torch.testing.assert_close(kl.detach(), values[estimator])
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    torch.testing.assert_close(grad, grads[estimator])


def test_kl_in_the_reward_and_the_train_mask() -> None:
    b = make_batch(9)
    alg = preset("reinforce_pp").replace(kl_coef=0.5)
    penalty = F.kl_penalty(alg, b.prox, b.ref, b.mask)
    want = [0.5 * sum(float(b.prox[i, t] - b.ref[i, t]) for t in range(7) if b.mask[i, t]) for i in range(8)]
    torch.testing.assert_close(penalty, torch.tensor(want, dtype=F64))
    truncated = torch.tensor([False, True] + [False] * 6)
    assert torch.equal(F.train_mask(Algorithm(), b.mask, truncated=truncated), b.mask)
    kept = F.train_mask(preset("dapo"), b.mask, truncated=truncated)
    assert not kept[1].any() and torch.equal(kept[0], b.mask[0])


def test_top_entropy_quantile_keeps_the_high_entropy_tokens() -> None:
    b = make_batch(10)
    logp_all = b.logits.log_softmax(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    alg = Algorithm(top_entropy_quantile=0.25, correction="none")
    terms = F.policy_loss(
        F.LossInputs(
            algorithm=alg,
            logp=logp_all[..., 0],
            prox_logp=None,
            behav_logp=b.behav,
            advantages=b.adv,
            mask=b.mask,
            entropy=entropy,
        )
    )
    assert 0.2 <= terms.kept_fraction <= 0.35
    (grad,) = torch.autograd.grad(terms.loss, logp_all, retain_graph=True)
    chosen = entropy.detach()[b.mask]
    low = b.mask & (entropy.detach() < torch.quantile(chosen, 0.75))
    assert float(grad[..., 0][low].abs().sum()) == 0.0


def test_a_function_s_per_token_advantages_reach_the_loss() -> None:
    def per_token(rewards: torch.Tensor, *, mask: torch.Tensor, **context: object) -> torch.Tensor:
        return (rewards - rewards.mean(dim=1, keepdim=True))[..., None] * mask

    b = make_batch(11)
    group_of = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = F.advantages(Algorithm(advantage=per_token), torch.arange(8.0), group_of, mask=b.mask)
    assert adv.shape == (8, 7)
    assert float(adv[0, 0]) == pytest.approx(-1.5) and float(adv[0, 2]) == 0.0

"""The loss, checked against a direct token-by-token computation written independently."""

from __future__ import annotations

import math

import pytest
import torch

from rlnb.learn import grpo_advantages, policy_loss


def direct_advantages(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std <= 1e-6:
        return [0.0] * len(rewards)
    return [(r - mean) / (std + 1e-6) for r in rewards]


def direct_loss(
    logp: torch.Tensor,
    prox: list[list[float]],
    behav: list[list[float]],
    adv: list[float],
    mask: list[list[bool]],
    ref: list[list[float]],
    *,
    eps: float,
    cap: float,
    kl_coef: float,
) -> torch.Tensor:
    """Scalar torch arithmetic, one token at a time: the definition, nothing vectorised."""
    total = torch.zeros(())
    count = 0
    for i in range(len(mask)):
        for t in range(len(mask[i])):
            if not mask[i][t]:
                continue
            count += 1
            ratio = torch.exp(logp[i, t] - prox[i][t])
            weight = min(math.exp(prox[i][t] - behav[i][t]), cap)
            clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
            term = -weight * torch.minimum(ratio * adv[i], clipped * adv[i])
            diff = ref[i][t] - logp[i, t]
            term = term + kl_coef * (torch.exp(diff) - diff - 1)
            total = total + term
    return total / count


def test_grpo_advantages_match_the_definition() -> None:
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.2, 0.2, 0.2, 0.2], [0.0, 0.4, 1.0, 0.1]]
    got = grpo_advantages(torch.tensor(rewards))
    for row, want in zip(got.tolist(), map(direct_advantages, rewards), strict=True):
        assert row == pytest.approx(want, abs=1e-5)
    assert got[1].abs().sum() == 0  # identical rewards: no signal
    with pytest.raises(ValueError, match="groups, group_size"):
        grpo_advantages(torch.tensor([1.0, 0.0]))


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_policy_loss_and_its_gradient_match_a_direct_computation(kl_coef: float) -> None:
    gen = torch.Generator().manual_seed(0)
    n, t = 6, 5
    base = -torch.rand(n, t, generator=gen) * 3
    # proximal off by up to +-0.5 so that some ratios leave the clip range; behaviour
    # far below on some tokens so that importance weights hit the cap
    prox = base + (torch.rand(n, t, generator=gen) - 0.5)
    behav = prox - torch.rand(n, t, generator=gen) * 1.5
    ref = base + (torch.rand(n, t, generator=gen) - 0.5) * 0.2
    mask = torch.rand(n, t, generator=gen) > 0.3
    adv = torch.randn(n, generator=gen)

    logp_a = base.clone().requires_grad_(True)
    terms = policy_loss(logp_a, prox, behav, adv, mask, clip_eps=0.2, is_cap=2.0, kl_coef=kl_coef, ref_logp=ref)
    terms.loss.backward()

    logp_b = base.clone().requires_grad_(True)
    want = direct_loss(
        logp_b,
        prox.tolist(),
        behav.tolist(),
        adv.tolist(),
        mask.tolist(),
        ref.tolist(),
        eps=0.2,
        cap=2.0,
        kl_coef=kl_coef,
    )
    want.backward()

    assert terms.loss.item() == pytest.approx(want.item(), abs=1e-6)
    assert logp_a.grad is not None and logp_b.grad is not None
    torch.testing.assert_close(logp_a.grad, logp_b.grad, atol=1e-6, rtol=1e-5)
    assert 0 < terms.clip_fraction < 1  # the clip was exercised
    assert 0 < terms.is_truncated_fraction < 1  # and so was the truncation
    assert (logp_a.grad[~mask] == 0).all()  # padding and prompt tokens get no gradient


def test_on_policy_samples_get_unit_weights_and_no_clipping() -> None:
    logp = -torch.rand(3, 4)
    terms = policy_loss(
        logp.clone().requires_grad_(True), logp, logp, torch.ones(3), torch.ones(3, 4, dtype=torch.bool)
    )
    assert terms.is_weight_mean == pytest.approx(1.0)
    assert terms.clip_fraction == 0 and terms.is_truncated_fraction == 0
    assert terms.loss.item() == pytest.approx(-1.0)  # -A with ratio 1, averaged over tokens


def test_bad_shapes_and_a_missing_reference_are_clear_errors() -> None:
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="share a shape"):
        policy_loss(x, x, torch.zeros(2, 4), torch.zeros(2), m)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, x, torch.zeros(3), m)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(x, x, x, torch.zeros(2), m, kl_coef=0.1)

"""GAE, whitening and the clipped value loss (``advantage="gae"``, the ``ppo`` preset)
against float64 references written from their formulas, on rows with padding and an
environment's tokens inside a conversation; and the checks of the critic's settings."""

from __future__ import annotations

import pytest
import torch

import rlnb
from rlnb.algorithms import Algorithm, preset
from rlnb.algorithms import functional as F


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewards [5], values [5, 7], a mask with padding, a row of one token, a row with
    no token, and environment tokens between two policy turns."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor(
        [
            [1, 1, 1, 1, 1, 1, 1],
            [1, 1, 1, 0, 0, 0, 0],
            [1, 1, 0, 0, 1, 1, 0],  # a conversation: two policy turns, an environment's reply between
            [1, 0, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0],
        ],
        dtype=torch.bool,
    )
    rewards = torch.tensor([1.0, -0.5, 2.0, 0.25, 3.0])
    values = torch.randn(5, 7, generator=gen)
    return rewards, values, mask


def _reference_gae(rewards, values, mask, gamma, lam):  # type: ignore[no-untyped-def]
    """Row by row in float64 over the row's policy tokens in order: the reward at the
    last, delta_k = r_k + gamma V_{k+1} - V_k (V past the last: 0), A_k = sum_l (gamma
    lam)^l delta_{k+l}."""
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        positions = [t for t in range(mask.shape[1]) if mask[i, t]]
        v = [float(values[i, t]) for t in positions] + [0.0]
        r = [0.0] * len(positions)
        if positions:
            r[-1] = float(rewards[i])
        deltas = [r[k] + gamma * v[k + 1] - v[k] for k in range(len(positions))]
        for k, t in enumerate(positions):
            adv[i, t] = sum((gamma * lam) ** m * deltas[k + m] for m in range(len(positions) - k))
    return adv


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (1.0, 0.95), (0.9, 0.5), (0.99, 0.0), (0.0, 1.0)])
def test_gae_matches_a_float64_reference_over_the_policys_tokens(gamma: float, lam: float) -> None:
    rewards, values, mask = _batch()
    adv, returns = F.gae(rewards, values, mask, gamma, lam)
    expected = _reference_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(returns.double(), (expected + values.double()) * mask, rtol=1e-6, atol=1e-6)
    assert not adv[~mask].any() and not returns[~mask].any()


def test_with_a_critic_of_zero_and_no_discount_every_token_gets_the_reward() -> None:
    rewards, _, mask = _batch()
    adv, returns = F.gae(rewards, torch.zeros(mask.shape), mask, 1.0, 1.0)
    assert torch.equal(adv, rewards[:, None] * mask) and torch.equal(returns, adv)


def test_one_step_td_when_lam_is_zero() -> None:
    rewards, values, _ = _batch()
    mask = torch.ones(1, 4, dtype=torch.bool)
    adv, _ = F.gae(rewards[:1], values[:1, :4], mask, 0.9, 0.0)
    v = values[0, :4]
    expected = torch.stack([0.9 * v[1] - v[0], 0.9 * v[2] - v[1], 0.9 * v[3] - v[2], rewards[0] - v[3]])
    torch.testing.assert_close(adv[0], expected)


def test_environment_tokens_change_nothing_of_the_policys_advantages() -> None:
    """A conversation's advantages equal those of its policy tokens laid end to end."""
    rewards, values, mask = _batch()
    adv, _ = F.gae(rewards[2:3], values[2:3], mask[2:3], 0.9, 0.8)
    squeezed = mask[2]
    alone, _ = F.gae(
        rewards[2:3], values[2:3, squeezed], torch.ones(1, int(squeezed.sum()), dtype=torch.bool), 0.9, 0.8
    )
    torch.testing.assert_close(adv[0, squeezed], alone[0])


def test_gae_refuses_mismatched_shapes() -> None:
    rewards, values, mask = _batch()
    with pytest.raises(rlnb.InvalidValueError, match="gae needs rewards"):
        F.gae(rewards, values[:, :3], mask, 1.0, 1.0)


def test_whiten_gives_mean_zero_and_bessel_variance_one_over_the_mask() -> None:
    _, values, mask = _batch()
    out = F.whiten(values * 3 + 1, mask)
    chosen = out[mask].double()
    assert float(chosen.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(chosen.var(unbiased=True)) == pytest.approx(1.0, rel=1e-5)
    assert not out[~mask].any()
    one = torch.zeros_like(mask)
    one[0, 0] = True
    assert not F.whiten(values, one).any()  # one token: nothing to scale by


def test_advantages_by_name_are_the_whitened_gae_and_a_critic_of_zero_without_values() -> None:
    rewards, values, mask = _batch()
    group_of = torch.tensor([0, 0, 1, 1, 1])
    alg = preset("ppo")
    with_values = F.advantages(alg, rewards, group_of, mask=mask, values=values)
    raw, _ = F.gae(rewards, values, mask, alg.gamma, alg.lam)
    torch.testing.assert_close(with_values, F.whiten(raw, mask))
    without = F.advantages(alg, rewards, group_of, mask=mask)
    torch.testing.assert_close(without, F.whiten(F.gae(rewards, torch.zeros(mask.shape), mask, 1.0, 0.95)[0], mask))


def _reference_value_loss(values, old, returns, mask, clip, normaliser):  # type: ignore[no-untyped-def]
    total = 0.0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            v, o, r = float(values[i, t]), float(old[i, t]), float(returns[i, t])
            clipped = o + min(max(v - o, -clip), clip) if clip is not None else v
            total += 0.5 * max((v - r) ** 2, (clipped - r) ** 2)
    return total / normaliser


@pytest.mark.parametrize("clip", [None, 0.2, 5.0])
def test_the_value_loss_matches_a_float64_reference(clip: float | None) -> None:
    rewards, old, mask = _batch()
    gen = torch.Generator().manual_seed(1)
    values = (old + 0.5 * torch.randn(old.shape, generator=gen)).requires_grad_(True)
    _, returns = F.gae(rewards, old, mask, 1.0, 0.95)
    loss, clipped = F.value_loss(values, old, returns, mask, clip, 13.0)
    expected = _reference_value_loss(values.detach(), old, returns, mask, clip, 13.0)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    if clip is None or clip == 5.0:
        assert clipped == 0.0  # no clip, or none reached: the plain squared error
    else:
        assert 0.0 < clipped < 1.0
    (grad,) = torch.autograd.grad(loss, values)
    assert not grad[~mask].any()


def test_a_clipped_value_has_no_gradient_where_the_clip_makes_the_error_larger() -> None:
    old = torch.zeros(1, 2)
    returns = torch.tensor([[1.0, 1.0]])
    values = torch.tensor([[0.5, 0.1]], requires_grad=True)  # 0.5 moved past the clip 0.2 toward the return
    loss, clipped = F.value_loss(values, old, returns, torch.ones(1, 2, dtype=torch.bool), 0.2, 2.0)
    (grad,) = torch.autograd.grad(loss, values)
    assert clipped == 0.5
    assert grad[0, 0] == 0.0 and grad[0, 1] != 0.0


def test_the_ppo_preset_learns_a_critic_with_gae() -> None:
    alg = preset("ppo")
    assert alg.has_critic and alg.critic == "model" and (alg.gamma, alg.lam, alg.value_clip) == (1.0, 0.95, 0.2)
    assert alg.dual_clip == 3.0
    assert not preset("grpo").has_critic


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"gamma": 1.5}, "Algorithm.gamma"),
        ({"lam": -0.1}, "Algorithm.lam"),
        ({"value_clip": 0.0}, "Algorithm.value_clip"),
        ({"critic_lr": -1e-3}, "Algorithm.critic_lr"),
        ({"critic": "lora-head"}, "Algorithm.critic"),
    ],
)
def test_a_bad_critic_setting_names_its_field_and_the_fix(changes: dict[str, object], field: str) -> None:
    with pytest.raises(rlnb.ConfigError, match=field.replace(".", r"\.")) as info:
        Algorithm(advantage="gae", **changes)  # type: ignore[arg-type]
    assert "e.g." in str(info.value)

"""A part given as a function is tried on a dry batch when the Algorithm is made: each
kind of mistake is a ConfigError naming the function, before any step."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlnb._errors import ConfigError
from rlnb.algorithms import Algorithm, check
from rlnb.algorithms import functional as F


def centred(rewards: torch.Tensor, **context: Any) -> torch.Tensor:
    return rewards - rewards.mean(dim=1, keepdim=True)


def per_token(rewards: torch.Tensor, *, mask: torch.Tensor, **context: Any) -> torch.Tensor:
    return centred(rewards)[..., None] * mask


def reinforce(inputs: F.LossInputs) -> torch.Tensor:
    adv = inputs.advantages  # [N] per sample, or [N, T] from a per-token estimator
    return -((adv[:, None] if adv.dim() == 1 else adv) * inputs.logp)


def scalar(inputs: F.LossInputs) -> torch.Tensor:
    return reinforce(inputs)[inputs.mask].mean()


def test_good_functions_pass_and_keep_their_names() -> None:
    alg = Algorithm(advantage=per_token, loss=scalar)
    check(alg)
    assert alg.functions == (f"{__name__}.per_token", f"{__name__}.scalar")
    Algorithm(advantage=centred, loss=reinforce)
    assert Algorithm().functions == ()


def no_context(rewards: torch.Tensor) -> torch.Tensor:
    return rewards


def per_sample_mean(rewards: torch.Tensor, **context: Any) -> torch.Tensor:
    return rewards.mean(dim=1)


def divides_by_zero(rewards: torch.Tensor, **context: Any) -> torch.Tensor:
    return rewards / 0


def raises(rewards: torch.Tensor, **context: Any) -> torch.Tensor:
    raise RuntimeError("boom")


def returns_a_list(rewards: torch.Tensor, **context: Any) -> Any:
    return rewards.tolist()


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (no_context, "unexpected keyword argument"),
        (per_sample_mean, r"returned \(2,\) for rewards \(2, 4\)"),
        (divides_by_zero, "NaN or inf"),
        (raises, "boom"),
        (returns_a_list, "returned list"),
    ],
)
def test_a_bad_advantage_function_is_a_config_error_naming_it(fn: Any, why: str) -> None:
    with pytest.raises(ConfigError, match=rf"Algorithm\.advantage={__name__}\.{fn.__name__}.*{why}"):
        Algorithm(advantage=fn)


def per_sample_loss(inputs: F.LossInputs) -> torch.Tensor:
    return reinforce(inputs).sum(dim=1)


def detached(inputs: F.LossInputs) -> torch.Tensor:
    return reinforce(inputs).detach()


def not_a_number(inputs: F.LossInputs) -> torch.Tensor:
    return reinforce(inputs) * float("nan")


def infinite(inputs: F.LossInputs) -> torch.Tensor:
    return reinforce(inputs).sum() / 0.0


def from_nothing(inputs: F.LossInputs) -> torch.Tensor:
    return torch.ones((), requires_grad=True)


def loss_raises(inputs: F.LossInputs) -> torch.Tensor:
    raise KeyError("no such input")


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (per_sample_loss, r"returned \(8,\).*scalar or per-token"),
        (detached, "without gradient"),
        (not_a_number, "loss of nan"),
        (infinite, "loss of -?inf"),
        (from_nothing, "no gradient reaches the policy"),
        (loss_raises, "no such input"),
    ],
)
def test_a_bad_loss_function_is_a_config_error_naming_it(fn: Any, why: str) -> None:
    with pytest.raises(ConfigError, match=rf"Algorithm\.loss={__name__}\.{fn.__name__}.*{why}"):
        Algorithm(loss=fn)


def test_a_change_to_a_function_is_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"Algorithm\.loss="):
        Algorithm().replace(loss=detached)

"""Numbers stay finite (ARCHITECTURE.md contract 14): any reward the checks accept
trains to finite weights, and a loss or gradient that is not finite stops the step
with an error before the optimiser changes anything."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from typing import Any

import pytest
import torch

import rlnb
from rlnb.data import Task, register_task
from rlnb.learn import LearnConfig, Learner, grpo_advantages
from rlnb.models import CharTokenizer, TinyPolicy
from tests.helpers import small_config

TOK = CharTokenizer("0123456789+=")
BIG = 3e38  # within the rewards' check, |r| <= 3.4e38: two of them overflow float32


def encode(text: str) -> list[int]:
    return TOK.encode(text, bos=True)


def policy() -> TinyPolicy:
    torch.manual_seed(0)
    return TinyPolicy(rlnb.ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, max_len=16))


def sample(model: TinyPolicy, prompt: str, completion: str, reward: float) -> rlnb.Sample:
    """A sample whose behaviour log-probs are the model's own (on-policy)."""
    ids = encode(prompt) + TOK.encode(completion) + [TOK.EOS]
    with torch.no_grad():
        logp = model(torch.tensor([ids[:-1]]))[0].log_softmax(-1)
    start = len(encode(prompt))
    tokens = ids[start:]
    return rlnb.Sample(
        prompt=prompt,
        completion=completion,
        token_ids=tuple(tokens),
        logprobs=tuple(float(logp[start - 1 + k, tok]) for k, tok in enumerate(tokens)),
        versions=(0,) * len(tokens),
        reward=reward,
    )


def group(model: TinyPolicy, rewards: tuple[float, ...], prompt: str = "12+34=") -> rlnb.Group:
    completions = ("46", "91", "4", "5", "460", "1")
    return rlnb.Group(prompt, tuple(sample(model, prompt, c, r) for c, r in zip(completions, rewards, strict=False)))


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a: Any, b: Any) -> bool:
    """Equal, tensors compared exactly, through dicts and lists (an optimiser's state)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


def test_advantages_of_rewards_near_float32s_limit_are_those_of_the_same_rewards_made_small() -> None:
    huge = grpo_advantages(torch.tensor([[BIG, BIG, BIG, -BIG], [BIG, BIG, BIG, BIG]]))
    small = grpo_advantages(torch.tensor([[1.0, 1.0, 1.0, -1.0], [1.0, 1.0, 1.0, 1.0]]))
    assert torch.isfinite(huge).all()
    assert huge.flatten().tolist() == pytest.approx(small.flatten().tolist(), abs=1e-5)


def test_advantages_of_ordinary_rewards_are_computed_in_float32_as_before() -> None:
    # A float64 table of rewards (the learner's) gives the float32 advantages bit for bit:
    # runs with ordinary rewards train exactly as they did.
    rewards = [[1.0, 0.0, 0.4, 0.1], [0.3, 0.3, 0.7, 0.2]]
    as32 = torch.tensor(rewards, dtype=torch.float32)
    mean, std = as32.mean(1, keepdim=True), as32.std(1, keepdim=True, unbiased=False)
    expected = torch.where(std > 1e-6, (as32 - mean) / (std + 1e-6), torch.zeros_like(as32))
    got = grpo_advantages(torch.tensor(rewards, dtype=torch.float64))
    assert got.dtype == torch.float32 and torch.equal(got, expected)


@pytest.mark.parametrize("rewards", [(BIG, BIG, BIG, -BIG), (-BIG, -BIG, BIG, 0.0), (BIG, BIG, BIG, BIG)])
def test_rewards_within_the_bound_train_five_steps_to_finite_weights(rewards: tuple[float, ...]) -> None:
    model = policy()
    learner = Learner(model, encode=encode, pad_id=TOK.PAD, config=LearnConfig(lr=1e-2))
    batch = [group(model, rewards)]
    for _ in range(5):
        metrics = learner.step(batch)
        assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert metrics["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert learner.version == 5


def test_a_reward_total_beyond_float32_from_its_weights_trains_to_finite_weights() -> None:
    # A weighted sum of rewards may pass float32's range (reward_weights up to 1e6): read in float64.
    model = policy()
    learner = Learner(model, encode=encode, pad_id=TOK.PAD, config=LearnConfig(lr=1e-2))
    metrics = learner.step([group(model, (1e6 * BIG, 0.0, -1e6 * BIG, 0.0))])
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("spread", [BIG, 1e20])
def test_advantages_too_large_for_the_update_stop_it_with_weights_and_optimiser_as_they_were(spread: float) -> None:
    # Dr. GRPO keeps the rewards' scale: the advantages (3e38) or the gradient (1e20) overflow float32.
    model = policy()
    learner = Learner(model, encode=encode, pad_id=TOK.PAD, config=LearnConfig(lr=1e-2, scale_advantages=False))
    learner.step([group(model, (1.0, 0.0, 0.0, 1.0))])  # the optimiser has moments to keep
    kept, state = weights(model), copy.deepcopy(learner.optimizer.state_dict())
    with pytest.raises(rlnb.TrainingError) as info:
        learner.step([group(model, (spread, spread, -spread, 0.0))])
    message = str(info.value)
    assert "at step 2" in message and "the step was not taken" in message
    assert f"its rewards span [{-spread:.4g}, {spread:.4g}]" in message and "scale_advantages=True" in message
    assert all(torch.equal(a, b) for a, b in zip(kept, model.parameters(), strict=True))
    assert same(learner.optimizer.state_dict(), state)
    assert learner.version == 1
    learner.step([group(model, (1.0, 0.0, 0.0, 1.0))])  # and training goes on
    assert learner.version == 2


def test_a_later_update_of_a_step_that_goes_nan_puts_back_the_weights_of_before_the_first() -> None:
    # Two minibatches: the first updates the weights, the second's loss is NaN (a
    # behaviour log-prob an engine got wrong): the whole step is undone.
    model = policy()
    learner = Learner(model, encode=encode, pad_id=TOK.PAD, config=LearnConfig(lr=1e-2, minibatches=2))
    learner.step([group(model, (1.0, 0.0)), group(model, (0.0, 1.0), "1+2=")])
    kept, state = weights(model), copy.deepcopy(learner.optimizer.state_dict())
    broken = group(model, (0.0, 1.0), "1+2=")
    bad = broken.samples[0]
    broken = rlnb.Group(
        broken.prompt, (dataclasses.replace(bad, logprobs=(math.nan, *bad.logprobs[1:])), broken.samples[1])
    )
    with pytest.raises(rlnb.TrainingError, match="the loss is nan at step 2"):
        learner.step([group(model, (1.0, 0.0)), broken])
    assert all(torch.equal(a, b) for a, b in zip(kept, model.parameters(), strict=True))
    assert same(learner.optimizer.state_dict(), state)
    assert learner.version == 1


def test_a_warm_up_step_whose_loss_is_not_finite_changes_nothing() -> None:
    model = policy()
    learner = Learner(model, encode=encode, pad_id=TOK.PAD)
    optimizer = torch.optim.AdamW(learner.trainable_parameters(), lr=1e-3)
    learner.supervised_step([("1+2=", "3")], optimizer)
    with torch.no_grad():
        next(model.parameters()).fill_(math.inf)  # weights gone wrong
    kept, state = weights(model), copy.deepcopy(optimizer.state_dict())
    with pytest.raises(rlnb.TrainingError, match="warm-up step's loss is nan"):
        learner.supervised_step([("1+2=", "3")], optimizer)
    assert all(torch.equal(a, b) for a, b in zip(kept, model.parameters(), strict=True))
    assert same(optimizer.state_dict(), state)


def test_a_group_of_ordinary_rewards_beside_one_of_huge_rewards_keeps_its_float32_advantages() -> None:
    # Each group is read in float64 only when its own rewards need it: what-if's
    # group-by-group advantages are the learner's.
    alone = grpo_advantages(torch.tensor([[1.0, 0.0, 0.4, 0.1]]))
    beside = grpo_advantages(torch.tensor([[1.0, 0.0, 0.4, 0.1], [BIG, BIG, BIG, -BIG]], dtype=torch.float64))
    assert torch.equal(beside[0].float(), alone[0]) and torch.isfinite(beside).all()


def huge(completion: str, answer: str) -> float:
    """±3e38: every reward within the check, any two alike overflow float32's sum."""
    return BIG if len(completion) % 2 else -BIG


def test_a_session_rewarded_near_float32s_limit_trains_five_steps_to_finite_weights() -> None:
    register_task(Task("huge-rewards", "0123456789+=", _addition, huge, max_new_tokens=4), replace=True)
    with rlnb.Session(small_config(task="huge-rewards", seed=1), name="huge-rewards") as sess:
        history = [sess.step() for _ in range(5)]
        assert all(math.isfinite(m[k]) for m in history for k in ("loss", "grad_norm", "reward_mean", "reward_std"))
        assert any(m["reward_std"] > 1e38 for m in history)  # the rewards were as large as promised
        assert all(torch.isfinite(p).all() for p in sess.policy.parameters())
        assert 0.0 <= sess.evaluate(8) <= 1.0


def _addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}+{b}=", str(a + b)

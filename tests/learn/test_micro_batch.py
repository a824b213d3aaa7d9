"""``LearnConfig.micro_batch_size``: gradients accumulated over micro-batches make the
same update as the whole batch at once."""

from __future__ import annotations

import copy

import pytest
import torch

import rlnb
from rlnb.learn import LearnConfig, Learner
from rlnb.models import CharTokenizer, TinyPolicy

TOK = CharTokenizer("0123456789+=")


def _encode(text: str) -> list[int]:
    return TOK.encode(text, bos=True)


def _sample(model: TinyPolicy, prompt: str, completion: str, reward: float) -> rlnb.Sample:
    """A sample whose behaviour log-probs are ``model``'s, a little off (as a stale engine's)."""
    ids = _encode(prompt) + TOK.encode(completion) + [TOK.EOS]
    with torch.no_grad():
        logp = model(torch.tensor([ids[:-1]]))[0].log_softmax(-1)
    start = len(_encode(prompt))
    tokens = ids[start:]
    logprobs = tuple(float(logp[start - 1 + k, t]) - 0.05 * (k % 3) for k, t in enumerate(tokens))
    return rlnb.Sample(prompt=prompt, completion=completion, token_ids=tuple(tokens), logprobs=logprobs, reward=reward)


def _groups(model: TinyPolicy) -> list[rlnb.Group]:
    """Three groups, ten samples of 2 to 9 tokens: per-token and per-sequence means differ."""
    shapes = [
        ("12+34=", ["46", "4", "4666666"]),
        ("5+5=", ["10", "1", "100000", "7"]),
        ("9+1=", ["10", "11111111", "2"]),
    ]
    return [
        rlnb.Group(prompt=p, samples=tuple(_sample(model, p, c, float(i % 2)) for i, c in enumerate(cs)))
        for p, cs in shapes
    ]


def _model() -> TinyPolicy:
    return TinyPolicy(
        rlnb.ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, max_len=24), seed=1
    )


def _step(micro: int | None, **learn: object) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One learner step of micro-batch size ``micro``: its metrics and the last update's gradients."""
    model = _model()
    groups = _groups(copy.deepcopy(model))
    config = LearnConfig(lr=1e-2, kl_coef=0.1, max_grad_norm=1e6, micro_batch_size=micro, **learn)  # type: ignore[arg-type]
    learner = Learner(model, encode=_encode, pad_id=TOK.PAD, eos_id=TOK.EOS, config=config)
    with torch.no_grad():  # a reference other than the policy: the KL term has a gradient
        for p in learner.reference.parameters():  # type: ignore[union-attr]
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    metrics = learner.step(groups)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return metrics, grads


@pytest.mark.parametrize("micro", [1, 3, 4, 10, 64])
def test_micro_batches_give_the_loss_and_gradients_of_the_whole_batch(micro: int) -> None:
    whole, whole_grads = _step(None)
    part, part_grads = _step(micro)  # 10 samples: 3 and 4 do not divide them
    for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm", "clip_fraction", "is_weight_mean"):
        assert part[key] == pytest.approx(whole[key], abs=1e-5), key
    assert len(part_grads) == len(whole_grads) == len(list(_model().parameters()))
    for a, b in zip(part_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_micro_batches_with_epochs_and_minibatches_give_the_same_updates() -> None:
    # Four updates; the later ones start from Adam steps, which magnify rounding in
    # near-zero gradients, so the metrics (not the weights) are compared.
    whole, _ = _step(None, epochs=2, minibatches=2)
    part, _ = _step(3, epochs=2, minibatches=2)
    for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm", "clip_fraction"):
        assert part[key] == pytest.approx(whole[key], abs=1e-5), key


@pytest.mark.parametrize("value", [0, -2, 2.0, "8", True])
def test_a_micro_batch_size_that_is_not_a_positive_int_is_a_config_error(value: object) -> None:
    with pytest.raises(rlnb.ConfigError, match=r"LearnConfig\.micro_batch_size=.* is invalid: use None or an int >= 1"):
        LearnConfig(micro_batch_size=value)  # type: ignore[arg-type]
    assert LearnConfig().micro_batch_size is None and LearnConfig(micro_batch_size=8).micro_batch_size == 8

"""Loss masks: a conversation's environment tokens are context, never a target. The
learner's loss, its gradients and its token counts see only the policy's tokens, and
a warm-up on a demonstrated conversation trains only the policy's turns."""

from __future__ import annotations

import dataclasses

import torch

import rlnb
from rlnb.envs import Demonstration
from rlnb.learn import LearnConfig, Learner, collate
from rlnb.models import CharTokenizer, TinyPolicy

TOK = CharTokenizer("0123456789*=mul(),;")


def encode(text: str) -> list[int]:
    return TOK.encode(text, bos=True)


def learner(seed: int = 0, **config: float) -> Learner:
    torch.manual_seed(seed)
    model = TinyPolicy(rlnb.ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, max_len=48))
    return Learner(model, encode=encode, pad_id=TOK.PAD, eos_id=TOK.EOS, config=LearnConfig(**config))


def conversation(reward: float, reply: str = "=1776;", tail: str = "1776") -> rlnb.Sample:
    """A tool call, the tool's reply (mask 0) and an answer, with made-up behaviour log-probs."""
    call = [*TOK.encode("mul(37,48)"), TOK.EOS]
    obs = TOK.encode(reply)
    answer = [*TOK.encode(tail), TOK.EOS] if tail else []
    ids = (*call, *obs, *answer)
    mask = (1,) * len(call) + (0,) * len(obs) + (1,) * len(answer)
    logprobs = tuple(-0.5 if m else 0.0 for m in mask)
    return rlnb.Sample(
        "37*48=",
        "",
        ids,
        logprobs,
        (0,) * len(ids),
        reward=reward,
        mask=mask,
        turns=(0, len(call) + len(obs)) if answer else (0,),
    )


def grads(model: Learner, groups: list[rlnb.Group]) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One step's metrics, and the gradients it applied (taken at the weights before it)."""
    metrics = model.step(groups)
    return metrics, [p.grad.detach().clone() for p in model.trainable_parameters() if p.grad is not None]


def test_collate_marks_only_the_policys_tokens_for_the_loss_and_keeps_the_real_lengths() -> None:
    sample = conversation(1.0)
    batch = collate([rlnb.Group("37*48=", (sample, conversation(0.0, tail="")))], encode, TOK.PAD)
    assert batch.lengths.tolist() == [len(sample.token_ids), 17]
    assert batch.mask[0].tolist() == [bool(m) for m in sample.mask]
    assert batch.mask[1].tolist() == [True] * 11 + [False] * (batch.mask.shape[1] - 11)


def test_environment_tokens_carry_no_gradient_change_one_and_the_loss_is_unchanged() -> None:
    # Conversations that end with the environment's reply: nothing the policy says
    # follows it, so a change to it can change the loss only through its own terms.
    a = [conversation(1.0, tail=""), conversation(0.0, reply="=1234;", tail="")]
    b = [conversation(1.0, reply="=9999;", tail=""), conversation(0.0, reply="=4321;", tail="")]
    b = [
        dataclasses.replace(s, logprobs=tuple(-3.0 if not m else x for x, m in zip(s.logprobs, s.mask, strict=True)))
        for s in b
    ]
    metrics_a, grads_a = grads(learner(), [rlnb.Group("37*48=", tuple(a))])
    metrics_b, grads_b = grads(learner(), [rlnb.Group("37*48=", tuple(b))])
    assert metrics_a["loss"] == metrics_b["loss"]
    assert all(torch.equal(x, y) for x, y in zip(grads_a, grads_b, strict=True))
    # and the same samples with their replies unmasked train on them: the test can tell
    unmasked = [dataclasses.replace(s, mask=(1,) * len(s.token_ids)) for s in b]
    metrics_c, grads_c = grads(learner(), [rlnb.Group("37*48=", tuple(unmasked))])
    assert metrics_c["loss"] != metrics_b["loss"]
    assert not all(torch.equal(x, y) for x, y in zip(grads_b, grads_c, strict=True))


def test_the_policys_tokens_after_a_reply_are_trained_and_counted() -> None:
    group = rlnb.Group("37*48=", (conversation(1.0), conversation(0.0, tail="1234")))
    model = learner(lr=1e-2)
    metrics = model.step([group])
    policy_tokens = sum(sum(s.mask) for s in group.samples)
    assert metrics["response_length"] == policy_tokens / 2  # the environment's tokens are not the policy's
    logp, batch = model.logp([group])
    assert (logp[~batch.mask] == 0).all() and (logp[batch.mask] < 0).all()


def test_a_warm_up_on_a_demonstrated_conversation_trains_the_policys_turns_only() -> None:
    def loss(*turns: str) -> float:
        model = learner()  # the same weights each time
        optimizer = torch.optim.SGD(model.trainable_parameters(), lr=0.0)
        return model.supervised_step([("37*48=", Demonstration(*turns))], optimizer)["sft_loss"]

    # a reply is read, never a target: which reply ends the demonstration changes nothing
    assert loss("mul(37,48)", "=1776;") == loss("mul(37,48)", "=9999;") == loss("mul(37,48)")
    # the policy's turns after a reply are targets, and the reply is their context
    assert loss("mul(37,48)", "=1776;", "1776") != loss("mul(37,48)", "=9999;", "1776") != loss("mul(37,48)")


def test_a_warm_up_learns_a_demonstrated_conversation() -> None:
    model = learner()
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=3e-3)
    demo = Demonstration("mul(37,48)", "=1776;", "1776")
    first = model.supervised_step([("37*48=", demo)], optimizer)["sft_loss"]
    for _ in range(100):
        last = model.supervised_step([("37*48=", demo)], optimizer)["sft_loss"]
    assert first > 1.0 > 0.05 > last
    assert model.version == 0

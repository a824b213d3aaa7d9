"""A step's ``tokens_counted``: the tokens its policy loss is taken over, after the
algorithm's filters (flat groups dropped, truncated completions masked, only the
high-entropy tokens kept), once per pass over the batch; a what-if shows it."""

from __future__ import annotations

import torch

import rlnb
from rlnb.algorithms import preset
from rlnb.learn import LearnConfig, Learner, WhatIf
from rlnb.models import CharTokenizer, TinyPolicy

TOK = CharTokenizer("0123456789+=")


def encode(text: str) -> list[int]:
    return TOK.encode(text, bos=True)


def sample(prompt: str, completion: str, reward: float, *, cut: bool = False) -> rlnb.Sample:
    """A sample of ``completion`` (its end token too unless ``cut``: then it reached
    the length limit) with made-up behaviour log-probs."""
    tokens = TOK.encode(completion) + ([] if cut else [TOK.EOS])
    return rlnb.Sample(
        prompt=prompt,
        completion=completion,
        token_ids=tuple(tokens),
        logprobs=(-1.0,) * len(tokens),
        versions=(0,) * len(tokens),
        reward=reward,
        finish_reason="length" if cut else "stop",
    )


# 3 + 2 tokens with signal, a completion cut at the limit (3 tokens), a flat group (2 + 3)
GROUPS = [
    rlnb.Group("1+2=", (sample("1+2=", "12", 1.0), sample("1+2=", "3", 0.0))),
    rlnb.Group("4+4=", (sample("4+4=", "8", 1.0), sample("4+4=", "123", 0.0, cut=True))),
    rlnb.Group("2+2=", (sample("2+2=", "4", 0.0), sample("2+2=", "44", 0.0))),
]


def step(config: LearnConfig) -> dict[str, float]:
    torch.manual_seed(0)
    model = TinyPolicy(rlnb.ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, max_len=16))
    return Learner(model, encode=encode, pad_id=TOK.PAD, config=config).step(GROUPS)


def test_every_token_counts_without_filters_once_per_pass_over_the_batch() -> None:
    assert step(LearnConfig())["tokens_counted"] == 3 + 2 + 2 + 3 + 2 + 3
    assert step(LearnConfig(epochs=2, minibatches=2))["tokens_counted"] == 15  # two passes, four updates


def test_filters_leave_tokens_out() -> None:
    dropped = preset("grpo").replace(drop_flat_groups=True)
    assert step(LearnConfig(algorithm=dropped))["tokens_counted"] == 3 + 2 + 2 + 3
    cut = preset("grpo").replace(mask_truncated=True)
    assert step(LearnConfig(algorithm=cut))["tokens_counted"] == 15 - 3
    dapo = step(LearnConfig(algorithm="dapo"))  # both
    assert (dapo["tokens_counted"], dapo["groups_dropped"]) == (3 + 2 + 2, 1.0)
    # the high-entropy quarter of the tokens (ties at the threshold are kept)
    top = step(LearnConfig(algorithm=preset("grpo").replace(top_entropy_quantile=0.25)))["tokens_counted"]
    assert 15 * 0.25 <= top < 15


def test_a_what_if_shows_the_tokens_each_column_counts() -> None:
    row = dict.fromkeys(("loss", "clip_active", "clip_fraction", "update_kl"), 0.5)
    shown = WhatIf(1, {"algorithm": "dapo"}, row, {**row, "tokens_counted": 12345.0}, {**row, "tokens_counted": 7.0})
    assert [r for r in shown.rows() if r[0] == "tokens_counted"] == [("tokens_counted", None, 12345.0, 7.0)]
    line = next(line for line in repr(shown).splitlines() if line.startswith("tokens_counted"))
    assert line.split() == ["tokens_counted", "12345", "7"]
    assert "<td>tokens_counted</td><td></td><td>12345</td><td>7</td>" in shown._repr_html_()

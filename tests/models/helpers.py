"""What the tests of ``rlnb.models`` share: a small policy shape and a teacher-forced generator."""

from __future__ import annotations

import torch

from rlnb import ModelConfig
from rlnb.models import KVCache, TinyPolicy

VOCAB = 11
SMALL = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_len=16, mlp_ratio=2)
SEED = 3


def small_policy() -> TinyPolicy:
    return TinyPolicy(SMALL, seed=SEED)


def same_weights(a: TinyPolicy, b: TinyPolicy) -> bool:
    wa, wb = a.state_dict(), b.state_dict()
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def generate(
    model: TinyPolicy,
    cache: KVCache,
    slots: list[int],
    seqs: list[torch.Tensor],
    prompt_lens: list[int],
    pad: int,
) -> list[list[torch.Tensor]]:
    """Prefill the prompts in one batch, then teacher-force the rest of each sequence
    with every unfinished slot stepping together. Returns, per sequence, the logits
    predicting positions prompt_len .. len (one row per step)."""
    n, t = len(seqs), max(prompt_lens)
    ids = torch.full((n, t), pad, dtype=torch.long)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
        ids[i, :p] = s[:p]
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    first = model.prefill(cache, torch.tensor(slots), ids, torch.tensor(prompt_lens))
    assert first.shape == (n, model.config.vocab_size)
    for i in range(n):
        out[i].append(first[i])
    pos = list(prompt_lens)
    while True:
        active = [i for i in range(n) if pos[i] < len(seqs[i])]
        if not active:
            return out
        logits = model.decode(
            cache,
            torch.tensor([slots[i] for i in active]),
            torch.tensor([int(seqs[i][pos[i]]) for i in active]),
            torch.tensor([pos[i] for i in active]),
        )
        assert logits.shape == (len(active), model.config.vocab_size)
        for row, i in enumerate(active):
            out[i].append(logits[row])
            pos[i] += 1


def reference(model: TinyPolicy, seqs: list[torch.Tensor], prompt_lens: list[int]) -> list[torch.Tensor]:
    """forward() on the full, right-padded sequences, at the positions generate() predicts from."""
    batch = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    with torch.no_grad():
        full = model(batch)
    return [full[i, p - 1 : len(s)] for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True))]

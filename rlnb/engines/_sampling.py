"""Vectorised next-token sampling with per-request temperature, top-k, top-p and seed.

Each request draws its uniform number from its own ``random.Random``, so what it
samples does not depend on which other requests share the batch. The behaviour
log-prob recorded is that of the distribution actually sampled from (after
temperature, top-k and top-p); for greedy rows, that of the untempered policy.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from rlnb.engines._protocol import GenerateRequest


def sample_next(
    logits: torch.Tensor, requests: Sequence[GenerateRequest], rngs: Sequence[random.Random], eos_id: int
) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` [A, V]; returns token ids and their log-probs."""
    logits = logits.float()
    dev = logits.device
    params = [r.sampling for r in requests]
    if any(p.ignore_eos for p in params):
        mask = torch.tensor([p.ignore_eos for p in params], device=dev)
        logits = logits.clone()
        logits[mask, eos_id] = float("-inf")
    temps = torch.tensor([p.temperature for p in params], device=dev)
    greedy = temps == 0
    scaled = logits / torch.where(greedy, 1.0, temps)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    top_k = torch.tensor([p.top_k for p in params], device=dev)
    if bool((top_k > 0).any()):
        ranks = torch.arange(probs.shape[-1], device=dev)[None, :]
        keep &= (top_k[:, None] == 0) | (ranks < top_k[:, None])
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    if bool((top_p < 1).any()):
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        keep &= before < top_p[:, None]
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    cdf = probs.cumsum(dim=-1)
    u = torch.tensor([rng.random() for rng in rngs], dtype=cdf.dtype, device=dev)
    choice = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_max(probs.shape[-1] - 1)
    choice = torch.where(greedy[:, None], 0, choice)
    tokens = order.gather(-1, choice).squeeze(-1)
    chosen_p = probs.gather(-1, choice).squeeze(-1)
    logprobs = torch.where(greedy, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1), chosen_p.log())
    return tokens.tolist(), logprobs.tolist()

"""``compare_logprobs``: an engine's behaviour log-probs against a model's own forward pass."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from rlnb._errors import InvalidValueError
from rlnb.engines._protocol import Engine, GenerateRequest

__all__ = ["compare_logprobs"]


async def compare_logprobs(engine: Engine, model: Any, requests: Sequence[GenerateRequest]) -> float:
    """Generate ``requests`` on ``engine`` and score the tokens with ``model`` (a
    Hugging Face causal LM holding the same weights); the largest absolute
    difference between the engine's behaviour log-probs and the model's.

    Requests must not truncate (top_k 0, top_p 1); temperature 0 compares against
    the untempered model. Runs the model on the calling loop's thread (a check, not
    a hot path).
    """
    import torch

    for r in requests:
        if r.sampling.top_k or r.sampling.top_p < 1:
            raise InvalidValueError(f"request {r.request_id}: compare_logprobs needs top_k=0 and top_p=1")
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    worst = 0.0
    for request, result in zip(requests, results, strict=True):
        if not result.token_ids:
            continue
        context = [*request.prompt_ids, *request.prefix_ids]
        ids = torch.tensor([[*context, *result.token_ids]], device=next(model.parameters()).device)
        with torch.no_grad():
            out = model(ids)
        logits = getattr(out, "logits", out)[0, len(context) - 1 : -1].float().cpu()
        temperature = request.sampling.temperature or 1.0
        reference = (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(result.token_ids)[:, None])[:, 0]
        worst = max(worst, float((reference - torch.tensor(result.logprobs)).abs().max()))
    return worst

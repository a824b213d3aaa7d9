from __future__ import annotations

import pytest
import torch

from rlnb.models import KVCache, TinyPolicy, _kvcache
from tests.models.helpers import SEED, SMALL, VOCAB, generate, reference, small_policy


@pytest.mark.parametrize("slot_order", ["run", "scattered"])
def test_long_tail_batches_split_for_attention_and_still_match_forward(
    slot_order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ten short sequences beside two long ones: decode() then attends over two buckets
    # (short and long contexts) instead of padding everyone to the longest.
    buckets_seen: list[int] = []
    make = _kvcache._DecodePlan.make

    def spy(*args: torch.Tensor) -> _kvcache._DecodePlan:
        plan = make(*args)
        buckets_seen.append(len(plan.buckets))
        return plan

    monkeypatch.setattr(_kvcache._DecodePlan, "make", spy)
    model = small_policy()
    gen = torch.Generator().manual_seed(1)
    lengths = [4, 5, 4, 6, 5, 4, 5, 6, 4, 5, 16, 15]
    prompt_lens = [1] * 10 + [12, 11]
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]
    cache = model.new_cache(16)
    cache.k.normal_(generator=gen).mul_(50)
    cache.v.normal_(generator=gen).mul_(50)
    slots = list(range(12)) if slot_order == "run" else [15, 2, 9, 4, 11, 0, 7, 13, 5, 1, 8, 3]
    got = generate(model, cache, slots, seqs, prompt_lens, pad=7)
    for g, want in zip(got, reference(model, seqs, prompt_lens), strict=True):
        torch.testing.assert_close(torch.stack(g), want, atol=1e-4, rtol=1e-4)
    assert 2 in buckets_seen  # the split path really ran


def test_slots_with_gaps_attend_over_a_view_of_their_run_and_match_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    # Continuous batching leaves gaps as sequences end: twelve rows in slots 0-14 read
    # a view of the run (the gaps' rows masked to position 0) instead of a copy of
    # each row, and give what forward() gives. The gaps hold garbage, as freed slots do.
    spans: list[tuple[int, int] | None] = []
    make = _kvcache._DecodePlan.make

    def spy(*args: torch.Tensor) -> _kvcache._DecodePlan:
        plan = make(*args)
        spans.extend(b.span for b in plan.buckets)
        return plan

    monkeypatch.setattr(_kvcache._DecodePlan, "make", spy)
    model = small_policy()
    gen = torch.Generator().manual_seed(2)
    lengths = [5, 6, 4, 6, 5, 4, 5, 6, 4, 5, 6, 5]
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]
    cache = model.new_cache(16)
    cache.k.normal_(generator=gen).mul_(50)
    cache.v.normal_(generator=gen).mul_(50)
    slots = [0, 1, 3, 4, 5, 7, 8, 9, 10, 12, 13, 14]  # a run of 15 with 3 gaps
    got = generate(model, cache, slots, seqs, [1] * 12, pad=7)
    for g, want in zip(got, reference(model, seqs, [1] * 12), strict=True):
        torch.testing.assert_close(torch.stack(g), want, atol=1e-4, rtol=1e-4)
    assert (0, 15) in spans  # the view path really ran


def test_cache_shape_and_dtype_follow_the_model() -> None:
    model = small_policy()
    cache = model.new_cache(5)
    assert cache.slots == 5
    assert cache.k.shape == (2, 5, 4, 16, 8) and cache.v.shape == cache.k.shape
    assert cache.k.dtype == torch.float32 and not cache.k.any()
    assert model.to(torch.float64).new_cache(1).v.dtype == torch.float64
    with pytest.raises(ValueError, match="slots >= 1"):
        model.new_cache(0)


def test_a_cache_from_another_shape_is_refused() -> None:
    model = small_policy()
    other = TinyPolicy(SMALL.replace(max_len=8), seed=SEED).new_cache(2)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="new_cache"):
        model.decode(other, one, one, one)
    with pytest.raises(ValueError, match="one shape"):
        KVCache(torch.zeros(1, 2, 3, 4, 5), torch.zeros(1, 2, 3, 4, 6))


def test_copy_slots_copies_a_prefix_of_every_layer() -> None:
    cache = small_policy().new_cache(3)
    cache.k[:, 0].normal_()
    cache.v[:, 0].normal_()
    cache.copy_slots(torch.tensor([0]), torch.tensor([2]), 5)
    assert torch.equal(cache.k[:, 2, :, :5], cache.k[:, 0, :, :5])
    assert torch.equal(cache.v[:, 2, :, :5], cache.v[:, 0, :, :5])
    assert not cache.k[:, 2, :, 5:].any() and not cache.v[:, 2, :, 5:].any()

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlnb import ConfigError, ModelConfig
from rlnb.models import TinyPolicy
from tests.models.helpers import SEED, SMALL, VOCAB, generate, reference, same_weights, small_policy


def test_weights_are_a_pure_function_of_the_config_and_seed() -> None:
    a = TinyPolicy(SMALL, seed=SEED)
    torch.manual_seed(12345)  # the global RNG state must not matter
    torch.rand(7)
    b = TinyPolicy(SMALL, seed=SEED)
    assert same_weights(a, b)
    assert not same_weights(a, TinyPolicy(SMALL, seed=4))
    assert (a.config, a.seed) == (SMALL, SEED)
    assert TinyPolicy(SMALL).seed == 0


def test_construction_leaves_the_global_rng_alone() -> None:
    before = torch.get_rng_state()
    small_policy()
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(
    ("config", "seed", "message"),
    [
        ({"vocab_size": 4}, 0, r"TinyPolicy\.config=\{'vocab_size': 4\} is invalid: pass a rlnb\.ModelConfig"),
        (ModelConfig(), 0, r"ModelConfig\.vocab_size=None is invalid: .*config\.replace\(vocab_size="),
        (SMALL, -1, r"TinyPolicy\.seed=-1 is invalid: use"),
        (SMALL, 1.5, r"TinyPolicy\.seed=1\.5 is invalid: use"),
        (SMALL, True, r"TinyPolicy\.seed=True is invalid: use"),
    ],
)
def test_constructor_errors_name_the_field_and_the_fix(config: Any, seed: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TinyPolicy(config, seed=seed)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"d_model": -8}, "d_model"),
        ({"n_layers": 1.5}, "n_layers"),
        ({"n_heads": True}, "n_heads"),
        ({"max_len": 0}, "max_len"),
        ({"mlp_ratio": "4"}, "mlp_ratio"),
        ({"d_model": 30}, "n_heads"),  # d_model must be a multiple of n_heads
    ],
)
def test_config_errors_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"ModelConfig\.{field}=.* is invalid: use"):
        ModelConfig(**{"vocab_size": 16, **changes})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=rf"ModelConfig\.{field}="):
        SMALL.replace(**changes)  # replace() validates too


def test_forward_shape_and_gradients_reach_every_parameter() -> None:
    model = small_policy()
    ids = torch.randint(0, VOCAB, (3, 9))
    logits = model(ids)
    assert logits.shape == (3, 9, VOCAB)
    logits.logsumexp(-1).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing


def test_forward_refuses_sequences_longer_than_max_len() -> None:
    model = small_policy()
    with pytest.raises(ValueError, match="max_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_prefill_and_decode_match_forward() -> None:
    model = small_policy()
    gen = torch.Generator().manual_seed(0)
    lengths, prompt_lens = [5, 16, 9, 12], [2, 7, 9, 1]  # one prompt fills its sequence; one runs to max_len
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]
    cache = model.new_cache(7)
    cache.k.normal_(generator=gen).mul_(50)  # garbage everywhere: nothing unwritten may be read
    cache.v.normal_(generator=gen).mul_(50)
    # Non-contiguous, unsorted slot ids; the pad token is a real token, so padding must not leak either.
    got = generate(model, cache, [5, 0, 3, 6], seqs, prompt_lens, pad=7)
    for g, want in zip(got, reference(model, seqs, prompt_lens), strict=True):
        torch.testing.assert_close(torch.stack(g), want, atol=1e-4, rtol=1e-4)


def test_reusing_a_slot_after_a_longer_sequence_gives_the_same_logits() -> None:
    model = small_policy()
    gen = torch.Generator().manual_seed(1)
    long_seq = torch.randint(3, VOCAB, (16,), generator=gen)
    short = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (6, 8)]
    fresh = generate(model, model.new_cache(2), [0, 1], short, [3, 2], pad=0)
    cache = model.new_cache(2)
    generate(model, cache, [1], [long_seq], [10], pad=0)  # slot 1 now holds 16 stale positions
    reused = generate(model, cache, [0, 1], short, [3, 2], pad=0)
    for a, b in zip(fresh, reused, strict=True):
        torch.testing.assert_close(torch.stack(a), torch.stack(b), atol=1e-5, rtol=1e-5)


def test_decode_edges() -> None:
    model = small_policy()
    cache = model.new_cache(2)
    none = torch.zeros(0, dtype=torch.long)
    assert model.decode(cache, none, none, none).shape == (0, VOCAB)
    one = torch.tensor([1])
    with pytest.raises(ValueError, match="position 16, past the context"):
        model.decode(cache, one, one, torch.tensor([16]))
    with pytest.raises(ValueError, match="one shape"):
        model.decode(cache, one, torch.tensor([1, 2]), one)


def test_default_size() -> None:
    n = TinyPolicy(ModelConfig(vocab_size=16)).num_parameters()
    assert 300_000 <= n <= 500_000


def test_forward_shared_gives_forward_logits_and_gradients_with_each_prompt_run_once() -> None:
    model = TinyPolicy(ModelConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=2, max_len=14), seed=3)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 15, (n,), generator=gen).tolist() for n in (3, 7, 5)]
    # (group, completion): lengths 0 to 10; padded to the longest, the 7-token prompt's
    # rows would run past max_len, and only their padding may be cut
    rows = [(0, [4, 5, 6]), (1, [7]), (2, []), (0, [8, 9, 1, 2, 3, 4, 5, 6, 7, 8]), (1, [4, 4, 5, 6, 7, 8]), (2, [3])]
    width = max(len(c) for _, c in rows)
    padded_prompts = torch.tensor([p + [0] * (7 - len(p)) for p in prompts])
    completions = torch.tensor([c + [0] * (width - len(c)) for _, c in rows])
    shared = model.forward_shared(
        padded_prompts, torch.tensor([3, 7, 5]), completions, torch.tensor([g for g, _ in rows])
    )
    assert shared.shape == (len(rows), width + 1, 16)
    twin = TinyPolicy(model.config, seed=model.seed)
    shared_total = torch.zeros(())
    whole_total = torch.zeros(())
    for i, (g, c) in enumerate(rows):
        whole = twin(torch.tensor([prompts[g] + c]))[0, len(prompts[g]) - 1 :]
        torch.testing.assert_close(shared[i, : len(c) + 1], whole, atol=1e-5, rtol=1e-5)
        weights = torch.linspace(-1, 1, 16)  # any function of the valid logits
        shared_total = shared_total + (shared[i, : len(c) + 1] * weights).sum()
        whole_total = whole_total + (whole * weights).sum()
    shared_total.backward()
    whole_total.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    with pytest.raises(ValueError, match="forward_shared needs"):
        model.forward_shared(padded_prompts, torch.tensor([3, 7]), completions, torch.zeros(6, dtype=torch.long))

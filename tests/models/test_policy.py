from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlnb import ConfigError
from rlnb.models import KVCache, PolicyConfig, TinyPolicy, _policy

SMALL = PolicyConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=4, max_len=16, mlp_ratio=2, seed=3)


def _weights(model: TinyPolicy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same_weights(a: TinyPolicy, b: TinyPolicy) -> bool:
    wa, wb = a.state_dict(), b.state_dict()
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_weights_are_a_pure_function_of_the_config() -> None:
    a = TinyPolicy(SMALL)
    torch.manual_seed(12345)  # the global RNG state must not matter
    torch.rand(7)
    b = TinyPolicy(SMALL)
    assert _same_weights(a, b)
    assert not _same_weights(a, TinyPolicy(SMALL.replace(seed=4)))


def test_construction_leaves_the_global_rng_alone() -> None:
    before = torch.get_rng_state()
    TinyPolicy(SMALL)
    assert torch.equal(torch.get_rng_state(), before)


def test_forward_shape_and_gradients_reach_every_parameter() -> None:
    model = TinyPolicy(SMALL)
    ids = torch.randint(0, SMALL.vocab_size, (3, 9))
    logits = model(ids)
    assert logits.shape == (3, 9, SMALL.vocab_size)
    logits.logsumexp(-1).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing


def test_forward_refuses_sequences_longer_than_max_len() -> None:
    model = TinyPolicy(SMALL)
    with pytest.raises(ValueError, match="max_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def _generate(
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


def _reference(model: TinyPolicy, seqs: list[torch.Tensor], prompt_lens: list[int]) -> list[torch.Tensor]:
    """forward() on the full, right-padded sequences, at the positions _generate predicts from."""
    batch = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    with torch.no_grad():
        full = model(batch)
    return [full[i, p - 1 : len(s)] for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True))]


def test_prefill_and_decode_match_forward() -> None:
    model = TinyPolicy(SMALL)
    gen = torch.Generator().manual_seed(0)
    lengths, prompt_lens = [5, 16, 9, 12], [2, 7, 9, 1]  # one prompt fills its sequence; one runs to max_len
    seqs = [torch.randint(3, SMALL.vocab_size, (n,), generator=gen) for n in lengths]
    cache = model.new_cache(7)
    cache.k.normal_(generator=gen).mul_(50)  # garbage everywhere: nothing unwritten may be read
    cache.v.normal_(generator=gen).mul_(50)
    # Non-contiguous, unsorted slot ids; the pad token is a real token, so padding must not leak either.
    got = _generate(model, cache, [5, 0, 3, 6], seqs, prompt_lens, pad=7)
    for g, want in zip(got, _reference(model, seqs, prompt_lens), strict=True):
        torch.testing.assert_close(torch.stack(g), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("slot_order", ["run", "scattered"])
def test_long_tail_batches_split_for_attention_and_still_match_forward(
    slot_order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ten short sequences beside two long ones: decode() then attends over two buckets
    # (short and long contexts) instead of padding everyone to the longest.
    buckets_seen: list[int] = []
    make = _policy._DecodePlan.make

    def spy(*args: torch.Tensor) -> _policy._DecodePlan:
        plan = make(*args)
        buckets_seen.append(len(plan.buckets))
        return plan

    monkeypatch.setattr(_policy._DecodePlan, "make", spy)
    model = TinyPolicy(SMALL)
    gen = torch.Generator().manual_seed(1)
    lengths = [4, 5, 4, 6, 5, 4, 5, 6, 4, 5, 16, 15]
    prompt_lens = [1] * 10 + [12, 11]
    seqs = [torch.randint(3, SMALL.vocab_size, (n,), generator=gen) for n in lengths]
    cache = model.new_cache(16)
    cache.k.normal_(generator=gen).mul_(50)
    cache.v.normal_(generator=gen).mul_(50)
    slots = list(range(12)) if slot_order == "run" else [15, 2, 9, 4, 11, 0, 7, 13, 5, 1, 8, 3]
    got = _generate(model, cache, slots, seqs, prompt_lens, pad=7)
    for g, want in zip(got, _reference(model, seqs, prompt_lens), strict=True):
        torch.testing.assert_close(torch.stack(g), want, atol=1e-4, rtol=1e-4)
    assert 2 in buckets_seen  # the split path really ran


def test_reusing_a_slot_after_a_longer_sequence_gives_the_same_logits() -> None:
    model = TinyPolicy(SMALL)
    gen = torch.Generator().manual_seed(1)
    long_seq = torch.randint(3, SMALL.vocab_size, (16,), generator=gen)
    short = [torch.randint(3, SMALL.vocab_size, (n,), generator=gen) for n in (6, 8)]
    fresh = _generate(model, model.new_cache(2), [0, 1], short, [3, 2], pad=0)
    cache = model.new_cache(2)
    _generate(model, cache, [1], [long_seq], [10], pad=0)  # slot 1 now holds 16 stale positions
    reused = _generate(model, cache, [0, 1], short, [3, 2], pad=0)
    for a, b in zip(fresh, reused, strict=True):
        torch.testing.assert_close(torch.stack(a), torch.stack(b), atol=1e-5, rtol=1e-5)


def test_cache_shape_and_dtype_follow_the_model() -> None:
    model = TinyPolicy(SMALL)
    cache = model.new_cache(5)
    assert cache.slots == 5
    assert cache.k.shape == (2, 5, 4, 16, 8) and cache.v.shape == cache.k.shape
    assert cache.k.dtype == torch.float32 and not cache.k.any()
    assert model.to(torch.float64).new_cache(1).v.dtype == torch.float64
    with pytest.raises(ValueError, match="slots >= 1"):
        model.new_cache(0)


def test_a_cache_from_another_shape_is_refused() -> None:
    model = TinyPolicy(SMALL)
    other = TinyPolicy(SMALL.replace(max_len=8)).new_cache(2)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="new_cache"):
        model.decode(other, one, one, one)
    with pytest.raises(ValueError, match="one shape"):
        KVCache(torch.zeros(1, 2, 3, 4, 5), torch.zeros(1, 2, 3, 4, 6))


def test_decode_edges() -> None:
    model = TinyPolicy(SMALL)
    cache = model.new_cache(2)
    none = torch.zeros(0, dtype=torch.long)
    assert model.decode(cache, none, none, none).shape == (0, SMALL.vocab_size)
    one = torch.tensor([1])
    with pytest.raises(ValueError, match="position 16, past the context"):
        model.decode(cache, one, one, torch.tensor([16]))
    with pytest.raises(ValueError, match="one shape"):
        model.decode(cache, one, torch.tensor([1, 2]), one)


def test_save_load_round_trip(tmp_path: Path) -> None:
    model = TinyPolicy(SMALL)
    with torch.no_grad():  # differ from a fresh init, so a load that ignores the file would fail
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    back = TinyPolicy.load(tmp_path / "ckpt")
    assert back.config == model.config
    assert _same_weights(model, back)
    ids = torch.randint(0, SMALL.vocab_size, (2, 10))
    with torch.no_grad():
        assert torch.equal(model(ids), back(ids))


def _checkpoint(tmp_path: Path) -> Path:
    TinyPolicy(SMALL).save(tmp_path)
    return tmp_path


def test_load_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json is missing"):
        TinyPolicy.load(tmp_path)
    _checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model\.safetensors is missing"):
        TinyPolicy.load(tmp_path)


def test_load_bad_config(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    (path / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        TinyPolicy.load(path)
    (path / "config.json").write_text(json.dumps({**SMALL.to_dict(), "d_model": 0}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"config\.json does not describe a PolicyConfig.*d_model"):
        TinyPolicy.load(path)


def test_load_damaged_weights(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        TinyPolicy.load(path)


def test_load_weights_that_do_not_fit_the_config(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    (path / "config.json").write_text(json.dumps(SMALL.replace(vocab_size=12).to_dict()), encoding="utf-8")
    with pytest.raises(ValueError, match=r"does not match .*config\.json: tok_emb\.weight has shape \[11, 32\]"):
        TinyPolicy.load(path)
    tensors = {k: v.contiguous() for k, v in TinyPolicy(SMALL).state_dict().items() if k != "ln_f.bias"}
    tensors["extra"] = torch.zeros(2)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(SMALL.to_dict()), encoding="utf-8")
    with pytest.raises(ValueError, match=r"missing ln_f\.bias; unexpected extra"):
        TinyPolicy.load(path)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"d_model": -8}, "d_model"),
        ({"n_layers": 1.5}, "n_layers"),
        ({"n_heads": True}, "n_heads"),
        ({"max_len": 0}, "max_len"),
        ({"mlp_ratio": "4"}, "mlp_ratio"),
        ({"seed": -1}, "seed"),
        ({"d_model": 30}, "d_model"),
    ],
)
def test_config_errors_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"PolicyConfig\.{field}=.* is invalid: use"):
        PolicyConfig(**{"vocab_size": 16, **changes})  # type: ignore[arg-type]


def test_config_dict_round_trip_and_refusals() -> None:
    assert PolicyConfig.from_dict(json.loads(json.dumps(SMALL.to_dict()))) == SMALL
    with pytest.raises(ConfigError, match="multiple of n_heads=4"):
        SMALL.replace(d_model=30)
    with pytest.raises(ConfigError, match=r"unknown fields \['width'\]"):
        PolicyConfig.from_dict({"vocab_size": 4, "width": 3})
    with pytest.raises(ConfigError, match="vocab_size is missing"):
        PolicyConfig.from_dict({"d_model": 32})
    with pytest.raises(ConfigError, match="PolicyConfig"):
        TinyPolicy({"vocab_size": 4})  # type: ignore[arg-type]


def test_default_size() -> None:
    n = TinyPolicy(PolicyConfig(vocab_size=16)).num_parameters()
    assert 300_000 <= n <= 500_000


def test_forward_shared_gives_forward_logits_and_gradients_with_each_prompt_run_once() -> None:
    model = TinyPolicy(PolicyConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=2, max_len=14, seed=3))
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
    twin = TinyPolicy(model.config)
    shared_total = 0
    whole_total = 0
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

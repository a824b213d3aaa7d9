from __future__ import annotations

import pytest
import torch

import rlnb
from rlnb.learn import LearnConfig, Learner, collate
from rlnb.models import CharTokenizer, TinyPolicy

TOK = CharTokenizer("0123456789+=")


def encode(text: str) -> list[int]:
    return TOK.encode(text, bos=True)


def policy() -> TinyPolicy:
    return TinyPolicy(rlnb.ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, max_len=16))


def sample_with_behaviour(
    model: TinyPolicy, prompt: str, completion: str, reward: float, version: int = 0
) -> rlnb.Sample:
    """A sample whose behaviour log-probs are the model's own (on-policy)."""
    ids = encode(prompt) + TOK.encode(completion) + [TOK.EOS]
    with torch.no_grad():
        logp = model(torch.tensor([ids[:-1]]))[0].log_softmax(-1)
    start = len(encode(prompt))
    tokens = ids[start:]
    logprobs = tuple(float(logp[start - 1 + k, tok]) for k, tok in enumerate(tokens))
    return rlnb.Sample(
        prompt=prompt,
        completion=completion,
        token_ids=tuple(tokens),
        logprobs=logprobs,
        versions=(version,) * len(tokens),
        reward=reward,
    )


def sequence_logp(model: TinyPolicy, prompt: str, sample: rlnb.Sample) -> float:
    ids = encode(prompt) + list(sample.token_ids)
    with torch.no_grad():
        logp = model(torch.tensor([ids[:-1]]))[0].log_softmax(-1)
    start = len(encode(prompt))
    return sum(float(logp[start - 1 + k, tok]) for k, tok in enumerate(sample.token_ids))


def test_collate_stores_each_prompt_once_and_aligns_targets_with_behaviour_logprobs() -> None:
    model = policy()
    good = sample_with_behaviour(model, "12+34=", "46", 1.0)
    bad = sample_with_behaviour(model, "12+34=", "5", 0.0)
    other = sample_with_behaviour(model, "1+2=", "3", 1.0)
    batch = collate([rlnb.Group("12+34=", (good, bad)), rlnb.Group("1+2=", (other,))], encode, TOK.PAD)
    assert batch.prompts.tolist() == [encode("12+34="), [*encode("1+2="), TOK.PAD, TOK.PAD]]
    assert batch.prompt_lengths.tolist() == [7, 5]
    assert batch.group_of.tolist() == [0, 0, 1]
    assert batch.targets.tolist() == [list(good.token_ids), [*bad.token_ids, TOK.PAD], [*other.token_ids, TOK.PAD]]
    assert batch.mask.sum(1).tolist() == [3, 2, 2]
    assert batch.behav_logp[0, batch.mask[0]].tolist() == pytest.approx(list(good.logprobs))
    assert batch.behav_logp[1, batch.mask[1]].tolist() == pytest.approx(list(bad.logprobs))
    assert batch.advantages.tolist() == pytest.approx([1.0, -1.0, 0.0], abs=1e-5)


def test_collate_reads_a_groups_prompt_ids_and_encodes_only_a_group_without_them() -> None:
    model = policy()
    rolled_out = rlnb.Group("12+34=", (sample_with_behaviour(model, "12+34=", "46", 1.0),), prompt_ids=encode("12+34="))
    by_hand = rlnb.Group("1+2=", (sample_with_behaviour(model, "1+2=", "3", 1.0),))
    encoded: list[str] = []

    def counting(text: str) -> list[int]:
        encoded.append(text)
        return encode(text)

    batch = collate([rolled_out, by_hand], counting, TOK.PAD)
    assert encoded == ["1+2="]  # the rolled-out group's ids were used as they were
    assert batch.prompts.tolist() == [encode("12+34="), [*encode("1+2="), TOK.PAD, TOK.PAD]]


def test_learner_log_probs_with_shared_prompts_are_those_of_the_whole_sequences() -> None:
    model = policy()
    groups = [
        rlnb.Group(p, tuple(sample_with_behaviour(model, p, c, 0.0) for c in cs))
        for p, cs in (("12+34=", ("46", "5", "")), ("7+8=", ("15", "1234")))
    ]
    batch = collate(groups, encode, TOK.PAD)
    logp, _ = Learner._token_logp(model, batch, torch.arange(5), batch.targets.shape[1])
    for row, sample in enumerate(s for g in groups for s in g.samples):
        assert logp[row, batch.mask[row]].tolist() == pytest.approx(list(sample.logprobs), abs=1e-5)


def test_a_step_moves_probability_towards_the_rewarded_completion() -> None:
    model = policy()
    learner = Learner(model, encode=encode, pad_id=TOK.PAD, config=LearnConfig(lr=1e-2))
    good = sample_with_behaviour(model, "12+34=", "46", 1.0)
    bad = sample_with_behaviour(model, "12+34=", "91", 0.0)
    group = rlnb.Group("12+34=", (good, bad))
    before = sequence_logp(model, "12+34=", good) - sequence_logp(model, "12+34=", bad)
    metrics = learner.step([group])
    after = sequence_logp(model, "12+34=", good) - sequence_logp(model, "12+34=", bad)
    assert after > before
    assert learner.version == 1 and metrics["version"] == 1
    assert metrics["reward_mean"] == pytest.approx(0.5) and metrics["accuracy"] == pytest.approx(0.5)
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy
    assert metrics["staleness"] == 0 and metrics["grad_norm"] > 0
    expected = {
        "loss",
        "policy_loss",
        "reward_mean",
        "reward_std",
        "accuracy",
        "response_length",
        "entropy",
        "clip_active",
        "clip_fraction",
        "clip_low_fraction",
        "clip_high_fraction",
        "kl",
        "is_weight_mean",
        "is_truncated_fraction",
        "staleness",
        "grad_norm",
        "train_tokens_per_s",
        "groups",
        "groups_dropped",
        "tokens_counted",
        "version",
        "lr",
    }
    assert set(metrics) == expected
    assert metrics["clip_active"] == 0.0  # one update per batch: the ratio is 1, no clip can act
    assert metrics["lr"] == learner.config.lr  # constant without lr_decay_steps


def test_lr_decays_linearly_to_zero_over_lr_decay_steps_and_stays_there() -> None:
    model = policy()
    learner = Learner(model, encode=encode, pad_id=TOK.PAD, config=LearnConfig(lr=1e-3, lr_decay_steps=4))
    group = rlnb.Group("1+1=", tuple(sample_with_behaviour(model, "1+1=", c, r) for c, r in (("2", 1.0), ("3", 0.0))))
    seen = []
    for _ in range(6):
        metrics = learner.step([group])
        seen.append((metrics["lr"], learner.optimizer.param_groups[0]["lr"]))
    expected = [1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0, 0.0]
    assert [logged for logged, _ in seen] == pytest.approx(expected)
    assert [used for _, used in seen] == pytest.approx(expected)  # what AdamW stepped with
    before = {k: v.clone() for k, v in model.state_dict().items()}
    learner.step([group])  # lr 0: AdamW leaves the weights where they are
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_stale_samples_are_reweighted_and_counted_as_stale() -> None:
    model = policy()
    learner = Learner(model, encode=encode, pad_id=TOK.PAD, config=LearnConfig(is_cap=1.5))
    learner.version = 3
    # behaviour log-probs far below the current policy's: an old, different policy
    fresh = sample_with_behaviour(model, "1+1=", "2", 1.0, version=3)
    stale = sample_with_behaviour(model, "1+1=", "3", 0.0, version=1)
    stale = rlnb.Sample(**{**stale.__dict__, "logprobs": tuple(lp - 2.0 for lp in stale.logprobs)})
    metrics = learner.step([rlnb.Group("1+1=", (fresh, stale))])
    assert metrics["staleness"] == pytest.approx(1.0)  # (0 + 2) / 2 versions behind
    assert metrics["is_truncated_fraction"] == pytest.approx(0.5)  # the stale sample's tokens
    assert 1.0 < metrics["is_weight_mean"] <= 1.5


def test_kl_to_the_reference_is_zero_at_first_and_grows_after_updates() -> None:
    model = policy()
    learner = Learner(model, encode=encode, pad_id=TOK.PAD, config=LearnConfig(lr=5e-2, kl_coef=0.1))
    assert learner.reference is not None and learner.reference is not model
    group = rlnb.Group(
        "2+2=",
        (sample_with_behaviour(model, "2+2=", "4", 1.0), sample_with_behaviour(model, "2+2=", "5", 0.0)),
    )
    first = learner.step([group])
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)
    group = rlnb.Group(
        "2+2=",
        (sample_with_behaviour(model, "2+2=", "4", 1.0), sample_with_behaviour(model, "2+2=", "5", 0.0)),
    )
    assert learner.step([group])["kl"] > 0


def test_malformed_batches_are_refused() -> None:
    learner = Learner(policy(), encode=encode, pad_id=TOK.PAD)
    with pytest.raises(ValueError, match="at least one group"):
        learner.step([])
    no_logprobs = rlnb.Sample(prompt="1+1=", completion="2", token_ids=(5, 2), reward=1.0)
    with pytest.raises(ValueError, match="behaviour log-probs"):
        learner.step([rlnb.Group("1+1=", (no_logprobs,))])


@pytest.mark.parametrize(
    ("field", "value"),
    [("lr", 0.0), ("clip_eps", 1.5), ("is_cap", 0.5), ("kl_coef", -1.0), ("epochs", 0), ("minibatches", 0)],
)
def test_learner_config_errors_name_the_field(field: str, value: float) -> None:
    with pytest.raises(rlnb.ConfigError, match=f"LearnConfig.{field}="):
        LearnConfig(**{field: value})


def test_supervised_step_teaches_the_answer_and_its_end_without_a_new_version() -> None:
    model = policy()
    learner = Learner(model, encode=encode, pad_id=TOK.PAD, eos_id=TOK.EOS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    target = rlnb.Sample(prompt="12+34=", token_ids=(*TOK.encode("46"), TOK.EOS))
    before = sequence_logp(model, "12+34=", target)
    losses = [learner.supervised_step([("12+34=", "46"), ("1+1=", "2")], optimizer)["sft_loss"] for _ in range(20)]
    assert losses[-1] < losses[0] / 4
    assert sequence_logp(model, "12+34=", target) > before + 2  # EOS included: it learns where to stop
    assert learner.version == 0
    with pytest.raises(ValueError, match="at least one"):
        learner.supervised_step([], optimizer)


def test_unscaled_advantages_only_centre_the_rewards() -> None:
    model = policy()
    groups = [
        rlnb.Group(
            prompt="1+1=",
            samples=tuple(sample_with_behaviour(model, "1+1=", c, r) for c, r in (("2", 1.0), ("3", 0.2), ("4", 0.0))),
        )
    ]
    scaled = collate(groups, encode, TOK.PAD).advantages
    centred = collate(
        groups, encode, TOK.PAD, algorithm=rlnb.LearnConfig(scale_advantages=False).resolved_algorithm
    ).advantages
    assert torch.allclose(centred, torch.tensor([0.6, -0.2, -0.4]), atol=1e-6)
    assert torch.allclose(scaled, centred / torch.tensor([1.0, 0.2, 0.0]).std(unbiased=False), atol=1e-4)


def test_length_chunks_give_the_same_update_as_one_padded_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    import copy

    from rlnb.learn import _learner

    model = policy()
    # 32 groups of 2 (64 rows) with completions of 1 to 8 characters: padding every
    # row to the longest would waste a third of the positions
    groups = []
    for i in range(32):
        prompt = f"{i}+{i}="
        long = sample_with_behaviour(model, prompt, "1" * (1 + i % 8), reward=1.0)
        short = sample_with_behaviour(model, prompt, "2", reward=0.0)
        groups.append(rlnb.Group(prompt=prompt, samples=(long, short)))
    twin = copy.deepcopy(model)
    chunked = Learner(model, encode=encode, pad_id=TOK.PAD, config=LearnConfig(lr=1e-2, kl_coef=0.1))
    padded = Learner(twin, encode=encode, pad_id=TOK.PAD, config=LearnConfig(lr=1e-2, kl_coef=0.1))
    calls: list[int] = []
    real = _learner._length_chunks
    monkeypatch.setattr(_learner, "_length_chunks", lambda rows, lengths: calls.append(1) or real(rows, lengths))
    m1 = chunked.step(groups)
    assert len(real(torch.arange(64), collate(groups, encode, TOK.PAD).mask.sum(1))) == 4
    monkeypatch.setattr(_learner, "_length_chunks", lambda rows, lengths: [rows])
    m2 = padded.step(groups)
    for key in ("loss", "policy_loss", "entropy", "kl", "grad_norm"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    # the same gradient (Adam's first step, ~lr * sign(g), would magnify rounding)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7)
    assert calls

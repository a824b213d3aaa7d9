from __future__ import annotations

import dataclasses

import pytest

import rlnb


@pytest.mark.parametrize(
    ("make", "field", "fix"),
    [
        (lambda: rlnb.Config(seed=-1), "Config.seed", "seed=0"),
        (lambda: rlnb.Config(seed=True), "Config.seed", "int"),
        (lambda: rlnb.Config(close_timeout=0), "Config.close_timeout", "close_timeout=5.0"),
        (lambda: rlnb.Config(buffer={"capacity": 8}), "Config.buffer", "rlnb.BufferConfig(...)"),
        (lambda: rlnb.BufferConfig(capacity=0), "BufferConfig.capacity", "capacity=256"),
        (lambda: rlnb.BufferConfig(max_staleness=-1), "BufferConfig.max_staleness", "max_staleness=1"),
        (lambda: rlnb.BufferConfig(partitions=["train"]), "BufferConfig.partitions", "tuple"),
        (lambda: rlnb.BufferConfig(partitions=("val",)), "BufferConfig.partitions", '"train"'),
        (lambda: rlnb.BufferConfig(partitions=("train", "train")), "BufferConfig.partitions", "distinct"),
        (lambda: rlnb.EngineConfig(threads=0), "EngineConfig.threads", "threads=1"),
        (lambda: rlnb.LearnConfig(lr_decay_steps=0), "LearnConfig.lr_decay_steps", "lr_decay_steps=3000"),
    ],
)
def test_bad_values_name_the_field_and_the_fix(make, field: str, fix: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(rlnb.ConfigError) as info:
        make()
    assert field in str(info.value)
    assert fix in str(info.value)
    assert isinstance(info.value, ValueError)  # plain `except ValueError` still catches it


def test_configs_are_frozen_and_replace_validates() -> None:
    cfg = rlnb.Config(seed=3, buffer=rlnb.BufferConfig(capacity=16, max_staleness=1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 4  # type: ignore[misc]
    assert cfg.replace(seed=4).seed == 4 and cfg.seed == 3
    with pytest.raises(rlnb.ConfigError, match=r"Config\.seed"):
        cfg.replace(seed=-4)


def test_the_session_builds_its_buffer_from_the_config() -> None:
    cfg = rlnb.Config(buffer=rlnb.BufferConfig(capacity=2, max_staleness=0, partitions=("train", "eval")))
    with rlnb.Session(cfg, name="configured") as sess:
        stats = sess.buffer.statistics()
        assert stats.capacity == 2 and stats.max_staleness == 0
        assert set(stats.sizes) == {"train", "eval"}
        assert sess.config is cfg


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: rlnb.LearnConfig(lr="x"), "LearnConfig.lr"),
        (lambda: rlnb.LearnConfig(clip_eps=None), "LearnConfig.clip_eps"),
        (lambda: rlnb.LearnConfig(betas=(0.9,)), "LearnConfig.betas"),
        (lambda: rlnb.LearnConfig(kl_coef=float("nan")), "LearnConfig.kl_coef"),
        (lambda: rlnb.WarmupConfig(lr="1e-3"), "WarmupConfig.lr"),
        (lambda: rlnb.RolloutConfig(temperature="hot"), "RolloutConfig.temperature"),
        (lambda: rlnb.Config(step_timeout="60"), "Config.step_timeout"),
        (lambda: rlnb.ModelConfig(d_model=64.0), "ModelConfig.d_model"),
    ],
)
def test_a_value_of_the_wrong_type_is_a_config_error_not_a_type_error(make, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(rlnb.ConfigError, match=rf"{field}=.* is invalid: use"):
        make()


def test_renamed_fields_say_their_new_name_and_old_checkpoints_still_load() -> None:
    with pytest.raises(
        rlnb.ConfigError, match=r"RolloutConfig.max_staleness was renamed: use RolloutConfig\(max_policy_lag=2\)"
    ):
        rlnb.RolloutConfig(max_staleness=2)  # type: ignore[call-arg]
    from rlnb.checkpoint import config_from_dict, config_to_dict

    saved = config_to_dict(rlnb.Config(rollout=rlnb.RolloutConfig(max_policy_lag=3)))
    saved["rollout"]["max_staleness"] = saved["rollout"].pop("max_policy_lag")  # as an older rlnb wrote it
    assert config_from_dict(saved).rollout.max_policy_lag == 3


def test_the_model_shape_has_one_name() -> None:
    with pytest.raises(rlnb.ConfigError, match=r"merged into rlnb\.ModelConfig"):
        from rlnb.models import PolicyConfig  # noqa: F401
    with pytest.raises(rlnb.ConfigError, match=r"ModelConfig.vocab_size=4 is invalid: task 'addition' needs"):
        rlnb.Session(rlnb.Config(model=rlnb.ModelConfig(vocab_size=4)), name="too-small")
    assert rlnb.sessions() == []

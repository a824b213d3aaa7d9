from __future__ import annotations

import dataclasses
import json

import pytest

import rlnb
from rlnb.config import config_from_dict, config_to_dict


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
        (lambda: rlnb.LearnConfig(clip_eps="0.2"), "LearnConfig.clip_eps"),
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


# -- numbers as numpy and torch give them, and the bounds a live change meets --------------


def test_numpy_and_torch_scalars_are_the_numbers_they_hold_and_are_kept_as_python_numbers() -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    cfg = rlnb.Config(
        seed=np.int64(3),
        learn=rlnb.LearnConfig(lr=np.float32(0.5), betas=(np.float64(0.9), torch.tensor(0.5))),
        rollout=rlnb.RolloutConfig(group_size=np.int64(4), temperature=torch.tensor(0.75), reward_weights=None),
    )
    assert (cfg.seed, cfg.learn.lr, cfg.learn.betas, cfg.rollout.group_size) == (3, 0.5, (0.9, 0.5), 4)
    assert type(cfg.seed) is int and type(cfg.learn.lr) is float and type(cfg.rollout.group_size) is int
    assert type(cfg.rollout.temperature) is float and all(type(b) is float for b in cfg.learn.betas)
    live, diff = cfg.with_live(lr=np.float32(0.25), groups_per_step=np.int64(8), reward_weights=[np.float32(2)])
    assert diff == [("lr", 0.5, 0.25), ("groups_per_step", 16, 8), ("reward_weights", None, (2.0,))]
    assert (
        type(live.rollout.groups_per_step) is int
        and config_from_dict(json.loads(json.dumps(config_to_dict(live)))) == live
    )
    for bad in (np.bool_(True), torch.tensor(True), True):  # a bool stays refused
        with pytest.raises(rlnb.ConfigError, match=r"LearnConfig\.lr="):
            cfg.with_live(lr=bad)
    with pytest.raises(rlnb.ConfigError, match=r"RolloutConfig\.group_size="):
        cfg.with_live(group_size=np.float32(4.0))  # a float is not an int, as 4.0 is not


def test_reward_weights_that_could_overflow_a_weighted_sum_are_refused() -> None:
    with pytest.raises(rlnb.ConfigError) as info:
        rlnb.Config().with_live(reward_weights=[1e300])
    assert str(info.value).startswith("RolloutConfig.reward_weights=(1e+300,) is invalid: 1e+300 is beyond ±1e+06")
    assert "reward_weights=(1.0, 0.5)" in str(info.value)
    assert rlnb.RolloutConfig(reward_weights=(-1e6, 1e6)).reward_weights == (-1e6, 1e6)  # the bound itself


def test_a_live_group_size_past_max_inflight_offers_what_set_can_change() -> None:
    with pytest.raises(rlnb.ConfigError) as info:
        rlnb.Config().with_live(group_size=200)
    message = str(info.value)
    assert message.startswith("RolloutConfig.group_size=200 is invalid:") and "use group_size <= 128" in message
    assert "a larger max_inflight needs a new session" in message


def test_groups_per_step_is_bounded_in_both_modes_and_by_the_buffer_in_async_mode() -> None:
    with pytest.raises(rlnb.ConfigError) as info:
        rlnb.Config().with_live(groups_per_step=10**6)
    assert "RolloutConfig.groups_per_step=1000000 is invalid" in str(info.value)
    assert "8,000,000 samples, more than 65,536; use groups_per_step <= 8,192" in str(info.value)
    assert rlnb.RolloutConfig(group_size=2, groups_per_step=2**15).groups_per_step == 2**15
    with pytest.raises(rlnb.ConfigError) as info:
        rlnb.Config(mode="async").with_live(groups_per_step=2000)
    assert "use groups_per_step <= 1024 (a larger capacity needs a new session" in str(info.value)

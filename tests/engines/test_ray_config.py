"""``RayConfig``'s checks and the ``rlnb train`` flags that set it: what needs no Ray
cluster (test_ray.py starts one)."""

from __future__ import annotations

import sys

import pytest

import rlnb


def ray_started() -> bool:
    """Whether Ray was started in this process (never imported counts as not)."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: rlnb.RayConfig(engine_replicas=-1), "RayConfig.engine_replicas=-1 is invalid"),
        (lambda: rlnb.RayConfig(num_cpus=0), "RayConfig.num_cpus=0 is invalid"),
        (lambda: rlnb.RayConfig(strategy="pack"), "use one of ('PACK'"),
        (lambda: rlnb.RayConfig(address=""), "RayConfig.address='' is invalid"),
        (lambda: rlnb.RayConfig(address="auto", log_dir="logs"), "RayConfig.log_dir='logs' is invalid: it applies"),
    ],
)
def test_bad_ray_settings_are_config_errors_before_anything_starts(make: object, words: str) -> None:
    with pytest.raises(rlnb.ConfigError, match=None) as caught:
        make()  # type: ignore[operator]
    assert words in str(caught.value)
    assert not ray_started()


def test_the_ray_flags_of_rlnb_train_set_the_ray_config() -> None:
    """``--ray-replicas``/``--ray-address`` reach ``RayConfig``; a whole run on replicas
    is test_ray.py's session test (a cluster start more there would cost a minute)."""
    from rlnb.cli import _build_parser, _train_config
    from rlnb.config import describe_model

    args = _build_parser().parse_args(["train", "--steps", "1", "--run-dir", "r", "--ray-replicas", "2"])
    config, _ = _train_config(args)
    assert config.ray == rlnb.RayConfig(engine_replicas=2)
    assert describe_model(config).endswith(", 2 engine replicas on a local Ray cluster of its own")  # the header
    args = _build_parser().parse_args(
        ["train", "--steps", "1", "--run-dir", "r", "--ray-replicas", "3", "--ray-address", "auto"]
    )
    assert _train_config(args)[0].ray == rlnb.RayConfig(engine_replicas=3, address="auto")

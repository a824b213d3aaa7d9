"""Components take their config whole: no constructor of the rollout or learn packages,
nor the buffer, and no public constructor or ``start`` of the tracker, the engines, the
models and the prompt loader, takes a parameter named like a field of the config it
belongs to. A relayed field is a second default that drifts (the Rollouter once
defaulted to ``max_inflight=64`` and ``reward_timeout=None`` against the config's 128
and 10.0; a hand-built TinyEngine to ``max_batch=64`` against 128, a PromptLoader to
``prefetch_factor=4`` against 8, a Tracker to the console against no backend)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

import rlnb.buffer
import rlnb.data
import rlnb.engines
import rlnb.learn
import rlnb.models
import rlnb.rollout
import rlnb.track
from rlnb.config import (
    PARTS,
    BufferConfig,
    DataConfig,
    EngineConfig,
    LearnConfig,
    ModelConfig,
    RolloutConfig,
    TrackConfig,
)

CONFIGS = tuple(PARTS.values())


def fields(*configs: type) -> dict[str, str]:
    return {f.name: f"{c.__name__}.{f.name}" for c in configs for f in dataclasses.fields(c)}


def constructors(package: ModuleType) -> list[type]:
    """The classes the package's modules define whose names are public."""
    modules = [package] + [
        importlib.import_module(f"{package.__name__}.{info.name}") for info in pkgutil.iter_modules(package.__path__)
    ]
    found = {
        obj
        for module in modules
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and not name.startswith("_") and obj.__module__.startswith(package.__name__)
    }
    return sorted(found, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}")


def public_makers(package: ModuleType) -> list[Callable[..., Any]]:
    """How a user makes the package's exported classes: the class itself, or its
    ``start`` classmethod for a class made by one (its ``__init__`` is then plumbing
    that ``start`` calls). Config classes a package exports are left out."""
    makers: list[Callable[..., Any]] = []
    for name in sorted(package.__all__):
        obj = getattr(package, name)
        if not inspect.isclass(obj) or obj in CONFIGS:
            continue
        if isinstance(inspect.getattr_static(obj, "start", None), classmethod):
            makers.append(obj.start)
        elif "__init__" in vars(obj) or dataclasses.is_dataclass(obj):
            makers.append(obj)
    return makers


def label(maker: Callable[..., Any]) -> str:
    return f"{maker.__module__}.{maker.__qualname__}"


# Parameters named like a config field that are not that field: (maker, parameter) -> why.
NOT_RELAYS = {
    ("rlnb.models._hf_policy.HFPolicy", "max_len"): (
        "wraps a transformers model already loaded; required, so no default to drift "
        "(load_hf_model passes ModelConfig.max_len)"
    ),
    ("rlnb.track._wandb_file.WandbRunFile", "run_id"): "a record read back from a .wandb file, not a component",
}

CASES = (
    [
        (cls, fields(RolloutConfig, LearnConfig, DataConfig))
        for cls in constructors(rlnb.rollout) + constructors(rlnb.learn)
        if "__init__" in vars(cls) or dataclasses.is_dataclass(cls)
    ]
    + [(rlnb.buffer.ReplayBuffer, fields(BufferConfig))]
    + [(maker, fields(TrackConfig)) for maker in public_makers(rlnb.track)]
    + [(maker, fields(EngineConfig, ModelConfig)) for maker in public_makers(rlnb.engines)]
    + [(maker, fields(ModelConfig)) for maker in [*public_makers(rlnb.models), rlnb.models.load_hf_model]]
    + [(maker, fields(DataConfig)) for maker in public_makers(rlnb.data)]
)


def test_the_parts_that_should_take_a_config_are_checked() -> None:
    checked = {maker.__qualname__ for maker, _ in CASES}
    assert {
        "Rollouter",
        "GroupRunner",
        "ConversationRunner",
        "Learner",
        "Trainer",
        "ReplayBuffer",
        "Tracker",
        "TinyEngine",
        "ProcessEngine.start",
        "RayEngine.start",
        "VLLMEngine.start",
        "TinyPolicy",
        "load_hf_model",
        "PromptLoader",
    } <= checked


@pytest.mark.parametrize(("maker", "names"), CASES, ids=lambda case: getattr(case, "__qualname__", ""))
def test_no_constructor_relays_a_config_field(maker: Callable[..., Any], names: dict[str, str]) -> None:
    parameters = inspect.signature(maker).parameters
    relayed = [names[p] for p in parameters if p in names and (label(maker), p) not in NOT_RELAYS]
    assert not relayed, (
        f"{label(maker)}() takes {', '.join(relayed)} one by one: take the config whole "
        "and read the field from it, so that the config's default is the only one"
    )


@pytest.mark.parametrize(("maker", "names"), CASES, ids=lambda case: getattr(case, "__qualname__", ""))
def test_a_config_given_by_default_is_the_configs_own_default(maker: Callable[..., Any], names: dict[str, str]) -> None:
    """``TinyEngine(policy, eos_id=...)`` builds as ``EngineConfig()`` says, not as a
    module-level copy with other values."""
    for name, parameter in inspect.signature(maker).parameters.items():
        default = parameter.default
        if isinstance(default, CONFIGS):
            assert default == type(default)(), f"{label(maker)}({name}=...) defaults to {default!r}"


def test_the_exempted_parameters_exist() -> None:
    """An exemption outlives its parameter only as a mistake."""
    makers = {label(maker): maker for maker, _ in CASES}
    for where, parameter in NOT_RELAYS:
        assert parameter in inspect.signature(makers[where]).parameters, (where, parameter)


def test_data_config_is_one_class_under_both_names() -> None:
    """It lives beside the loader that reads it (rlnb.data sits below rlnb.config)."""
    assert rlnb.config.DataConfig is rlnb.data.DataConfig is rlnb.DataConfig
    assert PARTS["data"] is DataConfig
    with pytest.raises(rlnb.ConfigError, match=r"did you mean num_workers="):
        DataConfig(num_wokers=1)  # type: ignore[call-arg]

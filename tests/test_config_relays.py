"""Components take their config whole: no constructor of the rollout or learn packages,
nor the buffer, takes a parameter named like a field of the config it belongs to. A
relayed field is a second default that drifts (the Rollouter once defaulted to
``max_inflight=64`` and ``reward_timeout=None`` against the config's 128 and 10.0)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from types import ModuleType

import pytest

import rlnb.buffer
import rlnb.learn
import rlnb.rollout
from rlnb.config import BufferConfig, LearnConfig, RolloutConfig


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


CASES = [
    (cls, fields(RolloutConfig, LearnConfig))
    for cls in constructors(rlnb.rollout) + constructors(rlnb.learn)
    if "__init__" in vars(cls) or dataclasses.is_dataclass(cls)
] + [(rlnb.buffer.ReplayBuffer, fields(BufferConfig))]


def test_the_parts_that_should_take_a_config_are_checked() -> None:
    checked = {cls.__name__ for cls, _ in CASES}
    assert {"Rollouter", "GroupRunner", "ConversationRunner", "Learner", "Trainer", "ReplayBuffer"} <= checked


@pytest.mark.parametrize(("cls", "names"), CASES, ids=lambda case: getattr(case, "__qualname__", ""))
def test_no_constructor_relays_a_config_field(cls: type, names: dict[str, str]) -> None:
    relayed = [names[p] for p in inspect.signature(cls).parameters if p in names]
    assert not relayed, (
        f"{cls.__module__}.{cls.__qualname__}() takes {', '.join(relayed)} one by one: take the config whole "
        "and read the field from it, so that the config's default is the only one"
    )

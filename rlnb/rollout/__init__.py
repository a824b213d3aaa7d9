"""Rollouts: the asynchronous ``Rollouter`` that drives an engine.

It turns prompts into scored groups in the replay buffer, pauses and resumes
generation (keeping partial rollouts), and waits out weight syncs. It speaks to an
engine only through the ``Engine`` protocol of :mod:`rlnb.engines`; the protocol's
names and the engines are importable from here too, as they were before
``rlnb.engines`` existed.
"""

import typing as _typing

import rlnb.engines as _engines
from rlnb._samples import PromptItem
from rlnb.engines import (
    Engine,
    EngineStatistics,
    FakeEngine,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    SamplingParams,
    compare_logprobs,
)
from rlnb.rollout._accounting import RolloutStatistics
from rlnb.rollout._rollouter import Rollouter
from rlnb.rollout._state import RolloutState

if _typing.TYPE_CHECKING:
    from rlnb.engines import RayEngine, TinyEngine, VLLMEngine
else:

    def __getattr__(name: str) -> object:
        # The heavy engines, from rlnb.engines when first asked for.
        if name in ("RayEngine", "TinyEngine", "VLLMEngine"):
            return getattr(_engines, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "RayEngine", "TinyEngine", "VLLMEngine"})


__all__ = [
    "Engine",
    "EngineStatistics",
    "FakeEngine",
    "GenerateRequest",
    "GenerateResult",
    "PauseMode",
    "PromptItem",
    "RayEngine",
    "RolloutState",
    "RolloutStatistics",
    "Rollouter",
    "SamplingParams",
    "TinyEngine",
    "VLLMEngine",
    "compare_logprobs",
]

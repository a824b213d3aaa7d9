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
    GenerateRequest,
    GenerateResult,
    PauseMode,
    SamplingParams,
)
from rlnb.rollout._accounting import RolloutStatistics
from rlnb.rollout._group import Conversations
from rlnb.rollout._rollouter import Rollouter
from rlnb.rollout._state import RolloutState

# The backends (and the check mode) are rlnb.engines' names, forwarded when first asked
# for: nothing here imports a backend.
_BACKENDS = ("FakeEngine", "RayEngine", "TinyEngine", "VLLMEngine", "compare_logprobs")

if _typing.TYPE_CHECKING:
    from rlnb.engines import FakeEngine, RayEngine, TinyEngine, VLLMEngine, compare_logprobs
else:

    def __getattr__(name: str) -> object:
        if name in _BACKENDS:
            return getattr(_engines, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_BACKENDS})


__all__ = [
    "Conversations",
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

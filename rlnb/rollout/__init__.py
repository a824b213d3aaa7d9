"""Generation: the ``Engine`` protocol, its backends and the asynchronous ``Rollouter``."""

from rlnb.rollout._engine import (
    Engine,
    EngineStatistics,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    SamplingParams,
)
from rlnb.rollout._fake import FakeEngine
from rlnb.rollout._rollouter import PromptItem, Rollouter, RolloutState, RolloutStatistics

__all__ = [
    "Engine",
    "EngineStatistics",
    "FakeEngine",
    "GenerateRequest",
    "GenerateResult",
    "PauseMode",
    "PromptItem",
    "RolloutState",
    "RolloutStatistics",
    "Rollouter",
    "SamplingParams",
]

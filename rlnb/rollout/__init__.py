"""Generation: the ``Engine`` protocol, its backends and the asynchronous ``Rollouter``."""

import typing as _typing

from rlnb._samples import PromptItem
from rlnb.rollout._accounting import RolloutStatistics
from rlnb.rollout._check import compare_logprobs
from rlnb.rollout._engine import (
    Engine,
    EngineStatistics,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    SamplingParams,
)
from rlnb.rollout._fake import FakeEngine
from rlnb.rollout._rollouter import Rollouter
from rlnb.rollout._state import RolloutState

if _typing.TYPE_CHECKING:
    from rlnb.rollout._ray import RayEngine
    from rlnb.rollout._tiny import TinyEngine
    from rlnb.rollout._vllm import VLLMEngine
else:

    def __getattr__(name: str) -> object:
        # TinyEngine needs torch, VLLMEngine vLLM, RayEngine Ray: imported when first
        # asked for, so `import rlnb` stays light.
        if name == "RayEngine":
            from rlnb.rollout._ray import RayEngine

            return RayEngine
        if name == "TinyEngine":
            from rlnb.rollout._tiny import TinyEngine

            return TinyEngine
        if name == "VLLMEngine":
            from rlnb.rollout._vllm import VLLMEngine

            return VLLMEngine
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

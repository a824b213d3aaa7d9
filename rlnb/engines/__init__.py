"""Engines: the ``Engine`` protocol and its backends.

``TinyEngine`` serves the built-in policy or a Hugging Face model in a thread,
``ProcessEngine`` runs it in a child process of its own (weights through shared memory),
``VLLMEngine`` serves a model directory with vLLM in a guarded child process,
``RayEngine`` runs replicas of either as Ray actors (on a ``RayCluster``, which the
learner's ranks use too), and ``FakeEngine`` is a scripted engine for tests. Nothing
here knows about the ``Rollouter`` (``rlnb.rollout``), which drives any object that
keeps the protocol.
"""

import typing as _typing

from rlnb.engines._check import compare_logprobs
from rlnb.engines._fake import FakeEngine
from rlnb.engines._protocol import (
    Engine,
    EngineStatistics,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    PromptTooLong,
    SamplingParams,
)

if _typing.TYPE_CHECKING:
    from rlnb.engines._process import ProcessEngine
    from rlnb.engines._ray import RayEngine
    from rlnb.engines._ray_cluster import RayCluster
    from rlnb.engines._tiny import TinyEngine
    from rlnb.engines._vllm import VLLMEngine
else:

    def __getattr__(name: str) -> object:
        # TinyEngine needs torch, VLLMEngine vLLM, RayEngine Ray: imported when first
        # asked for, so `import rlnb` stays light.
        if name == "ProcessEngine":
            from rlnb.engines._process import ProcessEngine

            return ProcessEngine
        if name == "RayEngine":
            from rlnb.engines._ray import RayEngine

            return RayEngine
        if name == "RayCluster":  # the learner's ranks run on the session's cluster too
            from rlnb.engines._ray_cluster import RayCluster

            return RayCluster
        if name == "TinyEngine":
            from rlnb.engines._tiny import TinyEngine

            return TinyEngine
        if name == "VLLMEngine":
            from rlnb.engines._vllm import VLLMEngine

            return VLLMEngine
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "ProcessEngine", "RayCluster", "RayEngine", "TinyEngine", "VLLMEngine"})


__all__ = [
    "Engine",
    "EngineStatistics",
    "FakeEngine",
    "GenerateRequest",
    "GenerateResult",
    "PauseMode",
    "ProcessEngine",
    "PromptTooLong",
    "RayCluster",
    "RayEngine",
    "SamplingParams",
    "TinyEngine",
    "VLLMEngine",
    "compare_logprobs",
]

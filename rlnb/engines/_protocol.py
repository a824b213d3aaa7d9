"""The ``Engine`` protocol: what a generation backend offers the rollouter.

Backends (the built-in ``TinyEngine``, Ray-actor replicas, vLLM) are async,
generate one request at a time from the caller's view, and batch internally.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from rlnb._checks import check_int, check_sampling
from rlnb._errors import InvalidValueError, RlnbError

__all__ = [
    "Engine",
    "EngineStatistics",
    "GenerateRequest",
    "GenerateResult",
    "PauseMode",
    "PromptTooLong",
    "SamplingParams",
]


class PauseMode(enum.StrEnum):
    """How an engine pauses.

    KEEP freezes in-flight requests in place (their KV cache kept); ABORT returns
    every in-flight request now with its partial tokens (finish reason "aborted");
    WAIT admits nothing new and lets in-flight requests finish (resume ends it).
    """

    KEEP = "keep"
    ABORT = "abort"
    WAIT = "wait"

    @classmethod
    def _missing_(cls, value: object) -> PauseMode:
        raise InvalidValueError(f"pause(mode={value!r}) is invalid: use one of 'abort', 'keep', 'wait'")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 mean no truncation;
    ``ignore_eos`` generates exactly ``max_new_tokens`` (for benchmarks). An invalid
    field raises :class:`~rlnb.ConfigError` naming it."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        check_sampling("SamplingParams", self.temperature, self.top_p, self.top_k)
        check_int("SamplingParams.max_new_tokens", self.max_new_tokens, minimum=1, example="max_new_tokens=16")


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One sequence to generate.

    ``prompt_ids`` is the tokenized prompt; ``prefix_ids`` are tokens already
    generated for it (a partial rollout being continued), which the engine
    conditions on but does not return again. ``seed`` makes sampling reproducible
    for this request whatever else is in the batch.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    prefix_ids: tuple[int, ...] = ()
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """New tokens for a request, with the behaviour log-prob and policy version of each.

    ``finish_reason`` is "stop" (end of sequence), "length" (``max_new_tokens`` or
    the model's context reached) or "aborted" (the tokens are a partial rollout).
    """

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: str


class PromptTooLong(RlnbError, ValueError):
    """An engine's refusal of a request whose prompt and prefix (``tokens``) leave no
    room for one new token in its context (``context``): the same request would fail
    again, so the rollouter does not retry it. Pickles whole (it crosses a process
    or a Ray actor's boundary)."""

    def __init__(self, message: str, *, tokens: int | None = None, context: int | None = None) -> None:
        super().__init__(message)
        self.tokens, self.context = tokens, context


@dataclasses.dataclass(frozen=True)
class EngineStatistics:
    """A snapshot of an engine: requests waiting, running and done; tokens; version."""

    version: int
    paused: str | None  # the PauseMode value while paused
    waiting: int
    running: int
    finished: int
    aborted: int
    generated_tokens: int
    decode_steps: int
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """An async generation backend. Every method is safe to call from the bridge loop."""

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Generate for ``request``; returns when it stops, hits a limit or is aborted."""
        ...

    async def abort(self, request_ids: list[str]) -> None:
        """Finish these requests now with finish reason "aborted" (unknown ids are ignored)."""
        ...

    async def pause(self, mode: PauseMode | str = PauseMode.KEEP) -> None:
        """Pause in ``mode``; returns once the engine is quiescent for KEEP and ABORT."""
        ...

    async def resume(self) -> None:
        """Leave any pause; frozen and queued requests continue."""
        ...

    async def update_weights(self, state: Mapping[str, Any], version: int) -> None:
        """Load ``state`` between decode steps; later tokens carry ``version``."""
        ...

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot; does not block."""
        ...

    def close(self, timeout: float | None = None) -> None:
        """Stop and release everything; idempotent. Pending requests are aborted."""
        ...

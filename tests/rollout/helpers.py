"""The Rollouter's test kit: a scripted prompt stream and engine, and waits that poll.

Waits poll for a condition; the only fixed sleeps let a scripted generation make a
few tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import rlnb
from rlnb.buffer import ReplayBuffer
from rlnb.config import BufferConfig, DataConfig, RolloutConfig
from rlnb.engines import FakeEngine, GenerateRequest, GenerateResult, PauseMode, SamplingParams
from rlnb.rollout import PromptItem, Rollouter
from tests.helpers import wait_until_async

EOS = 2  # FakeEngine ends every "stop" sequence with this token
DELAY = 0.01  # FakeEngine seconds per token where a test acts mid-generation
# Where a test must catch 20-token generations still running after waiting for 3 tokens,
# a slower pace: a loaded machine stalling for a few hundred ms must not finish them.
SLOW = 0.05
NO_LENGTH_CUT = SamplingParams(max_new_tokens=10**9)  # the scripted lengths alone end a sample


def prompt_stream() -> Iterator[PromptItem]:
    for i in itertools.count():
        yield PromptItem(i, f"{i}+{i}=", str(2 * i))


def parse_id(request_id: str) -> tuple[int, int, int, int]:
    """The rollouter names requests "prompt.sample.continuation.attempt"."""
    prompt, sample, continuation, attempt = map(int, request_id.split("."))
    return prompt, sample, continuation, attempt


def encode(text: str) -> list[int]:
    return [3 + ord(c) % 20 for c in text]


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def constant_reward(item: PromptItem, completion: str, **env: float | None) -> float:
    return 1.0  # a conversation's is also given env_reward=


class RecordingEngine(FakeEngine):
    """A FakeEngine that keeps every result and logs its control calls.

    ``update_gate``, when set, holds ``update_weights`` until it is set, so a test
    can act while the rollouter is SYNCING.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.results: dict[str, GenerateResult] = {}
        self.calls: list[str] = []
        self.update_gate: asyncio.Event | None = None

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        result = await super().generate(request)
        self.results[request.request_id] = result
        return result

    async def pause(self, mode: PauseMode | str = PauseMode.KEEP) -> None:
        self.calls.append(f"pause:{PauseMode(mode).value}")
        await super().pause(mode)

    async def resume(self) -> None:
        self.calls.append("resume")
        await super().resume()

    async def update_weights(self, state: Mapping[str, Any], version: int) -> None:
        self.calls.append(f"update:{version}")
        if self.update_gate is not None:
            await self.update_gate.wait()
        await super().update_weights(state, version)


ROLLOUT_FIELDS = {field.name for field in dataclasses.fields(RolloutConfig)}


def rollout_config(**fields: Any) -> RolloutConfig:
    """A RolloutConfig of ``fields``; ``group_size=1``, which a config refuses (a group
    of one learns nothing), is let through: a test of one sample reads simpler."""
    if fields.get("group_size") != 1:
        return RolloutConfig(**fields)
    config = RolloutConfig(**{**fields, "group_size": 2, "max_inflight": max(2, fields.get("max_inflight", 2))})
    object.__setattr__(config, "group_size", 1)
    object.__setattr__(config, "max_inflight", fields.get("max_inflight", config.max_inflight))
    return config


@contextlib.asynccontextmanager
async def make_rollouter(
    engine: FakeEngine,
    *,
    reward_fn: Callable[..., float] = constant_reward,
    buffer_capacity: int = 256,
    buffer_max_staleness: int | None = None,
    **kwargs: Any,
) -> AsyncIterator[tuple[Rollouter, ReplayBuffer]]:
    """A Rollouter on a scripted prompt stream; ``kwargs`` are RolloutConfig's fields
    (the config's defaults otherwise) and the Rollouter's other arguments."""
    config = rollout_config(**{k: kwargs.pop(k) for k in list(kwargs) if k in ROLLOUT_FIELDS})
    kwargs.setdefault("sampling", NO_LENGTH_CUT)
    kwargs.setdefault("encode", encode)
    kwargs.setdefault("seed", 0)
    kwargs.setdefault("data", DataConfig(on_bad_prompt=kwargs.pop("on_bad_prompt", "raise")))
    kwargs.setdefault("max_context", None)
    buffer = ReplayBuffer(BufferConfig(capacity=buffer_capacity, max_staleness=buffer_max_staleness))
    rollouter = Rollouter(
        engine, config, prompts=prompt_stream(), decode=decode, reward_fn=reward_fn, buffer=buffer, **kwargs
    )
    try:
        yield rollouter, buffer
    finally:
        await rollouter.aclose()
        buffer.close()


async def until(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Poll ``predicate`` on the loop; the timeout only turns a hang into a failure."""
    await wait_until_async(predicate, what, timeout)


async def settle(iterations: int = 50) -> None:
    """Let every ready task run a while, to show that something does NOT happen."""
    for _ in range(iterations):
        await asyncio.sleep(0)


async def next_pending_error(r: Rollouter) -> rlnb.RolloutError:
    """The next background failure raise_pending() reports (it is stored by the failed
    task's done-callback, a loop turn after the group counts as failed)."""
    error: rlnb.RolloutError | None = None

    def raised() -> bool:
        nonlocal error
        try:
            r.raise_pending()
        except rlnb.RolloutError as exc:
            error = exc
        return error is not None

    await until(raised, "a background failure to be reported")
    assert error is not None
    return error


def buffered_ids(buffer: ReplayBuffer) -> list[int]:
    n = buffer.statistics().sizes["train"]
    return [g.prompt_id for g in buffer.get_nowait(n)] if n else []


def groups_ended(r: Rollouter) -> Callable[[], bool]:
    """Every dispatched group has been counted as finished, failed or cancelled (a group
    is counted a few loop turns after its last sample ends, once its reward is in)."""

    def ended() -> bool:
        s = r.statistics()
        return s.in_flight == 0 and s.groups_finished + s.groups_failed + s.groups_cancelled == s.groups_dispatched

    return ended

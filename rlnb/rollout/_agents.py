"""Agents: samples made by your own code talking to the policy through an
OpenAI-compatible client.

A task with ``agent=`` (:class:`rlnb.data.Task`) rolls out each sample as an episode
of the agent: ``agent(client, row)`` gets a client of the session's endpoint
(:mod:`rlnb.serve`) made for that episode alone, calls the policy as often as it
likes (tools, several turns, ``n`` choices), and returns its reward (a number, a
list of turn rewards that are summed, or None to leave the scoring to the task's
reward functions). The calls it made become the sample (:mod:`rlnb.rollout._served`).

An ``async def`` agent runs as a task on an event loop of its own, on one thread
``rlnb-agents`` shared by every episode (they wait on the endpoint, not on the CPU);
the timeout cancels it. A plain ``def`` agent gets a synchronous client and runs on a
pool of threads ``rlnb-agent-N`` (one per episode running), where it cannot be
stopped: its thread ends when it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlnb._errors import ClosedError, RolloutError
from rlnb._reprs import short_repr
from rlnb._samples import PromptItem
from rlnb.rewards import BadValue, reward_value
from rlnb.rollout._conversation import row_of
from rlnb.rollout._reward import CallTimedOut, PoolFull, RewardPool
from rlnb.runtime import AsyncBridge

__all__ = ["AgentRunner", "Agents", "agent_name"]


@dataclasses.dataclass(frozen=True)
class Agents:
    """How samples become agent episodes: ``agent(client, row)`` is the user's function;
    ``client(episode, sync=...)`` makes the endpoint's client for one episode (an
    ``openai.AsyncOpenAI``, or an ``openai.OpenAI`` with ``sync``), on the thread that
    uses it; ``timeout``: seconds an episode may take (None: no limit)."""

    agent: Callable[..., Any]
    client: Callable[..., Any]
    timeout: float | None


def agent_name(agent: Any) -> str:
    return str(getattr(agent, "__qualname__", None) or type(agent).__name__)


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


async def _async_episode(agent: Callable[..., Any], make_client: Callable[..., Any], episode: str, row: Any) -> Any:
    client = make_client(episode, sync=False)
    try:
        return await agent(client, row)
    finally:
        with contextlib.suppress(Exception):  # a client that failed to close changes nothing trained
            await client.close()


def _sync_episode(agent: Callable[..., Any], make_client: Callable[..., Any], episode: str, row: Any) -> Any:
    client = make_client(episode, sync=True)
    try:
        return agent(client, row)
    finally:
        with contextlib.suppress(Exception):
            client.close()


def episode_reward(value: Any) -> float | None:
    """An agent's return as the episode's reward: a number, the sum of a list of turn
    rewards, or None. Raises BadValue for anything else."""
    if value is None:
        return None
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        parts = [reward_value(v, allow_none=True) for v in value]
        known = [p for p in parts if p is not None]
        return reward_value(sum(known)) if known else None
    return reward_value(value)


class AgentRunner:
    """Runs a group runner's agent episodes (``spec``): ``async def`` agents as tasks on
    a loop of their own, plain ones on up to ``workers`` threads."""

    def __init__(self, spec: Agents, *, workers: int) -> None:
        self.spec = spec
        self._async = _is_async(spec.agent)
        self._bridge: AsyncBridge | None = None
        self._pool: RewardPool | None = None
        self._workers = workers
        self._closed = False

    def close(self, timeout: float = 1.0) -> None:
        """Cancel every episode still running and stop the agents' loop or threads; idempotent."""
        self._closed = True
        if self._bridge is not None:
            self._bridge.close(timeout=timeout)
        if self._pool is not None:
            self._pool.close(timeout=timeout)

    async def run(self, item: PromptItem, episode: str) -> float | None:
        """The agent's episode ``episode`` for ``item``, to its end: its reward (None: it
        gave none). RolloutError naming the agent and the prompt when it raises, runs
        past the timeout (it is cancelled) or returns what is not a reward;
        CancelledError when cancelled (so is the agent)."""
        if self._closed:
            raise ClosedError("the agents' runner is closed")
        spec = self.spec
        name = agent_name(spec.agent)
        where = f"prompt {item.prompt_id} ({short_repr(item.prompt)})"
        row = row_of(item)
        try:
            if self._async:
                value = await self._run_async(episode, row, where)
            else:
                value = await self._run_sync(episode, row, where)
        except (asyncio.CancelledError, ClosedError, RolloutError):
            raise
        except Exception as exc:
            raise RolloutError(f"the agent {name} raised {exc!r} for {where}") from exc
        try:
            return episode_reward(value)
        except BadValue as bad:
            raise RolloutError(
                f"the agent {name} returned {bad.value} for {where}: return the episode's reward (a finite number), "
                "a list of turn rewards (summed), or None to let the task's reward functions score it"
            ) from None

    async def _run_async(self, episode: str, row: Any, where: str) -> Any:
        if self._bridge is None:
            self._bridge = AsyncBridge(name="rlnb-agents")
        spec = self.spec
        fut = self._bridge.submit(_async_episode(spec.agent, spec.client, episode, row))
        waiter = asyncio.wrap_future(fut)
        try:
            done, _ = await asyncio.wait({waiter}, timeout=spec.timeout)
        except BaseException:  # cancelled: so is the agent, and its client's calls end too
            self._abandon(fut, waiter)
            raise
        if not done:
            self._abandon(fut, waiter)
            raise RolloutError(self._late(where, stopped=True))
        return waiter.result()

    def _abandon(self, fut: Any, waiter: asyncio.Future[Any]) -> None:
        """Cancel an episode nobody waits for any more; how it ends is of no interest."""
        assert self._bridge is not None
        waiter.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._bridge.cancel(fut)

    async def _run_sync(self, episode: str, row: Any, where: str) -> Any:
        if self._pool is None:
            self._pool = RewardPool(max_workers=self._workers, name="agent")
        spec = self.spec
        try:
            return await self._pool.call(
                _sync_episode, spec.agent, spec.client, episode, row, timeout=spec.timeout, label=where
            )
        except CallTimedOut:
            raise RolloutError(self._late(where, stopped=False)) from None
        except PoolFull as full:
            raise RolloutError(
                f"the agent was not called for {where}: {full} earlier episodes that timed out are still running "
                "(a plain def agent cannot be stopped: write it async def to have it cancelled)"
            ) from None

    def _late(self, where: str, *, stopped: bool) -> str:
        fate = (
            "it was cancelled"
            if stopped
            else "a plain def agent cannot be stopped: its thread ends when it returns (write it async def)"
        )
        return (
            f"the agent {agent_name(self.spec.agent)} did not return within Task.agent_timeout={self.spec.timeout} s "
            f"for {where} ({fate}); give it more time (Task(agent_timeout=...)), or find where it waits"
        )

    def running(self) -> Mapping[str, int]:
        """Episodes running now, by kind."""
        return {"threads": 0 if self._pool is None else len(self._pool.running())}

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
import threading
from collections.abc import Callable, Sequence
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
    ``client(sync)`` makes the endpoint's client that every episode's is a copy of
    (an ``openai.AsyncOpenAI``, or an ``openai.OpenAI`` with ``sync``) and what closes
    its connections (a coroutine function for an async one); ``address(episode)`` is an
    episode's ``base_url`` and the key it needs (the endpoint's now: one started again,
    on another port with another key, takes the next episodes); ``timeout``: seconds an
    episode may take (None: no limit).

    One client, copied: making an ``openai`` client takes ~50 ms (its TLS context),
    which for every episode cost seconds a step; a copy takes 0.1 ms and shares the
    connections (whose close an episode's client cannot reach)."""

    agent: Callable[..., Any]
    client: Callable[[bool], tuple[Any, Callable[[], Any]]]
    address: Callable[[str], tuple[str, str]]
    timeout: float | None


def agent_name(agent: Any) -> str:
    return str(getattr(agent, "__qualname__", None) or type(agent).__name__)


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


async def _async_episode(runner: AgentRunner, episode: str, row: Any) -> Any:
    return await runner.spec.agent(runner.episode_client(episode, sync=False), row)


def _sync_episode(runner: AgentRunner, episode: str, row: Any) -> Any:
    return runner.spec.agent(runner.episode_client(episode, sync=True), row)


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


async def _cancelled_then(bridge: AsyncBridge, close: Callable[[], Any]) -> None:
    """On the agents' loop: cancel the episodes still running there, then ``close()``."""
    current = asyncio.current_task()
    others = [task for task in asyncio.all_tasks() if task is not current]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
    await close()


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
        self._lock = threading.Lock()
        self._clients: dict[bool, tuple[Any, Callable[[], Any]]] = {}  # by sync: the client episodes copy

    def episode_client(self, episode: str, *, sync: bool) -> Any:
        """The client of ``episode`` (on the thread that runs it): a copy of the shared one."""
        with self._lock:
            if self._closed:
                raise ClosedError("the agents' runner is closed")
            if sync not in self._clients:
                self._clients[sync] = self.spec.client(sync)
            base = self._clients[sync][0]
        url, key = self.spec.address(episode)
        return base.with_options(base_url=url, api_key=key)

    def close(self, timeout: float = 1.0) -> None:
        """Cancel every episode still running, close the clients' connections and stop
        the agents' loop or threads; idempotent."""
        with self._lock:
            self._closed = True
            clients, self._clients = self._clients, {}
        if self._bridge is not None:
            if False in clients:  # its connections belong to the agents' loop: closed there
                with contextlib.suppress(Exception):
                    self._bridge.run(_cancelled_then(self._bridge, clients[False][1]), timeout=timeout)
            self._bridge.close(timeout=timeout)
        if True in clients:
            with contextlib.suppress(Exception):
                clients[True][1]()
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
            raise RolloutError(f"the agent {name!r} raised {exc!r} for {where}") from exc
        try:
            return episode_reward(value)
        except BadValue as bad:
            raise RolloutError(
                f"the agent {name!r} returned {bad.value} for {where}: return the episode's reward (a finite number), "
                "a list of turn rewards (summed), or None to let the task's reward functions score it"
            ) from None

    async def _run_async(self, episode: str, row: Any, where: str) -> Any:
        if self._bridge is None:
            self._bridge = AsyncBridge(name="rlnb-agents")
        spec = self.spec
        fut = self._bridge.submit(_async_episode(self, episode, row))
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
            return await self._pool.call(_sync_episode, self, episode, row, timeout=spec.timeout, label=where)
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
            f"the agent {agent_name(self.spec.agent)!r} did not return within Task.agent_timeout={self.spec.timeout} s "
            f"for {where} ({fate}); give it more time (Task(agent_timeout=...)), or find where it waits"
        )

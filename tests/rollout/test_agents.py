"""Agents: samples made of the calls an agent's code makes, served by the rollouts.

The agents here talk to the rollouts through a direct client (no HTTP: the endpoint's
own tests are in tests/serve): each call is a ServedRequest handed to the rollouter's
loop, exactly as the endpoint hands it. The engine is a scripted FakeEngine. Covered:
an episode of several calls as one masked sample, branches, ``n``, rewards, failures
and timeouts named, every pause mode with episodes mid-way, a weight sync between
calls, a plain ``def`` agent, evaluation, and close with episodes in flight.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

import rlnb
from rlnb.engines import GenerateRequest, SamplingParams
from rlnb.rollout import Agents, Served, ServedChoice, ServedRequest, Serving
from tests.helpers import assert_counts_add_up
from tests.rollout.helpers import EOS, RecordingEngine, encode, make_rollouter, next_pending_error, until

OBS = 7  # every token of what comes between two replies, so a scripted engine can find where a turn began


def observe(observation: Any) -> list[int]:
    text = observation if isinstance(observation, str) else " ".join(m.get("content") or "" for m in observation)
    return [OBS] * max(1, len(text))


def encode_prompt(prompt: Any, tools: Any) -> list[int]:
    return encode(prompt if isinstance(prompt, str) else " ".join(m.get("content") or "" for m in prompt))


SERVING = Serving(encode_prompt=encode_prompt, encode_observation=observe, syntax="call")


def turn_lengths(*lengths: int) -> Callable[[GenerateRequest], int]:
    """Reply k gets ``lengths[k]`` tokens (EOS included), however often a pause cuts it:
    a reply begins after the last observation token of its prefix."""

    def total(request: GenerateRequest) -> int:
        prefix = request.prefix_ids
        start = max((i + 1 for i, t in enumerate(prefix) if t == OBS), default=0)
        turn = sum(1 for i, t in enumerate(prefix) if t == OBS and (i + 1 == len(prefix) or prefix[i + 1] != OBS))
        return start + lengths[min(turn, len(lengths) - 1)]

    return total


class DirectClient:
    """What an agent gets here: calls served on the rollouter's loop, as the endpoint does."""

    def __init__(self, served: Served, loop: asyncio.AbstractEventLoop, episode: str) -> None:
        self.served, self.loop, self.episode = served, loop, episode

    def with_options(self, *, base_url: str, api_key: str) -> DirectClient:  # as an openai client's copy
        return type(self)(self.served, self.loop, base_url)

    async def call(self, messages: list[dict[str, Any]], *, n: int = 1, **sampling: Any) -> list[ServedChoice]:
        request = ServedRequest(
            messages=tuple(messages),
            sampling=SamplingParams(**{"max_new_tokens": 10**6, **sampling}),
            n=n,
            episode=self.episode,
        )
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.served.serve(request), self.loop))

    def call_sync(self, messages: list[dict[str, Any]]) -> list[ServedChoice]:
        request = ServedRequest(
            messages=tuple(messages), sampling=SamplingParams(max_new_tokens=10**6), episode=self.episode
        )
        return asyncio.run_coroutine_threadsafe(self.served.serve(request), self.loop).result(10)


class SyncClient(DirectClient):
    """A plain def agent's client (the same calls: this one is not an openai client)."""


def agents(agent: Callable[..., Any], holder: dict[str, Any], *, timeout: float | None = 10.0) -> Agents:
    """The Agents spec for ``agent``, its clients calling on the loop ``holder`` names."""

    def client(sync: bool) -> tuple[DirectClient, Callable[[], Any]]:
        base = (SyncClient if sync else DirectClient)(holder["rollouter"].served, holder["loop"], "")

        async def close() -> None:
            pass

        return base, (lambda: None) if sync else close

    return Agents(agent, client, lambda episode: (episode, "key"), timeout)


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def reply(choice: ServedChoice) -> dict[str, Any]:
    return {"role": "assistant", "content": choice.content}


def env_reward(item: Any, completion: str, env_reward: float | None = None) -> float:
    return 0.0 if env_reward is None else env_reward


def two_call_agent(reward: Any = 1.0) -> Callable[..., Any]:
    async def agent(client: DirectClient, row: dict[str, Any]) -> Any:
        messages = [user(row["prompt"])]
        [first] = await client.call(messages)
        messages += [reply(first), user("go on")]
        await client.call(messages)
        return reward

    return agent


def run(main: Callable[[dict[str, Any]], Any]) -> None:
    async def wrapped() -> None:
        holder: dict[str, Any] = {"loop": asyncio.get_running_loop()}
        await main(holder)

    asyncio.run(wrapped())


def test_an_episode_of_two_calls_is_one_sample_with_what_came_between_masked() -> None:
    async def main(holder: dict[str, Any]) -> None:
        engine = RecordingEngine(lengths=turn_lengths(3, 4))
        async with make_rollouter(
            engine,
            group_size=2,
            max_inflight=2,
            serving=SERVING,
            agents=agents(two_call_agent(0.75), holder),
            reward_fn=env_reward,
        ) as (r, _):
            holder["rollouter"] = r
            [group] = await r.collect(1)
            stats = r.served.statistics()
        assert group.prompt_ids == tuple(encode("0+0="))  # the first call's prompt
        observation = observe([user("go on")])
        for sample in group.samples:
            assert sample.token_ids == (3, 3, EOS, *observation, 3, 3, 3, EOS)
            assert sample.mask == (1, 1, 1, *[0] * len(observation), 1, 1, 1, 1)
            assert sample.turns == (0, 3 + len(observation))
            assert sample.env_reward == 0.75 and sample.reward == 0.75
            assert sample.finish_reason == "stop"
        # the second call continued the first: its request carried the first reply and what came between
        second = [q for q in engine.requests if q.prefix_ids]
        assert {q.prefix_ids for q in second} == {(3, 3, EOS, *observation)}
        assert (stats.calls, stats.completions, stats.sampled, stats.unused, stats.failed) == (4, 4, 4, 0, 0)

    run(main)


def test_a_call_that_does_not_continue_the_last_starts_a_branch_and_the_last_branch_is_the_sample() -> None:
    async def agent(client: DirectClient, row: dict[str, Any]) -> float:
        await client.call([user("scratch")])  # a side question: not continued
        [answer] = await client.call([user(row["prompt"])])
        return 1.0 if answer.token_ids else 0.0

    async def main(holder: dict[str, Any]) -> None:
        engine = RecordingEngine(lengths=turn_lengths(3))
        async with make_rollouter(
            engine, group_size=2, max_inflight=2, serving=SERVING, agents=agents(agent, holder), reward_fn=env_reward
        ) as (r, _):
            holder["rollouter"] = r
            [group] = await r.collect(1)
            stats = r.served.statistics()
            log = r.served.log()
        assert group.prompt_ids == tuple(encode("0+0="))
        assert all(s.token_ids == (3, 3, EOS) and s.mask == (1, 1, 1) for s in group.samples)
        assert (stats.sampled, stats.unused) == (2, 2)
        assert sorted(call.fate for call in log) == ["sampled", "sampled", "unused", "unused"]

    run(main)


def test_episodes_whose_first_prompts_differ_share_the_common_start_and_keep_the_rest_masked() -> None:
    async def agent(client: DirectClient, row: dict[str, Any]) -> float:
        index = int(client.episode.split("-")[1])  # "prompt-index-random"
        await client.call([user(row["prompt"] + "x" * index)])
        return 1.0

    async def main(holder: dict[str, Any]) -> None:
        engine = RecordingEngine(lengths=turn_lengths(2))
        async with make_rollouter(
            engine, group_size=3, max_inflight=3, serving=SERVING, agents=agents(agent, holder), reward_fn=env_reward
        ) as (r, _):
            holder["rollouter"] = r
            [group] = await r.collect(1)
        assert group.prompt_ids == tuple(encode("0+0="))
        lengths = sorted(len(s.token_ids) for s in group.samples)
        assert lengths == [2, 3, 4]  # 0, 1 and 2 masked prompt tokens before the reply
        for sample in group.samples:
            extra = len(sample.token_ids) - 2
            assert sample.mask == (*[0] * extra, 1, 1) and sample.turns == ((0, extra) if extra else (0,))

    run(main)


def test_n_choices_in_an_episode_follow_the_one_the_agent_continues() -> None:
    async def agent(client: DirectClient, row: dict[str, Any]) -> float:
        choices = await client.call([user(row["prompt"])], n=2)
        await client.call([user(row["prompt"]), reply(choices[1]), user("and?")])
        return 1.0

    async def main(holder: dict[str, Any]) -> None:
        engine = RecordingEngine(lengths=turn_lengths(2, 3))
        async with make_rollouter(
            engine, group_size=2, max_inflight=2, serving=SERVING, agents=agents(agent, holder), reward_fn=env_reward
        ) as (r, _):
            holder["rollouter"] = r
            [group] = await r.collect(1)
            stats = r.served.statistics()
        for sample in group.samples:
            assert sample.mask.count(1) == 2 + 3  # one reply of the first call, then the second's
        assert (stats.completions, stats.sampled, stats.unused) == (6, 4, 2)
        # the two choices of a call are drawn with seeds of their own
        firsts = [q for q in engine.requests if not q.prefix_ids]
        assert len({q.seed for q in firsts}) == len(firsts) == 4

    run(main)


@pytest.mark.parametrize(
    ("returned", "expected"), [([0.25, 0.5], 0.75), ([0.25, None], 0.25), (True, 1.0), (None, 0.0)]
)
def test_an_agent_returns_a_number_a_list_of_turn_rewards_or_none(returned: Any, expected: float) -> None:
    async def main(holder: dict[str, Any]) -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(
            engine,
            group_size=2,
            max_inflight=2,
            serving=SERVING,
            agents=agents(two_call_agent(returned), holder),
            reward_fn=env_reward,
        ) as (r, _):
            holder["rollouter"] = r
            [group] = await r.collect(1)
        assert [s.reward for s in group.samples] == [expected] * 2

    run(main)


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        (
            "raises",
            [
                "the agent 'test_an_agent_that_fails_fails_its_group_with_a_clear_error.<locals>.agent' raised",
                "RuntimeError('the tool crashed')",
                "prompt 0",
            ],
        ),
        ("bad", ["the agent", "returned 'yes'", "a list of turn rewards"]),
        ("nan", ["returned nan", "finite"]),
        ("no call", ["made no call to the endpoint", "prompt 0", "client.chat.completions.create"]),
    ],
)
def test_an_agent_that_fails_fails_its_group_with_a_clear_error(kind: str, words: list[str]) -> None:
    async def agent(client: DirectClient, row: dict[str, Any]) -> Any:
        if kind != "no call":
            await client.call([user(row["prompt"])])
        if kind == "raises":
            raise RuntimeError("the tool crashed")
        return {"bad": "yes", "nan": float("nan"), "no call": 1.0}[kind]

    async def main(holder: dict[str, Any]) -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(
            engine, group_size=2, max_inflight=2, serving=SERVING, agents=agents(agent, holder), reward_fn=env_reward
        ) as (r, _):
            holder["rollouter"] = r
            with pytest.raises(rlnb.RolloutError) as info:
                await r.collect(1)
            stats = r.served.statistics()
        for word in words:
            assert word in str(info.value), (word, str(info.value))
        assert stats.sampled == 0 and stats.failed == (0 if kind == "no call" else 2)
        assert stats.episodes_open == 0

    run(main)


def test_an_agent_past_its_timeout_is_cancelled_and_named() -> None:
    cancelled = threading.Event()

    async def agent(client: DirectClient, row: dict[str, Any]) -> float:
        await client.call([user(row["prompt"])])
        try:
            await asyncio.sleep(60)
        finally:
            cancelled.set()
        return 1.0

    async def main(holder: dict[str, Any]) -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(
            engine,
            group_size=2,
            max_inflight=2,
            serving=SERVING,
            agents=agents(agent, holder, timeout=0.3),
            reward_fn=env_reward,
        ) as (r, _):
            holder["rollouter"] = r
            with pytest.raises(rlnb.RolloutError, match=r"Task.agent_timeout=0.3 s .*it was cancelled"):
                await r.collect(1)
            assert cancelled.wait(5)
            assert r.served.statistics().failed == 2

    run(main)


def test_a_plain_def_agent_runs_on_a_thread_of_its_own() -> None:
    threads: set[str] = set()

    def agent(client: DirectClient, row: dict[str, Any]) -> float:
        threads.add(threading.current_thread().name)
        [choice] = client.call_sync([user(row["prompt"])])
        return float(len(choice.token_ids))

    async def main(holder: dict[str, Any]) -> None:
        engine = RecordingEngine(lengths=3)
        async with make_rollouter(
            engine, group_size=2, max_inflight=2, serving=SERVING, agents=agents(agent, holder), reward_fn=env_reward
        ) as (r, _):
            holder["rollouter"] = r
            [group] = await r.collect(1)
        assert [s.reward for s in group.samples] == [3.0, 3.0]
        assert threads and all(name.startswith("rlnb-agent-") for name in threads)

    run(main)


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_every_pause_mode_settles_with_episodes_mid_way_and_loses_nothing(mode: str) -> None:
    # Episodes at different points (a reply generating, the agent between two calls,
    # done) when the pause lands; KEEP and ABORT hold their calls, WAIT lets them end.
    gate = threading.Event()

    async def agent(client: DirectClient, row: dict[str, Any]) -> float:
        messages = [user(row["prompt"])]
        [first] = await client.call(messages)
        if int(row["prompt_id"]) % 2:
            await asyncio.get_running_loop().run_in_executor(None, gate.wait, 10)  # the agent's own work
        messages += [reply(first), user("go on")]
        await client.call(messages)
        return 1.0

    async def main(holder: dict[str, Any]) -> None:
        engine = RecordingEngine(lengths=turn_lengths(6, 8), token_delay=0.003)
        async with make_rollouter(
            engine,
            group_size=2,
            max_inflight=8,
            max_policy_lag=None,
            buffer_capacity=64,
            serving=SERVING,
            agents=agents(two_call_agent() if mode == "keep" else agent, holder),
            reward_fn=env_reward,
        ) as (r, _):
            holder["rollouter"] = r
            await r.start()
            await until(
                lambda: (
                    r.statistics().in_flight >= 6
                    and r.served.statistics().calls >= 4
                    and engine.statistics().running > 0
                ),
                "episodes mid-way, replies generating",
            )
            await r.pause(mode)
            if mode == "wait":
                gate.set()  # the agents between calls go on: a WAIT drain lets their calls through
                await r.wait_paused(timeout=10)
                s = r.statistics()
                assert s.in_flight == 0 and s.kept_partial == 0 and r.served.statistics().episodes_open == 0, s
            else:
                calls = r.served.statistics().calls
                await asyncio.sleep(0.1)
                assert engine.statistics().running == 0 or mode == "keep"
                gate.set()
                await asyncio.sleep(0.05)
                assert r.served.statistics().completions <= calls  # nothing new is served while paused
            s = r.statistics()
            assert s.failed == 0 and r.served.statistics().failed == 0, s
            assert_counts_add_up(s)
            await r.resume()
            before = r.statistics().groups_finished
            await until(lambda: r.statistics().groups_finished >= before + 4, "rollouts to go on after resume")
            await r.stop()
            await until(lambda: r.statistics().in_flight == 0, "the groups in flight to end")
            finished = r.statistics().finished
            stats = r.served.statistics()
        assert r.statistics().failed == 0 and stats.failed == 0 and stats.unused == 0 and stats.pending == 0
        assert stats.sampled == stats.completions == 2 * finished  # two calls an episode: every one on its sample
        if mode == "abort":
            assert r.statistics().continuations > 0  # replies cut by the pause were continued

    run(main)


def test_a_weight_sync_between_two_calls_shows_in_the_versions_of_each_reply() -> None:
    between = asyncio.Event()
    synced = threading.Event()

    async def agent(client: DirectClient, row: dict[str, Any]) -> float:
        messages = [user(row["prompt"])]
        [first] = await client.call(messages)
        holder_loop.call_soon_threadsafe(between.set)
        await asyncio.get_running_loop().run_in_executor(None, synced.wait, 10)
        await client.call([*messages, reply(first), user("go on")])
        return 1.0

    async def main(holder: dict[str, Any]) -> None:
        nonlocal holder_loop
        holder_loop = holder["loop"]
        engine = RecordingEngine(lengths=turn_lengths(2, 3))
        async with make_rollouter(
            engine, group_size=2, max_inflight=2, serving=SERVING, agents=agents(agent, holder), reward_fn=env_reward
        ) as (r, _):
            holder["rollouter"] = r
            collect = asyncio.create_task(r.collect(1))
            await asyncio.wait_for(between.wait(), 5)
            await r.sync_weights({"w": 1}, 1)
            synced.set()
            [group] = await asyncio.wait_for(collect, 10)
        for sample in group.samples:
            policy = [v for v, m in zip(sample.versions, sample.mask, strict=True) if m]
            assert policy[:2] == [0, 0] and set(policy[2:]) == {1}

    holder_loop: Any = None
    run(main)


def test_an_evaluation_episode_is_greedy_and_counted_apart() -> None:
    async def main(holder: dict[str, Any]) -> None:
        engine = RecordingEngine(lengths=turn_lengths(2, 3))
        async with make_rollouter(
            engine,
            group_size=2,
            max_inflight=2,
            serving=SERVING,
            agents=agents(two_call_agent(0.5), holder),
            reward_fn=env_reward,
        ) as (r, _):
            holder["rollouter"] = r
            results = await r.evaluate([rlnb.rollout.PromptItem(7, "7+7=", "14")], max_new_tokens=10**6)
            stats = r.served.statistics()
        assert [reward for _, reward in results] == [0.5]
        assert {q.sampling.temperature for q in engine.requests} == {0.0}
        assert (stats.evaluated, stats.sampled) == (2, 0)

    run(main)


def test_closing_with_episodes_in_flight_cancels_their_agents_and_leaves_no_thread() -> None:
    cancelled: list[str] = []

    async def agent(client: DirectClient, row: dict[str, Any]) -> float:
        try:
            await client.call([user(row["prompt"])])
            await asyncio.sleep(60)
        finally:
            cancelled.append(client.episode)
        return 1.0

    async def main(holder: dict[str, Any]) -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(
            engine,
            group_size=2,
            max_inflight=4,
            max_policy_lag=None,
            serving=SERVING,
            agents=agents(agent, holder),
            reward_fn=env_reward,
        ) as (r, _):
            holder["rollouter"] = r
            await r.start()
            await until(lambda: r.served.statistics().calls >= 4, "episodes waiting in their agents")
        assert len(cancelled) >= 4
        assert not [t.name for t in threading.enumerate() if t.name.startswith("rlnb-agent")]

    run(main)


def test_a_call_naming_an_episode_that_is_not_running_is_refused() -> None:
    async def main(holder: dict[str, Any]) -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(engine, group_size=2, max_inflight=2, serving=SERVING) as (r, _):
            with pytest.raises(rlnb.InvalidValueError, match="episode 'nope' is not running"):
                await r.served.serve(ServedRequest(messages=(user("hi"),), episode="nope"))
            [choice] = await r.served.serve(ServedRequest(messages=(user("hi"),)))  # outside any episode
            assert choice.token_ids[-1] == EOS and r.served.statistics().outside == 1

    run(main)


def test_a_failed_group_of_agents_in_the_background_is_reported_and_others_go_on() -> None:
    async def agent(client: DirectClient, row: dict[str, Any]) -> float:
        await client.call([user(row["prompt"])])
        if row["prompt_id"] == 1:
            raise RuntimeError("flaky tool")
        return 1.0

    async def main(holder: dict[str, Any]) -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(
            engine,
            group_size=2,
            max_inflight=4,
            max_policy_lag=None,
            serving=SERVING,
            agents=agents(agent, holder),
            reward_fn=env_reward,
        ) as (r, buffer):
            holder["rollouter"] = r
            await r.start()
            error = await next_pending_error(r)
            assert "flaky tool" in str(error) and "prompt 1" in str(error)
            await until(lambda: buffer.size() + buffer.held() >= 1, "the other groups to reach the buffer")

    run(main)

"""Conversations: samples whose turns alternate between the policy (a scripted
FakeEngine) and an environment, with loss masks, per-token versions across a weight
sync between turns, pauses in the middle of a model turn and of a tool call, and
environments that fail.

Every test runs its own event loop with ``asyncio.run`` and closes what it made.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

import rlnb
from rlnb.engines import GenerateRequest
from rlnb.envs import Turn
from rlnb.rollout import Conversations
from tests.helpers import assert_counts_add_up, cause_chain
from tests.rollout.helpers import (
    EOS,
    SLOW,
    RecordingEngine,
    encode,
    make_rollouter,
    next_pending_error,
    until,
)

OBS = 7  # every observation token, so a scripted engine can find where a turn began


def observe(observation: Any) -> list[int]:
    text = observation if isinstance(observation, str) else " ".join(m["content"] for m in observation)
    if "~" in text:
        raise ValueError("cannot encode '~'")
    return [OBS] * len(text)


def turn_lengths(*lengths: int) -> Callable[[GenerateRequest], int]:
    """A FakeEngine ``lengths`` giving policy turn k ``lengths[k]`` tokens (EOS
    included), however often a pause cuts it: a turn begins after the last observation."""

    def total(request: GenerateRequest) -> int:
        prefix = request.prefix_ids
        start = max((i + 1 for i, t in enumerate(prefix) if t == OBS), default=0)
        turn = sum(1 for i, t in enumerate(prefix) if t == OBS and (i + 1 == len(prefix) or prefix[i + 1] != OBS))
        return start + lengths[min(turn, len(lengths) - 1)]

    return total


class Script:
    """Environments that answer each turn with ``replies[k]`` (a Turn) and log what
    they saw; ``gate``, when given, holds every step until it is set (a tool call in flight)."""

    def __init__(self, *replies: Turn, gate: threading.Event | None = None, fail: str | None = None) -> None:
        self.replies = replies
        self.gate = gate
        self.fail = fail
        self.made = 0
        self.closed = 0
        self.steps: list[str] = []
        self.stepping = threading.Event()
        self.lock = threading.Lock()

    def __call__(self) -> Any:
        script = self
        with self.lock:
            self.made += 1

        class Env:
            turns = 0

            def reset(self, row: dict[str, Any]) -> None:
                if script.fail == "reset":
                    raise RuntimeError("no such level")
                return None

            def step(self, completion: str) -> Turn:
                script.stepping.set()
                if script.gate is not None:
                    assert script.gate.wait(10), "the test never opened the gate"
                if script.fail == "step":
                    raise RuntimeError("the tool crashed")
                with script.lock:
                    script.steps.append(completion)
                reply = script.replies[min(self.turns, len(script.replies) - 1)]
                self.turns += 1
                return reply

            def close(self) -> None:
                with script.lock:
                    script.closed += 1

        return Env()


def conversations(env: Callable[[], Any], max_turns: int = 3) -> Conversations:
    return Conversations(
        env=env,
        max_turns=max_turns,
        encode_prompt=lambda prompt, tools: encode(prompt),
        encode_observation=observe,
    )


def test_a_conversation_holds_policy_and_environment_tokens_with_a_mask_and_turns() -> None:
    script = Script(Turn("ab", reward=0.25), Turn(None, reward=0.5, done=True))
    seen: list[tuple[str, float | None]] = []

    def reward(item: Any, completion: str, env_reward: float | None = None) -> float:
        seen.append((completion, env_reward))
        return 1.0

    async def main() -> None:
        engine = RecordingEngine(lengths=turn_lengths(3, 4))
        async with make_rollouter(
            engine, group_size=2, max_inflight=2, conversations=conversations(script), reward_fn=reward
        ) as (r, _):
            [group] = await r.collect(1)
        for sample in group.samples:
            assert sample.token_ids == (3, 3, EOS, OBS, OBS, 3, 3, 3, EOS)
            assert sample.mask == (1, 1, 1, 0, 0, 1, 1, 1, 1)
            assert sample.turns == (0, 5)
            assert sample.logprobs[3:5] == (0.0, 0.0) and -1.0 in sample.logprobs
            assert sample.env_reward == 0.75 and sample.reward == 1.0
            assert sample.finish_reason == "stop"
        # the second turn's request carries the first turn and the observation as its prefix
        second = [q for q in engine.requests if q.prefix_ids]
        assert {q.prefix_ids for q in second} == {(3, 3, EOS, OBS, OBS)}
        assert all(q.request_id.endswith(".t1") for q in second)
        assert script.steps == ["3 3 2", "3 3 2", "3 3 3 2", "3 3 3 2"]  # each turn's own text
        assert seen == [("3 3 3 2", 0.75)] * 2  # the reward scores the last turn, with the env's reward
        assert (script.made, script.closed) == (2, 2)

    asyncio.run(main())


def test_a_conversation_ends_at_max_turns_and_where_the_context_is_full() -> None:
    script = Script(Turn("abc"))  # never done

    async def main() -> None:
        engine = RecordingEngine(lengths=turn_lengths(2))
        async with make_rollouter(engine, group_size=1, max_inflight=1, conversations=conversations(script, 3)) as (
            r,
            _,
        ):
            [group] = await r.collect(1)
            [sample] = group.samples
            assert sample.turns == (0, 5, 10) and len(sample.token_ids) == 12  # 3 turns, 2 observations
            assert sample.finish_reason == "stop"
        # a context of prompt + 8 tokens: room for the first turn and one observation, not a second turn
        engine = RecordingEngine(lengths=turn_lengths(2))
        prompt = len(encode("0+0="))
        async with make_rollouter(
            engine, group_size=1, max_inflight=1, conversations=conversations(script, 3), max_context=prompt + 5
        ) as (r, _):
            [group] = await r.collect(1)
            [sample] = group.samples
            assert sample.token_ids == (3, EOS) and sample.finish_reason == "length"
        assert script.made == script.closed == 2

    asyncio.run(main())


def test_versions_stay_per_token_across_a_weight_sync_between_turns() -> None:
    gate = threading.Event()
    script = Script(Turn("ab"), Turn(done=True), gate=gate)

    async def main() -> None:
        engine = RecordingEngine(lengths=turn_lengths(3))
        async with make_rollouter(engine, group_size=1, max_inflight=1, conversations=conversations(script)) as (r, _):
            task = asyncio.create_task(r.collect(1))
            await until(script.stepping.is_set, "the environment's first step")
            await r.sync_weights({}, 1)  # between the turns, while the tool call runs
            gate.set()
            [group] = await task
        [sample] = group.samples
        assert sample.versions == (0, 0, 0, 0, 0, 1, 1, 1)
        assert sample.mask == (1, 1, 1, 0, 0, 1, 1, 1)
        assert sample.min_version == 0

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_a_pause_in_the_middle_of_a_model_turn_keeps_the_finished_turns_and_continues(mode: str) -> None:
    script = Script(Turn("ab"), Turn(done=True))

    async def main() -> None:
        engine = RecordingEngine(lengths=turn_lengths(2, 20), token_delay=SLOW)
        async with make_rollouter(engine, group_size=2, max_inflight=2, conversations=conversations(script)) as (r, _):
            task = asyncio.create_task(r.collect(1))
            await until(lambda: len([q for q in engine.requests if q.prefix_ids]) == 2, "both second turns")
            await asyncio.sleep(3 * SLOW)  # a few tokens into the long second turn
            await r.pause(mode)
            s = r.statistics()
            assert s.state == "paused" and s.failed == 0
            assert (s.kept_partial == 2) if mode == "abort" else (s.in_flight == 2)
            assert_counts_add_up(s)
            await r.resume()
            [group] = await task
        for sample in group.samples:
            assert sample.token_ids == (3, EOS, OBS, OBS, *[3] * 19, EOS)  # nothing lost, nothing twice
            assert sample.mask == (1, 1, 0, 0, *[1] * 20)
            assert sample.turns == (0, 4)
            if mode == "abort":
                assert sample.resumed == 1 and 4 < sample.continued_at[0] < 24
        assert sorted(script.steps) == ["3 2"] * 2 + [" ".join(["3"] * 19 + ["2"])] * 2  # each turn once, whole

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_a_pause_in_the_middle_of_a_tool_call_lets_it_finish_and_holds_the_next_turn(mode: str) -> None:
    gate = threading.Event()
    script = Script(Turn("ab"), Turn(done=True), gate=gate)

    async def main() -> None:
        engine = RecordingEngine(lengths=turn_lengths(2, 3))
        async with make_rollouter(engine, group_size=1, max_inflight=1, conversations=conversations(script)) as (r, _):
            task = asyncio.create_task(r.collect(1))
            await until(script.stepping.is_set, "the tool call")
            await asyncio.wait_for(r.pause(mode), 5)  # returns at once: the tool call is not waited for
            assert r.statistics().state == "paused"
            gate.set()  # the tool call returns while paused: its observation is kept
            await until(lambda: len(script.steps) == 1, "the tool call to return")
            await asyncio.sleep(0.05)
            assert not [q for q in engine.requests if q.prefix_ids]  # the next turn waits for resume
            assert not task.done()
            await r.resume()
            [group] = await task
        [sample] = group.samples
        assert sample.token_ids == (3, EOS, OBS, OBS, 3, 3, EOS)
        assert sample.mask == (1, 1, 0, 0, 1, 1, 1)

    asyncio.run(main())


def test_a_wait_pause_lets_a_conversation_in_a_tool_call_run_to_its_end() -> None:
    # The drain waits for the tool call, then lets the next policy turn go to the
    # engine: a WAIT pause ends every conversation in flight, not only its current
    # call (it used to hold the next turn for a resume, and so waited for itself).
    gate = threading.Event()
    script = Script(Turn("ab"), Turn(done=True), gate=gate)

    async def main() -> None:
        engine = RecordingEngine(lengths=turn_lengths(2, 3))
        async with make_rollouter(engine, group_size=1, max_inflight=1, conversations=conversations(script)) as (r, _):
            task = asyncio.create_task(r.collect(1))
            await until(script.stepping.is_set, "the tool call")
            await r.pause("wait")
            waiting = asyncio.create_task(r.wait_paused(timeout=5))
            await asyncio.sleep(0.05)
            assert not waiting.done()  # the drain waits for the tool call to return
            gate.set()
            await waiting
            s = r.statistics()
            assert s.state == "paused" and s.in_flight == 0 and s.finished == 1, s
            assert engine.statistics().running == 0
            # the conversation ended during the drain: its collect() returns while paused
            [group] = await asyncio.wait_for(task, 5)
        assert group.samples[0].turns == (0, 4)
        assert group.samples[0].finish_reason == "stop"

    asyncio.run(main())


@pytest.mark.parametrize("dispatch", ["background", "collect"])
def test_a_wait_pause_settles_while_many_conversations_are_mid_way(dispatch: str) -> None:
    # Notebook 10's case: groups whose samples are at different turns (generating,
    # waiting for a tool, about to send their next turn, finished) when a
    # WAIT pause lands. It must settle with nothing in flight, every group ended
    # (in the buffer, or returned to collect()), and resume must go on from there.
    script = Script(Turn("ab"), Turn("abc"), Turn(done=True))

    async def main() -> None:
        engine = RecordingEngine(lengths=turn_lengths(2, 3, 4), token_delay=0.002)
        async with make_rollouter(
            engine,
            group_size=4,
            max_inflight=16,
            max_policy_lag=None,
            buffer_capacity=64,
            conversations=conversations(script),
        ) as (r, buffer):
            if dispatch == "background":
                await r.start()
                collect = None
            else:
                collect = asyncio.create_task(r.collect(4))
            await until(lambda: r.statistics().in_flight >= 12 and script.steps, "conversations mid-way")
            await r.pause("wait")
            await r.wait_paused(timeout=10)
            s = r.statistics()
            assert s.state == "paused" and s.in_flight == 0 and s.queued == 0 and s.kept_partial == 0, s
            assert s.failed == 0 and s.groups_finished == s.groups_dispatched, s
            assert engine.statistics().running == 0
            assert_counts_add_up(s)
            if collect is not None:
                assert len(await asyncio.wait_for(collect, 5)) == 4  # returns while paused
            else:
                assert buffer.size() + buffer.held() == s.groups_dispatched
            await r.resume()
            if dispatch == "background":
                before = s.groups_finished
                await until(lambda: r.statistics().groups_finished > before, "rollouts to go on after resume")
                await r.stop()
        assert script.made == script.closed  # every environment closed, drained or not

    asyncio.run(main())


@pytest.mark.parametrize(
    ("fail", "words"),
    [
        ("reset", ["environment's reset raised", "no such level"]),
        ("step", ["environment's step raised", "turn 1", "the tool crashed"]),
    ],
)
def test_an_environment_that_raises_fails_its_group_and_is_closed(fail: str, words: list[str]) -> None:
    script = Script(Turn("ab"), fail=fail)

    async def main() -> None:
        engine = RecordingEngine(lengths=turn_lengths(2))
        async with make_rollouter(engine, group_size=2, max_inflight=2, conversations=conversations(script)) as (r, _):
            with pytest.raises(rlnb.RolloutError) as caught:
                await r.collect(1)
            text = " ".join(str(e) for e in cause_chain(caught.value))
            assert all(w in text for w in words), text
            s = r.statistics()
            assert (s.groups_failed, s.in_flight) == (1, 0)
            assert_counts_add_up(s)
        assert script.made == script.closed

    asyncio.run(main())


@pytest.mark.parametrize(
    ("reply", "words"),
    [
        ("not a turn", ["Env.step() after turn 1 returned 'not a turn'", "rlnb.envs.Turn"]),
        (Turn(observation="a~b"), ["cannot be encoded", "'~'", "Task.alphabet"]),
        (Turn(observation=3), ["an observation must be text"]),  # type: ignore[arg-type]
        (Turn(reward=float("nan")), ["reward=nan", "finite number"]),
    ],
)
def test_a_bad_answer_from_an_environment_is_a_clear_error(reply: Any, words: list[str]) -> None:
    script = Script(reply)

    async def main() -> None:
        engine = RecordingEngine(lengths=turn_lengths(2))
        async with make_rollouter(engine, group_size=1, max_inflight=1, conversations=conversations(script)) as (r, _):
            with pytest.raises(rlnb.RolloutError) as caught:
                await r.collect(1)
        text = " ".join(str(e) for e in cause_chain(caught.value))
        assert all(w in text for w in words), text
        assert script.made == script.closed == 1

    asyncio.run(main())


def test_a_failing_environment_loses_no_other_group_in_the_background() -> None:
    class Picky:
        def __init__(self) -> None:
            self.row: dict[str, Any] = {}

        def reset(self, row: dict[str, Any]) -> None:
            self.row = row

        def step(self, completion: str) -> Turn:
            if self.row["prompt_id"] == 1:
                raise RuntimeError("prompt 1 breaks the tool")
            return Turn(done=True)

    async def main() -> None:
        engine = RecordingEngine(lengths=turn_lengths(2))
        async with make_rollouter(
            engine, group_size=2, max_inflight=6, conversations=conversations(Picky), max_policy_lag=None
        ) as (r, buffer):
            await r.start()
            await until(lambda: buffer.statistics().put >= 2, "two good groups in the buffer")
            error = await next_pending_error(r)
            assert "prompt 1 breaks the tool" in " ".join(str(e) for e in cause_chain(error))
            assert r.statistics().groups_failed == 1
            assert 1 not in [g.prompt_id for g in buffer.get_nowait(buffer.statistics().sizes["train"])]

    asyncio.run(main())


def test_closing_during_a_tool_call_closes_every_environment() -> None:
    gate = threading.Event()
    script = Script(Turn("ab"), gate=gate)

    async def main() -> None:
        engine = RecordingEngine(lengths=turn_lengths(2))
        async with make_rollouter(engine, group_size=2, max_inflight=2, conversations=conversations(script)) as (r, _):
            task = asyncio.create_task(r.collect(1))
            await until(script.stepping.is_set, "the tool call")
            gate.set()  # the abandoned call may return; close must not wait for it either way
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await until(lambda: script.closed == script.made == 2, "both environments closed")

    asyncio.run(main())


class Held:
    """Environments whose ``reset`` (or ``close``) waits for ``gate``: a group cancelled
    while they are made (or closed) must still close every one."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.made = self.closed = 0
        self.lock = threading.Lock()

    def __call__(self) -> Any:
        held = self
        with self.lock:
            self.made += 1

        class Env:
            def reset(self, row: dict[str, Any]) -> None:
                if held.where == "reset":
                    held.entered.set()
                    assert held.gate.wait(10), "the test never opened the gate"

            def step(self, completion: str) -> Turn:
                return Turn(done=True)

            def close(self) -> None:
                if held.where == "close" and not held.entered.is_set():  # the first: the others queue behind it
                    held.entered.set()
                    assert held.gate.wait(10), "the test never opened the gate"
                with held.lock:
                    held.closed += 1

        return Env()


@pytest.mark.parametrize("where", ["reset", "close"])
def test_a_group_cancelled_while_its_environments_open_or_close_closes_them_all(where: str) -> None:
    # Cancelled (Ctrl-C, stop, close) while a reset ran on the reward pool, a group
    # used to drop the environments the reset made; cancelled while its close waited
    # for the pool's thread, it dropped the close. Either way every one made is closed.
    held = Held(where)
    groups = 1 if where == "reset" else 2

    async def main() -> None:
        engine = RecordingEngine(lengths=turn_lengths(2))
        async with make_rollouter(engine, group_size=2, max_inflight=2 * groups, conversations=conversations(held)) as (
            r,
            _,
        ):
            task = asyncio.create_task(r.collect(groups))
            await until(held.entered.is_set, f"the environment's {where}")
            task.cancel()
            await asyncio.sleep(0.01)
            held.gate.set()
            try:
                await task
            except asyncio.CancelledError:
                pass
        await until(lambda: held.closed == held.made == 2 * groups, "every environment closed")

    asyncio.run(main())


class Concurrency:
    """Environments whose step takes ``seconds`` and that record how many steps ran at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.lock = threading.Lock()
        self.now = self.most = 0

    def __call__(self) -> Any:
        seen = self

        class Env:
            def reset(self, row: dict[str, Any]) -> None:
                return None

            def step(self, completion: str) -> Turn:
                with seen.lock:
                    seen.now += 1
                    seen.most = max(seen.most, seen.now)
                try:
                    threading.Event().wait(seen.seconds)
                finally:
                    with seen.lock:
                        seen.now -= 1
                return Turn(done=True)

        return Env()


@pytest.mark.parametrize("workers", [1, 8])
def test_environment_calls_run_env_workers_at_once_and_the_queue_is_counted(workers: int) -> None:
    # A slow tool used to be called one sample at a time (on the reward's single
    # thread): 8 samples x 0.2 s took 1.6 s a turn, and nothing said why.
    tools = Concurrency(0.2)

    async def main() -> None:
        engine = RecordingEngine(lengths=turn_lengths(2, 2))
        conv = conversations(tools, 2)
        async with make_rollouter(engine, group_size=8, max_inflight=8, env_workers=workers, conversations=conv) as (
            r,
            _,
        ):
            task = asyncio.create_task(r.collect(1))
            queued = 0
            while not task.done():
                queued = max(queued, r.statistics().env_calls_queued)
                await asyncio.sleep(0.01)
            [group] = task.result()
        assert len(group.samples) == 8 and all(s.turns == (0,) for s in group.samples)
        if workers == 1:
            assert tools.most == 1 and queued >= 5, (tools.most, queued)
        else:
            assert tools.most >= 4, tools.most

    asyncio.run(main())


def test_env_workers_must_be_a_positive_int() -> None:
    with pytest.raises(rlnb.ConfigError, match=r"RolloutConfig\.env_workers=0 is invalid"):
        rlnb.RolloutConfig(env_workers=0)
    assert rlnb.RolloutConfig().env_workers == 8

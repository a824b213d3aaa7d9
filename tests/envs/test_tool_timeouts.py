"""A ToolEnv's tools are bounded by ``reward_timeout`` as rewards and environments are.

An ``async def`` tool runs as a task the call's timeout cancels (its loop closed),
and a tool marked ``rlnb.rewards.isolated`` runs in a worker process the timeout
kills, even while it holds the GIL; either fails its sample naming the step and
the turn that called it. Every test runs under the suite's leak check: no thread,
FD, loop or process is left.
"""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import pytest

import rlnb
from rlnb.buffer import ReplayBuffer
from rlnb.engines import FakeEngine
from rlnb.envs import ToolEnv, tool_schema
from rlnb.rewards import Cancelled, Scope, isolated, scope_of
from rlnb.rollout import Conversations, Rollouter
from tests.helpers import Ticker
from tests.rollout.helpers import NO_LENGTH_CUT, constant_reward, encode, prompt_stream, settle

GIL_HOLDING_TEXT = "a" * 40 + "c"  # 2^40 steps of backtracking for (a+)+b


async def hang(n: int) -> int:
    """Never returns."""
    await asyncio.Event().wait()
    return n


@isolated
def matches(text: str) -> bool:
    """Whether ``text`` is some a's and a b.

    Args:
        text: the text to match.
    """
    return re.fullmatch(r"(a+)+b", text) is not None


def roll_out_calling(env: ToolEnv, turn: str) -> rlnb.RolloutError:
    """Roll out two groups of four whose every policy turn is ``turn``, with
    ``reward_timeout=0.5``; the RolloutError that fails them."""
    convs = Conversations(
        env=env,
        max_turns=3,
        encode_prompt=lambda prompt, tools: encode(prompt),
        encode_observation=lambda observation: [7],
    )

    async def main() -> rlnb.RolloutError:
        buffer = ReplayBuffer(rlnb.BufferConfig(capacity=64))
        rollouter = Rollouter(
            FakeEngine(lengths=lambda request: 3),
            rlnb.RolloutConfig(group_size=4, max_inflight=8, reward_timeout=0.5),
            sampling=NO_LENGTH_CUT,
            prompts=prompt_stream(),
            encode=lambda text: encode(str(text)),
            decode=lambda ids: turn,
            reward_fn=constant_reward,
            buffer=buffer,
            seed=0,
            data=rlnb.DataConfig(),
            max_context=None,
            conversations=convs,
        )
        try:
            with pytest.raises(rlnb.RolloutError) as info:
                await rollouter.collect(2)
            assert (rollouter.statistics().failed, rollouter.statistics().groups_failed) == (8, 2)
            await settle()
            rollouter.raise_pending()  # nothing else failed (closing the episodes, say)
            return info.value
        finally:
            await rollouter.aclose()
            buffer.close()

    return asyncio.run(main())


def test_an_async_tool_that_never_returns_is_cancelled_at_the_timeout_and_fails_its_sample_naming_it() -> None:
    error = roll_out_calling(ToolEnv([hang]), "hang(1)")
    message = str(error)
    assert "the environment's step did not return within reward_timeout=0.5 s" in message
    assert "'hang(1)'" in message  # the turn that called the tool
    assert "it was stopped" in message or "ran past the timeout first" in message
    # Before: asyncio.run held the reward thread (and its loop's FDs) for good; the
    # leak check sees none left.


def test_an_isolated_tool_that_holds_the_gil_is_killed_at_the_timeout_while_other_threads_run(
    loader_workers: set[int],
) -> None:
    env = ToolEnv([matches], syntax="json")
    with Ticker() as ticker:
        error = roll_out_calling(env, f'{{"name": "matches", "arguments": {{"text": "{GIL_HOLDING_TEXT}"}}}}')
    assert "the environment's step did not return within reward_timeout=0.5 s" in str(error)
    assert "matches" in str(error)
    assert "it was stopped" in str(error) or "ran past the timeout first" in str(error)
    assert ticker.ticks >= 10  # the other thread ran all along (frozen, it would not have ticked)


def test_an_isolated_tool_has_its_own_schema_and_runs_in_the_caller_outside_a_rollout() -> None:
    # Before: "ToolEnv.tools[0]=matches: parameter 'text' has no type hint" (the wrapper's hints).
    expected = {
        "type": "function",
        "function": {
            "name": "matches",
            "description": "Whether ``text`` is some a's and a b.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string", "description": "the text to match."}},
                "required": ["text"],
            },
        },
    }
    env = ToolEnv([matches])
    assert env.tools == [expected] and tool_schema(matches) == expected
    assert env().step('matches("aab")').observation == "=True\n"
    assert env().step("matches(3)").observation == "=?\n"  # its hints check the call, as a plain tool's


def test_an_async_tool_called_where_a_loop_runs_is_cancelled_when_its_call_is_stopped() -> None:
    release = threading.Event()

    async def waits(n: int) -> int:
        while not release.is_set():  # the bound only turns a hang into a failure
            await asyncio.sleep(0.01)
        return n

    scope = Scope(None)
    outcome: list[Any] = []

    async def in_a_notebook_cell() -> None:  # a running loop: the tool runs on a thread of its own
        try:
            outcome.append(ToolEnv([waits], error_format="error: {error}\n")().step("waits(1)").observation or "")
        except BaseException as exc:
            outcome.append(exc)

    def run() -> None:
        with scope_of(scope):
            asyncio.run(in_a_notebook_cell())

    caller = threading.Thread(target=run, name="test-caller")
    caller.start()
    try:
        scope.stop()  # the call's timeout: before or while the tool runs, it is cancelled
        caller.join(10)
    finally:
        release.set()
        caller.join()
    assert len(outcome) == 1 and isinstance(outcome[0], Cancelled), outcome
    assert "tool waits() was stopped" in str(outcome[0])


def test_a_wrapped_tool_takes_the_hints_and_docstring_of_the_function_it_wraps() -> None:
    import functools

    def logged(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        return wrapper

    @logged
    def add(a: int, b: int = 1) -> int:
        """Add two integers."""
        return a + b

    schema = tool_schema(add)["function"]
    assert schema["description"] == "Add two integers."
    assert schema["parameters"]["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer"}}
    assert ToolEnv([add])().step("add(2, 3)").observation == "=5\n"

"""User code is bounded by its timeout, even when it holds the GIL or never returns.

An isolated function (``rlnb.rewards.isolated``; ``math_answer`` and
``regex_format`` are) runs in a worker process that the timeout kills; an
``async def`` reward or environment method is a task the timeout cancels; and the
first timeout fails the calls that would only wait out timeouts of their own behind
it. Every test runs under the suite's leak check: no thread, FD or process is left.
"""

from __future__ import annotations

import asyncio
import importlib.util
import pickle
import threading
from typing import Any

import pytest

import rlnb
from rlnb.data import Task, register_task
from rlnb.envs import Turn
from rlnb.envs._episode import Episode
from rlnb.rewards import isolated, math_answer, regex_format
from rlnb.rewards._isolation import Cancelled, Scope, Workers, scope_of
from rlnb.rollout import Conversations
from rlnb.rollout._reward import CallTimedOut, RewardPool
from tests.helpers import Ticker, cause_chain, small_config, wait_until
from tests.rollout.helpers import RecordingEngine, encode, make_rollouter, settle

ROWS = [{"prompt": f"{n}=", "answer": str(n)} for n in range(20)]
SIXTEEN = rlnb.RolloutConfig(group_size=4, groups_per_step=4, reward_timeout=1.0)


@isolated
def spin(completion: str, answer: Any) -> float:
    """Never returns, holding the GIL of its process."""
    while True:
        pass


@isolated
def backtracks(completion: str, answer: Any) -> float:
    """A reward whose regex backtracks for minutes, whatever the completion."""
    return regex_format(r"(a+)+b")("a" * 40 + "c", answer)


@isolated
def boxed_tower(completion: str, answer: Any) -> float:
    return math_answer(r"\boxed{2^{2^{40}}}", "1")


@isolated
def pid(completion: str, answer: Any) -> float:
    import os

    return float(os.getpid())


def call_in_pool(fn: Any, *args: Any, timeout: float) -> Any:
    async def main() -> Any:
        pool = RewardPool()
        try:
            return await pool.call(fn, *args, timeout=timeout)
        finally:
            pool.close()

    return asyncio.run(main())


# -- what holds the GIL is stopped at its timeout, and nothing waits on it meanwhile ---------


@pytest.mark.parametrize(
    ("reward", "completion"),
    [
        (regex_format(r"(a+)+b"), "a" * 40 + "c"),  # 2^40 steps of backtracking
        pytest.param(
            math_answer,
            r"\boxed{2^{2^{40}}}",
            marks=pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="needs math-verify"),
        ),
    ],
    ids=["regex_format", "math_answer"],
)
def test_a_ready_reward_that_holds_the_gil_is_killed_at_its_timeout_while_other_threads_run(
    loader_workers: set[int], reward: Any, completion: str
) -> None:
    with Ticker() as ticker, pytest.raises(CallTimedOut) as info:
        call_in_pool(reward, completion, "1", timeout=1.0)
    assert info.value.stopped  # its worker process was killed: no thread is left in it
    assert ticker.ticks >= 10  # the other thread ran all along (frozen, it would not have ticked at all)


def test_isolated_rewards_that_never_return_fail_the_step_at_the_first_timeout(loader_workers: set[int]) -> None:
    for reward in (spin, backtracks, boxed_tower):
        if reward is boxed_tower and importlib.util.find_spec("math_verify") is None:
            continue
        register_task(Task.from_records("isolated-hang", ROWS, reward=reward, eval_size=0), replace=True)
        with rlnb.Session(small_config(task="isolated-hang", rollout=SIXTEEN), name="isolated-hang") as sess:
            with Ticker() as ticker, pytest.raises(rlnb.RolloutError) as info:
                sess.rollout(4, timeout=60)  # 16 samples; before, 16 timeouts one after another
            assert "ran past the timeout first" in str(info.value) or "it was stopped" in str(info.value)
            stats = sess.statistics().rollout
            assert (stats.failed, stats.groups_failed) == (16, 4)
            assert ticker.ticks >= 10
    # The leak check sees no worker process, thread or FD left.


def test_isolated_calls_reuse_their_worker_process_and_run_in_the_caller_outside_a_rollout(
    loader_workers: set[int],
) -> None:
    import os

    workers = Workers()
    try:
        with scope_of(Scope(workers)):
            first, second = pid("c", "a"), pid("c", "a")
        assert first == second != os.getpid()
        assert workers.alive == 1
    finally:
        workers.close()
    assert workers.alive == 0
    assert pid("c", "a") == os.getpid()  # outside a pool: in the caller


def test_a_stopped_scope_kills_an_isolated_call_in_progress(loader_workers: set[int]) -> None:
    workers = Workers()
    scope = Scope(workers)
    stopper = threading.Timer(0.5, scope.stop)
    try:
        with scope_of(scope), pytest.raises(Cancelled):
            stopper.start()
            spin("c", "a")
        assert scope.interrupted and workers.alive == 0
    finally:
        stopper.cancel()
        stopper.join()
        workers.close()


def test_an_isolated_reward_that_raises_is_named_and_its_worker_traceback_kept(loader_workers: set[int]) -> None:
    register_task(Task.from_records("isolated-raises", ROWS, reward=[exact, broken], eval_size=0), replace=True)
    config = small_config(task="isolated-raises", rollout=rlnb.RolloutConfig(max_retries=0))
    with rlnb.Session(config, name="isolated-raises") as sess, pytest.raises(rlnb.RolloutError) as info:
        sess.rollout(1)
    assert "the reward function 'broken' raised ZeroDivisionError" in str(info.value)
    assert any("in the worker process" in str(e) for e in cause_chain(info.value))


def exact(completion: str, answer: Any) -> float:
    return 1.0


@isolated
def broken(completion: str, answer: Any) -> float:
    return 1 / 0


def test_isolated_keeps_the_functions_name_signature_and_pickles_by_name() -> None:
    assert spin.__name__ == "spin" and "completion" in str(__import__("inspect").signature(spin))
    assert pickle.loads(pickle.dumps(spin)) is spin
    assert pickle.loads(pickle.dumps(math_answer)) is math_answer
    again = isolated(exact)  # not the module's name for it: pickled as isolated(exact)
    assert pickle.loads(pickle.dumps(again)).__wrapped__ is exact
    assert isolated(spin) is spin
    rewards = rlnb.rewards.Rewards.of([exact, broken], None)
    assert rewards.names == ("exact", "broken")


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda c, a: 1.0, "is not a module-level name"),
        (3, "pass a function"),
    ],
)
def test_isolated_refuses_what_a_worker_process_could_not_import(fn: Any, message: str) -> None:
    def local(c: str, a: Any) -> float:
        return 1.0

    with pytest.raises(rlnb.ConfigError, match=message):
        isolated(fn)
    with pytest.raises(rlnb.ConfigError, match="<locals>"):
        isolated(local)
    local.__module__ = "__main__"
    with pytest.raises(rlnb.ConfigError, match=r"defined in __main__ \(a notebook cell"):
        isolated(local)


# -- async def: a task cancelled at the timeout ----------------------------------------------


async def never(completion: str, answer: Any) -> float:
    await asyncio.Event().wait()
    return 1.0


def test_an_async_reward_that_never_returns_is_cancelled_and_fails_the_step_at_the_first_timeout() -> None:
    register_task(Task.from_records("async-hang", ROWS, reward=never, eval_size=0), replace=True)
    with rlnb.Session(small_config(task="async-hang", rollout=SIXTEEN), name="async-hang") as sess:
        with pytest.raises(rlnb.RolloutError) as info:
            sess.rollout(4, timeout=60)
        assert "it was stopped" in str(info.value) or "ran past the timeout first" in str(info.value)
        assert (sess.statistics().rollout.failed, sess.statistics().rollout.groups_failed) == (16, 4)
    # Before: a thread and a loop (3 FDs) per sample were left after close; the leak check sees none.


def test_a_plain_reward_that_never_returns_is_called_once_not_once_per_sample() -> None:
    release = threading.Event()
    calls: list[str] = []

    def hang(completion: str, answer: Any) -> float:
        calls.append(completion)
        release.wait(60)
        return 1.0

    register_task(Task.from_records("plain-hang", ROWS, reward=hang, eval_size=0), replace=True)
    try:
        with rlnb.Session(small_config(task="plain-hang", rollout=SIXTEEN), name="plain-hang") as sess:
            with pytest.raises(rlnb.RolloutError) as info:
                sess.rollout(4, timeout=60)
            assert len(calls) == 1  # before: 16, each waiting out its second
            assert "rlnb.rewards.isolated" in str(info.value) or "ran past the timeout first" in str(info.value)
    finally:
        release.set()
    wait_until(lambda: not [t for t in threading.enumerate() if t.name.startswith("rlnb-reward-")], "its thread")


class NeverSteps:
    """An environment whose ``async def step`` never returns."""

    def reset(self, row: dict[str, Any]) -> None:
        return None

    async def step(self, completion: str) -> Turn:
        await asyncio.Event().wait()
        return Turn("never")


def test_an_async_environment_step_that_never_returns_is_cancelled_and_named_not_its_close() -> None:
    convs = Conversations(
        env=NeverSteps,
        max_turns=3,
        encode_prompt=lambda prompt, tools: encode(prompt),
        encode_observation=lambda observation: [7],
    )

    async def main() -> None:
        engine = RecordingEngine(lengths=lambda request: 3)
        rollouter = make_rollouter(engine, group_size=4, max_inflight=8, conversations=convs, reward_timeout=0.5)
        async with rollouter as (r, _):
            with pytest.raises(rlnb.RolloutError, match=r"the environment's step did not return within") as info:
                await r.collect(2)
            assert "close" not in str(info.value) and "it was stopped" in str(info.value)
            assert (r.statistics().failed, r.statistics().groups_failed) == (8, 2)
            await settle()
            r.raise_pending()  # nothing else failed: before, closing the episodes raised
            # "Cannot close a running event loop", reported at the next call

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_environment_closed_while_its_step_runs_is_closed_once_the_step_returns(mode: str) -> None:
    release, closed, started = threading.Event(), threading.Event(), threading.Event()

    class Env:
        def reset(self, row: dict[str, Any]) -> None:
            return None

        def step(self, completion: str) -> Turn:
            started.set()
            release.wait(10)
            return Turn("x")

        def close(self) -> None:
            closed.set()

    class AsyncEnv(Env):
        async def step(self, completion: str) -> Turn:  # type: ignore[override]
            started.set()
            while not release.is_set():
                await asyncio.sleep(0.01)
            return Turn("x")

    episode = Episode(Env if mode == "sync" else AsyncEnv)
    stepping = threading.Thread(target=episode.step, args=("c",), name="test-step")
    stepping.start()
    try:
        assert started.wait(10)
        episode.close()  # waits CLOSE_WAIT_S for the step, then leaves the closing to it
        assert not closed.is_set()
    finally:
        release.set()
        stepping.join(10)
    assert closed.is_set()

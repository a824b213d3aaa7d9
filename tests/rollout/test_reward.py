"""Reward functions run off the session's event loop, one call at a time, each with a timeout.

A reward is the user's code. A slow one must not freeze pause or any other call,
a hung one must fail its sample with a message that says where, and close must
not wait for it; a value that is not a finite number must be reported, never
trained on. Session tests use the real TinyEngine with a tiny random policy; the
pool's own tests run their own event loop.
"""

from __future__ import annotations

import asyncio
import fractions
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import rlnb
from rlnb.data import get_task
from rlnb.rollout._reward import CallTimedOut, PoolFull, RewardPool
from tests.helpers import assert_counts_add_up, small_config, wait_until
from tests.rollout.helpers import until

CONFIG = small_config(data=rlnb.DataConfig())
FIRST = get_task(CONFIG.task).item(CONFIG.seed, 0)  # the first prompt a session rolls out


def reward_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rlnb-reward-")]


class Gate:
    """A reward that blocks until ``open`` is set; ``started`` is set by its first call."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.started = threading.Event()

    def __call__(self, completion: str, answer: Any) -> float:
        self.started.set()
        self.open.wait(60)
        return 1.0


class InThread:
    """``fn()`` on a thread of its own: a call that freezes fails the test at a
    ``wait_until`` instead of hanging it. ``join()`` before the test ends."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="test-caller")
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def join(self) -> None:
        self._thread.join(60)


# -- a slow or hung reward holds up nothing else ------------------------------------------


def test_pause_and_resume_return_while_a_reward_is_running_and_its_groups_finish_after() -> None:
    gate = Gate()
    callers: list[InThread] = []
    with rlnb.Session(CONFIG, name="slow-reward") as sess:
        sess.rollouts.set_reward(gate)
        try:
            sess.rollouts.start()
            assert gate.started.wait(20), "no reward was called"
            callers.append(pause := InThread(sess.rollouts.pause))
            wait_until(pause.done.is_set, "pause() to return while a reward is running")
            assert pause.error is None
            stats = sess.statistics()
            assert stats.rollout.state == "paused" and stats.engine.running == 0
            assert stats.rollout.in_flight >= 1  # the sample being rewarded is neither lost nor finished
            assert stats.buffer.put == 0
            assert_counts_add_up(stats.rollout)

            callers.append(resume := InThread(sess.rollouts.resume))
            wait_until(resume.done.is_set, "resume() to return while a reward is running")
            assert resume.error is None and sess.statistics().buffer.put == 0
        finally:
            gate.open.set()
            for caller in callers:
                caller.join()
        wait_until(lambda: sess.statistics().buffer.put >= 1, "a rewarded group in the buffer")
        assert_counts_add_up(sess.statistics().rollout)


def test_a_wait_pause_lets_running_rewards_finish_before_it_is_paused() -> None:
    gate = Gate()
    callers: list[InThread] = []
    with rlnb.Session(CONFIG, name="wait-reward") as sess:
        sess.rollouts.set_reward(gate)
        try:
            sess.rollouts.start()
            assert gate.started.wait(20), "no reward was called"
            callers.append(pause := InThread(lambda: sess.rollouts.pause("wait")))
            wait_until(pause.done.is_set, "pause('wait') to return at once")
            assert sess.statistics().rollout.state == "pausing"  # a sample is still being rewarded
        finally:
            gate.open.set()
            for caller in callers:
                caller.join()
        sess.rollouts.wait_paused(timeout=20)
        stats = sess.statistics()
        # What save() relies on: every dispatched sample finished, none left mid-reward.
        assert stats.rollout.state == "paused"
        assert (stats.rollout.in_flight, stats.rollout.kept_partial, stats.rollout.failed) == (0, 0, 0)
        assert stats.rollout.finished == stats.rollout.dispatched
        assert stats.buffer.put == stats.rollout.groups_finished == stats.rollout.groups_dispatched
        assert_counts_add_up(stats.rollout)


def test_a_hung_reward_fails_its_sample_naming_the_prompt_and_later_rewards_still_run() -> None:
    config = CONFIG.replace(rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=1, reward_timeout=0.3))
    release = threading.Event()
    calls: list[str] = []

    def hang(completion: str, answer: Any) -> float:
        calls.append(completion)
        release.wait(60)
        return 1.0

    try:
        with rlnb.Session(config, name="hung-reward") as sess:
            sess.rollouts.set_reward(hang)
            with pytest.raises(rlnb.RolloutError) as info:
                sess.rollout(1, timeout=30)
            message = str(info.value)
            assert f"prompt {FIRST.prompt_id} ({FIRST.prompt!r})" in message
            assert ("did not return within reward_timeout=0.3 s" in message and "not retried" in message) or (
                "ran past the timeout first" in message
            )
            # One call in all: a timeout is not retried, and the group's other sample,
            # queued behind it, fails at once instead of waiting out a timeout of its own.
            assert len(calls) == 1
            stats = sess.statistics().rollout
            assert (stats.failed, stats.groups_failed, stats.retries) == (2, 1, 0)
            assert_counts_add_up(stats)

            # The hung call still runs on its thread (nothing can stop a thread), but
            # it holds up no later reward.
            assert len(reward_threads()) >= 1
            sess.rollouts.set_reward(lambda completion, answer: 0.5)
            [group] = sess.rollout(1, timeout=30)
            assert [s.reward for s in group.samples] == [0.5, 0.5]
            # Closing does not wait for them either; they end when their calls return.
        assert sess.closed and len(reward_threads()) >= 1
    finally:
        release.set()
    wait_until(lambda: not reward_threads(), "the released calls' threads to end")


def test_close_returns_at_once_while_a_reward_hangs() -> None:
    config = CONFIG.replace(rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=1, reward_timeout=60.0))
    gate = Gate()
    callers: list[InThread] = []
    sess = rlnb.Session(config, name="close-hung")
    try:
        sess.rollouts.set_reward(gate)
        sess.rollouts.start()
        assert gate.started.wait(20), "no reward was called"
        callers.append(close := InThread(sess.close))
        wait_until(close.done.is_set, "close() to return while a reward hangs (long before its timeout)")
        assert close.error is None and sess.closed and rlnb.sessions() == []
        wait_until(lambda: len(reward_threads()) == 1, "only the hung call's thread left (until the call returns)")
    finally:
        gate.open.set()
        for caller in callers:
            caller.join()
        sess.close()
    wait_until(lambda: not reward_threads(), "the released call's thread to end")


# -- what a reward may return --------------------------------------------------------------

# 1e39 is finite in Python but inf in the learner's float32.
BAD = [float("nan"), None, "x", "1.0", float("inf"), -float("inf"), [1.0], 10**400, 1e39, -1e39]
BAD_REPRS = ["nan", "None", "'x'", "'1.0'", "inf", "-inf", "[1.0]", "1000000", "1e+39", "-1e+39"]


def test_a_reward_that_is_not_a_finite_number_fails_its_sample_naming_the_value_and_the_prompt() -> None:
    config = CONFIG.replace(rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=1))
    calls: list[object] = []
    with rlnb.Session(config, name="bad-values") as sess:
        for value, shown in zip(BAD, BAD_REPRS, strict=True):

            def bad(completion: str, answer: Any, value: object = value) -> Any:
                calls.append(value)
                return value

            sess.rollouts.set_reward(bad)
            before = sess.statistics().rollout
            with pytest.raises(rlnb.RolloutError, match="a reward must be a finite number") as info:
                sess.rollout(1, timeout=30)
            message = str(info.value)
            assert f"the reward function returned {shown}" in message, message
            item = get_task(config.task).item(config.seed, before.groups_dispatched)  # the prompt rolled out
            assert f"for prompt {item.prompt_id} ({item.prompt!r}), completion '" in message
            stats = sess.statistics().rollout
            assert stats.failed - before.failed == 2 and stats.retries == 0  # a wrong value is not retried
            assert_counts_add_up(stats)
        assert len(calls) == 2 * len(BAD)


def test_a_reward_that_raises_is_retried_and_then_named_with_its_error() -> None:
    config = CONFIG.replace(rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=1, max_retries=2))
    with rlnb.Session(config, name="raising-reward") as sess:

        def broken(completion: str, answer: Any) -> float:
            raise KeyError("no such answer")

        sess.rollouts.set_reward(broken)
        with pytest.raises(rlnb.RolloutError) as info:
            sess.rollout(1, timeout=30)
        assert f"raised KeyError('no such answer') 3 times for prompt {FIRST.prompt_id} ({FIRST.prompt!r})" in str(
            info.value
        )
        stats = sess.statistics().rollout
        assert (stats.failed, stats.retries) == (2, 2 * 2)
        assert_counts_add_up(stats)


def test_bools_ints_and_numpy_scalars_are_rewards() -> None:
    with rlnb.Session(CONFIG, name="good-values") as sess:
        rewards: list[tuple[Callable[[str, Any], Any], float]] = [
            (lambda c, a: True, 1.0),  # a bool, as an exact-match reward returns
            (lambda c, a: 0, 0.0),
            (lambda c, a: np.float32(0.25), 0.25),
            (lambda c, a: fractions.Fraction(1, 2), 0.5),
        ]
        for reward, expected in rewards:
            sess.rollouts.set_reward(reward)
            [group] = sess.rollout(1, timeout=30)
            assert {s.reward for s in group.samples} == {expected}
            assert all(type(s.reward) is float for s in group.samples)


def test_evaluate_reports_a_bad_reward_naming_the_prompt() -> None:
    with rlnb.Session(CONFIG, name="eval-reward") as sess:

        def no_reward(completion: str, answer: Any) -> Any:
            return None

        sess.rollouts.set_reward(no_reward)
        with pytest.raises(rlnb.RolloutError, match=r"returned None for prompt \d+ \('\d+\+\d+='\)"):
            sess.evaluate(4)


# -- the pool ------------------------------------------------------------------------------


def test_the_pool_runs_calls_in_order_off_the_loop_and_close_leaves_no_idle_thread() -> None:
    loop_thread = threading.get_ident()
    seen: list[tuple[int, int]] = []

    def work(i: int) -> int:
        seen.append((i, threading.get_ident()))
        return i * i

    async def main() -> None:
        pool = RewardPool()
        try:
            done: list[int] = []

            async def one(i: int) -> None:
                done.append(await pool.call(work, i, timeout=10.0))

            await asyncio.gather(*(one(i) for i in range(50)))
            assert done == [i * i for i in range(50)]  # results come back in the order the calls went in
            assert [i for i, _ in seen] == list(range(50))
            assert all(ident != loop_thread for _, ident in seen)
        finally:
            pool.close()
        assert reward_threads() == []  # close joined the idle worker
        with pytest.raises(rlnb.ClosedError):
            await pool.call(work, 1, timeout=None)

    asyncio.run(main())


def test_abandoned_calls_never_hold_up_later_ones_and_too_many_fail_new_calls_at_once() -> None:
    release = threading.Event()

    def hang() -> str:
        release.wait(60)
        return "late"

    async def main() -> None:
        pool = RewardPool(max_abandoned=2)
        try:
            with pytest.raises(CallTimedOut):
                await pool.call(hang, timeout=0.05)
            assert await pool.call(str, 7, timeout=10.0) == "7"  # a new thread took over at once
            with pytest.raises(CallTimedOut):
                await pool.call(hang, timeout=0.05)
            with pytest.raises(PoolFull):
                await pool.call(str, 8, timeout=10.0)  # two hung threads already: no third
            release.set()
            await until(lambda: len(reward_threads()) <= 1, "the hung calls to end", timeout=20)
            assert await pool.call(str, 9, timeout=10.0) == "9"
        finally:
            release.set()
            pool.close()

    asyncio.run(main())
    wait_until(lambda: not reward_threads(), "the workers to end")


def test_a_call_is_timed_from_its_start_not_from_its_wait_for_a_worker() -> None:
    gate = threading.Event()

    async def main() -> None:
        pool = RewardPool()
        try:
            first = asyncio.ensure_future(pool.call(gate.wait, 60, timeout=None))
            queued = asyncio.ensure_future(pool.call(str, "queued", timeout=0.05))
            await asyncio.sleep(0.2)  # four times the queued call's timeout, spent waiting for the worker
            assert not queued.done()
            gate.set()
            assert await first is True
            assert await queued == "queued"
        finally:
            gate.set()
            pool.close()

    asyncio.run(main())


def test_calls_cancelled_together_never_start_when_a_hung_one_is_abandoned() -> None:
    release = threading.Event()
    started: list[str] = []

    def hang(name: str) -> str:
        started.append(name)
        release.wait(60)
        return name

    async def main() -> None:
        pool = RewardPool()
        try:
            calls = [asyncio.ensure_future(pool.call(hang, name, timeout=None)) for name in "ab"]
            await until(lambda: started == ["a"], "the first call to start")
            for call in calls:  # as close() cancels every group at once
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            # The thread that took over from the hung one found nothing wanted and left.
            await until(lambda: len(reward_threads()) == 1, "only the hung call's thread left", timeout=20)
            assert started == ["a"]
        finally:
            release.set()
            pool.close()

    asyncio.run(main())
    wait_until(lambda: not reward_threads(), "the released call's thread to end")


@pytest.mark.parametrize("workers", [1, 4])
def test_reward_workers_bounds_how_many_rewards_run_at_once(workers: int) -> None:
    config = CONFIG.replace(rollout=rlnb.RolloutConfig(group_size=8, groups_per_step=1, reward_workers=workers))
    lock, running, most = threading.Lock(), [0], [0]

    def slow(completion: str, answer: Any) -> float:  # a judge behind an API: it waits
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        threading.Event().wait(0.1)
        with lock:
            running[0] -= 1
        return 0.0

    with rlnb.Session(config, name="reward-workers") as sess:
        sess.rollouts.set_reward(slow)
        sess.rollout(2, timeout=60)
    assert most[0] == workers


def test_reward_workers_must_be_a_positive_int() -> None:
    with pytest.raises(rlnb.ConfigError, match=r"RolloutConfig\.reward_workers"):
        rlnb.RolloutConfig(reward_workers=0)

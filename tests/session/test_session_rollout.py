"""The Session's rollout API on the real TinyEngine with a tiny random policy.

A notebook user's view: rollout() to inspect, background rollouts into the buffer,
pause/resume, errors that surface on the next call, Ctrl-C and close mid-generation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
from pathlib import Path

import pytest

import rlnb
from rlnb import RolloutBatch
from rlnb.engines import GenerateRequest
from tests.helpers import HookedEngine, assert_counts_add_up, cause_chain, ctrl_c_once, small_config, wait_until

CONFIG = small_config(data=rlnb.DataConfig())
# Background dispatch stops at (max_policy_lag + 1) * groups_per_step groups until the learner advances.
BUDGET = (1 + 1) * 4
PROMPT = re.compile(r"\d\d\+\d\d=")


def engine_threads(session_name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"rlnb-{session_name}-engine"]


@pytest.mark.slow  # seconds of waiting or drawing: the integration tier
def test_rollout_returns_rewarded_groups_that_render_as_tables() -> None:
    with rlnb.Session(CONFIG, name="inspect") as sess:
        batch = sess.rollout(3)
        assert sess.statistics().buffer.put == 0  # inspection only, nothing for the learner

    assert isinstance(batch, RolloutBatch) and len(batch) == 3
    for group in batch:
        assert PROMPT.fullmatch(group.prompt), group.prompt
        assert len(group.samples) == CONFIG.rollout.group_size
        for sample in group.samples:
            assert sample.prompt == group.prompt
            assert sample.reward is not None and 0.0 <= sample.reward <= 1.0
            assert 1 <= len(sample.token_ids) == len(sample.logprobs) == len(sample.versions)
            assert set(sample.versions) == {0}
            assert sample.finish_reason in ("stop", "length") and sample.resumed == 0

    html = batch._repr_html_()
    assert html.startswith("<table>") and html.endswith("</table>")
    assert all(group.prompt in html for group in batch)
    text = repr(batch)
    lines = text.splitlines()
    assert lines[0] == "RolloutBatch(3 groups)"
    assert lines[1].split() == ["prompt", "completion", "reward", "versions", "marks"]
    assert len(lines) == 2 + 3 * CONFIG.rollout.group_size
    assert "<" not in text


def test_background_rollouts_fill_the_buffer_to_the_staleness_budget_through_pause_and_resume() -> None:
    with rlnb.Session(CONFIG, name="background") as sess:
        sess.rollouts.start()
        sess.rollouts.pause()  # "abort": whatever is generating is kept as a partial rollout
        stats = sess.statistics()
        assert stats.rollout.state == "paused"
        assert stats.engine.running == 0 and stats.engine.paused == "abort"  # quiescent
        assert_counts_add_up(stats.rollout)

        sess.rollouts.resume()
        wait_until(lambda: sess.statistics().buffer.sizes["train"] == BUDGET, f"{BUDGET} groups in the buffer")
        stats = sess.statistics()
        assert stats.rollout.groups_dispatched == BUDGET and stats.rollout.dispatching
        assert_counts_add_up(stats.rollout)

        sess.rollouts.stop()
        stats = sess.statistics()
        assert not stats.rollout.dispatching and stats.rollout.state == "running"
        assert stats.rollout.in_flight == 0 and stats.rollout.kept_partial == 0
        assert_counts_add_up(stats.rollout)
        groups = sess.buffer.get(BUDGET, timeout=1)
        assert all(set(s.versions) == {0} for g in groups for s in g.samples)


def test_bad_pause_mode_and_rollout_while_paused_raise_helpful_errors() -> None:
    with rlnb.Session(CONFIG, name="modes") as sess:
        with pytest.raises(ValueError, match="'abort', 'keep', 'wait'"):
            sess.rollouts.pause(mode="bogus")
        assert sess.statistics().rollout.state == "running"  # the bad call changed nothing

        sess.rollouts.pause("keep")
        with pytest.raises(rlnb.RolloutError, match=r"resume\(\)"):
            sess.rollout(1)
        sess.rollouts.resume()
        assert len(sess.rollout(1)) == 1


def test_closing_during_generation_leaves_nothing_behind() -> None:
    # A large budget so that generation is surely under way when close() comes.
    config = CONFIG.replace(rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=64))
    sess = rlnb.Session(config, name="close-early")
    assert len(engine_threads("close-early")) == 1
    sess.rollouts.start()
    wait_until(lambda: sess.statistics().engine.running > 0, "the engine to generate")
    sess.close()
    assert sess.closed and rlnb.sessions() == []
    assert engine_threads("close-early") == []
    with pytest.raises(rlnb.ClosedError):
        sess.rollouts.start()


def test_an_engine_failure_surfaces_chained_on_the_next_call_and_the_session_recovers() -> None:
    original = RuntimeError("engine exploded")

    async def broken(request: GenerateRequest) -> None:
        raise original

    engine = HookedEngine(CONFIG, name="rlnb-engine-failure-engine")
    with rlnb.Session(CONFIG, name="engine-failure", engine=engine) as sess:
        engine.before_generate = broken
        sess.rollouts.start()

        # The next public call after a group fails reports it, statistics() included.
        errors: list[rlnb.RolloutError] = []

        def reported() -> bool:
            try:
                sess.statistics()
            except rlnb.RolloutError as exc:
                errors.append(exc)
            return bool(errors)

        wait_until(reported, "the failure to be reported")
        assert "background rollout" in str(errors[0]) and "failed" in str(errors[0])
        assert cause_chain(errors[0])[-1] is original
        assert all(cause_chain(e)[-1] is original for e in errors[0].errors)  # type: ignore[attr-defined]

        # Every failure is reported once; with generate fixed, rollouts work again.
        engine.before_generate = None

        def settled() -> bool:
            try:
                return sess.statistics().rollout.in_flight == 0
            except rlnb.RolloutError:  # groups that failed since the last call
                return False

        wait_until(settled, "the failing groups to settle")
        while True:
            try:
                sess.rollouts.stop()
                break
            except rlnb.RolloutError:
                continue
        assert len(sess.rollout(1)) == 1
        assert_counts_add_up(sess.statistics().rollout)


def test_ctrl_c_during_rollout_raises_keyboard_interrupt_and_the_session_stays_usable() -> None:
    engine = HookedEngine(CONFIG, name="rlnb-ctrl-c-engine")
    with rlnb.Session(CONFIG, name="ctrl-c", engine=engine) as sess:
        generating = engine.slow_down(0.2)  # the rollout is surely still running when Ctrl-C comes
        with ctrl_c_once(generating):
            sess.rollout(64)
        engine.before_generate = None

        assert [t.is_alive() for t in engine_threads("ctrl-c")] == [True]
        batch = sess.rollout(2)
        assert len(batch) == 2 and all(len(g.samples) == CONFIG.rollout.group_size for g in batch)
        stats = sess.statistics().rollout
        assert_counts_add_up(stats)
        # The interrupted samples were cancelled (their prompts go again), not failed.
        assert stats.cancelled > 0 and stats.groups_cancelled > 0
        assert stats.failed == 0 and stats.groups_failed == 0


def test_pause_wait_drains_even_with_more_samples_in_flight_than_engine_slots() -> None:
    config = CONFIG.replace(engine=rlnb.EngineConfig(max_batch=1))
    with rlnb.Session(config, name="wait-drain") as sess:
        sess.rollouts.start()
        wait_until(lambda: sess.statistics().engine.waiting > 0, "requests queued in the engine")
        sess.rollouts.pause("wait")
        sess.rollouts.wait_paused(timeout=1.0)
        stats = sess.statistics()
        assert stats.rollout.state == "paused"
        assert stats.engine.running == 0 and stats.engine.waiting == 0


def test_a_dead_engine_is_reported_at_the_next_call_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = HookedEngine(CONFIG, name="rlnb-dead-engine")
    with rlnb.Session(CONFIG, name="dead-engine", engine=engine) as sess:
        sess.rollout(1)

        def admit() -> list[object]:
            raise RuntimeError("admission broke")

        monkeypatch.setattr(engine.inner, "_admit", admit)  # a fault outside decode and prefill
        with pytest.raises(rlnb.RolloutError) as info:
            sess.rollout(1, timeout=30)
        assert any(isinstance(e, rlnb.EngineError) for e in cause_chain(info.value))
        assert "admission broke" in str(sess.statistics().engine.extra["died"])


def test_a_loaded_async_session_dispatches_no_further_ahead_than_its_policy_lag_budget(tmp_path: Path) -> None:
    """The budget is what is live now (generating or buffered), not a counter that a
    checkpoint forgets: after load() at step 3 the rollouter must not run 5 steps ahead."""
    config = dataclasses.replace(CONFIG, mode="async")
    with rlnb.Session(config, name="lagsave") as sess:
        sess.train(3, progress=False)
        sess.save(tmp_path / "ckpt")
        buffered = sess.statistics().buffer.sizes["train"]
    assert buffered <= BUDGET
    with rlnb.Session.load(tmp_path / "ckpt", name="lagload") as sess:
        assert sess.version == 3 and sess.statistics().buffer.sizes["train"] == buffered
        sess.rollouts.start()
        wait_until(lambda: sess.statistics().rollout.groups_live == BUDGET, "the budget to fill")
        sess.rollouts.stop()  # the groups in flight finish into the buffer
        stats = sess.statistics()
        assert stats.rollout.groups_dispatched == BUDGET - buffered
        assert stats.buffer.sizes["train"] == BUDGET
        assert (stats.rollout.groups_live, stats.rollout.groups_allowed) == (BUDGET, BUDGET)


def test_rollout_during_background_training_waits_out_each_weight_sync() -> None:
    # Every step syncs weights; a rollout() landing in one waits it out (milliseconds)
    # instead of failing "rollouts are syncing".
    config = CONFIG.replace(data=rlnb.DataConfig(num_workers=0))
    engine = HookedEngine(config)
    with rlnb.Session(config, name="syncs", engine=engine) as sess:
        syncs = 0

        async def slow_sync(version: int) -> None:  # make each sync wide enough to land in
            nonlocal syncs
            syncs += 1
            await asyncio.sleep(0.02)

        engine.before_update = slow_sync
        sess.training.start()
        for _ in range(30):
            assert len(sess.rollout(1)) == 1
        sess.training.stop()
        assert syncs >= 2, "no weight sync happened while rollout() was called"


@pytest.mark.parametrize("call", ["rollout", "step"])
def test_close_from_another_thread_during_a_call_says_the_session_was_closed(call: str) -> None:
    engine = HookedEngine(CONFIG)
    sess = rlnb.Session(CONFIG, name="closed-under", engine=engine)
    generating = engine.slow_down(5.0)
    closer = threading.Thread(target=lambda: (generating.wait(10), sess.close()))
    closer.start()
    try:
        with pytest.raises(rlnb.ClosedError, match="the session was closed"):
            getattr(sess, call)()
    finally:
        closer.join()
        sess.close()


@pytest.mark.parametrize("call", ["rollout", "save", "evaluate"])
def test_a_reward_that_calls_back_into_the_session_is_refused_at_once(call: str, tmp_path: Path) -> None:
    # Such a call waits for rollouts, which wait for this very reward: it would hang
    # until reward_timeout. It fails at once instead, saying why.
    config = CONFIG.replace(rollout=dataclasses.replace(CONFIG.rollout, max_retries=0, reward_timeout=60.0))
    with rlnb.Session(config, name="reentry") as sess:
        args = {"rollout": (1,), "save": (tmp_path / "ckpt",), "evaluate": (4,)}[call]

        def reward(completion: str, answer: str) -> float:
            getattr(sess, call)(*args)
            return 0.0

        sess.rollouts.set_reward(reward)
        with pytest.raises(rlnb.RolloutError) as raised:
            sess.rollout(1)
        assert any(f"{call}() was called from inside a reward function" in str(e) for e in cause_chain(raised.value)), (
            cause_chain(raised.value)
        )

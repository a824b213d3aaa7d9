"""``Rollouter.quiesce()``: nothing generating inside the block, every group in flight
finished (into the buffer, or held there when it is full), and rollouts as they were
afterwards, whatever interrupts it; with a dead engine it only stops dispatch.

Every test runs its own event loop with ``asyncio.run`` and closes what it made.
Assertions are on states, counts and the order of engine calls, never on wall-clock.
"""

from __future__ import annotations

import asyncio

import pytest

import rlnb
from rlnb.engines import PauseMode
from rlnb.rollout import Rollouter, RolloutState
from tests.helpers import assert_counts_add_up
from tests.rollout.helpers import DELAY, SLOW, RecordingEngine, groups_ended, make_rollouter, settle, until


def quiet(r: Rollouter) -> None:
    """Nothing generating, nothing kept partial, nothing dispatching, every group ended."""
    s = r.statistics()
    assert r.state is RolloutState.PAUSED and not r.dispatching
    assert s.in_flight == 0 and s.kept_partial == 0, s
    assert groups_ended(r)(), s
    assert_counts_add_up(s)


@pytest.mark.parametrize("full", [False, True], ids=["room", "full-buffer"])
def test_quiesce_drains_every_group_in_flight_and_leaves_rollouts_running_as_they_were(full: bool) -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=6, token_delay=DELAY)
        # A full buffer holds finished groups for room: the drain must not wait on it.
        async with make_rollouter(
            engine, buffer_capacity=2 if full else 256, group_size=2, max_inflight=8, max_policy_lag=None
        ) as (r, buffer):
            await r.start()
            await until(lambda: r.statistics().in_flight == 8, "8 samples generating")
            engine.calls.clear()
            async with r.quiesce(timeout=5):
                quiet(r)
                assert engine.calls == ["pause:wait"]  # no abort: every sample ran to its end
                finished = r.statistics().groups_finished
                assert finished >= 4
                assert buffer.size() + buffer.held() == finished
                assert (buffer.held() > 0) is full
            assert r.state is RolloutState.RUNNING and r.dispatching
            assert engine.calls == ["pause:wait", "resume"]
            if not full:  # dispatch goes on (a full buffer holds it until the learner takes room)
                await until(lambda: r.statistics().groups_dispatched > finished, "dispatch to go on")

    asyncio.run(main())


def test_quiesce_finishes_kept_partial_rollouts_and_leaves_rollouts_paused_as_they_were() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=10, token_delay=SLOW)
        async with make_rollouter(engine, group_size=2, max_inflight=4, max_policy_lag=None) as (r, buffer):
            await r.start()
            await until(lambda: engine.statistics().running == 4, "4 samples generating")
            await r.pause(PauseMode.ABORT)
            assert r.statistics().kept_partial == 4
            engine.calls.clear()
            async with r.quiesce(timeout=5):
                quiet(r)
                assert engine.calls == ["resume", "pause:wait"]  # the partial rollouts continued to their end
                assert buffer.size() == 2
                assert all(s.resumed == 1 and len(s.token_ids) == 10 for g in buffer.get_nowait(2) for s in g.samples)
            assert r.state is RolloutState.PAUSED and r.dispatching  # paused, and dispatching once resumed
            assert engine.calls == ["resume", "pause:wait"]  # leaving changed nothing in the engine

    asyncio.run(main())


def test_quiesce_with_nothing_running_leaves_nothing_running() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(engine, group_size=2, max_inflight=4) as (r, buffer):
            async with r.quiesce():
                quiet(r)
            assert r.state is RolloutState.RUNNING and not r.dispatching
            assert r.statistics().groups_dispatched == 0 and buffer.size() == 0

    asyncio.run(main())


def test_quiesce_with_a_dead_engine_only_stops_dispatch() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(engine, group_size=2, max_inflight=4, max_policy_lag=None) as (r, _):
            await r.start()
            engine.update_error = rlnb.EngineError("the engine process died")
            with pytest.raises(rlnb.WeightSyncError):
                await r.sync_weights({"w": 1.0}, 1)
            assert r.engine_dead and r.state is RolloutState.PAUSED and r.dispatching
            engine.calls.clear()
            async with r.quiesce(timeout=5):  # what was learnt can still be saved
                assert not r.dispatching and r.state is RolloutState.PAUSED
            assert not r.dispatching and r.state is RolloutState.PAUSED
            assert engine.calls == []

    asyncio.run(main())


def test_a_quiesce_cancelled_while_draining_leaves_rollouts_as_they_were() -> None:
    """What a Ctrl-C in save() does: the bridge cancels the call that waits for the drain."""

    async def main() -> None:
        engine = RecordingEngine(lengths=10**6, token_delay=SLOW)  # the drain never ends
        async with make_rollouter(engine, group_size=2, max_inflight=4, max_policy_lag=None) as (r, _):
            await r.start()
            await until(lambda: engine.statistics().running == 4, "4 samples generating")
            quiescence = r.quiesce()
            enter = asyncio.create_task(quiescence.enter())
            await until(lambda: r.state is RolloutState.PAUSING, "the drain to begin")
            enter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await enter
            assert r.state is RolloutState.RUNNING and r.dispatching
            assert engine.statistics().paused is None and engine.statistics().running == 4
            await quiescence.restore()  # the caller's own undo, after the cancelled call's: nothing left to do
            assert r.state is RolloutState.RUNNING and r.dispatching
            # Let the samples the resume woke wait again before close cancels them: on
            # Python 3.11 asyncio.wait_for (FakeEngine's) swallows a cancel that lands as it wakes.
            await settle()

    asyncio.run(main())


def test_a_quiesce_whose_drain_times_out_raises_and_leaves_rollouts_as_they_were() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=10**6, token_delay=SLOW)
        async with make_rollouter(engine, group_size=2, max_inflight=4, max_policy_lag=None) as (r, _):
            await r.start()
            await until(lambda: engine.statistics().running == 4, "4 samples generating")
            with pytest.raises(TimeoutError, match=r"2 groups \(4 samples\) are still in flight: 4 calls"):
                async with r.quiesce(timeout=0.05):
                    raise AssertionError("not reached")
            assert r.state is RolloutState.RUNNING and r.dispatching
            await settle()  # as above: before close cancels the woken samples

    asyncio.run(main())


def test_a_quiescence_is_entered_once() -> None:
    async def main() -> None:
        async with make_rollouter(RecordingEngine(lengths=2), group_size=2, max_inflight=4) as (r, _):
            quiescence = r.quiesce()
            async with quiescence:
                pass
            with pytest.raises(RuntimeError, match="entered once"):
                await quiescence.enter()
            assert r.state is RolloutState.RUNNING

    asyncio.run(main())

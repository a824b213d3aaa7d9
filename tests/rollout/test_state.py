"""The Rollouter's state machine, driven by a scripted FakeEngine: pause and resume
(resume does not wait for the long tail), the weight-sync transaction, WAIT drains,
idempotence and close.

Every test runs its own event loop with ``asyncio.run`` and closes what it made.
Assertions are on ordering and counts, never on wall-clock thresholds.
"""

from __future__ import annotations

import asyncio

import pytest

import rlnb
from rlnb.buffer import ReplayBuffer
from rlnb.engines import GenerateRequest, SamplingParams
from rlnb.rollout import Rollouter, RolloutState
from tests.helpers import assert_counts_add_up
from tests.rollout.helpers import (
    DELAY,
    SLOW,
    RecordingEngine,
    buffered_ids,
    constant_reward,
    decode,
    encode,
    make_rollouter,
    parse_id,
    prompt_stream,
    settle,
    until,
)

# -- 2. resume does not wait for the long tail --------------------------------------------


@pytest.mark.parametrize("mode", ["keep", "wait"])
def test_resume_dispatches_new_groups_while_64_long_generations_are_unfinished(mode: str) -> None:
    def lengths(request: GenerateRequest) -> int:
        prompt = parse_id(request.request_id)[0]
        return 10**6 if prompt < 8 else 3  # the first 8 groups are a tail that never ends

    async def main() -> None:
        engine = RecordingEngine(lengths=lengths, token_delay=0.005)
        async with make_rollouter(engine, group_size=8, max_inflight=256, max_policy_lag=1, groups_per_step=8) as (
            r,
            buffer,
        ):
            await r.start()  # a budget of 16 groups: the 8-group tail, and 8 that finish into the buffer
            await until(lambda: r.statistics().groups_finished == 8, "8 groups in the buffer")
            assert engine.statistics().running == 64
            await r.pause(mode)
            assert [g.prompt_id for g in buffer.get_nowait(8)] == list(range(8, 16))  # the learner takes them
            await r.set_version(1)  # the budget has room for 8 groups, but nothing goes out while paused
            await settle()
            assert r.statistics().groups_dispatched == 16

            async with asyncio.timeout(5):  # a resume that waited for the tail would hang here
                await r.resume()
            await until(lambda: r.statistics().groups_finished == 16, "the 8 new groups to finish")
            s = r.statistics()
            assert s.groups_dispatched == 24
            assert s.in_flight == 64 and s.finished == 128  # the tail is still running
            assert not any(parse_id(rid)[0] < 8 for rid in engine.results)
            assert buffered_ids(buffer) == list(range(16, 24))
            assert s.last_resume_to_dispatch_ms is not None and s.last_resume_to_dispatch_ms >= 0
            assert_counts_add_up(s)

    asyncio.run(main())


# -- 3. and 4. the weight-sync transaction ----------------------------------------------


def test_weight_sync_mid_generation_stamps_later_tokens_with_the_new_version() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=20, token_delay=SLOW)
        state = {"w": 1.0}
        async with make_rollouter(engine, group_size=2, max_inflight=2) as (r, _):
            task = asyncio.create_task(r.collect(1))
            await until(lambda: engine.statistics().running == 2, "2 generations running")
            await asyncio.sleep(3 * SLOW)  # some tokens at version 0, most still to come
            await r.sync_weights(state, version=1)
            assert r.state is RolloutState.RUNNING
            assert engine.weights is state and engine.statistics().version == 1
            assert engine.calls == ["pause:keep", "update:1", "resume"]
            [group] = await task

        for sample in group.samples:
            versions = list(sample.versions)
            assert len(versions) == len(sample.token_ids) == 20
            assert versions == sorted(versions) and set(versions) == {0, 1}, versions
            assert sample.resumed == 0  # a KEEP pause is invisible to the sample

    asyncio.run(main())


def test_failed_weight_sync_raises_chained_stays_paused_unsynced_and_resume_works() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=20, token_delay=DELAY)
        original = RuntimeError("checkpoint unreadable")
        engine.update_error = original
        async with make_rollouter(engine, group_size=2, max_inflight=2) as (r, _):
            task = asyncio.create_task(r.collect(1))
            await until(lambda: engine.statistics().running == 2, "2 generations running")
            with pytest.raises(rlnb.WeightSyncError, match="version 1") as info:
                await r.sync_weights({"w": 2.0}, version=1)
            assert info.value.__cause__ is original
            # Never half-synced: paused, old weights and version.
            assert r.state is RolloutState.PAUSED
            assert engine.weights is None and engine.statistics().version == 0
            assert not task.done()

            await r.resume()
            assert r.state is RolloutState.RUNNING and engine.statistics().paused is None
            [group] = await task
            assert all(set(s.versions) == {0} and len(s.token_ids) == 20 for s in group.samples)

    asyncio.run(main())


# -- 8. WAIT drains ---------------------------------------------------------------------------


def test_pause_wait_lets_in_flight_samples_finish_and_wait_paused_returns_once_drained() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=6, token_delay=DELAY)
        async with make_rollouter(engine, group_size=4, max_inflight=16, max_policy_lag=0, groups_per_step=2) as (
            r,
            buffer,
        ):
            await r.start()
            await until(lambda: engine.statistics().running == 8, "8 generations running")
            await r.pause("wait")  # returns at once
            assert r.state is RolloutState.PAUSING and r.statistics().in_flight == 8

            await r.wait_paused()
            s = r.statistics()
            assert s.state == "paused"
            assert (s.finished, s.in_flight, s.kept_partial, s.continuations) == (8, 0, 0, 0)
            assert engine.statistics().aborted == 0
            # The last group reaches the buffer a loop turn after its last sample.
            await until(lambda: buffer.statistics().put == 2, "both groups in the buffer")
            assert buffered_ids(buffer) == [0, 1]
            await r.resume()
            assert r.state is RolloutState.RUNNING

    asyncio.run(main())


def test_resume_during_a_wait_drain_interrupts_it_and_the_state_stays_running() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=6, token_delay=DELAY)
        async with make_rollouter(engine, group_size=4, max_inflight=16, max_policy_lag=0, groups_per_step=2) as (r, _):
            await r.start()
            await until(lambda: engine.statistics().running == 8, "8 generations running")
            await r.pause("wait")
            await r.resume()
            assert r.state is RolloutState.RUNNING
            await settle()
            assert not [t for t in asyncio.all_tasks() if t.get_name() == "rlnb-drain"]  # the drain ended
            # When the in-flight samples finish later, nothing flips the state to PAUSED.
            await until(lambda: r.statistics().finished == 8, "the in-flight samples to finish")
            await settle()
            assert r.state is RolloutState.RUNNING

    asyncio.run(main())


# -- 9. state machine and close ------------------------------------------------------------------


def test_pause_twice_is_idempotent_and_resume_while_running_is_a_no_op() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=4)
        async with make_rollouter(engine, group_size=2, max_inflight=2) as (r, _):
            await r.resume()
            assert engine.calls == [] and r.state is RolloutState.RUNNING
            assert r.statistics().last_resume_to_dispatch_ms is None

            await r.pause("abort")
            await r.pause("keep")
            assert engine.calls == ["pause:abort"] and r.state is RolloutState.PAUSED
            with pytest.raises(rlnb.RolloutError, match="resume"):
                await r.collect(1)
            with pytest.raises(ValueError, match="bogus"):
                await r.pause("bogus")
            await r.resume()
            await r.resume()
            assert engine.calls == ["pause:abort", "resume"]
            assert len(await r.collect(1)) == 1

    asyncio.run(main())


def test_pause_resume_and_sync_during_a_weight_sync_wait_for_it_then_take_effect() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=4)
        engine.update_gate = asyncio.Event()
        async with make_rollouter(engine, group_size=2, max_inflight=2) as (r, _):
            sync = asyncio.create_task(r.sync_weights({"w": 1.0}, version=1))
            await until(lambda: r.state is RolloutState.SYNCING, "the sync to start")
            pause = asyncio.create_task(r.pause("abort"))
            second = asyncio.create_task(r.sync_weights({"w": 2.0}, version=2))
            await settle()
            assert not pause.done() and not second.done()  # they wait for the sync in progress
            assert r.state is RolloutState.SYNCING
            engine.update_gate.set()
            await asyncio.gather(sync, pause, second)
            assert r.state is RolloutState.PAUSED  # the pause took effect after the first sync
            assert engine.statistics().version == 2  # and the second sync went through, paused
            await r.resume()
            assert r.state is RolloutState.RUNNING

    asyncio.run(main())


def test_a_weight_sync_during_a_wait_drain_waits_for_the_drain() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=6, token_delay=0.01)
        async with make_rollouter(engine, group_size=2, max_inflight=2) as (r, _):
            collect = asyncio.create_task(r.collect(1))
            await until(lambda: engine.statistics().running > 0, "generation to start")
            await r.pause("wait")
            assert r.state is RolloutState.PAUSING
            await r.sync_weights({"w": 1.0}, version=1)  # waited for the drain, then synced
            assert r.state is RolloutState.PAUSED and engine.statistics().version == 1
            await r.resume()
            groups = await collect
            assert all(set(s.versions) == {0} for s in groups[0].samples)  # finished with their weights

    asyncio.run(main())


def test_a_weight_sync_that_ends_after_aclose_leaves_the_rollouter_closed() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=4)
        engine.update_gate = asyncio.Event()
        async with make_rollouter(engine, group_size=2, max_inflight=2) as (r, _):
            await r.start()
            sync = asyncio.create_task(r.sync_weights({"w": 1.0}, version=1))
            await until(lambda: r.state is RolloutState.SYNCING, "the sync to start")
            await r.aclose()
            engine.update_gate.set()  # the engine answers after the close
            await asyncio.gather(sync, return_exceptions=True)
            assert r.state is RolloutState.CLOSED  # not the RUNNING the sync found
            with pytest.raises(rlnb.ClosedError):
                await r.resume()
        engine.close()

    asyncio.run(main())


def test_after_aclose_every_call_raises_closed_and_no_task_is_left() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=10**6, token_delay=0.005)
        buffer = ReplayBuffer(rlnb.BufferConfig(capacity=16))
        r = Rollouter(
            engine,
            rlnb.RolloutConfig(group_size=2, max_inflight=8),
            sampling=SamplingParams(),
            prompts=prompt_stream(),
            encode=encode,
            decode=decode,
            reward_fn=constant_reward,
            buffer=buffer,
            seed=0,
            data=rlnb.DataConfig(),
            max_context=None,
        )
        await r.start()
        await until(lambda: engine.statistics().running == 8, "generation running")
        await r.pause("wait")
        waiter = asyncio.create_task(r.wait_paused())  # a drain that never ends
        await settle(5)

        await r.aclose()
        assert r.state is RolloutState.CLOSED and not r.dispatching
        with pytest.raises(rlnb.ClosedError):
            await waiter  # woken, not left hanging
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert others == [], others  # aclose cancelled and awaited every task
        assert engine.statistics().running == 0

        calls = {
            "start": r.start,
            "pause": lambda: r.pause("abort"),
            "resume": r.resume,
            "wait_paused": r.wait_paused,
            "sync_weights": lambda: r.sync_weights({}, version=1),
            "collect": lambda: r.collect(1),
        }
        for name, call in calls.items():
            with pytest.raises(rlnb.ClosedError):
                await call()
                pytest.fail(f"{name}() after aclose() did not raise")
        await r.aclose()  # idempotent
        buffer.close()

    asyncio.run(main())

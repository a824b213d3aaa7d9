"""How the Rollouter counts samples and groups that end without finishing: a sample
whose generation or reward really failed counts as failed; one that was cancelled
(Ctrl-C during collect(), close) or whose engine closed under it counts as cancelled.

Driven by a scripted FakeEngine; every test runs its own event loop with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio

import pytest

import rlnb
from rlnb.engines import GenerateRequest
from rlnb.rollout import RolloutStatistics
from tests.helpers import assert_counts_add_up
from tests.rollout.helpers import DELAY, SLOW, RecordingEngine, groups_ended, make_rollouter, parse_id, until


def outcomes(s: RolloutStatistics) -> dict[str, int]:
    return {
        "finished": s.finished,
        "failed": s.failed,
        "cancelled": s.cancelled,
        "in_flight": s.in_flight,
        "kept_partial": s.kept_partial,
        "groups_finished": s.groups_finished,
        "groups_failed": s.groups_failed,
        "groups_cancelled": s.groups_cancelled,
    }


def ended(finished: int = 0, failed: int = 0, cancelled: int = 0, *, groups: tuple[int, int, int]) -> dict[str, int]:
    """The outcomes once nothing is in flight; ``groups`` is (finished, failed, cancelled)."""
    return {
        "finished": finished,
        "failed": failed,
        "cancelled": cancelled,
        "in_flight": 0,
        "kept_partial": 0,
        "groups_finished": groups[0],
        "groups_failed": groups[1],
        "groups_cancelled": groups[2],
    }


async def cancel(task: asyncio.Task[object]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# -- cancelled ------------------------------------------------------------------------------


def test_collect_cancelled_mid_generation_counts_every_sample_cancelled_and_none_failed() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=20, token_delay=SLOW)
        async with make_rollouter(engine, group_size=4, max_inflight=8) as (r, _):
            task = asyncio.create_task(r.collect(2))
            await until(lambda: engine.statistics().running == 8, "8 generations running")
            await asyncio.sleep(2 * SLOW)  # a few of 20 tokens: mid-generation
            await cancel(task)

            s = r.statistics()
            assert outcomes(s) == ended(cancelled=8, groups=(0, 0, 2))
            assert s.dispatched == 8 and s.groups_dispatched == 2
            assert_counts_add_up(s)
            assert [item.prompt_id for item in r.returned_prompts] == [0, 1]  # rolled out again next time
            r.raise_pending()  # nothing failed, nothing to report

            groups = await r.collect(2)  # the same prompts, counted like any others
            assert [g.prompt_id for g in groups] == [0, 1]
            assert outcomes(r.statistics()) == ended(finished=8, cancelled=8, groups=(2, 0, 2))

    asyncio.run(main())


def test_collect_cancelled_before_its_group_starts_counts_the_group_cancelled() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(engine, group_size=4, max_inflight=8) as (r, _):
            task = asyncio.create_task(r.collect(1))
            await asyncio.sleep(0)  # collect has dispatched; its group has not run yet
            await cancel(task)
            await until(lambda: r.statistics().in_flight == 0, "the cancelled group to be accounted", timeout=0.5)
            assert engine.requests == []  # no sample ever ran
            assert outcomes(r.statistics()) == ended(cancelled=4, groups=(0, 0, 1))
            assert_counts_add_up(r.statistics())

    asyncio.run(main())


def test_a_group_cancelled_after_some_samples_finished_counts_both_and_a_wait_pause_still_drains() -> None:
    def lengths(request: GenerateRequest) -> int:
        return 1 if parse_id(request.request_id)[1] == 0 else 10**6  # sample 0 finishes at once

    async def main() -> None:
        engine = RecordingEngine(lengths=lengths, token_delay=DELAY)
        async with make_rollouter(engine, group_size=4, max_inflight=4) as (r, _):
            task = asyncio.create_task(r.collect(1))
            await until(lambda: r.statistics().finished == 1, "sample 0 to finish")
            await cancel(task)
            assert outcomes(r.statistics()) == ended(finished=1, cancelled=3, groups=(0, 0, 1))
            assert_counts_add_up(r.statistics())

            # The finished sample's group never formed: it must not hold up a WAIT drain.
            await r.pause("wait")
            await asyncio.wait_for(r.wait_paused(), 5.0)  # the timeout only turns a hang into a failure

    asyncio.run(main())


def test_aclose_counts_generating_samples_cancelled_and_reports_nothing() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=10**6, token_delay=DELAY)
        async with make_rollouter(engine, group_size=4, max_inflight=16, max_policy_lag=None) as (r, _):
            await r.start()
            await until(lambda: engine.statistics().running == 16, "16 generations running")
            await r.aclose()
            s = r.statistics()
            assert s.state == "closed"
            assert outcomes(s) == ended(cancelled=16, groups=(0, 0, 4))
            assert_counts_add_up(s)
            r.raise_pending()  # a close is no failure

    asyncio.run(main())


def test_aclose_while_paused_counts_the_kept_partial_samples_cancelled() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=10**6, token_delay=DELAY)
        async with make_rollouter(engine, group_size=4, max_inflight=8, max_policy_lag=None) as (r, _):
            await r.start()
            await until(lambda: engine.statistics().running == 8, "8 generations running")
            await r.pause("abort")
            assert r.statistics().kept_partial == 8

            await r.aclose()  # they wait to continue, and get ClosedError or a cancellation
            assert outcomes(r.statistics()) == ended(cancelled=8, groups=(0, 0, 2))
            assert_counts_add_up(r.statistics())
            r.raise_pending()

    asyncio.run(main())


def test_samples_whose_engine_closed_under_them_count_cancelled_and_are_not_reported() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=10**6, token_delay=DELAY)
        async with make_rollouter(engine, group_size=4, max_inflight=8, max_policy_lag=0, groups_per_step=2) as (
            r,
            _,
        ):
            await r.start()
            await until(lambda: engine.statistics().running == 8, "8 generations running")
            await r.pause("abort")
            engine.close()  # the session closes its engine last; here it goes first
            await r.resume()  # every continuation meets ClosedError
            await until(lambda: r.statistics().groups_cancelled == 2, "the groups to end")
            assert outcomes(r.statistics()) == ended(cancelled=8, groups=(0, 0, 2))
            assert_counts_add_up(r.statistics())
            r.raise_pending()  # a background group reports its failure when it ends: there is none

    asyncio.run(main())


def test_stop_lets_dispatched_groups_finish_and_cancels_nothing() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=10, token_delay=DELAY)
        async with make_rollouter(engine, group_size=4, max_inflight=8, max_policy_lag=None) as (r, _):
            await r.start()
            await until(lambda: engine.statistics().running == 8, "8 generations running")
            await r.stop()  # the dispatcher is waiting for capacity: it gives back what it took
            await until(groups_ended(r), "the dispatched groups to finish")
            s = r.statistics()
            assert s.groups_dispatched >= 2 and not s.dispatching
            assert outcomes(s) == ended(finished=s.dispatched, groups=(s.groups_dispatched, 0, 0))
            assert_counts_add_up(s)

    asyncio.run(main())


# -- failed ---------------------------------------------------------------------------------


def test_a_generation_that_really_fails_counts_failed_and_its_siblings_finish() -> None:
    def fail_sample_0(request: GenerateRequest) -> BaseException | None:
        return RuntimeError("CUDA error") if parse_id(request.request_id)[1] == 0 else None

    async def main() -> None:
        engine = RecordingEngine(lengths=3, fail=fail_sample_0)
        async with make_rollouter(engine, group_size=4, max_inflight=8, max_retries=1) as (r, _):
            with pytest.raises(rlnb.RolloutError, match="rollout failed"):
                await r.collect(1)
            assert outcomes(r.statistics()) == ended(finished=3, failed=1, groups=(0, 1, 0))
            assert_counts_add_up(r.statistics())

    asyncio.run(main())


def test_a_reward_that_really_fails_counts_failed() -> None:
    def reward(item: rlnb.rollout.PromptItem, completion: str) -> float:
        raise ValueError("reward crashed")

    async def main() -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(engine, group_size=2, max_inflight=8, max_retries=0, reward_fn=reward) as (r, _):
            with pytest.raises(rlnb.RolloutError):
                await r.collect(2)
            assert outcomes(r.statistics()) == ended(failed=4, groups=(0, 2, 0))
            assert_counts_add_up(r.statistics())

    asyncio.run(main())


def test_a_group_that_fails_before_its_samples_run_counts_them_failed() -> None:
    def encode(text: str) -> list[int]:
        raise UnicodeError("cannot encode")

    async def main() -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(engine, group_size=4, max_inflight=8, encode=encode) as (r, _):
            with pytest.raises(rlnb.RolloutError, match="rollout failed"):
                await r.collect(1)
            assert engine.requests == []
            assert outcomes(r.statistics()) == ended(failed=4, groups=(0, 1, 0))
            assert_counts_add_up(r.statistics())

    asyncio.run(main())

"""The Rollouter driven by a scripted FakeEngine: pause/resume, partial rollouts,
weight syncs, failures, counting and the staleness bound.

Every test runs its own event loop with ``asyncio.run`` and closes what it made.
Waits poll for a condition; the only fixed sleeps let a scripted generation make a
few tokens. Assertions are on ordering and counts, never on wall-clock thresholds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import pytest

import rlnb
from rlnb.buffer import ReplayBuffer
from rlnb.rollout import (
    FakeEngine,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    PromptItem,
    Rollouter,
    RolloutState,
    RolloutStatistics,
    SamplingParams,
)
from tests.helpers import assert_counts_add_up, cause_chain

EOS = 2  # FakeEngine ends every "stop" sequence with this token
DELAY = 0.01  # FakeEngine seconds per token where a test acts mid-generation
# Where a test must catch 20-token generations still running after waiting for 3 tokens,
# a slower pace: a loaded machine stalling for a few hundred ms must not finish them.
SLOW = 0.05
NO_LENGTH_CUT = SamplingParams(max_new_tokens=10**9)  # the scripted lengths alone end a sample


def prompt_stream() -> Iterator[PromptItem]:
    for i in itertools.count():
        yield PromptItem(i, f"{i}+{i}=", str(2 * i))


def parse_id(request_id: str) -> tuple[int, int, int, int]:
    """The rollouter names requests "prompt.sample.continuation.attempt"."""
    prompt, sample, continuation, attempt = map(int, request_id.split("."))
    return prompt, sample, continuation, attempt


def encode(text: str) -> list[int]:
    return [3 + ord(c) % 20 for c in text]


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def constant_reward(item: PromptItem, completion: str) -> float:
    return 1.0


class RecordingEngine(FakeEngine):
    """A FakeEngine that keeps every result and logs its control calls.

    ``update_gate``, when set, holds ``update_weights`` until it is set, so a test
    can act while the rollouter is SYNCING.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.results: dict[str, GenerateResult] = {}
        self.calls: list[str] = []
        self.update_gate: asyncio.Event | None = None

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        result = await super().generate(request)
        self.results[request.request_id] = result
        return result

    async def pause(self, mode: PauseMode | str = PauseMode.KEEP) -> None:
        self.calls.append(f"pause:{PauseMode(mode).value}")
        await super().pause(mode)

    async def resume(self) -> None:
        self.calls.append("resume")
        await super().resume()

    async def update_weights(self, state: Mapping[str, Any], version: int) -> None:
        self.calls.append(f"update:{version}")
        if self.update_gate is not None:
            await self.update_gate.wait()
        await super().update_weights(state, version)


@contextlib.asynccontextmanager
async def make_rollouter(
    engine: FakeEngine,
    *,
    reward_fn: Callable[[PromptItem, str], float] = constant_reward,
    buffer_capacity: int = 256,
    **kwargs: Any,
) -> AsyncIterator[tuple[Rollouter, ReplayBuffer]]:
    kwargs.setdefault("sampling", NO_LENGTH_CUT)
    buffer = ReplayBuffer(buffer_capacity)
    rollouter = Rollouter(
        engine,
        prompts=prompt_stream(),
        encode=encode,
        decode=decode,
        reward_fn=reward_fn,
        buffer=buffer,
        **kwargs,
    )
    try:
        yield rollouter, buffer
    finally:
        await rollouter.aclose()
        buffer.close()


async def until(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Poll ``predicate`` on the loop; the timeout only turns a hang into a failure."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.001)


async def settle(iterations: int = 50) -> None:
    """Let every ready task run a while, to show that something does NOT happen."""
    for _ in range(iterations):
        await asyncio.sleep(0)


async def next_pending_error(r: Rollouter) -> rlnb.RolloutError:
    """The next background failure raise_pending() reports (it is stored by the failed
    task's done-callback, a loop turn after the group counts as failed)."""
    error: rlnb.RolloutError | None = None

    def raised() -> bool:
        nonlocal error
        try:
            r.raise_pending()
        except rlnb.RolloutError as exc:
            error = exc
        return error is not None

    await until(raised, "a background failure to be reported")
    assert error is not None
    return error


def buffered_ids(buffer: ReplayBuffer) -> list[int]:
    n = buffer.statistics().sizes["train"]
    return [g.prompt_id for g in buffer.get_nowait(n)] if n else []


# -- 1. partial rollouts ----------------------------------------------------------------


def test_pause_abort_keeps_every_in_flight_sample_and_resume_continues_its_prefix() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=20, token_delay=SLOW)
        async with make_rollouter(engine, group_size=4, max_inflight=8) as (r, _):
            task = asyncio.create_task(r.collect(2))
            await until(lambda: engine.statistics().running == 8, "8 generations running")
            await asyncio.sleep(3 * SLOW)  # about 3 of 20 tokens each: a real prefix, far from done
            in_flight = r.statistics().in_flight
            assert in_flight == 8

            await r.pause("abort")
            s = r.statistics()
            assert s.state == "paused"
            assert s.kept_partial == in_flight  # none lost
            assert (s.in_flight, s.finished, s.failed) == (0, 0, 0)
            assert engine.statistics().running == 0
            assert_counts_add_up(s)
            assert not task.done()

            await r.resume()
            groups = await task

        for group in groups:
            for index, sample in enumerate(group.samples):
                aborted = engine.results[f"{group.prompt_id}.{index}.0.0"]
                continued = engine.results[f"{group.prompt_id}.{index}.1.0"]
                assert aborted.finish_reason == "aborted" and aborted.token_ids  # a real prefix
                request = next(q for q in engine.requests if q.request_id == f"{group.prompt_id}.{index}.1.0")
                assert request.prefix_ids == aborted.token_ids
                # The sample is the prefix followed by the continuation, nothing dropped or repeated.
                assert sample.token_ids == aborted.token_ids + continued.token_ids
                assert sample.token_ids[: len(aborted.token_ids)] == request.prefix_ids
                assert len(sample.token_ids) == 20 and sample.token_ids[-1] == EOS
                assert len(sample.logprobs) == len(sample.versions) == 20
                assert sample.resumed >= 1 and sample.finish_reason == "stop"
        s = r.statistics()
        assert (s.finished, s.kept_partial, s.in_flight, s.continuations) == (8, 0, 0, 8)

    asyncio.run(main())


# -- 2. resume does not wait for the long tail --------------------------------------------


@pytest.mark.parametrize("mode", ["keep", "wait"])
def test_resume_dispatches_new_groups_while_64_long_generations_are_unfinished(mode: str) -> None:
    def lengths(request: GenerateRequest) -> int:
        prompt = parse_id(request.request_id)[0]
        return 10**6 if prompt < 8 else 3  # the first 8 groups are a tail that never ends

    async def main() -> None:
        engine = RecordingEngine(lengths=lengths, token_delay=0.005)
        async with make_rollouter(engine, group_size=8, max_inflight=256, max_staleness=0, groups_per_step=8) as (
            r,
            buffer,
        ):
            await r.start()
            await until(lambda: engine.statistics().running == 64, "64 long generations running")
            await r.pause(mode)
            await r.set_version(1)  # opens the budget to 16 groups, but nothing goes out while paused
            await settle()
            assert r.statistics().groups_dispatched == 8

            async with asyncio.timeout(5):  # a resume that waited for the tail would hang here
                await r.resume()
            await until(lambda: r.statistics().groups_finished == 8, "the 8 new groups to finish")
            s = r.statistics()
            assert s.groups_dispatched == 16
            assert s.in_flight == 64 and s.finished == 64  # the tail is still running
            assert not any(parse_id(rid)[0] < 8 for rid in engine.results)
            assert buffered_ids(buffer) == list(range(8, 16))
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


# -- 5. failures -------------------------------------------------------------------------


def test_transient_generation_and_reward_failures_within_the_budget_are_retried() -> None:
    def flaky_engine(request: GenerateRequest) -> BaseException | None:
        return RuntimeError("engine hiccup") if parse_id(request.request_id)[3] < 2 else None

    seen: set[tuple[int, str]] = set()

    def flaky_reward(item: PromptItem, completion: str) -> float:
        if (item.prompt_id, completion) not in seen:  # first call per completion fails
            seen.add((item.prompt_id, completion))
            raise ValueError("reward server busy")
        return 0.5

    async def main() -> None:
        engine = RecordingEngine(lengths=3, fail=flaky_engine)
        async with make_rollouter(engine, group_size=2, max_inflight=2, max_retries=2, reward_fn=flaky_reward) as (
            r,
            _,
        ):
            [group] = await r.collect(1)
            assert [s.reward for s in group.samples] == [0.5, 0.5]
            s = r.statistics()
            # Two failed attempts per sample, plus one reward failure (both completions are equal).
            assert s.retries == 2 * 2 + 1
            assert (s.finished, s.failed, s.groups_failed) == (2, 0, 0)
            r.raise_pending()  # nothing to report

    asyncio.run(main())


def test_engine_failure_beyond_retries_surfaces_chained_and_buffered_groups_survive() -> None:
    original = RuntimeError("CUDA error: device-side assert")

    def fail_prompt_1(request: GenerateRequest) -> BaseException | None:
        return original if parse_id(request.request_id)[0] == 1 else None

    async def main() -> None:
        engine = RecordingEngine(lengths=3, fail=fail_prompt_1)
        async with make_rollouter(
            engine, group_size=2, max_inflight=8, max_staleness=0, groups_per_step=3, max_retries=1
        ) as (r, buffer):
            await r.start()
            await until(lambda: r.statistics().groups_finished + r.statistics().groups_failed == 3, "3 groups")
            error = await next_pending_error(r)
            assert "background rollout failed" in str(error)
            assert cause_chain(error)[-1] is original
            r.raise_pending()  # reported once, not again
            assert buffered_ids(buffer) == [0, 2]  # the good groups are kept
            s = r.statistics()
            assert (s.groups_failed, s.failed, s.finished) == (1, 2, 4)
            assert_counts_add_up(s)

    asyncio.run(main())


def test_reward_failure_beyond_retries_surfaces_in_background_and_from_collect() -> None:
    original = ValueError("reward crashed")

    def reward(item: PromptItem, completion: str) -> float:
        if item.prompt_id % 2 == 1:
            raise original
        return 1.0

    async def main() -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(
            engine, group_size=2, max_inflight=8, max_staleness=0, groups_per_step=2, reward_fn=reward
        ) as (r, buffer):
            await r.start()  # prompts 0 (good) and 1 (bad)
            await until(lambda: r.statistics().groups_finished + r.statistics().groups_failed == 2, "2 groups")
            assert cause_chain(await next_pending_error(r))[-1] is original
            assert buffered_ids(buffer) == [0]

            await r.stop()
            with pytest.raises(rlnb.RolloutError, match="rollout failed") as info:
                await r.collect(2)  # prompts 2 (good) and 3 (bad)
            assert cause_chain(info.value)[-1] is original
            assert_counts_add_up(r.statistics())

    asyncio.run(main())


def test_retries_count_only_attempts_that_are_retried() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=2, fail=lambda request: RuntimeError("down"))
        async with make_rollouter(engine, group_size=1, max_inflight=1, max_retries=2) as (r, _):
            with pytest.raises(rlnb.RolloutError):
                await r.collect(1)
            assert len(engine.requests) == 3  # one try and two retries
            assert r.statistics().retries == 2

    asyncio.run(main())


# -- 6. counting invariant ----------------------------------------------------------------


def test_every_dispatched_sample_is_finished_kept_failed_or_in_flight_at_all_times() -> None:
    def lengths(request: GenerateRequest) -> int:
        prompt, sample, _, _ = parse_id(request.request_id)
        return 2 + (prompt * 7 + sample * 3) % 11

    def fail(request: GenerateRequest) -> BaseException | None:
        return RuntimeError("bad prompt") if parse_id(request.request_id)[0] % 5 == 3 else None

    violations: list[RolloutStatistics] = []
    checks = 0

    async def main() -> None:
        nonlocal checks
        engine = RecordingEngine(lengths=lengths, token_delay=0.001, fail=fail)
        async with make_rollouter(engine, group_size=4, max_inflight=16, max_staleness=None, max_retries=1) as (
            r,
            buffer,
        ):

            async def watch() -> None:  # checks between every step of every other task
                nonlocal checks
                while True:
                    s = r.statistics()
                    if s.dispatched != s.finished + s.kept_partial + s.failed + s.in_flight:
                        violations.append(s)
                    checks += 1
                    await asyncio.sleep(0)

            watcher = asyncio.create_task(watch())
            await r.start()
            for mode in ("abort", "keep", "abort", "wait"):
                await until(lambda: engine.statistics().running > 0, "generations running")
                await r.pause(mode)
                assert_counts_add_up(r.statistics())
                await r.resume()
                assert_counts_add_up(r.statistics())
                await until(lambda: r.statistics().groups_failed >= 1, "a failed group")
            await r.stop()
            await until(lambda: r.statistics().in_flight == 0, "the last groups to finish")
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

            s = r.statistics()
            assert_counts_add_up(s)
            assert s.kept_partial == 0 and s.continuations > 0 and s.failed > 0
            assert s.finished + s.failed == s.dispatched
            assert s.groups_finished + s.groups_failed == s.groups_dispatched
            assert buffer.statistics().put == s.groups_finished
            while True:  # every failed group is reported
                try:
                    r.raise_pending()
                except rlnb.RolloutError:
                    continue
                break

    asyncio.run(main())
    assert checks > 100 and not violations, violations[:3]


# -- 7. staleness bound ----------------------------------------------------------------------


def test_staleness_bound_stops_background_dispatch_until_the_learner_advances() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(engine, group_size=2, max_inflight=16, max_staleness=0, groups_per_step=2) as (
            r,
            buffer,
        ):
            await r.start()
            await until(lambda: r.statistics().groups_finished == 2, "2 groups in the buffer")
            await settle()
            assert r.statistics().groups_dispatched == 2 and r.dispatching

            await r.set_version(1)
            await until(lambda: r.statistics().groups_finished == 4, "4 groups in the buffer")
            await settle()
            assert r.statistics().groups_dispatched == 4
            assert buffered_ids(buffer) == [0, 1, 2, 3]

    asyncio.run(main())


def test_collect_does_not_use_up_the_background_staleness_budget() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(engine, group_size=2, max_inflight=16, max_staleness=0, groups_per_step=2) as (
            r,
            buffer,
        ):
            assert len(await r.collect(3)) == 3  # inspection only: these never reach the learner
            await r.start()
            await until(lambda: buffer.statistics().put == 2, "2 groups in the buffer")
            await settle()
            assert buffer.statistics().put == 2

    asyncio.run(main())


# -- 8. WAIT drains ---------------------------------------------------------------------------


def test_pause_wait_lets_in_flight_samples_finish_and_wait_paused_returns_once_drained() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=6, token_delay=DELAY)
        async with make_rollouter(engine, group_size=4, max_inflight=16, max_staleness=0, groups_per_step=2) as (
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
        async with make_rollouter(engine, group_size=4, max_inflight=16, max_staleness=0, groups_per_step=2) as (
            r,
            _,
        ):
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


def test_pause_and_resume_during_a_weight_sync_raise_and_the_sync_completes() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=4)
        engine.update_gate = asyncio.Event()
        async with make_rollouter(engine, group_size=2, max_inflight=2) as (r, _):
            sync = asyncio.create_task(r.sync_weights({"w": 1.0}, version=1))
            await until(lambda: r.state is RolloutState.SYNCING, "the sync to start")
            with pytest.raises(rlnb.RolloutError, match="weight sync"):
                await r.pause("abort")
            with pytest.raises(rlnb.RolloutError, match="weight sync"):
                await r.resume()
            with pytest.raises(rlnb.WeightSyncError, match="syncing"):
                await r.sync_weights({"w": 2.0}, version=2)
            engine.update_gate.set()
            await sync
            assert r.state is RolloutState.RUNNING and engine.statistics().version == 1

    asyncio.run(main())


def test_after_aclose_every_call_raises_closed_and_no_task_is_left() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=10**6, token_delay=0.005)
        buffer = ReplayBuffer(16)
        r = Rollouter(
            engine,
            prompts=prompt_stream(),
            encode=encode,
            decode=decode,
            reward_fn=constant_reward,
            buffer=buffer,
            group_size=2,
            max_inflight=8,
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


# -- bugs: cancellation leaks ------------------------------------------------------------------


def test_stop_while_the_dispatcher_waits_for_capacity_does_not_shrink_capacity() -> None:
    def lengths(request: GenerateRequest) -> int:
        return 1 if parse_id(request.request_id)[1] == 0 else 20  # sample 0 frees a permit first

    async def main() -> None:
        engine = RecordingEngine(lengths=lengths, token_delay=0.001)
        async with make_rollouter(engine, group_size=4, max_inflight=4, max_staleness=None) as (r, _):
            await r.start()
            await until(lambda: r.statistics().finished == 1, "sample 0 to finish")
            await settle()  # the dispatcher takes the freed permit and waits for 3 more
            await r.stop()
            await until(lambda: r.statistics().in_flight == 0, "the group to finish")
            collect = asyncio.create_task(r.collect(1))
            done, _ = await asyncio.wait({collect}, timeout=0.5)
            if not done:
                collect.cancel()
                await asyncio.gather(collect, return_exceptions=True)
            assert done, "collect(1) cannot get a group's capacity back after stop()"

    asyncio.run(main())


def test_collect_cancelled_before_its_groups_start_releases_their_capacity() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(engine, group_size=4, max_inflight=8) as (r, _):
            task = asyncio.create_task(r.collect(1))
            await asyncio.sleep(0)  # collect has dispatched and is waiting for its group
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await until(lambda: r.statistics().in_flight == 0, "the cancelled group to be accounted", timeout=0.5)
            assert_counts_add_up(r.statistics())

    asyncio.run(main())


def test_cancelled_collect_stops_the_groups_it_already_dispatched() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=10**6, token_delay=0.002)
        async with make_rollouter(engine, group_size=4, max_inflight=8) as (r, _):
            task = asyncio.create_task(r.collect(5))  # 2 groups fit; it waits for a third
            await until(lambda: engine.statistics().running == 8, "2 groups generating")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert engine.statistics().running == 0
            assert r.statistics().in_flight == 0

    asyncio.run(main())


def test_a_full_buffer_holds_dispatch_back_and_taking_lets_it_go_on() -> None:
    async def main() -> None:
        engine = FakeEngine(lengths=2)
        async with make_rollouter(engine, buffer_capacity=1, group_size=2, max_inflight=4, max_staleness=None) as (
            rollouter,
            buffer,
        ):
            await rollouter.start()
            await until(lambda: rollouter.statistics().groups_finished >= 3, "groups beyond the buffer's room")
            await settle(200)
            held = rollouter.statistics().groups_dispatched
            await settle(200)
            # One group in the buffer, one waiting to go in, the in-flight ones: no more.
            assert rollouter.statistics().groups_dispatched == held <= 1 + 1 + 4 // 2
            # Once the learner has taken every finished group, dispatch goes on.
            for _ in range(held):
                await asyncio.to_thread(buffer.get, 1, 5.0)
                await settle(20)
                if rollouter.statistics().groups_dispatched > held:
                    break
            await until(lambda: rollouter.statistics().groups_dispatched > held, "dispatch to go on")
            assert_counts_add_up(rollouter.statistics())

    asyncio.run(main())

"""The Rollouter's dispatch and accounting, driven by a scripted FakeEngine: partial
rollouts, failures, counting, the policy-lag budget and cancellation.

Every test runs its own event loop with ``asyncio.run`` and closes what it made.
Assertions are on ordering and counts, never on wall-clock thresholds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle

import pytest

import rlnb
from rlnb.engines import FakeEngine, GenerateRequest, PromptTooLong, SamplingParams
from rlnb.rollout import PromptItem, RolloutState, RolloutStatistics
from tests.helpers import assert_counts_add_up, cause_chain
from tests.rollout.helpers import (
    DELAY,
    EOS,
    SLOW,
    RecordingEngine,
    buffered_ids,
    encode,
    groups_ended,
    make_rollouter,
    next_pending_error,
    parse_id,
    settle,
    until,
)

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
                assert sample.continued_at[0] == len(aborted.token_ids)  # where the pause cut it
        s = r.statistics()
        assert (s.finished, s.kept_partial, s.in_flight, s.continuations) == (8, 0, 0, 8)

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
            engine, group_size=2, max_inflight=8, max_policy_lag=0, groups_per_step=3, max_retries=1
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
            engine, group_size=2, max_inflight=8, max_policy_lag=0, groups_per_step=2, reward_fn=reward
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
            with pytest.raises(rlnb.RolloutError, match=r"failed 3 times: RuntimeError\('down'\)$"):  # and why
                await r.collect(1)
            assert len(engine.requests) == 3  # one try and two retries
            assert r.statistics().retries == 2

    asyncio.run(main())


def test_a_prompt_the_engine_finds_too_long_fails_at_once_naming_it() -> None:
    def refuse_prompt_1(request: GenerateRequest) -> BaseException | None:
        if parse_id(request.request_id)[0] != 1:
            return None
        return PromptTooLong(
            f"request {request.request_id}: prompt and prefix take 40 tokens, leaving no room in the model's "
            "context of 32",
            tokens=40,
            context=32,
        )

    async def main() -> None:
        engine = RecordingEngine(lengths=2, fail=refuse_prompt_1)
        sampling = SamplingParams(max_new_tokens=4)
        async with make_rollouter(engine, group_size=2, max_inflight=2, max_retries=2, sampling=sampling) as (r, _):
            await r.collect(1)
            with pytest.raises(rlnb.RolloutError) as caught:  # three tries each, the reason two causes down
                await r.collect(1)
            assert str(caught.value).startswith(
                "rollout failed: prompt 1 ('1+1=') takes 40 tokens, and with up to 4 new tokens it needs 44 positions, "
                "more than the model's context of 32 (ModelConfig.max_len) (the engine refused it, not retried: "
                "request 1.0.0.0: "
            ), caught.value
            assert "make the task's prompts shorter, or use ModelConfig.max_len >= 44" in str(caught.value)
            assert sorted(q.request_id for q in engine.requests if q.request_id.startswith("1.")) == [
                "1.0.0.0",
                "1.1.0.0",
            ]
            assert r.statistics().retries == 0
        refused = refuse_prompt_1(GenerateRequest("1.0.0.0", (3,)))
        assert pickle.loads(pickle.dumps(refused)).tokens == 40  # it crosses to a process engine's parent whole

    asyncio.run(main())


def test_a_prompt_too_long_for_the_context_is_refused_before_it_generates_or_skipped() -> None:
    def encode_long_thirds(text: str) -> list[int]:  # prompts 1, 4, 7...: 20 tokens
        return [3] * (20 if int(text.split("+")[0]) % 3 == 1 else 4)

    async def main() -> None:
        engine = RecordingEngine(lengths=2)
        sampling = SamplingParams(max_new_tokens=4)
        kwargs = {"group_size": 1, "max_inflight": 4, "sampling": sampling, "encode": encode_long_thirds}
        async with make_rollouter(engine, max_context=16, **kwargs) as (r, _):
            await r.collect(1)
            with pytest.raises(rlnb.RolloutError) as caught:
                await r.collect(2)
            message = str(caught.value)
            assert message.startswith(
                "prompt 1 ('1+1=') takes 20 tokens, and with up to 4 new tokens it needs 24 positions, more than "
                "the model's context of 16 (ModelConfig.max_len): "
            )
            assert message.endswith('DataConfig(on_bad_prompt="skip") skips such prompts, counting them')
            assert not any(q.request_id.startswith("1.") for q in engine.requests)  # nothing was generated for it
            assert [g.prompt_id for g in await r.collect(2)] == [2, 3]  # the stream goes on
            s = r.statistics()
            assert (s.bad_prompts, s.failed, s.retries) == (1, 0, 0)
            assert_counts_add_up(s)
        async with make_rollouter(engine, max_context=16, on_bad_prompt="skip", **kwargs) as (r, _):
            assert [g.prompt_id for g in await r.collect(4)] == [0, 2, 3, 5]
            s = r.statistics()
            assert s.bad_prompts == 2 and s.last_bad_prompt is not None and s.last_bad_prompt.startswith("prompt 4 ")
        every = {**kwargs, "encode": lambda text: [3] * 20}
        async with make_rollouter(engine, max_context=16, on_bad_prompt="skip", **every) as (r, _):
            with pytest.raises(rlnb.RolloutError, match=r"^1000 prompts in a row were bad and skipped .*the last: "
                               r"prompt 999 "):  # fmt: skip
                await r.collect(1)  # it looked for a prompt that fits for ever, holding the event loop

    asyncio.run(main())


# -- 6. counting invariant ----------------------------------------------------------------


def test_every_dispatched_sample_is_finished_kept_failed_cancelled_or_in_flight_at_all_times() -> None:
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
        async with make_rollouter(engine, group_size=4, max_inflight=16, max_policy_lag=None, max_retries=1) as (
            r,
            buffer,
        ):

            async def watch() -> None:  # checks between every step of every other task
                nonlocal checks
                while True:
                    s = r.statistics()
                    if s.dispatched != s.finished + s.kept_partial + s.failed + s.cancelled + s.in_flight:
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
            await until(groups_ended(r), "the last groups to finish")
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


# -- 7. policy-lag budget -------------------------------------------------------------------


def test_policy_lag_budget_stops_background_dispatch_until_the_learner_takes_a_batch() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(engine, group_size=2, max_inflight=16, max_policy_lag=0, groups_per_step=2) as (
            r,
            buffer,
        ):
            await r.start()
            await until(lambda: r.statistics().groups_finished == 2, "2 groups in the buffer")
            await settle()
            s = r.statistics()
            assert s.groups_dispatched == 2 and r.dispatching
            assert (s.groups_live, s.groups_allowed) == (2, 2)

            await r.set_version(5)  # a version alone (a loaded checkpoint's) opens nothing
            await settle()
            assert r.statistics().groups_dispatched == 2

            assert [g.prompt_id for g in buffer.get_nowait(2)] == [0, 1]  # the learner takes its batch
            await r.set_version(6)
            await until(lambda: r.statistics().groups_finished == 4, "2 more groups in the buffer")
            await settle()
            assert r.statistics().groups_dispatched == 4
            assert buffered_ids(buffer) == [2, 3]

    asyncio.run(main())


def test_a_new_config_reaches_the_groups_dispatched_after_it_and_the_budget_at_once() -> None:
    # Session.set hands the rollouter a whole RolloutConfig: each live field must take effect.
    seen: list[GenerateRequest] = []

    def two_tokens(request: GenerateRequest) -> int:
        seen.append(request)
        return 2

    async def main() -> None:
        engine = RecordingEngine(lengths=two_tokens)
        async with make_rollouter(engine, group_size=2, max_inflight=16, max_policy_lag=0, groups_per_step=2) as (
            r,
            buffer,
        ):
            await r.start()
            await until(lambda: r.statistics().groups_finished == 2, "2 groups in the buffer")
            await settle()
            assert r.statistics().groups_dispatched == 2  # the budget is spent

            sampling = SamplingParams(temperature=0.5, max_new_tokens=10**9)
            config = dataclasses.replace(r.config, group_size=4, max_policy_lag=1, groups_per_step=3)
            await r.configure(config, sampling)
            assert r.config == config and r.statistics().groups_allowed == 6  # (1 + 1) x 3
            await until(lambda: r.statistics().groups_finished == 6, "4 more groups, under the new budget")
            await settle()
            assert r.statistics().groups_dispatched == 6
            groups = buffer.get_nowait(6)
            assert [len(g.samples) for g in groups] == [2, 2, 4, 4, 4, 4]
            temperatures = {(parse_id(q.request_id)[0] >= 2, q.sampling.temperature) for q in seen}
            assert temperatures == {(False, 1.0), (True, 0.5)}  # the groups dispatched after the change

            with pytest.raises(rlnb.ConfigError, match=r"RolloutConfig\.max_inflight cannot change"):
                await r.configure(dataclasses.replace(config, max_inflight=32), sampling)
            assert r.config == config  # nothing changed

    asyncio.run(main())


def test_failed_and_evicted_groups_give_their_budget_back() -> None:
    """Groups that never reach the learner must not use up the budget for good: with
    the old counter, failures beyond the budget stalled async training for ever."""

    def reward(item: PromptItem, completion: str) -> float:
        if item.prompt_id < 4:
            raise ValueError(f"no reward for prompt {item.prompt_id}")
        return 1.0

    async def main() -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(
            engine,
            reward_fn=reward,
            buffer_capacity=16,
            buffer_max_staleness=0,
            group_size=2,
            max_inflight=16,
            max_policy_lag=0,
            groups_per_step=2,
            max_retries=0,
        ) as (rollouter, buffer):
            for failed in (2, 4):  # groups 0-1, then 2-3 fail: twice the budget
                await rollouter.start()
                await until(lambda n=failed: rollouter.statistics().groups_failed == n, "2 groups to fail")
                await settle()
                error = await next_pending_error(rollouter)
                assert any("no reward for prompt" in str(e) for e in cause_chain(error)), cause_chain(error)
                # a failed group halts dispatch until the next start(): no storm of failures
                assert rollouter.statistics().groups_dispatched == failed
            await rollouter.start()
            await until(lambda: buffer.statistics().put == 2, "groups 4 and 5 in the buffer")
            assert buffered_ids(buffer) == [4, 5]
            assert rollouter.statistics().groups_live == 0
            await rollouter.set_version(0)  # the learner took a batch

            await until(lambda: buffer.statistics().put == 4, "groups 6 and 7 in the buffer")
            await rollouter.sync_weights({}, 1)
            buffer.set_version(1)  # the learner moved on without them: too stale, evicted
            assert buffer.statistics().evicted_stale == 2
            await rollouter.set_version(1)
            await until(lambda: buffer.statistics().put == 6, "two more groups in the buffer")
            assert buffered_ids(buffer) == [8, 9]
            assert_counts_add_up(rollouter.statistics())

    asyncio.run(main())


def test_a_group_keeps_the_token_ids_its_prompt_was_rolled_out_with() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(engine, group_size=2, max_inflight=4) as (r, _):
            [group] = await r.collect(1)
        assert group.prompt_ids == tuple(encode(group.prompt)) != ()
        assert {request.prompt_ids for request in engine.requests} == {group.prompt_ids}

    asyncio.run(main())


def test_publish_carries_the_version_to_the_engine_the_rollouter_and_the_buffer() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(
            engine, buffer_max_staleness=0, group_size=2, max_inflight=16, max_policy_lag=0, groups_per_step=2
        ) as (r, buffer):
            await r.start()
            await until(lambda: buffer.statistics().put == 2, "2 groups in the buffer")
            await settle()
            assert r.statistics().groups_dispatched == 2  # the budget is spent
            engine.calls.clear()
            weights = {"w": 1.0}
            await r.publish(weights, 1)
            assert engine.calls == ["pause:keep", "update:1", "resume"]
            assert engine.weights is weights and engine.statistics().version == 1
            assert r.statistics().version == 1 and buffer.statistics().version == 1
            assert buffer.statistics().evicted_stale == 2  # made by version 0: too stale now
            # Their places in the budget are free, so dispatch goes on, on the new weights.
            await until(lambda: buffer.statistics().put == 4, "2 new groups in the buffer")
            assert {v for g in buffer.get_nowait(2) for s in g.samples for v in s.versions} == {1}
            assert r.state is RolloutState.RUNNING

    asyncio.run(main())


def test_a_failed_publish_changes_no_version_and_a_retry_publishes_it_all() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=2)
        engine.update_error = RuntimeError("weights unreadable")
        async with make_rollouter(
            engine, buffer_max_staleness=0, group_size=2, max_inflight=16, max_policy_lag=0, groups_per_step=2
        ) as (r, buffer):
            await r.start()
            await until(lambda: buffer.statistics().put == 2, "2 groups in the buffer")
            with pytest.raises(rlnb.WeightSyncError, match="version 1"):
                await r.publish({"w": 1.0}, 1)
            assert r.state is RolloutState.PAUSED  # on the old weights
            versions = (engine.statistics().version, r.statistics().version, buffer.statistics().version)
            assert versions == (0, 0, 0) and buffer.statistics().evicted_stale == 0

            engine.update_error = None
            await r.publish({"w": 1.0}, 1)
            versions = (engine.statistics().version, r.statistics().version, buffer.statistics().version)
            assert versions == (1, 1, 1) and buffer.statistics().evicted_stale == 2
            assert r.state is RolloutState.PAUSED  # until resume()

    asyncio.run(main())


def test_collect_does_not_use_up_the_background_policy_lag_budget() -> None:
    async def main() -> None:
        engine = RecordingEngine(lengths=2)
        async with make_rollouter(engine, group_size=2, max_inflight=16, max_policy_lag=0, groups_per_step=2) as (
            r,
            buffer,
        ):
            assert len(await r.collect(3)) == 3  # inspection only: these never reach the learner
            await r.start()
            await until(lambda: buffer.statistics().put == 2, "2 groups in the buffer")
            await settle()
            assert buffer.statistics().put == 2

    asyncio.run(main())


# -- bugs: cancellation leaks ------------------------------------------------------------------


def test_stop_while_the_dispatcher_waits_for_capacity_does_not_shrink_capacity() -> None:
    def lengths(request: GenerateRequest) -> int:
        return 1 if parse_id(request.request_id)[1] == 0 else 20  # sample 0 frees a permit first

    async def main() -> None:
        engine = RecordingEngine(lengths=lengths, token_delay=0.001)
        async with make_rollouter(engine, group_size=4, max_inflight=4, max_policy_lag=None) as (r, _):
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
        async with make_rollouter(engine, buffer_capacity=1, group_size=2, max_inflight=4, max_policy_lag=None) as (
            rollouter,
            buffer,
        ):
            await rollouter.start()
            await until(lambda: rollouter.statistics().groups_finished >= 3, "groups beyond the buffer's room")
            await settle(200)
            held = rollouter.statistics().groups_dispatched
            await settle(200)
            # Dispatch stops: one group in the buffer, the groups generating when the first
            # one was held (max_inflight // group_size), and at most as many again, started in
            # the capacity those freed with their last samples, just before each was held
            # (capacity is the engine's: it is given back when a sample ends, before its
            # reward and its group's hold). Then nothing more.
            assert rollouter.statistics().groups_dispatched == held <= 1 + 2 * (4 // 2)
            # Once the learner has taken every finished group, dispatch goes on.
            for _ in range(held):
                await asyncio.to_thread(buffer.get, 1, 5.0)
                await settle(20)
                if rollouter.statistics().groups_dispatched > held:
                    break
            await until(lambda: rollouter.statistics().groups_dispatched > held, "dispatch to go on")
            assert_counts_add_up(rollouter.statistics())

    asyncio.run(main())


# -- errors are never discarded ---------------------------------------------------------------


def test_evaluate_stops_every_other_prompt_at_the_first_failure() -> None:
    def fail(request: GenerateRequest) -> BaseException | None:
        return RuntimeError("the engine lost prompt 0") if request.request_id == "eval.0" else None

    async def main() -> None:
        engine = RecordingEngine(lengths=10**6, token_delay=DELAY, fail=fail)
        async with make_rollouter(engine, group_size=2, max_inflight=8) as (r, _):
            items = [PromptItem(i, f"{i}+{i}=", str(2 * i)) for i in range(4)]
            with pytest.raises(rlnb.RolloutError, match=r"evaluation failed \(1 of 4 prompts\)") as raised:
                await r.evaluate(items, max_new_tokens=10**6)
            assert "the engine lost prompt 0" in str(raised.value.__cause__)
            await until(lambda: engine.statistics().running == 0, "the other prompts to stop generating")

    asyncio.run(main())


def test_a_group_that_failed_before_collect_was_interrupted_is_reported_at_the_next_call() -> None:
    def fail(request: GenerateRequest) -> BaseException | None:
        return RuntimeError("prompt 0 is broken") if parse_id(request.request_id)[0] == 0 else None

    async def main() -> None:
        engine = RecordingEngine(lengths=10**6, token_delay=DELAY, fail=fail)
        async with make_rollouter(engine, group_size=2, max_inflight=8, max_retries=0) as (r, _):
            collect = asyncio.create_task(r.collect(2))
            await until(lambda: r.statistics().groups_failed == 1, "group 0 to fail")
            collect.cancel()  # Ctrl-C while group 1 still generates
            with pytest.raises(asyncio.CancelledError):
                await collect
            error = await next_pending_error(r)
            assert any("prompt 0 is broken" in str(e) for e in cause_chain(error))

    asyncio.run(main())


def test_a_wait_pause_finishes_groups_whose_samples_had_not_reached_the_engine() -> None:
    # A group dispatched just before a WAIT pause has samples that have not reached the
    # engine yet: the drain lets them go and ends once the group has ended, in the
    # buffer. It used to report "paused" with them queued for good (issue 42, item 2).
    async def main() -> None:
        engine = RecordingEngine(lengths=3, token_delay=DELAY)
        async with make_rollouter(engine, group_size=4, max_inflight=8) as (r, buffer):
            await r.start()
            while not r.statistics().dispatched:  # one turn of the loop at a time
                await asyncio.sleep(0)
            assert r.statistics().in_flight > 0 and engine.statistics().running == 0
            await r.pause("wait")  # before the dispatched samples had a turn to reach the engine
            await r.wait_paused(timeout=5)
            s = r.statistics()
            assert s.state == "paused" and s.in_flight == 0 and s.queued == 0, s
            assert s.groups_finished == s.groups_dispatched > 0, s
            assert buffer.size() + buffer.held() == s.groups_dispatched
            assert engine.statistics().running == 0
            assert_counts_add_up(s)
            await r.resume()

    asyncio.run(main())

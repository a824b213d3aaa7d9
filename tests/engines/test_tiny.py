from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import torch

import rlnb
from rlnb.engines import GenerateRequest, GenerateResult, PauseMode, SamplingParams
from rlnb.engines._tiny import TinyEngine
from rlnb.models import CharTokenizer, TinyPolicy
from rlnb.runtime import AsyncBridge
from tests.helpers import ctrl_c_once

TOKENIZER = CharTokenizer("0123456789+=")
EOS = TOKENIZER.EOS


@pytest.fixture(scope="module")
def policy() -> TinyPolicy:
    return TinyPolicy(rlnb.ModelConfig(vocab_size=TOKENIZER.vocab_size, d_model=32, n_layers=2, n_heads=2, max_len=40))


@pytest.fixture
def engine(policy: TinyPolicy) -> Iterator[TinyEngine]:
    eng = TinyEngine(policy, rlnb.EngineConfig(max_batch=8), eos_id=EOS)
    yield eng
    eng.close()


@pytest.fixture
def bridge() -> Iterator[AsyncBridge]:
    with AsyncBridge(name="engine-test") as b:
        yield b


def request(rid: str, prompt: str = "12+34=", *, seed: int = 0, prefix: tuple[int, ...] = (), **sampling: object):
    return GenerateRequest(
        rid, tuple(TOKENIZER.encode(prompt, bos=True)), SamplingParams(**sampling), prefix_ids=prefix, seed=seed
    )


async def decoding(engine: TinyEngine, start: Callable[[int], Awaitable[object]]) -> asyncio.Task[Any]:
    """A task of ``start(attempt)`` (a request) once the engine is decoding it. On a quiet
    machine a request can finish between two looks; then another one is started, so a
    test that needs one in flight never waits on a request that has already ended."""
    for attempt in range(50):
        task = asyncio.ensure_future(start(attempt))
        while not task.done():
            if engine.statistics().running:
                return task
            await asyncio.sleep(0)
        await task
    raise AssertionError("no request was ever seen decoding in 50 tries")


def greedy_continuation(policy: TinyPolicy, ids: list[int], n: int) -> list[int]:
    """The reference: n greedy tokens by re-running forward() on the whole sequence."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(policy(torch.tensor([out]))[0, -1].argmax()))
    return out[len(ids) :]


def test_greedy_decoding_matches_the_model_run_from_scratch(
    engine: TinyEngine, bridge: AsyncBridge, policy: TinyPolicy
) -> None:
    result = bridge.run(engine.generate(request("g", temperature=0.0, max_new_tokens=6, ignore_eos=True)))
    ids = TOKENIZER.encode("12+34=", bos=True)
    assert list(result.token_ids) == greedy_continuation(policy, ids, 6)
    assert result.finish_reason == "length" and result.versions == (0,) * 6


def test_logprobs_are_those_of_the_sampling_distribution(
    engine: TinyEngine, bridge: AsyncBridge, policy: TinyPolicy
) -> None:
    # No ignore_eos here: masking EOS changes the sampling distribution, and the
    # recorded log-probs follow the distribution actually sampled from.
    result = bridge.run(engine.generate(request("s", seed=3, max_new_tokens=8)))
    assert result.token_ids
    ids = TOKENIZER.encode("12+34=", bos=True) + list(result.token_ids)
    with torch.no_grad():
        logp = policy(torch.tensor([ids]))[0].log_softmax(-1)
    start = len(ids) - len(result.token_ids) - 1
    expected = [float(logp[start + i, t]) for i, t in enumerate(result.token_ids)]
    assert result.logprobs == pytest.approx(expected, abs=1e-4)


def test_top_k_one_is_greedy_and_seeds_reproduce_whatever_shares_the_batch(
    engine: TinyEngine, bridge: AsyncBridge
) -> None:
    async def alone() -> list[tuple[int, ...]]:
        return [(await engine.generate(request("a", seed=7, max_new_tokens=8))).token_ids]

    async def crowded() -> list[tuple[int, ...]]:
        others = [request(f"o{i}", "5+5=", seed=100 + i, max_new_tokens=8) for i in range(5)]
        mine = engine.generate(request("a", seed=7, max_new_tokens=8))
        results = await asyncio.gather(mine, *map(engine.generate, others))
        return [results[0].token_ids]

    assert bridge.run(alone()) == bridge.run(crowded())
    top1 = bridge.run(engine.generate(request("k", top_k=1, max_new_tokens=5, ignore_eos=True)))
    greedy = bridge.run(engine.generate(request("t", temperature=0.0, max_new_tokens=5, ignore_eos=True)))
    assert top1.token_ids == greedy.token_ids


def test_short_requests_finish_while_a_long_one_keeps_decoding(engine: TinyEngine, bridge: AsyncBridge) -> None:
    async def scenario() -> list[str]:
        order: list[str] = []

        async def run(rid: str, n: int) -> None:
            await engine.generate(request(rid, max_new_tokens=n, ignore_eos=True))
            order.append(rid)

        long = await decoding(engine, lambda _: run("long", 30))  # decoding before the short ones come
        await asyncio.gather(run("short1", 2), run("short2", 3))  # join at a step boundary, leave at once
        await long
        return order

    assert bridge.run(scenario()) == ["short1", "short2", "long"]
    assert engine.statistics().extra["mean_batch"] > 1


def test_a_continuation_conditions_on_its_prefix(engine: TinyEngine, bridge: AsyncBridge, policy: TinyPolicy) -> None:
    ids = TOKENIZER.encode("12+34=", bos=True)
    reference = greedy_continuation(policy, ids, 6)
    cont = bridge.run(
        engine.generate(request("c", prefix=tuple(reference[:2]), temperature=0.0, max_new_tokens=4, ignore_eos=True))
    )
    assert list(cont.token_ids) == reference[2:]


def test_pause_keep_freezes_and_abort_returns_partial_rollouts(engine: TinyEngine, bridge: AsyncBridge) -> None:
    async def scenario() -> None:
        running = [
            asyncio.create_task(engine.generate(request(f"r{i}", max_new_tokens=35, ignore_eos=True))) for i in range(4)
        ]
        while engine.statistics().generated_tokens < 8:
            await asyncio.sleep(0.001)
        await engine.pause(PauseMode.KEEP)
        frozen = engine.statistics().generated_tokens
        await asyncio.sleep(0.05)
        assert engine.statistics().generated_tokens == frozen  # nothing decodes while kept
        await engine.resume()
        await engine.pause(PauseMode.ABORT)
        assert engine.statistics().running == 0  # quiescent when pause() returns
        results = await asyncio.gather(*running)
        assert {r.finish_reason for r in results} == {"aborted"}
        assert all(0 < len(r.token_ids) < 35 for r in results)
        queued = asyncio.create_task(engine.generate(request("later", max_new_tokens=2)))
        await asyncio.sleep(0.02)
        assert not queued.done()  # paused engines admit nothing
        await engine.resume()
        assert (await queued).finish_reason in ("stop", "length")

    bridge.run(scenario())


def test_pause_wait_lets_in_flight_finish_but_admits_nothing(engine: TinyEngine, bridge: AsyncBridge) -> None:
    async def scenario() -> None:
        first = await decoding(
            engine, lambda i: engine.generate(request(f"first{i}", max_new_tokens=10, ignore_eos=True))
        )
        await engine.pause(PauseMode.WAIT)
        second = asyncio.create_task(engine.generate(request("second", max_new_tokens=2)))
        assert (await first).finish_reason == "length"
        await asyncio.sleep(0.02)
        assert not second.done()
        await engine.resume()
        await second

    bridge.run(scenario())


def test_weights_update_between_steps_and_stamp_later_tokens(
    engine: TinyEngine, bridge: AsyncBridge, policy: TinyPolicy
) -> None:
    async def scenario() -> tuple[int, ...]:
        task = asyncio.create_task(engine.generate(request("w", max_new_tokens=35, ignore_eos=True)))
        while engine.statistics().generated_tokens < 3:
            await asyncio.sleep(0.001)
        await engine.update_weights(policy.state_dict(), 1)
        return (await task).versions

    versions = bridge.run(scenario())
    assert versions[0] == 0 and versions[-1] == 1 and list(versions) == sorted(versions)
    with pytest.raises(RuntimeError, match="state_dict"):
        bridge.run(engine.update_weights({"nope": torch.zeros(1)}, 2))
    assert engine.statistics().version == 1  # a failed update changes nothing


def test_abort_by_id_and_context_overflow(engine: TinyEngine, bridge: AsyncBridge) -> None:
    async def scenario() -> str:
        ids: list[str] = []

        def start(attempt: int) -> Awaitable[GenerateResult]:
            ids.append(f"x{attempt}")
            return engine.generate(request(ids[-1], max_new_tokens=35, ignore_eos=True))

        task = await decoding(engine, start)
        await engine.abort([ids[-1], "unknown"])
        return (await task).finish_reason

    assert bridge.run(scenario()) == "aborted"
    with pytest.raises(ValueError, match="no room"):
        bridge.run(engine.generate(request("big", "1" * 45)))


def test_close_fails_waiting_callers_and_stops_the_thread(policy: TinyPolicy, bridge: AsyncBridge) -> None:
    engine = TinyEngine(policy, rlnb.EngineConfig(max_batch=2), eos_id=EOS)
    bridge.run(engine.pause(PauseMode.KEEP))
    fut = bridge.submit(engine.generate(request("stuck")))
    engine.close()
    engine.close()
    with pytest.raises(rlnb.ClosedError):
        fut.result(timeout=5)
    assert not engine._thread.is_alive()
    with pytest.raises(rlnb.ClosedError):
        bridge.run(engine.generate(request("after")))


def test_ctrl_c_interrupts_the_caller_not_the_engine(engine: TinyEngine, bridge: AsyncBridge) -> None:
    started = threading.Event()

    async def long_generation() -> None:
        started.set()
        await engine.generate(request("long", max_new_tokens=35, ignore_eos=True))
        await asyncio.sleep(30)

    with ctrl_c_once(started):
        bridge.run(long_generation())
    assert engine._thread.is_alive()
    result = bridge.run(engine.generate(request("next", max_new_tokens=3, ignore_eos=True)))
    assert len(result.token_ids) == 3


def test_a_group_of_identical_prompts_is_prefilled_once_and_each_copy_decodes_as_if_alone(
    engine: TinyEngine, bridge: AsyncBridge, policy: TinyPolicy
) -> None:
    # The engine runs each distinct prompt once and copies its keys and values into
    # the other slots: every copy must still see its own prompt (two prompts of
    # different lengths, interleaved) and sample with its own seed.
    prompts = ["12+34=", "7+8=", "12+34=", "7+8=", "12+34=", "7+8="]

    async def together() -> list[tuple[int, ...]]:
        reqs = [request(f"r{i}", p, seed=i, max_new_tokens=6, ignore_eos=True) for i, p in enumerate(prompts)]
        return [r.token_ids for r in await asyncio.gather(*map(engine.generate, reqs))]

    async def one_by_one() -> list[tuple[int, ...]]:
        out = []
        for i, p in enumerate(prompts):
            out.append(
                (await engine.generate(request(f"a{i}", p, seed=i, max_new_tokens=6, ignore_eos=True))).token_ids
            )
        return out

    shared = bridge.run(together())
    assert shared == bridge.run(one_by_one())
    assert len(set(shared[0::2])) > 1  # distinct seeds sampled distinct completions of one prompt

    async def greedy_all() -> list[GenerateResult]:
        reqs = [request(f"g{i}", p, temperature=0.0, max_new_tokens=5) for i, p in enumerate(prompts)]
        return list(await asyncio.gather(*map(engine.generate, reqs)))

    greedy = bridge.run(greedy_all())
    for p, result in zip(prompts, greedy, strict=True):
        expected = greedy_continuation(policy, TOKENIZER.encode(p, bos=True), 5)
        assert list(result.token_ids) == expected[: len(result.token_ids)]


def test_engine_threads_apply_to_the_engine_thread_only(policy: TinyPolicy, bridge: AsyncBridge) -> None:
    before = torch.get_num_threads()
    engine = TinyEngine(policy, rlnb.EngineConfig(max_batch=2, threads=before + 1), eos_id=EOS)
    try:
        seen: list[int] = []
        original = engine._apply_updates  # called on the engine thread every loop

        def probe(updates):  # type: ignore[no-untyped-def]
            seen.append(torch.get_num_threads())
            return original(updates)

        engine._apply_updates = probe  # type: ignore[method-assign]
        bridge.run(engine.generate(request("t", max_new_tokens=2)))
        assert seen and set(seen) == {before + 1}
        assert torch.get_num_threads() == before  # the caller's thread keeps its setting
    finally:
        engine.close()


def test_an_engine_thread_that_dies_fails_every_waiter_and_every_later_call(
    engine: TinyEngine, bridge: AsyncBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fault outside decode and prefill (here: admitting a request) used to kill the
    # thread silently, and every later generate() waited forever.
    broken = RuntimeError("admission broke")

    def admit() -> list[object]:
        raise broken

    monkeypatch.setattr(engine, "_admit", admit)
    with pytest.raises(rlnb.EngineError, match="engine thread died") as info:
        bridge.run(engine.generate(request("a")), timeout=10)
    assert info.value.__cause__ is broken
    with pytest.raises(rlnb.EngineError) as again:  # at once, not after a wait
        bridge.run(engine.generate(request("b")), timeout=1)
    assert again.value.__cause__ is broken
    with pytest.raises(rlnb.EngineError):
        bridge.run(engine.pause(PauseMode.ABORT), timeout=1)
    assert "admission broke" in str(engine.statistics().extra["died"])


def test_a_long_queue_is_prefilled_a_budget_at_a_time_and_each_sample_is_as_if_alone(
    policy: TinyPolicy, bridge: AsyncBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """24 continuations of different prefixes (no shared prompt to prefill once) with a
    budget of 40 prefill tokens: several prefills, none over the budget, and every
    sample is what it is when generated alone (its seed decides it)."""
    prefills: list[int] = []
    engine = TinyEngine(policy, rlnb.EngineConfig(max_batch=32), eos_id=EOS, max_prefill_tokens=40)
    run = engine._prefill

    def spy(seqs: list[Any]) -> None:
        prefills.append(len({(*s.request.prompt_ids, *s.request.prefix_ids) for s in seqs}) * 9)
        run(seqs)

    monkeypatch.setattr(engine, "_prefill", spy)
    requests = [request(f"p{i}", seed=i, prefix=(i % 10, 3), max_new_tokens=4, ignore_eos=True) for i in range(24)]

    async def all_at_once() -> list[GenerateResult]:
        return list(await asyncio.gather(*map(engine.generate, requests)))

    try:
        together = bridge.run(all_at_once(), timeout=30)
        alone = [bridge.run(engine.generate(r)) for r in requests[:3]]
    finally:
        engine.close()
    assert len(prefills) > 3 and max(prefills) <= 40  # 9 tokens each: at most 4 inputs a prefill
    assert [r.token_ids for r in together[:3]] == [r.token_ids for r in alone]

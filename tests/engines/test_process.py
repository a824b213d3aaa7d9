"""``ProcessEngine``: the built-in engine in a child process keeps the Engine protocol
as the in-process engine does (same tokens for the same seeds, every pause mode,
versions across a weight sync through shared memory), and leaves no process: after
``close()``, after the child dies, and after its owner is SIGKILLed."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import torch

import rlnb
from rlnb.engines import GenerateRequest, GenerateResult, PauseMode, ProcessEngine, SamplingParams
from rlnb.engines._process_server import PROCESS_NAME
from rlnb.engines._tiny import TinyEngine
from rlnb.models import CharTokenizer, TinyPolicy
from rlnb.runtime import AsyncBridge
from tests.helpers import exited, guard_processes, wait_until, wait_until_async

pytestmark = pytest.mark.slow  # each test spawns an engine process (~2 s to import torch)

TOKENIZER = CharTokenizer("0123456789+=")
EOS = TOKENIZER.EOS


@pytest.fixture(scope="module")
def policy() -> TinyPolicy:
    return TinyPolicy(rlnb.ModelConfig(vocab_size=TOKENIZER.vocab_size, d_model=32, n_layers=2, n_heads=2, max_len=40))


@pytest.fixture
def bridge() -> Iterator[AsyncBridge]:
    with AsyncBridge(name="process-engine-test") as b:
        yield b


@pytest.fixture
def engine(policy: TinyPolicy) -> Iterator[ProcessEngine]:
    eng = ProcessEngine.start(policy, rlnb.EngineConfig(max_batch=8), eos_id=EOS)
    yield eng
    eng.close()


def request(rid: str, *, seed: int = 0, prefix: tuple[int, ...] = (), **sampling: Any) -> GenerateRequest:
    ids = tuple(TOKENIZER.encode("12+34=", bos=True))
    return GenerateRequest(rid, ids, SamplingParams(**sampling), prefix_ids=prefix, seed=seed)


async def _all(engine: object, requests: list[GenerateRequest]) -> list[GenerateResult]:
    return list(await asyncio.gather(*(engine.generate(r) for r in requests)))  # type: ignore[attr-defined]


def test_it_samples_what_the_in_process_engine_samples(
    engine: ProcessEngine, policy: TinyPolicy, bridge: AsyncBridge
) -> None:
    """Same seeds, same tokens, log-probs and versions; the child runs under its own name."""
    assert psutil.Process(engine.pid).name() == PROCESS_NAME
    requests = [
        *(request(f"s{i}", seed=i, max_new_tokens=12) for i in range(6)),
        request("greedy", temperature=0.0, max_new_tokens=8, ignore_eos=True),
        request("prefixed", seed=9, prefix=(3, 4), max_new_tokens=5),
    ]
    here = TinyEngine(policy, rlnb.EngineConfig(max_batch=8), eos_id=EOS)
    try:
        expected = bridge.run(_all(here, requests))
    finally:
        here.close()
    got = bridge.run(_all(engine, requests))
    for g, e in zip(got, expected, strict=True):
        assert (g.request_id, g.token_ids, g.versions, g.finish_reason) == (
            e.request_id,
            e.token_ids,
            e.versions,
            e.finish_reason,
        )
        assert g.logprobs == pytest.approx(e.logprobs, abs=1e-5)
    stats = engine.statistics()
    assert stats.finished == len(requests) and stats.running == 0 and stats.decode_steps > 0
    assert stats.generated_tokens == sum(len(g.token_ids) for g in got)
    with pytest.raises(ValueError, match="no room"):  # an error stays with its request
        bridge.run(engine.generate(GenerateRequest("big", tuple(range(45)))))


async def decoded(engine: ProcessEngine) -> int:
    """The child's count of decode steps, brought by the answer to a kept pause."""
    await engine.pause(PauseMode.KEEP)
    await engine.resume()
    return engine.statistics().decode_steps


async def decoded_past(engine: ProcessEngine, steps: int) -> bool:
    return await decoded(engine) >= steps


def test_every_pause_mode_and_a_weight_sync_through_shared_memory(policy: TinyPolicy, bridge: AsyncBridge) -> None:
    long_policy = TinyPolicy(dataclasses.replace(policy.config, max_len=200))
    other = TinyPolicy(long_policy.config, seed=1)
    engine = ProcessEngine.start(long_policy, rlnb.EngineConfig(max_batch=8), eos_id=EOS)

    async def scenario() -> None:
        long = [
            asyncio.create_task(engine.generate(request(f"r{i}", max_new_tokens=150, ignore_eos=True)))
            for i in range(4)
        ]
        await wait_until_async(lambda: decoded_past(engine, 5), "5 decode steps", every=0.01)
        await engine.pause(PauseMode.KEEP)
        assert engine.statistics().paused == "keep"
        await engine.update_weights(other.state_dict(), 1)  # while kept: later tokens carry v1
        await engine.resume()
        await engine.pause(PauseMode.ABORT)
        assert all(t.done() for t in long)  # every partial rollout is back when pause returns
        results = [t.result() for t in long]
        assert {r.finish_reason for r in results} == {"aborted"}
        assert all(5 <= len(r.token_ids) < 150 for r in results)
        assert all(r.versions[0] == 0 and r.versions == tuple(sorted(r.versions)) for r in results)
        queued = asyncio.create_task(engine.generate(request("later", max_new_tokens=3, ignore_eos=True)))
        await asyncio.sleep(0.1)
        assert not queued.done()  # a paused engine admits nothing
        await engine.resume()
        assert (await queued).versions == (1, 1, 1)
        first = asyncio.create_task(engine.generate(request("first", max_new_tokens=150, ignore_eos=True)))
        await wait_until_async(lambda: decoded_past(engine, 3), "3 decode steps", every=0.01)
        await engine.pause(PauseMode.WAIT)
        second = asyncio.create_task(engine.generate(request("second", max_new_tokens=2)))
        assert (await first).finish_reason == "length"  # in flight: runs to its end
        await asyncio.sleep(0.1)
        assert not second.done()  # asked for after the pause: waits for the resume
        await engine.resume()
        await second

    here = TinyEngine(other, rlnb.EngineConfig(max_batch=2), eos_id=EOS)
    try:
        bridge.run(scenario())
        assert engine.statistics().version == 1
        greedy = request("g", temperature=0.0, max_new_tokens=6, ignore_eos=True)
        assert bridge.run(engine.generate(greedy)).token_ids == bridge.run(here.generate(greedy)).token_ids
        with pytest.raises(RuntimeError, match="state_dict"):
            bridge.run(engine.update_weights({"nope": torch.zeros(1)}, 2))
        assert engine.statistics().version == 1  # a refused update changes nothing
    finally:
        here.close()
        engine.close()


def test_a_cancelled_caller_and_abort_by_id_free_the_child(engine: ProcessEngine, bridge: AsyncBridge) -> None:
    async def scenario() -> tuple[str, int]:
        await engine.pause(PauseMode.KEEP)  # both wait in the child's queue
        cancelled = asyncio.create_task(engine.generate(request("c", max_new_tokens=30, ignore_eos=True)))
        aborted = asyncio.create_task(engine.generate(request("a", max_new_tokens=30, ignore_eos=True)))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        # its cancellation has run (and told the child) before anything resumes the child:
        # awaited after resume(), a loaded machine let the child decode it for a while first
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await engine.abort(["a", "unknown"])
        await engine.resume()
        reason = (await aborted).finish_reason
        steps = engine.statistics().decode_steps
        assert len((await engine.generate(request("n", max_new_tokens=3, ignore_eos=True))).token_ids) == 3
        await asyncio.sleep(0.3)
        await engine.pause(PauseMode.KEEP)  # its answer brings the child's count of decode steps
        await engine.resume()
        return reason, engine.statistics().decode_steps - steps

    reason, steps = bridge.run(scenario())
    assert reason == "aborted"
    assert steps < 10, f"{steps} decode steps: the cancelled request (30 tokens) still ran in the child"


def test_close_fails_waiters_and_leaves_no_process_and_a_dead_child_is_an_engine_error(
    policy: TinyPolicy, bridge: AsyncBridge
) -> None:
    others = guard_processes()
    eng = ProcessEngine.start(policy, rlnb.EngineConfig(max_batch=2), eos_id=EOS)
    child = psutil.Process(eng.pid)
    guard = [psutil.Process(pid) for pid in guard_processes() - others]
    assert len(guard) == 1
    bridge.run(eng.pause(PauseMode.KEEP))
    stuck = bridge.submit(eng.generate(request("stuck")))
    child.kill()
    with pytest.raises(rlnb.EngineError, match=rf"engine process \(pid {eng.pid}\) died: killed by SIGKILL"):
        stuck.result(timeout=10)
    with pytest.raises(rlnb.EngineError, match="died"):
        bridge.run(eng.generate(request("after")))
    eng.close()
    eng.close()  # idempotent
    assert exited(child) and all(exited(p) for p in guard)
    with pytest.raises(rlnb.ClosedError):
        bridge.run(eng.generate(request("late")))

    eng = ProcessEngine.start(policy, rlnb.EngineConfig(max_batch=2), eos_id=EOS)
    child = psutil.Process(eng.pid)
    bridge.run(eng.pause(PauseMode.KEEP))
    waiting = bridge.submit(eng.generate(request("waiting")))
    eng.close()
    with pytest.raises(rlnb.ClosedError):
        waiting.result(timeout=10)
    assert exited(child)
    assert not [t for t in __import__("threading").enumerate() if t.name.endswith("-reader")]


def test_a_cuda_policy_is_refused_before_any_process_starts() -> None:
    class OnGPU:
        device = torch.device("cuda")

    before = psutil.Process().children(recursive=True)
    with pytest.raises(rlnb.EngineError, match="serves on the CPU"):
        ProcessEngine.start(OnGPU(), eos_id=EOS)
    assert psutil.Process().children(recursive=True) == before


OWNER = """
import time
import rlnb
from rlnb.engines import ProcessEngine
from rlnb.models import TinyPolicy

# No `if __name__ == "__main__":` on purpose: the engine must not need one.
engine = ProcessEngine.start(TinyPolicy(rlnb.ModelConfig(vocab_size=16)), eos_id=15)
print("PID", engine.pid, flush=True)
time.sleep(600)
"""


def test_killing_the_owner_leaves_no_engine_process(tmp_path: object) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(OWNER)], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        assert line.startswith("PID "), line
        everyone = psutil.Process(owner.pid).children(recursive=True)
        assert PROCESS_NAME in {p.name() for p in everyone}
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        wait_until(lambda: all(exited(p) for p in everyone), "the guard to kill the engine process", timeout=5.0)
    finally:
        owner.kill()
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()

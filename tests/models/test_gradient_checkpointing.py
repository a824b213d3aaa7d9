"""``ModelConfig(gradient_checkpointing=True)``: transformers' gradient checkpointing
for a Hugging Face model's learner, with the same loss and gradients as without."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import rlnb
from rlnb.learn import LearnConfig, Learner
from rlnb.models import HFPolicy, load_hf_model, load_hf_tokenizer, tiny_llama

pytestmark = pytest.mark.skipif(  # find_spec: importing transformers costs every collection seconds
    importlib.util.find_spec("transformers") is None, reason="the 'hf' extra (transformers) is not installed"
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", hidden_size=64, intermediate_size=128, seed=0)


def _groups(llama_dir: Path) -> list[rlnb.Group]:
    tokenizer = load_hf_tokenizer(llama_dir)
    groups = []
    for prompt, completions in (("12+34=", ["46", "4", "4666"]), ("5+5=", ["10", "1", "100000"])):
        samples = []
        for i, text in enumerate(completions):
            ids = (*tokenizer.encode(text), tokenizer.EOS)
            samples.append(
                rlnb.Sample(
                    prompt=prompt, completion=text, token_ids=ids, logprobs=(-2.5,) * len(ids), reward=float(i == 0)
                )
            )
        groups.append(rlnb.Group(prompt=prompt, samples=tuple(samples)))
    return groups


def _learner(policy: HFPolicy, llama_dir: Path) -> Learner:
    tokenizer = load_hf_tokenizer(llama_dir)
    return Learner(
        policy,
        encode=lambda text: tokenizer.encode(text, bos=True),
        pad_id=tokenizer.PAD,
        eos_id=tokenizer.EOS,
        config=LearnConfig(kl_coef=0.1, max_grad_norm=1e6),
    )


def test_checkpointed_layers_run_again_in_the_backward_pass_and_give_the_same_loss_and_gradients(
    llama_dir: Path,
) -> None:
    plain = load_hf_model(rlnb.ModelConfig(path=str(llama_dir), max_len=32))
    checkpointed = load_hf_model(rlnb.ModelConfig(path=str(llama_dir), max_len=32, gradient_checkpointing=True))
    assert checkpointed.model.is_gradient_checkpointing and not plain.model.is_gradient_checkpointing
    runs: list[str] = []
    for name, layer in checkpointed.model.named_modules():
        if type(layer).__name__ == "LlamaDecoderLayer":
            layer.register_forward_pre_hook(lambda *_, name=name: runs.append(name))
    groups = _groups(llama_dir)
    metrics = [_learner(policy, llama_dir).step(groups) for policy in (plain, checkpointed)]
    # Two layers, a prompt pass and a completion pass, each run again in backward (the
    # no-gradient passes of the KL reference and nothing else run once).
    assert len(runs) == 2 * 2 * 2 + 2 * 2
    for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], abs=1e-5), key
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=0, msg=name)


def test_a_session_trains_a_model_with_gradient_checkpointing(llama_dir: Path) -> None:
    model = rlnb.ModelConfig(path=str(llama_dir), max_len=32, gradient_checkpointing=True)
    config = rlnb.Config(
        model=model,
        rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=2),
        data=rlnb.DataConfig(num_workers=0),
    )
    with rlnb.Session(config, name="hf-checkpointing") as sess:
        assert sess.policy.model.is_gradient_checkpointing
        assert sess.step()["version"] == 1
        assert sess.statistics().engine.version == 1


def test_gradient_checkpointing_of_the_built_in_policy_is_a_config_error() -> None:
    with pytest.raises(
        rlnb.ConfigError,
        match=r"ModelConfig\.gradient_checkpointing=True is invalid: "
        r"it is for Hugging Face models \(ModelConfig\.path\)",
    ):
        rlnb.ModelConfig(gradient_checkpointing=True)
    with pytest.raises(
        rlnb.ConfigError, match=r"ModelConfig\.gradient_checkpointing='yes' is invalid: use True or False"
    ):
        rlnb.ModelConfig(path="/m", gradient_checkpointing="yes")  # type: ignore[arg-type]

"""The critic on Hugging Face models: ``critic="model"`` (a whole copy, every weight
trained) and ``critic="lora"`` (a second adapter on the LoRA policy's own frozen base
weights, shared, not copied), their memory, a resume, and the refusals."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import rlnb
from rlnb.algorithms import preset
from rlnb.models import tiny_llama
from tests.helpers import assert_same_metrics, small_config

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("peft") is None,
    reason="the 'hf' and 'lora' extras (transformers, peft) are not installed",
)

VALUE_METRICS = {"value_loss", "explained_variance", "critic_grad_norm"}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", seed=0)


def _config(path: Path, critic: str, *, lora: bool = True) -> rlnb.Config:
    model = rlnb.ModelConfig(path=str(path), max_len=32, lora=rlnb.LoraConfig(r=4, alpha=8) if lora else None)
    algorithm = preset("ppo").replace(critic=critic)
    return small_config(model=model, learn=rlnb.LearnConfig(algorithm=algorithm, lr=1e-2))


def _trained(critic: object) -> int:
    return sum(p.numel() for p in critic.parameters())  # type: ignore[attr-defined]


def test_a_lora_critic_shares_the_policys_frozen_weights_and_trains_only_its_adapter(llama_dir: Path) -> None:
    with rlnb.Session(_config(llama_dir, "lora"), name="lora-critic") as sess:
        learner = sess._trainer.learner
        critic = learner.critic
        assert critic is not None and critic.kind == "lora"
        frozen = {id(p) for p in learner.policy.parameters() if not p.requires_grad}
        shared = {id(p) for p in critic.model.parameters() if not p.requires_grad}
        assert shared == frozen  # the very tensors: no second copy of the model
        adapter = {n: p.detach().clone() for n, p in critic.model.model.named_parameters() if p.requires_grad}
        policy_adapter = {n: p for n, p in learner.policy.model.named_parameters() if p.requires_grad}
        assert adapter.keys() == policy_adapter.keys() and all(
            p is not policy_adapter[n] for n, p in critic.model.model.named_parameters() if p.requires_grad
        )
        base = {n: p.detach().clone() for n, p in learner.policy.model.named_parameters() if not p.requires_grad}
        metrics = sess.train(2, progress=False)[-1]
        assert VALUE_METRICS <= set(metrics)
        after = dict(critic.model.model.named_parameters())
        assert any(not torch.equal(adapter[n], after[n]) for n in adapter)  # its adapter learns
        assert all(torch.equal(v, dict(learner.policy.model.named_parameters())[n]) for n, v in base.items())
        # what it trains and keeps moments for: an adapter and a head, not a model
        total = sum(p.numel() for p in learner.policy.parameters())
        assert _trained(critic) < 0.2 * total


def test_a_model_critic_trains_every_weight_of_a_copy(llama_dir: Path) -> None:
    with rlnb.Session(_config(llama_dir, "model", lora=False), name="model-critic") as sess:
        learner = sess._trainer.learner
        critic = learner.critic
        assert critic is not None and critic.kind == "model"
        assert not {id(p) for p in critic.model.parameters()} & {id(p) for p in learner.policy.parameters()}
        assert _trained(critic) == sum(p.numel() for p in learner.policy.parameters()) + critic.head.weight.numel() + 1
        assert VALUE_METRICS <= set(sess.step())


def test_a_lora_critic_resumes_exactly(llama_dir: Path, tmp_path: Path) -> None:
    with rlnb.Session(_config(llama_dir, "lora"), name="saved") as sess:
        sess.step()
        sess.save(tmp_path / "ckpt")
        expected = sess.train(2, progress=False)
    with rlnb.Session.load(tmp_path / "ckpt", name="loaded") as loaded:
        critic = loaded._trainer.learner.critic
        assert critic is not None and critic.kind == "lora"
        assert_same_metrics(loaded.train(2, progress=False), expected)


def test_a_lora_critic_without_a_lora_policy_is_refused_before_anything_starts() -> None:
    with pytest.raises(rlnb.ConfigError, match=r"Algorithm\.critic.*critic=\"model\""):
        small_config(learn=rlnb.LearnConfig(algorithm=preset("ppo").replace(critic="lora")))
    with rlnb.Session(small_config(), name="tiny") as sess, pytest.raises(rlnb.ConfigError, match="LoRA critic"):
        sess.set(algorithm=preset("ppo").replace(critic="lora"))

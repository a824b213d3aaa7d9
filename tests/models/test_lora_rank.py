"""A LoRA rank larger than the layers it adapts is refused before anything is built:
``B @ A`` of an ``in x out`` layer has rank min(in, out) at most, and r=10**6 on a
hidden-size-128 model once took 17 GB and the kernel with it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import rlnb
from rlnb.models import tiny_llama
from tests.helpers import small_config

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("peft") is None,
    reason="the 'hf' and 'lora' extras (transformers, peft) are not installed",
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # hidden 128: attention layers of 128 x 128, MLP layers of 128 x 256 and 256 x 128
    return tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", seed=0)


def _config(path: Path, lora: rlnb.LoraConfig) -> rlnb.Config:
    return small_config(model=rlnb.ModelConfig(path=str(path), max_len=32, lora=lora))


def test_a_rank_past_the_model_is_refused_naming_its_size_before_anything_starts(llama_dir: Path) -> None:
    with rlnb.Session(small_config(), name="lora-rank") as live:
        with pytest.raises(rlnb.ConfigError) as error:
            rlnb.Session(_config(llama_dir, rlnb.LoraConfig(r=10**6)), name="lora-rank")
        assert not live.closed  # refused before the live session of that name was replaced
    assert str(error.value) == (
        f"LoraConfig.r=1000000 is invalid for the model in {str(llama_dir)!r} (hidden size 128, its adapted layer "
        "'model.layers.0.self_attn.q_proj' is 128 x 128): an adapter's B @ A has rank min(in, out) = 128 at most, "
        "so a larger r only adds memory and time; use r <= 128, e.g. r=8"
    )


def test_the_bound_is_the_smallest_side_of_the_layers_adapted(llama_dir: Path) -> None:
    with pytest.raises(rlnb.ConfigError, match=r"LoraConfig\.r=129 is invalid .*'model\.layers\.0\.mlp\.up_proj'"):
        rlnb.Session(_config(llama_dir, rlnb.LoraConfig(r=129, target_modules=("up_proj",))), name="lora-up")
    with rlnb.Session(_config(llama_dir, rlnb.LoraConfig(r=128, target_modules=("q_proj",))), name="lora-q") as s:
        assert s.policy.lora is not None and s.policy.lora.r == 128  # min(in, out) itself is allowed

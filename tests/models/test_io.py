from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from rlnb.models import TinyPolicy
from tests.models.helpers import SEED, SMALL, VOCAB, same_weights, small_policy


def _checkpoint(tmp_path: Path) -> Path:
    small_policy().save(tmp_path)
    return tmp_path


def _write_config(path: Path, **changes: Any) -> None:
    """Rewrite path/config.json with ``changes`` applied; a value of ... drops the field."""
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not ...}
    (path / "config.json").write_text(json.dumps(config), encoding="utf-8")


def test_save_load_round_trip(tmp_path: Path) -> None:
    model = small_policy()
    with torch.no_grad():  # differ from a fresh init, so a load that ignores the file would fail
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    back = TinyPolicy.load(tmp_path / "ckpt")
    assert back.config == model.config
    assert back.seed == model.seed == SEED
    assert same_weights(model, back)
    ids = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        assert torch.equal(model(ids), back(ids))


def test_config_json_holds_the_model_config_and_the_seed(tmp_path: Path) -> None:
    # The same keys PolicyConfig.to_dict() wrote before the merge, so older checkpoints still load.
    path = _checkpoint(tmp_path)
    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    hf_only = ("path", "dtype", "device", "gradient_checkpointing", "lora")  # a Hugging Face model's
    shape = {k: v for k, v in dataclasses.asdict(SMALL).items() if k not in hf_only}
    assert raw == {**shape, "seed": SEED}
    assert list(raw) == ["vocab_size", "d_model", "n_layers", "n_heads", "max_len", "mlp_ratio", "seed"]


def test_load_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json is missing"):
        TinyPolicy.load(tmp_path)
    _checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model\.safetensors is missing"):
        TinyPolicy.load(tmp_path)


def test_load_bad_config(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    (path / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        TinyPolicy.load(path)
    (path / "config.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match=r"config\.json does not describe a ModelConfig.*an object with the fields"):
        TinyPolicy.load(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"d_model": 0}, r"ModelConfig\.d_model=0 is invalid"),
        ({"d_model": 30}, r"ModelConfig\.n_heads=4 is invalid: use a divisor of d_model=30"),
        ({"max_len": "16"}, r"ModelConfig\.max_len='16' is invalid"),
        ({"vocab_size": None}, r"ModelConfig\.vocab_size=None is invalid.*config\.replace\(vocab_size="),
        ({"seed": -1}, r"TinyPolicy\.seed=-1 is invalid"),
        ({"width": 3}, r"unknown fields \['width'\]"),
        ({"vocab_size": ...}, r"missing fields \['vocab_size'\]"),
        ({"seed": ..., "mlp_ratio": ...}, r"missing fields \['mlp_ratio', 'seed'\]"),
    ],
)
def test_load_a_config_that_is_not_a_model_config_and_seed(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    path = _checkpoint(tmp_path)
    _write_config(path, **changes)
    with pytest.raises(ValueError, match=r"config\.json does not describe a ModelConfig and seed: " + message):
        TinyPolicy.load(path)


def test_load_damaged_weights(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        TinyPolicy.load(path)


def test_load_weights_that_do_not_fit_the_config(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    _write_config(path, vocab_size=12)
    with pytest.raises(ValueError, match=r"does not match .*config\.json: tok_emb\.weight has shape \[11, 32\]"):
        TinyPolicy.load(path)
    tensors = {k: v.contiguous() for k, v in small_policy().state_dict().items() if k != "ln_f.bias"}
    tensors["extra"] = torch.zeros(2)
    save_file(tensors, str(path / "model.safetensors"))
    _write_config(path, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"missing ln_f\.bias; unexpected extra"):
        TinyPolicy.load(path)

"""Loading a Hugging Face model from a local directory: its ``config.json`` read and
checked before anything is built, the tokenizer, the device, the model as an
:class:`HFPolicy` (one shared forward pass checked against the plain one), and the
model on the meta device for its shapes alone.

transformers is imported only when a model is loaded or built.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlnb._errors import ConfigError
from rlnb.config import LoraConfig, ModelConfig
from rlnb.models._hf_policy import HFPolicy
from rlnb.models._hf_tokenizer import HFTokenizer

__all__ = [
    "check_device",
    "check_model_dir",
    "hf_model_on_meta",
    "load_hf_model",
    "load_hf_tokenizer",
    "quiet_transformers",
    "read_model_config",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def quiet_transformers() -> Any:
    """transformers, imported with its download hints and progress bars off (rlnb is offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(
            "ModelConfig.path needs transformers: install rlnb's 'hf' extra (pip install 'rlnb[hf]')"
        ) from exc
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers


def read_model_config(path: str | os.PathLike[str], field: str) -> dict[str, Any]:
    """The ``config.json`` of the model directory ``path`` as a dict, read without
    loading anything; :class:`~rlnb.ConfigError` naming ``field`` and ``path`` for a
    missing directory, a missing or unreadable file, or JSON that is not an object."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ConfigError(
            f"{field}={str(path)!r} is invalid: no such directory; pass the local directory of a Hugging Face "
            "model (its config.json, weights and tokenizer), e.g. one `rlnb make-tiny-llama DIR` or "
            "rlnb.models.tiny_llama(path) built"
        )
    config_file = directory / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{field}={str(path)!r} is invalid: it has no config.json, so it is not a Hugging Face model directory"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{field}={str(path)!r} is invalid: cannot read its config.json: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{field}={str(path)!r} is invalid: its config.json holds {type(raw).__name__}, not a JSON object; "
            "save the model with save_pretrained()"
        )
    return raw


def check_model_dir(
    path: str | os.PathLike[str], field: str = "ModelConfig.path", *, max_len: int | None = None
) -> dict[str, Any]:
    """The model's ``config.json`` of the directory ``path``, read without loading
    anything (:func:`read_model_config`) and found to be a causal LM's;
    :class:`~rlnb.ConfigError` naming ``field`` and the fix otherwise, or
    naming ``ModelConfig.max_len`` when it is past the model's positions."""
    raw = read_model_config(path, field)
    if not raw.get("architectures"):
        raise ConfigError(
            f"{field}={str(path)!r} is invalid: its config.json names no architectures; save the model with "
            "save_pretrained()"
        )
    if not any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in raw["architectures"]):
        raise ConfigError(
            f"{field}={str(path)!r} is invalid: its architecture {raw['architectures']} is not a causal language "
            "model; rlnb trains models that AutoModelForCausalLM loads"
        )
    limit = raw.get("max_position_embeddings") or raw.get("n_positions")
    if max_len is not None and isinstance(limit, int) and limit < max_len:
        raise ConfigError(
            f"ModelConfig.max_len={max_len} is invalid: the model at {str(path)!r} has only {limit} positions; "
            f"use max_len <= {limit}"
        )
    return raw


def load_hf_tokenizer(path: str | os.PathLike[str], *, max_len: int | None = None) -> HFTokenizer:
    """The tokenizer in the local model directory ``path`` (nothing is downloaded);
    with ``max_len``, the model's positions are checked first."""
    check_model_dir(path, max_len=max_len)
    transformers = quiet_transformers()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"ModelConfig.path={str(path)!r} is invalid: transformers cannot load its tokenizer: {exc}"
        ) from exc
    return HFTokenizer(tokenizer)


def check_device(device: str, field: str = "ModelConfig.device") -> torch.device:
    """``device`` ("cpu", "cuda" or "cuda:N") as a torch device, once torch has been
    found to have it; :class:`~rlnb.ConfigError` naming ``field`` otherwise."""
    where = torch.device(device)
    if where.type != "cuda":
        return where
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(
            f"{field}={device!r} is invalid: torch sees no CUDA device here (torch {torch.__version__}, {build}); "
            'use device="cpu", or a machine with an NVIDIA GPU and a CUDA build of torch'
        )
    count = torch.cuda.device_count()
    if where.index is not None and where.index >= count:
        raise ConfigError(
            f"{field}={device!r} is invalid: torch sees {count} CUDA device(s) here; "
            f'use "cuda" or one of cuda:0 to cuda:{count - 1}'
        )
    return torch.device("cuda", torch.cuda.current_device() if where.index is None else where.index)


def load_hf_model(model: ModelConfig, *, seed: int = 0) -> HFPolicy:
    """The causal LM in the local directory ``model.path`` as an :class:`HFPolicy` in
    train mode (nothing is downloaded), as ``model`` (a :class:`~rlnb.ModelConfig`)
    says: its ``max_len``, ``dtype`` and ``device``, with gradient checkpointing and a
    LoRA adapter (its initial weights made from ``seed``) if asked for.
    :class:`~rlnb.ConfigError` for a ``model`` without a path, a directory that is not
    a causal LM, a ``max_len`` past its positions, a device torch does not have, an
    architecture rlnb cannot drive, or LoRA targets the model lacks."""
    if not isinstance(model, ModelConfig) or model.path is None:
        raise ConfigError(
            f"load_hf_model(model={model!r}) takes a rlnb.ModelConfig with the model's local directory as its "
            "path, e.g. load_hf_model(rlnb.ModelConfig(path='path/to/model', max_len=64))"
        )
    path = model.path
    check_model_dir(path, max_len=model.max_len)
    where = check_device(model.device)
    transformers = quiet_transformers()
    try:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=_DTYPES[model.dtype]
        )  # with torch's scaled_dot_product_attention where the model has it
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"ModelConfig.path={str(path)!r} is invalid: transformers cannot load it: {exc}") from exc
    policy = HFPolicy(loaded.to(where), max_len=model.max_len, source=str(path))
    _check_hooks(policy, str(path))
    if model.lora is not None:
        policy.add_lora(model.lora, seed=seed)
    if model.gradient_checkpointing:
        policy.enable_gradient_checkpointing()
    return policy.train()


def hf_model_on_meta(path: str | os.PathLike[str], *, lora: LoraConfig | None = None) -> nn.Module:
    """The model of ``path`` built on the meta device (shapes only, nothing read but
    config.json), with ``lora``'s adapter in it if given (only the adapter then requires
    grad); :class:`~rlnb.ConfigError` as :func:`load_hf_model` for the adapter."""
    check_model_dir(path)
    transformers = quiet_transformers()
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    if lora is not None:
        from rlnb.models._lora import add_lora

        add_lora(model, lora, str(path))
    return model


def _check_hooks(policy: HFPolicy, path: str) -> None:
    """One shared forward pass against the plain one: a model whose attention does not
    go through ``past_key_values.update()`` gets a clear error, not wrong gradients."""
    dev = policy.device
    ids = torch.tensor([[1, 4, 5, 6], [1, 7, 8, 0]], device=dev) % max(2, policy.model.config.vocab_size)
    with torch.no_grad():
        plain = policy.forward(ids)
        error: Exception | None = None
        try:
            two, groups = torch.tensor([2, 2], device=dev), torch.tensor([0, 1], device=dev)
            shared = policy.forward_shared(ids[:, :2], two, ids[:, 2:], groups)
        except Exception as exc:
            shared, error = None, exc
    if shared is None or not torch.allclose(shared, plain[:, 1:], atol=1e-3, rtol=1e-3):
        raise ConfigError(
            f"ModelConfig.path={path!r}: rlnb cannot drive this architecture "
            f"({type(policy.model).__name__}): its attention does not take keys and values through "
            f"past_key_values.update() with explicit position ids ({error!r}); Llama-, Qwen2- and Mistral-style "
            "models work"
        ) from error

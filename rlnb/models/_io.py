"""A :class:`TinyPolicy` on disk: ``model.safetensors`` and ``config.json``.

``config.json`` holds the :class:`~rlnb.ModelConfig` fields and the ``seed`` the
weights were first drawn from; nothing is pickled, so loading a checkpoint runs
no code from it. :meth:`TinyPolicy.save` and :meth:`TinyPolicy.load` call these.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from rlnb._errors import ConfigError, InvalidValueError
from rlnb._files import check_owned, clean_leftovers, save_place, write_dir
from rlnb.config import ModelConfig

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "load_policy", "save_policy"]


class Saved(Protocol):
    """What saving reads of a policy, and loading fills in of the one it makes: a
    :class:`TinyPolicy`, whose module calls these (so this one does not import it)."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def seed(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> object: ...


P = TypeVar("P", bound=Saved)

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


# The ModelConfig fields of the built-in policy's shape (path, dtype and device are a Hugging Face model's).
_SHAPE = ("vocab_size", "d_model", "n_layers", "n_heads", "max_len", "mlp_ratio")


def save_policy(policy: Saved, directory: str | os.PathLike[str]) -> Path:
    """Write ``policy``'s weights and config into ``directory`` (``~`` expanded, missing
    parents made); returns it, absolute. As ``Session.save`` writes a checkpoint: beside
    it first, then swapped in, so a kill leaves the old or the new one whole. A directory
    there must be new, empty or hold a policy saved so and nothing else; anything else is
    refused with a :class:`~rlnb.CheckpointError`, as is every failure to write."""
    from safetensors.torch import save_file

    target = save_place(directory, "the policy", call="TinyPolicy.save", argument="directory")
    clean_leftovers(target)
    check_owned(target, "the policy", "TinyPolicy", _not_a_policys)
    tensors = {name: t.detach().cpu().contiguous() for name, t in policy.state_dict().items()}
    shape = {k: v for k, v in dataclasses.asdict(policy.config).items() if k in _SHAPE}
    config = {**shape, "seed": policy.seed}

    def fill(staging: Path) -> None:
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    return write_dir(target, fill, "the policy")


def _not_a_policys(root: Path) -> list[str] | None:
    """What ``root`` holds besides a saved policy's two files; None without its config."""
    try:
        raw = json.loads((root / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or set(raw) != {*_SHAPE, "seed"}:
        return None
    return sorted(repr(p.name + "/" * p.is_dir()) for p in root.iterdir() if p.name not in (CONFIG_FILE, WEIGHTS_FILE))


def load_policy(cls: Callable[..., P], directory: str | os.PathLike[str]) -> P:
    """The policy :func:`save_policy` wrote into ``directory``, built by ``cls``.

    Raises ``ValueError`` naming the file and the problem; see :meth:`TinyPolicy.load`.
    """
    from safetensors.torch import load as load_safetensors

    path = Path(directory)
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    for p in (config_path, weights_path):
        if not p.is_file():
            raise InvalidValueError(
                f"{p} is missing: a TinyPolicy checkpoint directory holds {CONFIG_FILE} and {WEIGHTS_FILE}"
            )
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidValueError(f"{config_path} is not valid JSON: {e}") from e
    try:
        config, seed = _config_and_seed(raw)
        model = cls(config, seed=seed)  # checks what ModelConfig leaves open: vocab_size set, the seed
    except ConfigError as e:
        raise InvalidValueError(f"{config_path} does not describe a ModelConfig and seed: {e}") from e
    try:
        # Read the bytes ourselves: no file handle or mmap outlives this call.
        tensors = load_safetensors(weights_path.read_bytes())
    except Exception as e:  # safetensors raises its own error type for every kind of damage
        raise InvalidValueError(f"{weights_path} is not a readable safetensors file: {e}") from e
    problems = _mismatches(model.state_dict(), tensors)
    if problems:
        raise InvalidValueError(f"{weights_path} does not match {config_path}: " + "; ".join(problems))
    model.load_state_dict(tensors)
    return model


def _config_and_seed(raw: Any) -> tuple[ModelConfig, int]:
    """The ModelConfig and seed a config.json holds; ConfigError if it holds anything else."""
    names = [*_SHAPE, "seed"]
    if not isinstance(raw, dict):
        raise ConfigError(f"got {raw!r}: the file should hold an object with the fields {names}")
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise ConfigError(f"unknown fields {unknown}: the fields are {names}")
    # Every field is required: a default filled in here could differ from the one the checkpoint was saved with.
    missing = [name for name in names if name not in raw]
    if missing:
        raise ConfigError(f"missing fields {missing}: save writes all of {names}")
    fields = dict(raw)
    seed = fields.pop("seed")
    return ModelConfig(**fields), seed


def _mismatches(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> list[str]:
    """What keeps ``tensors`` from loading into a model whose state dict is ``expected``."""
    problems = [f"missing {k}" for k in sorted(set(expected) - set(tensors))]
    problems += [f"unexpected {k}" for k in sorted(set(tensors) - set(expected))]
    problems += [
        f"{k} has shape {list(tensors[k].shape)}, the config needs {list(v.shape)}"
        for k, v in expected.items()
        if k in tensors and tensors[k].shape != v.shape
    ]
    return problems

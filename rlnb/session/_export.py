"""``Session.save_pretrained``: the trained model as a Hugging Face model directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlnb._errors import ConfigError
from rlnb._files import write_model_dir

if TYPE_CHECKING:
    from rlnb.learn import Trainer

__all__ = ["save_pretrained"]


def save_pretrained(trainer: Trainer, tokenizer: Any, directory: str | os.PathLike[str], *, adapter_only: bool) -> Path:
    """Write the policy ``trainer`` trains (a Hugging Face model's) and the tokenizer
    into ``directory`` whole (see ``Session.save_pretrained``); returns it. Raises
    :class:`~rlnb.ConfigError` for the built-in policy, an ``adapter_only`` that is
    not a bool, or one asked of a model without LoRA; ``RuntimeError`` while it trains."""
    if not isinstance(adapter_only, bool):
        raise ConfigError(
            f"save_pretrained(adapter_only={adapter_only!r}) is invalid: pass True (the LoRA adapter alone) or "
            "False (the whole model)"
        )
    trainer.check_idle("save_pretrained()")
    policy: Any = trainer.learner.policy
    if not hasattr(policy, "write_pretrained"):
        raise ConfigError(
            "save_pretrained() writes a Hugging Face model, and this session trains the built-in policy: "
            "use save() (a checkpoint), or train a Hugging Face model with ModelConfig(path=...)"
        )
    if adapter_only and getattr(policy, "lora", None) is None:
        raise ConfigError(
            "save_pretrained(adapter_only=True) writes a LoRA adapter, and this session trains every weight "
            "of its model: use save_pretrained(directory), or train an adapter with "
            "ModelConfig(path=..., lora=rlnb.LoraConfig())"
        )

    def fill(staging: Path) -> None:
        policy.write_pretrained(staging, adapter_only=adapter_only)
        tokenizer.tokenizer.save_pretrained(staging)  # transformers' own: into the new directory

    return write_model_dir(directory, fill, call="Session.save_pretrained", argument="directory")

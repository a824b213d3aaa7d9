"""LoRA adapters on a Hugging Face causal LM, through peft.

peft puts its LoRA layers into the transformers model in place (each adapted
``nn.Linear`` becomes a layer holding it as ``base_layer`` beside ``lora_A`` and
``lora_B``) and freezes everything else, so :class:`~rlnb.models.HFPolicy` keeps
driving the same module. What engines and ``save_pretrained`` need is the model
without adapters: :func:`merged_state_dict` gives its weights under the model's own
names, each adapted one merged (``W + scale * B @ A``) tensor by tensor, the others
the model's own tensors (no copy); :func:`unadapted_copy` gives such a model, sharing
every tensor but the merged ones with the adapted model.

peft is imported only when a model gets an adapter.
"""

from __future__ import annotations

import copy
import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rlnb._errors import ConfigError

if TYPE_CHECKING:
    from rlnb.config import LoraConfig

__all__ = ["add_lora", "check_rank", "check_targets", "import_peft", "merged_state_dict", "unadapted_copy"]

# A state-dict key of an adapter tensor: some part of it is peft's "lora_..." module.
_ADAPTER_KEY = re.compile(r"(^|\.)lora_")


def import_peft() -> Any:
    """peft, or a :class:`~rlnb.ConfigError` that says how to install it."""
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(
            "ModelConfig.lora needs peft, which is not installed: install rlnb's 'lora' extra "
            "(pip install 'rlnb[lora]'), or use lora=None to train every weight"
        ) from exc
    return peft


def check_targets(model: nn.Module, lora: LoraConfig, where: str) -> None:
    """Each of ``lora.target_modules`` names some module of ``model``; a
    :class:`~rlnb.ConfigError` naming those that match none and the linear layers
    the model has otherwise (``where``: the model's directory, for the message)."""
    names = [name for name, _ in model.named_modules() if name]
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    targets = lora.target_modules
    if targets == "all-linear":
        return
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        raise ConfigError(
            f"LoraConfig.target_modules={targets!r} is invalid: {', '.join(map(repr, missing))} "
            f"match{'es' * (len(missing) == 1)} no module of {type(model).__name__} in {where!r}; its linear layers "
            f'are named {", ".join(map(repr, linear))}: use some of those, or "all-linear"'
        )


def _targeted(model: nn.Module, lora: LoraConfig) -> dict[str, tuple[int, int]]:
    """The weight shapes of the layers ``lora`` adapts, by name: the linear ones
    (``nn.Linear``, GPT-2's ``Conv1D``) but the output head for "all-linear", as peft
    means it; those its names match otherwise."""
    targets = lora.target_modules
    output = getattr(model, "get_output_embeddings", None)
    head = output() if callable(output) else None
    found = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not name or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if targets == "all-linear":
            linear = isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
            if not linear or module is head:
                continue
        elif not any(name == t or name.endswith(f".{t}") for t in targets):
            continue
        found[name] = (int(weight.shape[0]), int(weight.shape[1]))
    return found


def check_rank(model: nn.Module, lora: LoraConfig, where: str) -> None:
    """``lora.r`` is at most the smaller side of every layer it adapts: ``B @ A`` of a
    layer of ``in x out`` has rank min(in, out) at most, so a larger r adds parameters
    (memory, time) and nothing else. :class:`~rlnb.ConfigError` naming the layer and
    the model's size otherwise. Reads only shapes: a model on the meta device will do."""
    layers = _targeted(model, lora)
    if not layers:
        return
    name, (rows, cols) = min(layers.items(), key=lambda item: min(item[1]))
    side = min(rows, cols)
    if lora.r > side:
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        size = f"hidden size {hidden}, " if hidden is not None else ""
        raise ConfigError(
            f"LoraConfig.r={lora.r} is invalid for the model in {where!r} ({size}its adapted layer {name!r} is "
            f"{rows} x {cols}): an adapter's B @ A has rank min(in, out) = {side} at most, so a larger r only adds "
            f"memory and time; use r <= {side}, e.g. r=8"
        )


def add_lora(model: nn.Module, lora: LoraConfig, where: str, *, seed: int = 0) -> Any:
    """Put a LoRA adapter (``lora``) into ``model`` in place and freeze the rest of it;
    returns peft's ``PeftModel`` around it (for saving the adapter and switching it off).
    ``A`` starts random from ``seed`` (torch's global generator is left as it was), ``B``
    at zero. :class:`~rlnb.ConfigError` for targets the model lacks or peft cannot adapt,
    or a rank larger than the layers it adapts."""
    peft = import_peft()
    check_targets(model, lora, where)
    check_rank(model, lora, where)
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return peft.get_peft_model(model, config)
    except ValueError as exc:  # e.g. a target that is a block, not a layer peft can adapt
        raise ConfigError(
            f"LoraConfig.target_modules={lora.target_modules!r} is invalid for {type(model).__name__}: {exc}; "
            'name linear layers (e.g. "q_proj"), or use "all-linear"'
        ) from exc


def _adapted(model: nn.Module) -> dict[str, Any]:
    """``model``'s LoRA layers by name."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def _merged(layer: Any) -> torch.Tensor:
    """The base weight of the LoRA layer ``layer`` with its active adapters added: a new tensor."""
    weight = layer.get_base_layer().weight.detach()
    merged = weight.clone()
    for adapter in layer.active_adapters:
        merged += layer.get_delta_weight(adapter).to(weight.dtype)
    return merged


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights as the model without adapters names them, each adapted
    weight merged (a new tensor), every other one the model's own tensor."""
    state: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if not _ADAPTER_KEY.search(key):
            state[key.replace(".base_layer.", ".")] = value
    for name, layer in _adapted(model).items():
        state[f"{name}.weight"] = _merged(layer)
    return state


@torch.no_grad()
def unadapted_copy(model: nn.Module) -> nn.Module:
    """``model`` as it would be without its LoRA layers, each adapted weight merged. It
    shares every other parameter and buffer with ``model`` (nothing but the merged
    weights is copied): change neither in place."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    clone = copy.deepcopy(model, memo=shared)
    for name, layer in _adapted(clone).items():
        base = layer.get_base_layer()
        base.weight = nn.Parameter(_merged(layer), requires_grad=False)  # the clone's own module: model's stays
        parent, _, child = name.rpartition(".")
        setattr(clone.get_submodule(parent), child, base)
    if "peft_config" in vars(clone):
        del clone.peft_config
    return clone

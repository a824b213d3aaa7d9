"""``HFPolicy``: a Hugging Face causal LM behind the interface ``TinyPolicy`` offers.

The learner calls :meth:`HFPolicy.forward_shared` (each prompt run once for its
group) and the built-in engine calls :meth:`HFPolicy.new_cache`,
:meth:`HFPolicy.prefill` and :meth:`HFPolicy.decode` (a slot KV cache, every
slot at its own position), exactly as they call ``TinyPolicy``'s. The model is
transformers' own module, unchanged: its attention layers hand their keys and
values to ``past_key_values.update()``, and an object of ours stands in that
place (:class:`_KVHook`) with a ready 4-D attention mask and explicit position
ids. Any decoder that takes ``past_key_values``, ``attention_mask`` and
``position_ids`` the way Llama, Qwen2 and Mistral do works; ``load_hf`` checks
one forward pass against the plain one before anything is trained.

transformers is imported only when a model is loaded or built.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rlnb._errors import ConfigError, InvalidValueError
from rlnb._files import write_model_dir

if TYPE_CHECKING:
    from rlnb.config import LoraConfig

__all__ = ["HFPolicy", "HFSlotCache"]


class _KVHook:
    """What the model's attention layers see as ``past_key_values``.

    ``update(k, v, layer)`` gets each layer's new keys and values ``[B, H, T, D]``
    and returns those to attend over; ``on_update`` decides which (a call of the
    model sets it, then calls the model once)."""

    is_compileable = False

    def __init__(
        self, on_update: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        # One hook per call of the model: gradient checkpointing replays a layer in the
        # backward pass, after the call returned, and the replay must find the same hook.
        self.on_update = on_update

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.on_update(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class HFSlotCache:
    """Keys and values of every layer for a fixed number of sequence slots, for an
    :class:`HFPolicy`: per layer ``[slots, kv_heads, max_len, head_dim]``, made on
    the first write (the model says its head shape then)."""

    def __init__(self, slots: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._shape = (slots, max_len)
        self._dtype, self._device = dtype, device

    @property
    def slots(self) -> int:
        return self._shape[0]

    def layer(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.k) <= index:
            shape = (self._shape[0], like.shape[1], self._shape[1], like.shape[3])
            self.k.append(torch.zeros(shape, dtype=self._dtype, device=self._device))
            self.v.append(torch.zeros(shape, dtype=self._dtype, device=self._device))
        return self.k[index], self.v[index]

    @torch.inference_mode()  # the tensors were made in prefill's inference mode
    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy positions ``0..length-1`` of slots ``src`` [n] into slots ``dst`` [n], in every layer."""
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive float mask every attention implementation takes."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, torch.finfo(dtype).min)


class HFPolicy(nn.Module):
    """A transformers causal LM (``model``) as rlnb's learner and engine use a policy.

    ``max_len`` is the context the session uses (prompt and completion together).
    ``state_dict()`` and ``load_state_dict()`` are the model's own, with the
    model's own names: what vLLM and ``save_pretrained`` read.
    """

    model: Any  # a transformers PreTrainedModel

    def __init__(self, model: nn.Module, *, max_len: int, source: str | None = None) -> None:
        super().__init__()
        self.model = model
        self.max_len = max_len
        self.source = source  # the directory it was loaded from, if any
        self.gradient_checkpointing = False
        self.lora: LoraConfig | None = None  # the adapter's config, once add_lora() put one in
        self.__dict__["_peft"] = None  # peft's PeftModel around ``model`` (not a submodule of ours)

    def train(self, mode: bool = True) -> HFPolicy:
        """Train mode for gradients, with the model's dropout always off: the learner's
        log-probs must be those of the policy that sampled (as TRL's ``disable_dropout``).
        With gradient checkpointing, its decoder layers alone are in train mode (that is
        when transformers checkpoints them; their dropout is in their children)."""
        super().train(mode)
        self.model.eval()
        if self.gradient_checkpointing:
            for layer in self._checkpointed_layers():
                layer.training = mode
        if self.lora is not None and self.lora.dropout > 0:  # the adapter's dropout, as configured
            for name, module in self.model.named_modules():
                if name.endswith("lora_dropout") or ".lora_dropout." in name:
                    module.training = mode
        return self

    def _checkpointed_layers(self) -> list[nn.Module]:
        from transformers.modeling_layers import GradientCheckpointingLayer

        return [m for m in self.model.modules() if isinstance(m, GradientCheckpointingLayer)]

    def enable_gradient_checkpointing(self) -> None:
        """transformers' gradient checkpointing: each decoder layer keeps only its input and
        runs again in the backward pass, trading compute for activation memory. The same
        loss and gradients. :class:`~rlnb.ConfigError` for a model that has none."""
        if not getattr(self.model, "supports_gradient_checkpointing", False):
            raise ConfigError(
                f"ModelConfig.gradient_checkpointing=True is invalid: {type(self.model).__name__} has no gradient "
                "checkpointing in transformers; use gradient_checkpointing=False"
            )
        # Non-reentrant: the completion pass reads the prompt's keys and values from a
        # closure, and only this variant sends gradients back through those.
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not self._checkpointed_layers():
            raise ConfigError(
                f"ModelConfig.gradient_checkpointing=True is invalid: {type(self.model).__name__}'s layers are not "
                "transformers' GradientCheckpointingLayer, which rlnb drives; use gradient_checkpointing=False"
            )
        self.gradient_checkpointing = True
        for layer in self._checkpointed_layers():
            # transformers drops past_key_values in a checkpointed layer, since a replay
            # would write a cache twice. Ours only hands keys and values on: a replay
            # computes the same ones, so the layers keep it.
            layer._can_checkpoint_with_cache = True  # type: ignore[assignment]
        self.train(self.training)

    # The model's own names, so that checkpoints, vLLM and save_pretrained agree.
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.state_dict(*args, **kwargs)

    # -- LoRA ----------------------------------------------------------------------------

    def add_lora(self, lora: LoraConfig, *, seed: int = 0) -> None:
        """Put a LoRA adapter into the model (peft), its initial weights made from ``seed``,
        and freeze the model's own weights; from then on only the adapter trains.
        :class:`~rlnb.ConfigError` for targets the model lacks, or without peft."""
        from rlnb.models._lora import add_lora

        if self.lora is not None:
            raise InvalidValueError("HFPolicy.add_lora: the model has an adapter already")
        self.__dict__["_peft"] = add_lora(self.model, lora, self.source or type(self.model).__name__, seed=seed)
        self.lora = lora
        self.train(self.training)

    def parameter_counts(self) -> tuple[int, int]:
        """(trainable, all) numbers of the model: with LoRA, the adapter's and the model's with it."""
        every = list(self.parameters())
        return sum(p.numel() for p in every if p.requires_grad), sum(p.numel() for p in every)

    def merged_state_dict(self) -> dict[str, Any]:
        """The weights an engine serves and ``save_pretrained`` writes, under the model's
        own names: ``state_dict()`` without LoRA; with it, each adapted weight merged
        (``W + alpha / r * B @ A``, a new tensor each) and every other one the model's
        own tensor (no copy)."""
        if self.lora is None:
            return dict(self.state_dict())
        from rlnb.models._lora import merged_state_dict

        return merged_state_dict(self.model)

    def serving_copy(self) -> HFPolicy:
        """This policy as an engine serves it: itself without LoRA; with it, an
        ``HFPolicy`` of the model without adapters and with merged weights, sharing
        every other tensor with this one (copy it before changing any)."""
        if self.lora is None:
            return self
        from rlnb.models._lora import unadapted_copy

        return HFPolicy(unadapted_copy(self.model), max_len=self.max_len, source=self.source).eval()

    def trainable_state_dict(self) -> dict[str, Any]:
        """What training changes, as a checkpoint keeps it: ``state_dict()`` without LoRA,
        only the adapter's tensors with it (the model's own weights never change)."""
        if self.lora is None:
            return dict(self.state_dict())
        return {name: p.detach() for name, p in self.model.named_parameters() if p.requires_grad}

    def load_trainable_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what :meth:`trainable_state_dict` gave (``RuntimeError`` for other tensors)."""
        if self.lora is None:
            self.load_state_dict(state)
            return
        mine = self.trainable_state_dict()
        if set(state) != set(mine):
            raise InvalidValueError(
                f"the adapter's tensors are {sorted(mine)[:3]}..., got {sorted(set(state) ^ set(mine))[:3]}... besides"
            )
        with torch.no_grad():
            for name, value in state.items():
                mine[name].copy_(value)

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """Within the block, the model runs without its LoRA adapter: the model as loaded
        (the reference a KL term compares with), at no memory cost."""
        peft_model = self.__dict__["_peft"]
        if peft_model is None:
            raise InvalidValueError("HFPolicy.adapter_disabled: the model has no adapter")
        with peft_model.disable_adapter():
            yield

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def hidden_size(self) -> int:
        """The width of the final hidden states (``forward_shared(..., hidden=True)``)."""
        return int(self.model.config.hidden_size)

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return next(self.model.parameters()).device

    def _run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        on_update: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
        *,
        hidden: bool = False,
    ) -> torch.Tensor:
        """Logits ``[B, T, V]`` of ``ids`` [B, T] at ``positions`` [B, T], each query
        seeing the keys ``visible`` [B, T, K] marks among those ``on_update`` returns
        (``hidden``: the decoder's last hidden states ``[B, T, H]``, no output head)."""
        out = (self.model.get_decoder() if hidden else self.model)(
            input_ids=ids,
            position_ids=positions,
            attention_mask=_additive(visible[:, None], self._dtype),
            past_key_values=_KVHook(on_update),
            use_cache=True,
        )
        return out.last_hidden_state if hidden else out.logits

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` for token ids ``[B, T]`` (right-padding allowed)."""
        return self.model(input_ids=ids, use_cache=False).logits

    def forward_shared(
        self,
        prompts: torch.Tensor,
        prompt_lengths: torch.Tensor,
        completions: torch.Tensor,
        group_of: torch.Tensor,
        *,
        hidden: bool = False,
    ) -> torch.Tensor:
        """As :meth:`rlnb.models.TinyPolicy.forward_shared`: ``[N, Tc + 1, V]``, each
        prompt run once and its keys and values shared by the rows of its group
        (``hidden``: the final hidden states ``[N, Tc + 1, hidden_size]``)."""
        n_prompts, tp = prompts.shape
        n, tc = completions.shape
        dev = prompts.device
        prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            prefix[layer] = (k.index_select(0, group_of), v.index_select(0, group_of))
            return k, v

        arange = torch.arange(max(tp, tc), device=dev)
        causal_p = (arange[:tp, None] >= arange[None, :tp]).expand(n_prompts, tp, tp)
        logits_p = self._run(prompts, arange[:tp].expand(n_prompts, tp), causal_p, keep, hidden=hidden)
        last = logits_p[torch.arange(n_prompts, device=dev), prompt_lengths - 1].index_select(0, group_of)
        if tc == 0:
            return last[:, None]

        def extend(k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            pk, pv = prefix[layer]
            return torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)

        starts = prompt_lengths.index_select(0, group_of)[:, None]
        positions = (starts + arange[:tc]).clamp_max(self.max_len - 1)
        in_prompt = (arange[:tp] < starts)[:, None, :].expand(n, tc, tp)
        causal = (arange[:tc, None] >= arange[None, :tc]).expand(n, tc, tc)
        logits_c = self._run(completions, positions, torch.cat([in_prompt, causal], dim=2), extend, hidden=hidden)
        return torch.cat([last[:, None], logits_c], dim=1)

    # -- the engine's side: a slot cache ------------------------------------------------

    def new_cache(self, slots: int) -> HFSlotCache:
        """An empty :class:`HFSlotCache` with ``slots`` sequence slots."""
        if not isinstance(slots, int) or slots < 1:
            raise InvalidValueError(f"HFPolicy.new_cache needs slots >= 1, got {slots!r}")
        return HFSlotCache(slots, self.max_len, self._dtype, self.device)

    @torch.inference_mode()
    def prefill(
        self, cache: HFSlotCache, slots: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """As :meth:`rlnb.models.TinyPolicy.prefill`: logits ``[N, V]`` at each input's end."""
        n, t = ids.shape
        if not 1 <= t <= self.max_len:
            raise InvalidValueError(f"HFPolicy.prefill needs 1 <= T <= max_len={self.max_len}, got T={t}")

        def store(k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            ck, cv = cache.layer(layer, k)
            ck[slots, :, :t] = k
            cv[slots, :, :t] = v
            return k, v

        arange = torch.arange(t, device=ids.device)
        causal = (arange[:, None] >= arange[None, :]).expand(n, t, t)
        logits = self._run(ids, arange.expand(n, t), causal, store)
        return logits[torch.arange(n, device=ids.device), lengths - 1]

    @torch.inference_mode()
    def decode(
        self, cache: HFSlotCache, slots: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """As :meth:`rlnb.models.TinyPolicy.decode`: one token per slot, logits ``[A, V]``."""
        context = int(positions.max()) + 1
        if context > self.max_len:
            raise InvalidValueError(
                f"HFPolicy.decode got position {context - 1}, past max_len - 1 = {self.max_len - 1}"
            )

        def step(k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            ck, cv = cache.layer(layer, k)
            ck[slots, :, positions] = k[:, :, 0]
            cv[slots, :, positions] = v[:, :, 0]
            return ck[slots, :, :context], cv[slots, :, :context]

        visible = (torch.arange(context, device=ids.device) <= positions[:, None])[:, None, :]
        return self._run(ids[:, None], positions[:, None], visible, step)[:, 0]

    def num_parameters(self) -> int:
        """Number of trainable numbers (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())

    def save_pretrained(self, directory: str | os.PathLike[str], *, adapter_only: bool = False) -> Path:
        """Write the model as the directory ``directory``: its ``save_pretrained``
        (safetensors and config.json); with LoRA, the model with merged weights, or
        with ``adapter_only`` peft's adapter (adapter_config.json and
        adapter_model.safetensors, which ``peft.PeftModel.from_pretrained(base_model,
        directory)`` loads). Written as ``Session.save_pretrained`` writes (new, empty
        or a model rlnb saved, and never what a live session reads, such as its base
        model: :class:`~rlnb.CheckpointError` otherwise). Returns it, absolute.
        :class:`~rlnb.ConfigError` for an ``adapter_only`` that is not a bool,
        ``ValueError`` for ``adapter_only=True`` without an adapter."""
        if not isinstance(adapter_only, bool):
            raise ConfigError(
                f"HFPolicy.save_pretrained(adapter_only={adapter_only!r}) is invalid: pass True (the LoRA adapter "
                "alone) or False (the whole model)"
            )
        if adapter_only and self.__dict__["_peft"] is None:
            raise InvalidValueError("HFPolicy.save_pretrained(adapter_only=True): the model has no LoRA adapter")
        return write_model_dir(
            directory,
            functools.partial(self.write_pretrained, adapter_only=adapter_only),
            call="HFPolicy.save_pretrained",
            argument="directory",
        )

    def write_pretrained(self, staging: Path, *, adapter_only: bool = False) -> None:
        """Write :meth:`save_pretrained`'s files into ``staging``, a save's new directory
        (``rlnb._files.write_dir`` checks the target and swaps it in)."""
        if adapter_only:
            peft_model = self.__dict__["_peft"]
            if peft_model is None:
                raise InvalidValueError("HFPolicy.save_pretrained(adapter_only=True): the model has no LoRA adapter")
            peft_model.save_pretrained(staging, safe_serialization=True)
            return
        self.serving_copy().model.save_pretrained(staging, safe_serialization=True)

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
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rlnb._errors import ConfigError
from rlnb._files import as_path, check_not_in_use, write_model_dir
from rlnb._samples import messages_text

if TYPE_CHECKING:
    from rlnb.config import LoraConfig

__all__ = [
    "HFPolicy",
    "HFTokenizer",
    "check_device",
    "check_model_dir",
    "hf_model_on_meta",
    "load_hf_model",
    "load_hf_tokenizer",
    "tiny_llama",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
            raise ValueError("HFPolicy.add_lora: the model has an adapter already")
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
            raise RuntimeError(
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
            raise ValueError("HFPolicy.adapter_disabled: the model has no adapter")
        with peft_model.disable_adapter():
            yield

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

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
    ) -> torch.Tensor:
        """Logits ``[B, T, V]`` of ``ids`` [B, T] at ``positions`` [B, T], each query
        seeing the keys ``visible`` [B, T, K] marks among those ``on_update`` returns."""
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=_additive(visible[:, None], self._dtype),
            past_key_values=_KVHook(on_update),
            use_cache=True,
        )
        return out.logits

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` for token ids ``[B, T]`` (right-padding allowed)."""
        return self.model(input_ids=ids, use_cache=False).logits

    def forward_shared(
        self, prompts: torch.Tensor, prompt_lengths: torch.Tensor, completions: torch.Tensor, group_of: torch.Tensor
    ) -> torch.Tensor:
        """As :meth:`rlnb.models.TinyPolicy.forward_shared`: ``[N, Tc + 1, V]``, each
        prompt run once and its keys and values shared by the rows of its group."""
        n_prompts, tp = prompts.shape
        n, tc = completions.shape
        dev = prompts.device
        prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            prefix[layer] = (k.index_select(0, group_of), v.index_select(0, group_of))
            return k, v

        arange = torch.arange(max(tp, tc), device=dev)
        causal_p = (arange[:tp, None] >= arange[None, :tp]).expand(n_prompts, tp, tp)
        logits_p = self._run(prompts, arange[:tp].expand(n_prompts, tp), causal_p, keep)
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
        logits_c = self._run(completions, positions, torch.cat([in_prompt, causal], dim=2), extend)
        return torch.cat([last[:, None], logits_c], dim=1)

    # -- the engine's side: a slot cache ------------------------------------------------

    def new_cache(self, slots: int) -> HFSlotCache:
        """An empty :class:`HFSlotCache` with ``slots`` sequence slots."""
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"HFPolicy.new_cache needs slots >= 1, got {slots!r}")
        return HFSlotCache(slots, self.max_len, self._dtype, self.device)

    @torch.inference_mode()
    def prefill(
        self, cache: HFSlotCache, slots: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """As :meth:`rlnb.models.TinyPolicy.prefill`: logits ``[N, V]`` at each input's end."""
        n, t = ids.shape
        if not 1 <= t <= self.max_len:
            raise ValueError(f"HFPolicy.prefill needs 1 <= T <= max_len={self.max_len}, got T={t}")

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
            raise ValueError(f"HFPolicy.decode got position {context - 1}, past max_len - 1 = {self.max_len - 1}")

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
            raise ValueError("HFPolicy.save_pretrained(adapter_only=True): the model has no LoRA adapter")
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
                raise ValueError("HFPolicy.save_pretrained(adapter_only=True): the model has no LoRA adapter")
            peft_model.save_pretrained(staging, safe_serialization=True)
            return
        self.serving_copy().model.save_pretrained(staging, safe_serialization=True)


class HFTokenizer:
    """A transformers tokenizer as rlnb's parts use one: ``encode(prompt)`` (through
    the chat template when the tokenizer has one), ``decode(ids)``, and the PAD and
    EOS ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ConfigError(
                f"the tokenizer of {tokenizer.name_or_path!r} has no eos_token: rlnb needs one to end completions; "
                "set eos_token in its tokenizer_config.json"
            )
        self.EOS: int = eos
        self.PAD: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self.vocab_size: int = len(tokenizer)

    def encode(
        self,
        text: str | Sequence[Mapping[str, str]],
        *,
        bos: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """A prompt's ids (``bos``: through the chat template if there is one, else with
        the tokenizer's special tokens), or a target's (``bos=False``: the text's own).
        A prompt may be chat messages ({"role", "content"}): the chat template gets them
        as they are; without one, their contents are the text, one per line. ``tools``:
        the JSON schemas of tools the chat template describes to the model."""
        if not isinstance(text, str) and not (bos and self.chat):
            text = messages_text(text)
        if not bos:
            assert isinstance(text, str)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self.chat:
            messages = [{"role": "user", "content": text}] if isinstance(text, str) else [dict(m) for m in text]
            extra = {"tools": [dict(t) for t in tools]} if tools else {}
            return self._template(messages, add_generation_prompt=True, **extra)
        return list(self.tokenizer(text, add_special_tokens=bos)["input_ids"])

    def _template(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, **options)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def encode_observation(self, observation: str | Sequence[Mapping[str, Any]]) -> list[int]:
        """An environment's observation in a conversation, after a policy turn. With a
        chat template, the tokens the template puts between an assistant turn and the
        next one: the observation's messages (text is a user message; a tool's result
        has role "tool") and the assistant's generation prompt, cut out of a rendering
        of a stand-in conversation. Without one, the text's own ids."""
        if not self.chat:
            text = observation if isinstance(observation, str) else messages_text(observation)
            return self.encode(text)
        messages = (
            [{"role": "user", "content": observation}]
            if isinstance(observation, str)
            else [dict(m) for m in observation]
        )
        base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
        before = self._template(base)
        after = self._template(base + messages, add_generation_prompt=True)
        if after[: len(before)] != before:  # a template that renders earlier turns differently later
            raise ValueError("the chat template renders a conversation's earlier turns differently once it goes on")
        return after[len(before) :]

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """The tokenizer's files into ``directory`` (beside what is there, as Hugging
        Face writes them), never into what a live session reads, such as its base
        model (:class:`~rlnb.CheckpointError`, before anything is written)."""
        target = Path(os.path.abspath(as_path(directory, call="HFTokenizer.save_pretrained", argument="directory")))
        check_not_in_use(target, "the tokenizer")
        self.tokenizer.save_pretrained(target)


def _quiet_transformers() -> Any:
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


def check_model_dir(
    path: str | os.PathLike[str], field: str = "ModelConfig.path", *, max_len: int | None = None
) -> dict[str, Any]:
    """The model's ``config.json`` of the directory ``path``, read without loading
    anything; :class:`~rlnb.ConfigError` naming ``field`` and the fix otherwise, or
    naming ``ModelConfig.max_len`` when it is past the model's positions."""
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
    if not isinstance(raw, dict) or not raw.get("architectures"):
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
    transformers = _quiet_transformers()
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


def load_hf_model(
    path: str | os.PathLike[str],
    *,
    max_len: int,
    dtype: str = "float32",
    device: str = "cpu",
    gradient_checkpointing: bool = False,
    lora: LoraConfig | None = None,
    seed: int = 0,
) -> HFPolicy:
    """The causal LM in the local directory ``path`` as an :class:`HFPolicy` in train
    mode on ``device`` (nothing is downloaded), with gradient checkpointing and a LoRA
    adapter (its initial weights made from ``seed``) if asked for.
    :class:`~rlnb.ConfigError` for a directory that is not a causal LM, a ``max_len``
    past its positions, a device torch does not have, an architecture rlnb cannot
    drive, or LoRA targets the model lacks."""
    check_model_dir(path, max_len=max_len)
    where = check_device(device)
    transformers = _quiet_transformers()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=_DTYPES[dtype]
        )  # with torch's scaled_dot_product_attention where the model has it
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"ModelConfig.path={str(path)!r} is invalid: transformers cannot load it: {exc}") from exc
    policy = HFPolicy(model.to(where), max_len=max_len, source=str(path))
    _check_hooks(policy, str(path))
    if lora is not None:
        policy.add_lora(lora, seed=seed)
    if gradient_checkpointing:
        policy.enable_gradient_checkpointing()
    return policy.train()


def hf_model_on_meta(path: str | os.PathLike[str], *, lora: LoraConfig | None = None) -> nn.Module:
    """The model of ``path`` built on the meta device (shapes only, nothing read but
    config.json), with ``lora``'s adapter in it if given (only the adapter then requires
    grad); :class:`~rlnb.ConfigError` as :func:`load_hf_model` for the adapter."""
    check_model_dir(path)
    transformers = _quiet_transformers()
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


def tiny_llama(
    path: str | os.PathLike[str],
    *,
    alphabet: str = "0123456789+=",
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    max_positions: int = 64,
    seed: int = 0,
) -> Path:
    """Build a small random Llama and its character tokenizer into ``path``, offline.

    One token per character of ``alphabet``, then ``<bos>``, ``<eos>``, ``<pad>``
    and ``<unk>``; the tokenizer puts ``<bos>`` before each text. The defaults are
    the 332K-parameter model of ``benchmarks/trl_baseline.py`` (head size 32: vLLM's
    CPU attention needs 32 or more). ``path`` is written as ``Session.save_pretrained``
    writes (new, empty or a model rlnb saved; anything else is refused with a
    :class:`~rlnb.CheckpointError`). Returns ``path``, absolute."""
    transformers = _quiet_transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {c: i for i, c in enumerate([*alphabet, "<bos>", "<eos>", "<pad>", "<unk>"])}
    if len(vocab) != len(alphabet) + 4:
        raise ConfigError(f"tiny_llama(alphabet={alphabet!r}) is invalid: list each character once")
    bos, eos, pad = vocab["<bos>"], vocab["<eos>"], vocab["<pad>"]
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    config = transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)

    def fill(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)

    return write_model_dir(path, fill, call="tiny_llama", argument="path")

"""``TinyPolicy``: a small decoder-only transformer with a slot-based KV cache.

Training calls :meth:`TinyPolicy.forward` on whole (right-padded) sequences; a
generation engine keeps one :class:`KVCache` with a fixed number of slots, fills
slots with :meth:`TinyPolicy.prefill` and steps every active slot one token at a
time with :meth:`TinyPolicy.decode`, each slot at its own position.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from rlnb._errors import ConfigError

__all__ = ["KVCache", "PolicyConfig", "TinyPolicy"]

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def _require(ok: bool, field: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{field}={value!r} is invalid: {fix}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """The shape of a :class:`TinyPolicy`, and the seed its weights are drawn from.

    vocab_size: number of token ids (e.g. ``CharTokenizer.vocab_size``).
    d_model, n_layers, n_heads: width, depth and attention heads (``d_model`` must
        be a multiple of ``n_heads``).
    max_len: context length, prompt plus completion tokens.
    mlp_ratio: the MLP's hidden width is ``mlp_ratio * d_model``.
    seed: the initial weights are a pure function of the config, seed included.

    Raises :class:`~rlnb.ConfigError` naming the field and the fix.
    """

    vocab_size: int
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 48
    mlp_ratio: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        examples = {"vocab_size": 16, "d_model": 128, "n_layers": 2, "n_heads": 4, "max_len": 48, "mlp_ratio": 4}
        for name, example in examples.items():
            value = getattr(self, name)
            _require(
                _is_int(value) and value >= 1,
                f"PolicyConfig.{name}",
                value,
                f"use a positive int, e.g. {name}={example}",
            )
        _require(_is_int(self.seed) and self.seed >= 0, "PolicyConfig.seed", self.seed, "use an int >= 0, e.g. seed=0")
        _require(
            self.d_model % self.n_heads == 0,
            "PolicyConfig.d_model",
            self.d_model,
            f"use a multiple of n_heads={self.n_heads}, e.g. d_model={self.n_heads * 32}",
        )

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``d_model // n_heads``."""
        return self.d_model // self.n_heads

    def replace(self, **changes: Any) -> PolicyConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of the fields; :meth:`from_dict` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PolicyConfig:
        """The config :meth:`to_dict` described.

        Raises :class:`~rlnb.ConfigError` for a non-dict, an unknown or missing
        field, or an invalid value.
        """
        if not isinstance(d, dict):
            raise ConfigError(f"PolicyConfig.from_dict got {d!r}: pass a dict such as PolicyConfig.to_dict() returns")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(
                f"PolicyConfig.from_dict got unknown fields {unknown}: the fields are {sorted(names)}",
            )
        if "vocab_size" not in d:
            raise ConfigError("PolicyConfig.vocab_size is missing: include it, e.g. vocab_size=16")
        return cls(**d)


@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer for a fixed number of sequence slots.

    k, v: ``[n_layers, slots, n_heads, max_len, head_dim]``. Make one with
    :meth:`TinyPolicy.new_cache`. Raises ``ValueError`` if the shapes disagree.
    """

    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self) -> None:
        if self.k.dim() != 5 or self.k.shape != self.v.shape:
            raise ValueError(
                f"KVCache needs k and v of one shape [n_layers, slots, n_heads, max_len, head_dim], "
                f"got {tuple(self.k.shape)} and {tuple(self.v.shape)}; use TinyPolicy.new_cache(slots)"
            )

    @property
    def slots(self) -> int:
        """Number of sequences the cache holds."""
        return int(self.k.shape[1])

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy positions ``0..length-1`` of slots ``src`` [n] into slots ``dst`` [n], in every layer."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, config.mlp_ratio * d)
        self.out = nn.Linear(config.mlp_ratio * d, d)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # [..., d] -> three [..., n_heads, head_dim]
        q, k, v = self.qkv(self.ln1(x)).unflatten(-1, (3, self.n_heads, self.head_dim)).unbind(-3)
        return q, k, v

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(self.ln2(x))))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d] -> (x, k, v) with k, v [B, n_heads, T, head_dim] for the cache."""
        b, t, d = x.shape
        q, k, v = (z.transpose(1, 2) for z in self._qkv(x))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self._mlp(x), k, v

    def extend(
        self, x: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """x [N, T, d] after prefixes whose keys and values are k_prefix, v_prefix [N, n_heads, Tp, head_dim];
        visible [N, 1, T, Tp + T] says which prefix and own positions each query attends to."""
        n, t, d = x.shape
        q, k, v = (z.transpose(1, 2) for z in self._qkv(x))
        keys, values = torch.cat([k_prefix, k], dim=2), torch.cat([v_prefix, v], dim=2)
        a = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        x = x + self.proj(a.transpose(1, 2).reshape(n, t, d))
        return x + self._mlp(x)

    def step(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _DecodePlan) -> torch.Tensor:
        """One token per slot: x [A, d]; k_cache, v_cache [slots, n_heads, max_len, head_dim] (written)."""
        a_n, d = x.shape
        q, k, v = self._qkv(x)  # [A, n_heads, head_dim]
        k_cache[plan.slots, :, plan.positions] = k
        v_cache[plan.slots, :, plan.positions] = v
        if len(plan.buckets) == 1:
            a = plan.buckets[0].attend(q, k_cache, v_cache)
        else:
            a = torch.empty_like(q)
            for bucket in plan.buckets:
                a[bucket.rows] = bucket.attend(q.index_select(0, bucket.rows), k_cache, v_cache)
        x = x + self.proj(a.reshape(a_n, d))
        return x + self._mlp(x)


@dataclasses.dataclass(frozen=True)
class _Bucket:
    """Rows of a decode batch that attend over the same number of cached positions."""

    rows: torch.Tensor  # indices into the batch
    slots: torch.Tensor  # their cache slots
    context: int  # positions 0..context-1 are read
    mask: torch.Tensor  # [n, 1, 1, context]: each row sees up to its own position
    first_slot: int | None  # set when slots are one ascending run: read a view, copy nothing

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        if self.first_slot is not None:
            end = self.first_slot + self.slots.shape[0]
            keys = k_cache[self.first_slot : end, :, : self.context]
            values = v_cache[self.first_slot : end, :, : self.context]
        else:  # index_select copies whole rows, several times faster than k_cache[slots] on CPU
            keys = k_cache[:, :, : self.context].index_select(0, self.slots)
            values = v_cache[:, :, : self.context].index_select(0, self.slots)
        return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=self.mask).squeeze(2)


@dataclasses.dataclass(frozen=True)
class _DecodePlan:
    """How one decode step reads the cache, worked out once and shared by every layer.

    Attention over a padded batch costs rows times the longest context in it; with long
    tails (a few long sequences among many short ones) splitting the batch in two at
    the best position is several times cheaper, so decode() does that when it pays.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    buckets: tuple[_Bucket, ...]

    @classmethod
    def make(cls, slots: torch.Tensor, positions: torch.Tensor, arange: torch.Tensor) -> _DecodePlan:
        a_n = slots.shape[0]
        context = int(positions.max()) + 1
        whole = torch.arange(a_n)
        split = None
        if a_n >= 8:
            order = positions.argsort()
            ends = positions[order] + 1  # the context a bucket ending at each row would need
            n_short = torch.arange(1, a_n)
            costs = n_short * ends[:-1] + (a_n - n_short) * context
            best = int(costs.argmin())
            if int(costs[best]) < 0.6 * a_n * context:  # worth the extra gathers
                split = (order[: best + 1], order[best + 1 :], int(ends[best]))
        if split is None:
            return cls(slots, positions, (_bucket(whole, slots, positions, context, arange),))
        short, long, short_context = split
        return cls(
            slots,
            positions,
            (
                _bucket(short, slots[short], positions[short], short_context, arange),
                _bucket(long, slots[long], positions[long], context, arange),
            ),
        )


def _bucket(
    rows: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, context: int, arange: torch.Tensor
) -> _Bucket:
    n = slots.shape[0]
    mask = (arange[:context] <= positions[:, None]).view(n, 1, 1, context)
    first = int(slots[0])
    run = torch.equal(slots, torch.arange(first, first + n, dtype=slots.dtype))
    return _Bucket(rows, slots, context, mask, first if run else None)


class TinyPolicy(nn.Module):
    """Decoder-only transformer: token + learned position embeddings, pre-LayerNorm blocks with
    causal multi-head self-attention (``torch.nn.functional.scaled_dot_product_attention``) and a
    GELU MLP, final LayerNorm, output head tied to the token embedding.

    The initial weights depend only on ``config`` (its ``seed`` included); building
    one leaves the global torch RNG as it was. Raises :class:`~rlnb.ConfigError`
    if ``config`` is not a :class:`PolicyConfig`.
    """

    _positions: torch.Tensor  # arange(max_len), a buffer so it follows .to(device)

    def __init__(self, config: PolicyConfig) -> None:
        if not isinstance(config, PolicyConfig):
            raise ConfigError(
                f"TinyPolicy.config={config!r} is invalid: pass a PolicyConfig, e.g. PolicyConfig(vocab_size=16)"
            )
        super().__init__()
        self.config = config
        d = config.d_model
        with torch.random.fork_rng(devices=[]):  # seed locally; the caller's RNG stream is untouched
            torch.manual_seed(config.seed)
            self.tok_emb = nn.Embedding(config.vocab_size, d)
            self.pos_emb = nn.Embedding(config.max_len, d)
            self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
            self.ln_f = nn.LayerNorm(d)
            self._init_weights()
        self.register_buffer("_positions", torch.arange(config.max_len), persistent=False)

    def _init_weights(self) -> None:
        # GPT-2 style: small normal weights, zero biases, residual projections scaled
        # down by depth so the residual stream's variance does not grow with n_layers.
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear | nn.Embedding):
                    nn.init.normal_(module.weight, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
            for block in self._blocks():
                nn.init.normal_(block.proj.weight, std=residual_std)
                nn.init.normal_(block.out.weight, std=residual_std)

    def _blocks(self) -> Iterable[_Block]:
        return cast("Iterable[_Block]", self.blocks)  # typing only: ModuleList yields plain Modules

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln_f(x), self.tok_emb.weight)  # tied output head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]`` for token ids ``[B, T]`` (``T <= max_len``).

        Attention is causal, so right-padding does not change the logits at valid
        positions. Raises ``ValueError`` for a wrong shape or a too-long sequence.
        """
        if ids.dim() != 2 or not 1 <= ids.shape[1] <= self.config.max_len:
            raise ValueError(
                f"TinyPolicy.forward needs ids of shape [B, T] with 1 <= T <= max_len={self.config.max_len}, "
                f"got {tuple(ids.shape)}"
            )
        x = self.tok_emb(ids) + self.pos_emb(self._positions[: ids.shape[1]])
        for block in self._blocks():
            x, _, _ = block(x)
        return self._head(x)

    def forward_shared(
        self, prompts: torch.Tensor, prompt_lengths: torch.Tensor, completions: torch.Tensor, group_of: torch.Tensor
    ) -> torch.Tensor:
        """Logits for many completions of a few prompts, each prompt run once.

        prompts [P, Tp]: right-padded prompts; prompt_lengths [P]: their lengths,
        each >= 1; completions [N, Tc]: the tokens that follow prompt ``group_of[i]``
        in row i, right-padded (``Tc`` may be 0); group_of [N]. Returns
        ``[N, Tc + 1, vocab_size]``: row i's logits after its prompt's last token and
        after each of its completion tokens, which is what :meth:`forward` gives on
        the concatenated sequence (up to float rounding) for a fraction of the work
        when each prompt has several completions (GRPO's groups). Gradients reach
        the prompts' computation once per group. Rows must fit ``max_len``; padding
        past a row's end may be cut off at the last position. Raises ``ValueError``
        for mismatched shapes.
        """
        if (
            prompts.dim() != 2
            or completions.dim() != 2
            or prompt_lengths.shape != prompts.shape[:1]
            or group_of.shape != completions.shape[:1]
        ):
            raise ValueError(
                "TinyPolicy.forward_shared needs prompts [P, Tp], prompt_lengths [P], completions [N, Tc] and "
                f"group_of [N], got {tuple(prompts.shape)}, {tuple(prompt_lengths.shape)}, "
                f"{tuple(completions.shape)} and {tuple(group_of.shape)}"
            )
        n_prompts, tp = prompts.shape
        n, tc = completions.shape
        if not 1 <= tp <= self.config.max_len or tc >= self.config.max_len:
            raise ValueError(
                f"TinyPolicy.forward_shared needs 1 <= Tp <= max_len={self.config.max_len} and "
                f"Tc < max_len, got Tp={tp}, Tc={tc}"
            )
        x = self.tok_emb(prompts) + self.pos_emb(self._positions[:tp])
        prefix_kv = []
        for block in self._blocks():
            x, k, v = block(x)
            prefix_kv.append((k.index_select(0, group_of), v.index_select(0, group_of)))
        last = x[torch.arange(n_prompts, device=x.device), prompt_lengths - 1].index_select(0, group_of)
        if tc == 0:
            return self._head(last[:, None])
        starts = prompt_lengths.index_select(0, group_of)[:, None]  # [N, 1]
        positions = (starts + self._positions[:tc]).clamp_max(self.config.max_len - 1)
        y = self.tok_emb(completions) + self.pos_emb(positions)
        in_prompt = (self._positions[:tp] < starts)[:, None, :].expand(n, tc, tp)
        causal = torch.ones(tc, tc, dtype=torch.bool, device=x.device).tril().expand(n, tc, tc)
        visible = torch.cat([in_prompt, causal], dim=2)[:, None]
        for block, (k, v) in zip(self._blocks(), prefix_kv, strict=True):
            y = block.extend(y, k, v, visible)
        return self._head(torch.cat([last[:, None], y], dim=1))

    def new_cache(self, slots: int) -> KVCache:
        """An all-zero :class:`KVCache` with ``slots`` sequence slots, in the weights' dtype and device.

        Raises ``ValueError`` if ``slots`` is not a positive int.
        """
        if not _is_int(slots) or slots < 1:
            raise ValueError(f"TinyPolicy.new_cache needs slots >= 1, got {slots!r}")
        c = self.config
        w = self.tok_emb.weight
        shape = (c.n_layers, slots, c.n_heads, c.max_len, c.head_dim)
        return KVCache(
            torch.zeros(shape, dtype=w.dtype, device=w.device), torch.zeros(shape, dtype=w.dtype, device=w.device)
        )

    def _check_cache(self, cache: KVCache) -> None:
        c = self.config
        expected = (c.n_layers, c.n_heads, c.max_len, c.head_dim)
        shape = cache.k.shape
        if (shape[0], *shape[2:]) != expected:
            raise ValueError(
                f"KVCache of shape {tuple(shape)} does not fit this TinyPolicy (it needs "
                f"[{c.n_layers}, slots, {c.n_heads}, {c.max_len}, {c.head_dim}]); use TinyPolicy.new_cache(slots)"
            )

    @torch.inference_mode()
    def prefill(self, cache: KVCache, slots: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Run N prompts in one batch and store their keys and values in the cache.

        slots [N]: distinct slot indices (long); ids [N, T]: right-padded prompts;
        lengths [N]: valid lengths, each >= 1. Positions ``0..T-1`` of each slot are
        written; those at or past a sequence's length hold padding, which
        :meth:`decode` overwrites or masks. Returns the logits at each sequence's
        last valid position, ``[N, vocab_size]``. Raises ``ValueError`` for
        mismatched shapes or a cache that does not fit.
        """
        self._check_cache(cache)
        if ids.dim() != 2 or slots.shape != (ids.shape[0],) or lengths.shape != (ids.shape[0],):
            raise ValueError(
                f"TinyPolicy.prefill needs slots [N], ids [N, T] and lengths [N], got {tuple(slots.shape)}, "
                f"{tuple(ids.shape)} and {tuple(lengths.shape)}"
            )
        n, t = ids.shape
        if not 1 <= t <= self.config.max_len:
            raise ValueError(f"TinyPolicy.prefill needs 1 <= T <= max_len={self.config.max_len}, got T={t}")
        x = self.tok_emb(ids) + self.pos_emb(self._positions[:t])
        for i, block in enumerate(self._blocks()):
            x, k, v = block(x)
            cache.k[i][slots, :, :t] = k
            cache.v[i][slots, :, :t] = v
        last = x[torch.arange(n, device=x.device), lengths - 1]
        return self._head(last)

    @torch.inference_mode()
    def decode(self, cache: KVCache, slots: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Advance each active slot by one token.

        slots [A]: distinct slot indices; ids [A]: the new tokens; positions [A]:
        each token's position (its slot's current length, >= 0 and < max_len). Writes the
        token's keys and values at that position and attends to positions
        ``0..position`` of its own slot only. Returns logits ``[A, vocab_size]``.
        Raises ``ValueError`` for mismatched shapes, a position >= max_len, or a
        cache that does not fit.
        """
        self._check_cache(cache)
        if ids.dim() != 1 or slots.shape != ids.shape or positions.shape != ids.shape:
            raise ValueError(
                f"TinyPolicy.decode needs slots, ids and positions of one shape [A], got {tuple(slots.shape)}, "
                f"{tuple(ids.shape)} and {tuple(positions.shape)}"
            )
        a_n = ids.shape[0]
        if a_n == 0:
            return self.tok_emb.weight.new_empty(0, self.config.vocab_size)
        # Nothing past the furthest slot's position can be attended to, so gather and
        # attend over only the first `context` positions (short prompts: a few of max_len).
        context = int(positions.max()) + 1
        if context > self.config.max_len:
            raise ValueError(
                f"TinyPolicy.decode got position {context - 1}, past the context: positions run to "
                f"max_len - 1 = {self.config.max_len - 1}"
            )
        x = self.tok_emb(ids) + self.pos_emb(positions)
        plan = _DecodePlan.make(slots, positions, self._positions)  # shared by all layers
        for i, block in enumerate(self._blocks()):
            x = block.step(x, cache.k[i], cache.v[i], plan)
        return self._head(x)

    def num_parameters(self) -> int:
        """Number of trainable numbers (the tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write ``model.safetensors`` and ``config.json`` into ``directory`` (made if missing)."""
        from safetensors.torch import save_file

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().cpu().contiguous() for name, t in self.state_dict().items()}
        save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
        (path / CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> TinyPolicy:
        """The policy :meth:`save` wrote into ``directory`` (on the CPU, in float32).

        Reads only JSON and safetensors (nothing is unpickled). Raises ``ValueError``
        naming the file and the problem: a missing file, invalid JSON or config,
        a damaged weights file, or tensors whose names or shapes do not fit the config.
        """
        from safetensors.torch import load as load_safetensors

        path = Path(directory)
        config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
        for p in (config_path, weights_path):
            if not p.is_file():
                raise ValueError(
                    f"{p} is missing: a TinyPolicy checkpoint directory holds {CONFIG_FILE} and {WEIGHTS_FILE}"
                )
        try:
            raw = json.loads(config_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{config_path} is not valid JSON: {e}") from e
        try:
            config = PolicyConfig.from_dict(raw)
        except (ConfigError, TypeError) as e:
            raise ValueError(f"{config_path} does not describe a PolicyConfig: {e}") from e
        try:
            # Read the bytes ourselves: no file handle or mmap outlives this call.
            tensors = load_safetensors(weights_path.read_bytes())
        except Exception as e:  # safetensors raises its own error type for every kind of damage
            raise ValueError(f"{weights_path} is not a readable safetensors file: {e}") from e
        model = cls(config)
        expected = model.state_dict()
        problems = [f"missing {k}" for k in sorted(set(expected) - set(tensors))]
        problems += [f"unexpected {k}" for k in sorted(set(tensors) - set(expected))]
        problems += [
            f"{k} has shape {list(tensors[k].shape)}, the config needs {list(v.shape)}"
            for k, v in expected.items()
            if k in tensors and tensors[k].shape != v.shape
        ]
        if problems:
            raise ValueError(f"{weights_path} does not match {config_path}: " + "; ".join(problems))
        model.load_state_dict(tensors)
        return model

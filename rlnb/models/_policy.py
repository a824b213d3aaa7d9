"""``TinyPolicy``: a small decoder-only transformer with a slot-based KV cache.

Training calls :meth:`TinyPolicy.forward` on whole (right-padded) sequences; a
generation engine keeps one :class:`KVCache` with a fixed number of slots, fills
slots with :meth:`TinyPolicy.prefill` and steps every active slot one token at a
time with :meth:`TinyPolicy.decode`, each slot at its own position.

The cache and its decode planner live in ``_kvcache``, the checkpoint files in ``_io``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from rlnb._checks import check_int, is_int, require
from rlnb._errors import ConfigError, InvalidValueError
from rlnb.config import ModelConfig
from rlnb.models import _io
from rlnb.models._kvcache import KVCache, _DecodePlan

__all__ = ["TinyPolicy"]


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, config: ModelConfig) -> None:
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


class TinyPolicy(nn.Module):
    """Decoder-only transformer: token + learned position embeddings, pre-LayerNorm blocks with
    causal multi-head self-attention (``torch.nn.functional.scaled_dot_product_attention``) and a
    GELU MLP, final LayerNorm, output head tied to the token embedding.

    ``config`` is the network's shape (its ``vocab_size`` must be set) and ``seed``
    the seed its initial weights are drawn from: they are a pure function of the
    two, and building one leaves the global torch RNG as it was. ``policy.config``
    and ``policy.seed`` hold them. Raises :class:`~rlnb.ConfigError` naming the
    field and the fix if ``config`` is not a :class:`~rlnb.ModelConfig`, its
    ``vocab_size`` is None, or ``seed`` is not an int >= 0.
    """

    _positions: torch.Tensor  # arange(max_len), a buffer so it follows .to(device)

    def __init__(self, config: ModelConfig, *, seed: int = 0) -> None:
        require(
            isinstance(config, ModelConfig),
            "TinyPolicy.config",
            config,
            "pass a rlnb.ModelConfig, e.g. TinyPolicy(rlnb.ModelConfig(vocab_size=16))",
        )
        vocab_size = config.vocab_size
        if vocab_size is None:  # an if, not require(): mypy narrows it to an int below
            raise ConfigError(
                "ModelConfig.vocab_size=None is invalid: TinyPolicy needs the vocabulary size; set it, "
                "e.g. config.replace(vocab_size=tokenizer.vocab_size)"
            )
        check_int("TinyPolicy.seed", seed, minimum=0, example="seed=0")
        super().__init__()
        self.config = config
        self.seed = seed
        d = config.d_model
        with torch.random.fork_rng(devices=[]):  # seed locally; the caller's RNG stream is untouched
            torch.manual_seed(seed)
            self.tok_emb = nn.Embedding(vocab_size, d)
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
            raise InvalidValueError(
                f"TinyPolicy.forward needs ids of shape [B, T] with 1 <= T <= max_len={self.config.max_len}, "
                f"got {tuple(ids.shape)}"
            )
        x = self.tok_emb(ids) + self.pos_emb(self._positions[: ids.shape[1]])
        for block in self._blocks():
            x, _, _ = block(x)
        return self._head(x)

    def forward_shared(
        self,
        prompts: torch.Tensor,
        prompt_lengths: torch.Tensor,
        completions: torch.Tensor,
        group_of: torch.Tensor,
        *,
        hidden: bool = False,
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
        for mismatched shapes. ``hidden=True``: the final hidden states
        ``[N, Tc + 1, hidden_size]`` (after the last norm) in place of the logits,
        which a value head reads.
        """
        if (
            prompts.dim() != 2
            or completions.dim() != 2
            or prompt_lengths.shape != prompts.shape[:1]
            or group_of.shape != completions.shape[:1]
        ):
            raise InvalidValueError(
                "TinyPolicy.forward_shared needs prompts [P, Tp], prompt_lengths [P], completions [N, Tc] and "
                f"group_of [N], got {tuple(prompts.shape)}, {tuple(prompt_lengths.shape)}, "
                f"{tuple(completions.shape)} and {tuple(group_of.shape)}"
            )
        n_prompts, tp = prompts.shape
        n, tc = completions.shape
        if not 1 <= tp <= self.config.max_len or tc >= self.config.max_len:
            raise InvalidValueError(
                f"TinyPolicy.forward_shared needs 1 <= Tp <= max_len={self.config.max_len} and "
                f"Tc < max_len, got Tp={tp}, Tc={tc}"
            )
        x = self.tok_emb(prompts) + self.pos_emb(self._positions[:tp])
        prefix_kv = []
        for block in self._blocks():
            x, k, v = block(x)
            prefix_kv.append((k.index_select(0, group_of), v.index_select(0, group_of)))
        head = self.ln_f if hidden else self._head
        last = x[torch.arange(n_prompts, device=x.device), prompt_lengths - 1].index_select(0, group_of)
        if tc == 0:
            return head(last[:, None])
        starts = prompt_lengths.index_select(0, group_of)[:, None]  # [N, 1]
        positions = (starts + self._positions[:tc]).clamp_max(self.config.max_len - 1)
        y = self.tok_emb(completions) + self.pos_emb(positions)
        in_prompt = (self._positions[:tp] < starts)[:, None, :].expand(n, tc, tp)
        causal = torch.ones(tc, tc, dtype=torch.bool, device=x.device).tril().expand(n, tc, tc)
        visible = torch.cat([in_prompt, causal], dim=2)[:, None]
        for block, (k, v) in zip(self._blocks(), prefix_kv, strict=True):
            y = block.extend(y, k, v, visible)
        return head(torch.cat([last[:, None], y], dim=1))

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return self.tok_emb.weight.device

    def new_cache(self, slots: int) -> KVCache:
        """An all-zero :class:`KVCache` with ``slots`` sequence slots, in the weights' dtype and device.

        Raises ``ValueError`` if ``slots`` is not a positive int.
        """
        if not is_int(slots) or slots < 1:
            raise InvalidValueError(f"TinyPolicy.new_cache needs slots >= 1, got {slots!r}")
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
            raise InvalidValueError(
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
            raise InvalidValueError(
                f"TinyPolicy.prefill needs slots [N], ids [N, T] and lengths [N], got {tuple(slots.shape)}, "
                f"{tuple(ids.shape)} and {tuple(lengths.shape)}"
            )
        n, t = ids.shape
        if not 1 <= t <= self.config.max_len:
            raise InvalidValueError(f"TinyPolicy.prefill needs 1 <= T <= max_len={self.config.max_len}, got T={t}")
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
            raise InvalidValueError(
                f"TinyPolicy.decode needs slots, ids and positions of one shape [A], got {tuple(slots.shape)}, "
                f"{tuple(ids.shape)} and {tuple(positions.shape)}"
            )
        a_n = ids.shape[0]
        if a_n == 0:
            return self.tok_emb.weight.new_empty(0, self.tok_emb.num_embeddings)
        # Nothing past the furthest slot's position can be attended to, so gather and
        # attend over only the first `context` positions (short prompts: a few of max_len).
        context = int(positions.max()) + 1
        if context > self.config.max_len:
            raise InvalidValueError(
                f"TinyPolicy.decode got position {context - 1}, past the context: positions run to "
                f"max_len - 1 = {self.config.max_len - 1}"
            )
        x = self.tok_emb(ids) + self.pos_emb(positions)
        plan = _DecodePlan.make(slots, positions, self._positions)  # shared by all layers
        for i, block in enumerate(self._blocks()):
            x = block.step(x, cache.k[i], cache.v[i], plan)
        return self._head(x)

    @property
    def hidden_size(self) -> int:
        """The width of the final hidden states (``forward_shared(..., hidden=True)``)."""
        return int(self.tok_emb.embedding_dim)

    @property
    def max_len(self) -> int:
        """The context length in tokens (``config.max_len``)."""
        return self.config.max_len

    def num_parameters(self) -> int:
        """Number of trainable numbers (the tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write ``model.safetensors`` and ``config.json`` into ``directory`` (made if missing).

        ``config.json`` holds the :class:`~rlnb.ModelConfig` fields and ``"seed"``.
        """
        _io.save_policy(self, directory)

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> TinyPolicy:
        """The policy :meth:`save` wrote into ``directory`` (on the CPU, in float32).

        Reads only JSON and safetensors (nothing is unpickled). Raises ``ValueError``
        naming the file and the problem: a missing file, invalid JSON, a config that
        is not a ModelConfig and seed (unknown or missing fields, bad values), a
        damaged weights file, or tensors whose names or shapes do not fit the config.
        """
        return _io.load_policy(cls, directory)

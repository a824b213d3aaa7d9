"""The KV cache a generation engine keeps, and the plan one decode step reads it by.

:class:`KVCache` holds every layer's keys and values for a fixed number of
sequence slots; :class:`_DecodePlan` works out once per decode step which cached
positions each row attends to, so that every layer reuses it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from rlnb._errors import InvalidValueError

__all__ = ["KVCache"]


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
            raise InvalidValueError(
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


@dataclasses.dataclass(frozen=True)
class _Bucket:
    """Rows of a decode batch that attend over the same number of cached positions."""

    rows: torch.Tensor  # indices into the batch
    slots: torch.Tensor  # their cache slots
    context: int  # positions 0..context-1 are read
    mask: torch.Tensor  # [n, 1, 1, context]: each row sees up to its own position
    first_slot: int | None  # set when slots are one ascending run: read a view, copy nothing
    # Set when the slots lie in a run with a few gaps (continuous batching's usual
    # case, as sequences end at random): (first, end) of the run, each row's place in
    # it, and the mask over the whole run (a gap's row sees position 0 only).
    span: tuple[int, int] | None = None
    local: torch.Tensor | None = None
    span_mask: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        if self.first_slot is not None:
            end = self.first_slot + self.slots.shape[0]
            keys = k_cache[self.first_slot : end, :, : self.context]
            values = v_cache[self.first_slot : end, :, : self.context]
        elif self.span is not None and self.local is not None:
            # Attend over a view of the whole run, gaps included, rather than copy the
            # rows out: reading a few idle rows costs less than writing every row again.
            first, end = self.span
            keys = k_cache[first:end, :, : self.context]
            values = v_cache[first:end, :, : self.context]
            full = q.new_zeros((end - first, *q.shape[1:]))
            full[self.local] = q
            out = F.scaled_dot_product_attention(full.unsqueeze(2), keys, values, attn_mask=self.span_mask)
            return out.squeeze(2).index_select(0, self.local)
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
    if run:
        return _Bucket(rows, slots, context, mask, first)
    low, high = int(slots.min()), int(slots.max()) + 1
    if n >= 8 and high - low <= SPAN_SLACK * n:
        local = slots - low
        span_mask = (arange[:context] == 0).expand(high - low, context).clone()
        span_mask[local] = mask.view(n, context)
        return _Bucket(rows, slots, context, mask, None, (low, high), local, span_mask.view(high - low, 1, 1, context))
    return _Bucket(rows, slots, context, mask, None)


SPAN_SLACK = 1.25  # attend over a run of slots with gaps when it is at most this many times the rows

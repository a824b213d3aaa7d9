"""A rank's model sharded with torch's FSDP2 (``LearnConfig(strategy="fsdp")``).

:func:`shard` puts each transformer block, then the whole policy, under
``fully_shard`` on a one-dimensional device mesh of the ranks (the CPU's with gloo,
passed explicitly: on a machine with GPUs the default would move the parameters to
CUDA). Each rank then keeps 1/N of every parameter, of its gradient and of the
optimiser's moments; a block's weights are gathered for its forward and backward and
dropped after, and each gradient is reduce-scattered to the rank that keeps it.

Rows are still split as with "ddp" (:meth:`~rlnb.learn._ranks.Ranks.mine`), each
chunk's loss already its share of the update's, so the gradients are *summed* over
the ranks, not averaged (``set_gradient_divide_factor(1.0)``). Every rank must run
the same sequence of gathers: the learner gives every rank as many chunks as the
rank with the most (:meth:`~rlnb.learn._ranks.Ranks.even_chunks`), a rank with fewer
running a chunk that adds nothing.

The rest of rlnb reads whole tensors: :func:`gathered` makes a state dict's
sharded tensors whole (a collective: every rank calls it), :func:`sharded_like` cuts
a whole tensor into this rank's shard of a parameter (no communication: every rank
holds the whole one).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "gathered",
    "local_bytes",
    "shard",
    "sharded_like",
    "sharded_optimizer_state",
    "sharded_state",
    "to_float",
]


def _blocks(policy: nn.Module) -> Iterable[nn.Module]:
    """The policy's transformer blocks: the built-in policy's, or a Hugging Face
    decoder's layers (``model.model.layers``); none found: the policy is one unit."""
    blocks = getattr(policy, "blocks", None)
    if blocks is None:
        inner = getattr(getattr(policy, "model", None), "model", None)
        blocks = getattr(inner, "layers", None)
    return list(blocks) if blocks is not None else []


def shard(policy: nn.Module, world: int) -> None:
    """Put ``policy`` (in place; or any module, a critic's head) under FSDP2 across
    ``world`` ranks of the default process group, on the device its parameters are on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    # The built-in block returns its keys and values as views (transposed); nothing
    # changes them in place, which is what FSDP2 warns of.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    device = next(policy.parameters()).device
    mesh = init_device_mesh(device.type, (world,))
    units = []
    for block in _blocks(policy):
        fully_shard(block, mesh=mesh)
        if hasattr(block, "extend"):  # the built-in block's second entry (a completion after its prompt)
            register_fsdp_forward_method(block, "extend")
        units.append(block)
    fully_shard(policy, mesh=mesh)
    if hasattr(policy, "forward_shared"):  # a policy's entry besides forward (a critic's head has none)
        register_fsdp_forward_method(policy, "forward_shared")
    for unit in [*units, policy]:
        unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]  # each rank's loss is its share: a sum
        # a plain SUM: float32's factor otherwise rides on PREMUL_SUM, which gloo lacks
        unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]


def _is_sharded(value: Any) -> bool:
    """Whether ``value`` is a DTensor. torch.distributed.tensor takes ~0.6 s to
    import: where nothing imported it, nothing is one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def gathered(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every sharded tensor made whole (nested dicts too); a collective:
    every rank calls it with the same keys. The shards go in one message per dtype
    (a tensor at a time took a message each: ~50 for the built-in policy)."""
    found: list[tuple[list[Any], Any, Any]] = []  # (the dict, its key, the DTensor)

    def walk(source: Mapping[Any, Any]) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for key, value in source.items():
            if _is_sharded(value):
                found.append((out, key, value))  # type: ignore[arg-type]
                out[key] = None
            elif isinstance(value, Mapping):
                out[key] = walk(value)
            else:
                out[key] = value
        return out

    whole = walk(state)
    by_dtype: dict[tuple[torch.dtype, torch.device], list[tuple[Any, Any, Any]]] = {}
    for entry in found:
        if _on_dim0(entry[2]):
            local = entry[2].to_local()
            by_dtype.setdefault((local.dtype, local.device), []).append(entry)
        else:  # another layout than FSDP2's: made whole alone
            entry[0][entry[1]] = entry[2].full_tensor().detach()
    for entries in by_dtype.values():
        for (out, key, _), tensor in zip(entries, _gather_dim0([e[2] for e in entries]), strict=True):
            out[key] = tensor
    return whole


def _on_dim0(value: Any) -> bool:
    """Whether ``value`` is sharded as FSDP2 shards: along dim 0 on a one-dimensional mesh."""
    from torch.distributed.tensor import Shard

    return value.device_mesh.ndim == 1 and tuple(value.placements) == (Shard(0),) and value.dim() > 0


def _gather_dim0(tensors: list[Any]) -> list[torch.Tensor]:
    """Whole copies of ``tensors`` (DTensors of one dtype and device, each cut along dim
    0 as ``torch.chunk`` cuts: ceil(D / N) rows a rank, the last ranks fewer or none),
    by one all-gather of every rank's shards, each padded to its full share."""
    import torch.distributed as dist

    mesh = tensors[0].device_mesh
    world, group = mesh.size(), mesh.get_group()
    shapes = [tuple(t.shape) for t in tensors]
    shares = [-(-shape[0] // world) for shape in shapes]  # rows a rank holds at most
    sizes = [share * math.prod(shape[1:]) for share, shape in zip(shares, shapes, strict=True)]
    local = tensors[0].to_local()
    mine = torch.zeros(sum(sizes), dtype=local.dtype, device=local.device)
    offset = 0
    for tensor, size in zip(tensors, sizes, strict=True):
        rows = tensor.to_local().detach().reshape(-1)
        mine[offset : offset + rows.numel()] = rows
        offset += size
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    out = []
    offset = 0
    for shape, share, size in zip(shapes, shares, sizes, strict=True):
        pieces = [every[r][offset : offset + size].view(share, *shape[1:]) for r in range(world)]
        out.append(torch.cat(pieces)[: shape[0]].clone())
        offset += size
    return out


def sharded_like(whole: torch.Tensor, like: Any) -> torch.Tensor:
    """``whole`` cut as ``like`` (a parameter or a moment) is: this rank's shard
    (``whole`` itself if ``like`` is not sharded)."""
    if not _is_sharded(like):
        return whole
    from torch.distributed.tensor import distribute_tensor

    whole = whole.to(dtype=like.dtype, device=like.device)
    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)


def sharded_state(whole: Mapping[str, Any], like: Mapping[str, Any]) -> dict[str, Any]:
    """A state dict of whole tensors cut as ``like``'s (a sharded model's state dict) are."""
    return {k: sharded_like(v, like[k]) if k in like and isinstance(v, torch.Tensor) else v for k, v in whole.items()}


def sharded_optimizer_state(whole: Mapping[str, Any], params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """An optimiser's state dict of whole tensors (as one process's optimiser has
    it), each moment cut as its parameter (``params``, in the optimiser's order) is."""
    state = {
        index: {
            k: sharded_like(v, params[int(index)]) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
            for k, v in entry.items()
        }
        for index, entry in whole["state"].items()
    }
    return {**whole, "state": state}


def local_bytes(tensor: Any) -> int:
    """The bytes this rank holds of ``tensor`` (its shard, if it is sharded)."""
    local = tensor.to_local() if _is_sharded(tensor) else tensor
    return local.numel() * local.element_size()


def to_float(value: Any) -> float:
    """A scalar, made whole first if it is sharded (a reduction's result)."""
    return float(value.full_tensor() if _is_sharded(value) else value)

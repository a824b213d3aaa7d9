"""The learner split across processes: ``Ranks`` is one process's place among them.

Every rank holds the whole batch (collated the same everywhere, so the advantages,
the normalisers and the token counts are the same numbers a single process uses)
and runs the forward and backward passes of its own share of each update's rows
(:meth:`Ranks.mine`). Each chunk's loss is already its share of the update's, so the
ranks' gradients add up to the single process's: they are summed
(:meth:`Ranks.sum_gradients`, an all-reduce on torch.distributed's default group)
before the clip and the optimiser step, which then take the same step on every
rank. The step's metrics are sums of the chunks' shares, summed likewise.

A rank whose share fails (a loss function that raises, a loss that is not finite)
must not leave the others waiting in the next collective: it keeps its error, every
rank says at the same point whether it failed (:meth:`Ranks.agree`), and all raise,
the failing rank its own error, the others one that names it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from rlnb._errors import TrainingError

__all__ = ["RankFailed", "Ranks"]


class RankFailed(TrainingError):
    """Another rank's share of the step failed, so this rank's step was not taken either."""


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process is ``rank`` of ``world`` learner ranks, on torch.distributed's
    default process group (initialised by the caller). ``sharded``: the model
    sharded with FSDP2 (``LearnConfig.strategy="fsdp"``, :mod:`rlnb.learn._sharding`),
    which reduce-scatters the gradients itself; else ("ddp") the whole model on every
    rank and the gradients summed by :meth:`sum_gradients`."""

    rank: int
    world: int
    sharded: bool = False

    @classmethod
    def current(cls, *, sharded: bool = False) -> Ranks:
        """This process's place in the default process group."""
        import torch.distributed as dist

        return cls(dist.get_rank(), dist.get_world_size(), sharded)

    def mine(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``rows``: a contiguous run (a group's rows stay
        together where they can), the shares' sizes differing by one at most."""
        return rows.tensor_split(self.world)[self.rank]

    def even_chunks(
        self, rows: torch.Tensor, chunks: Callable[[torch.Tensor], list[torch.Tensor]]
    ) -> list[torch.Tensor | None]:
        """This rank's share of ``rows`` cut by ``chunks`` (none without rows), then None up to the most
        chunks any rank's share is cut into: with "fsdp" every rank must run as many
        passes (each gathers the weights with the others). Every rank holds ``rows``,
        so each works the others' counts out alone."""

        def cut(share: torch.Tensor) -> list[torch.Tensor]:
            return [chunk for chunk in chunks(share) if len(chunk)] if len(share) else []

        mine: list[torch.Tensor | None] = list(cut(self.mine(rows)))
        if not self.sharded:
            return mine
        most = max(len(cut(share)) for share in rows.tensor_split(self.world))
        return mine + [None] * (most - len(mine))

    def passes(self, rows: torch.Tensor, size: int | None, run: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``run`` (a pass without gradient, [len(rows), ...] -> values) over this rank's
        share of ``rows``, ``size`` rows at a time (None: at once), and every rank's
        values gathered in row order: each rank runs 1/N of a no-gradient pass
        instead of all of it. With "fsdp" a rank with fewer chunks runs passes whose
        values it drops (each gathers the weights with the others)."""
        import torch.distributed as dist

        computed, template = [], None
        for chunk in self.even_chunks(rows, lambda mine: list(mine.split(size or max(1, len(mine))))):
            template = run(rows[:1] if chunk is None else chunk)
            if chunk is not None:
                computed.append(template)
        if template is None:  # "ddp", no rows here: a pass alone (no collective in it) for the values' shape
            template = run(rows[:1])
        sizes = [len(share) for share in rows.tensor_split(self.world)]
        mine = torch.cat(computed) if computed else template
        padded = template.new_zeros((max(sizes), *template.shape[1:]))
        padded[: len(mine)] = mine
        every = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(every, padded)
        return torch.cat([values[:n] for values, n in zip(every, sizes, strict=True)])

    def sum(self, values: Sequence[float]) -> list[float]:
        """``values`` summed element-wise over the ranks (in float64)."""
        import torch.distributed as dist

        total = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(total)
        return [float(v) for v in total]

    def sum_gradients(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        """Make each parameter's gradient the sum of the ranks' (a rank that had no
        rows, or whose rows did not reach a parameter, adds zeros), one all-reduce
        per dtype and device."""
        import torch.distributed as dist

        buckets: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for param in parameters:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            buckets.setdefault((param.grad.dtype, param.grad.device), []).append(param)
        for params in buckets.values():
            flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
            dist.all_reduce(flat)
            offset = 0
            for param in params:
                assert param.grad is not None
                size = param.grad.numel()
                param.grad.copy_(flat[offset : offset + size].view_as(param.grad))
                offset += size

    def agree(self, failure: BaseException | None, what: str) -> None:
        """Every rank at once: raise ``failure`` where it is set, and :class:`RankFailed`
        naming the failed ranks elsewhere; nothing if no rank failed. ``what`` says
        what the ranks were doing."""
        import torch.distributed as dist

        flags = torch.zeros(self.world, dtype=torch.float64)
        flags[self.rank] = 1.0 if failure is not None else 0.0
        dist.all_reduce(flags)
        if failure is not None:
            raise failure
        failed = [r for r in range(self.world) if flags[r] > 0]
        if failed:
            ranks = ", ".join(str(r) for r in failed)
            raise RankFailed(f"learner rank {ranks} failed during {what}; the step was not taken on any rank")

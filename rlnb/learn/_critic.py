"""The ``Critic``: the value function that ``Algorithm(advantage="gae")`` (the ``ppo``
preset) learns beside the policy, with an optimiser of its own.

Two kinds (``Algorithm.critic``), each with a scalar head on the last hidden state:

- ``"model"`` is what the field runs (verl's and OpenRLHF's critic, TRL's
  ``value_model``): a whole copy of the policy, as it is when the critic is first
  needed. It costs a second model and its AdamW moments.
- ``"lora"``, for a LoRA policy: a copy of the policy's adapter on the policy's own
  frozen base weights, which the critic shares (the same tensors, never copied: LoRA
  never changes them). It costs an adapter and its moments.

The learner owns it; a checkpoint keeps it; a what-if or fork copies it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from rlnb._errors import ConfigError, InvalidValueError, TrainingError
from rlnb.algorithms import Algorithm
from rlnb.algorithms import functional as F
from rlnb.config import LearnConfig
from rlnb.learn import _sharding
from rlnb.learn._ranks import Ranks
from rlnb.models import HFPolicy, TinyPolicy

__all__ = ["Critic"]


class TrainBatch(Protocol):
    """What the critic reads of the learner's ``TrainBatch``."""

    @property
    def prompts(self) -> torch.Tensor: ...

    @property
    def prompt_lengths(self) -> torch.Tensor: ...

    @property
    def targets(self) -> torch.Tensor: ...

    @property
    def lengths(self) -> torch.Tensor: ...

    @property
    def group_of(self) -> torch.Tensor: ...


class Critic:
    """A value function ``V(prompt, y_<t)`` for each completion token: ``model``, a copy
    of ``policy`` (``kind`` "model": every weight trained; "lora": its adapter trained,
    its frozen base weights shared with ``policy``), and a linear ``head`` on its final
    hidden state, zero at the start (values of 0: the first advantages are the
    whitened returns), trained by an AdamW of its own with ``config``'s ``betas`` and
    ``weight_decay`` (its rate is set at each update). ``kind`` None: ``config``'s algorithm's."""

    def __init__(self, policy: TinyPolicy | HFPolicy, config: LearnConfig, *, kind: str | None = None) -> None:
        kind = kind or config.resolved_algorithm.critic
        self.kind = kind
        self.model: TinyPolicy | HFPolicy
        if kind == "lora":
            if not isinstance(policy, HFPolicy) or policy.lora is None:
                raise InvalidValueError('critic="lora" needs a policy with a LoRA adapter (ModelConfig.lora)')
            frozen = {id(p): p for p in policy.parameters() if not p.requires_grad}
            self.model = copy.deepcopy(policy, frozen).train()  # the frozen weights: the policy's own tensors
        else:
            self.model = copy.deepcopy(policy).train().requires_grad_(True)
        # float32 at least (a bfloat16 policy's head in float32), a float64 policy's in float64
        dtype = torch.promote_types(next(policy.parameters()).dtype, torch.float32)
        self.head = torch.nn.Linear(policy.hidden_size, 1, device=policy.device, dtype=dtype)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.held = False  # an optimiser step update() left for step_held()
        self._betas, self._weight_decay = config.betas, config.weight_decay
        self.optimizer = self._new_optimizer()
        self.share: Ranks | None = None  # this process's place among a learner's ranks (shard())

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), betas=self._betas, weight_decay=self._weight_decay, foreach=True)

    def shard(self, share: Ranks) -> None:
        """Run as ``share``'s rank of a learner split across processes: each rank's
        share of every update's rows, the gradients summed over the ranks; with
        "fsdp" the model and the head sharded (FSDP2) and the optimiser remade on
        the shards. Called once, before any update."""
        self.share = share
        if share.sharded:
            if self.kind == "lora":
                raise ConfigError(
                    'Algorithm.critic="lora" is invalid with LearnConfig.strategy="fsdp": its base weights are '
                    'the policy\'s own; use critic="model", or strategy="ddp"'
                )
            _sharding.shard(self.model, share.world)
            _sharding.shard(self.head, share.world)
            self.optimizer = self._new_optimizer()

    def parameters(self) -> list[torch.nn.Parameter]:
        """What the critic's optimiser trains: the model's trainable weights (a LoRA
        critic's: its adapter) and the head's."""
        return [*(p for p in self.model.parameters() if p.requires_grad), *self.head.parameters()]

    def values(self, batch: TrainBatch, rows: torch.Tensor, width: int) -> torch.Tensor:
        """The values [len(rows), width] of the states before ``rows``' first ``width``
        targets (with gradient, unless called under ``torch.no_grad()``)."""
        groups, local = torch.unique(batch.group_of[rows], return_inverse=True)
        prompt_lengths = batch.prompt_lengths[groups]
        prompts = batch.prompts[groups, : int(prompt_lengths.max())]
        targets = batch.targets[rows, :width]
        hidden = self.model.forward_shared(prompts, prompt_lengths, targets[:, :-1], local, hidden=True)
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)

    def all_values(self, batch: TrainBatch, size: int | None) -> torch.Tensor:
        """Every target's value [N, C] of ``batch`` (no gradient), ``size`` rows at a time."""
        every, width = torch.arange(len(batch.group_of), device=batch.targets.device), batch.targets.shape[1]
        with torch.no_grad():
            if self.share is not None:  # each rank its share, then every rank's gathered
                return self.share.passes(every, size, lambda rows: self.values(batch, rows, width))
            return torch.cat([self.values(batch, rows, width) for rows in every.split(size or len(every))])

    def update(
        self,
        batch: TrainBatch,
        *,
        algorithm: Algorithm,
        mask: torch.Tensor,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        parts: Sequence[torch.Tensor],
        epochs: int,
        chunks: Callable[[torch.Tensor], list[torch.Tensor]],
        lr: float,
        max_grad_norm: float,
        hold_last: bool = False,
    ) -> dict[str, float]:
        """``epochs`` passes over ``parts`` (the policy's minibatches: groups), one
        optimiser step each, on the clipped value loss toward ``returns``; returns the
        mean ``value_loss``, ``value_clip_fraction`` and ``critic_grad_norm``.
        ``hold_last``: the last optimiser step waits, its gradients ready, for
        :meth:`step_held` (or :meth:`drop_held`): a step of one update then changes
        nothing of the critic until the policy's update has succeeded, without a copy.
        Raises :class:`~rlnb.TrainingError` for a loss or gradient that is not finite,
        before the optimiser steps on it (with several updates the caller puts back
        :meth:`snapshot`)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        sums = {"loss": 0.0, "clip": 0.0, "gn": 0.0}
        updates = 0
        ranks = self.share
        sharded = ranks is not None and ranks.sharded
        least = min(2, batch.targets.shape[1]) if sharded else 1  # as the policy's passes: see Learner._least_width
        for _ in range(epochs):
            for part in parts:
                rows = torch.nonzero(torch.isin(batch.group_of, part)).flatten()
                denominator = max(1.0, float(mask[rows].sum()))
                self.optimizer.zero_grad(set_to_none=True)
                mine = chunks(rows) if ranks is None else ranks.even_chunks(rows, chunks)
                failure: Exception | None = None
                for chunk in mine:
                    if chunk is None or failure is not None:  # a pass that adds nothing, as the other ranks run
                        (self.values(batch, rows[:1], least).sum() * 0.0).backward()
                        continue
                    width = max(least, int(batch.lengths[chunk].max()))
                    values = self.values(batch, chunk, width)
                    loss, clipped = F.value_loss(
                        values,
                        old_values[chunk, :width],
                        returns[chunk, :width],
                        mask[chunk, :width],
                        algorithm.value_clip,
                        denominator,
                    )
                    value = float(loss.detach())
                    if not torch.isfinite(loss):
                        failure = TrainingError(
                            f"the critic's value loss is {value}: use a smaller Algorithm.critic_lr"
                        )
                        if ranks is None:
                            raise failure
                        (values.sum() * 0.0).backward()  # the others reduce this pass's gradients with it
                        continue
                    loss.backward()
                    share = float(mask[chunk, :width].sum()) / denominator
                    sums["loss"] += value
                    sums["clip"] += clipped * share
                if ranks is not None:
                    ranks.agree(failure, f"the critic's update {updates + 1}")
                    if not sharded:
                        ranks.sum_gradients(self.parameters())
                norm = _sharding.to_float(torch.nn.utils.clip_grad_norm_(self.parameters(), max_grad_norm))
                if not torch.isfinite(torch.tensor(norm)):
                    raise TrainingError(f"the critic's gradient norm is {norm}: use a smaller Algorithm.critic_lr")
                sums["gn"] += norm
                updates += 1
                if hold_last and updates == epochs * len(parts):
                    self.held = True
                else:
                    self.optimizer.step()
        if ranks is not None:  # each rank summed its own chunks' shares; the norm is the same everywhere
            sums["loss"], sums["clip"] = ranks.sum([sums["loss"], sums["clip"]])
        return {
            "value_loss": sums["loss"] / updates,
            "value_clip_fraction": sums["clip"] / updates,
            "critic_grad_norm": sums["gn"] / updates,
        }

    def step_held(self) -> None:
        """Take the optimiser step :meth:`update` held, if any."""
        if self.held:
            self.held = False
            self.optimizer.step()

    def drop_held(self) -> None:
        """Forget the step :meth:`update` held: the critic stays as it was."""
        self.held = False
        self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> dict[str, Any]:
        """The critic's weights (a LoRA critic's: its adapter's), head and optimiser
        state (tensors, not copies)."""
        model = self.model
        weights = model.trainable_state_dict() if isinstance(model, HFPolicy) else dict(model.state_dict())
        return {
            "model": weights,
            "head": dict(self.head.state_dict()),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Put back :meth:`state`'s tensors (others: torch's ``RuntimeError`` or
        :class:`~rlnb.InvalidValueError`)."""
        model = self.model
        if isinstance(model, HFPolicy):
            model.load_trainable_state_dict(state["model"])
        else:
            model.load_state_dict(state["model"])
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])

    def snapshot(self) -> dict[str, Any]:
        """A copy of :meth:`state`, to put back a step that was not taken."""
        return copy.deepcopy(self.state())

"""The ``Learner``: groups of rewarded samples in, one optimisation step, metrics out.

It owns the trainable policy, its AdamW optimiser, when the algorithm's
``kl_coef > 0`` a frozen reference copy, and with ``advantage="gae"`` a critic
(:class:`~rlnb.learn._critic.Critic`, a value model with an optimiser of its own). The update itself is the algorithm's
(:mod:`rlnb.algorithms`). It knows nothing about sessions, loops or notebooks.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from rlnb._errors import ConfigError, InvalidValueError, TrainingError
from rlnb._samples import Group
from rlnb.algorithms import Algorithm, has_signal, preset
from rlnb.algorithms import functional as F
from rlnb.config import LearnConfig
from rlnb.envs import Demonstration
from rlnb.learn import _sharding
from rlnb.learn._critic import Critic
from rlnb.learn._ranks import Ranks
from rlnb.models import HFPolicy, TinyPolicy

__all__ = ["Learner", "TrainBatch", "collate"]

_GRPO = preset("grpo")


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """Groups of completions, each group's prompt stored once (GRPO samples a prompt
    ``group_size`` times, and the learner runs each prompt once).

    ``prompts`` [P, Tp] (BOS and prompt, right-padded) with ``prompt_lengths`` [P];
    ``targets`` [N, C]: each sample's completion tokens, right-padded, which the
    model predicts after its prompt ``group_of[i]``; ``lengths`` [N] counts each
    row's real tokens; ``mask`` [N, C] marks those the loss trains on: the policy's
    (``Sample.mask``; a conversation's environment tokens and the padding are 0);
    ``behav_logp`` [N, C] holds their behaviour log-probs;
    ``advantages`` [N] (or [N, C] from an estimator that gives them per token),
    ``rewards``, ``min_versions``, ``group_of``, ``truncated`` (the completion
    stopped at the length limit): [N].
    """

    prompts: torch.Tensor
    prompt_lengths: torch.Tensor
    targets: torch.Tensor
    lengths: torch.Tensor
    mask: torch.Tensor
    behav_logp: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    min_versions: torch.Tensor
    group_of: torch.Tensor
    truncated: torch.Tensor

    def to(self, device: torch.device) -> TrainBatch:
        """This batch with every tensor on ``device`` (itself when they are there)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **moved)


def _padded(rows: list[list[Any]], width: int, fill: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    # One tensor per field from padded Python lists: far cheaper than a copy per row.
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=dtype)


def collate(
    groups: Sequence[Group],
    encode: Callable[[str], list[int]],
    pad_id: int,
    *,
    algorithm: Algorithm = _GRPO,
) -> TrainBatch:
    """Build a :class:`TrainBatch`, its advantages by ``algorithm``'s estimator;
    raises ``ValueError`` for samples without tokens or log-probs. A group's prompt
    ids are the ones it was rolled out with; ``encode`` makes them for a group that
    has none."""
    prompts = [list(group.prompt_ids) if group.prompt_ids else encode(group.prompt) for group in groups]
    targets: list[list[int]] = []
    masks: list[list[int]] = []
    behav: list[list[float]] = []
    rewards: list[list[float]] = []
    versions: list[int] = []
    group_of: list[int] = []
    truncated: list[bool] = []
    for g_index, group in enumerate(groups):
        rewards.append([float(s.reward or 0.0) for s in group.samples])
        for sample in group.samples:
            if len(sample.logprobs) != len(sample.token_ids):
                raise InvalidValueError(f"sample of prompt {group.prompt!r} has no behaviour log-probs for its tokens")
            targets.append(list(sample.token_ids))
            masks.append(list(sample.mask))
            behav.append(list(sample.logprobs))
            versions.append(sample.min_version if sample.min_version is not None else 0)
            group_of.append(g_index)
            truncated.append(sample.finish_reason == "length")
    width = max(1, max(len(t) for t in targets))
    lengths = torch.tensor([len(t) for t in targets])
    mask = _padded(masks, width, 0, torch.bool)
    group_tensor = torch.tensor(group_of)
    # float64: a reward total (a weighted sum) may lie beyond float32's range
    flat_rewards = torch.tensor([x for r in rewards for x in r], dtype=torch.float64)
    advantages = F.advantages(algorithm, flat_rewards, group_tensor, lengths=mask.sum(1), mask=mask, groups=groups)
    return TrainBatch(
        prompts=_padded(prompts, max(len(p) for p in prompts), pad_id, torch.long),
        prompt_lengths=torch.tensor([len(p) for p in prompts]),
        targets=_padded(targets, width, pad_id, torch.long),
        lengths=lengths,
        mask=mask,
        behav_logp=_padded(behav, width, 0.0, torch.float32),
        advantages=advantages,
        rewards=flat_rewards,
        min_versions=torch.tensor(versions),
        group_of=group_tensor,
        truncated=torch.tensor(truncated, dtype=torch.bool),
    )


_DEFAULT = LearnConfig()
# What to change when a loss or gradient overflows with finite advantages.
_OVERFLOW = (
    "large advantages (rewards of a large spread with scale_advantages=False), a policy far from the one "
    "that sampled, or a large lr make an update overflow: use smaller rewards (or reward_weights), "
    "LearnConfig.scale_advantages=True or a smaller lr"
)


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` on this thread for the block (None:
    unchanged), and restored after it; the setting is per thread and costs a microsecond."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _value_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How well the critic's values (before its update) predicted the returns: their
    means, and the explained variance ``1 - Var(R - V) / Var(R)`` over ``mask`` (1: a
    perfect critic; 0: no better than a constant; NaN-free: 0 where the returns are flat)."""
    m = mask.to(torch.bool)
    if not bool(m.any()):
        return {"value_mean": 0.0, "return_mean": 0.0, "explained_variance": 0.0}
    v, r = values[m].double(), returns[m].double()
    spread = float(r.var(unbiased=False))
    explained = 1.0 - float((r - v).var(unbiased=False)) / spread if spread > 1e-12 else 0.0
    return {"value_mean": float(v.mean()), "return_mean": float(r.mean()), "explained_variance": explained}


def _sample_advantages(
    given: Sequence[Group], trained: Sequence[Group], advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[tuple[float, ...], ...]:
    """Each sample's advantage in a step, group by group as ``given`` to it: the
    learner's own (per-token ones averaged over the sample's trained tokens), 0 for the
    groups a filter left out of ``trained``."""
    if advantages.dim() == 2:
        counted = mask.to(advantages.dtype)
        advantages = (advantages * counted).sum(1) / counted.sum(1).clamp_min(1)
    values, at, by_group = advantages.tolist(), 0, {}
    for group in trained:
        by_group[id(group)] = tuple(values[at : at + len(group.samples)])
        at += len(group.samples)
    return tuple(by_group.get(id(g), (0.0,) * len(g.samples)) for g in given)


def _length_chunks(rows: torch.Tensor, lengths: torch.Tensor, *, max_chunks: int = 4) -> list[torch.Tensor]:
    """``rows`` split into up to ``max_chunks`` runs of similar length when padding
    them all to the longest would waste a fifth or more of the positions."""
    lens = lengths[rows]
    waste = 1 - float(lens.sum()) / (len(rows) * int(lens.max()))
    n = min(max_chunks, len(rows) // 16)
    if waste < 0.2 or n < 2:
        return [rows]
    return list(rows[lens.argsort()].chunk(n))


class Learner:
    """Optimises ``policy`` with the update of ``config.resolved_algorithm`` (its
    advantages, policy loss, aggregation, correction, regularisers and filters, from
    :mod:`rlnb.algorithms`), as ``config`` (:class:`~rlnb.LearnConfig`) says; the session swaps ``config`` for a
    live change, read at the start of each step. ``config.threads`` is read once,
    here: torch's intra-op threads during each update (None: the caller's).
    ``share``: this process's place among the ranks of a learner split across
    processes (:mod:`rlnb.learn._ranks`; torch.distributed's default group): it runs
    its share of each update's rows and the ranks' gradients are summed. None: the
    whole update here."""

    def __init__(
        self,
        policy: TinyPolicy | HFPolicy,
        *,
        encode: Callable[[str], list[int]],
        pad_id: int,
        eos_id: int = 2,
        config: LearnConfig = _DEFAULT,
        encode_target: Callable[[str], list[int]] | None = None,
        encode_observation: Callable[[str], list[int]] | None = None,
        share: Ranks | None = None,
    ) -> None:
        self.policy = policy.train()
        self.config = config
        # This process's share of a learner split across processes (None: all of it).
        self.share = share
        self.threads = config.threads  # not a live setting: a live change's config leaves it be
        self._encode = encode
        # A warm-up target's ids: the text's own (default: encode() less the BOS it adds).
        self._encode_target = encode_target or (lambda text: encode(text)[1:])
        # A demonstrated conversation's environment replies (default: as a target's text).
        self._encode_observation = encode_observation or self._encode_target
        self._pad = pad_id
        self._eos = eos_id
        self.optimizer = self._new_optimizer()
        # The frozen reference of the KL term: a copy of the initial policy, or, with a
        # LoRA adapter (which starts at zero), the policy with its adapter switched off.
        self._lora = isinstance(policy, HFPolicy) and policy.lora is not None
        self._kl = config.resolved_algorithm.kl_coef > 0
        self.reference = copy.deepcopy(policy).eval().requires_grad_(False) if self._kl and not self._lora else None
        # The value function of advantage="gae": made with the learner, or at the first
        # step that needs it (a live switch to such an algorithm), from the policy then.
        self.critic: Critic | None = None
        self._critic_before: dict[str, Any] | None = None  # the critic's state while a step runs
        # each sample's advantage in the last step, group by group (see last_advantages)
        self.last_advantages: tuple[tuple[float, ...], ...] = ()
        if config.resolved_algorithm.has_critic:  # (made here, not by ensure_critic(): before any sharding)
            self.critic = Critic(self.policy, config)
        self.version = 0
        if share is not None and share.sharded:  # FSDP2: 1/N of each weight, gradient and moment here
            _sharding.shard(self.policy, share.world)
            if self.reference is not None:
                _sharding.shard(self.reference, share.world)
            self.optimizer = self._new_optimizer()  # on the sharded parameters
        if share is not None and self.critic is not None:
            self.critic.shard(share)  # made from the whole policy above

    def _new_optimizer(self) -> torch.optim.Optimizer:
        cfg = self.config
        return torch.optim.AdamW(
            self.trainable_parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, foreach=True
        )

    def ensure_critic(self, kind: str | None = None) -> Critic:
        """The critic of ``kind`` (None: the algorithm's ``critic``), made from a copy of
        the policy as it is now if there is none of that kind yet (one of another kind
        is dropped: a switch from a "model" critic to a "lora" one starts it anew)."""
        cfg = self.config
        kind = kind or cfg.resolved_algorithm.critic
        if self.critic is None or self.critic.kind != kind:
            if self._sharded:
                raise ConfigError(
                    f'Algorithm.critic={kind!r} cannot be made now: with LearnConfig.strategy="fsdp" the ranks make '
                    "the critic when they start (from the whole policy); start the session with an algorithm that "
                    'has one (advantage="gae"), or use strategy="ddp"'
                )
            self.critic = Critic(self.policy, cfg, kind=kind)
            if self.share is not None:
                self.critic.shard(self.share)
        return self.critic

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters training changes (an optimiser's): all of them, or a LoRA adapter's."""
        return [p for p in self.policy.parameters() if p.requires_grad]

    def model_state(self) -> dict[str, Any]:
        """What of the policy a checkpoint keeps: its weights, or only a LoRA adapter's."""
        policy = self.policy
        return policy.trainable_state_dict() if isinstance(policy, HFPolicy) else dict(policy.state_dict())

    def load_model_state(self, state: dict[str, Any]) -> None:
        """Put back :meth:`model_state`'s tensors (others: torch's ``RuntimeError``, or
        :class:`~rlnb.InvalidValueError` for a LoRA adapter's)."""
        if isinstance(self.policy, HFPolicy):
            self.policy.load_trainable_state_dict(state)
        else:
            self.policy.load_state_dict(state)

    def serving_policy(self) -> TinyPolicy | HFPolicy:
        """The policy as an engine serves it (a copy is the engine's to make): the policy
        itself, or with LoRA a model without adapters whose weights are merged."""
        return self.policy.serving_copy() if isinstance(self.policy, HFPolicy) else self.policy

    @property
    def has_reference(self) -> bool:
        """Whether a KL term can be computed: a frozen reference was kept (``kl_coef > 0``
        when the learner was made), or LoRA's base model serves as one."""
        return self.reference is not None or self._lora

    def _reference_logp(self, batch: TrainBatch, kl_coef: float) -> torch.Tensor | None:
        """The reference policy's log-probs of every target (no gradient), or None without a KL term."""
        if self.reference is not None:
            return self._all_logp(self.reference, batch)
        if not (self._lora and kl_coef > 0):
            return None
        assert isinstance(self.policy, HFPolicy)
        with self.policy.adapter_disabled():
            return self._all_logp(self.policy, batch)

    def encode(self, prompt: str) -> list[int]:
        """``prompt``'s token ids as the learner reads them (and the rollouts give the engine)."""
        return self._encode(prompt)

    def lr_at(self, version: int, config: LearnConfig | None = None) -> float:
        """The learning rate of the step that makes policy version ``version + 1``
        (under ``config``; None: the learner's)."""
        cfg = self.config if config is None else config
        if cfg.lr_decay_steps is None:
            return cfg.lr
        return cfg.lr * max(0.0, 1.0 - version / cfg.lr_decay_steps)

    @staticmethod
    def _token_logp(
        model: TinyPolicy | HFPolicy, batch: TrainBatch, rows: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies [len(rows), width] of ``rows``' first ``width`` targets,
        each of their prompts run once."""
        groups, local = torch.unique(batch.group_of[rows], return_inverse=True)
        prompt_lengths = batch.prompt_lengths[groups]
        prompts = batch.prompts[groups, : int(prompt_lengths.max())]
        targets = batch.targets[rows, :width]
        logits = model.forward_shared(prompts, prompt_lengths, targets[:, :-1], local)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 up; a float64 model stays
        logp_all = logits.log_softmax(-1)
        logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy

    def _chunks(self, rows: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """The runs of ``rows`` that go through the model together: micro-batches of
        ``micro_batch_size`` rows in order (a group's rows stay together, so its prompt
        is run once per micro-batch), or runs of similar length."""
        size = self.config.micro_batch_size
        return _length_chunks(rows, lengths) if size is None else list(rows.split(size))

    def _all_logp(self, model: TinyPolicy | HFPolicy, batch: TrainBatch) -> torch.Tensor:
        """Log-probs [N, C] of every target of ``batch`` (no gradient), a micro-batch at a time."""
        every, width = torch.arange(len(batch.group_of), device=batch.targets.device), batch.targets.shape[1]
        size = self.config.micro_batch_size or len(every)
        if self.share is not None:  # each rank its share, then every rank's gathered
            return self.share.passes(every, size, lambda rows: self._token_logp(model, batch, rows, width)[0])
        return torch.cat([self._token_logp(model, batch, rows, width)[0] for rows in every.split(size)])

    def step(self, groups: Sequence[Group], *, max_length: int | None = None) -> dict[str, float]:
        """One optimisation step on ``groups``; returns its metrics. The policy's
        version goes up by one, and :attr:`last_advantages` holds each sample's
        advantage (per-token ones averaged over its trained tokens; GAE's from the
        critic; 0 for a group a filter left out), group by group. ``max_length``: the most tokens a completion may have
        (the sampling's ``max_new_tokens``), the constant normaliser's length
        (``aggregation="seq_mean_token_sum_norm"``; None: the batch's longest).
        Raises ``ValueError`` for an empty or malformed batch, and
        :class:`~rlnb.TrainingError` for advantages, a loss or a gradient that is
        not finite, with the weights and the optimiser's state as they were before;
        an algorithm's function part that raises raises its own error, likewise."""
        with intra_op_threads(self.threads):
            try:
                return self._step(groups, max_length)
            except BaseException:  # the step was not taken: its critic update is undone too
                if self.critic is not None:
                    self.critic.drop_held()
                    if self._critic_before is not None:
                        self.critic.load_state(self._critic_before)
                raise
            finally:
                self._critic_before = None

    def _step(self, groups: Sequence[Group], max_length: int | None) -> dict[str, float]:
        if not groups:
            raise InvalidValueError("Learner.step() needs at least one group")
        # The settings that shape the loss are read once, here; lr (with its schedule) and
        # max_grad_norm at the first optimiser step, where they are used: a live change
        # (Session.set) made before that point applies to this step, and its record says so.
        cfg = self.config
        alg = cfg.resolved_algorithm
        start = time.perf_counter()
        dev = self.policy.device
        dropped, given = 0, list(groups)
        if alg.drop_flat_groups:  # no signal, and their tokens would dilute the token-mean
            with_signal = [g for g in groups if has_signal([s.reward or 0.0 for s in g.samples])]
            if with_signal:  # all flat: trained on as they are (their advantages are 0)
                dropped, groups = len(groups) - len(with_signal), with_signal
        batch = collate(groups, self._encode, self._pad, algorithm=alg).to(dev)
        lr: float | None = None
        max_grad_norm = cfg.max_grad_norm
        parts = torch.arange(len(groups), device=dev).chunk(max(1, min(cfg.minibatches, len(groups))))
        # A later update that goes non-finite puts back the weights and moments of before
        # the first: with several updates a step keeps a copy of them while it runs.
        saved = self._save_state() if cfg.epochs * len(parts) > 1 else None
        # With one update per batch the proximal policy is the current one: the ratio is
        # 1 by construction (prox_logp=None: no extra pass, and no clip can act).
        single_update = cfg.epochs == 1 and len(parts) == 1
        kl_in_reward = alg.kl_coef > 0 and alg.kl_in == "reward"
        with torch.no_grad():
            prox = None if single_update and not kl_in_reward else self._all_logp(self.policy, batch)
            ref = self._reference_logp(batch, alg.kl_coef)
        train_mask = F.train_mask(alg, batch.mask, truncated=batch.truncated)
        rewards = batch.rewards
        if kl_in_reward and ref is not None and prox is not None:
            rewards = batch.rewards - F.kl_penalty(alg, prox, ref, batch.mask).to(batch.rewards.dtype)
            if not alg.has_critic:
                advantages = F.advantages(
                    alg, rewards, batch.group_of, lengths=batch.mask.sum(1), mask=batch.mask, groups=groups
                )
                batch = dataclasses.replace(batch, advantages=advantages)
            prox = None if single_update else prox
        critic_metrics: dict[str, float] = {}
        if alg.has_critic:
            # GAE on the critic's values of the states the batch went through; the critic
            # learns first, so that one that fails leaves the policy untouched, and a
            # policy update that fails puts the critic back (step()): with one update per
            # batch by holding its optimiser step until the policy's is taken, with
            # several from a copy, as the policy's own.
            critic = self.ensure_critic()
            old_values = critic.all_values(batch, cfg.micro_batch_size)
            raw, returns = F.gae(rewards, old_values, train_mask, alg.gamma, alg.lam)
            batch = dataclasses.replace(batch, advantages=F.whiten(raw, train_mask))
            single = cfg.epochs * len(parts) == 1
            self._critic_before = None if single else critic.snapshot()
            critic_metrics = critic.update(
                batch,
                algorithm=alg,
                mask=train_mask,
                old_values=old_values,
                returns=returns,
                parts=parts,
                epochs=cfg.epochs,
                chunks=lambda rows: self._chunks(rows, batch.lengths),
                lr=alg.critic_lr if alg.critic_lr is not None else self.lr_at(self.version, cfg),
                max_grad_norm=cfg.max_grad_norm,
                hold_last=single,
            )
            critic_metrics.update(_value_metrics(old_values, returns, train_mask))
        if not bool(torch.isfinite(batch.advantages.float()).all()):
            raise self._not_finite(
                "the advantages are beyond float32's range",
                batch,
                "LearnConfig.scale_advantages=False keeps the rewards' scale: use scale_advantages=True, "
                "or rewards (and reward_weights) whose spread in a group is within 3.4e38",
            )
        per_token = batch.advantages.dim() == 2
        self.last_advantages = _sample_advantages(given, groups, batch.advantages, train_mask)
        lengths = batch.lengths
        keys = ("loss", "policy", "kl", "clip", "clip_low", "clip_high", "isw", "istrunc", "ent", "gn")
        sums: dict[str, float] = dict.fromkeys(keys, 0.0)
        clippable = False
        updates = 0
        counted = 0.0  # the tokens the policy loss is taken over, after top_entropy_quantile too
        try:
            for _ in range(cfg.epochs):
                for part in parts:
                    rows = torch.nonzero(torch.isin(batch.group_of, part)).flatten()
                    # The update's denominator and tokens, once: each chunk's loss is its share
                    # of the update's, so the chunks (micro-batches, or rows of similar length,
                    # each padded only to its own longest) add up to the same loss without
                    # most of the padding; split across ranks, so do the ranks' chunks.
                    denominator = F.normaliser(alg, train_mask[rows], max_length=max_length)
                    total = max(1, int(train_mask[rows].sum()))
                    self.optimizer.zero_grad(set_to_none=True)
                    failure: Exception | None = None
                    chunks = (
                        self._chunks(rows, lengths)
                        if self.share is None
                        else self.share.even_chunks(rows, lambda mine: self._chunks(mine, lengths))
                    )
                    try:
                        for index, chunk in enumerate(chunks):
                            if self._sharded:  # FSDP2: the gradients are reduced at the last pass only
                                self.policy.set_requires_gradient_sync(index == len(chunks) - 1)  # type: ignore[operator]
                            if chunk is None or failure is not None:  # a pass that adds nothing, as the others run
                                self._idle_pass(batch, rows)
                                continue
                            width = max(self._least_width(batch), int(lengths[chunk].max()))
                            mask = train_mask[chunk, :width]
                            logp, entropy = self._token_logp(self.policy, batch, chunk, width)
                            inputs = F.LossInputs(
                                algorithm=alg,
                                logp=logp,
                                prox_logp=None if prox is None else prox[chunk, :width],
                                behav_logp=batch.behav_logp[chunk, :width],
                                advantages=batch.advantages[chunk, :width] if per_token else batch.advantages[chunk],
                                mask=mask,
                                ref_logp=None if ref is None or kl_in_reward else ref[chunk, :width],
                                versions=batch.min_versions[chunk],
                                lengths=lengths[chunk],
                                entropy=entropy,
                                normaliser=denominator,
                                update_tokens=total,
                            )
                            # A loss function (a user's) that raises: no half-made step. With sharded
                            # ranks its backward still runs (adding nothing): the others wait on it.
                            try:
                                terms = F.policy_loss(inputs)
                                loss_value = float(terms.loss.detach())
                                if not math.isfinite(loss_value):
                                    raise self._not_finite(f"the loss is {loss_value}", batch, _OVERFLOW)
                            except Exception as exc:
                                if not self._sharded:
                                    raise
                                failure = exc
                                (logp.sum() * 0.0).backward()
                                continue
                            portion = terms.tokens / total  # of the update's tokens
                            terms.loss.backward()
                            clippable = clippable or terms.clippable
                            counted += terms.tokens * terms.kept_fraction
                            sums["loss"] += loss_value
                            for key, value in (
                                ("policy", terms.policy),
                                ("kl", terms.kl),
                                ("clip", terms.clip_fraction),
                                ("clip_low", terms.clip_low_fraction),
                                ("clip_high", terms.clip_high_fraction),
                                ("isw", terms.is_weight_mean),
                                ("istrunc", terms.is_corrected_fraction),
                                ("ent", float((entropy.detach() * mask).sum() / mask.sum().clamp_min(1))),
                            ):
                                sums[key] += value * portion
                    except Exception as exc:
                        if self.share is None:
                            raise
                        failure = exc  # said at the same point on every rank: none waits in a collective
                    if self.share is not None:
                        self.share.agree(failure, f"update {updates + 1} of step {self.version + 1}")
                        if not self._sharded:
                            self.share.sum_gradients(self.trainable_parameters())
                    if lr is None:  # the first optimiser step of this update
                        now = self.config
                        lr, max_grad_norm = self.lr_at(self.version, now), now.max_grad_norm
                    norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), max_grad_norm)
                    grad_norm = _sharding.to_float(norm)  # sharded gradients: their norm, made whole
                    if not math.isfinite(grad_norm):  # clipping would spread the inf or NaN to every weight
                        raise self._not_finite(f"the gradient's norm is {grad_norm}", batch, _OVERFLOW)
                    for param_group in self.optimizer.param_groups:
                        param_group["lr"] = lr
                    self.optimizer.step()
                    updates += 1
                    sums["gn"] += grad_norm
        except BaseException:
            self._put_back(saved, updates)  # a later update that failed: the weights of before the first
            raise
        if self.share is not None:  # each rank summed its own chunks' shares
            summed = [k for k in sums if k != "gn"]  # the norm is of the summed gradient: the same everywhere
            *values, counted, either = self.share.sum([*(sums[k] for k in summed), counted, float(clippable)])
            sums.update(zip(summed, values, strict=True))
            clippable = either > 0
        assert lr is not None  # epochs >= 1 and a part at least: every update steps the optimiser
        if alg.has_critic and self.critic is not None:
            self.critic.step_held()  # the policy's update is taken: the critic's held one too
        self.version += 1
        elapsed = time.perf_counter() - start
        tokens = int(train_mask.sum())  # the policy's: those trained on
        response = batch.mask.sum(dim=1).float()
        mean = {k: v / updates for k, v in sums.items()}
        return {
            "loss": mean["loss"],
            "policy_loss": mean["policy"],
            "reward_mean": float(batch.rewards.mean()),
            "reward_std": float(batch.rewards.std(unbiased=False)),
            "accuracy": float((batch.rewards >= 1.0).float().mean()),
            "response_length": float(response.mean()),
            "entropy": mean["ent"],
            # 0 where no clip can act (one update per batch: the ratio is 1 by construction)
            "clip_active": 1.0 if clippable else 0.0,
            "clip_fraction": mean["clip"],
            "clip_low_fraction": mean["clip_low"],
            "clip_high_fraction": mean["clip_high"],
            "kl": mean["kl"],
            "is_weight_mean": mean["isw"],
            "is_truncated_fraction": mean["istrunc"],
            "staleness": float((self.version - 1 - batch.min_versions).float().mean()),
            "grad_norm": mean["gn"],
            "train_tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "groups": float(len(groups)),
            "groups_dropped": float(dropped),
            # per pass over the batch: less than its tokens where a filter left some out
            "tokens_counted": float(round(counted / cfg.epochs)),
            "version": float(self.version),
            "lr": lr,
            **critic_metrics,
        }

    @property
    def _sharded(self) -> bool:
        return self.share is not None and self.share.sharded

    def _least_width(self, batch: TrainBatch) -> int:
        """The fewest targets a pass reads: 1, or with sharded ranks 2 where the batch
        has them, so that every pass runs the blocks on a completion after its prompt
        (one whose completions are all one token long runs only the prompts' pass:
        every rank would gather each block's weights once less)."""
        return min(2, batch.targets.shape[1]) if self._sharded else 1

    def _idle_pass(self, batch: TrainBatch, rows: torch.Tensor) -> None:
        """A forward and backward pass that changes no gradient: a sharded rank with
        fewer chunks than another (or whose chunk failed) runs one for each chunk it
        lacks, so that every rank gathers and reduces the weights as often."""
        logp, _ = self._token_logp(self.policy, batch, rows[:1], self._least_width(batch))
        (logp.sum() * 0.0).backward()

    def _save_state(self) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """Copies of the trainable weights and of the optimiser's state."""
        with torch.no_grad():
            weights = [p.detach().clone() for p in self.trainable_parameters()]
        return weights, copy.deepcopy(self.optimizer.state_dict())

    def _put_back(self, saved: tuple[list[torch.Tensor], dict[str, Any]] | None, updates: int) -> None:
        """The weights and optimiser state of :meth:`_save_state`, if ``updates`` changed them."""
        if saved is None or updates == 0:
            return
        weights, state = saved
        with torch.no_grad():
            for param, kept in zip(self.trainable_parameters(), weights, strict=True):
                param.copy_(kept)
        self.optimizer.load_state_dict(state)

    def _not_finite(self, what: str, batch: TrainBatch, fix: str) -> TrainingError:
        """The error of a step stopped by a number that is not finite: ``what``, the
        step, the batch's rewards and advantages, and ``fix``."""
        rewards, advantages = batch.rewards, batch.advantages
        return TrainingError(
            f"{what} at step {self.version + 1}; the step was not taken (the weights and the optimiser are as "
            f"they were): its rewards span [{float(rewards.min()):.4g}, {float(rewards.max()):.4g}] and its "
            f"advantages [{float(advantages.min()):.4g}, {float(advantages.max()):.4g}]; {fix}"
        )

    def supervised_step(
        self, pairs: Sequence[tuple[Any, str | Demonstration]], optimizer: torch.optim.Optimizer
    ) -> dict[str, float]:
        """One teacher-forced step on ``(prompt, target)`` pairs: cross-entropy on the
        target's tokens and EOS, with ``optimizer`` (a warm-up keeps its own, so the
        RL optimiser's moments start clean). A target may be a :class:`Demonstration`
        of a conversation: its policy turns are trained on (each with its EOS), the
        environment's replies only read. The policy version does not change. Raises
        :class:`~rlnb.TrainingError` for a loss or gradient that is not finite, before
        ``optimizer`` changes anything."""
        if not pairs:
            raise InvalidValueError("Learner.supervised_step() needs at least one (prompt, target) pair")
        rows, trained = [], []
        for prompt, target in pairs:
            row = list(self._encode(prompt))
            flags = [False] * len(row)
            for piece, train in self._target_pieces(target):
                row += piece
                flags += [train] * len(piece)
            rows.append(row)
            trained.append(flags)
        n, length = len(rows), max(len(r) for r in rows)
        ids = torch.full((n, length), self._pad, dtype=torch.long)
        mask = torch.zeros(n, length - 1, dtype=torch.bool)
        for i, (row, flags) in enumerate(zip(rows, trained, strict=True)):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row) - 1] = torch.tensor(flags[1:])  # position j predicts token j + 1
        ids, mask = ids.to(self.policy.device), mask.to(self.policy.device)
        logp = self.policy(ids[:, :-1]).float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), self.config.max_grad_norm))
        loss_value = float(loss.detach())
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            raise TrainingError(
                f"the warm-up step's loss is {loss_value} and its gradient's norm {grad_norm}; the step was not "
                "taken (the weights and the optimiser are as they were): a large lr makes an update overflow; "
                "use a smaller WarmupConfig.lr"
            )
        optimizer.step()
        return {"sft_loss": loss_value, "grad_norm": grad_norm}

    def _target_pieces(self, target: str | Demonstration) -> list[tuple[list[int], bool]]:
        """A warm-up target's token ids in runs, each with whether it is trained on."""
        if not isinstance(target, Demonstration):
            return [([*self._encode_target(target), self._eos], True)]
        return [
            ([*self._encode_target(turn), self._eos], True) if i % 2 == 0 else (self._encode_observation(turn), False)
            for i, turn in enumerate(target.turns)
        ]

    def logp(self, groups: Sequence[Group]) -> tuple[torch.Tensor, TrainBatch]:
        """The policy's log-prob of every completion token of ``groups`` (no gradient;
        [N, C], zero past each completion's end and for an environment's tokens:
        ``batch.mask``) and their batch."""
        batch = collate(groups, self._encode, self._pad, algorithm=self.config.resolved_algorithm)
        batch = batch.to(self.policy.device)
        with torch.no_grad():
            return self._all_logp(self.policy, batch) * batch.mask, batch

    def twin(self, config: LearnConfig | None = None) -> Learner:
        """An independent learner on copies of this one's policy and optimiser state
        (the frozen reference is shared: nothing changes it), with ``config`` (None:
        this one's). Training it changes nothing here. Call it while no step runs."""
        twin = copy.copy(self)
        twin.config = self.config if config is None else config
        twin.policy = copy.deepcopy(self.policy)
        twin.critic = copy.deepcopy(self.critic)  # None, or one of its own: training it changes nothing here
        lc = twin.config
        twin.optimizer = torch.optim.AdamW(
            twin.trainable_parameters(), lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay, foreach=True
        )
        state = copy.deepcopy(self.optimizer.state_dict())
        for group in state["param_groups"]:
            group.update(betas=lc.betas, weight_decay=lc.weight_decay)
        twin.optimizer.load_state_dict(state)
        return twin

    def export_weights(self) -> dict[str, Any]:
        """The policy's weights for an engine's ``update_weights`` (tensors, not copies:
        engines copy them into their own model). With LoRA, the model's own names and
        merged weights: a new tensor for each adapted weight, the model's own for the rest."""
        if isinstance(self.policy, HFPolicy):
            return self.policy.merged_state_dict()
        return self.policy.state_dict()

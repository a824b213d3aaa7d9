"""Batches kept after training, and "what if" questions asked of them.

The trainer keeps the last ``LearnConfig.keep_batches`` batches it trained on as
:class:`KeptBatch` objects, frozen. :func:`what_if` trains a twin of the learner (a
copy of the current policy and optimiser) on one of them under other settings and
under the same ones, so that the two differ by the change alone; the session's own
learner, its version and the process's random state are left as they were.
"""

from __future__ import annotations

import dataclasses
import hashlib
import html
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlnb._samples import Group
from rlnb.algorithms import Algorithm, describe, preset
from rlnb.algorithms import functional as F
from rlnb.config import ONE_UPDATE, LearnConfig, algorithm_label
from rlnb.learn._learner import Learner, TrainBatch

__all__ = ["BatchOrigin", "KeptBatch", "WhatIf", "advantages_of", "clip_note", "vocabulary_digest", "what_if"]

# The metrics a what-if compares, in the order it shows them: the step's own (taken
# before its update, so lr does not move them), then what the update did to the policy
# on the batch (measured after it; a step that is not recorded has none of these).
COMPARED = (
    "loss",
    "policy_loss",
    "kl",
    "clip_active",
    "clip_fraction",
    "grad_norm",
    "entropy",
    "lr",
    "tokens_counted",
    "update_kl",
    "update_ratio_outside_clip",
    "logp_change_positive",
    "logp_change_negative",
    "value_loss",
    "explained_variance",
)


def advantages_of(
    rewards: Sequence[Sequence[float]],
    *,
    scale: bool | None = None,
    algorithm: Algorithm | None = None,
    groups: Sequence[Group] | None = None,
) -> tuple[tuple[float, ...], ...]:
    """Each group's advantages, group by group as the learner computes them: by
    ``algorithm``'s estimator (an :class:`rlnb.algorithms.Algorithm`; an estimator
    that gives them per token is averaged over each sample's trained tokens here), or
    GRPO's (rewards centred on the group's mean, and divided by its std unless
    ``scale`` is False). ``groups``, the groups ``rewards`` score, give the estimator
    the context the learner gives it (each sample's mask and trained tokens, the
    groups); without them each sample counts as one token, and an advantage function
    gets ``mask=None``."""
    if algorithm is None:
        algorithm = preset("grpo") if scale is not False else preset("dr_grpo")
    flat = torch.tensor([float(x) for r in rewards for x in r], dtype=torch.float64)
    group_of = torch.tensor([g for g, r in enumerate(rewards) for _ in r], dtype=torch.long)
    if not len(flat):
        return tuple(() for _ in rewards)
    mask = None if groups is None else _mask(groups)
    if mask is None:
        values = F.advantages(algorithm, flat, group_of)
    else:
        values = F.advantages(algorithm, flat, group_of, lengths=mask.sum(1), mask=mask, groups=groups)
    if values.dim() == 2:
        weights = torch.ones_like(values) if mask is None else mask.to(values.dtype)
        values = (values * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)
    out, at = [], 0
    for r in rewards:
        out.append(tuple(values[at : at + len(r)].tolist()))
        at += len(r)
    return tuple(out)


def _mask(groups: Sequence[Group]) -> torch.Tensor:
    """The samples' masks [N, T], right-padded with 0, as the learner builds them."""
    masks = [sample.mask for group in groups for sample in group.samples]
    out = torch.zeros(len(masks), max(1, max((len(m) for m in masks), default=0)), dtype=torch.bool)
    for row, m in enumerate(masks):
        out[row, : len(m)] = torch.tensor(m, dtype=torch.bool)
    return out


def vocabulary_digest(tokenizer: Any) -> str:
    """The SHA-256 of what ``tokenizer``'s ids mean: its tokens in id order (a Hugging
    Face tokenizer's own tokens; for rlnb's character tokenizer, each id's text), as a
    checkpoint records them."""
    ids = list(range(tokenizer.vocab_size))
    hf = getattr(tokenizer, "tokenizer", None)
    tokens = [str(t) for t in hf.convert_ids_to_tokens(ids)] if hf is not None else [tokenizer.decode([i]) for i in ids]
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class BatchOrigin:
    """What made a kept batch, and so what its numbers mean: the ``session`` (its
    name), the ``task`` whose prompts it holds (its name), the ``seed`` they were
    drawn with (a prompt id means a prompt only with it), and ``vocabulary``, the
    :func:`vocabulary_digest` of the tokenizer its token ids belong to."""

    session: str
    task: str
    seed: int
    vocabulary: str

    def __str__(self) -> str:
        return f"session {self.session!r} on task {self.task!r} (seed {self.seed})"

    def mismatch(self, here: BatchOrigin) -> str | None:
        """Why a batch of this origin cannot be read by the session ``here`` (its token
        ids mean other tokens, or its prompt ids other prompts), or None where it can."""
        if self.vocabulary != here.vocabulary:
            return "its token ids belong to another vocabulary, so they would be read as other tokens"
        if self.task != here.task:
            return "it holds another task's prompts"
        if self.seed != here.seed:
            return "its prompts were drawn with another seed, so its prompt ids name other prompts"
        return None


@dataclasses.dataclass(frozen=True)
class KeptBatch:
    """A batch the learner trained on, as it was: ``step`` is the policy version its
    update made; ``groups`` hold every sample's token ids, behaviour log-probs,
    policy versions and rewards (each function's in ``Sample.rewards``);
    ``advantages`` the GRPO advantages it was trained with (per group, per sample);
    ``metrics`` the step's record; ``config`` the learner settings in force;
    ``origin`` the session, task and vocabulary that made it (:class:`BatchOrigin`;
    set by the session before anyone sees the batch, None on one made by hand)."""

    step: int
    groups: tuple[Group, ...]
    advantages: tuple[tuple[float, ...], ...]
    metrics: Mapping[str, float]
    config: LearnConfig
    origin: BatchOrigin | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def of(
        cls,
        groups: Sequence[Group],
        metrics: Mapping[str, float],
        config: LearnConfig,
        advantages: tuple[tuple[float, ...], ...] | None = None,
    ) -> KeptBatch:
        """The batch of ``groups``, trained on under ``config`` with ``metrics``;
        ``advantages``: those the update used (``Learner.last_advantages``), or
        :meth:`advantages_for`'s, computed here, when None."""
        if advantages is None:
            advantages = cls.advantages_for(groups, config)
        return cls(int(metrics["version"]), tuple(groups), advantages, dict(metrics), config)

    @staticmethod
    def advantages_for(groups: Sequence[Group], config: LearnConfig) -> tuple[tuple[float, ...], ...]:
        """What a kept batch of ``groups`` records as their advantages under ``config``
        (an advantage function is called: the trainer asks before it updates, so that
        one that raises fails the step before anything changed)."""
        rewards = [[float(s.reward or 0.0) for s in g.samples] for g in groups]
        return advantages_of(rewards, algorithm=config.resolved_algorithm, groups=groups)

    def stamped(self, origin: BatchOrigin) -> KeptBatch:
        """This batch, its :attr:`origin` set to ``origin`` if it had none (once, in
        place: the trainer that made it knows no tokenizer, the session that keeps it
        does, and stamps it before handing it out)."""
        if self.origin is None:
            object.__setattr__(self, "origin", origin)  # the same value, whichever thread sets it first
        return self

    @property
    def rewards(self) -> tuple[tuple[float, ...], ...]:
        """Each sample's reward (the weighted sum), group by group."""
        return tuple(tuple(float(s.reward or 0.0) for s in g.samples) for g in self.groups)

    @property
    def samples(self) -> int:
        return sum(len(g.samples) for g in self.groups)

    def __repr__(self) -> str:
        reward = self.metrics.get("reward_mean")
        tail = "" if reward is None else f", reward_mean {reward:.3f}"
        return f"<KeptBatch step {self.step}: {len(self.groups)} groups, {self.samples} samples{tail}>"


_CLIP_FIELDS = ("clip_eps", "clip_low", "clip_high")


def _clip_reason(learn: LearnConfig) -> str:
    """Why a step under ``learn`` whose record says ``clip_active`` 0 had no clip."""
    return learn.why_no_clip or ONE_UPDATE


def clip_note(
    changes: Mapping[str, Any], baseline: LearnConfig, changed: LearnConfig, active: tuple[bool, bool]
) -> str:
    """What a what-if says about the clip under the ``baseline`` and ``changed``
    settings, where it could act (``active``: each twin's ``clip_active``) in one
    of them at most; "" where it could in both."""
    if all(active):
        return ""
    if not any(active):
        reasons = {_clip_reason(baseline), _clip_reason(changed)}
        text = f"clip inactive in both columns ({'; '.join(sorted(reasons))})"
        if changes.keys() & set(_CLIP_FIELDS):
            text += f": {', '.join(k for k in changes if k in _CLIP_FIELDS)} can change nothing here"
            if changed.epochs == 1 and changed.minibatches == 1:
                text += (
                    "; for the clip to act, more than one update per batch: LearnConfig(epochs=2) or minibatches > 1"
                )
        return text
    if active[1]:
        return f"clip inactive now ({_clip_reason(baseline)}), active with the change"
    return f"clip active now, inactive with the change ({_clip_reason(changed)})"


@dataclasses.dataclass(frozen=True)
class WhatIf:
    """What one learner step on a kept batch gives under other settings.

    ``recorded``: the step's metrics when it was trained. ``baseline`` and
    ``changed``: the same batch trained once more by twins of the current policy and
    optimiser, with the settings in force and with ``changes``: their difference is
    the change's alone (the recorded step started from older weights). ``note``:
    what it shows says of the clip where it could not act in a column (its
    ``clip_active`` 0, e.g. one update per batch, whose ratio is 1: a clip setting
    then changes nothing), "" otherwise."""

    step: int
    changes: Mapping[str, Any]
    recorded: Mapping[str, float]
    baseline: Mapping[str, float]
    changed: Mapping[str, float]
    note: str = ""

    def rows(self) -> list[tuple[str, float | None, float | None, float | None]]:
        """``(metric, recorded, baseline, changed)`` for each compared metric in either
        column (None where a column has none: recorded for what the update did, which a
        training step does not measure; a critic's for an algorithm without one)."""
        return [
            (k, self.recorded.get(k), self.baseline.get(k), self.changed.get(k))
            for k in COMPARED
            if k in self.changed or k in self.baseline
        ]

    def _what(self) -> str:
        """The changes as the title shows them: an algorithm by its label ("dapo",
        "custom (loss=...)"), a function by its name, not their reprs."""

        def shown(value: Any) -> str:
            if isinstance(value, Algorithm):
                return algorithm_label(value)
            return describe(value) if callable(value) else repr(value)

        return ", ".join(f"{k}={shown(v)}" for k, v in self.changes.items()) or "no change"

    def __repr__(self) -> str:
        lines = [f"what if {self._what()}, on the batch of step {self.step}:"]
        lines.append(f"{'':28}{'recorded':>12}{'now':>12}{'what if':>12}")
        for key, *values in self.rows():
            lines.append(f"{key:28}" + "".join(f"{_cell(key, v):>12}" for v in values))
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        what = html.escape(self._what())
        head = "<tr><th></th><th>recorded</th><th>now</th><th>what if</th></tr>"
        body = "".join(
            f"<tr><td>{k}</td>" + "".join(f"<td>{_cell(k, v)}</td>" for v in values) + "</tr>"
            for k, *values in self.rows()
        )
        note = f'<div class="rlnb-whatif-note">{html.escape(self.note)}</div>' if self.note else ""
        return f"<b>what if {what}</b>, on the batch of step {self.step}<table>{head}{body}</table>{note}"


def _cell(key: str, value: float | None) -> str:
    """A value of the table as shown: ``clip_active`` as "yes"/"no" (could a clip act),
    ``tokens_counted`` whole."""
    if value is None:
        return ""
    if key == "clip_active":
        return "yes" if value else "no"
    if key == "tokens_counted":
        return f"{value:.0f}"  # a count: 12345, not 1.234e+04
    return f"{value:.4g}"


def what_if(twins: tuple[Learner, Learner], batch: KeptBatch, changes: Mapping[str, Any]) -> WhatIf:
    """Train ``twins`` (a learner's :meth:`~Learner.twin` with its own settings, and one
    with ``changes``; taken together while no step ran) on ``batch``; see
    :class:`WhatIf`. The process's random state is left as it was."""
    groups, results = list(batch.groups), []
    for twin in twins:
        device = twin.policy.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            before, tokens = twin.logp(groups)
            metrics = twin.step(groups)
            after, _ = twin.logp(groups)
        results.append({**metrics, **_update_effect(before, after, tokens, twin.config.resolved_algorithm)})
    active = (results[0].get("clip_active") != 0.0, results[1].get("clip_active") != 0.0)
    note = clip_note(changes, twins[0].config, twins[1].config, active)
    return WhatIf(batch.step, dict(changes), dict(batch.metrics), results[0], results[1], note)


def _update_effect(
    before: torch.Tensor, after: torch.Tensor, batch: TrainBatch, algorithm: Algorithm
) -> dict[str, float]:
    """What one update did to the policy on its batch's tokens: ``update_kl``, the KL
    from the policy before to the one after (k3 estimate, on the batch's samples);
    ``update_ratio_outside_clip``, the share of tokens whose probability ratio left
    the algorithm's clip range [1 - clip_low, 1 + clip_high]; ``logp_change_positive``
    / ``_negative``, the mean change of the log-prob of tokens of samples with a
    positive / negative advantage (per-token advantages: of such tokens)."""
    mask = batch.mask
    delta = (after - before)[mask]
    ratio = delta.exp()
    per_token = batch.advantages if batch.advantages.dim() == 2 else batch.advantages[:, None].expand_as(mask)
    advantage = per_token[mask]
    low, high = 1 - algorithm.clip_low, 1 + algorithm.clip_high

    def mean(values: torch.Tensor) -> float:
        return float(values.mean()) if values.numel() else 0.0

    return {
        "update_kl": mean(ratio - 1 - delta),
        "update_ratio_outside_clip": mean(((ratio < low) | (ratio > high)).float()),
        "logp_change_positive": mean(delta[advantage > 0]),
        "logp_change_negative": mean(delta[advantage < 0]),
    }

"""Questions asked of the batches a session trained on: what if the learner's
settings differed (``Session.what_if``), the current policy's log-probs
(``Session.logprobs``), another reward (``Session.rescore``), and whether a batch
is this session's to read at all."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from rlnb._errors import BatchIndexError, ConfigError, InvalidTypeError, RolloutError, StateError
from rlnb._reprs import short_repr
from rlnb.config import LearnConfig

if TYPE_CHECKING:
    from rlnb._samples import Group, Sample
    from rlnb.config import ModelConfig
    from rlnb.data import Task
    from rlnb.learn import BatchOrigin, KeptBatch, Trainer, WhatIf

__all__ = ["BatchQuestions"]


class BatchQuestions:
    """What a session answers about batches: the trainer's kept batches, read with the
    session's tokenizer, task and seed (its :class:`~rlnb.learn.BatchOrigin`)."""

    def __init__(
        self, *, name: str, trainer: Trainer, task: Task, tokenizer: Any, model: ModelConfig, seed: int
    ) -> None:
        self._name, self._trainer, self._task, self._tokenizer = name, trainer, task, tokenizer
        self._model, self._seed = model, seed
        self._origin: BatchOrigin | None = None

    @property
    def origin(self) -> BatchOrigin:
        """What makes this session's batches; made once (the digest reads every token)."""
        if self._origin is None:
            from rlnb.learn import BatchOrigin, vocabulary_digest

            digest = vocabulary_digest(self._tokenizer)
            self._origin = BatchOrigin(self._name, self._task.name, self._seed, digest)
        return self._origin

    def kept_batches(self) -> list[KeptBatch]:
        """The trainer's kept batches, oldest first, each stamped with its origin."""
        origin = self.origin
        return [b.stamped(origin) for b in self._trainer.batches]

    def kept(self, batch: KeptBatch | int | None, call: str) -> KeptBatch:
        """The kept batch ``batch`` names: None the last, an int an index, or one given."""
        kept = self._trainer.batches
        if batch is None or (isinstance(batch, int) and not isinstance(batch, bool)):
            if not kept:
                why = "LearnConfig.keep_batches is 0" if not kept.maxlen else "no step has been trained yet"
                raise StateError(f"{call}(): there is no kept batch to ask of ({why})")
            if batch is None:
                return kept[-1].stamped(self.origin)
            try:
                return list(kept)[batch].stamped(self.origin)
            except IndexError:
                raise BatchIndexError(
                    f"{call}(batch={batch}): {len(kept)} batches are kept (sess.batches); use an index in "
                    f"[{-len(kept)}, {len(kept)})"
                ) from None
        if isinstance(batch, bool) or not hasattr(batch, "groups") or not hasattr(batch, "metrics"):
            raise InvalidTypeError(
                f"{call}(batch={batch!r}): pass one of sess.batches, an index into them, or None (the last)"
            )
        self.check_readable(batch, call)
        return batch

    def check_readable(self, batch: Any, call: str, argument: str = "batch") -> None:
        """Raise ConfigError unless this session can read ``batch`` (a kept batch, a
        group or groups): one kept by a session of another task, seed or vocabulary
        (its :class:`~rlnb.learn.KeptBatch` ``origin`` says), or holding a token id
        outside this model's vocabulary, would be read as other tokens or prompts."""
        from rlnb._samples import Group
        from rlnb.learn import BatchOrigin

        if any(b is batch for b in self._trainer.batches):
            batch.stamped(self.origin)  # in place, once
            return  # one of its own
        origin = getattr(batch, "origin", None)
        here = self.origin
        if isinstance(origin, BatchOrigin) and (why := origin.mismatch(here)) is not None:
            raise ConfigError(
                f"{call}({argument}={short_repr(batch)}) is invalid: it was kept by {origin}, and this is {here}: "
                f"{why}; pass one of this session's batches (sess.batches), or ask session {origin.session!r}"
            )
        groups = [batch] if isinstance(batch, Group) else getattr(batch, "groups", batch)
        if isinstance(groups, str) or not hasattr(groups, "__iter__"):
            return  # not groups: the caller says what it takes
        limit = self._id_limit()
        for g, group in enumerate(groups):
            for s, sample in enumerate(getattr(group, "samples", ())):
                ids = (*getattr(group, "prompt_ids", ()), *getattr(sample, "token_ids", ()))
                bad = next((i for i in ids if not 0 <= i < limit), None)
                if bad is not None:
                    raise ConfigError(
                        f"{call}(): group {g}, sample {s} holds token id {bad}, outside this session's vocabulary "
                        f"of {limit} ids: it was made with another tokenizer; pass groups this session made "
                        "(sess.batches, sess.rollout(4))"
                    )

    def _id_limit(self) -> int:
        """How many token ids this session's model reads (its embedding's rows)."""
        policy: Any = self._trainer.learner.policy
        embeddings = getattr(getattr(policy, "model", None), "get_input_embeddings", None)
        rows = embeddings().num_embeddings if embeddings is not None else self._model.vocab_size or 0
        return max(int(rows), int(self._tokenizer.vocab_size))

    def what_if(self, batch: KeptBatch | int | None, changes: dict[str, Any]) -> WhatIf:
        """``Session.what_if``: one step on twins of the current learner, as it is and changed."""
        from rlnb.learn import what_if

        kept = self.kept(batch, "what_if")
        learner = self._trainer.learner
        try:
            config = _what_if_config(learner.config, changes)
        except TypeError as exc:
            raise ConfigError(f"what_if(): {exc}") from None
        if (kl_coef := config.resolved_algorithm.kl_coef) > 0 and not learner.has_reference:
            raise ConfigError(
                f"what_if(kl_coef={kl_coef!r}): this session keeps no reference policy (it started with "
                "kl_coef=0), so there is no KL to measure"
            )
        with self._trainer.update_lock:
            twins = learner.twin(), learner.twin(config)
        return what_if(twins, kept, changes)

    def logprobs(self, groups: Any) -> list[list[list[float]]]:
        """``Session.logprobs``: the current policy's log-prob of each completion token."""
        self.check_readable(groups, "logprobs", "groups")
        chosen = list(getattr(groups, "groups", groups))
        if not chosen:
            return []
        learner = self._trainer.learner
        with self._trainer.update_lock:
            logp, batch = learner.logp(chosen)
        rows = logp.cpu().tolist()
        lengths = batch.lengths.tolist()
        out, row = [], 0
        for group in chosen:
            out.append([rows[row + i][: int(lengths[row + i])] for i in range(len(group.samples))])
            row += len(group.samples)
        return out

    def rescore(self, batch: KeptBatch | int | None, reward: Any, reward_weights: list[float] | None) -> dict[str, Any]:
        """``Session.rescore``: a kept batch's rewards and advantages under another reward."""
        from rlnb.learn import advantages_of
        from rlnb.rewards import Rewards

        kept = self.kept(batch, "rescore")
        rewards = Rewards.of(reward, reward_weights, field="rescore")
        algorithm = self._trainer.learner.config.resolved_algorithm
        seed = self._seed if kept.origin is None else kept.origin.seed
        values: list[list[float]] = []
        for g, group in enumerate(kept.groups):
            item = self._task.item(seed, group.prompt_id)
            if item.prompt != group.prompt:
                raise ConfigError(
                    f"rescore(): group {g} holds the prompt {short_repr(group.prompt)}, but task "
                    f"{self._task.name!r} gives prompt {group.prompt_id} as {short_repr(item.prompt)}, so its answer "
                    "would be another prompt's; rescore batches this session kept (sess.batches)"
                )
            values.append(self._rescore_group(rewards, item, group, g))
        return {
            "rewards": values,
            "advantages": [list(a) for a in advantages_of(values, algorithm=algorithm, groups=kept.groups)],
            "recorded_rewards": [list(r) for r in kept.rewards],
            "recorded_advantages": [list(a) for a in kept.advantages],
        }

    def _rescore_group(self, rewards: Any, item: Any, group: Group, g: int) -> list[float]:
        """``group``'s rewards under ``rewards``, each sample scored as the rollout scored
        it (``rollout/_group.py``'s ``_run_sample``, the session's reward functions)."""
        from rlnb.rewards import BadValue

        texts = [self._scored_text(s) for s in group.samples]
        prompt = f"prompt {group.prompt_id} ({short_repr(item.prompt)})"
        where = f"group {g}: {prompt}"
        try:
            scored = []
            for s, (sample, text) in enumerate(zip(group.samples, texts, strict=True)):
                where = f"group {g}, sample {s}: {prompt}, completion {short_repr(text)}"
                scored.append(
                    rewards.score(text, item.answer, prompt=item.prompt, row=item.row, env_reward=sample.env_reward)
                )
            if rewards.has_batched:
                n = len(group.samples)
                where = f"group {g}: {prompt}, its {n} completions"
                scored = rewards.score_group(
                    [s.parts for s in scored],
                    [s.completion for s in group.samples],  # as the rollout's group scoring gives them
                    [item.answer] * n,
                    [item.prompt] * n,
                    [item.row] * n,
                    [s.env_reward for s in group.samples],
                    completion_ids=[s.token_ids for s in group.samples],
                    prompt_messages=[item.messages] * n,
                )
        except BadValue as bad:
            which = "the reward function" if bad.function is None else f"the reward function {bad.function!r}"
            may_skip = "" if bad.function is None else ", or None when it does not apply to the sample"
            raise RolloutError(
                f"rescore(): {which} returned {bad.value} for {where}; a reward must be a finite number within "
                f"float32's range, |r| <= 3.4e38 (int, float, bool or a numpy/torch scalar){may_skip}"
            ) from None
        except Exception as exc:
            raise RolloutError(f"rescore(): a reward function raised {exc!r} for {where}") from exc
        return [s.total for s in scored]

    def _scored_text(self, sample: Sample) -> str:
        """The text the rollout gave ``sample``'s reward: its completion, or for a
        conversation its last policy turn (the tokens from the last turn's start,
        up to any the environment spoke)."""
        if len(sample.turns) == 1 and not sample.is_conversation:
            return sample.completion
        start = sample.turns[-1]
        end = next((i for i in range(start, len(sample.token_ids)) if not sample.mask[i]), len(sample.token_ids))
        return str(self._tokenizer.decode(list(sample.token_ids[start:end])))


def _fields(config: Any) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _what_if_config(config: LearnConfig, changes: dict[str, Any]) -> LearnConfig:
    """``config`` with ``changes``: LearnConfig's fields, and the algorithm's own
    (``clip_high=0.28``, ``loss="gspo"``...), which change the algorithm in force (its
    LearnConfig overrides included) and then take LearnConfig's changes on top."""
    from rlnb.algorithms import Algorithm

    own = {f.name for f in dataclasses.fields(Algorithm)} - set(_fields(config))
    knobs = {k: v for k, v in changes.items() if k in own}
    learn = {k: v for k, v in changes.items() if k not in own}
    fields = _fields(config)
    if knobs:
        if "clip_eps" in learn and learn["clip_eps"] is not None and {"clip_low", "clip_high"} & set(knobs):
            raise ConfigError(
                f"what_if(clip_eps={learn['clip_eps']!r}, ...): clip_eps sets both clip bounds and would hide "
                f"{sorted({'clip_low', 'clip_high'} & set(knobs))}: give one or the other"
            )
        base = LearnConfig(**{**fields, "algorithm": learn.pop("algorithm", config.algorithm)}).resolved_algorithm
        try:
            algorithm = base.replace(**knobs)
        except ConfigError as exc:
            raise ConfigError(f"what_if(): {exc}") from None
        fields.update(algorithm=algorithm, clip_eps=None, is_cap=None, kl_coef=None, scale_advantages=None)
    return LearnConfig(**{**fields, **learn})

"""The session's experiment cells: change settings of a running session, fork it, and
ask "what if" of the batches it trained on. A part of :class:`~rlnb.Session`.

``set`` changes the live settings (:data:`rlnb.config.LIVE_FIELDS`): learner ones
take effect in the next update (``clip_eps``, ``is_cap`` and ``kl_coef`` as it
starts, ``lr`` and ``max_grad_norm`` at its optimiser step: a step under way takes a
new ``lr`` unless it has stepped already), rollout ones for every group dispatched after the call (groups in
flight keep theirs; ``statistics().rollout.old_settings_in_flight`` counts their
samples). Each change is a :class:`~rlnb.config.Change` in ``changes``, an event of
the tracker and a checkpoint's, and ``config`` shows the values in force.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import os
import re
import threading
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlnb._errors import ConfigError, RolloutError, public_call
from rlnb._reprs import short_repr
from rlnb.config import Change, Config, LearnConfig, ModelConfig, config_to_dict
from rlnb.runtime import lookup_session, sessions
from rlnb.session import _assembly as parts

if TYPE_CHECKING:
    from rlnb._samples import Group, Sample
    from rlnb.data import Task
    from rlnb.learn import BatchOrigin, KeptBatch, Trainer, WhatIf
    from rlnb.rollout import Rollouter
    from rlnb.runtime import AsyncBridge
    from rlnb.session._session import Session
    from rlnb.track import Tracker

__all__ = ["ExperimentCells"]


class ExperimentCells:
    """Live settings, fork and what-if of :class:`~rlnb.Session`, which provides the
    parts and ``_check()``."""

    _bridge: AsyncBridge
    _trainer: Trainer
    _tracker: Tracker
    _config: Config
    _task: Task
    _tokenizer: Any
    _model: ModelConfig
    _name: str
    _prompts: Any
    _settings_lock: threading.Lock
    reward_name: str | None
    _custom_reward: Callable[[str, Any], float] | None

    def _check(self) -> Rollouter:
        raise NotImplementedError  # the session's

    # -- live settings ----------------------------------------------------------------

    @property
    def changes(self) -> list[Change]:
        """Every live setting changed in this run (:meth:`set`), oldest first: a record
        ``(step, field, old, new, time)`` each. A checkpoint keeps them, and a fork
        starts with its parent's."""
        return list(self._trainer.changes)

    @public_call("nothing was changed, or every change was made: sess.config says which")
    def set(self, **changes: Any) -> list[Change]:
        """Change live settings of this session, in the foreground or while it trains in
        the background, e.g. ``sess.set(lr=1e-3, temperature=0.7)``; returns a
        :class:`~rlnb.config.Change` for each value that differs (logged by the tracker).

        The live settings are :data:`rlnb.config.LIVE_FIELDS`: the learner's ``lr``,
        ``lr_decay_steps``, ``kl_coef``, ``clip_eps``, ``is_cap`` and ``max_grad_norm``
        (from the next update; see the module docstring), and rollouts' ``temperature``, ``top_p``, ``top_k``,
        ``max_new_tokens``, ``max_policy_lag``, ``groups_per_step``, ``group_size`` and
        ``reward_weights`` (for groups dispatched from now on). Raises
        :class:`~rlnb.ConfigError` for another field or a value ``Config`` refuses,
        before anything changes."""
        rollouter = self._check()
        with self._settings_lock:
            config, diff = self._live_config(changes)
            if not diff:
                return []
            step = self._trainer.version
            records = [Change(step, field, old, new) for field, old, new in diff]
            self._apply(config, {field for field, _, _ in diff}, rollouter)
            self._trainer.changes.extend(records)
            as_dict = config_to_dict(config)
            for record in records:
                self._tracker.log_change(record.as_dict(), as_dict)
        return records

    def _live_config(self, changes: dict[str, Any], *, call: str = "set") -> tuple[Config, list[tuple[str, Any, Any]]]:
        """The config with ``changes``, and what differs; every check that needs the
        session's parts too (the reference policy, the reward, the model's length)."""
        config, diff = self._config.with_live(**changes)
        changed = {field for field, _, _ in diff}
        learner = self._trainer.learner
        if "kl_coef" in changed and config.learn.kl_coef > 0 and not learner.has_reference:
            raise ConfigError(
                f"{call}(kl_coef={config.learn.kl_coef!r}): this session started with kl_coef=0, so it kept no "
                "frozen reference policy to measure the KL against; start one with LearnConfig(kl_coef>0) "
                "(a small value such as 1e-3 keeps the reference), or use LoRA, whose base model is the reference"
            )
        if "reward_weights" in changed and self.reward_name is not None:
            raise ConfigError(
                f"{call}(reward_weights=...): a custom reward from set_reward() ({self.reward_name}) is in force; "
                "reward_weights weigh the task's own reward functions"
            )
        if "max_new_tokens" in changed:
            from rlnb.models import check_positions

            try:
                check_positions(config, self._task, self._tokenizer)
            except ConfigError as exc:
                raise ConfigError(f"{call}(max_new_tokens={config.rollout.max_new_tokens!r}): {exc}") from None
        return config, diff

    def _apply(self, config: Config, changed: Collection[str], rollouter: Rollouter) -> None:
        """Hand ``config``'s live settings to the parts that use them."""
        trainer = self._trainer
        if config.learn != self._config.learn:
            trainer.learner.config = config.learn  # read once at the start of each step
        if config.rollout != self._config.rollout:
            r = config.rollout
            self._bridge.run(
                rollouter.configure(
                    group_size=r.group_size,
                    sampling=parts.sampling_params(config, self._task),
                    max_policy_lag=r.max_policy_lag,
                    groups_per_step=r.groups_per_step,
                )
            )
        if "reward_weights" in changed:
            rewards = self._task.rewards.with_weights(config.rollout.reward_weights)
            self._bridge.run(rollouter.set_reward_fn(*parts.reward_functions(rewards)))
        self._config = trainer.config = config

    # -- what it reads and writes --------------------------------------------------------

    def _paths_in_use(self) -> list[tuple[Path, str]]:
        """What this session reads or writes while it lives, with what each is: no save
        may replace them or a directory holding them (``rlnb._files.check_not_in_use``)."""
        used = []
        if self._config.model.path is not None:
            used.append((Path(self._config.model.path), "the base model (ModelConfig.path)"))
        if self._config.track.run_dir is not None:
            used.append((Path(self._config.track.run_dir), "the run dir (TrackConfig.run_dir)"))
        records = getattr(self._task, "records", None)
        if (path := _records_file(records)) is not None:
            used.append((path, f"the records file of task {self._task.name!r}"))
        return used

    # -- fork -------------------------------------------------------------------------

    @public_call("nothing was made; this session is as it was", waits_for_rollouts=True)
    def fork(self, name: str, **changes: Any) -> Session:
        """A new, independent session called ``name`` that starts where this one stands:
        weights, optimiser, scheduler, prompt stream position, random streams, buffer,
        history and change log, with the live settings ``changes`` (:meth:`set`'s)
        applied. Without changes, in sync mode, its next ``step()`` gives the same
        metrics as this one's.

        Generations in flight are finished into the buffer first (nothing is lost, as
        in :meth:`save`). The fork builds its own engine, loader and tracker from the
        config (an ``engine=`` object given to this session is not shared); with a
        run dir, its tracker writes to ``<run_dir>-<name>`` (``name`` with each
        character other than letters, digits, ``_``, ``.`` and ``-`` made ``_`` and,
        where any was, a hash of ``name`` added, so two names never share a
        directory); where that directory already holds another run's files, or is a
        live session's run dir, the first free ``<run_dir>-<name>-2``, ``-3``... is
        taken instead, and a line says so. Callbacks are not copied; a reward from
        :meth:`set_reward` is. Each session trains and closes on its own.

        A fork never replaces a session: ``name`` must not be a live session's
        (unlike ``Session(name=...)``, which closes the one its cell made before).
        Raises :class:`~rlnb.ConfigError` for a bad or live name or a bad change, and
        ``RuntimeError`` while this session trains in the background (``stop()`` it
        first), before anything is made."""
        from rlnb import checkpoint

        self._check()
        if not isinstance(name, str) or not name.strip() or name == self._name:
            raise ConfigError(
                f"fork(name={name!r}) is invalid: give the new session a name of its own, e.g. "
                f"fork({self._name + '-b'!r}) (its name must differ from this session's, {self._name!r})"
            )
        if (live := lookup_session(name)) is not None and not live.closed:
            raise ConfigError(
                f"fork(name={name!r}) is invalid: a live session is called {name!r} ({live!r}), and a fork never "
                f"replaces one: pick another name, e.g. fork({_free_name(name)!r}), or close it first "
                "(rlnb.sessions() lists the live ones)"
            )
        config, diff = self._live_config(changes, call="fork")
        if (run_dir := config.track.run_dir) is not None:
            sibling = _fork_run_dir(Path(run_dir), name)
            config = config.replace(track=dataclasses.replace(config.track, run_dir=str(sibling), run_id=None))
        trainer = self._trainer
        with trainer.quiesced("fork()"):
            manifest, tensors = checkpoint.capture(
                trainer, prompts=self._prompts, name=self._name, run_id=None, reward=self.reward_name
            )
            tensors = {stem: {k: v.clone() for k, v in state.items()} for stem, state in tensors.items()}
        manifest["format_version"] = checkpoint.FORMAT_VERSION  # as write() would record it
        history, evaluations = [dict(m) for m in trainer.history], list(trainer.evaluations)
        make: Any = type(self)  # the Session class (imported from here it would be a cycle)
        fork: Session = make(config, name=name, _restore=(manifest, tensors, Path(f"<fork of {self._name!r}>")))
        try:
            fork._trainer.history[:0] = history
            fork._trainer.evaluations[:0] = evaluations  # the change log came with the checkpoint
            if self._custom_reward is not None:
                fork.set_reward(self._custom_reward)
            step = fork._trainer.version
            records = [Change(step, field, old, new) for field, old, new in diff]
            fork._trainer.changes.extend(records)
            as_dict = config_to_dict(config)
            for record in records:
                fork._tracker.log_change(record.as_dict(), as_dict)
        except BaseException:
            fork.close()
            raise
        return fork

    # -- what if ------------------------------------------------------------------------

    @property
    def batches(self) -> list[KeptBatch]:
        """The last ``LearnConfig.keep_batches`` batches trained on, oldest first, frozen
        (:class:`~rlnb.learn.KeptBatch`): token ids, behaviour log-probs, versions,
        rewards by function, advantages, the step's metrics, and their ``origin``
        (this session, its task and vocabulary)."""
        origin = self._batch_origin()
        return [b.stamped(origin) for b in self._trainer.batches]

    def _batch_origin(self) -> BatchOrigin:
        """What makes this session's batches; made once (the digest reads every token)."""
        origin: BatchOrigin | None = self.__dict__.get("_origin")
        if origin is None:
            from rlnb.learn import BatchOrigin, vocabulary_digest

            digest = vocabulary_digest(self._tokenizer)
            origin = self.__dict__["_origin"] = BatchOrigin(self._name, self._task.name, self._config.seed, digest)
        return origin

    def _kept(self, batch: KeptBatch | int | None, call: str) -> KeptBatch:
        kept = self._trainer.batches
        if batch is None or (isinstance(batch, int) and not isinstance(batch, bool)):
            if not kept:
                why = "LearnConfig.keep_batches is 0" if not kept.maxlen else "no step has been trained yet"
                raise RuntimeError(f"{call}(): there is no kept batch to ask of ({why})")
            if batch is None:
                return kept[-1].stamped(self._batch_origin())
            try:
                return list(kept)[batch].stamped(self._batch_origin())
            except IndexError:
                raise IndexError(
                    f"{call}(batch={batch}): {len(kept)} batches are kept (sess.batches); use an index in "
                    f"[{-len(kept)}, {len(kept)})"
                ) from None
        if isinstance(batch, bool) or not hasattr(batch, "groups") or not hasattr(batch, "metrics"):
            raise TypeError(
                f"{call}(batch={batch!r}): pass one of sess.batches, an index into them, or None (the last)"
            )
        self._check_readable(batch, call)
        return batch

    def _check_readable(self, batch: Any, call: str, argument: str = "batch") -> None:
        """Raise ConfigError unless this session can read ``batch`` (a kept batch, a
        group or groups): one kept by a session of another task, seed or vocabulary
        (its :class:`~rlnb.learn.KeptBatch` ``origin`` says), or holding a token id
        outside this model's vocabulary, would be read as other tokens or prompts."""
        from rlnb._samples import Group
        from rlnb.learn import BatchOrigin

        if any(b is batch for b in self._trainer.batches):
            batch.stamped(self._batch_origin())
            return  # one of its own
        origin = getattr(batch, "origin", None)
        here = self._batch_origin()
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

    @public_call("nothing was changed")
    def what_if(self, batch: KeptBatch | int | None = None, **changes: Any) -> WhatIf:
        """One learner step on a kept batch (None: the last; an int indexes
        :attr:`batches`) with the learner settings ``changes`` (any
        :class:`~rlnb.LearnConfig` field), run on twins of the **current** policy and
        optimiser: once with the settings in force and once with the changes, so the
        two differ by the change alone. Returns a :class:`~rlnb.learn.WhatIf` with
        both, beside the step's recorded metrics (loss, KL, clip fraction, grad norm,
        entropy...). The session is not changed: its weights, optimiser, version and
        random state are as they were, so its next step is the same as without the
        question. Works while it trains in the background (the twins are taken
        between two steps).

        A batch kept by another session is read where it has this session's task,
        seed and vocabulary (a fork's parent's, say); one of another task, seed or
        vocabulary is refused with :class:`~rlnb.ConfigError` naming both sessions
        (its token ids would be read as other tokens)."""
        from rlnb.learn import what_if

        self._check()
        kept = self._kept(batch, "what_if")
        learner = self._trainer.learner
        try:
            config = LearnConfig(**{**_fields(learner.config), **changes})
        except TypeError as exc:
            raise ConfigError(f"what_if(): {exc}") from None
        if config.kl_coef > 0 and not learner.has_reference:
            raise ConfigError(
                f"what_if(kl_coef={config.kl_coef!r}): this session keeps no reference policy (it started with "
                "kl_coef=0), so there is no KL to measure"
            )
        with self._trainer.update_lock:
            twins = learner.twin(), learner.twin(config)
        return what_if(twins, kept, changes)

    @property
    def tokenizer(self) -> Any:
        """The session's tokenizer: ``encode(text)``, ``decode(ids)`` (the task's
        characters, or the Hugging Face model's own)."""
        return self._tokenizer

    @public_call("nothing was changed")
    def logprobs(self, groups: Any) -> list[list[list[float]]]:
        """The **current** policy's log-prob of each completion token of ``groups`` (a
        kept batch, a :meth:`rollout`'s result, or a list of groups): one list per
        group, of one list per sample, as long as its ``token_ids``. Beside a sample's
        behaviour log-probs (``Sample.logprobs``, the engine's as it sampled) they give
        the importance ratio of each token. Taken between two steps (also while
        training runs in the background); the session is not changed. Raises
        :class:`~rlnb.ConfigError` for a batch kept by a session of another task,
        seed or vocabulary, or groups holding a token id this model does not have
        (see :meth:`what_if`)."""
        self._check()
        self._check_readable(groups, "logprobs", "groups")
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

    @public_call("nothing was changed")
    def rescore(
        self,
        batch: KeptBatch | int | None = None,
        *,
        reward: Any,
        reward_weights: list[float] | None = None,
    ) -> dict[str, Any]:
        """A kept batch's rewards and GRPO advantages under another reward: ``reward``
        is a function ``(completion, answer) -> float`` or a list of them (as
        ``Task(reward=...)`` takes, with ``reward_weights``). Returns ``{"rewards":
        ..., "advantages": ..., "recorded_rewards": ..., "recorded_advantages": ...}``,
        each a list per group of a value per sample. Nothing in the session changes;
        the reward runs on this thread.

        Each sample is scored as its rollout scored it: a conversation's function gets
        its last policy turn and ``env_reward=`` the environment's reward (a batched
        function the group's samples' text, as in the rollout), so the task's own
        rewards give the recorded ones. A batch of another session is read where it
        has this session's task, seed and vocabulary (see :meth:`what_if`). Raises
        :class:`~rlnb.RolloutError` naming the function, the sample and the fix where a
        reward raises (chained) or returns something other than a finite number, and
        :class:`~rlnb.ConfigError` where a group's prompt is not the task's prompt of
        its id."""
        from rlnb.learn import advantages_of
        from rlnb.rewards import Rewards

        self._check()
        kept = self._kept(batch, "rescore")
        rewards = Rewards.of(reward, reward_weights, field="rescore")
        scale = self._trainer.learner.config.scale_advantages
        seed = self._config.seed if kept.origin is None else kept.origin.seed
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
            "advantages": [list(a) for a in advantages_of(values, scale=scale)],
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


def _records_file(records: Any) -> Path | None:
    """The file a task's records were read from, if they were (``Records.source`` is
    its path's repr then)."""
    path = getattr(records, "path", None)
    if path is None:
        source = getattr(records, "source", None)
        if isinstance(source, str) and source[:1] in "'\"" and source:
            with contextlib.suppress(ValueError, SyntaxError):
                path = ast.literal_eval(source)
    if not isinstance(path, str | os.PathLike) or not os.path.isfile(path):
        return None
    return Path(path)


def _free_name(name: str) -> str:
    """``name`` with the first suffix ``-2``, ``-3``... that no live session has."""
    taken = {s.name for s in sessions()}
    return next(f"{name}-{n}" for n in range(2, len(taken) + 3) if f"{name}-{n}" not in taken)


def _fork_run_dir(run_dir: Path, name: str) -> Path:
    """The run dir of a fork called ``name`` of a session whose run dir is ``run_dir``:
    ``<run_dir>-<name>``, made safe as a file name (other characters become ``_``, and
    a hash of ``name`` keeps two names apart: "x y" and "x?y" differ), or where that is
    a live session's or holds files, the first free ``-2``, ``-3``... after it (said
    on stdout: a notice, as a replaced session's)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    if safe != name or len(safe) > 64:
        safe = f"{safe[:48]}-{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"
    wanted = run_dir.with_name(f"{run_dir.name}-{safe}")
    live = {os.path.realpath(s.config.track.run_dir) for s in sessions() if s.config.track.run_dir is not None}
    candidate, n = wanted, 1
    while (
        os.path.realpath(candidate) in live
        or (candidate.is_dir() and any(candidate.iterdir()))
        or (os.path.lexists(candidate) and not candidate.is_dir())
    ):
        n += 1
        candidate = wanted.with_name(f"{wanted.name}-{n}")
    if candidate != wanted:
        why = "is a live session's run dir" if os.path.realpath(wanted) in live else "holds another run's files"
        print(f"rlnb: fork {name!r} writes its run to {candidate} ({wanted} {why})")
    return candidate


def _fields(config: LearnConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}

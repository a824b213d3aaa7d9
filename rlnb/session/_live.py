"""Live settings: what ``Session.set`` and ``Session.fork`` change in a running session.

``set`` changes the live settings (:data:`rlnb.config.LIVE_FIELDS`): learner ones
take effect in the next update (``clip_eps``, ``is_cap`` and ``kl_coef`` as it
starts, ``lr`` and ``max_grad_norm`` at its optimiser step: a step under way takes a
new ``lr`` unless it has stepped already), rollout ones for every group dispatched
after the call (groups in flight keep theirs;
``statistics().rollout.old_settings_in_flight`` counts their samples). Each change
is a :class:`~rlnb.config.Change` in ``Session.changes``, an event of the tracker and
a checkpoint's, and ``Session.config`` shows the values in force.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from rlnb._errors import ConfigError
from rlnb.config import Change, Config, config_to_dict
from rlnb.session import _assembly as parts

if TYPE_CHECKING:
    from rlnb.data import Task
    from rlnb.learn import Trainer
    from rlnb.rollout import Rollouter
    from rlnb.runtime import AsyncBridge
    from rlnb.track import Tracker

__all__ = ["apply", "live_config", "record"]

Diff = list[tuple[str, Any, Any]]  # (field, old, new) for each value that differs


def live_config(
    config: Config,
    changes: dict[str, Any],
    *,
    trainer: Trainer,
    task: Task,
    tokenizer: Any,
    reward_name: str | None,
    call: str = "set",
) -> tuple[Config, Diff]:
    """``config`` with ``changes``, and what differs; every check that needs the
    session's parts too (the reference policy, the reward, the model's length).
    Raises :class:`~rlnb.ConfigError` naming ``call`` and the field."""
    new, diff = config.with_live(**changes)
    changed = {field for field, _, _ in diff}
    kl_coef = new.learn.resolved_algorithm.kl_coef
    if kl_coef > 0 and not trainer.learner.has_reference:
        raise ConfigError(
            f"{call}(kl_coef={kl_coef!r}): this session started with kl_coef=0, so it kept no "
            "frozen reference policy to measure the KL against; start one with LearnConfig(kl_coef>0) "
            "(a small value such as 1e-3 keeps the reference), or use LoRA, whose base model is the reference"
        )
    if "reward_weights" in changed and reward_name is not None:
        raise ConfigError(
            f"{call}(reward_weights=...): a custom reward from sess.rollouts.set_reward() ({reward_name}) is in "
            "force; reward_weights weigh the task's own reward functions"
        )
    if "max_new_tokens" in changed:
        from rlnb.models import check_positions

        try:
            check_positions(new, task, tokenizer)
        except ConfigError as exc:
            raise ConfigError(f"{call}(max_new_tokens={new.rollout.max_new_tokens!r}): {exc}") from None
    return new, diff


def apply(
    old: Config,
    new: Config,
    changed: Collection[str],
    *,
    trainer: Trainer,
    rollouter: Rollouter,
    bridge: AsyncBridge,
    task: Task,
) -> None:
    """Hand ``new``'s live settings to the parts that use them (``old`` is in force)."""
    if new.learn != old.learn:
        trainer.learner.config = new.learn  # read once at the start of each step
    if new.rollout != old.rollout:
        bridge.run(rollouter.configure(new.rollout, parts.sampling_params(new, task)))
    if "reward_weights" in changed:
        rewards = task.rewards.with_weights(new.rollout.reward_weights)
        bridge.run(rollouter.set_reward_fn(*parts.reward_functions(rewards)))
    trainer.config = new


def record(config: Config, diff: Diff, *, trainer: Trainer, tracker: Tracker) -> list[Change]:
    """Record ``diff`` at the trainer's step: in its change log and as the tracker's events."""
    records = [Change(trainer.version, field, old, new) for field, old, new in diff]
    trainer.changes.extend(records)
    as_dict = config_to_dict(config)
    for change in records:
        tracker.log_change(change.as_dict(), as_dict)
    return records

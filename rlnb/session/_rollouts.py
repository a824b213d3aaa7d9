"""``sess.rollouts``: generation in the background, its pauses and its reward.

A :class:`Rollouts` is a part of one :class:`~rlnb.Session`; each call is a short
delegation to the session's :class:`~rlnb.rollout.Rollouter` on the session's loop.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlnb._errors import InvalidTypeError, public_call
from rlnb.engines import PauseMode
from rlnb.rewards import is_trl_reward
from rlnb.rollout import Rollouter, RolloutState

if TYPE_CHECKING:
    from rlnb.config import Config
    from rlnb.learn import Trainer
    from rlnb.runtime import AsyncBridge

__all__ = ["Reward", "Rollouts"]

Reward = Callable[[str, Any], float]  # (completion, answer) -> float


class Rollouts:
    """The session's rollouts, ``sess.rollouts``: start and stop generating into the
    buffer, pause and resume it (partial rollouts kept), and swap the reward.

    ``sess.rollout(n)`` and ``sess.complete(prompts)`` look at rollouts without the
    buffer; training (``sess.step()``, ``sess.training.start()``) starts these
    background rollouts itself where the mode needs them."""

    def __init__(
        self, *, check: Callable[[], Rollouter], bridge: AsyncBridge, trainer: Trainer, config: Callable[[], Config]
    ) -> None:
        self._check, self._bridge, self._trainer, self._config = check, bridge, trainer, config
        self._reward: Reward | None = None
        self._reward_name: str | None = None

    @property
    def state(self) -> RolloutState:
        """Where rollouts stand: ``RolloutState.RUNNING``, ``PAUSING``, ``PAUSED`` or ``CLOSED``."""
        return self._check().state

    @property
    def reward_name(self) -> str | None:
        """The name of the reward from :meth:`set_reward` in force (a checkpoint records
        it), or None while the task's own rewards score rollouts."""
        return self._reward_name

    @property
    def reward(self) -> Reward | None:
        """The function given to :meth:`set_reward`, or None (a fork takes it)."""
        return self._reward

    @public_call("statistics().rollout says whether they run")
    def start(self) -> None:
        """Generate in the background into the buffer, within the dispatch budget. Idempotent."""
        self._bridge.run(self._check().start())

    @public_call("statistics().rollout says whether they still run")
    def stop(self) -> None:
        """Stop dispatching new prompts; those in flight still finish into the buffer."""
        self._bridge.run(self._check().stop())

    @public_call("rollouts may be pausing: sess.rollouts.resume() undoes it, wait_paused() waits for it")
    def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> None:
        """Pause generation. ``"abort"`` (default) keeps every in-flight sample as a
        partial rollout and continues it after :meth:`resume`; ``"keep"`` freezes the
        engine in place; ``"wait"`` lets every dispatched group finish (:meth:`wait_paused`
        waits for that). Blocks until paused, except in ``"wait"`` mode."""
        self._bridge.run(self._check().pause(PauseMode(mode)))

    @public_call("call sess.rollouts.resume() again")
    def resume(self) -> None:
        """Leave a pause: partial rollouts continue with their prefixes and dispatch goes on.
        A trained step whose weight sync failed is synced first (:class:`~rlnb.WeightSyncError`
        again if it still fails; rollouts then stay paused)."""
        rollouter = self._check()
        self._trainer.publish_pending()
        self._bridge.run(rollouter.resume())

    @public_call("the pause goes on; sess.rollouts.wait_paused() waits again", waits_for_rollouts=True)
    def wait_paused(self, timeout: float | None = None) -> None:
        """Block until a pause has taken effect (a ``"wait"`` pause once its groups have
        finished). :class:`TimeoutError` after ``timeout`` s (``Config.step_timeout``
        when None) says what it still waits for; :class:`~rlnb.RolloutError` at once
        if rollouts are running."""
        limit = self._config().step_timeout if timeout is None else timeout
        self._bridge.run(self._check().wait_paused(timeout=limit))

    @public_call("the reward in force was kept")
    def set_reward(self, reward_fn: Reward) -> None:
        """Use ``reward_fn(completion, answer) -> float`` from the next rollout on.

        Completions already scored keep their rewards. Raises ``TypeError`` if it
        is not callable with two arguments. A checkpoint records
        that a custom reward was in force (code cannot be saved): ``Session.load`` then
        asks for it again."""
        if not callable(reward_fn):
            raise InvalidTypeError(f"set_reward() takes a callable (completion, answer) -> float, not {reward_fn!r}")
        if is_trl_reward(reward_fn):
            raise InvalidTypeError(
                f"set_reward({getattr(reward_fn, '__qualname__', reward_fn)}): it has TRL's signature (keywords, "
                "once per group), and set_reward() calls reward_fn(completion, answer) for each sample; give it "
                "to a task, rlnb.data.Task(..., reward=fn), or try it on kept batches: sess.rescore(reward=fn)"
            )
        try:
            inspect.signature(reward_fn).bind("completion", "answer")
        except TypeError:
            raise InvalidTypeError(
                f"set_reward({reward_fn!r}): it is called as reward_fn(completion, answer) -> float, "
                "so it must take two arguments"
            ) from None
        except ValueError:  # no signature to read (some builtins): it is called and checked then
            pass
        self._bridge.run(self._check().set_reward_fn(lambda item, completion, **_: reward_fn(completion, item.answer)))
        self._reward_name = getattr(reward_fn, "__qualname__", None) or repr(reward_fn)
        self._reward = reward_fn

    def __repr__(self) -> str:
        return f"<rlnb rollouts: {self._check().state.value}>"

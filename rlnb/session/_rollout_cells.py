"""The session's rollout cells: look at rollouts, generate in the background, pause
and resume, swap the reward. A part of :class:`~rlnb.Session`, kept apart so that
``session.py`` stays the composition root and its training cells."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlnb._errors import public_call
from rlnb._samples import RolloutBatch
from rlnb.engines import PauseMode, SamplingParams
from rlnb.rollout import Rollouter
from rlnb.runtime import AsyncBridge

if TYPE_CHECKING:
    from rlnb.config import Config
    from rlnb.learn import Trainer

__all__ = ["RolloutCells"]


class RolloutCells:
    """Rollout methods of :class:`~rlnb.Session`, which provides ``_bridge`` and
    ``_check()`` (every public call starts there: closed sessions and background
    errors raise)."""

    _bridge: AsyncBridge
    _trainer: Trainer
    _config: Config
    reward_name: str | None = None  # the custom reward in force (a checkpoint records it), if any
    _custom_reward: Callable[[str, Any], float] | None = None  # and its function (a fork takes it)

    def _check(self) -> Rollouter:
        raise NotImplementedError  # the session's

    @public_call("nothing was lost: its prompts are rolled out first next time", waits_for_rollouts=True)
    def rollout(self, n_groups: int = 1, *, timeout: float | None = None) -> RolloutBatch:
        """Roll out ``n_groups`` new prompts now and return them (they do not go to the buffer).

        Blocks until they finish (or ``timeout``). Raises :class:`~rlnb.RolloutError`
        if rollouts are paused or a generation or reward failed after its retries.
        """
        collect = self._check().collect(n_groups, paused_timeout=self._config.step_timeout)
        return RolloutBatch(self._bridge.run(collect, timeout=timeout))

    @public_call("nothing was changed", waits_for_rollouts=True)
    def complete(
        self, prompts: str | list[str], *, temperature: float = 0.0, max_new_tokens: int = 16, seed: int = 0
    ) -> str | list[str]:
        """What the engine's model writes after ``prompts`` (one text or a list): greedy
        by default. Nothing is rewarded, buffered or trained. Blocks."""
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not all(isinstance(t, str) for t in texts):
            raise TypeError(f"complete(prompts={prompts!r}): pass a string or a list of strings")
        sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
        out = self._bridge.run(
            self._check().complete(texts, sampling, seed=seed, paused_timeout=self._config.step_timeout)
        )
        return out[0] if isinstance(prompts, str) else out

    @public_call("statistics().rollout says whether they run")
    def start_rollouts(self) -> None:
        """Generate in the background into the buffer, within the dispatch budget. Idempotent."""
        self._bridge.run(self._check().start())

    @public_call("statistics().rollout says whether they still run")
    def stop_rollouts(self) -> None:
        """Stop dispatching new prompts; those in flight still finish into the buffer."""
        self._bridge.run(self._check().stop())

    @public_call("rollouts may be pausing: resume() undoes it, wait_paused() waits for it")
    def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> None:
        """Pause generation. ``"abort"`` (default) keeps every in-flight sample as a
        partial rollout and continues it after :meth:`resume`; ``"keep"`` freezes the
        engine in place; ``"wait"`` lets in-flight samples finish (:meth:`wait_paused`
        waits for that). Blocks until paused, except in ``"wait"`` mode."""
        self._bridge.run(self._check().pause(PauseMode(mode)))

    @public_call("call resume() again")
    def resume(self) -> None:
        """Leave a pause: partial rollouts continue with their prefixes and dispatch goes on.
        A trained step whose weight sync failed is synced first (:class:`~rlnb.WeightSyncError`
        again if it still fails; rollouts then stay paused)."""
        rollouter = self._check()
        self._trainer.publish_pending()
        self._bridge.run(rollouter.resume())

    @public_call("the pause goes on; wait_paused() waits again", waits_for_rollouts=True)
    def wait_paused(self, timeout: float | None = None) -> None:
        """Block until a pause has taken effect (a ``"wait"`` pause once its samples have
        finished). :class:`TimeoutError` after ``timeout`` s (``Config.step_timeout``
        when None) says what it still waits for; :class:`~rlnb.RolloutError` at once
        if rollouts are running."""
        limit = self._config.step_timeout if timeout is None else timeout
        self._bridge.run(self._check().wait_paused(timeout=limit))

    def set_reward(self, reward_fn: Callable[[str, Any], float]) -> None:
        """Use ``reward_fn(completion, answer) -> float`` from the next rollout on.

        Completions already scored keep their rewards. Raises ``TypeError`` if it is
        not callable. A checkpoint records that a custom reward was in force (code
        cannot be saved): ``Session.load`` then asks for it again.
        """
        if not callable(reward_fn):
            raise TypeError(f"set_reward() takes a callable (completion, answer) -> float, not {reward_fn!r}")
        try:
            inspect.signature(reward_fn).bind("completion", "answer")
        except TypeError:
            raise TypeError(
                f"set_reward({reward_fn!r}): it is called as reward_fn(completion, answer) -> float, "
                "so it must take two arguments"
            ) from None
        except ValueError:  # no signature to read (some builtins): it is called and checked then
            pass
        self._bridge.run(self._check().set_reward_fn(lambda item, completion, **_: reward_fn(completion, item.answer)))
        self.reward_name = getattr(reward_fn, "__qualname__", None) or repr(reward_fn)
        self._custom_reward = reward_fn

"""``Episode``: one environment driven through one conversation, from a worker thread.

The rollout calls an episode's methods on its reward pool (user code never runs on
the event loop). An environment's ``async def`` methods run on an event loop of the
episode's own, made at the first one and closed with the episode, so an environment
may keep an async client across its turns. Each runs as a task that the call's
timeout cancels (:mod:`rlnb.rewards._isolation`); ``close`` waits for a call still
unwinding, and leaves the closing to a call that never returns, when it does.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlnb._errors import ConfigError, RlnbError
from rlnb._reprs import short_repr
from rlnb.envs._protocol import Observation, Turn
from rlnb.rewards import BadValue, cancellable, reward_value

__all__ = ["EnvError", "Episode", "check_factory"]

# How long close() waits for a method call still running (a cancelled one unwinds in
# milliseconds) before it leaves the closing to that call.
CLOSE_WAIT_S = 1.0


class EnvError(RlnbError):
    """An environment broke its protocol (a bad return value) or raised; the message
    says which method, with what, and the fix."""


def check_factory(env: Any, field: str = "Task.env") -> None:
    """Raise :class:`~rlnb.ConfigError` naming ``field`` unless ``env`` is a factory:
    callable with no arguments (a class, a function, or a :class:`~rlnb.envs.ToolEnv`)."""
    if not callable(env) or (hasattr(env, "reset") and not hasattr(env, "__call__")):  # noqa: B004
        raise ConfigError(
            f"{field}={short_repr(env)} is invalid: pass a factory that makes one environment per sample, "
            "e.g. env=MyEnv (the class) or env=lambda: MyEnv(level=2)"
        )
    try:
        signature = inspect.signature(env)
    except (TypeError, ValueError):
        return
    try:
        signature.bind()
    except TypeError as exc:
        raise ConfigError(
            f"{field}={short_repr(env)} is invalid: it cannot be called with no arguments ({exc}); "
            "wrap it: env=lambda: MyEnv(arg)"
        ) from None


def _check_observation(value: Any, where: str) -> Observation:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Sequence) and all(isinstance(m, Mapping) and "content" in m for m in value):
        return [dict(m) for m in value]
    raise EnvError(
        f"{where} returned {short_repr(value)}: an observation must be text, a list of chat messages "
        '({"role": ..., "content": ...}) or None'
    )


class EpisodeGroup:
    """What the episodes of one group share (:attr:`Episode.group`)."""

    __slots__ = ("__weakref__",)


class Episode:
    """The environment ``factory()`` makes, for one conversation. One call at a time,
    from any thread (the rollout awaits each before the next); :meth:`close` may come
    while a call that timed out still runs."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        env = factory()
        missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
        if missing:
            raise EnvError(
                f"the environment factory {short_repr(factory)} made {short_repr(env)}, which has no "
                f"{' or '.join(missing)}() method: an environment needs reset(row) and step(completion)"
            )
        self.env = env
        self.name = type(env).__name__
        self.turns = 0
        self.reward: float | None = None  # the sum of the turns' rewards, None while none gave one
        # What the episodes of one group share (set by the rollout): a timeout of one's
        # step fails the others' later steps at once.
        self.group: EpisodeGroup | None = None
        self._runner: asyncio.Runner | None = None
        self._lock = threading.RLock()  # held by a method call, and by close
        self._close_pending = False  # close() found a call still running: the call closes when it returns

    @staticmethod
    def new_group(episodes: Sequence[Episode]) -> None:
        """Mark ``episodes`` as one group's (:attr:`group`)."""
        group = EpisodeGroup()
        for episode in episodes:
            episode.group = group

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """The tool schemas the environment offers a chat template, if any."""
        tools = getattr(self.env, "tools", None)
        return list(tools) if tools else None

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            try:
                if self.env is None:
                    raise EnvError(f"{self.name}.{method}() was called after the episode closed")
                return self._await(getattr(self.env, method)(*args))
            finally:
                if self._close_pending:
                    self._close_now()

    def _await(self, value: Any) -> Any:
        """``value``, awaited on the episode's loop if it is awaitable (cancelled when the
        reward pool stops the call: :class:`~rlnb.rewards._isolation.Cancelled`)."""
        if not inspect.isawaitable(value):
            return value
        if self._runner is None:
            # One loop for the whole conversation, not rlnb.runtime.block_on's new loop per
            # call: an environment's async methods may keep what is bound to a loop (a
            # client, a queue, a lock) from reset() to its last step().
            self._runner = asyncio.Runner()
        return self._runner.run(cancellable(value))

    def reset(self, row: Mapping[str, Any]) -> Observation:
        """The conversation's first prompt (None: the task's own)."""
        return _check_observation(self._call("reset", row), f"{self.name}.reset()")

    def step(self, completion: str) -> Turn:
        """The environment's answer to the policy's turn ``completion``; adds its reward
        to :attr:`reward`. Raises :class:`EnvError` for a value that is not a Turn."""
        where = f"{self.name}.step() after turn {self.turns + 1}"
        turn = self._call("step", completion)
        if isinstance(turn, tuple) and len(turn) == 3:  # (observation, reward, done), as gym-style code writes it
            turn = Turn(*turn)
        if not isinstance(turn, Turn):
            raise EnvError(
                f"{where} returned {short_repr(turn)}: return rlnb.envs.Turn(observation=..., reward=..., done=...)"
            )
        observation = _check_observation(turn.observation, where)
        try:
            reward = reward_value(turn.reward, allow_none=True)
        except BadValue as bad:
            raise EnvError(f"{where} gave reward={bad.value}: a reward must be a finite number, or None") from None
        if not isinstance(turn.done, bool):
            raise EnvError(f"{where} gave done={short_repr(turn.done)}: use True or False")
        self.turns += 1
        if reward is not None:
            self.reward = reward + (self.reward or 0.0)
        return Turn(observation, reward, turn.done)

    def close(self) -> None:
        """Close the environment (if it has ``close()``) and the episode's event loop.
        Idempotent; the loop is closed even when the environment's close raises.
        Blocks up to :data:`CLOSE_WAIT_S` for a method call still running (one that
        timed out); if it still runs then, it closes the episode when it returns."""
        self._close_pending = True  # first: a call that returns meanwhile closes it
        if not self._lock.acquire(timeout=CLOSE_WAIT_S):
            return
        try:
            self._close_now()
        finally:
            self._lock.release()

    def _close_now(self) -> None:
        self._close_pending = False
        env, self.env = self.env, None
        try:
            close = getattr(env, "close", None)
            if callable(close):
                self._await(close())
        finally:
            runner, self._runner = self._runner, None
            if runner is not None:
                runner.close()

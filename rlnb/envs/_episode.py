"""``Episode``: one environment driven through one conversation, from a worker thread.

The rollout calls an episode's methods on its reward pool (user code never runs on
the event loop). An environment's ``async def`` methods run on an event loop of the
episode's own, made at the first one and closed with the episode, so an environment
may keep an async client across its turns.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlnb._errors import ConfigError
from rlnb._reprs import short_repr
from rlnb.envs._protocol import Observation, Turn
from rlnb.rewards import BadValue, reward_value

__all__ = ["EnvError", "Episode", "check_factory"]


class EnvError(Exception):
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


class Episode:
    """The environment ``factory()`` makes, for one conversation. Not thread-safe:
    one call at a time, from any thread (the rollout awaits each before the next)."""

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
        self._runner: asyncio.Runner | None = None

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """The tool schemas the environment offers a chat template, if any."""
        tools = getattr(self.env, "tools", None)
        return list(tools) if tools else None

    def _call(self, method: str, *args: Any) -> Any:
        value = getattr(self.env, method)(*args)
        if inspect.isawaitable(value):
            if self._runner is None:
                self._runner = asyncio.Runner()
            value = self._runner.run(_awaited(value))
        return value

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
        Idempotent; the loop is closed even when the environment's close raises."""
        env, self.env = self.env, None
        try:
            close = getattr(env, "close", None)
            if callable(close):
                value = close()
                if inspect.isawaitable(value):
                    if self._runner is None:
                        self._runner = asyncio.Runner()
                    self._runner.run(_awaited(value))
        finally:
            runner, self._runner = self._runner, None
            if runner is not None:
                runner.close()


async def _awaited(value: Any) -> Any:
    return await value

"""``GymEnv``: a Gymnasium-style text environment as an rlnb environment.

Gymnasium's API (``reset(seed=, options=) -> (observation, info)``, ``step(action) ->
(observation, reward, terminated, truncated, info)``, ``close()``) maps onto the
protocol one to one: the policy's turn is the action, the observation is what it reads
next. Duck-typed: gymnasium itself need not be installed, and any object with those
methods works.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rlnb._errors import ConfigError
from rlnb._reprs import short_repr
from rlnb.envs._episode import EnvError
from rlnb.envs._protocol import Observation, Turn

__all__ = ["GymEnv", "seed_of"]


class GymEnv:
    """Adapts a Gymnasium-style text environment, and is its own factory: a task takes
    it as ``env=GymEnv(lambda: gymnasium.make("MyText-v0"))``, and ``GymEnv.__call__()``
    gives each sample a fresh adapter, which calls ``make()`` for an environment of its
    own at ``reset``.

    make: a function of no arguments that makes the environment (a class, or a lambda);
        not an environment, which the samples would share.
    seed: how ``reset`` seeds the environment from the prompt's row: the name of a row
        field holding an int (``"prompt_id"`` by default, so the samples of a group,
        which share a row, see the same episode), a function ``seed(row) -> int | None``,
        or None (``reset(seed=None)``: a group's samples must then still get one first
        observation, or the rollout raises :class:`EnvError`).
    options: a function ``options(row) -> dict | None`` whose value is passed as
        ``reset(options=...)`` (e.g. the record's puzzle); None passes no options.

    ``reset(row)`` returns the first observation, which must be text or chat messages
    (:class:`EnvError` otherwise: wrap the environment so it returns text). ``step``
    gives ``Turn(observation, reward, done=terminated or truncated)``; the old Gym API
    (``reset() -> observation``, ``step() -> (observation, reward, done, info)``) works
    too. :attr:`info` holds the latest ``info``. ``close()`` closes the environment (once).
    Raises :class:`~rlnb.ConfigError` for a ``make`` that is not a factory, or a
    ``seed``/``options`` of the wrong kind.
    """

    def __init__(
        self,
        make: Callable[[], Any],
        *,
        seed: str | Callable[[Mapping[str, Any]], int | None] | None = "prompt_id",
        options: Callable[[Mapping[str, Any]], Mapping[str, Any] | None] | None = None,
    ) -> None:
        if not callable(make) or (callable(getattr(make, "step", None)) and not isinstance(make, type)):
            raise ConfigError(
                f"GymEnv.make={short_repr(make)} is invalid: pass a function that makes the environment, so each "
                "sample gets its own, e.g. GymEnv(MyEnv) or GymEnv(lambda: gymnasium.make('MyText-v0'))"
            )
        if not (seed is None or isinstance(seed, str) or callable(seed)):
            raise ConfigError(
                f"GymEnv.seed={short_repr(seed)} is invalid: use the name of a row field holding an int "
                "(seed='prompt_id'), a function of the row (seed=lambda row: row['level']), or None"
            )
        if not (options is None or callable(options)):
            raise ConfigError(
                f"GymEnv.options={short_repr(options)} is invalid: use a function of the row that returns reset()'s "
                "options, e.g. options=lambda row: {'puzzle': row['puzzle']}, or None"
            )
        self.make = make
        self.seed = seed
        self.options = options
        self.env: Any = None  # the environment, once reset made it
        self.info: Any = None  # the latest info reset or step gave
        self._closed = False

    def __call__(self) -> GymEnv:
        """A fresh adapter, for one conversation (this makes a GymEnv a task's factory)."""
        return GymEnv(self.make, seed=self.seed, options=self.options)

    def __repr__(self) -> str:
        return f"GymEnv({short_repr(self.make)}, seed={short_repr(self.seed)})"

    @property
    def _name(self) -> str:
        return type(self.env).__name__ if self.env is not None else short_repr(self.make)

    def _seed_of(self, row: Mapping[str, Any]) -> int | None:
        return seed_of("GymEnv", self.seed, row)

    def reset(self, row: Mapping[str, Any]) -> Observation:
        """Make the environment (the first time) and reset it, seeded from ``row``:
        its first observation. Raises :class:`EnvError` for one that is not text or
        chat messages."""
        if self._closed:
            raise EnvError(f"GymEnv({self._name}).reset() was called after close(); make a new one")
        kwargs: dict[str, Any] = {"seed": self._seed_of(row)}
        if self.options is not None and (options := self.options(row)) is not None:
            kwargs["options"] = dict(options)
        if self.env is None:
            self.env = self.make()
            if not (callable(getattr(self.env, "reset", None)) and callable(getattr(self.env, "step", None))):
                raise EnvError(
                    f"GymEnv's make={short_repr(self.make)} made {short_repr(self.env)}, which has no reset() "
                    "and step(): make a Gymnasium-style environment"
                )
        value = self.env.reset(**kwargs)
        if isinstance(value, tuple) and len(value) == 2:
            observation, self.info = value
        else:  # the old Gym API returned the observation alone
            observation, self.info = value, None
        return self._observation(observation, "reset()")

    def step(self, completion: str) -> Turn:
        """The environment's step with the policy's turn as the action. Raises
        :class:`EnvError` for a result that is not Gymnasium's 5-tuple (or Gym's 4-tuple)."""
        if self.env is None:
            raise EnvError(f"GymEnv({self._name}).step() was called before reset()")
        value = self.env.step(completion)
        if isinstance(value, tuple) and len(value) == 5:
            observation, reward, terminated, truncated, self.info = value
            done = bool(terminated) or bool(truncated)
        elif isinstance(value, tuple) and len(value) == 4:  # the old Gym API: (obs, reward, done, info)
            observation, reward, done, self.info = value
            done = bool(done)
        else:
            raise EnvError(
                f"{self._name}.step() returned {short_repr(value)}: a Gymnasium environment returns "
                "(observation, reward, terminated, truncated, info)"
            )
        return Turn(self._observation(observation, "step()"), reward, done)

    def _observation(self, value: Any, method: str) -> Observation:
        if isinstance(value, str):
            return str(value)  # a numpy str_ too
        if isinstance(value, list | tuple) and all(isinstance(m, Mapping) and "content" in m for m in value):
            return [dict(m) for m in value]
        raise EnvError(
            f"{self._name}.{method} gave the observation {short_repr(value)}: the policy reads text or chat "
            'messages ({"role": ..., "content": ...}); wrap the environment so its observations are text, '
            "e.g. with a gymnasium.ObservationWrapper"
        )

    def close(self) -> None:
        """Close the environment, if one was made; idempotent."""
        env, self.env, self._closed = self.env, None, True
        if env is not None and callable(getattr(env, "close", None)):
            env.close()


def seed_of(owner: str, seed: str | Callable[[Mapping[str, Any]], Any] | None, row: Mapping[str, Any]) -> int | None:
    """The seed an adapter (``owner``: its class's name) resets with, from ``row``: None
    without ``seed``, the row's field named ``seed``, or what ``seed(row)`` gives.
    EnvError naming the field or the value when there is none or it is not an int."""
    if seed is None:
        return None
    if isinstance(seed, str):
        if seed not in row:
            raise EnvError(
                f"{owner}(seed={seed!r}): the row has no {seed!r} to seed reset() with (its fields: "
                f"{', '.join(map(str, row))}); pass seed= another field, or a function of the row"
            )
        value = row[seed]
    else:
        value = seed(row)
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool)):
        raise EnvError(
            f"{owner}(seed={short_repr(seed)}) gave {short_repr(value)} to seed reset() with: "
            "a seed is an int (or None)"
        )
    return value

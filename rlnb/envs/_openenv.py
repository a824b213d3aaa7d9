"""``OpenEnv``: an OpenEnv environment, driven through its client, as an rlnb environment.

OpenEnv (``openenv-core``) serves an environment as a FastAPI app; a client holds a
WebSocket to it, and the server keeps one environment per connection. Each sample
gets an adapter of its own, which opens its own connection at ``reset`` and closes it
with the sample. The mapping onto turns:

* ``reset(row)`` -> the client's ``reset(seed=..., **kwargs)``; the observation,
  rendered as text, is the prompt;
* each policy turn -> an action (``action(text)``) -> the client's ``step(action)``
  -> ``Turn(rendered observation, reward, done)``.

An action the environment rejects (``action(text)`` raises ValueError or TypeError,
which a pydantic model's validation error is, or the server answers
``VALIDATION_ERROR``) is, by default, a turn like any other: the policy reads
``invalid`` (e.g. "invalid action: ...") with ``invalid_reward`` and tries again,
within the task's ``max_turns``. ``invalid=None`` makes it an :class:`EnvError`
(the sample fails). Any other server error is an :class:`EnvError`.
"""

from __future__ import annotations

import json
import typing
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from rlnb._errors import ConfigError
from rlnb._reprs import short_repr
from rlnb.envs._episode import EnvError
from rlnb.envs._gym import seed_of
from rlnb.envs._protocol import Observation, Turn

__all__ = ["OpenEnv"]

# Fields every OpenEnv Observation and Action has, which are not the environment's content.
_OBSERVATION_BOOK = frozenset({"done", "reward", "metadata"})
_ACTION_BOOK = frozenset({"metadata"})
SCHEMA_TIMEOUT_S = 10.0


class OpenEnv:
    """Adapts an OpenEnv environment, and is its own factory: a task takes it as
    ``env=OpenEnv(server)``, and each sample gets a fresh adapter with a connection
    of its own.

    base_url: the server: its URL (``"http://127.0.0.1:8000"``), or an
        :class:`~rlnb.envs.OpenEnvServer` (its ``url``).
    client: the environment's client class (an ``openenv.core.EnvClient`` subclass,
        called as ``client(base_url=...)``), or None for OpenEnv's
        ``GenericEnvClient``, whose actions and observations are dicts.
    action: a function ``action(text) -> Action`` (or a dict, with the generic client)
        that turns the policy's turn into the environment's action. By default the
        text fills the action's one field (from the client's Action class, or the
        server's ``/schema``); pydantic converts it (``"5"`` for an int field).
    observation: a function ``observation(obs) -> str | messages`` that renders an
        observation (a pydantic model, or a dict) for the policy. By default its one
        field other than done/reward/metadata, as text, or those fields as JSON.
    seed: how ``reset`` is seeded from the prompt's row: a row field holding an int
        (``"prompt_id"``, so a group's samples, which share a row, start the same
        episode), a function ``seed(row) -> int | None``, or None (no seed).
    reset: a function ``reset(row) -> dict`` of more keyword arguments for the
        environment's ``reset`` (e.g. the record's level), or None.
    invalid: the observation for a rejected action, a format string of ``{error}``;
        None: a rejected action is an :class:`EnvError` instead.
    invalid_reward: the reward of a turn whose action was rejected.

    Raises :class:`~rlnb.ConfigError` for options of the wrong kind. openenv-core is
    imported at the first ``reset`` (``pip install openenv-core``).
    """

    def __init__(
        self,
        base_url: Any,
        *,
        client: Callable[..., Any] | None = None,
        action: Callable[[str], Any] | None = None,
        observation: Callable[[Any], Observation] | None = None,
        seed: str | Callable[[Mapping[str, Any]], int | None] | None = "prompt_id",
        reset: Callable[[Mapping[str, Any]], Mapping[str, Any] | None] | None = None,
        invalid: str | None = "invalid action: {error}",
        invalid_reward: float | None = 0.0,
    ) -> None:
        if not (isinstance(base_url, str) or isinstance(getattr(base_url, "url", None), str)):
            raise ConfigError(
                f"OpenEnv(base_url={short_repr(base_url)}) is invalid: pass the server's URL "
                "('http://127.0.0.1:8000') or an rlnb.envs.OpenEnvServer"
            )
        for name, value, example in (
            ("client", client, "client=GuessEnv (the EnvClient subclass)"),
            ("action", action, "action=lambda text: GuessAction(guess=int(text))"),
            ("observation", observation, "observation=lambda obs: obs.prompt"),
            ("reset", reset, "reset=lambda row: {'level': row['level']}"),
        ):
            if value is not None and not callable(value):
                raise ConfigError(f"OpenEnv.{name}={short_repr(value)} is invalid: use a function, e.g. {example}")
        if not (seed is None or isinstance(seed, str) or callable(seed)):
            raise ConfigError(
                f"OpenEnv.seed={short_repr(seed)} is invalid: use the name of a row field holding an int "
                "(seed='prompt_id'), a function of the row, or None"
            )
        if invalid is not None:
            try:
                invalid.format(error="x")
            except (AttributeError, IndexError, KeyError, ValueError):
                raise ConfigError(
                    f"OpenEnv.invalid={short_repr(invalid)} is invalid: use a format string of {{error}}, "
                    "e.g. 'invalid action: {error}', or None to fail the sample"
                ) from None
        self.base_url = base_url
        self.client = client
        self.action = action
        self.observation = observation
        self.seed = seed
        self.reset_kwargs = reset
        self.invalid = invalid
        self.invalid_reward = invalid_reward
        self.connection: Any = None  # the client, connected, between reset and close
        self._schema: dict[str, Any] = {}  # the server's action schema, shared with the copies
        self._closed = False

    def __call__(self) -> OpenEnv:
        """A fresh adapter, for one conversation (this makes an OpenEnv a task's factory)."""
        copy = OpenEnv(
            self.base_url,
            client=self.client,
            action=self.action,
            observation=self.observation,
            seed=self.seed,
            reset=self.reset_kwargs,
            invalid=self.invalid,
            invalid_reward=self.invalid_reward,
        )
        copy._schema = self._schema
        return copy

    def __repr__(self) -> str:
        client = f", client={short_repr(self.client)}" if self.client is not None else ""
        return f"OpenEnv({self.url!r}{client})"

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self.base_url if isinstance(self.base_url, str) else str(self.base_url.url)

    def _seed_of(self, row: Mapping[str, Any]) -> int | None:
        return seed_of("OpenEnv", self.seed, row)

    async def reset(self, row: Mapping[str, Any]) -> Observation:
        """Connect (the first time) and reset the environment, seeded from ``row``: its
        first observation, rendered. Raises :class:`EnvError` when the server cannot
        be reached or refuses."""
        if self._closed:
            raise EnvError(f"{self!r}.reset() was called after close(); make a new one")
        kwargs: dict[str, Any] = {}
        if (seed := self._seed_of(row)) is not None:
            kwargs["seed"] = seed
        if self.reset_kwargs is not None and (more := self.reset_kwargs(row)) is not None:
            kwargs.update(more)
        if self.connection is None:
            self.connection = self._make_client()
            try:
                await self.connection.connect()
            except Exception as exc:
                self.connection = None
                raise EnvError(
                    f"OpenEnv could not connect to the server at {self.url}: {exc}; is it running? "
                    "(rlnb.envs.OpenEnvServer starts one)"
                ) from None
        try:
            result = await self.connection.reset(**kwargs)
        except Exception as exc:
            raise EnvError(self._server_error(exc, "reset()")) from None
        return self._render(result.observation, "reset()")

    async def step(self, completion: str) -> Turn:
        """The environment's step with the policy's turn as the action. A rejected
        action is a retry turn (``invalid``) or an :class:`EnvError` (``invalid=None``)."""
        if self.connection is None:
            raise EnvError(f"{self!r}.step() was called before reset()")
        try:
            action = self._action(completion)
        except (ValueError, TypeError) as exc:
            return self._rejected(completion, _one_line(exc))
        try:
            result = await self.connection.step(action)
        except RuntimeError as exc:
            if "(code: VALIDATION_ERROR)" in str(exc):
                return self._rejected(completion, "the server rejected it (VALIDATION_ERROR)")
            raise EnvError(self._server_error(exc, "step()")) from None
        except Exception as exc:
            raise EnvError(self._server_error(exc, "step()")) from None
        return Turn(self._render(result.observation, "step()"), result.reward, bool(result.done))

    async def close(self) -> None:
        """Close the connection (the server ends its environment); idempotent."""
        client, self.connection, self._closed = self.connection, None, True
        if client is None:
            return
        try:
            await client.close()
        finally:
            # A close cancelled midway (the session closing, a timeout) must not leave the
            # socket open: drop the connection's transport, a no-op once it closed cleanly.
            transport = getattr(getattr(client, "_ws", None), "transport", None)
            if transport is not None:
                transport.abort()

    def _make_client(self) -> Any:
        if self.client is not None:
            return self.client(base_url=self.url)
        try:
            from openenv.core.generic_client import GenericEnvClient
        except ImportError as exc:
            raise EnvError(f"OpenEnv needs openenv-core: pip install openenv-core ({exc})") from None
        return GenericEnvClient(base_url=self.url)

    def _rejected(self, completion: str, error: str) -> Turn:
        if self.invalid is None:
            raise EnvError(f"the OpenEnv environment at {self.url} rejected the action {completion!r}: {error}")
        return Turn(self.invalid.format(error=error), self.invalid_reward, False)

    def _server_error(self, exc: Exception, method: str) -> str:
        text = str(exc)
        closed = type(exc).__name__.startswith("ConnectionClosed")
        if closed and method == "step()":
            return (
                f"the OpenEnv server at {self.url} closed the session in {method} ({text}); a server that pings its "
                "clients closes a session idle between two turns, as a client answers only while rlnb calls it: "
                "serve it with uvicorn's ws_ping_interval=None (rlnb.envs.OpenEnvServer does)"
            )
        # A server at capacity sends CAPACITY_REACHED and closes: the client may see either.
        if "CAPACITY_REACHED" in text or closed:
            return (
                f"the OpenEnv server at {self.url} refused or closed the session in {method} ({text or exc!r}); "
                "a server serves at most create_fastapi_app(..., max_concurrent_envs=N) sessions at once (1 by "
                "default), and rlnb opens one per sample in flight (evaluate(n) opens n at once): raise N"
            )
        return f"the OpenEnv environment at {self.url} failed in {method}: {exc!r}"

    def _action(self, completion: str) -> Any:
        if self.action is not None:
            return self.action(completion)
        action_cls = _action_class(self.client)
        if action_cls is not None:
            fields = {n: f for n, f in action_cls.model_fields.items() if n not in _ACTION_BOOK}
            name = self._one_field(list(fields), getattr(action_cls, "__name__", "Action"))
            text = completion if fields[name].annotation is str else completion.strip()
            return action_cls(**{name: text})
        if not self._schema:
            self._schema.update(self._fetch_schema())
        properties = [n for n in self._schema.get("properties", {}) if n not in _ACTION_BOOK]
        name = self._one_field(properties, str(self._schema.get("title", "Action")))
        kind = self._schema["properties"][name].get("type")
        return {name: completion if kind == "string" else completion.strip()}

    def _one_field(self, names: list[str], action: str) -> str:
        if len(names) != 1:
            raise EnvError(
                f"OpenEnv cannot make a {action} from the policy's text by itself: it has the fields "
                f"{', '.join(names) or '(none)'}, not one; pass action=, a function of the text, "
                f"e.g. action=lambda text: {{...}}"
            )
        return names[0]

    def _fetch_schema(self) -> dict[str, Any]:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"{self.url}/schema", timeout=SCHEMA_TIMEOUT_S) as answer:
                schema = json.loads(answer.read()).get("action", {})
        except (OSError, ValueError) as exc:
            raise EnvError(f"OpenEnv could not read the action schema at {self.url}/schema: {exc}") from None
        return dict(schema) if isinstance(schema, Mapping) else {}

    def _render(self, obs: Any, method: str) -> Observation:
        if self.observation is not None:
            return self.observation(obs)
        if hasattr(obs, "model_dump"):
            obs = obs.model_dump()
        if not isinstance(obs, Mapping):
            raise EnvError(
                f"the OpenEnv environment's {method} gave the observation {short_repr(obs)}, which OpenEnv cannot "
                "render by itself; pass observation=, a function that returns its text"
            )
        content = {k: v for k, v in obs.items() if k not in _OBSERVATION_BOOK}
        if len(content) == 1 and isinstance(text := next(iter(content.values())), str):
            return text or None  # an empty text says nothing
        return json.dumps(content, default=str) if content else None


def _action_class(client: Any) -> Any:
    """The Action class of an ``EnvClient[Action, Observation, State]`` subclass, if it names one."""
    for base in getattr(client, "__orig_bases__", ()):
        args = typing.get_args(base)
        if args and isinstance(args[0], type) and hasattr(args[0], "model_fields"):
            return args[0]
    return None


def _one_line(exc: BaseException) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):  # a pydantic ValidationError: its first error, briefly
        try:
            first = errors()[0]
            return f"{'.'.join(map(str, first.get('loc', ())))}: {first.get('msg', '')}".strip(": ")
        except Exception:
            pass
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__

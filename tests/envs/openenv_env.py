"""OpenEnv environments for tests/envs/test_openenv.py, served by a real server process
(``OpenEnvServer("tests.envs.openenv_env:app")``), so they live in a module of their own.

``app``: a calculator game the built-in policy can play. ``reset(seed)`` asks for a
product (``37*48=``, the numbers from the seed); the policy may call ``mul(37,48)``, to
which the environment answers ``=1776;``, or answer; an answer ends the episode with
reward 1 if it is right. As in rlnb's ``calculator`` task, products of two digits by
two can only be got right through the tool, and RL learns to call it.

``guess_app``: guess a number from 1 to 9 with an int action (``"x"`` is rejected),
answered ``<``/``>``. ``unhealthy``: an app whose /health answers 503.
"""

from __future__ import annotations

import random
import re
from typing import Any

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

# rlnb opens a session per sample in flight (evaluate(n): n at once), and closes lag behind under load.
MAX_SESSIONS = 1024
CALL = re.compile(r"mul\((\d+),(\d+)\)")


class TextAction(Action):
    text: str


class TextObservation(Observation):
    text: str = ""


class CalcState(State):
    a: int = 0
    b: int = 0


class CalcEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = CalcState()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> TextObservation:
        rng = random.Random(seed)
        if rng.random() < 0.3:
            a, b = rng.randint(1, 9), rng.randint(1, 9)
        else:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
        self._state = CalcState(episode_id=episode_id, step_count=0, a=a, b=b)
        return TextObservation(text=f"{a}*{b}=", done=False, reward=None)

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        self._state.step_count += 1
        text = action.text.strip()
        if (call := CALL.fullmatch(text)) is not None:
            return TextObservation(text=f"={int(call[1]) * int(call[2])};", done=False, reward=None)
        right = text == str(self._state.a * self._state.b)
        return TextObservation(text="", done=True, reward=float(right))

    @property
    def state(self) -> CalcState:
        return self._state


app = create_fastapi_app(CalcEnvironment, TextAction, TextObservation, max_concurrent_envs=MAX_SESSIONS)


class GuessAction(Action):
    guess: int


class GuessState(State):
    target: int = 0


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> TextObservation:
        self._state = GuessState(episode_id=episode_id, step_count=0, target=random.Random(seed).randint(1, 9))
        return TextObservation(text="?", done=False, reward=None)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        self._state.step_count += 1
        target = self._state.target
        if action.guess == target:
            return TextObservation(text="=", done=True, reward=1.0)
        return TextObservation(text="<" if action.guess > target else ">", done=False, reward=0.0)

    @property
    def state(self) -> GuessState:
        return self._state


def guess_app() -> Any:
    """The guessing game's app (a factory, as ``OpenEnvServer(guess_app)`` takes one)."""
    return create_fastapi_app(GuessEnvironment, GuessAction, TextObservation, max_concurrent_envs=MAX_SESSIONS)


class GuessClient(EnvClient[GuessAction, TextObservation, GuessState]):
    """The guessing game's typed client: it checks an action before sending it."""

    def _step_payload(self, action: GuessAction) -> dict[str, Any]:
        return {"guess": action.guess}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[TextObservation]:
        obs = payload.get("observation", {})
        done = payload.get("done", False)
        observation = TextObservation(text=obs.get("text", ""), done=done, reward=payload.get("reward"))
        return StepResult(observation=observation, reward=payload.get("reward"), done=done)

    def _parse_state(self, payload: dict[str, Any]) -> GuessState:
        return GuessState(**payload)


async def unhealthy(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app that is up but never healthy."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"starting"})

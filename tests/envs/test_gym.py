from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, ClassVar

import gymnasium
import numpy as np
import pytest
from gymnasium.envs.registration import EnvSpec
from gymnasium.spaces import Text

from rlnb import ConfigError
from rlnb.envs._episode import EnvError, Episode, check_factory
from rlnb.envs._gym import GymEnv
from rlnb.envs._protocol import Turn

ROW = {"prompt": "guess", "answer": None, "prompt_id": 7}


class Guess:
    """A duck-typed Gymnasium text environment: guess a digit in three tries. Records
    what it is asked, in ``events`` (shared by every instance, so a test sees them all)."""

    events: ClassVar[list[tuple[str, Any]]] = []

    def __init__(self, tries: int = 3) -> None:
        self.tries = tries
        self.target = -1

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.events.append(("reset", (seed, options)))
        self.target = random.Random(seed).randrange(10) if options is None else options["target"]
        self.left = self.tries
        return f"guess a digit; {self.tries} tries (game {seed})", {"target": self.target}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.events.append(("step", action))
        self.left -= 1
        if action.strip() == str(self.target):
            return "right", 1.0, True, False, {"left": self.left}
        return ("lower" if int(action) > self.target else "higher"), 0.0, False, self.left == 0, {"left": self.left}

    def close(self) -> None:
        self.events.append(("close", None))


@pytest.fixture
def events() -> list[tuple[str, Any]]:
    Guess.events = []
    return Guess.events


def test_a_gym_env_is_its_own_factory_and_makes_one_environment_per_adapter(events: list[tuple[str, Any]]) -> None:
    factory = GymEnv(Guess)
    check_factory(factory)
    first, second = factory(), factory()
    assert first is not second and first.env is None
    assert first.reset(ROW) == second.reset(ROW) == "guess a digit; 3 tries (game 7)"
    assert first.env is not second.env and isinstance(first.env, Guess)
    assert first.info == {"target": first.env.target}
    assert events == [("reset", (7, None)), ("reset", (7, None))]
    assert repr(factory).startswith("GymEnv(<class ") and "seed='prompt_id'" in repr(factory)


def test_the_samples_of_a_group_see_the_same_episode_and_other_prompts_another() -> None:
    def target(prompt_id: int) -> int:
        env = GymEnv(Guess)()
        env.reset({**ROW, "prompt_id": prompt_id})
        return int(env.env.target)

    assert target(7) == target(7)
    assert len({target(i) for i in range(20)}) > 1


def test_step_maps_terminated_and_truncated_to_done(events: list[tuple[str, Any]]) -> None:
    env = GymEnv(Guess)()
    env.reset(ROW)
    target = env.env.target
    wrong = (target + 1) % 10
    assert env.step(str(wrong)) == Turn("lower" if wrong > target else "higher", 0.0, False)
    assert env.info == {"left": 2}
    assert env.step(f"{target}\n") == Turn("right", 1.0, True)  # terminated

    env = GymEnv(lambda: Guess(tries=1))()
    env.reset(ROW)
    assert env.step(str((env.env.target + 1) % 10)).done  # truncated: out of tries


def test_close_closes_the_environment_once(events: list[tuple[str, Any]]) -> None:
    env = GymEnv(Guess)()
    env.close()  # nothing made yet: nothing to close
    assert events == []
    env = GymEnv(Guess)()
    env.reset(ROW)
    env.close()
    env.close()
    assert events == [("reset", (7, None)), ("close", None)]
    with pytest.raises(EnvError, match=r"reset\(\) was called after close\(\)"):
        env.reset(ROW)


def test_seed_and_options_from_the_row(events: list[tuple[str, Any]]) -> None:
    GymEnv(Guess, seed="level")().reset({**ROW, "level": 3})
    GymEnv(Guess, seed=lambda row: row["prompt_id"] * 10)().reset(ROW)
    GymEnv(Guess, seed=None)().reset(ROW)
    env = GymEnv(Guess, options=lambda row: {"target": row["prompt_id"]})()
    env.reset(ROW)
    assert env.step("7") == Turn("right", 1.0, True)
    assert events[:3] == [("reset", (3, None)), ("reset", (70, None)), ("reset", (None, None))]
    assert events[3] == ("reset", (7, {"target": 7}))


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"make": Guess()}, ["GymEnv.make=", "pass a function that makes the environment", "GymEnv(MyEnv)"]),
        ({"make": "Guess-v0"}, ["GymEnv.make='Guess-v0'"]),
        ({"make": Guess, "seed": 3}, ["GymEnv.seed=3", "seed='prompt_id'"]),
        ({"make": Guess, "options": {"target": 1}}, ["GymEnv.options={'target': 1}", "function of the row"]),
    ],
)
def test_construction_errors_name_the_field_and_the_fix(kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        GymEnv(**kwargs)
    for word in words:
        assert word in str(info.value)


class Odd:
    """Gives whatever it was told to, from reset and step."""

    def __init__(self, reset: Any = ("hi", {}), step: Any = ("ok", 0.0, False, False, {})) -> None:
        self.reset_value, self.step_value = reset, step

    def reset(self, *, seed: int | None = None) -> Any:
        return self.reset_value

    def step(self, action: str) -> Any:
        return self.step_value


@pytest.mark.parametrize(
    ("env", "row", "words"),
    [
        (GymEnv(Guess, seed="level"), ROW, ["no 'level' to seed reset() with", "prompt, answer, prompt_id"]),
        (GymEnv(Guess, seed=lambda row: "7"), ROW, ["gave '7' to seed reset() with", "a seed is an int"]),
        (GymEnv(lambda: Odd(reset=(np.zeros(3), {}))), ROW, ["Odd.reset() gave the observation array", "text"]),
        (GymEnv(lambda: Odd(reset=({"text": "hi"}, {}))), ROW, ["Odd.reset() gave the observation {'text'", "wrap"]),
        (GymEnv(lambda: 3), ROW, ["made 3, which has no reset() and step()"]),
    ],
)
def test_reset_errors_say_what_was_wrong(env: GymEnv, row: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(EnvError) as info:
        env().reset(row)
    for word in words:
        assert word in str(info.value)


def test_step_errors_say_what_was_wrong() -> None:
    with pytest.raises(EnvError, match=r"step\(\) was called before reset\(\)"):
        GymEnv(Guess)().step("1")
    env = GymEnv(lambda: Odd(step=("ok", 1.0)))()
    env.reset(ROW)
    with pytest.raises(EnvError, match=r"Odd.step\(\) returned \('ok', 1.0\): .*\(observation, reward, terminated"):
        env.step("1")
    env = GymEnv(lambda: Odd(step=(7, 1.0, True, False, {})))()
    env.reset(ROW)
    with pytest.raises(EnvError, match=r"Odd.step\(\) gave the observation 7"):
        env.step("1")


def test_the_old_gym_api_and_chat_message_observations() -> None:
    messages = [{"role": "user", "content": "hi"}]
    env = GymEnv(lambda: Odd(reset=messages, step=("bye", 1, True, {"x": 1})))()
    assert env.reset(ROW) == messages and env.info is None
    assert env.step("1") == Turn("bye", 1, True) and env.info == {"x": 1}


def test_a_gym_env_fits_the_protocol_through_an_episode(events: list[tuple[str, Any]]) -> None:
    # numpy scalars, as environments built on numpy give them
    env = Odd(reset=(np.str_("hi"), {}), step=("ok", np.float32(0.5), np.bool_(True), np.bool_(False), {}))
    episode = Episode(GymEnv(lambda: env))
    try:
        assert episode.reset(ROW) == "hi"
        assert episode.step("1") == Turn("ok", 0.5, True)
        assert episode.reward == 0.5
    finally:
        episode.close()

    episode = Episode(GymEnv(Guess, options=lambda row: {"target": 4}))
    try:
        assert episode.reset(ROW) == "guess a digit; 3 tries (game 7)"
        assert episode.step("9") == Turn("lower", 0.0, False)
        assert episode.step("4") == Turn("right", 1.0, True)
        assert episode.reward == 1.0 and episode.turns == 2
    finally:
        episode.close()
    assert events[-1] == ("close", None)


class GuessGymnasium(gymnasium.Env[str, str]):
    """The guessing game as a real gymnasium.Env with Text spaces, seeded by its np_random."""

    closed = 0

    def __init__(self) -> None:
        self.observation_space = Text(max_length=64, charset="abcdefghijklmnopqrstuvwxyz0123456789 ;()")
        self.action_space = Text(max_length=4, charset="0123456789")
        self.target = -1

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.target = int(self.np_random.integers(0, 10))
        return "guess a digit", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if action.strip() == str(self.target):
            return "right", 1.0, True, False, {}
        return "wrong", 0.0, False, False, {}

    def close(self) -> None:
        GuessGymnasium.closed += 1


def test_a_real_gymnasium_env_through_gymnasium_make() -> None:
    spec = EnvSpec("rlnb-test/Guess-v0", entry_point=GuessGymnasium, max_episode_steps=3)
    factory = GymEnv(lambda: gymnasium.make(spec))
    GuessGymnasium.closed = 0
    episodes = [Episode(factory) for _ in range(2)]
    try:
        assert [e.reset(ROW) for e in episodes] == ["guess a digit", "guess a digit"]
        targets = [e.env.env.unwrapped.target for e in episodes]
        assert targets[0] == targets[1]  # one row, one seed: one episode
        wrong = str((targets[0] + 1) % 10)
        assert episodes[0].step(wrong) == Turn("wrong", 0.0, False)
        assert episodes[0].step(str(targets[0])) == Turn("right", 1.0, True)
        assert episodes[1].step(wrong) == Turn("wrong", 0.0, False)
        assert episodes[1].step(wrong) == Turn("wrong", 0.0, False)
        assert episodes[1].step(wrong) == Turn("wrong", 0.0, True)  # TimeLimit truncates the third
    finally:
        for episode in episodes:
            episode.close()
    assert GuessGymnasium.closed == 2

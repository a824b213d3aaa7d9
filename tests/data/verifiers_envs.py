"""The verifiers environments of tests/data/test_verifiers.py, in a module of their own:
importing verifiers takes seconds, so the tests import it on first use, not when
pytest collects them."""

from __future__ import annotations

import random
from typing import Any

import datasets
import tqdm
import verifiers as vf

from rlnb.data import Task

ALPHABET = "\n0123456789+=(),abcdefgh"

# verifiers maps its data set with a tqdm bar (a disabled one too), and tqdm 4.70
# starts a monitor thread with its first bar that never ends: the suite would take it
# for a thread the test left behind. The monitor only refreshes stalled bars.
tqdm.tqdm.monitor_interval = 0


def words(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` rows of "reverse the word" in verifiers' columns (question, answer)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 6)))
        rows.append({"question": f"{word}=", "answer": word[::-1]})
    return rows


def exact(completion: Any, answer: str) -> float:
    return float((completion[-1]["content"] or "") == answer)


def close(completion: Any, answer: str) -> float:
    """Partial credit, position by position: a signal before the first exact answer."""
    text = completion[-1]["content"] or ""
    return sum(a == b for a, b in zip(text, answer, strict=False)) / max(len(answer), len(text), 1)


class Recorded:
    """Keeps the states an environment's rollouts returned (a mixin: the test reads
    what verifiers saw beside what rlnb trained on)."""

    states: list[Any]

    async def rollout(self, *args: Any, **kwargs: Any) -> Any:
        state = await super().rollout(*args, **kwargs)  # type: ignore[misc]
        self.states.append(state)
        return state


class RecordedSingleTurn(Recorded, vf.SingleTurnEnv):
    pass


class Guess(Recorded, vf.MultiTurnEnv):
    """Answers each reply with "=" and lets the policy try again, up to max_turns."""

    async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
        return [{"role": "user", "content": "="}]


class RecordedTools(Recorded, vf.ToolEnv):
    pass


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def single_turn_task() -> Task:
    env = RecordedSingleTurn(
        dataset=datasets.Dataset.from_list(words(12)),
        system_prompt="=",
        rubric=vf.Rubric(funcs=[exact, close], weights=[1.0, 0.5]),
    )
    env.states = []
    return Task.from_verifiers(env, name="vf-single", eval_size=2, alphabet=ALPHABET)


def multi_turn_task() -> Task:
    env = Guess(
        dataset=datasets.Dataset.from_list(words(6)),
        max_turns=3,
        rubric=vf.Rubric(funcs=[exact]),
    )
    env.states = []
    return Task.from_verifiers(env, name="vf-multi", eval_size=1, alphabet=ALPHABET, max_new_tokens=4)


def tool_task() -> Task:
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((3, 4), (2, 5), (1, 1))]
    env = RecordedTools(
        dataset=datasets.Dataset.from_list(rows),
        tools=[add],
        max_turns=3,
        rubric=vf.Rubric(funcs=[exact]),
    )
    env.states = []
    return Task.from_verifiers(env, name="vf-tools", eval_size=1, alphabet=ALPHABET, max_new_tokens=12)

"""Tasks: prompt generators with verifiable rewards, and a registry of built-in ones.

A task is data, not a process: it makes prompts from a seed (so held-out sets are
reproducible) and scores completions. Nothing is downloaded; everything is generated.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any

from rlnb._errors import ConfigError
from rlnb._samples import PromptItem

__all__ = ["Task", "addition", "get_task", "register_task", "reverse", "sort", "task_names"]

# Prompt ids of held-out sets live far from the training stream's.
EVAL_ID_OFFSET = 1 << 40


@dataclasses.dataclass(frozen=True)
class Task:
    """A prompt generator and a reward.

    name: how ``Config(task=...)`` refers to it.
    alphabet: every character a prompt or answer may contain (the tokenizer's vocabulary).
    make_prompt: ``make_prompt(rng) -> (prompt, answer)``, using only ``rng`` for randomness.
    reward: ``reward(completion, answer) -> float``, 1.0 for a correct answer.
    max_new_tokens: enough tokens for any correct answer plus end-of-sequence.
    """

    name: str
    alphabet: str
    make_prompt: Callable[[random.Random], tuple[str, Any]]
    reward: Callable[[str, Any], float]
    max_new_tokens: int

    def item(self, seed: int, index: int) -> PromptItem:
        """Training prompt number ``index`` of the stream for ``seed``."""
        prompt, answer = self.make_prompt(random.Random(f"{self.name}:{seed}:{index}"))
        return PromptItem(index, prompt, answer)

    def prompts(self, seed: int, *, start: int = 0) -> Iterator[PromptItem]:
        """An endless, reproducible stream of training prompts (ids from ``start``)."""
        for i in itertools.count(start):
            yield self.item(seed, i)

    def eval_set(self, n: int, *, seed: int = 12345) -> list[PromptItem]:
        """``n`` held-out prompts, the same for the same seed."""
        rng = random.Random(f"{self.name}:eval:{seed}")
        items = []
        for i in range(n):
            prompt, answer = self.make_prompt(rng)
            items.append(PromptItem(EVAL_ID_OFFSET + i, prompt, answer))
        return items


def _positional_credit(completion: str, answer: str) -> float:
    """1.0 for an exact answer; otherwise at most 0.4, for the characters in place."""
    completion = completion.strip()
    if completion == answer:
        return 1.0
    if not completion:
        return 0.0
    hits = sum(a == b for a, b in zip(completion, answer, strict=False))
    return 0.4 * hits / max(len(answer), len(completion))


def _addition_prompt(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}+{b}=", str(a + b)


addition = Task(
    name="addition",
    alphabet="0123456789+=",
    make_prompt=_addition_prompt,
    reward=_positional_credit,
    max_new_tokens=4,
)


def _reverse_prompt(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 6)))
    return f"{word}=", word[::-1]


reverse = Task(
    name="reverse",
    alphabet="abcdefgh=",
    make_prompt=_reverse_prompt,
    reward=_positional_credit,
    max_new_tokens=7,
)


def _sort_prompt(rng: random.Random) -> tuple[str, str]:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
    return f"{digits}=", "".join(sorted(digits))


sort = Task(
    name="sort",
    alphabet="0123456789=",
    make_prompt=_sort_prompt,
    reward=_positional_credit,
    max_new_tokens=7,
)

_TASKS: dict[str, Task] = {t.name: t for t in (addition, reverse, sort)}


def register_task(task: Task, *, replace: bool = False) -> Task:
    """Make ``task`` available by name to ``Config(task=...)``; returns it."""
    if task.name in _TASKS and not replace and _TASKS[task.name] is not task:
        raise ConfigError(f"a task named {task.name!r} exists already; pass replace=True to replace it")
    _TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    """The registered task called ``name``; ConfigError naming the known ones otherwise."""
    try:
        return _TASKS[name]
    except KeyError:
        raise ConfigError(f"Config.task={name!r} is unknown: use one of {task_names()}") from None


def task_names() -> list[str]:
    return sorted(_TASKS)

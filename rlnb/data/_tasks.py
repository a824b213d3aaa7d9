"""Tasks: prompt generators with verifiable rewards, and a registry of built-in ones.

A task is data, not a process: it makes prompts from a seed (so held-out sets are
reproducible) and scores completions. Nothing is downloaded; everything is generated.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rlnb._checks import check_int, check_number, check_reward_weights, plain, require
from rlnb._errors import ConfigError
from rlnb._samples import PromptItem
from rlnb.data._records import EVAL_ID_OFFSET, Generated, PromptSource, Records
from rlnb.envs import Demonstration, ToolEnv, check_factory, env_reward
from rlnb.rewards import Rewards

__all__ = [
    "Task",
    "addition",
    "calculator",
    "calculator_teacher",
    "get_task",
    "register_task",
    "reverse",
    "sloppy_reverse",
    "sort",
    "task_names",
]

# Prompts register_task makes to check a task before any session uses it.
SAMPLE_PROMPTS = 16


def _check_callable(field: str, fn: Any, args: tuple[Any, ...], shape: str) -> None:
    """``fn`` is a callable that takes ``args`` positionally (when its signature can be read)."""
    require(callable(fn), field, fn, f"pass a function, {shape}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no readable signature: calling them will tell
        return
    try:
        signature.bind(*args)
    except TypeError as exc:
        raise ConfigError(f"{field}={fn!r} is invalid: it cannot be called as {shape} ({exc})") from None


@dataclasses.dataclass(frozen=True, repr=False)
class Task:
    """Prompts with answers, and a reward: a prompt generator, or a data set of records
    (:meth:`from_records`).

    name: how ``Config(task=...)`` refers to it.
    alphabet: every character a prompt or answer may contain (the built-in
        tokenizer's vocabulary; a Hugging Face model brings its own tokenizer).
    make_prompt: ``make_prompt(rng) -> (prompt, answer)``, using only ``rng`` for
        randomness; None for a task made by :meth:`from_records`.
    reward: ``reward(completion, answer) -> float``, 1.0 for a correct answer; or a
        list of such functions, whose values ``reward_weights`` sums (see
        :mod:`rlnb.rewards`: a function may also take ``prompt=`` and ``row=``, and
        return None where it does not apply).
    max_new_tokens: enough tokens for any correct answer plus end-of-sequence (with
        ``env``: for each policy turn).
    about: one line on what it is, for logs (optional).
    reward_weights: one weight per reward function; None: 1 each.
    records: the data set of a task made by :meth:`from_records` (None otherwise).
    env: a factory of environments (:mod:`rlnb.envs`): each sample becomes a
        conversation with one of its own, of up to ``max_turns`` policy turns. The
        reward functions then score the last policy turn and may take
        ``env_reward=``; ``reward=None`` scores with the environment's reward alone
        (``rlnb.envs.env_reward``). None: one completion per sample.
    max_turns: the most policy turns of a conversation (1 without ``env``).
    agent: your agent, ``async def agent(client, row)`` (or a plain ``def``): each
        sample is an episode of it, with ``client`` an ``openai.AsyncOpenAI`` (an
        ``openai.OpenAI`` for a plain def) of the session's endpoint made for that
        episode, and ``row`` the prompt's record (``"prompt"``, ``"answer"``,
        ``"prompt_id"`` and its own fields). It calls the policy as it likes (tools,
        several turns) and returns the episode's reward: a number, a list of turn
        rewards (summed), or None. Its calls are the sample: the last call's replies
        are trained on, what came between them is masked (see :mod:`rlnb.serve`).
        The reward functions then score the last reply and may take ``env_reward=``
        (the agent's return); ``reward=None`` takes the agent's return alone.
    agent_timeout: seconds an episode may take, waiting on the policy included
        (None: no limit); past it an ``async def`` agent is cancelled, and the sample fails.

    Raises :class:`~rlnb.ConfigError` naming the field and the fix for a value of
    the wrong kind; :func:`register_task` also tries a few prompts.
    """

    name: str
    alphabet: str
    make_prompt: Callable[[random.Random], tuple[str, Any]] | None
    reward: Callable[..., Any] | Sequence[Callable[..., Any]] | None
    max_new_tokens: int
    about: str = ""
    reward_weights: Sequence[float] | None = None
    records: Records | None = None
    env: Callable[[], Any] | None = None
    max_turns: int = 1
    agent: Callable[..., Any] | None = None
    agent_timeout: float | None = 300.0

    @classmethod
    def from_records(
        cls,
        name: str,
        records: Any,
        *,
        prompt: str = "prompt",
        answer: str = "answer",
        reward: Callable[..., Any] | Sequence[Callable[..., Any]] | None = None,
        reward_weights: Sequence[float] | None = None,
        env: Callable[[], Any] | None = None,
        max_turns: int = 1,
        agent: Callable[..., Any] | None = None,
        agent_timeout: float | None = 300.0,
        eval_size: int | float = 200,
        alphabet: str | None = None,
        max_new_tokens: int | None = None,
        split_seed: int = 0,
        about: str = "",
    ) -> Task:
        """A task whose prompts and answers are your data set's.

        records: a list of dicts, a ``datasets.Dataset``, a ``pandas.DataFrame`` (its rows),
            or the path of a ``.jsonl``, ``.json`` (a list) or ``.parquet`` file
            (``rlnb[data]``). The task keeps a copy: changing the records afterwards
            changes nothing it trains on (register a new task for new records).
        prompt, answer: the fields that hold each record's prompt (a string, or a list of
            chat messages ``{"role", "content"}``, which a Hugging Face model's chat
            template gets as they are; the built-in tokenizer reads their contents,
            one per line) and answer
            (what the reward functions get as ``answer``; they get the whole record as
            ``row=`` when they take it).
        reward, reward_weights: one reward function or a list, and their weights (see
            :mod:`rlnb.rewards`); None only with ``env``.
        env, max_turns: an environment factory and its most policy turns, as in :class:`Task`.
        agent, agent_timeout: your agent, whose calls of the policy are each sample, as in :class:`Task`.
        eval_size: records held out, never trained on, for ``Session.evaluate()``: an
            int is a count (0: none, and ``evaluate()`` then refuses), a float a fraction
            of the records in (0, 1) (e.g. 0.1; 1.0 is refused); drawn with ``split_seed``.
        alphabet: for the built-in tokenizer; None takes the records' own characters.
        max_new_tokens: None: the longest answer's length in characters, plus one.

        The training records come in a new order each epoch, shuffled with the
        session's seed. Raises :class:`~rlnb.ConfigError` naming the argument and the
        fix (a missing field, no records, ``eval_size`` of all of them, a character
        outside ``alphabet``, a file that is not UTF-8 JSON or parquet, naming its line,
        a streaming data set, a value that cannot be copied, ...) before anything starts.
        """
        eval_size, split_seed = plain(eval_size), plain(split_seed)
        if isinstance(eval_size, float) and not 0 < eval_size < 1:
            raise ConfigError(
                f"Task.from_records(eval_size={eval_size!r}) is invalid: a float is a fraction between 0 and 1 "
                "(both excluded) of the records, e.g. eval_size=0.1; a number of records is an int, "
                "e.g. eval_size=200 (0 for none)"
            )
        data = Records.load(name, records, prompt=prompt, answer=answer, eval_size=eval_size, split_seed=split_seed)
        if alphabet is None:
            alphabet = "".join(sorted(data.characters())) or " "
        elif isinstance(alphabet, str):
            data.check_alphabet(alphabet)
        return cls(
            name=name,
            alphabet=alphabet,
            make_prompt=None,
            reward=reward,
            max_new_tokens=data.longest_answer() + 1 if max_new_tokens is None else max_new_tokens,
            about=about or f"{len(data.train)} records to train on, {len(data.held_out_rows)} held out",
            reward_weights=reward_weights,
            records=data,
            env=env,
            max_turns=max_turns,
            agent=agent,
            agent_timeout=agent_timeout,
        )

    @classmethod
    def from_verifiers(
        cls,
        env: Any,
        *,
        name: str | None = None,
        env_args: dict[str, Any] | None = None,
        sampling_args: dict[str, Any] | None = None,
        eval_size: int | float = 0.1,
        alphabet: str | None = None,
        max_new_tokens: int | None = None,
        agent_timeout: float | None = 300.0,
        split_seed: int = 0,
        about: str = "",
    ) -> Task:
        """A task whose samples are rollouts of a verifiers environment (``SingleTurnEnv``,
        ``MultiTurnEnv``, ``ToolEnv``, ... with its ``Rubric``; verifiers>=0.3.1,<0.4).

        env: the environment, or the id of an installed Hub environment, loaded with
            ``verifiers.load_environment(env, **env_args)``.
        name: the task's (default: the id, or the environment's class name).
        sampling_args: added to what each call asks (log-probs and token ids); the
            rollouts' temperature and max tokens apply to what it leaves out.
        eval_size, alphabet, max_new_tokens, split_seed, about: as in :meth:`from_records`,
            over the environment's data set (``env.get_dataset()``: its prompt, answer,
            info, task and example_id columns).
        agent_timeout: seconds one rollout may take.

        Each sample is an episode of ``env.rollout`` through the session's endpoint,
        scored by ``env.rubric``; what it served is the sample (see docs/verifiers.md).
        A rollout that ends on an error fails its sample with a RolloutError rather than
        train on its 0.0. Raises ConfigError when verifiers is missing, the id cannot be
        loaded, the rubric scores whole groups, or the data set is empty.
        """
        from rlnb.data._verifiers import load

        name, records, agent = load(env, name=name, env_args=env_args, sampling_args=sampling_args)
        return cls.from_records(
            name,
            records,
            agent=agent,
            agent_timeout=agent_timeout,
            eval_size=eval_size,
            alphabet=alphabet,
            max_new_tokens=max_new_tokens,
            split_seed=split_seed,
            about=about or f"{agent.about}: {len(records)} rows",
        )

    def __post_init__(self) -> None:
        require(
            isinstance(self.name, str) and bool(self.name.strip()),
            "Task.name",
            self.name,
            "use a non-empty string, e.g. name='times7'",
        )
        require(
            isinstance(self.alphabet, str) and bool(self.alphabet),
            "Task.alphabet",
            self.alphabet,
            "use a string of every character a prompt or answer may hold, e.g. alphabet='0123456789*='",
        )
        repeated = "".join(sorted({c for c in self.alphabet if self.alphabet.count(c) > 1}))
        require(not repeated, "Task.alphabet", self.alphabet, f"it repeats {repeated!r}: list each character once")
        if self.records is None:
            _check_callable("Task.make_prompt", self.make_prompt, ("rng",), "make_prompt(rng) -> (prompt, answer)")
        else:
            require(
                self.make_prompt is None,
                "Task.make_prompt",
                self.make_prompt,
                "a task made from records takes its prompts from them: leave make_prompt None",
            )
        if self.env is not None:
            check_factory(self.env, "Task.env")
        for field in ("max_turns", "max_new_tokens"):  # a numpy or torch int is kept as a Python one
            object.__setattr__(self, field, plain(getattr(self, field)))
        check_int("Task.max_turns", self.max_turns, minimum=1, example="max_turns=3")
        require(
            self.env is not None or self.max_turns == 1,
            "Task.max_turns",
            self.max_turns,
            "a task without env= has one turn: give env= an environment factory, or leave max_turns at 1",
        )
        if self.agent is not None:
            _check_callable("Task.agent", self.agent, ("client", "row"), "async def agent(client, row) -> reward")
            require(
                self.env is None,
                "Task.agent",
                self.agent,
                "a task has an agent or an environment, not both: the agent steps its own environment",
            )
        if self.agent_timeout is not None:
            check_number("Task.agent_timeout", self.agent_timeout, gt=0, fix="use seconds > 0, or None for no limit")
        require(
            self.reward is not None or self.env is not None or self.agent is not None,
            "Task.reward",
            self.reward,
            "give a reward function, e.g. reward=lambda completion, answer: float(completion == answer) "
            "(None is for a task with env= or agent=, scored by its environment or agent)",
        )
        weights = self.reward_weights
        if isinstance(weights, list | tuple):  # each a Python number, within the bound that keeps sums finite
            weights = tuple(map(plain, weights)) if isinstance(weights, tuple) else list(map(plain, weights))
            object.__setattr__(self, "reward_weights", weights)
            check_reward_weights("Task.reward_weights", weights, "reward_weights=[1.0, 0.5]")
        self.rewards  # checks reward and reward_weights  # noqa: B018
        check_int("Task.max_new_tokens", self.max_new_tokens, minimum=1, example="the longest answer's length + 1")
        require(isinstance(self.about, str), "Task.about", self.about, "use a string, e.g. about='x*7 of two digits'")

    def __repr__(self) -> str:
        # Short: a notebook cell that ends in register_task(task) echoes it.
        alphabet = self.alphabet if len(self.alphabet) <= 40 else self.alphabet[:37] + "..."
        turns = f", max_turns={self.max_turns}" if self.env is not None else ""
        return f"Task({self.name!r}, alphabet={alphabet!r}, max_new_tokens={self.max_new_tokens}{turns})"

    @functools.cached_property
    def rewards(self) -> Rewards:
        """The reward functions with their weights, as a rollout calls them."""
        return Rewards.of(env_reward if self.reward is None else self.reward, self.reward_weights)

    def prompt_source(self) -> PromptSource:
        """What a prompt-loader worker needs to make this task's prompts: its records,
        or its ``make_prompt``; never its reward functions."""
        if self.records is not None:
            return self.records
        assert self.make_prompt is not None
        return Generated(self.name, self.make_prompt)

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint records of the data this task trains on: its records' count
        and hash (:meth:`Records.fingerprint`), or that ``make_prompt`` makes its prompts."""
        return {"kind": "generated"} if self.records is None else self.records.fingerprint()

    def item(self, seed: int, index: int) -> PromptItem:
        """Training prompt number ``index`` of the stream for ``seed``."""
        return self.prompt_source().item(seed, index)

    def prompts(self, seed: int, *, start: int = 0) -> Iterator[PromptItem]:
        """An endless, reproducible stream of training prompts (ids from ``start``)."""
        for i in itertools.count(start):
            yield self.item(seed, i)

    def eval_set(self, n: int, *, seed: int = 12345) -> list[PromptItem]:
        """``n`` held-out prompts, the same for the same seed. A task made from records
        gives its held-out records (at most ``n``, in a fixed order; ``seed`` is not used);
        ConfigError if it holds out none."""
        if self.records is not None:
            if not self.records.held_out_rows:
                raise ConfigError(
                    f"task {self.name!r} holds out no records (Task.from_records(eval_size=0)), so there is nothing "
                    "to evaluate on: make the task with eval_size > 0, e.g. eval_size=0.1 or eval_size=200"
                )
            return self.records.held_out(n)
        assert self.make_prompt is not None
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


# How often the sloppy teacher drops the last letter of a word of 4 or more letters.
SLOPPY_SLIP_RATE = 0.6


def _sloppy_reverse_prompt(rng: random.Random) -> tuple[str, str]:
    prompt, answer = _reverse_prompt(rng)
    if len(answer) >= 4 and rng.random() < SLOPPY_SLIP_RATE:
        answer = answer[:-1]
    return prompt, answer


sloppy_reverse = Task(
    name="sloppy_reverse",
    alphabet=reverse.alphabet,
    make_prompt=_sloppy_reverse_prompt,
    reward=_positional_credit,
    max_new_tokens=reverse.max_new_tokens,
    about=f"a sloppy teacher: words of 4+ letters lose their last letter {SLOPPY_SLIP_RATE:.0%} of the time",
)
"""``reverse`` as a sloppy teacher writes it: the same words, but for words of 4 or
more letters the reversal drops its last letter 60 % of the time ("abcde=" ->
"edcb"). Meant as demonstrations for a warm-up (``WarmupConfig(task=...)``) that
RL on ``reverse`` then corrects; as a task of its own it rewards the slip."""


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


def mul(a: int, b: int) -> int:
    """The calculator tool of the ``calculator`` task: a times b."""
    return a * b


# Products of one digit by one the tiny policy can learn by heart; the rest it cannot.
CALCULATOR_SMALL = 0.3
# How often the calculator's warm-up teacher calls the tool (it answers directly otherwise).
CALCULATOR_TEACHER_CALLS = 0.3


def _factors(rng: random.Random) -> tuple[int, int]:
    if rng.random() < CALCULATOR_SMALL:
        return rng.randint(1, 9), rng.randint(1, 9)
    return rng.randint(10, 99), rng.randint(10, 99)


def _calculator_prompt(rng: random.Random) -> tuple[str, str]:
    a, b = _factors(rng)
    return f"{a}*{b}=", str(a * b)


def _calculator_teacher_prompt(rng: random.Random) -> tuple[str, str | Demonstration]:
    a, b = _factors(rng)
    if rng.random() < CALCULATOR_TEACHER_CALLS:
        return f"{a}*{b}=", Demonstration(f"mul({a},{b})", f"={a * b};", str(a * b))
    return f"{a}*{b}=", str(a * b)


def _exact(completion: str, answer: str) -> float:
    return float(completion.strip() == answer)


calculator = Task(
    name="calculator",
    alphabet="0123456789*=mul(),;?",
    make_prompt=_calculator_prompt,
    reward=_exact,
    max_new_tokens=11,
    about="products of two numbers, with a calculator tool mul(a,b) to call",
    env=ToolEnv([mul], result_format="={result};", error_format="=?;"),
    max_turns=3,
)
"""A teaching environment: ``37*48=`` asks for a product, and the policy may answer at
once or call the tool first: ``mul(37,48)``, to which the environment answers
``=1776;``, then ``1776``. Products of one digit by one (30 %) can be learnt by heart;
those of two digits by two cannot. Its warm-up teacher (``calculator_teacher``) calls
the tool only 30 % of the time, so after the warm-up the policy mostly answers at
once; RL, rewarded for exact answers, learns to call the tool."""

calculator_teacher = Task(
    name="calculator_teacher",
    alphabet=calculator.alphabet,
    make_prompt=_calculator_teacher_prompt,
    reward=_exact,
    max_new_tokens=calculator.max_new_tokens,
    about=f"answers at once, and calls mul() first {CALCULATOR_TEACHER_CALLS:.0%} of the time",
)
"""Demonstrations of ``calculator`` for a warm-up: right answers, written at once
most of the time and after a call of ``mul`` (a :class:`~rlnb.envs.Demonstration`) 30 %
of the time."""

_TASKS: dict[str, Task] = {t.name: t for t in (addition, reverse, sloppy_reverse, sort, calculator, calculator_teacher)}


def _check_prompts(task: Task) -> None:
    """Make a few of ``task``'s prompts, as a session would, and check what comes back."""
    name = f"Task {task.name!r}"
    assert task.make_prompt is not None
    for index in range(SAMPLE_PROMPTS):
        try:
            made = task.make_prompt(random.Random(f"{task.name}:check:{index}"))
        except Exception as exc:
            raise ConfigError(f"{name}: make_prompt(rng) raised {exc!r}; fix it and register the task again") from exc
        if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], str)):
            raise ConfigError(
                f"{name}: make_prompt(rng) returned {made!r}: return a tuple (prompt, answer) whose prompt is a "
                "str, e.g. ('12*7=', '84')"
            )
        prompt, answer = made
        for what, text in (("prompt", prompt), ("answer", answer if isinstance(answer, str) else "")):
            outside = "".join(sorted(set(text) - set(task.alphabet)))
            if outside:
                raise ConfigError(
                    f"Task.alphabet={task.alphabet!r} of {task.name!r} is invalid: the {what} {text!r} holds "
                    f"{outside!r}; add every character a prompt or answer may hold"
                )
        if isinstance(answer, str) and len(answer) + 1 > task.max_new_tokens:
            raise ConfigError(
                f"Task.max_new_tokens={task.max_new_tokens} of {task.name!r} is invalid: the answer {answer!r} "
                f"needs {len(answer) + 1} tokens with end-of-sequence; use the longest answer's length + 1"
            )


def register_task(task: Task, *, replace: bool = False) -> Task:
    """Make ``task`` available by name to ``Config(task=...)``; returns it.

    Makes a few of its prompts first and raises :class:`~rlnb.ConfigError` if
    ``make_prompt`` fails or returns something a session cannot use (not a
    ``(prompt, answer)`` tuple, characters outside the alphabet, an answer longer
    than ``max_new_tokens`` allows), or if the name is taken and ``replace`` is False.
    """
    require(
        isinstance(task, Task),
        "register_task(task)",
        task,
        "pass a rlnb.data.Task(name, alphabet, make_prompt, reward, max_new_tokens)",
    )
    if task.name in _TASKS and not replace and _TASKS[task.name] is not task:
        raise ConfigError(f"a task named {task.name!r} exists already; pass replace=True to replace it")
    if task.records is None:  # records were checked when the task was made
        _check_prompts(task)
    _TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    """The registered task called ``name``; ConfigError naming the known ones otherwise."""
    require(isinstance(name, str), "Config.task", name, 'use a task name, e.g. task="addition"')
    try:
        return _TASKS[name]
    except KeyError:
        raise ConfigError(
            f"Config.task={name!r} is unknown: use one of {task_names()}, or register your own first "
            "with rlnb.data.register_task(rlnb.data.Task(...))"
        ) from None


def task_names() -> list[str]:
    return sorted(_TASKS)

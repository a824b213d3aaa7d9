"""TRL's reward functions as they are: called once per group, with keywords, as TRL's ``GRPOTrainer`` calls them.

TRL calls ``fn(prompts=, completions=, completion_ids=, **columns, trainer_state=,
log_extra=, log_metric=)`` with one entry per completion in each list and expects one
number (or None: "does not apply") per completion. rlnb calls such a function once per
group (it is :func:`~rlnb.rewards.batched`), with:

- ``prompts``: the prompt's text per completion; for a chat task its messages
  (a list of ``{"role", "content"}`` dicts);
- ``completions``: each completion's text; for a chat task ``[{"role": "assistant",
  "content": text}]`` (for a conversation with an environment, its whole text);
- ``completion_ids``: the token ids the policy sampled for each completion (a list
  of ints; a conversation's hold the environment's tokens between its turns);
- each column of the task's record by its name, one value per completion, except
  ``prompt``, ``completion`` and ``completion_ids`` (as TRL leaves them out) and a
  column named like one of these keywords; a task made by a generator (no record)
  gives its answers as ``answer``;
- ``trainer_state=None`` (rlnb has no ``transformers.TrainerState``: a function that
  shapes its reward by the step reads the policy version elsewhere), and
  ``log_extra`` and ``log_metric`` as functions that drop what they are given (each
  function's values are in the history as ``reward/<name>`` already).

A function without ``**kwargs`` gets only the keywords it names.

**Recognised by its signature** (:func:`is_trl_reward`, the one rule): a function
that takes ``**kwargs`` and names ``prompts``, ``completions`` or ``completion_ids``,
or takes no positional argument at all, is TRL's, and a task's ``reward`` wraps it
with :func:`from_trl` itself. rlnb's own functions take ``(completion, answer)``
(singular) and its batched ones are marked, so neither is mistaken for TRL's; wrap
any other function explicitly with :func:`from_trl`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlnb._errors import ConfigError
from rlnb._reprs import short_repr
from rlnb.rewards._isolation import run_coroutine

__all__ = ["TRL_KEYWORDS", "TrlReward", "from_trl", "is_trl_reward"]

# The keywords TRL passes besides the data set's columns.
TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
_NAMES = ("prompts", "completions", "completion_ids")  # a parameter named so marks a TRL function
_NOT_COLUMNS = frozenset({"prompt", "completion", *TRL_KEYWORDS})  # TRL leaves the first three out of the columns
_BATCHED = "__rlnb_batched__"  # rlnb.rewards.batched's mark (_combine.py)


def is_trl_reward(fn: Any) -> bool:
    """Whether ``fn`` has TRL's reward signature: it takes ``**kwargs`` and names
    ``prompts``, ``completions`` or ``completion_ids``, or takes no positional argument;
    never a function marked :func:`~rlnb.rewards.batched` or already wrapped."""
    if not callable(fn) or getattr(fn, _BATCHED, False):
        return False
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no readable signature: rlnb's own call will tell
        return False
    if not any(p.kind is p.VAR_KEYWORD for p in parameters):
        return False
    positional = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
    )
    return any(p.name in _NAMES for p in parameters) or not any(p.kind in positional for p in parameters)


def from_trl(fn: Callable[..., Any], *, name: str | None = None) -> TrlReward:
    """``fn``, a reward function written for TRL's ``GRPOTrainer``, as an rlnb reward
    function called once per group (see :mod:`rlnb.rewards._trl` for what it gets);
    ``name`` (default: ``fn``'s) is the one the history shows as ``reward/<name>``.
    A task's ``reward`` wraps a function with TRL's signature by itself (:func:`is_trl_reward`).

    Raises :class:`~rlnb.ConfigError` when ``fn`` is not callable, or has a positional-only
    parameter without a default (TRL passes keywords only)."""
    if isinstance(fn, TrlReward):
        return fn if name is None else TrlReward(fn.fn, name)
    if not callable(fn):
        raise ConfigError(f"from_trl({short_repr(fn)}) is invalid: pass a reward function written for TRL")
    if name is not None and (not isinstance(name, str) or not name):
        raise ConfigError(f"from_trl(name={name!r}) is invalid: give a non-empty string, or None for the function's")
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    for p in parameters:
        if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise ConfigError(
                f"from_trl({short_repr(fn)}) is invalid: its parameter {p.name!r} is positional-only, and a TRL "
                "reward function is called with keywords only (prompts=, completions=, completion_ids=, the columns)"
            )
    return TrlReward(fn, name if name is not None else _name(fn))


def _name(fn: Any) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return "reward" if name == "<lambda>" else str(name)


def _ignore(*args: Any, **kwargs: Any) -> None:
    """TRL's ``log_extra`` and ``log_metric``: rlnb keeps each function's values already."""


class TrlReward:
    """A TRL reward function as an rlnb batched one (:func:`from_trl` makes it): called
    ``(completions, answers, prompts=, rows=, completion_ids=, prompt_messages=)`` by
    :class:`~rlnb.rewards.Rewards`, it calls ``fn`` with TRL's keywords and returns
    what ``fn`` returns (an awaitable run to its end on the reward thread)."""

    __rlnb_batched__ = True

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self.fn = fn
        self.__name__ = name
        try:
            parameters = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # unreadable: give it everything, as TRL does
            parameters = None
        # Without **kwargs a function gets only the keywords it names.
        takes_any = parameters is None or any(p.kind is p.VAR_KEYWORD for p in parameters)
        self._takes: frozenset[str] | None = (
            None if takes_any else frozenset(p.name for p in parameters or () if p.kind is not p.POSITIONAL_ONLY)
        )

    def __call__(
        self,
        completions: Sequence[str],
        answers: Sequence[Any],
        *,
        prompts: Sequence[str],
        rows: Sequence[Mapping[str, Any] | None],
        completion_ids: Sequence[Sequence[int] | None],
        prompt_messages: Sequence[Sequence[Mapping[str, str]] | None],
    ) -> Any:
        chat = bool(prompt_messages) and all(m is not None for m in prompt_messages)
        given: dict[str, Any] = {
            "prompts": [[dict(m) for m in ms or ()] for ms in prompt_messages] if chat else list(prompts),
            "completions": [[{"role": "assistant", "content": c}] for c in completions] if chat else list(completions),
            "completion_ids": [None if ids is None else list(ids) for ids in completion_ids],
            **_columns(rows, answers),
            "trainer_state": None,
            "log_extra": _ignore,
            "log_metric": _ignore,
        }
        if self._takes is not None:
            given = {k: v for k, v in given.items() if k in self._takes}
        value = self.fn(**given)
        if inspect.isawaitable(value):
            value = run_coroutine(value)  # on the reward thread, as rlnb's own async functions
        return value

    def __repr__(self) -> str:
        return f"from_trl({short_repr(self.fn)})"


def _columns(rows: Sequence[Mapping[str, Any] | None], answers: Sequence[Any]) -> dict[str, list[Any]]:
    """The records' columns by name, a value per completion (as TRL repeats them per
    generation); without records, the answers as ``answer``."""
    if not rows or any(row is None for row in rows):
        return {"answer": list(answers)}
    first = rows[0]
    assert first is not None
    return {key: [row.get(key) for row in rows if row is not None] for key in first if key not in _NOT_COLUMNS}

"""Several reward functions as one: each function's value for a sample, and their weighted sum.

A task's ``reward`` is one function or a list of them. Each is called as
``fn(completion, answer)``, with ``prompt=`` and ``row=`` (the task's record) added
when its signature takes them (and ``env_reward=``, a conversation's environment
reward, :mod:`rlnb.envs`); it returns a number, or None when it does not apply
to the sample (that function then does not count for it, as TRL's multi-task
rewards). An ``async def`` function is run to its end on the reward thread, as a
task that the call's timeout cancels (:mod:`rlnb.rewards._isolation`). The
sample's reward is the weighted sum of the values that are not None (0.0 when every
function said None), and each function's value is kept under its name.

A function marked :func:`batched` is called once per group instead, with lists:
``fn(completions, answers)``, and ``prompts=``, ``rows=``, ``env_rewards=``,
``completion_ids=`` (each completion's token ids) and ``prompt_messages=`` (a chat
prompt's messages, None for a text prompt) when it takes them; it returns one value
(or None) per completion. For reward models and LLM judges, which score a batch in
one call. A function with TRL's signature (``fn(completions, **kwargs)``, keywords
only) is wrapped as one (:mod:`rlnb.rewards._trl`, :func:`~rlnb.rewards.from_trl`).

Each function keeps its last calls' durations and its failures (:meth:`Rewards.timings`,
:meth:`Rewards.failures`), for ``Session.diagnose``: a record shared by every copy
of the function that :meth:`Rewards.with_weights` makes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from rlnb._checks import check_reward_weights, plain
from rlnb._errors import ConfigError, InvalidValueError, RlnbError
from rlnb._reprs import clip, short_repr
from rlnb._samples import Sample
from rlnb.rewards._isolation import run_coroutine
from rlnb.rewards._trl import from_trl, is_trl_reward

__all__ = [
    "FLOAT32_MAX",
    "BadValue",
    "RewardFunction",
    "Rewards",
    "Scored",
    "Timing",
    "batched",
    "per_function",
    "raised_by",
    "reward_value",
]

# The learner computes advantages in float32: a larger reward would become inf there.
FLOAT32_MAX = 3.4028234663852886e38
_KEYWORDS = ("prompt", "row", "env_reward")
_BATCHED_KEYWORDS = ("prompts", "rows", "env_rewards", "completion_ids", "prompt_messages")
_MARK = "__rlnb_batched__"
_RAISED_BY = "__rlnb_reward_function__"  # set on an exception a function of several raised
TIMED_CALLS = 256  # the last calls of each function whose durations timings() reads


def batched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` to be called once per group, as ``fn(completions, answers)`` with lists
    (and ``prompts=``, ``rows=``, ``env_rewards=``, ``completion_ids=``, ``prompt_messages=``
    lists when it takes them), returning a list of one number (or None) per completion.
    Returns ``fn`` itself::

        @rlnb.rewards.batched
        def judge(completions, answers):
            return model.score(completions, answers)
    """
    setattr(fn, _MARK, True)
    return fn


class BadValue(RlnbError):
    """A reward function returned something that is not a finite number (its repr in
    ``value``), or None where None is not allowed; ``function``: its name, if known.
    Also a sample's weighted sum beyond float32's range (``value`` says so, naming
    each function's value and weight; ``function`` None)."""

    def __init__(self, value: str, function: str | None = None) -> None:
        super().__init__(value)
        self.value = value
        self.function = function


def reward_value(value: Any, *, allow_none: bool = False) -> float | None:
    """``value`` as a finite float; None stays None when ``allow_none``. Raises
    ``BadValue`` with the value's repr for anything else: a string (even "1.0"), a
    list, NaN, inf, or a number the learner's float32 would make inf (``|r| > 3.4e38``).
    Takes a bool as 0.0 or 1.0, and a numpy or torch scalar."""
    if value is None and allow_none:
        return None
    reward = None
    if not isinstance(value, (str, bytes, bytearray)):  # float("1") would let a string through
        with contextlib.suppress(TypeError, ValueError, OverflowError):
            reward = float(value)
    if reward is None or not math.isfinite(reward) or abs(reward) > FLOAT32_MAX:
        raise BadValue(short_repr(value))
    return reward


def _name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return "reward" if name == "<lambda>" else str(name)


class Timing(NamedTuple):
    """A reward function's timing: ``calls`` in all, and the median and 99th percentile
    of the durations of its last :data:`TIMED_CALLS` calls, in seconds (a batched
    function's call scores a whole group)."""

    calls: int
    p50_s: float
    p99_s: float


class CallRecord:
    """A reward function's calls: the durations of the last ``window`` in a ring, the
    count of all, and its failures (raised, or a value that is not a number) with the
    last one's text. Thread-safe (several reward threads may record into it
    at once); a copy or a pickle starts empty (a lock does not travel)."""

    def __init__(self, window: int = TIMED_CALLS) -> None:
        self._lock = threading.Lock()
        self._seconds: collections.deque[float] = collections.deque(maxlen=window)
        self.calls = 0
        self.failed = 0
        self.last_error: str | None = None

    def add(self, seconds: float, error: BaseException | None = None) -> None:
        with self._lock:
            self._seconds.append(seconds)
            self.calls += 1
            if error is not None:
                self.failed += 1
                self.last_error = clip(f"{type(error).__name__}: {error}", 200)

    def fail(self, error: str) -> None:
        """A call that returned but whose value was refused (``error`` says why)."""
        with self._lock:
            self.failed += 1
            self.last_error = error

    def timing(self) -> Timing | None:
        """``Timing(calls, p50_s, p99_s)``; None before the first call."""
        with self._lock:
            seconds, calls = sorted(self._seconds), self.calls
        if not seconds:
            return None
        return Timing(calls, _percentile(seconds, 0.5), _percentile(seconds, 0.99))

    def __reduce__(self) -> tuple[Any, ...]:
        return (CallRecord, (self._seconds.maxlen or TIMED_CALLS,))


def _percentile(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``ordered`` (sorted, not empty)."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """One reward function, as :class:`Rewards` calls it. ``record`` times each call and
    counts its failures; copies made by :meth:`Rewards.with_weights` share it."""

    fn: Callable[..., Any]
    name: str
    weight: float
    keywords: tuple[str, ...]  # of _KEYWORDS (batched: _BATCHED_KEYWORDS): those its signature takes
    is_async: bool
    is_batched: bool = False
    record: CallRecord = dataclasses.field(default_factory=CallRecord, compare=False, repr=False)

    @classmethod
    def of(cls, fn: Any, name: str, weight: float, field: str) -> RewardFunction:
        if not callable(fn):
            raise ConfigError(
                f"{field}={fn!r} is invalid: a reward must be a function called as reward(completion, answer) "
                "that returns a number (or None when it does not apply)"
            )
        is_batched = bool(getattr(fn, _MARK, False))
        names = _BATCHED_KEYWORDS if is_batched else _KEYWORDS
        shape = "fn(completions, answers) -> list, with lists" if is_batched else "reward(completion, answer) -> float"
        keywords: tuple[str, ...] = ()
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # some builtins have no readable signature: calling them will tell
            signature = None
        if signature is not None:
            takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
            keywords = tuple(k for k in names if takes_any or _takes_keyword(signature, k))
            try:
                signature.bind("completion", "answer", **dict.fromkeys(keywords))
            except TypeError as exc:
                raise ConfigError(
                    f"{field}={fn!r} is invalid: it cannot be called as {shape}, "
                    f"with {'=, '.join(names)}= if it takes them ({exc}); a reward function written for TRL "
                    "(keywords only: prompts=, completions=, ...) is wrapped with rlnb.rewards.from_trl(fn)"
                ) from None
        target = getattr(fn, "__call__", fn) if not inspect.isroutine(fn) else fn  # noqa: B004
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(target)
        return cls(fn, name, weight, keywords, is_async, is_batched)

    def __call__(self, completion: Any, answer: Any, **given: Any) -> Any:
        started, error = time.perf_counter(), None
        try:
            value = self.fn(completion, answer, **{k: given[k] for k in self.keywords})
            if self.is_async:
                value = run_coroutine(value)  # on the reward thread, which runs no loop of its own
            return value
        except Exception as exc:
            error = exc
            if getattr(exc, _RAISED_BY, None) is None:  # the innermost function that raised it is the one to name
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(exc, _RAISED_BY, self.name)
                    exc.add_note(f"(raised by the reward function {self.name!r})")
            raise
        finally:
            self.record.add(time.perf_counter() - started, error)

    def value(self, value: Any) -> float | None:
        try:
            return reward_value(value, allow_none=True)
        except BadValue as bad:
            self.record.fail(f"returned {bad.value}, not a number")
            raise BadValue(bad.value, self.name) from None


def raised_by(exc: BaseException) -> str | None:
    """The name of the reward function (of a :class:`Rewards`) that raised ``exc``, if one did."""
    name = getattr(exc, _RAISED_BY, None)
    return name if isinstance(name, str) else None


def _takes_keyword(signature: inspect.Signature, name: str) -> bool:
    parameter = signature.parameters.get(name)
    return parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)


@dataclasses.dataclass(frozen=True)
class Scored:
    """A sample's reward: ``total``, the weighted sum, and ``parts``, each function's
    value by name (None where it did not apply)."""

    total: float
    parts: Mapping[str, float | None]


@dataclasses.dataclass(frozen=True)
class Rewards:
    """A task's reward functions with their weights; :meth:`score` calls them all."""

    functions: tuple[RewardFunction, ...]

    @classmethod
    def of(cls, reward: Any, weights: Sequence[Any] | None, *, field: str = "Task") -> Rewards:
        """Check ``reward`` (one function or a list) and ``weights`` (None: 1 each),
        raising ConfigError naming ``{field}.reward`` or ``{field}.reward_weights``."""
        single = callable(reward) or not isinstance(reward, Sequence) or isinstance(reward, str)
        functions = [reward] if single else list(reward)
        functions = [from_trl(fn) if is_trl_reward(fn) else fn for fn in functions]  # TRL's signature: _trl.py
        if not functions:
            raise ConfigError(f"{field}.reward=[] is invalid: give at least one reward function")
        example = f"reward_weights={[1.0] + [0.5] * (len(functions) - 1)}"
        if weights is None:
            weights = [1.0] * len(functions)
        if isinstance(weights, list | tuple):  # a numpy or torch scalar counts as the number it holds
            weights = [plain(w) for w in weights]
        if isinstance(weights, str) or not isinstance(weights, Sequence) or len(weights) != len(functions):
            raise ConfigError(
                f"{field}.reward_weights={weights!r} is invalid: give one number per reward function "
                f"({len(functions)}), e.g. {example}"
            )
        # As the configs check them: finite, and small enough that a weighted sum of
        # rewards within float32's range stays finite.
        check_reward_weights(f"{field}.reward_weights", list(weights), example)
        names = _unique([_name(fn) if callable(fn) else "reward" for fn in functions])
        return cls(
            tuple(
                RewardFunction.of(fn, name, float(w), f"{field}.reward" + ("" if single else f"[{i}]"))
                for i, (fn, name, w) in enumerate(zip(functions, names, weights, strict=True))
            )
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.functions)

    @property
    def weights(self) -> tuple[float, ...]:
        return tuple(f.weight for f in self.functions)

    def with_weights(self, weights: Sequence[float] | None) -> Rewards:
        """These functions with ``weights`` instead (one each, checked by the caller); None: as they are."""
        if weights is None:
            return self
        if len(weights) != len(self.functions):
            raise InvalidValueError(f"{len(self.functions)} reward functions need as many weights, got {len(weights)}")
        return Rewards(
            tuple(dataclasses.replace(f, weight=float(w)) for f, w in zip(self.functions, weights, strict=True))
        )

    def timings(self) -> dict[str, Timing]:
        """Each function's :class:`Timing` ``(calls, p50_s, p99_s)`` by name, for those
        called at least once: what it has cost wherever these functions ran (the
        rollouts and evaluations of every session of this task in the process)."""
        return {f.name: timing for f in self.functions if (timing := f.record.timing()) is not None}

    def failures(self) -> dict[str, tuple[int, str]]:
        """``(failed calls, the last failure)`` by name, for the functions that have
        failed: raised, or returned something that is not a number (or None)."""
        out = {}
        for f in self.functions:
            failed, last = f.record.failed, f.record.last_error
            if failed and last is not None:
                out[f.name] = (failed, last)
        return out

    @property
    def has_batched(self) -> bool:
        """Whether a function is called once per group (:meth:`score_group`)."""
        return any(f.is_batched for f in self.functions)

    def score(
        self,
        completion: str,
        answer: Any,
        *,
        prompt: str = "",
        row: Mapping[str, Any] | None = None,
        env_reward: float | None = None,
    ) -> Scored:
        """Call every function that scores one sample (on the caller's thread) and sum
        their weighted values; batched functions wait for :meth:`score_group`. Raises
        what a function raises, ``BadValue`` naming a function that returned
        something other than a finite number or None, and ``BadValue`` for a weighted
        sum beyond float32's range (|total| > 3.4e38; checked here unless batched
        functions are still to come, and then by :meth:`score_group`)."""
        parts = {
            f.name: f.value(f(completion, answer, prompt=prompt, row=row, env_reward=env_reward))
            for f in self.functions
            if not f.is_batched
        }
        # With batched functions to come the total is provisional: score_group checks the whole one.
        return self._scored(parts, check=not self.has_batched)

    def score_group(
        self,
        scored: Sequence[Mapping[str, float | None]],
        completions: Sequence[str],
        answers: Sequence[Any],
        prompts: Sequence[str],
        rows: Sequence[Mapping[str, Any] | None],
        env_rewards: Sequence[float | None] | None = None,
        *,
        completion_ids: Sequence[Sequence[int]] | None = None,
        prompt_messages: Sequence[Sequence[Mapping[str, str]] | None] | None = None,
    ) -> list[Scored]:
        """A group's samples, each with the values :meth:`score` gave it (``scored``),
        scored again with the batched functions' values added, each function called
        once with the group's lists (``completion_ids``: the samples' token ids, None
        each when not given; ``prompt_messages``: a chat prompt's messages, None for text)."""
        parts = [dict(p) for p in scored]
        n = len(parts)
        lists: dict[str, list[Any]] = {
            "prompts": list(prompts),
            "rows": list(rows),
            "env_rewards": list(env_rewards) if env_rewards is not None else [None] * n,
            "completion_ids": list(completion_ids) if completion_ids is not None else [None] * n,
            "prompt_messages": list(prompt_messages) if prompt_messages is not None else [None] * n,
        }
        for f in self.functions:
            if not f.is_batched:
                continue
            values = _as_list(f(list(completions), list(answers), **{k: list(v) for k, v in lists.items()}))
            if isinstance(values, str | bytes) or not isinstance(values, Sequence) or len(values) != len(parts):
                raise BadValue(f"{short_repr(values)}, not a list of {len(parts)} values (one per completion)", f.name)
            for part, value in zip(parts, values, strict=True):
                part[f.name] = f.value(value)
        return [self._scored(part) for part in parts]

    def _scored(self, parts: dict[str, float | None], *, check: bool = True) -> Scored:
        """``parts`` and their weighted sum; ``check``: raise ``BadValue`` (naming each
        function's value and weight) for a sum beyond float32's range, as a single
        reward beyond it is refused: the buffer, the metrics, the dashboard and
        ``rescore`` keep rewards in float32 or compare them with its limit."""
        ordered = {f.name: parts[f.name] for f in self.functions if f.name in parts}
        terms = [(f, value) for f in self.functions if (value := ordered.get(f.name)) is not None]
        total = float(sum(f.weight * value for f, value in terms))
        if check and not abs(total) <= FLOAT32_MAX:  # NaN too (inf - inf, from weights no check saw)
            summed = " + ".join(f"{f.name}={value:.4g} * {f.weight:g}" for f, value in terms)
            raise BadValue(
                f"a weighted sum of {total:.4g} ({summed}; scale the functions, or their reward_weights, down)"
            )
        return Scored(total, ordered)


def _as_list(values: Any) -> Any:
    """A 1-D numpy array or torch tensor as a list of its numbers; anything else as it is."""
    if getattr(values, "ndim", None) == 1 and callable(getattr(values, "tolist", None)):
        with contextlib.suppress(Exception):
            listed = values.tolist()
            if isinstance(listed, list):
                return listed
    return values


def per_function(samples: Iterable[Sample]) -> dict[str, float]:
    """Each reward function's mean and standard deviation (over the samples where it
    applied) as ``reward/<name>`` and ``reward/<name>/std``; empty for samples scored
    by a single function (``reward_mean`` is its mean)."""
    values: dict[str, list[float]] = {}
    for sample in samples:
        for name, value in sample.rewards.items():
            if value is not None:
                values.setdefault(name, []).append(value)
            else:
                values.setdefault(name, [])
    metrics: dict[str, float] = {}
    if len(values) < 2:  # one function: its mean is reward_mean
        return metrics
    for name, found in values.items():
        if found:
            metrics[f"reward/{name}"] = statistics.fmean(found)
            metrics[f"reward/{name}/std"] = statistics.pstdev(found)
    return metrics


def _unique(names: list[str]) -> list[str]:
    """``names`` made unique: each name's first use keeps it, a repeat gets the first
    ``name_2``, ``name_3``, ... that no function has or is given (f, f, f_2 -> f, f_3, f_2)."""
    taken = set(names)
    seen: set[str] = set()
    out = []
    for name in names:
        if name in seen:
            n = 2
            while f"{name}_{n}" in taken:
                n += 1
            name = f"{name}_{n}"
            taken.add(name)
        seen.add(name)
        out.append(name)
    return out

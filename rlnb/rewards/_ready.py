"""Ready-made reward functions: an exact answer, a math answer, a format, a length limit.

Each is called as ``fn(completion, answer) -> float`` on a reward thread. The two
that parse model output, :func:`math_answer` and the test of :func:`regex_format`,
are :func:`~rlnb.rewards.isolated`: in a rollout they run in a worker process that
``RolloutConfig.reward_timeout`` kills, since a pathological expression or a
backtracking pattern holds the GIL (every other thread stops) for as long as it runs. Its
``__name__`` names its metric (``reward/<name>`` in the history); the callables that
:func:`regex_format` and :func:`length_penalty` return are instances of top-level
classes with a short repr, so a task that holds them can be pickled and copied.

:func:`math_answer` needs the optional extra ``rlnb[math]`` (math-verify), imported
at its first call: ``import rlnb.rewards`` loads neither math-verify nor sympy.
"""

from __future__ import annotations

import dataclasses
import decimal
import logging
import re
from typing import Any

from rlnb._checks import is_int, is_number
from rlnb._errors import ConfigError
from rlnb.rewards._combine import FLOAT32_MAX
from rlnb.rewards._isolation import isolated

__all__ = ["exact_match", "length_penalty", "math_answer", "regex_format"]


def _require(ok: bool, call: str, argument: str, value: Any, fix: str) -> None:
    """Raise ``ConfigError("{call}({argument}={value!r}) is invalid: {fix}")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{call}({argument}={value!r}) is invalid: {fix}")


def exact_match(completion: str, answer: Any) -> float:
    """1.0 when the completion is the answer, ignoring surrounding whitespace, else 0.0.

    Compares ``completion.strip()`` with ``str(answer).strip()``, so a number given as
    an int matches its digits (``exact_match(" 42\\n", 42) == 1.0``); an answer of
    None scores 0.0 for every completion. For answers that may be written in more
    than one way ("0.5", "1/2", "\\boxed{\\frac12}"), use :func:`math_answer`.
    """
    if answer is None:
        return 0.0
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


# --- math_answer -----------------------------------------------------------------------


class _DropTimeoutNotice(logging.Filter):
    """Drops math-verify's "Timeout is disabled ..." warning. math_answer turns its
    timeouts off on purpose (see there), and rlnb's ``RolloutConfig.reward_timeout``
    bounds each reward call, so the advice to add one would only mislead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


_DROP_TIMEOUT_NOTICE = _DropTimeoutNotice()


def _math_verify() -> Any:
    """The ``math_verify`` module; raises ConfigError naming the extra when it is missing."""
    try:
        import math_verify
    except ImportError as exc:
        raise ConfigError(
            f"math_answer needs the math-verify package, which is not installed ({exc}): pip install 'rlnb[math]'"
        ) from exc
    for logger in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(logger).addFilter(_DROP_TIMEOUT_NOTICE)  # a no-op when already added
    return math_verify


def _answer_text(answer: Any) -> str:
    """``answer`` as text math-verify reads: a float in plain digits, since it takes
    ``str(1e-07)`` for 1."""
    if isinstance(answer, float):
        return format(decimal.Decimal(repr(answer)), "f")
    return str(answer)


@isolated
def math_answer(completion: str, answer: Any) -> float:
    """1.0 when the completion's final answer equals ``answer`` mathematically, else 0.0.

    Both are read with math-verify (``pip install 'rlnb[math]'``): the completion's
    answer in a ``\\boxed{}`` if it has one, else the last it finds, in LaTeX or
    plain notation, compared by value, so ``"\\boxed{\\frac{1}{2}}"`` matches
    ``"0.5"`` and ``"The answer is 42."`` matches ``42`` (an int, float or string).
    A completion with no answer math-verify can read scores 0.0, and so does every
    completion when ``answer`` is None or holds no math it can read (plain words
    such as "yes"; use :func:`exact_match` for those).

    Runs without math-verify's own timeouts: they use ``signal.alarm``, which works
    only on the main thread. In a rollout it runs in a worker process instead
    (:func:`~rlnb.rewards.isolated`), killed at ``RolloutConfig.reward_timeout``, so a
    pathological expression (``\boxed{2^{2^{40}}}``) fails its sample after the
    timeout and freezes nothing; called directly (in a cell) it runs in the caller,
    unbounded.

    Raises :class:`~rlnb.ConfigError` when math-verify is not installed.
    """
    math_verify = _math_verify()
    if answer is None:
        return 0.0
    gold = math_verify.parse(_answer_text(answer), parsing_timeout=None)
    predicted = math_verify.parse(completion, parsing_timeout=None)
    if not gold or not predicted:
        return 0.0
    return 1.0 if math_verify.verify(gold, predicted, timeout_seconds=None) else 0.0


# --- regex_format ----------------------------------------------------------------------


def _check_name(owner: str, name: Any) -> None:
    _require(
        name is None or (isinstance(name, str) and bool(name) and not re.search(r"[\s/]", name)),
        owner,
        "name",
        name,
        "use None or a metric name without spaces or '/', e.g. name='answer_tags'",
    )


@dataclasses.dataclass(frozen=True, repr=False)
class _RegexFormat:
    """The reward :func:`regex_format` returns."""

    pattern: str
    flags: int
    name: str | None

    @property
    def __name__(self) -> str:
        return self.name or "regex_format"

    def __call__(self, completion: str, answer: Any) -> float:
        return 1.0 if _fullmatch(self.pattern, self.flags, completion.strip()) else 0.0

    def __repr__(self) -> str:
        flags = f", flags={re.RegexFlag(self.flags)!s}" if self.flags else ""
        name = f", name={self.name!r}" if self.name else ""
        return f"regex_format({self.pattern!r}{flags}{name})"


@isolated
def _fullmatch(pattern: str, flags: int, text: str) -> bool:
    """Whether ``text`` matches ``pattern`` whole: in a worker process in a rollout, since
    a backtracking pattern holds the GIL for as long as it runs."""
    return re.fullmatch(pattern, text, flags) is not None


_RE_FLAGS = 0
for _flag in re.RegexFlag:
    _RE_FLAGS |= _flag.value


def regex_format(pattern: str, *, flags: int = 0, name: str | None = None) -> _RegexFormat:
    """A reward scoring 1.0 when the whole completion (stripped) matches ``pattern``, else 0.0.

    The test is ``re.fullmatch(pattern, completion.strip(), flags)``, whatever the
    answer. Its ``__name__`` (its metric: ``reward/<name>``) is ``name`` or
    "regex_format". Example, a reasoning-then-answer format::

        regex_format(r"<think>.*</think>\\s*<answer>.*</answer>", flags=re.DOTALL, name="format")

    In a rollout the match runs in a worker process that ``RolloutConfig.reward_timeout``
    kills: a pattern that backtracks (``r"(a+)+b"`` on a long run of a's) fails its
    sample after the timeout instead of freezing the session.

    Raises :class:`~rlnb.ConfigError` at once for a pattern that does not compile
    (naming the regex error), flags that are not a combination of ``re`` flags, or a
    name that is not a metric name.
    """
    _require(isinstance(pattern, str), "regex_format", "pattern", pattern, r"use a string, e.g. pattern=r'\d+'")
    _require(
        is_int(flags) and flags >= 0 and not flags & ~_RE_FLAGS,
        "regex_format",
        "flags",
        flags,
        "use re flags (an int), e.g. flags=re.DOTALL | re.IGNORECASE",
    )
    _check_name("regex_format", name)
    try:
        re.compile(pattern, flags)
    except (re.error, ValueError, OverflowError) as exc:
        raise ConfigError(
            f"regex_format(pattern={pattern!r}) is invalid: it does not compile ({exc}); fix the regular expression"
        ) from None
    return _RegexFormat(pattern, int(flags), name)


# --- length_penalty --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, repr=False)
class _LengthPenalty:
    """The reward :func:`length_penalty` returns."""

    limit: int
    per_char: float | None  # None: 1 / limit
    max_penalty: float | None  # None: no cap
    name: str | None

    @property
    def __name__(self) -> str:
        return self.name or "length_penalty"

    def __call__(self, completion: str, answer: Any) -> float:
        excess = len(completion) - self.limit
        if excess <= 0:
            return 0.0
        penalty = excess * (self.per_char if self.per_char is not None else 1 / self.limit)
        # Without a cap, a long completion times a large per_char could pass float32's
        # range (or reach inf): the learner's numbers must stay finite.
        return -min(float(penalty), FLOAT32_MAX if self.max_penalty is None else self.max_penalty)

    def __repr__(self) -> str:
        options = [f"{self.limit}"]
        if self.per_char is not None:
            options.append(f"per_char={self.per_char!r}")
        if self.max_penalty != 1.0:
            options.append(f"max_penalty={self.max_penalty!r}")
        if self.name:
            options.append(f"name={self.name!r}")
        return f"length_penalty({', '.join(options)})"


def length_penalty(
    limit: int, *, per_char: float | None = None, max_penalty: float | None = 1.0, name: str | None = None
) -> _LengthPenalty:
    """A reward of 0.0 for a completion of at most ``limit`` characters, negative above.

    The value is ``-min(max_penalty, per_char * (len(completion) - limit))`` past the
    limit. ``per_char`` defaults to ``1 / limit``, so by default the penalty grows
    linearly from 0 at ``limit`` characters to -1.0 at twice the limit and stays
    there: ``length_penalty(100)`` gives 0.0 for 80 characters, -0.5 for 150 and -1.0
    for 300. ``max_penalty=None`` removes the cap. The length is the completion's
    own, whitespace included; without a cap the penalty stops at float32's largest
    number, 3.4e38, so it stays finite. Its ``__name__`` is ``name`` or "length_penalty".
    Combine it with a correctness reward, weighted, e.g. ``Task(reward=[math_answer,
    length_penalty(400)], reward_weights=[1.0, 0.2])``.

    Raises :class:`~rlnb.ConfigError` naming the argument when ``limit`` is not an int
    >= 1, or ``per_char`` or ``max_penalty`` is not None or a number > 0 and at most
    3.4e38 (float32's range, which the learner computes in).
    """
    _require(is_int(limit) and limit >= 1, "length_penalty", "limit", limit, "use an int >= 1 (characters), e.g. 400")
    _require(
        per_char is None or (is_number(per_char) and 0 < per_char <= FLOAT32_MAX),
        "length_penalty",
        "per_char",
        per_char,
        f"use None (1 / limit) or a number > 0 and <= 3.4e38, the penalty per character past the limit, "
        f"e.g. {1 / limit:g}",
    )
    _require(
        max_penalty is None or (is_number(max_penalty) and 0 < max_penalty <= FLOAT32_MAX),
        "length_penalty",
        "max_penalty",
        max_penalty,
        "use None (no cap) or a number > 0 and <= 3.4e38, the largest penalty, e.g. 1.0",
    )
    _check_name("length_penalty", name)
    return _LengthPenalty(
        limit,
        None if per_char is None else float(per_char),
        None if max_penalty is None else float(max_penalty),
        name,
    )

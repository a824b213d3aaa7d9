from __future__ import annotations

import copy
import importlib.util
import inspect
import logging
import pickle
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

import rlnb
from rlnb.rewards._ready import exact_match, length_penalty, math_answer, regex_format
from tests.helpers.processes import PythonProcesses

needs_math_verify = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None, reason="needs math-verify: pip install 'rlnb[math]'"
)


def test_exact_match_compares_the_stripped_completion_with_the_answer_as_text() -> None:
    assert exact_match("42", "42") == 1.0
    assert exact_match("  42\n", " 42 ") == 1.0
    assert exact_match("42", 42) == 1.0
    assert exact_match("4 2", "42") == 0.0
    assert exact_match("42.0", 42) == 0.0  # text, not value: math_answer compares values
    assert exact_match("", "42") == 0.0
    assert exact_match("None", None) == 0.0
    assert exact_match("", None) == 0.0


@needs_math_verify
@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("42", 42),
        ("The answer is 42.", "42"),
        ("\\boxed{1/2}", "0.5"),
        ("\\boxed{1/2}", 0.5),
        ("so $x = \\frac{1}{2}$", "1/2"),
        ("0.5", "\\frac{1}{2}"),
        ("Work: 3 + 4 = 7, so the result is \\boxed{7}", 7),
        ("0.0000001", 1e-7),  # a small float is compared by value, not read from "1e-07"
        ("\\boxed{\\sqrt{2}}", "1.41421356"),
        ("\\boxed{-3}", -3),
    ],
)
def test_math_answer_scores_an_equal_final_answer(completion: str, answer: Any) -> None:
    assert math_answer(completion, answer) == 1.0


@needs_math_verify
@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("43", 42),
        ("\\boxed{3}", -3),
        ("\\boxed{1/3}", 0.5),
        ("I do not know.", 42),  # no answer to read
        ("", "42"),
        ("42", None),
        ("yes", "yes"),  # no math in the answer: exact_match's job
    ],
)
def test_math_answer_scores_zero_for_a_wrong_missing_or_unreadable_answer(completion: str, answer: Any) -> None:
    assert math_answer(completion, answer) == 0.0


@needs_math_verify
def test_math_answer_works_on_worker_threads() -> None:
    # math-verify's default timeouts use signal.alarm, which fails off the main thread.
    cases = [("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("The answer is 42.", 42, 1.0), ("41", 42, 0.0)]
    results: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def score(worker: int) -> None:
        try:
            results[worker] = [math_answer(c, a) for c, a, _ in cases * 3]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=score, args=(i,), name=f"reward-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == {i: [expected for *_, expected in cases * 3] for i in range(2)}


@needs_math_verify
def test_math_answer_silences_the_notice_about_its_disabled_timeouts(caplog: pytest.LogCaptureFixture) -> None:
    math_answer("1", 1)
    with caplog.at_level(logging.WARNING):
        logging.getLogger("math_verify.parser").warning("Timeout is disabled as parsing_timeout is None or <= 0")
        logging.getLogger("math_verify.grader").warning("Timeout during comparison")
    assert [r.getMessage() for r in caplog.records] == ["Timeout during comparison"]


def test_math_answer_without_math_verify_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now fails
    with pytest.raises(rlnb.ConfigError, match=re.escape("pip install 'rlnb[math]'")):
        math_answer("42", 42)


def test_importing_the_rewards_loads_neither_math_verify_nor_sympy(start_python: PythonProcesses) -> None:
    code = "import sys, rlnb.rewards._ready; print(sorted({'math_verify', 'sympy'} & set(sys.modules)))"
    out, err = start_python("-c", code).communicate(timeout=60)
    assert out.strip() == "[]", err


def test_regex_format_scores_a_full_match_of_the_stripped_completion() -> None:
    fmt = regex_format(r"<answer>\d+</answer>")
    assert fmt("<answer>42</answer>", None) == 1.0
    assert fmt("\n <answer>42</answer>  \n", "anything") == 1.0
    assert fmt("The <answer>42</answer>", None) == 0.0  # the whole completion must match
    assert fmt("<answer>42</answer> done", None) == 0.0
    assert fmt("<answer>x</answer>", None) == 0.0
    think = regex_format(r"<think>.*</think>\s*<answer>.*</answer>", flags=re.DOTALL | re.IGNORECASE)
    assert think("<THINK>a\nb</THINK>\n<answer>1</answer>", None) == 1.0
    assert regex_format(r"<think>.*</think>")("<think>a\nb</think>", None) == 0.0  # "." stops at a newline


def test_regex_format_is_named_for_its_metric_and_shows_its_pattern() -> None:
    fmt = regex_format(r"<answer>\d+</answer>")
    assert fmt.__name__ == "regex_format"
    assert repr(fmt) == r"regex_format('<answer>\\d+</answer>')"
    named = regex_format(r"\d+", flags=re.DOTALL, name="digits")
    assert named.__name__ == "digits"
    assert repr(named) == r"regex_format('\\d+', flags=re.DOTALL, name='digits')"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pattern": "<answer>(\\d+</answer>"}, r"regex_format\(pattern='<answer>.*it does not compile \(missing \)"),
        ({"pattern": "a**"}, r"regex_format\(pattern='a\*\*'\) is invalid: .*multiple repeat"),
        ({"pattern": b"\\d+"}, r"regex_format\(pattern=b'.*use a string"),
        ({"pattern": "x", "flags": "s"}, r"regex_format\(flags='s'\) is invalid: use re flags"),
        ({"pattern": "x", "flags": -1}, r"regex_format\(flags=-1\)"),
        ({"pattern": "x", "flags": 1 << 40}, r"regex_format\(flags=1099511627776\) is invalid: use re flags"),
        ({"pattern": "x", "name": ""}, r"regex_format\(name=''\) is invalid"),
        ({"pattern": "x", "name": "reward/format"}, r"regex_format\(name='reward/format'\) is invalid: .* without"),
    ],
)
def test_regex_format_rejects_bad_arguments_before_any_training(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(rlnb.ConfigError, match=message):
        regex_format(**kwargs)


def test_length_penalty_is_zero_up_to_the_limit_then_grows_to_the_cap() -> None:
    penalty = length_penalty(100)
    assert [penalty("x" * n, None) for n in (0, 80, 100)] == [0.0, 0.0, 0.0]
    assert penalty("x" * 101, None) == pytest.approx(-0.01)
    assert penalty("x" * 150, None) == pytest.approx(-0.5)
    assert penalty("x" * 200, None) == pytest.approx(-1.0)
    assert penalty("x" * 1000, None) == -1.0  # capped at max_penalty
    assert penalty(" " * 150, "answer") == pytest.approx(-0.5)  # whitespace is length too
    linear = length_penalty(10, per_char=0.5, max_penalty=None)
    assert linear("x" * 40, None) == pytest.approx(-15.0)
    assert length_penalty(10, per_char=0.5, max_penalty=2)("x" * 40, None) == -2.0


def test_length_penalty_is_named_for_its_metric_and_shows_its_settings() -> None:
    assert length_penalty(100).__name__ == "length_penalty"
    assert repr(length_penalty(100)) == "length_penalty(100)"
    custom = length_penalty(50, per_char=0.1, max_penalty=None, name="short")
    assert custom.__name__ == "short"
    assert repr(custom) == "length_penalty(50, per_char=0.1, max_penalty=None, name='short')"


@pytest.mark.parametrize(
    ("args", "kwargs", "field"),
    [
        ((0,), {}, "limit=0"),
        ((-5,), {}, "limit=-5"),
        ((100.0,), {}, "limit=100.0"),
        (("100",), {}, "limit='100'"),
        ((True,), {}, "limit=True"),
        ((100,), {"per_char": -0.1}, "per_char=-0.1"),
        ((100,), {"per_char": 0}, "per_char=0"),
        ((100,), {"per_char": float("nan")}, "per_char=nan"),
        ((100,), {"per_char": 1e308}, "per_char=1e+308"),
        ((100,), {"max_penalty": 1e300}, "max_penalty=1e+300"),
        ((100,), {"max_penalty": -1.0}, "max_penalty=-1.0"),
        ((100,), {"max_penalty": "1"}, "max_penalty='1'"),
        ((100,), {"name": "too long"}, "name='too long'"),
    ],
)
def test_length_penalty_rejects_bad_arguments_naming_them(
    args: tuple[Any, ...], kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(rlnb.ConfigError, match=re.escape(f"length_penalty({field}) is invalid: use ")):
        length_penalty(*args, **kwargs)


READY: list[Callable[[str, Any], float]] = [
    exact_match,
    math_answer,
    regex_format(r"\d+", flags=re.ASCII, name="digits"),
    length_penalty(3, per_char=0.25),
]


@pytest.mark.parametrize("fn", READY, ids=lambda fn: fn.__name__)
def test_ready_rewards_pickle_copy_and_take_completion_and_answer(fn: Callable[[str, Any], float]) -> None:
    inspect.signature(fn).bind("completion", "answer")
    for clone in (pickle.loads(pickle.dumps(fn)), copy.deepcopy(fn)):
        assert clone.__name__ == fn.__name__
        assert repr(clone) == repr(fn)
        if fn is not math_answer or importlib.util.find_spec("math_verify") is not None:
            assert clone("12345", "12345") == fn("12345", "12345")


def test_length_penalty_without_a_cap_stays_finite_in_float32() -> None:
    huge = length_penalty(1, per_char=3e38, max_penalty=None)
    assert huge("x" * 100, None) == -3.4028234663852886e38

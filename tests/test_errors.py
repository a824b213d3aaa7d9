"""rlnb's errors: every error it raises on purpose is an ``RlnbError`` (and the
builtin it stands for), so that ``public_call`` can tell it from a bug by its type."""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path

import pytest

import rlnb

PACKAGE = Path(rlnb.__file__).parent

# Builtins rlnb must not raise itself: each has an RlnbError that stands for it
# (InvalidValueError, InvalidTypeError, StateError, BatchIndexError, UnknownNameError,
# WaitTimeoutError), and only RlnbErrors are shown short in a notebook.
BUILTINS = {"ValueError", "TypeError", "RuntimeError", "IndexError", "KeyError", "LookupError", "TimeoutError"}
BUILTINS_IN_STUBS = BUILTINS | {"NotImplementedError"}

# (file under rlnb/, function's qualified name, exception): why it may raise the builtin.
ALLOWED = {
    ("rewards/_isolation.py", "_Worker.request", "TimeoutError"): (
        "an internal signal: Workers.call catches it and kills the worker, never reaching a user"
    ),
}


def builtin_raises(path: Path) -> list[tuple[str, int, str]]:
    """``(qualified function name, line, builtin)`` for each ``raise Builtin(...)`` or
    ``raise Builtin`` in ``path``; a bare ``raise`` or ``raise exc`` re-raises."""
    found: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, (*scope, child.name))
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                target = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(target, ast.Name) and target.id in BUILTINS_IN_STUBS:
                    found.append((".".join(scope), child.lineno, target.id))
            visit(child, scope)

    visit(ast.parse(path.read_text(encoding="utf-8")), ())
    return found


def test_rlnb_raises_no_builtin_error_of_its_own() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for function, line, name in builtin_raises(path):
            if (relative, function, name) not in ALLOWED:
                offenders.append(f"rlnb/{relative}:{line} in {function or '<module>'}: raise {name}")
    assert not offenders, (
        "raise the RlnbError that stands for the builtin (rlnb/_errors.py: InvalidValueError, "
        "InvalidTypeError, StateError, BatchIndexError, UnknownNameError, WaitTimeoutError...) "
        "so that a notebook shows it short and `except <builtin>` still catches it:\n" + "\n".join(offenders)
    )


def test_the_scan_finds_each_form_of_a_builtin_raise(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "class A:\n"
        "    def f(self, exc):\n"
        "        raise ValueError('x')\n"
        "    def g(self):\n"
        "        try:\n"
        "            pass\n"
        "        except KeyError as exc:\n"
        "            raise exc\n"
        "        except LookupError:\n"
        "            raise\n"
        "        raise TimeoutError from None\n"
        "def h():\n"
        "    raise NotImplementedError\n"
    )
    assert builtin_raises(source) == [
        ("A.f", 3, "ValueError"),
        ("A.g", 11, "TimeoutError"),
        ("h", 13, "NotImplementedError"),
    ]


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (rlnb.InvalidValueError, ValueError),
        (rlnb.ConfigError, ValueError),
        (rlnb.InvalidTypeError, TypeError),
        (rlnb.BatchIndexError, IndexError),
        (rlnb.UnknownNameError, KeyError),
        (rlnb.UnknownNameError, LookupError),
        (rlnb.StateError, RuntimeError),
        (rlnb.WaitTimeoutError, TimeoutError),
        (rlnb.BackgroundError, RuntimeError),
        (rlnb.ClosedError, RuntimeError),
    ],
)
def test_each_error_is_caught_as_the_builtin_it_stands_for(error: type[Exception], builtin: type[Exception]) -> None:
    with pytest.raises(builtin, match="what was wrong") as raised:
        raise error("what was wrong")
    assert isinstance(raised.value, rlnb.RlnbError)


def test_an_unknown_name_reads_as_its_message_without_keyerrors_quotes() -> None:
    assert str(rlnb.UnknownNameError("no 'x' backend")) == "no 'x' backend"
    assert str(KeyError("no 'x' backend")) == "\"no 'x' backend\""  # what it would have read


def test_a_converted_error_is_still_caught_by_except_valueerror() -> None:
    try:
        rlnb.Sample("1+1=", token_ids=(1, 2), mask=(1,))
    except ValueError as exc:
        assert isinstance(exc, rlnb.InvalidValueError), type(exc)
        assert "Sample.mask has 1 entries" in str(exc)
    else:
        pytest.fail("a mask of the wrong length was accepted")


def test_every_public_error_is_an_rlnb_error() -> None:
    # LeakError fails a test (an AssertionError); Interrupted is Ctrl-C (a KeyboardInterrupt).
    not_rlnb = {rlnb.LeakError, rlnb.Interrupted, rlnb.TrainingInterrupted}
    errors = []
    for name in ("rlnb", "rlnb.data", "rlnb.envs", "rlnb.rewards", "rlnb.track", "rlnb.engines"):
        module = importlib.import_module(name)
        # rlnb.engines' lazy names are its heavy backends (vLLM, Ray): none is an error
        names = vars(module).keys() & set(module.__all__) if name == "rlnb.engines" else module.__all__
        errors += [e for e in map(functools.partial(getattr, module), names) if isinstance(e, type)]
    errors = [e for e in errors if issubclass(e, BaseException)]
    assert {e.__name__ for e in errors} >= {"EnvError", "PromptLoaderError", "IsolatedError", "PromptTooLong"}
    assert [e.__name__ for e in errors if not issubclass(e, rlnb.RlnbError) and e not in not_rlnb] == []

"""``ToolEnv``: Python functions as tools the policy calls, one call per turn or more.

A turn that calls a tool gets the tool's result back as an observation and the
conversation goes on; a turn that calls none is the final answer (the task's reward
functions score it). Two ways to write a call:

- ``syntax="call"``, for the built-in character-level policy: the whole turn is one
  Python-style call with literal arguments, ``mul(37, 48)``; the result comes back as
  text, ``=1776`` and a newline by default.
- ``syntax="json"``, for Hugging Face chat models: the calls their chat templates
  teach, Hermes/Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks or a Llama-3.1 bare ``{"name": ..., "parameters": {...}}``; each result comes
  back as a ``{"role": "tool", ...}`` message.

:func:`tool_schema` turns a function's type hints and docstring into the JSON schema a
chat template shows the model; the same hints check the arguments of every call.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import copy
import functools
import inspect
import json
import re
import threading
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, cast

from rlnb._checks import check_int
from rlnb._errors import ConfigError
from rlnb._reprs import short_repr
from rlnb.envs._protocol import Message, Turn
from rlnb.rewards import Cancelled, IsolatedError, current_scope, run_coroutine, scope_of

__all__ = ["ToolEnv", "tool_schema"]

SYNTAXES = ("call", "json")
# What a result and an error look like, per syntax (None in ToolEnv takes these).
RESULT_FORMATS = {"call": "={result}\n", "json": "{result}"}
ERROR_FORMATS = {"call": "=?\n", "json": "error: {error}"}

_JSON_TYPES: dict[Any, str] = {int: "integer", float: "number", str: "string", bool: "boolean"}
_SUPPORTED = "int, float, str, bool, list[...], dict[str, ...], Literal[...] or X | None"
_SECTION = re.compile(r"^(\w+(?: \w+)?):\s*$")
_ARG_LINE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_CALL_START = re.compile(r"^([A-Za-z_]\w*)\s*\(")
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


# --- schemas -----------------------------------------------------------------------


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``fn`` as a tool, as Hugging Face chat templates and OpenAI's
    API take it: ``{"type": "function", "function": {"name", "description",
    "parameters"}}``.

    Parameter types come from the type hints: ``int`` (integer), ``float`` (number),
    ``str``, ``bool``, ``list[X]`` (array), ``dict[str, X]`` (object), ``Literal[...]``
    (enum) and ``X | None`` (nullable, and optional). A parameter is required unless it
    has a default or is ``X | None``. The description is the docstring's first
    paragraph; a Google-style ``Args:`` section describes the parameters. A docstring
    is optional.

    Raises :class:`~rlnb.ConfigError` naming the tool and the parameter for a
    parameter without a type hint, with a hint a schema cannot describe, or for
    ``*args``/``**kwargs``.
    """
    return _Tool.of(fn, f"tool_schema({_name(fn)})").schema


class _BadCall(Exception):
    """A tool call the policy got wrong; its message becomes the error observation."""


def _annotated(fn: Any) -> Any:
    """What holds ``fn``'s annotations: the function, a partial's function, a wrapper's
    wrapped function (``rlnb.rewards.isolated``, ``functools.wraps``; its signature is
    the wrapped one's too), a class's ``__init__`` or a callable object's ``__call__``."""
    if isinstance(fn, functools.partial):
        return _annotated(fn.func)
    if not isinstance(fn, type) and callable(getattr(fn, "__wrapped__", None)):
        return _annotated(inspect.unwrap(fn))
    if inspect.isroutine(fn):
        return fn
    return cast(Any, fn).__init__ if isinstance(fn, type) else type(fn).__call__


def _type_hints(target: Any) -> dict[str, Any]:
    """``target``'s resolved type hints; when the return hint cannot be resolved (a
    class local to a function, say), the parameters' alone: a schema needs only them."""
    try:
        return typing.get_type_hints(target)
    except Exception:
        params = {k: v for k, v in getattr(target, "__annotations__", {}).items() if k != "return"}
        holder = types.SimpleNamespace(__annotations__=params)
        return typing.get_type_hints(holder, globalns=getattr(target, "__globals__", None))


def _name(fn: Any) -> str:
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


class _Tool:
    """One tool: its function, signature, hints and schema."""

    def __init__(self, fn: Callable[..., Any], name: str, signature: inspect.Signature, hints: dict[str, Any]) -> None:
        self.fn = fn
        self.name = name
        self.signature = signature
        self.hints = hints
        self.schema: dict[str, Any] = {}

    @classmethod
    def of(cls, fn: Callable[..., Any], where: str) -> _Tool:
        name = _name(fn)
        if not name.isidentifier():
            raise ConfigError(
                f"{where} is invalid: a tool needs a name the model can write, and {name!r} is not one; "
                "define it with def, e.g. def add(a: int, b: int) -> int"
            )
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where} is invalid: its signature cannot be read ({exc}); wrap it in a def") from None
        try:
            hints = _type_hints(_annotated(fn))
        except Exception as exc:  # a hint naming what its module does not define
            raise ConfigError(
                f"{where} is invalid: its type hints cannot be resolved ({type(exc).__name__}: {exc}); "
                "define the types they name where the tool is defined"
            ) from None
        tool = cls(fn, name, signature, hints)
        tool.schema = tool._make_schema(where)
        return tool

    def _example(self, fix: str) -> str:
        """The tool's def line, with ``int`` for parameter ``fix``'s hint."""
        hints = {p: int if p == fix else self.hints.get(p, int) for p in self.signature.parameters}
        returns = f" -> {_hint_text(self.hints['return'])}" if "return" in self.hints else ""
        return f"def {self.name}({', '.join(f'{p}: {_hint_text(h)}' for p, h in hints.items())}){returns}"

    def _make_schema(self, where: str) -> dict[str, Any]:
        documented = self.fn
        while isinstance(documented, functools.partial) or hasattr(documented, "__wrapped__"):
            documented = documented.func if isinstance(documented, functools.partial) else documented.__wrapped__
        description, arg_docs = _parse_docstring(inspect.getdoc(documented) or "")
        properties: dict[str, Any] = {}
        required: list[str] = []
        for param in self.signature.parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                star = "*" if param.kind is param.VAR_POSITIONAL else "**"
                raise ConfigError(
                    f"{where} is invalid: parameter {star}{param.name} cannot be described to the model; "
                    f"name each parameter, e.g. {self._example(param.name)}"
                )
            if param.name not in self.hints:
                raise ConfigError(
                    f"{where}: parameter {param.name!r} has no type hint; annotate it, e.g. {self._example(param.name)}"
                )
            hint = self.hints[param.name]
            try:
                prop = _hint_schema(hint)
            except _Unsupported:
                raise ConfigError(
                    f"{where}: parameter {param.name!r} has type hint {_hint_text(hint)}, which a tool schema "
                    f"cannot describe; use {_SUPPORTED}"
                ) from None
            if param.name in arg_docs:
                prop["description"] = arg_docs[param.name]
            properties[param.name] = prop
            if param.default is param.empty and not _nullable(hint):
                required.append(param.name)
        parameters = {"type": "object", "properties": properties, "required": required}
        return {
            "type": "function",
            "function": {"name": self.name, "description": description, "parameters": parameters},
        }

    def call(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Check the arguments against the hints, then call the tool (an ``async def``
        one runs to its end here). Raises :class:`_BadCall` for wrong arguments or a
        tool that raised."""
        try:
            bound = self.signature.bind_partial(*args, **kwargs)
            for param in self.signature.parameters.values():
                missing = param.name not in bound.arguments and param.default is param.empty
                if missing and _nullable(self.hints[param.name]):
                    bound.arguments[param.name] = None
            bound = self.signature.bind(*bound.args, **bound.kwargs)
        except TypeError as exc:
            raise _BadCall(f"{self.name}() {exc}") from None
        for arg, value in bound.arguments.items():
            try:
                bound.arguments[arg] = _convert(value, self.hints[arg])
            except _WrongType as wrong:
                where = f"{self.name}() argument {arg!r}{wrong.path}"
                raise _BadCall(f"{where} must be {wrong.expected}, got {short_repr(wrong.value)}") from None
        try:
            result = self.fn(*bound.args, **bound.kwargs)
            if inspect.isawaitable(result):
                result = _run_coroutine(result)
        except Cancelled:
            # The call's timeout stopped it (its task cancelled, its worker process
            # killed): the step fails, it is no answer for the policy to read.
            raise Cancelled(f"tool {self.name}() was stopped: it ran past its timeout, or its caller gave up") from None
        except IsolatedError:
            raise  # the tool could not run in its worker process: no call can, whatever the policy writes
        except Exception as exc:
            raise _BadCall(f"{self.name}() raised {type(exc).__name__}: {exc}") from None
        return result


class _Unsupported(Exception):
    pass


def _hint_text(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) and not typing.get_args(hint) else str(hint).replace("typing.", "")


def _nullable(hint: Any) -> bool:
    return _is_union(hint) and type(None) in typing.get_args(hint)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _hint_schema(hint: Any) -> dict[str, Any]:
    """The JSON schema of one parameter's hint; raises _Unsupported."""
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is list or origin is list:
        return {"type": "array", "items": _hint_schema(args[0])} if args else {"type": "array"}
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return {"type": "array", "items": _hint_schema(args[0])}
    if hint is dict or origin is dict:
        if not args:
            return {"type": "object"}
        if args[0] is not str:
            raise _Unsupported
        return {"type": "object", "additionalProperties": _hint_schema(args[1])}
    if origin is Literal:
        if not args or not all(type(v) in _JSON_TYPES for v in args):
            raise _Unsupported
        kinds = {_JSON_TYPES[type(v)] for v in args}
        return {"type": kinds.pop(), "enum": list(args)} if len(kinds) == 1 else {"enum": list(args)}
    if _is_union(hint):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            return {**_hint_schema(rest[0]), "nullable": True}
    raise _Unsupported


class _WrongType(Exception):
    """A value (``value``, at ``path`` inside the argument, e.g. "[1]") that is not
    ``expected`` ("an integer", ...)."""

    def __init__(self, expected: str, value: Any, path: str = "") -> None:
        super().__init__(expected)
        self.expected, self.value, self.path = expected, value, path

    def inside(self, step: str) -> _WrongType:
        return _WrongType(self.expected, self.value, step + self.path)


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "True or False"}


def _convert(value: Any, hint: Any) -> Any:
    """``value`` as the type ``hint`` names, or _WrongType. Strict: a string is never
    parsed, a bool is no number; the only conversions are lossless (an int for a float,
    a tuple for a list)."""
    if hint in _KIND_NAMES:
        if hint is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if type(value) is not hint:
            raise _WrongType(_KIND_NAMES[hint], value)
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is list or origin is list or origin is tuple:
        if not isinstance(value, list | tuple):
            raise _WrongType("a list", value)
        items = list(value)
        for i, item in enumerate(items if args else ()):
            try:
                items[i] = _convert(item, args[0])
            except _WrongType as wrong:
                raise wrong.inside(f"[{i}]") from None
        return tuple(items) if origin is tuple else items
    if hint is dict or origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _WrongType("an object with string keys", value)
        converted = dict(value)
        for key, item in converted.items() if args else ():
            try:
                converted[key] = _convert(item, args[1])
            except _WrongType as wrong:
                raise wrong.inside(f"[{key!r}]") from None
        return converted
    if origin is Literal:
        if not any(type(value) is type(v) and value == v for v in args):
            raise _WrongType("one of " + ", ".join(map(repr, args)), value)
        return value
    if _is_union(hint):  # X | None
        if value is None:
            return None
        inner = next(a for a in args if a is not type(None))
        try:
            return _convert(value, inner)
        except _WrongType as wrong:
            raise (_WrongType(f"{wrong.expected} or None", value) if not wrong.path else wrong) from None
    raise _WrongType(_hint_text(hint), value)  # pragma: no cover (schemas admit no other hint)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The first paragraph, and the parameter descriptions of a Google-style ``Args:``."""
    lines = doc.splitlines()
    description: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line.strip()):
            break
        description.append(line.strip())
    args: dict[str, str] = {}
    in_args, arg_indent, current = False, 0, None
    for line in lines:
        stripped, indent = line.strip(), len(line) - len(line.lstrip())
        if not stripped:
            continue
        if indent == 0 and (section := _SECTION.match(stripped)):
            in_args = section.group(1) in ("Args", "Arguments", "Parameters", "Params")
            arg_indent, current = 0, None
            continue
        if not in_args or indent == 0:
            in_args = in_args and indent > 0
            continue
        arg_indent = arg_indent or indent
        match = _ARG_LINE.match(stripped)
        if indent == arg_indent and match:
            current = match.group(1)
            args[current] = match.group(2).strip()
        elif current is not None and indent > arg_indent:
            args[current] = f"{args[current]} {stripped}".strip()
    return " ".join(description), args


def _run_coroutine(awaitable: Any) -> Any:
    """Run an ``async def`` tool's coroutine to its end on an event loop of its own,
    closed before this returns (on a thread of its own when this thread already runs a
    loop, as a notebook's does). In a rollout it runs as a task that the call's timeout
    cancels (:class:`~rlnb.rewards.Cancelled`), so a tool that never returns leaves no
    loop, thread or FD behind."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run_coroutine(awaitable)
    scope = current_scope()  # the helper thread runs the call as this thread's: the same timeout stops it
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            with scope_of(scope) if scope is not None else contextlib.nullcontext():
                box["value"] = run_coroutine(awaitable)
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="rlnb-tool")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


# --- the environment ---------------------------------------------------------------


class ToolEnv:
    """An environment whose tools are Python functions, and its own factory: a task
    takes it as ``env=ToolEnv([mul])``, and ``ToolEnv.__call__()`` gives each sample a
    fresh copy (the copies share the tool functions, so a tool must keep no state of
    one conversation).

    tools: the functions, each with type hints on every parameter (see
        :func:`tool_schema`); a docstring is optional. ``async def`` tools run on an
        event loop of their own, as a task that ``RolloutConfig.reward_timeout``
        cancels; a tool marked :func:`rlnb.rewards.isolated` runs in a worker process
        that the timeout kills (it may hold the GIL). A tool stopped so fails the
        sample; a plain one cannot be stopped.
    syntax: how the policy writes a call. ``"call"`` (for the built-in policy): the
        whole turn, stripped, is one call ``name(arg, ..., key=arg)`` with Python literal
        arguments. ``"json"`` (for Hugging Face chat models): one or more Hermes/Qwen
        ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in
        the turn, or the whole turn one Llama-3.1 ``{"name": ..., "parameters": {...}}``
        (or a JSON list of them). A turn without a call is the final answer: the
        conversation ends there.
    result_format: ``syntax="call"``'s observation for a result, ``"={result}\\n"`` by
        default; ``syntax="json"`` puts ``result_format`` (default ``"{result}"``) in a
        ``{"role": "tool", "name": ..., "content": ...}`` message per call. A result
        that is not a string is written with ``str()`` (``"call"``) or as JSON
        (``"json"``).
    error_format: the observation for a call that failed: malformed, an unknown tool,
        arguments missing, extra or of the wrong type, or a tool that raised. The
        conversation goes on, so the policy may try again. ``"=?\\n"`` for
        ``syntax="call"`` (a character-level policy cannot read the reason, and its
        alphabet could not write it); pass ``error_format="error: {error}\\n"`` to see
        it. ``"error: {error}"`` for ``syntax="json"``, e.g. ``error: mul() missing a
        required argument: 'b'``.
    max_result_chars: results and error messages longer than this are cut to it (with
        "…" after, for ``syntax="json"``); None: no limit.

    Arguments are checked against the hints strictly: a string is never parsed as a
    number (``mul("3", 4)`` is an error), a bool is not an int, and the only conversions
    are an int where a float is wanted and a tuple or list for a list.

    With the built-in policy, the task's ``alphabet`` must hold every character of the
    observations, the formats' (by default ``=``, ``?`` and the newline) and the
    results' (for ``mul``: digits and ``-``), as well as those of the calls (the
    letters of the tool names, ``(``, ``,`` and ``)``).

    Raises :class:`~rlnb.ConfigError` naming the field and the fix: no tools, a tool
    that is not a function, two tools of one name, a parameter without a type hint, an
    unknown syntax, a format with other fields than ``{result}``/``{error}``.
    ``step`` blocks while a tool runs, and raises nothing for a bad call.
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]],
        *,
        syntax: Literal["call", "json"] = "call",
        result_format: str | None = None,
        error_format: str | None = None,
        max_result_chars: int | None = 200,
    ) -> None:
        if syntax not in SYNTAXES:
            raise ConfigError(
                f"ToolEnv.syntax={short_repr(syntax)} is invalid: use 'call' (one Python-style call per turn, "
                "for the built-in policy) or 'json' (the tool calls of Hugging Face chat templates)"
            )
        if isinstance(tools, str | bytes) or not isinstance(tools, Sequence) or not tools:
            example = f"[{_name(tools)}]" if callable(tools) else "[add, mul]"
            raise ConfigError(
                f"ToolEnv.tools={short_repr(tools)} is invalid: pass a non-empty list of functions, e.g. "
                f"ToolEnv(tools={example})"
            )
        by_name: dict[str, _Tool] = {}
        for i, fn in enumerate(tools):
            where = f"ToolEnv.tools[{i}]={short_repr(fn) if not callable(fn) else _name(fn)}"
            if not callable(fn):
                raise ConfigError(f"{where} is invalid: a tool is a function, e.g. def add(a: int, b: int) -> int")
            tool = _Tool.of(fn, where)
            if tool.name in by_name:
                first = next(j for j, other in enumerate(tools) if _name(other) == tool.name)
                raise ConfigError(
                    f"{where} is invalid: tools[{first}] is named {tool.name!r} too; the model calls tools by "
                    "name, so give each a name of its own"
                )
            by_name[tool.name] = tool
        formats = {}
        for field, given, defaults, key in (
            ("result_format", result_format, RESULT_FORMATS, "result"),
            ("error_format", error_format, ERROR_FORMATS, "error"),
        ):
            fmt = defaults[syntax] if given is None else given
            try:
                ok = isinstance(fmt, str) and isinstance(fmt.format(**{key: ""}), str)
            except (KeyError, IndexError, ValueError):
                ok = False
            if not ok:
                raise ConfigError(
                    f"ToolEnv.{field}={short_repr(given)} is invalid: use a string whose only field is "
                    f"{{{key}}}, e.g. {defaults[syntax]!r} (double a literal brace: {{{{ }}}})"
                )
            formats[field] = fmt
        check_int("ToolEnv.max_result_chars", max_result_chars, minimum=1, optional=True, example=200)
        self.syntax: str = syntax
        self.result_format: str = formats["result_format"]
        self.error_format: str = formats["error_format"]
        self.max_result_chars = max_result_chars
        self._tools = by_name
        self.tools: list[dict[str, Any]] = [copy.deepcopy(t.schema) for t in by_name.values()]
        self.calls = 0  # tool calls this conversation, bad ones included
        self.errors = 0  # of which failed

    def __call__(self) -> ToolEnv:
        """A fresh copy, for one conversation (this makes a ToolEnv a task's factory)."""
        fresh = copy.copy(self)
        fresh.tools = copy.deepcopy(self.tools)
        fresh.calls = fresh.errors = 0
        return fresh

    def __repr__(self) -> str:
        return f"ToolEnv(tools=[{', '.join(self._tools)}], syntax={self.syntax!r})"

    def reset(self, row: Mapping[str, Any]) -> None:
        """Start a conversation: the task's prompt stands (returns None)."""
        self.calls = self.errors = 0

    def step(self, completion: str) -> Turn:
        """Run the tool calls in ``completion`` (blocks while they run): their results
        (or errors) as the observation; a turn without a call ends the conversation."""
        if self.syntax == "call":
            return self._step_call(completion)
        return self._step_json(completion)

    def _clip(self, text: str) -> str:
        limit = self.max_result_chars
        if limit is None or len(text) <= limit:
            return text
        return text[:limit] + ("…" if self.syntax == "json" else "")

    def _run(self, name: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[bool, str]:
        """Call tool ``name``: (True, its result as text) or (False, the error)."""
        self.calls += 1
        try:
            tool = self._tools.get(name) if isinstance(name, str) else None
            if tool is None:
                raise _BadCall(f"unknown tool {short_repr(name)}; the tools are {', '.join(self._tools)}")
            result = tool.call(args, kwargs)
            if not isinstance(result, str):
                result = _as_text(result, self.syntax)
        except _BadCall as bad:
            self.errors += 1
            return False, self._clip(str(bad))
        return True, self._clip(result)

    def _text(self, ok: bool, text: str) -> str:
        return self.result_format.format(result=text) if ok else self.error_format.format(error=text)

    def _step_call(self, completion: str) -> Turn:
        text = completion.strip()
        start = _CALL_START.match(text)
        if start is None:
            return Turn(done=True)
        try:
            name, args, kwargs = _parse_call(text)
        except SyntaxError as exc:
            if start.group(1) not in self._tools:
                return Turn(done=True)  # it only looks like a call of something that is no tool
            self.calls += 1
            self.errors += 1
            return Turn(observation=self._text(False, self._clip(f"{start.group(1)}(...) does not parse: {exc.msg}")))
        return Turn(observation=self._text(*self._run(name, args, kwargs)))

    def _step_json(self, completion: str) -> Turn:
        calls = _json_calls(completion)
        if calls is None:
            return Turn(done=True)
        messages: list[Message] = []
        for name, arguments, error in calls:
            if error is not None:  # a block that is not a call
                self.calls += 1
                self.errors += 1
                ok, text = False, self._clip(error)
            else:
                ok, text = self._run(name, (), arguments)
            named = {"name": name} if isinstance(name, str) else {}
            messages.append({"role": "tool", **named, "content": self._text(ok, text)})
        return Turn(observation=messages)


def _as_text(value: Any, syntax: str) -> str:
    """A tool's result that is not a string: ``str()`` for the call syntax, JSON (or
    ``str()`` where JSON cannot write it) for chat models. _BadCall when neither can."""
    try:
        if syntax == "json":
            try:
                return json.dumps(value, ensure_ascii=False)
            except (TypeError, ValueError, RecursionError):
                pass
        return str(value)
    except Exception as exc:
        raise _BadCall(f"the result {type(value).__name__} cannot be written as text ({exc!r})") from None


def _parse_call(text: str) -> tuple[str, list[Any], dict[str, Any]]:
    """``name(arg, key=arg)`` with literal arguments, or SyntaxError saying why not."""
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError as exc:
        raise SyntaxError(exc.msg) from None
    except (ValueError, RecursionError, MemoryError) as exc:  # a null character; nesting too deep
        raise SyntaxError(f"{type(exc).__name__}: {exc}") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise SyntaxError("the turn is more than one call")
    args, kwargs = [], {}
    for i, arg in enumerate(node.args):
        if isinstance(arg, ast.Starred):
            raise SyntaxError("*args cannot be used in a tool call")
        args.append(_literal(arg, f"argument {i + 1}"))
    for keyword in node.keywords:
        if keyword.arg is None:
            raise SyntaxError("**kwargs cannot be used in a tool call")
        kwargs[keyword.arg] = _literal(keyword.value, f"argument {keyword.arg!r}")
    return node.func.id, args, kwargs


def _literal(node: ast.expr, what: str) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise SyntaxError(f"{what} is not a literal ({ast.unparse(node)})") from None


# A chat model's tool call: (name, arguments, None), or (name or None, {}, why it is none).
_JsonCall = tuple[Any, dict[str, Any], str | None]


def _json_calls(completion: str) -> list[_JsonCall] | None:
    """The tool calls in a chat model's turn; None for a turn without a call."""
    if "<tool_call>" in completion:
        return [_json_call(block) for block in _TOOL_CALL_BLOCK.findall(completion)]
    text = completion.strip().removeprefix("<|python_tag|>").strip()
    if not text.startswith(("{", "[")):
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None  # the answer is text that happens to start with a brace
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(item, dict) and "name" in item for item in items):
        return None  # JSON, but not calls: an answer
    return [_json_call(item) for item in items]


def _json_call(block: str | dict[str, Any]) -> _JsonCall:
    if isinstance(block, str):
        try:
            block = json.loads(block)
        except (ValueError, RecursionError) as exc:
            return None, {}, f"the tool call is not valid JSON ({exc})"
    if not isinstance(block, dict) or "name" not in block:
        return None, {}, 'a tool call is {"name": ..., "arguments": {...}}'
    name = block["name"]
    arguments = block.get("arguments", block.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            return name, {}, f"{name}() arguments are not valid JSON ({exc})"
    if not isinstance(arguments, dict):
        return name, {}, f"{name}() arguments must be a JSON object, got {short_repr(arguments)}"
    return name, arguments, None

"""A Python function as a tool: the JSON schema a chat template shows the model (from
its type hints and docstring), and its calls, whose arguments the same hints check
strictly before the function runs (``async def`` ones to their end).

:func:`tool_schema` is public (``rlnb.envs.tool_schema``); :class:`Tool` and
:class:`BadCall` are what :class:`~rlnb.envs.ToolEnv` calls and catches.
"""

from __future__ import annotations

import functools
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, cast

from rlnb._errors import ConfigError
from rlnb._reprs import short_repr
from rlnb.rewards import Cancelled, IsolatedError, run_coroutine

__all__ = ["BadCall", "Tool", "tool_name", "tool_schema"]

_JSON_TYPES: dict[Any, str] = {int: "integer", float: "number", str: "string", bool: "boolean"}
_SUPPORTED = "int, float, str, bool, list[...], dict[str, ...], Literal[...] or X | None"
_SECTION = re.compile(r"^(\w+(?: \w+)?):\s*$")
_ARG_LINE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


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
    return Tool.of(fn, f"tool_schema({tool_name(fn)})").schema


class BadCall(Exception):
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


def tool_name(fn: Any) -> str:
    """The name a tool is called by: its function's ``__name__`` (a partial's function's), or its type's."""
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


class Tool:
    """One tool: its function, signature, hints and schema."""

    def __init__(self, fn: Callable[..., Any], name: str, signature: inspect.Signature, hints: dict[str, Any]) -> None:
        self.fn = fn
        self.name = name
        self.signature = signature
        self.hints = hints
        self.schema: dict[str, Any] = {}

    @classmethod
    def of(cls, fn: Callable[..., Any], where: str) -> Tool:
        name = tool_name(fn)
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
        one runs to its end here). Raises :class:`BadCall` for wrong arguments or a
        tool that raised."""
        try:
            bound = self.signature.bind_partial(*args, **kwargs)
            for param in self.signature.parameters.values():
                missing = param.name not in bound.arguments and param.default is param.empty
                if missing and _nullable(self.hints[param.name]):
                    bound.arguments[param.name] = None
            bound = self.signature.bind(*bound.args, **bound.kwargs)
        except TypeError as exc:
            raise BadCall(f"{self.name}() {exc}") from None
        for arg, value in bound.arguments.items():
            try:
                bound.arguments[arg] = _convert(value, self.hints[arg])
            except _WrongType as wrong:
                where = f"{self.name}() argument {arg!r}{wrong.path}"
                raise BadCall(f"{where} must be {wrong.expected}, got {short_repr(wrong.value)}") from None
        try:
            result = self.fn(*bound.args, **bound.kwargs)
            if inspect.isawaitable(result):
                result = run_coroutine(result)  # on a thread of its own under a running loop
        except Cancelled:
            # The call's timeout stopped it (its task cancelled, its worker process
            # killed): the step fails, it is no answer for the policy to read.
            raise Cancelled(f"tool {self.name}() was stopped: it ran past its timeout, or its caller gave up") from None
        except IsolatedError:
            raise  # the tool could not run in its worker process: no call can, whatever the policy writes
        except Exception as exc:
            raise BadCall(f"{self.name}() raised {type(exc).__name__}: {exc}") from None
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

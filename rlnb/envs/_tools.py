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

:func:`~rlnb.envs.tool_schema` (``_tool_schema.py``) turns a function's type hints and
docstring into the JSON schema a chat template shows the model; the same hints check
the arguments of every call.
"""

from __future__ import annotations

import ast
import copy
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from rlnb._checks import check_int
from rlnb._errors import ConfigError
from rlnb._reprs import short_repr
from rlnb.envs._protocol import Message, Turn
from rlnb.envs._tool_schema import BadCall, Tool, tool_name

__all__ = ["ToolEnv", "tool_calls"]

SYNTAXES = ("call", "json")
# What a result and an error look like, per syntax (None in ToolEnv takes these).
RESULT_FORMATS = {"call": "={result}\n", "json": "{result}"}
ERROR_FORMATS = {"call": "=?\n", "json": "error: {error}"}

_CALL_START = re.compile(r"^([A-Za-z_]\w*)\s*\(")
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


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
            example = f"[{tool_name(tools)}]" if callable(tools) else "[add, mul]"
            raise ConfigError(
                f"ToolEnv.tools={short_repr(tools)} is invalid: pass a non-empty list of functions, e.g. "
                f"ToolEnv(tools={example})"
            )
        by_name: dict[str, Tool] = {}
        for i, fn in enumerate(tools):
            where = f"ToolEnv.tools[{i}]={short_repr(fn) if not callable(fn) else tool_name(fn)}"
            if not callable(fn):
                raise ConfigError(f"{where} is invalid: a tool is a function, e.g. def add(a: int, b: int) -> int")
            tool = Tool.of(fn, where)
            if tool.name in by_name:
                first = next(j for j, other in enumerate(tools) if tool_name(other) == tool.name)
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
                raise BadCall(f"unknown tool {short_repr(name)}; the tools are {', '.join(self._tools)}")
            result = tool.call(args, kwargs)
            if not isinstance(result, str):
                result = _as_text(result, self.syntax)
        except BadCall as bad:
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
    ``str()`` where JSON cannot write it) for chat models. BadCall when neither can."""
    try:
        if syntax == "json":
            try:
                return json.dumps(value, ensure_ascii=False)
            except (TypeError, ValueError, RecursionError):
                pass
        return str(value)
    except Exception as exc:
        raise BadCall(f"the result {type(value).__name__} cannot be written as text ({exc!r})") from None


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


# --- a turn's calls, for the endpoint ---------------------------------------------------


def tool_calls(
    text: str, *, syntax: str, tools: Sequence[Mapping[str, Any]] = ()
) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """A policy turn ``text`` split into what it says and the well-formed tool calls it
    makes, ``(content, [(name, arguments), ...])``, read in ``syntax`` as
    :class:`ToolEnv` reads it: ``"json"``, Hermes/Qwen ``<tool_call>`` blocks (the
    content is the text around them) or a whole turn of Llama-3.1 JSON; ``"call"``, the
    whole turn one ``name(arg, key=arg)`` call of one of ``tools`` (JSON schemas), its
    positional arguments named after the tool's parameters in order. A turn with no
    call, or with a malformed one, is all content: ``(text, [])``."""
    if syntax == "json":
        calls = [(name, args) for name, args, why in _json_calls(text) or [] if why is None]
        if not calls:
            return text, []
        content = _TOOL_CALL_BLOCK.sub("", text).strip() if "<tool_call>" in text else ""
        return content, calls
    try:
        name, args, kwargs = _parse_call(text.strip())
    except SyntaxError:
        return text, []
    schema = next((t for t in tools if _schema_name(t) == name), None)
    params = list(_schema_parameters(schema or {}))
    if schema is None or len(args) > len(params):
        return text, []
    return "", [(name, {**dict(zip(params, args, strict=False)), **kwargs})]


def _schema_name(schema: Mapping[str, Any]) -> Any:
    function = schema.get("function", schema)
    return function.get("name") if isinstance(function, Mapping) else None


def _schema_parameters(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    function = schema.get("function", schema)
    parameters = function.get("parameters", {}) if isinstance(function, Mapping) else {}
    properties = parameters.get("properties", {}) if isinstance(parameters, Mapping) else {}
    return properties if isinstance(properties, Mapping) else {}

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import Any, Literal

import pytest

from rlnb import ConfigError
from rlnb.envs import ToolEnv, tool_schema
from rlnb.envs._episode import Episode, check_factory
from rlnb.envs._protocol import Turn

VERBOSE = "error: {error}\n"  # the call syntax's errors, with their reason


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b (int): the second factor,
            a whole number.

    Returns:
        The product.
    """
    return a * b


def div(a: float, b: float) -> float:
    return a / b


def echo(text: str, times: int = 1, sep: str | None = None) -> str:
    return (sep or "").join([text] * times)


def test_schema_from_hints_and_google_docstring() -> None:
    assert tool_schema(mul) == {
        "type": "function",
        "function": {
            "name": "mul",
            "description": "Multiply two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first factor"},
                    "b": {"type": "integer", "description": "the second factor, a whole number."},
                },
                "required": ["a", "b"],
            },
        },
    }


def test_schema_without_docstring_and_with_defaults() -> None:
    function = tool_schema(echo)["function"]
    assert function["description"] == ""
    assert function["parameters"] == {
        "type": "object",
        "properties": {
            "text": {"type": "string"},
            "times": {"type": "integer"},
            "sep": {"type": "string", "nullable": True},
        },
        "required": ["text"],
    }


def test_schema_description_is_the_first_paragraph_only() -> None:
    def look(query: str) -> str:
        """Look a word up
        in the dictionary.

        More detail that the model need not read.
        """
        return query

    assert tool_schema(look)["function"]["description"] == "Look a word up in the dictionary."


@pytest.mark.parametrize(
    ("hint", "schema"),
    [
        (int, {"type": "integer"}),
        (float, {"type": "number"}),
        (str, {"type": "string"}),
        (bool, {"type": "boolean"}),
        (list[int], {"type": "array", "items": {"type": "integer"}}),
        (list, {"type": "array"}),
        (tuple[str, ...], {"type": "array", "items": {"type": "string"}}),
        (dict, {"type": "object"}),
        (dict[str, float], {"type": "object", "additionalProperties": {"type": "number"}}),
        (Literal["add", "sub"], {"type": "string", "enum": ["add", "sub"]}),
        (Literal[1, 2], {"type": "integer", "enum": [1, 2]}),
        (int | None, {"type": "integer", "nullable": True}),
        (list[list[int]], {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}),
    ],
)
def test_schema_types(hint: Any, schema: dict[str, Any]) -> None:
    def tool(x: int) -> None: ...

    tool.__annotations__ = {"x": hint}
    assert tool_schema(tool)["function"]["parameters"]["properties"]["x"] == schema


def test_schema_of_a_partial_a_class_and_a_callable_object() -> None:
    assert tool_schema(functools.partial(mul, 3))["function"]["parameters"]["required"] == ["b"]
    assert tool_schema(functools.partial(mul, 3))["function"]["description"] == "Multiply two integers."

    class Scale:
        """Scale a number."""

        def __call__(self, x: float) -> float:
            return 2 * x

    assert tool_schema(Scale())["function"]["name"] == "Scale"
    assert tool_schema(Scale())["function"]["parameters"]["properties"] == {"x": {"type": "number"}}


def _no_hint(a: int, b):  # b has no hint, on purpose
    return a + b


def _set_hint(items: set[int]) -> int:
    return len(items)


def _star(*numbers: int) -> int:
    return sum(numbers)


def _union(x: int | str) -> str:
    return str(x)


def _dict_int_keys(x: dict[int, int]) -> int:
    return len(x)


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        (_no_hint, ["tool_schema(_no_hint)", "parameter 'b' has no type hint", "def _no_hint(a: int, b: int)"]),
        (_set_hint, ["parameter 'items'", "set[int]", "cannot describe", "Literal"]),
        (_star, ["*numbers", "name each parameter"]),
        (_union, ["parameter 'x'", "int | str"]),
        (_dict_int_keys, ["parameter 'x'", "dict[int, int]"]),
        (lambda x: x, ["'<lambda>'", "define it with def"]),
    ],
)
def test_schema_errors_name_the_tool_the_parameter_and_the_fix(fn: Callable[..., Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        tool_schema(fn)
    for word in words:
        assert word in str(info.value)


def test_schema_error_for_a_hint_that_cannot_be_resolved() -> None:
    def tool(x: Missing) -> int:  # type: ignore[name-defined]  # noqa: F821
        return 0

    with pytest.raises(ConfigError, match=r"tool_schema\(tool\) is invalid: its type hints cannot be resolved"):
        tool_schema(tool)


# --- construction ------------------------------------------------------------------


def _other_mul(x: int) -> int:
    return x


_other_mul.__name__ = "mul"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"tools": []}, ["ToolEnv.tools=[]", "non-empty list of functions"]),
        ({"tools": mul}, ["ToolEnv.tools=", "ToolEnv(tools=[mul])"]),
        ({"tools": [mul, 3]}, ["ToolEnv.tools[1]=3", "a tool is a function"]),
        ({"tools": [mul, _other_mul]}, ["ToolEnv.tools[1]=mul", "tools[0] is named 'mul' too"]),
        ({"tools": [mul, _no_hint]}, ["ToolEnv.tools[1]=_no_hint: parameter 'b' has no type hint", "b: int"]),
        ({"tools": [mul], "syntax": "xml"}, ["ToolEnv.syntax='xml'", "'call'", "'json'"]),
        ({"tools": [mul], "result_format": "{value}"}, ["ToolEnv.result_format='{value}'", "{result}"]),
        ({"tools": [mul], "error_format": "{"}, ["ToolEnv.error_format='{'", "{error}"]),
        ({"tools": [mul], "error_format": 3}, ["ToolEnv.error_format=3"]),
        ({"tools": [mul], "max_result_chars": 0}, ["ToolEnv.max_result_chars=0", "int >= 1"]),
    ],
)
def test_construction_errors_name_the_field_and_the_fix(kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        ToolEnv(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_a_tool_env_is_its_own_factory_and_its_copies_are_independent() -> None:
    factory = ToolEnv([mul, div])
    check_factory(factory)
    first, second = factory(), factory()
    assert first is not factory and first is not second
    assert first.tools == second.tools == [tool_schema(mul), tool_schema(div)]
    first.tools[0]["function"]["name"] = "changed"
    assert second.tools[0]["function"]["name"] == "mul" and factory.tools[0]["function"]["name"] == "mul"
    assert first.reset({"prompt": "37*48=", "answer": "1776", "prompt_id": 0}) is None
    first.step("mul(1,2)")
    first.step("div(1,0)")
    assert (first.calls, first.errors) == (2, 1)
    assert (second.calls, second.errors) == (0, 0)
    assert (factory().calls, factory.calls) == (0, 0)
    assert repr(factory) == "ToolEnv(tools=[mul, div], syntax='call')"


# --- syntax="call" -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("turn", "observation"),
    [
        ("mul(37,48)", "=1776\n"),
        ("  mul(37, 48)\n", "=1776\n"),
        ("mul(37, b=48)", "=1776\n"),
        ("mul(a=-2, b=3)", "=-6\n"),
        ("div(1, 4)", "=0.25\n"),  # an int where a float is wanted
        ("echo('ab', 2, sep='-')", "=ab-ab\n"),
        ("echo('ab')", "=ab\n"),  # sep: an X | None without default gets None
    ],
)
def test_call_syntax_runs_the_call(turn: str, observation: str) -> None:
    env = ToolEnv([mul, div, echo])()
    assert env.step(turn) == Turn(observation=observation)


@pytest.mark.parametrize("turn", ["1776", "", "  ", "the answer is mul(1, 2)", "f(x)", "1776 mul(2,3)", "(1, 2)"])
def test_call_syntax_a_turn_without_a_call_is_the_final_answer(turn: str) -> None:
    env = ToolEnv([mul])()
    assert env.step(turn) == Turn(done=True)
    assert env.calls == 0


@pytest.mark.parametrize(
    ("turn", "error"),
    [
        ("mul(37,48", "mul(...) does not parse: '(' was never closed"),
        ("mul(37,48) mul(1,2)", "mul(...) does not parse: invalid syntax"),
        ("mul(x, 1)", "mul(...) does not parse: argument 1 is not a literal (x)"),
        ("mul(1, *[2])", "mul(...) does not parse: *args cannot be used in a tool call"),
        ("mul(37)", "mul() missing a required argument: 'b'"),
        ("mul(1, 2, 3)", "mul() too many positional arguments"),
        ("mul(1, c=2)", "mul() got an unexpected keyword argument 'c'"),
        ("mul('3', 4)", "mul() argument 'a' must be an integer, got '3'"),
        ("mul(True, 4)", "mul() argument 'a' must be an integer, got True"),
        ("mul(3.0, 4)", "mul() argument 'a' must be an integer, got 3.0"),
        ("div(1, 0)", "div() raised ZeroDivisionError: float division by zero"),
        ("add(1, 2)", "unknown tool 'add'; the tools are mul, div"),
    ],
)
def test_call_syntax_a_bad_call_is_an_error_observation(turn: str, error: str) -> None:
    env = ToolEnv([mul, div], error_format=VERBOSE)()
    assert env.step(turn) == Turn(observation=f"error: {error}\n")
    assert (env.calls, env.errors) == (1, 1)
    assert ToolEnv([mul, div])().step(turn) == Turn(observation="=?\n")  # the default: no letters


def test_arguments_are_checked_against_nested_hints() -> None:
    def total(xs: list[int], mode: Literal["sum", "max"] = "sum", weights: dict[str, float] | None = None) -> int:
        return sum(xs) if mode == "sum" else max(xs)

    env = ToolEnv([total], error_format=VERBOSE)()
    assert env.step("total([1, 2, 3])").observation == "=6\n"
    assert env.step("total((1, 2), mode='max')").observation == "=2\n"
    assert env.step("total([1], weights={'a': 1})").observation == "=1\n"
    assert env.step("total([1, '2'])").observation == "error: total() argument 'xs'[1] must be an integer, got '2'\n"
    assert env.step("total(1)").observation == "error: total() argument 'xs' must be a list, got 1\n"
    assert env.step("total([1], mode='min')").observation == (
        "error: total() argument 'mode' must be one of 'sum', 'max', got 'min'\n"
    )
    assert env.step("total([1], weights=[1])").observation == (
        "error: total() argument 'weights' must be an object with string keys or None, got [1]\n"
    )


def test_formats_and_clipping() -> None:
    def long(n: int) -> str:
        return "7" * n

    env = ToolEnv([long], result_format="<{result}>", max_result_chars=5)()
    assert env.step("long(3)").observation == "<777>"
    assert env.step("long(9)").observation == "<77777>"
    assert ToolEnv([long], max_result_chars=None)().step("long(300)").observation == "=" + "7" * 300 + "\n"
    clipped = ToolEnv([long], error_format=VERBOSE, max_result_chars=12)().step("long('x')").observation
    assert clipped == "error: long() argum\n"


def test_an_async_tool_runs_to_its_end_also_inside_a_running_loop() -> None:
    async def slow_add(a: int, b: int) -> int:
        await asyncio.sleep(0.01)
        return a + b

    env = ToolEnv([slow_add])()
    assert env.step("slow_add(2, 3)").observation == "=5\n"

    async def inside_a_loop() -> Turn:  # as a notebook cell runs
        return env.step("slow_add(4, 5)")

    assert asyncio.run(inside_a_loop()).observation == "=9\n"


# --- syntax="json" -----------------------------------------------------------------


def _hermes(name: str, arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_json_syntax_hermes_blocks_each_get_a_tool_message() -> None:
    env = ToolEnv([mul, div], syntax="json")()
    turn = f"I will multiply, then divide.\n{_hermes('mul', {'a': 37, 'b': 48})}\n{_hermes('div', {'a': 1, 'b': 4})}"
    assert env.step(turn) == Turn(
        observation=[
            {"role": "tool", "name": "mul", "content": "1776"},
            {"role": "tool", "name": "div", "content": "0.25"},
        ]
    )
    assert env.calls == 2


@pytest.mark.parametrize(
    "turn",
    [
        '{"name": "mul", "parameters": {"a": 6, "b": 7}}',  # Llama 3.1
        '<|python_tag|>{"name": "mul", "parameters": {"a": 6, "b": 7}}',
        '{"name": "mul", "arguments": "{\\"a\\": 6, \\"b\\": 7}"}',  # arguments as a JSON string
        '<tool_call>{"name": "mul", "arguments": {"a": 6, "b": 7}}',  # stopped before </tool_call>
    ],
)
def test_json_syntax_other_ways_to_write_one_call(turn: str) -> None:
    assert ToolEnv([mul], syntax="json")().step(turn).observation == [{"role": "tool", "name": "mul", "content": "42"}]


def test_json_syntax_a_list_of_calls() -> None:
    turn = '[{"name": "mul", "parameters": {"a": 2, "b": 3}}, {"name": "mul", "parameters": {"a": 4, "b": 5}}]'
    observation = ToolEnv([mul], syntax="json")().step(turn).observation
    assert observation == [
        {"role": "tool", "name": "mul", "content": "6"},
        {"role": "tool", "name": "mul", "content": "20"},
    ]


@pytest.mark.parametrize(
    "turn", ["The product is 1776.", "", '{"answer": 1776}', "[1, 2]", "{not json", "[]", "mul(1, 2)"]
)
def test_json_syntax_a_turn_without_a_call_is_the_final_answer(turn: str) -> None:
    assert ToolEnv([mul], syntax="json")().step(turn) == Turn(done=True)


@pytest.mark.parametrize(
    ("turn", "name", "error"),
    [
        (_hermes("mul", {"a": 3}), "mul", "mul() missing a required argument: 'b'"),
        (_hermes("mul", {"a": "3", "b": 4}), "mul", "mul() argument 'a' must be an integer, got '3'"),
        (_hermes("pow", {"a": 3}), "pow", "unknown tool 'pow'; the tools are mul, div"),
        (_hermes("div", {"a": 3, "b": 0}), "div", "div() raised ZeroDivisionError: float division by zero"),
        (_hermes("mul", [3, 4]), "mul", "mul() arguments must be a JSON object, got [3, 4]"),
        ('{"name": "mul", "arguments": "{a: 3}"}', "mul", "mul() arguments are not valid JSON"),
        ('<tool_call>{"name": "mul", "arguments": {"a": 3,}}</tool_call>', None, "the tool call is not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', None, 'a tool call is {"name": ..., "arguments": {...}}'),
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', None, "unknown tool 3; the tools are mul, div"),
    ],
)
def test_json_syntax_a_bad_call_is_an_error_message(turn: str, name: str | None, error: str) -> None:
    env = ToolEnv([mul, div], syntax="json")()
    observation = env.step(turn).observation
    assert isinstance(observation, list) and len(observation) == 1
    message = dict(observation[0])
    assert message.pop("role") == "tool"
    assert message.get("name") == name
    assert message["content"].startswith(f"error: {error}")
    assert (env.calls, env.errors) == (1, 1)


def test_json_syntax_results_that_are_not_text_are_json_and_long_ones_are_clipped() -> None:
    def lookup(key: str) -> dict[str, Any]:
        return {"key": key, "found": True, "values": [1, 2]}

    env = ToolEnv([lookup], syntax="json", max_result_chars=20)()
    observation = env.step(_hermes("lookup", {"key": "a"})).observation
    assert observation == [{"role": "tool", "name": "lookup", "content": '{"key": "a", "found"…'}]


# --- through the protocol ----------------------------------------------------------


def test_a_tool_env_fits_the_protocol_through_an_episode() -> None:
    episode = Episode(ToolEnv([mul]))
    try:
        assert episode.tools == [tool_schema(mul)]
        assert episode.reset({"prompt": "37*48=", "answer": "1776", "prompt_id": 3}) is None
        assert episode.step("mul(37,48)") == Turn(observation="=1776\n")
        assert episode.step("1776") == Turn(done=True)
        assert episode.turns == 2 and episode.reward is None
    finally:
        episode.close()

    episode = Episode(ToolEnv([mul], syntax="json"))
    try:
        episode.reset({"prompt": "37*48=", "answer": "1776", "prompt_id": 3})
        turn = episode.step(_hermes("mul", {"a": 37, "b": 48}))
        assert turn.observation == [{"role": "tool", "name": "mul", "content": "1776"}] and not turn.done
    finally:
        episode.close()


def test_input_nested_too_deep_is_handled_not_raised() -> None:
    deep = "mul(" + "[" * 100_000 + "]" * 100_000 + ", 1)"
    assert ToolEnv([mul], error_format=VERBOSE)().step(deep).observation.startswith("error: mul(...) does not parse")  # type: ignore[union-attr]
    deep_json = '<tool_call>{"name": "mul", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>"
    observation = ToolEnv([mul], syntax="json")().step(deep_json).observation
    assert observation == [{"role": "tool", "content": observation[0]["content"]}]  # type: ignore[index]
    assert observation[0]["content"].startswith("error: the tool call is not valid JSON")  # type: ignore[index]


def test_a_result_that_cannot_be_written_is_an_error() -> None:
    class Unprintable:
        def __str__(self) -> str:
            raise RuntimeError("no")

    def make() -> Unprintable:
        return Unprintable()

    for syntax in ("call", "json"):
        env = ToolEnv([make], syntax=syntax, error_format="{error}")()  # type: ignore[arg-type]
        turn = env.step("make()" if syntax == "call" else '{"name": "make", "parameters": {}}')
        text = turn.observation if syntax == "call" else turn.observation[0]["content"]  # type: ignore[index]
        assert text == "the result Unprintable cannot be written as text (RuntimeError('no'))"

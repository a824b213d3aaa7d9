"""Tools through the endpoint: a reply in the policy's tool syntax comes back as
``message.tool_calls`` (finish_reason "tool_calls"), streamed or not; the parsing of
both syntaxes (Hermes JSON with a chat template, ``name(args)`` for the built-in policy)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import rlnb
from rlnb.envs import tool_calls
from tests.serve.helpers import DEADLINE, ScriptedEngine, chat, config

MUL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "mul",
        "description": "a times b",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


@pytest.fixture
def scripted() -> Iterator[tuple[rlnb.Session, ScriptedEngine]]:
    """A calculator session whose policy always answers ``mul(3,4)``."""
    engine = ScriptedEngine()
    with rlnb.Session(config("calculator"), name="tools", engine=engine) as sess:
        engine.script = sess.tokenizer.encode("mul(3,4)")
        yield sess, engine


@pytest.mark.netns
def test_a_reply_that_calls_a_tool_comes_back_as_tool_calls(scripted: tuple[rlnb.Session, Any]) -> None:
    sess, _ = scripted
    with sess.serve().client(sync=True, max_retries=0, timeout=DEADLINE) as client:
        r = client.chat.completions.create(model="m", messages=chat("3*4="), tools=[MUL])
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "mul" and json.loads(call.function.arguments) == {"a": 3, "b": 4}
        assert sess.tokenizer.decode(choice.model_extra["token_ids"]) == "mul(3,4)"

        stream = client.chat.completions.create(model="m", messages=chat("3*4="), tools=[MUL], stream=True)
        chunks = [c for c in stream if c.choices]
        streamed = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
        assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] == [("mul", {"a": 3, "b": 4})]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        # Without tools, or with tool_choice "none", the same reply is text.
        for extra in ({}, {"tools": [MUL], "tool_choice": "none"}):
            plain = client.chat.completions.create(model="m", messages=chat("3*4="), **extra).choices[0]
            assert plain.message.content == "mul(3,4)" and not plain.message.tool_calls
            assert plain.finish_reason == "stop"

        # A call of a tool it was not given is text too.
        other = {"type": "function", "function": {"name": "add", "parameters": MUL["function"]["parameters"]}}
        r = client.chat.completions.create(model="m", messages=chat("3*4="), tools=[other])
        assert r.choices[0].message.content == "mul(3,4)" and r.choices[0].finish_reason == "stop"


def test_the_call_syntax_of_the_built_in_policy() -> None:
    assert tool_calls("mul(3,4)", syntax="call", tools=[MUL]) == ("", [("mul", {"a": 3, "b": 4})])
    assert tool_calls("mul(3, b=4)", syntax="call", tools=[MUL]) == ("", [("mul", {"a": 3, "b": 4})])
    assert tool_calls("mul(3,4", syntax="call", tools=[MUL]) == ("mul(3,4", [])  # malformed: text
    assert tool_calls("add(3,4)", syntax="call", tools=[MUL]) == ("add(3,4)", [])  # not a tool given
    assert tool_calls("12", syntax="call", tools=[MUL]) == ("12", [])


def test_the_json_syntax_of_a_chat_template() -> None:
    text = 'Let me multiply.<tool_call>{"name": "mul", "arguments": {"a": 3, "b": 4}}</tool_call>'
    assert tool_calls(text, syntax="json") == ("Let me multiply.", [("mul", {"a": 3, "b": 4})])
    two = text + '<tool_call>{"name": "mul", "arguments": {"a": 5, "b": 6}}</tool_call>'
    assert tool_calls(two, syntax="json")[1] == [("mul", {"a": 3, "b": 4}), ("mul", {"a": 5, "b": 6})]
    assert tool_calls("<tool_call>{not json</tool_call>", syntax="json")[1] == []
    assert tool_calls("no call here", syntax="json") == ("no call here", [])

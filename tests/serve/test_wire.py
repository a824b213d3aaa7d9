"""The endpoint through the real ``openai`` client, on the built-in tiny policy: chat and
text completions, streamed and not, with what rlnb adds (token ids, log-probs, policy
versions); and every refusal, in OpenAI's error shape, naming what to fix."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import openai
import pytest

import rlnb
from rlnb.models import CharTokenizer
from tests.serve.helpers import DEADLINE, ScriptedEngine, chat, config, raw, run_async

pytestmark = [pytest.mark.netns]


@pytest.fixture
def sess() -> Iterator[rlnb.Session]:
    with rlnb.Session(config(), name="wire") as s:
        yield s


@pytest.fixture
def client(sess: rlnb.Session) -> Iterator[openai.OpenAI]:
    with sess.serve().client(sync=True, max_retries=0, timeout=DEADLINE) as c:
        yield c


def extra(obj: Any, name: str) -> Any:
    """A field the OpenAI types do not declare (vLLM's and rlnb's), as the client keeps it."""
    return (obj.model_extra or {})[name]


def check_choice(choice: Any) -> None:
    ids, versions = extra(choice, "token_ids"), extra(choice, "token_versions")
    assert len(ids) == len(versions) > 0
    assert extra(choice, "policy_version") == max(versions) == 0


def test_chat_and_text_completions_carry_token_ids_versions_and_usage(sess: rlnb.Session, client: Any) -> None:
    r = client.chat.completions.create(model="any", messages=chat(), temperature=0, max_tokens=6)
    assert r.object == "chat.completion" and r.model == "any"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    check_choice(choice)
    prompt_ids = extra(r, "prompt_token_ids")
    assert prompt_ids == sess.tokenizer.encode(chat(), bos=True)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == len(extra(choice, "token_ids"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert sess.tokenizer.decode(extra(choice, "token_ids")) == choice.message.content
    assert extra(r, "policy_version") == 0

    t = client.completions.create(model="any", prompt="abc", temperature=0, max_tokens=6)
    assert t.object == "text_completion"
    check_choice(t.choices[0])
    assert extra(t, "prompt_token_ids") == sess.tokenizer.encode("abc", bos=True)
    assert t.usage.completion_tokens == len(extra(t.choices[0], "token_ids"))
    assert sess.tokenizer.decode(extra(t.choices[0], "token_ids")) == t.choices[0].text
    raw_reply = raw(sess.serve(), "POST", "/v1/completions", json={"model": "m", "prompt": "ab", "max_tokens": 2})
    assert raw_reply.status_code == 200 and raw_reply.headers["x-rlnb-policy-version"] == "0"
    served = sess.serve().statistics().served
    assert served.calls == served.completions == served.outside == 3  # never trained on
    log = sess.serve().log()
    assert [call.fate for call in log] == ["outside"] * 3 and log[0].episode is None
    assert log[0].request.messages == tuple(chat()) and log[1].request.prompt == "abc"
    assert list(log[0].choices[0].token_ids) == extra(choice, "token_ids")


def test_greedy_is_repeatable_and_n_gives_n_choices(client: Any) -> None:
    ask = {"model": "m", "messages": chat("abcd"), "temperature": 0, "max_tokens": 8}
    first, second = (client.chat.completions.create(**ask) for _ in range(2))
    assert first.choices[0].message.content == second.choices[0].message.content
    assert extra(first.choices[0], "token_ids") == extra(second.choices[0], "token_ids")

    r = client.chat.completions.create(model="m", messages=chat(), n=3, temperature=1.0, max_tokens=4)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(extra(c, "token_ids")) for c in r.choices)
    t = client.completions.create(model="m", prompt="abc", n=2, max_tokens=4)
    assert [c.index for c in t.choices] == [0, 1]


def test_max_tokens_cuts_the_reply_with_finish_reason_length(client: Any) -> None:
    for max_tokens in (1, 5):
        r = client.chat.completions.create(
            model="m", messages=chat(), max_tokens=max_tokens, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].finish_reason == "length"
        assert len(extra(r.choices[0], "token_ids")) == r.usage.completion_tokens == max_tokens
    t = client.completions.create(model="m", prompt="abc", max_tokens=3, extra_body={"ignore_eos": True})
    assert t.choices[0].finish_reason == "length" and len(extra(t.choices[0], "token_ids")) == 3


def test_a_stop_string_cuts_the_text_and_the_token_ids() -> None:
    engine = ScriptedEngine()
    with rlnb.Session(config(), name="stops", engine=engine) as sess:
        engine.script = sess.tokenizer.encode("abcdefgh")
        with sess.serve().client(sync=True, max_retries=0, timeout=DEADLINE) as client:
            for stop, text in ((["ef", "zz"], "abcd"), ("a", ""), ("hh", "abcdefgh")):
                whole = client.completions.create(model="m", prompt="ab", stop=stop, max_tokens=20).choices[0]
                chat_choice = client.chat.completions.create(
                    model="m", messages=chat(), stop=stop, max_tokens=20
                ).choices[0]
                streamed = client.completions.create(model="m", prompt="ab", stop=stop, max_tokens=20, stream=True)
                assert whole.text == chat_choice.message.content == text
                assert "".join(c.choices[0].text for c in streamed if c.choices) == text
                assert whole.finish_reason == chat_choice.finish_reason == "stop"
                ids = extra(whole, "token_ids")
                assert ids == extra(chat_choice, "token_ids") == [*engine.script, CharTokenizer.EOS][: len(ids)]
                assert len(extra(whole, "token_versions")) == len(ids)
                if text != "abcdefgh":  # cut where the stop string starts: its first token at most is kept
                    assert sess.tokenizer.decode(ids[: len(text)]) == text and len(ids) <= len(text) + 1


def test_logprobs_one_per_token_finite_and_never_positive(client: Any) -> None:
    r = client.chat.completions.create(model="m", messages=chat(), max_tokens=6, logprobs=True)
    choice = r.choices[0]
    ids = extra(choice, "token_ids")
    entries = choice.logprobs.content
    assert len(entries) == len(ids)
    assert all(math.isfinite(e.logprob) and e.logprob <= 0 for e in entries)
    assert "".join(e.token for e in entries) == choice.message.content

    as_ids = client.chat.completions.create(
        model="m", messages=chat(), max_tokens=6, logprobs=True, extra_body={"return_tokens_as_token_ids": True}
    ).choices[0]
    assert [e.token for e in as_ids.logprobs.content] == [f"token_id:{t}" for t in extra(as_ids, "token_ids")]

    t = client.completions.create(model="m", prompt="abc", max_tokens=6, logprobs=1).choices[0]
    assert len(t.logprobs.token_logprobs) == len(t.logprobs.tokens) == len(extra(t, "token_ids"))
    assert all(math.isfinite(lp) and lp <= 0 for lp in t.logprobs.token_logprobs)
    plain = client.chat.completions.create(model="m", messages=chat(), max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_a_streamed_reply_is_the_same_as_the_whole_one(client: Any) -> None:
    ask: dict[str, Any] = {"model": "m", "messages": chat("abcd"), "temperature": 0, "max_tokens": 8}
    whole = client.chat.completions.create(**ask).choices[0]
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(extra(whole, "token_ids"))
    last = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert extra(last.choices[0], "token_ids") == extra(whole, "token_ids")

    text_ask: dict[str, Any] = {"model": "m", "prompt": "abcd", "temperature": 0, "max_tokens": 8}
    whole_text = client.completions.create(**text_ask).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**text_ask, stream=True) if c.choices)
    assert streamed == whole_text


def test_the_async_client_streams_and_lists_the_model(sess: rlnb.Session) -> None:
    ep = sess.serve()

    async def main() -> tuple[list[str], str, str]:
        client = ep.client(max_retries=0, timeout=DEADLINE)
        try:
            models = await client.models.list()
            ask: dict[str, Any] = {"model": "m", "messages": chat(), "temperature": 0, "max_tokens": 5}
            whole = await client.chat.completions.create(**ask)
            stream = await client.chat.completions.create(**ask, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            return [m.id for m in models.data], whole.choices[0].message.content or "", text
        finally:
            await client.close()

    ids, whole, streamed = run_async(main)
    assert ids == [ep.model] == ["wire"]
    assert streamed == whole


# --- refusals ------------------------------------------------------------------------------


def error_of(response: Any) -> dict[str, Any]:
    """The OpenAI-shaped error of a refused raw request."""
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    assert body["error"]["code"] == response.status_code
    return body["error"]


def test_no_key_or_a_wrong_key_is_refused_with_401(sess: rlnb.Session) -> None:
    ep = sess.serve()
    with openai.OpenAI(base_url=ep.base_url, api_key="not-the-key", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.chat.completions.create(model="m", messages=chat())
        assert info.value.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    response = raw(ep, "POST", "/v1/chat/completions", key=None, json={"model": "m", "messages": chat()})
    assert response.status_code == 401 and error_of(response)["type"] == "authentication_error"
    assert "Bearer" in error_of(response)["message"]
    assert sess.serve().statistics().served.calls == 0


@pytest.mark.parametrize(
    ("ask", "field"),
    [
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
        ({"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
        ({"n": 65}, "n"),
        ({"messages": []}, "messages"),
        ({"temperature": 3.0}, "temperature"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": chat("abcdefgh" * 5)}, "prompt"),  # over the model's context of 32
    ],
)
def test_a_bad_chat_request_is_refused_with_400_naming_the_field(client: Any, ask: dict[str, Any], field: str) -> None:
    call = {"model": "m", "messages": chat(), "max_tokens": 2} | ask
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**call)
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict) and field in body["message"], body
    assert body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("ask", "field"),
    [
        ({"logprobs": 3}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"prompt": ["ab", "cd"]}, "prompt"),
        ({"prompt": "abcdefgh" * 5}, "prompt"),
    ],
)
def test_a_bad_text_request_is_refused_with_400_naming_the_field(client: Any, ask: dict[str, Any], field: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**({"model": "m", "prompt": "abc", "max_tokens": 2} | ask))
    assert field in info.value.body["message"]  # type: ignore[index]


def test_bad_json_a_big_body_an_unknown_route_and_an_unknown_episode(sess: rlnb.Session) -> None:
    ep = sess.serve(max_body_bytes=1024)
    bad = raw(ep, "POST", "/v1/chat/completions", content=b'{"model": "m", "messages": [', headers={})
    assert bad.status_code == 400 and "not valid JSON" in error_of(bad)["message"]
    not_object = raw(ep, "POST", "/v1/completions", content=b"[1, 2]")
    assert not_object.status_code == 400 and "JSON object" in error_of(not_object)["message"]

    big = {"model": "m", "messages": chat("a" * 2000)}
    too_big = raw(ep, "POST", "/v1/chat/completions", content=json.dumps(big).encode())
    assert too_big.status_code == 413 and "max_body_bytes" in error_of(too_big)["message"]
    with ep.client(sync=True, max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(**big)
        assert info.value.status_code == 413
        assert client.chat.completions.create(model="m", messages=chat(), max_tokens=1).choices  # it goes on
    chunked = raw(ep, "POST", "/v1/completions", content=iter([b" " * 600] * 4))  # no Content-Length
    assert chunked.status_code == 413 and "max_body_bytes" in error_of(chunked)["message"]

    missing = raw(ep, "GET", "/v1/nothing")
    assert missing.status_code == 404 and "/v1/chat/completions" in error_of(missing)["message"]
    assert raw(ep, "GET", "/v1/chat/completions").status_code == 405

    with ep.client(sync=True, episode="no-such-episode", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=chat())
        assert "not running" in info.value.body["message"]  # type: ignore[index]
    stats = ep.statistics()
    assert stats.by_status[400] >= 3 and stats.by_status[413] == 3 and stats.by_status[404] == 1
    assert stats.served.completions == 1  # the one call that was not refused

"""What the endpoint's tests share: a small session, engines that say what they
generate, and raw HTTP beside the ``openai`` client."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence
from typing import Any

import httpx

import rlnb
from rlnb.engines import FakeEngine, GenerateRequest, GenerateResult
from tests.helpers import small_config

# How long a test waits on a call that must not hang.
DEADLINE = 20.0


def config(task: str = "reverse", **changes: Any) -> rlnb.Config:
    """The suite's small config on ``task`` (``reverse``: quick to make)."""
    return small_config(task=task, **changes)


def slow_engine(*, delay: float = 0.01, long: int = 400) -> FakeEngine:
    """A FakeEngine whose calls that ask for more than the rollouts' few tokens run
    ``long`` tokens (EOS last), one every ``delay`` seconds: slow enough to pause,
    sync, disconnect or close while they generate; the rollouts' own requests stay quick."""

    def lengths(request: GenerateRequest) -> int:
        return long if request.sampling.max_new_tokens > 16 else 4

    return FakeEngine(lengths=lengths, token_delay=delay)


class ScriptedEngine(FakeEngine):
    """A FakeEngine that writes ``script`` (token ids, EOS added) for every request, so a
    test knows the policy's reply: set ``script`` once the session's tokenizer is known."""

    def __init__(self) -> None:
        self.script: Sequence[int] = ()
        super().__init__(lengths=lambda _request: len(self.script) + 1)

    def _result(self, request: GenerateRequest, total: int, versions: list[int], reason: str) -> GenerateResult:
        result = super()._result(request, total, versions, reason)
        start = len(request.prefix_ids)
        script = [*self.script, rlnb.models.CharTokenizer.EOS]
        ids = tuple(script[start : start + len(result.token_ids)])
        return GenerateResult(result.request_id, ids, result.logprobs, result.versions, result.finish_reason)


def raw(ep: Any, method: str, path: str, *, key: str | None = "", **options: Any) -> httpx.Response:
    """A plain HTTP request to the endpoint at ``path`` (below the host), with its key
    unless ``key`` says another (None: no Authorization header)."""
    headers = dict(options.pop("headers", {}))
    if key is not None:
        headers["Authorization"] = f"Bearer {key or ep.api_key}"
    url = ep.base_url.removesuffix("/v1") + path
    with httpx.Client(timeout=DEADLINE) as client:
        return client.request(method, url, headers=headers, **options)


def refuses_connections(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing listens on ``host:port`` (a connection is refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect((host, port))
        except ConnectionRefusedError:
            return True
    return False


def run_async(make: Callable[[], Any]) -> Any:
    """``asyncio.run`` of ``make()``: a test's own loop for the async client, closed at the end."""
    return asyncio.run(make())


def chat(text: str = "abc") -> list[Any]:
    return [{"role": "user", "content": text}]


def assert_serves(sess: rlnb.Session, prompt: str) -> None:
    """The session's endpoint serves its engine, whatever it is: a chat and a text call
    through the real ``openai`` client, with one log-prob per token id and every token
    made by the policy the session has now."""
    with sess.serve().client(sync=True, max_retries=0, timeout=120) as client:
        chat = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": prompt}], max_tokens=4, logprobs=True
        )
        text = client.completions.create(model="policy", prompt=prompt, max_tokens=4, logprobs=1)
    for choice, logprobs in ((chat.choices[0], chat.choices[0].logprobs.content), (text.choices[0], None)):
        ids = choice.model_extra["token_ids"]
        assert 1 <= len(ids) <= 4, choice
        assert set(choice.model_extra["token_versions"]) == {sess.version}, (choice, sess.version)
        if logprobs is not None:
            assert len(logprobs) == len(ids) and all(lp.logprob <= 0 for lp in logprobs)
    assert len(text.choices[0].logprobs.token_logprobs) == len(text.choices[0].model_extra["token_ids"])
    assert chat.model_extra["prompt_token_ids"] and sess.serve().statistics().served.outside >= 2

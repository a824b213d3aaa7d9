"""The endpoint's calls and the session's life: a pause holds a call (an abort pause
continues it whole), a weight sync mid-call shows in its tokens' versions, and a client
that goes away mid-generation frees its engine request."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

import rlnb
from rlnb.engines import FakeEngine
from rlnb.models import CharTokenizer
from tests.helpers import wait_until
from tests.serve.helpers import DEADLINE, chat, config, run_async, slow_engine

pytestmark = [pytest.mark.netns]

LONG = 40  # tokens of a slow call (EOS last), 10 ms each


@pytest.fixture
def engine() -> FakeEngine:
    return slow_engine(long=LONG)


@pytest.fixture
def sess(engine: FakeEngine) -> Iterator[rlnb.Session]:
    with rlnb.Session(config(), name="pause", engine=engine) as s:
        yield s


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="client") as p:
        yield p


def call(sess: rlnb.Session, **ask: Any) -> Any:
    """One chat call asking for more than ``LONG`` tokens: the slow engine's long reply."""
    with sess.serve().client(sync=True, max_retries=0, timeout=DEADLINE) as client:
        return client.chat.completions.create(**({"model": "m", "messages": chat(), "max_tokens": 100} | ask))


def engine_running(sess: rlnb.Session) -> int:
    return sess.statistics().engine.running


def assert_whole(reply: Any) -> None:
    choice = reply.choices[0]
    ids = choice.model_extra["token_ids"]
    assert len(ids) == LONG and ids[-1] == CharTokenizer.EOS and choice.finish_reason == "stop"
    assert reply.usage.completion_tokens == LONG


def test_a_call_made_while_paused_waits_for_the_resume(
    sess: rlnb.Session, pool: concurrent.futures.ThreadPoolExecutor
) -> None:
    sess.serve()
    sess.rollouts.pause("keep")
    reply = pool.submit(call, sess)
    time.sleep(0.3)
    assert not reply.done() and engine_running(sess) == 0  # held before the engine
    sess.rollouts.resume()
    assert_whole(reply.result(DEADLINE))


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_call_paused_mid_generation_completes_whole_after_the_resume(
    sess: rlnb.Session, engine: FakeEngine, pool: concurrent.futures.ThreadPoolExecutor, mode: str
) -> None:
    sess.serve()
    reply = pool.submit(call, sess)
    wait_until(lambda: engine_running(sess) == 1, "the call to generate")
    time.sleep(0.05)
    sess.rollouts.pause(mode)
    time.sleep(0.2)
    assert not reply.done()
    sess.rollouts.resume()
    assert_whole(reply.result(DEADLINE))
    served = [r for r in engine.requests if r.request_id.startswith("served.")]
    if mode == "abort":  # its partial reply was continued, not started again
        assert len(served) == 2 and served[1].prefix_ids and len(served[1].prefix_ids) < LONG
    else:
        assert len(served) == 1


def test_a_weight_sync_mid_call_shows_in_its_token_versions(
    sess: rlnb.Session, pool: concurrent.futures.ThreadPoolExecutor
) -> None:
    ep = sess.serve()
    with ep.client(sync=True, max_retries=0, timeout=DEADLINE) as client:
        ask = {"model": "m", "messages": chat(), "max_tokens": 100}
        reply = pool.submit(client.chat.completions.with_raw_response.create, **ask)
        wait_until(lambda: engine_running(sess) >= 1, "the call to generate")
        assert sess.step()["version"] == 1
        response = reply.result(DEADLINE)
    choice = response.parse().choices[0]
    versions = choice.model_extra["token_versions"]
    assert len(versions) == len(choice.model_extra["token_ids"]) == LONG
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1, versions
    assert choice.model_extra["policy_version"] == response.parse().model_extra["policy_version"] == 1
    assert response.headers["x-rlnb-policy-version"] == "1"
    assert ep.statistics().served.outside == 1  # served, never trained on


def test_a_client_gone_mid_generation_frees_its_engine_request(sess: rlnb.Session) -> None:
    ep = sess.serve()
    body = {"model": "m", "messages": chat(), "max_tokens": 100, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {ep.api_key}"}
    with httpx.Client(timeout=0.3) as http, pytest.raises(httpx.ReadTimeout):
        http.post(ep.base_url + "/chat/completions", json=body, headers=headers)
    wait_until(lambda: ep.statistics().disconnected == 1, lambda: f"the disconnect counted: {ep.statistics()}")
    wait_until(lambda: engine_running(sess) == 0, "the engine request to be freed")
    with ep.client(sync=True, max_retries=0, timeout=0.3) as client, pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model="m", messages=chat(), max_tokens=100)
    wait_until(lambda: ep.statistics().disconnected == 2, lambda: f"the disconnect counted: {ep.statistics()}")
    wait_until(lambda: engine_running(sess) == 0, "the engine request to be freed")
    engine = sess.statistics().engine
    assert engine.waiting == 0 and engine.finished == 0
    stats = ep.statistics()
    assert stats.served.completions == 0 and stats.by_status == {499: 2}
    # The endpoint goes on serving.
    assert len(call(sess).choices[0].model_extra["token_ids"]) == LONG


def test_a_client_gone_while_its_call_waits_out_a_pause_is_never_generated(sess: rlnb.Session) -> None:
    ep = sess.serve()
    sess.rollouts.pause("keep")
    body = {"model": "m", "prompt": "ab", "max_tokens": 100}
    headers = {"Authorization": f"Bearer {ep.api_key}"}
    with httpx.Client(timeout=0.3) as http, pytest.raises(httpx.ReadTimeout):
        http.post(ep.base_url + "/completions", json=body, headers=headers)
    wait_until(lambda: ep.statistics().disconnected == 1, lambda: f"the disconnect counted: {ep.statistics()}")
    sess.rollouts.resume()
    assert len(call(sess).choices[0].model_extra["token_ids"]) == LONG  # the next call is served
    engine = sess.statistics().engine
    assert engine.finished == 1 and engine.running == engine.waiting == 0
    assert ep.statistics().served.completions == 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_calls_while_the_session_trains_are_served_with_the_versions_that_made_them(mode: str) -> None:
    with rlnb.Session(config(mode=mode), name="training") as sess:
        ep = sess.serve()
        sess.training.start(6)

        async def calls() -> list[Any]:
            client = ep.client(max_retries=0, timeout=DEADLINE)
            replies: list[Any] = []
            try:
                while sess.training.running or not replies:
                    ask = {"model": "m", "prompt": "abc", "max_tokens": 20, "extra_body": {"ignore_eos": True}}
                    replies += await asyncio.gather(*(client.completions.create(**ask) for _ in range(4)))
            finally:
                await client.close()
            return replies

        replies = run_async(calls)
        sess.training.wait()
        assert sess.statistics().engine.version == 6
        for reply in replies:
            choice = reply.choices[0]
            versions = choice.model_extra["token_versions"]
            assert len(versions) == len(choice.model_extra["token_ids"])
            assert versions == sorted(versions) and choice.model_extra["policy_version"] == versions[-1]
        stats = ep.statistics()
        assert stats.by_status == {200: len(replies)}
        assert stats.served.outside == len(replies) and stats.served.sampled == 0  # never trained on


@pytest.mark.slow
def test_the_built_in_engine_aborts_the_request_of_a_client_gone_mid_generation() -> None:
    model = rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2, max_len=4096)  # room for a long reply
    with rlnb.Session(config(model=model), name="gone") as sess:
        ep = sess.serve()
        body = {"model": "m", "prompt": "ab", "max_tokens": 4000, "ignore_eos": True}  # ~20 s of decoding
        headers = {"Authorization": f"Bearer {ep.api_key}"}
        with httpx.Client(timeout=0.3) as http, pytest.raises(httpx.ReadTimeout):
            http.post(ep.base_url + "/completions", json=body, headers=headers)
        wait_until(lambda: sess.statistics().engine.aborted == 1, lambda: f"the abort: {sess.statistics().engine}")
        engine = sess.statistics().engine
        assert engine.running == engine.waiting == engine.finished == 0
        time.sleep(0.1)
        assert sess.statistics().engine.decode_steps == engine.decode_steps  # nothing decodes any more
        assert ep.statistics().disconnected == 1

"""The endpoint under load: many async clients at once are all answered, every call
counted, and nothing grows (FDs, threads, the loop's tasks); past ``max_concurrency``
the extra calls are refused with 503 while the others are served."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai
import pytest

import rlnb
from rlnb.runtime import snapshot
from tests.helpers import wait_until, wait_until_async
from tests.serve.helpers import DEADLINE, chat, config, run_async, slow_engine

pytestmark = [pytest.mark.netns]

CLIENTS, CALLS = 32, 50


async def _tasks() -> int:
    return len(asyncio.all_tasks())


def counts(sess: rlnb.Session) -> tuple[int, int, int]:
    """FDs, threads, and tasks on the session's loop, now."""
    now = snapshot()
    return len(now.fds), len(now.threads), sess.bridge.run(_tasks())


@pytest.mark.slow
def test_32_clients_of_50_calls_each_are_all_answered_and_leave_nothing_growing() -> None:
    with rlnb.Session(config(), name="load") as sess:
        ep = sess.serve()

        async def client_calls(index: int) -> list[int]:
            client = ep.client(max_retries=0, timeout=60.0)
            try:
                lengths = []
                for k in range(CALLS):
                    if k % 5 == 4:  # streamed: the usage comes in the last chunk
                        stream = await client.chat.completions.create(
                            model="m",
                            messages=chat("abc"),
                            max_tokens=2,
                            stream=True,
                            stream_options={"include_usage": True},
                        )
                        r: Any = [chunk async for chunk in stream][-1]
                    elif k % 2:
                        r = await client.chat.completions.create(
                            model="m", messages=chat("abc"), max_tokens=2, seed=index * CALLS + k
                        )
                    else:
                        r = await client.completions.create(model="m", prompt="abc", max_tokens=2)
                    lengths.append(r.usage.completion_tokens)
                return lengths
            finally:
                await client.close()

        async def load(clients: int) -> list[list[int]]:
            return await asyncio.gather(*(client_calls(i) for i in range(clients)))

        run_async(lambda: load(2))  # warm: the server's first connections, the engine's batch
        wait_until(lambda: ep.statistics().requests == 2 * CALLS, "the warm-up")
        before = counts(sess)
        start = time.monotonic()
        answered = run_async(lambda: load(CLIENTS))
        took = time.monotonic() - start
        assert len(answered) == CLIENTS and all(len(a) == CALLS and all(0 < n <= 2 for n in a) for a in answered)
        stats = ep.statistics()
        made = (CLIENTS + 2) * CALLS
        assert stats.requests == made and stats.by_status == {200: made}
        assert stats.served.completions == stats.served.calls == stats.served.outside == made
        assert stats.disconnected == 0
        engine = sess.statistics().engine
        assert engine.running == engine.waiting == 0
        # The server closes its side of each connection once the client has: give it a moment.
        wait_until(
            lambda: all(now <= then for now, then in zip(counts(sess), before, strict=True)),
            lambda: f"no growth of (FDs, threads, loop tasks): {before} before, {counts(sess)} now",
            10.0,
        )
        print(f"\n{CLIENTS * CALLS} calls by {CLIENTS} clients in {took:.1f} s ({CLIENTS * CALLS / took:.0f}/s)")


@pytest.mark.slow
def test_calls_past_max_concurrency_are_refused_with_503_and_the_others_served() -> None:
    with rlnb.Session(config(), name="limit", engine=slow_engine(long=60)) as sess:
        ep = sess.serve(max_concurrency=2)

        async def one() -> Any:
            client = ep.client(max_retries=0, timeout=DEADLINE)
            try:
                return await client.chat.completions.create(model="m", messages=chat(), max_tokens=100)
            finally:
                await client.close()

        async def main() -> tuple[list[Any], list[Any]]:
            first = [asyncio.ensure_future(one()) for _ in range(2)]
            await wait_until_async(lambda: sess.statistics().engine.running == 2, "two calls to generate")
            extra = await asyncio.gather(*(one() for _ in range(4)), return_exceptions=True)
            return list(await asyncio.gather(*first, return_exceptions=True)), list(extra)

        served, refused = run_async(main)
        assert all(len(r.choices[0].model_extra["token_ids"]) == 60 for r in served), served
        for error in refused:
            assert isinstance(error, openai.APIStatusError) and error.status_code == 503, error
            assert "max_concurrency" in error.message, error.message  # OpenAI's error shape, naming the setting
        assert ep.statistics().served.completions == 2
        # Once the calls are done, the endpoint takes new ones again.
        assert len(run_async(one).choices) == 1

"""``RayEngine``'s batched calls, against stand-in actors (no Ray cluster): the
requests of one turn of the loop go to a replica in one streaming call, each result
reaches its own request as it comes, and an error stays with its request.
test_ray.py runs the same path on real Ray actors."""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

import rlnb
from rlnb.engines import GenerateRequest, GenerateResult, RayEngine, SamplingParams


class ActorDied(Exception):
    """Stands in for ``ray.exceptions.RayActorError``."""


FAKE_RAY = types.SimpleNamespace(
    exceptions=types.SimpleNamespace(RayActorError=ActorDied, RayTaskError=type("RayTaskError", (Exception,), {}))
)


class Method:
    """``actor.method``: ``.remote(...)`` and ``.options(...).remote(...)`` call ``fn``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def options(self, **_: Any) -> Method:
        return self

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class Actor:
    """A replica that answers each request after ``delay(request)`` seconds, in the
    order they finish, through an async stream of awaitables as Ray's is."""

    def __init__(self, delay: Callable[[GenerateRequest], float], fail: set[str] | None = None) -> None:
        self.delay, self.fail = delay, fail or set()
        self.batches: list[list[str]] = []
        self.cancelled: list[str] = []
        self.generate_many = Method(self._generate_many)
        self.cancel = Method(self.cancelled.extend)

    def _generate_many(self, requests: list[GenerateRequest]) -> AsyncIterator[Awaitable[Any]]:
        self.batches.append([r.request_id for r in requests])

        async def one(position: int, request: GenerateRequest) -> tuple[int, Any]:
            await asyncio.sleep(self.delay(request))
            if request.request_id in self.fail:
                return position, ValueError(f"no answer for {request.request_id}")
            return position, GenerateResult(request.request_id, (7,), (-0.5,), (0,), "stop")

        async def stream() -> AsyncIterator[Awaitable[Any]]:
            for task in asyncio.as_completed([one(i, r) for i, r in enumerate(requests)]):
                result = await task
                done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                done.set_result([result])  # the requests that ended together, one here
                yield done

        return stream()


def engine_with(*actors: Actor) -> RayEngine:
    cluster = types.SimpleNamespace(owned=False, logs=None, close=lambda timeout=None: None)
    engine = RayEngine(FAKE_RAY, cluster, factory=None, config=rlnb.RayConfig(engine_replicas=len(actors)))
    engine._slots = [_running_slot(i, actor) for i, actor in enumerate(actors)]
    return engine


def _running_slot(index: int, actor: Actor) -> Any:
    from rlnb.engines._ray import _Slot

    slot = _Slot(index, actor)
    slot.state = "running"
    return slot


def request(i: int) -> GenerateRequest:
    return GenerateRequest(f"r{i}", (1, 2), SamplingParams(max_new_tokens=3))


def test_the_requests_of_one_dispatch_go_in_one_call_and_each_gets_its_own_result() -> None:
    actor = Actor(delay=lambda r: 0.01 * (10 - int(r.request_id[1:])))  # the last request finishes first

    async def main() -> list[GenerateResult]:
        engine = engine_with(actor)
        return await asyncio.gather(*(engine.generate(request(i)) for i in range(10)))

    results = asyncio.run(main())
    assert actor.batches == [[f"r{i}" for i in range(10)]]  # one actor call for the dispatch
    assert [r.request_id for r in results] == [f"r{i}" for i in range(10)]


def test_requests_spread_over_replicas_one_call_each() -> None:
    first, second = Actor(delay=lambda r: 0.0), Actor(delay=lambda r: 0.0)

    async def main() -> None:
        engine = engine_with(first, second)
        await asyncio.gather(*(engine.generate(request(i)) for i in range(8)))

    asyncio.run(main())
    assert len(first.batches) == len(second.batches) == 1
    assert sorted(first.batches[0] + second.batches[0]) == sorted(f"r{i}" for i in range(8))


def test_an_error_stays_with_its_request() -> None:
    actor = Actor(delay=lambda r: 0.0, fail={"r2"})

    async def main() -> list[Any]:
        engine = engine_with(actor)
        return await asyncio.gather(*(engine.generate(request(i)) for i in range(4)), return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[2], ValueError) and "r2" in str(results[2])
    assert [r.request_id for i, r in enumerate(results) if i != 2] == ["r0", "r1", "r3"]


def test_a_request_its_caller_stops_waiting_for_is_cancelled_on_its_replica() -> None:
    actor = Actor(delay=lambda r: 5.0 if r.request_id == "r1" else 0.01)

    async def main() -> list[Any]:
        engine = engine_with(actor)
        tasks = [asyncio.ensure_future(engine.generate(request(i))) for i in range(3)]
        await asyncio.sleep(0.05)
        tasks[1].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[1], asyncio.CancelledError)
    assert actor.cancelled == ["r1"]
    assert [results[0].request_id, results[2].request_id] == ["r0", "r2"]


def test_a_stream_that_ends_early_fails_its_waiting_requests_with_an_engine_error() -> None:
    actor = Actor(delay=lambda r: 0.0)

    def short(requests: list[GenerateRequest]) -> AsyncIterator[Any]:
        async def stream() -> AsyncIterator[Any]:
            done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            done.set_result([(0, GenerateResult(requests[0].request_id, (7,), (-0.5,), (0,), "stop"))])
            yield done

        return stream()

    actor.generate_many = Method(short)

    async def main() -> list[Any]:
        engine = engine_with(actor)
        return await asyncio.gather(*(engine.generate(request(i)) for i in range(2)), return_exceptions=True)

    first, second = asyncio.run(main())
    assert first.request_id == "r0"
    with pytest.raises(rlnb.EngineError, match="without an answer for every request"):
        raise second

"""``FakeEngine``: a scripted :class:`~rlnb.engines.Engine` for tests and benchmarks.

It runs on the caller's event loop (no thread): each request yields a scripted
number of tokens, one every ``token_delay`` seconds, and honours pause modes,
aborts and weight updates exactly as the protocol says.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from rlnb._errors import ClosedError
from rlnb.engines._protocol import EngineStatistics, GenerateRequest, GenerateResult, PauseMode

__all__ = ["FakeEngine"]

EOS = 2


@dataclasses.dataclass
class _Running:
    request: GenerateRequest
    aborted: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # pause, resume, abort or new weights


class FakeEngine:
    """Scripted engine.

    ``lengths(request)`` gives how many tokens a request produces in all (prefix
    included, so a continued request finishes where it would have); the last one is
    EOS (finish "stop") unless ``max_new_tokens`` cuts it ("length"). ``token``
    is the id of every other token. ``fail(request)`` may return an exception to
    raise instead of generating, and ``update_error`` makes ``update_weights`` fail.
    """

    def __init__(
        self,
        *,
        lengths: Callable[[GenerateRequest], int] | int = 4,
        token_delay: float = 0.0,
        token: int = 3,
        fail: Callable[[GenerateRequest], BaseException | None] | None = None,
    ) -> None:
        self._lengths = lengths if callable(lengths) else (lambda _request, n=lengths: n)
        self._delay = token_delay
        self._token = token
        self._fail = fail
        self.update_error: BaseException | None = None
        self.weights: Mapping[str, Any] | None = None
        self._version = 0
        self._paused: PauseMode | None = None
        self._resumed: asyncio.Event | None = None
        self._running: dict[str, _Running] = {}
        self._waiting = 0
        self._counts = {"finished": 0, "aborted": 0, "tokens": 0}
        self._closed = False
        self.requests: list[GenerateRequest] = []  # every request seen, for tests to inspect

    def _resume_event(self) -> asyncio.Event:
        if self._resumed is None:
            self._resumed = asyncio.Event()
            self._resumed.set()
        return self._resumed

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self._closed:
            raise ClosedError("the engine is closed")
        self.requests.append(request)
        if self._fail is not None and (error := self._fail(request)) is not None:
            raise error
        resumed = self._resume_event()
        self._waiting += 1
        try:
            while self._paused is not None:  # KEEP and WAIT both admit nothing new
                await resumed.wait()
        finally:
            self._waiting -= 1
        running = _Running(request)
        self._running[request.request_id] = running
        try:
            return await self._decode(running)
        finally:
            del self._running[request.request_id]

    async def _decode(self, running: _Running) -> GenerateResult:
        request = running.request
        total = max(1, self._lengths(request)) - len(request.prefix_ids)
        target = max(0, min(total, request.sampling.max_new_tokens))
        versions: list[int] = []
        loop = asyncio.get_running_loop()
        while len(versions) < target:
            if running.aborted.is_set():
                self._counts["aborted"] += 1
                return self._result(request, total, versions, "aborted")
            if self._paused is PauseMode.KEEP:
                running.wake.clear()
                await running.wake.wait()  # resume or abort
                continue
            if not self._delay:
                versions.append(self._version)
                await asyncio.sleep(0)
                continue
            # Sleep until done, waking only for a pause, an abort or new weights: one
            # wake-up per request instead of one per token keeps thousands in flight cheap.
            version, start = self._version, loop.time()
            running.wake.clear()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation
            # that lands as the wait wakes, and a close right after a resume() then hangs.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout((target - len(versions)) * self._delay):
                    await running.wake.wait()
            done = int((loop.time() - start) / self._delay) if running.wake.is_set() else target
            versions += [version] * min(done, target - len(versions))
        self._counts["finished"] += 1
        return self._result(request, total, versions, "stop" if len(versions) == total else "length")

    def _result(self, request: GenerateRequest, total: int, versions: list[int], reason: str) -> GenerateResult:
        self._counts["tokens"] += len(versions)
        tokens = [EOS if i == total - 1 else self._token for i in range(len(versions))]
        return GenerateResult(request.request_id, tuple(tokens), tuple(-1.0 for _ in tokens), tuple(versions), reason)

    async def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if (running := self._running.get(rid)) is not None:
                running.aborted.set()
                running.wake.set()

    async def pause(self, mode: PauseMode | str = PauseMode.KEEP) -> None:
        mode = PauseMode(mode)
        self._paused = mode
        self._resume_event().clear()
        self._wake_all()
        if mode is PauseMode.ABORT:
            await self.abort(list(self._running))
            while self._running:  # quiescent: every in-flight request has returned
                await asyncio.sleep(0)

    async def resume(self) -> None:
        self._paused = None
        self._resume_event().set()
        self._wake_all()

    def _wake_all(self) -> None:
        for running in self._running.values():
            running.wake.set()

    async def update_weights(self, state: Mapping[str, Any], version: int) -> None:
        if self.update_error is not None:
            raise self.update_error
        self.weights = state
        self._version = version
        self._wake_all()  # tokens from now on carry the new version

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            version=self._version,
            paused=None if self._paused is None else self._paused.value,
            waiting=self._waiting,
            running=len(self._running),
            finished=self._counts["finished"],
            aborted=self._counts["aborted"],
            generated_tokens=self._counts["tokens"],
            decode_steps=self._counts["tokens"],  # one token a step per request
        )

    def close(self, timeout: float | None = None) -> None:
        self._closed = True

"""What the engine backends share and nothing else: handing a result from an engine's
own thread (or process reader) back to the asyncio loop that awaits it, and counting
the requests running under a pause for engines that see requests, not decode steps."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

from rlnb.engines._protocol import PauseMode


def deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any) -> None:
    """Resolve ``future`` on ``loop`` from any thread: with ``result``, or with it as the
    exception when it is one. A no-op if the future is done or its loop has closed."""

    def settle() -> None:
        if future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop closed: nobody is waiting any more
        pass


def running(in_flight: Collection[int], paused: PauseMode | None, cutoff: int) -> int:
    """How many of the requests in flight (their arrival numbers) are running: all of
    them unpaused; none after an "abort" pause (every one came back); under "keep"
    (frozen in place) or "wait" (finishing), those that arrived by the pause's ``cutoff``."""
    if paused is None:
        return len(in_flight)
    if paused is PauseMode.ABORT:
        return 0
    return sum(a <= cutoff for a in in_flight)

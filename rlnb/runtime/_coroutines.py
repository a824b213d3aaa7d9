"""``block_on``: a coroutine run to its end from sync code, on an event loop of its own.

rlnb runs a coroutine from sync code in one of two ways. A session's calls go to the
session's one long-lived loop through :class:`~rlnb.runtime.AsyncBridge`, where the
rollouter and the engine live. Everything else that holds a coroutine and no loop (an
``async def`` reward or tool, an isolated function in its worker process, the engine
server of a child process, a benchmark's run) calls :func:`block_on`: a new loop for
the one call, closed before it returns, so nothing is left behind.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

__all__ = ["block_on"]

T = TypeVar("T")


def block_on(awaitable: Awaitable[T]) -> T:
    """Run ``awaitable`` to its end on a new event loop and return its result (or raise
    its exception); the loop, its async generators and its default executor are closed
    before this returns. Blocks the calling thread. From a thread that already runs a
    loop (a notebook cell's), which cannot run a second one, the new loop runs on a
    thread of its own, in a copy of this thread's context, and this thread waits for it."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        with asyncio.Runner() as runner:
            return runner.run(_as_coroutine(awaitable))
    box: dict[str, Any] = {}
    context = contextvars.copy_context()

    def run() -> None:
        try:
            with asyncio.Runner() as runner:
                box["value"] = runner.run(_as_coroutine(awaitable), context=context)
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="rlnb-block-on")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _as_coroutine(awaitable: Awaitable[T]) -> Coroutine[Any, Any, T]:
    """``awaitable`` as the coroutine ``asyncio.Runner.run`` takes."""
    if asyncio.iscoroutine(awaitable):
        return awaitable

    async def wait() -> T:
        return await awaitable

    return wait()

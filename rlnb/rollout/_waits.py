"""Waits the rollouter's cell-sized calls share: a deadline on being paused, all
results or the first failure, and a wake-up from another thread.

A call made in a cell (``collect``, ``evaluate``, ``complete``) waits out a pause
that lands while it runs, but not for ever: a kernel busy with that cell cannot
take the click that would resume it (see ``docs/architecture.md``, section 4).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from rlnb._errors import WaitTimeoutError
from rlnb.rollout._state import StateMachine

__all__ = ["all_or_first_error", "call_soon", "pause_limited"]

_T = TypeVar("_T")


async def pause_limited(machine: StateMachine, coro: Coroutine[Any, Any, _T], limit: float | None, call: str) -> _T:
    """Await ``coro``; once rollouts have been stopped (paused) for ``limit`` s
    meanwhile, cancel it and raise TimeoutError naming ``call`` and the fix. None:
    no limit. A cancelled caller cancels ``coro`` too."""
    if limit is None:
        return await coro
    task = asyncio.ensure_future(coro)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=min(0.25, limit))
            if not task.done() and machine.not_running_for() > limit:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise WaitTimeoutError(
                    f"{call} waited {limit:g} s while rollouts were {machine.state.value}: "
                    "sess.rollouts.resume() them and call it again; nothing was lost "
                    "(Config.step_timeout sets the wait)"
                )
        return task.result()
    finally:
        if not task.done():  # the caller was cancelled: so is what it waited for
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def all_or_first_error(coros: list[Coroutine[Any, Any, _T]]) -> list[_T | BaseException]:
    """Run ``coros`` at once. Every result in order; or, at the first failure, the
    rest cancelled and only the failures returned. A cancelled caller cancels them all."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    failed = [t for t in tasks if not t.cancelled() and t.exception() is not None]
    if not failed:
        return [t.result() for t in tasks]
    return [exc for t in failed if (exc := t.exception()) is not None]


def call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """``callback()`` on ``loop`` from any thread; nothing once the loop has closed."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:  # the loop has closed: there is nothing left to wake
        pass

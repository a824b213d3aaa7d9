"""``block_on`` runs a coroutine to its end from sync code on a loop of its own, closed
before it returns: in the calling thread, or on a thread of its own (in a copy of the
caller's context) where the caller already runs a loop, as a notebook cell does."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Generator
from typing import Any

import pytest

from rlnb.runtime import block_on

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="unset")


async def where() -> tuple[str, asyncio.AbstractEventLoop, str]:
    await asyncio.sleep(0)
    return threading.current_thread().name, asyncio.get_running_loop(), request_id.get()


def test_it_runs_in_this_thread_on_a_new_loop_it_closes() -> None:
    token = request_id.set("cell 1")
    try:
        thread, loop, seen = block_on(where())
    finally:
        request_id.reset(token)
    assert thread == threading.current_thread().name
    assert seen == "cell 1"
    assert loop.is_closed()
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()  # none is left running here


def test_the_coroutines_error_is_raised_as_it_is() -> None:
    async def fails() -> None:
        raise KeyError("the coroutine's own")

    with pytest.raises(KeyError, match="the coroutine's own"):
        block_on(fails())


def test_under_a_running_loop_it_runs_on_a_thread_of_its_own_with_the_callers_context() -> None:
    async def notebook_cell() -> tuple[tuple[str, asyncio.AbstractEventLoop, str], asyncio.AbstractEventLoop]:
        request_id.set("cell 2")
        return block_on(where()), asyncio.get_running_loop()

    (thread, loop, seen), cells_loop = asyncio.run(notebook_cell())
    assert thread == "rlnb-block-on"
    assert loop is not cells_loop and loop.is_closed()
    assert seen == "cell 2"
    assert not [t for t in threading.enumerate() if t.name == "rlnb-block-on"]


def test_under_a_running_loop_the_error_comes_back_to_the_caller() -> None:
    async def fails() -> None:
        raise ValueError("from the helper thread")

    async def notebook_cell() -> None:
        block_on(fails())

    with pytest.raises(ValueError, match="from the helper thread"):
        asyncio.run(notebook_cell())


def test_an_awaitable_that_is_not_a_coroutine_is_awaited() -> None:
    class Ready:
        def __await__(self) -> Generator[Any, None, int]:
            yield from asyncio.sleep(0).__await__()
            return 7

    assert block_on(Ready()) == 7

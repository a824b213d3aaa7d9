"""What the engine backends share and nothing else: handing a result from an engine's
own thread (or process reader) back to the asyncio loop that awaits it, and spawning
a child process without re-running the caller's script."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing.spawn
import threading
from collections.abc import Iterator
from typing import Any


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


@contextlib.contextmanager
def spawn_without_main() -> Iterator[None]:
    """Spawned children started by this thread do not re-run the ``__main__`` script.

    A spawned child normally re-imports the parent's main script, which would start
    another session (and another engine) unless the script guards itself with
    ``if __name__ == "__main__":``. The engines' children (vLLM's EngineCore,
    :class:`~rlnb.engines.ProcessEngine`'s server) run targets that live in
    packages, so they never need the script. Only this thread's spawns are changed.
    """
    original = multiprocessing.spawn.get_preparation_data
    me = threading.current_thread()

    def preparation_data(name: str) -> dict[str, Any]:
        data: dict[str, Any] = original(name)
        if threading.current_thread() is me:
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data

    multiprocessing.spawn.get_preparation_data = preparation_data
    try:
        yield
    finally:
        multiprocessing.spawn.get_preparation_data = original

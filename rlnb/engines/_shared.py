"""What the engine backends share and nothing else: handing a result from an engine's
own thread (or process reader) back to the asyncio loop that awaits it."""

from __future__ import annotations

import asyncio
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

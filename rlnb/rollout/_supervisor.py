"""The rollouter's tasks: none outlives it, and none fails unheard.

A background task's failure is kept until the next public call reports it
(``raise_pending``); ``cancel_all`` cancels every task and waits for them all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from rlnb._errors import ClosedError, RolloutError

__all__ = ["TaskSupervisor"]


class TaskSupervisor:
    """Starts tasks on the running loop, keeps them until they end, stores their failures."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._errors: list[BaseException] = []

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str, report: bool = True) -> asyncio.Task[Any]:
        """A supervised task: its failure is stored for ``raise_pending`` when ``report``
        (otherwise whoever awaits it raises it)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done if report else self._tasks.discard)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None and not isinstance(exc, ClosedError):
            self._errors.append(exc)

    def report(self, exc: BaseException) -> None:
        """Store a failure that a task handled itself, for ``raise_pending``."""
        self._errors.append(exc)

    def raise_pending(self) -> None:
        """Raise failures not yet reported: one error chained to the first, holding
        them all in ``.errors``; each failure is reported exactly once."""
        if not self._errors:
            return
        errors, self._errors = self._errors, []
        if len(errors) == 1:
            message = f"a background rollout failed: {errors[0]}"
        else:
            message = f"{len(errors)} background rollouts failed; the first: {errors[0]}"
        exc = RolloutError(message)
        exc.errors = errors  # type: ignore[attr-defined]
        raise exc from errors[0]

    async def cancel_all(self) -> None:
        """Cancel every task and wait for them all."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

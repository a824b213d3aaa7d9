"""``Quiescence``: rollouts with nothing generating for the length of a block, then
as they were (what a checkpoint needs: every group in flight finished into the buffer).

It drives the rollouter's public calls only: stop dispatch, resume (kept partial
rollouts finish too), pause WAIT and wait for the drain; afterwards it resumes and
restarts dispatch if they ran before. Whatever interrupts it, at any await, the
rollouts are put back: ``enter()`` undoes itself when it fails or is cancelled,
and ``restore()`` may be called again, from a caller that could not wait for that.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Protocol

from rlnb._errors import StateError
from rlnb.engines import PauseMode
from rlnb.rollout._state import RolloutState

__all__ = ["Quiescence"]


class QuiesceTarget(Protocol):
    """What a quiescence drives of the :class:`~rlnb.rollout.Rollouter` (which makes
    it in ``quiesce()``, so this module does not import it back)."""

    @property
    def state(self) -> RolloutState: ...

    @property
    def dispatching(self) -> bool: ...

    @property
    def engine_dead(self) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def pause(self, mode: PauseMode) -> None: ...

    async def resume(self) -> None: ...

    async def wait_paused(self, timeout: float | None) -> None: ...


class Quiescence:
    """An async context manager: see :meth:`Rollouter.quiesce`. Use it once."""

    def __init__(self, rollouter: QuiesceTarget, timeout: float | None) -> None:
        self._rollouter = rollouter
        self._timeout = timeout
        self._entered = False
        self._was: tuple[RolloutState, bool] | None = None  # (state, dispatching) before enter(), until restored
        self._restoring = asyncio.Lock()

    async def __aenter__(self) -> None:
        await self.enter()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.restore()

    async def enter(self) -> None:
        """Stop dispatch and drain every sample in flight (kept partial ones too) into
        its group's end. Raises TimeoutError as ``wait_paused()`` does after the
        timeout; failed or cancelled, it restores the rollouts before it raises."""
        if self._entered:
            raise StateError("a Quiescence is entered once: call Rollouter.quiesce() for another")
        self._entered = True
        r = self._rollouter
        self._was = (r.state, r.dispatching)  # before the first change
        try:
            await r.stop()
            if not r.engine_dead:  # a dead engine generates nothing; what was learnt can still be saved
                await r.resume()  # kept partial rollouts finish too
                await r.pause(PauseMode.WAIT)
                await r.wait_paused(self._timeout)
        except BaseException:
            await self.restore()
            raise

    async def restore(self) -> None:
        """Put rollouts back as they were before :meth:`enter`: running if they ran,
        dispatching if they were. Nothing with a dead engine. Idempotent: once done,
        or before ``enter()``, it does nothing; a call while another is under way
        waits for it."""
        async with self._restoring:
            was, self._was = self._was, None
            if was is None or self._rollouter.engine_dead:
                return
            try:
                state, dispatching = was
                if state is RolloutState.RUNNING:
                    await self._rollouter.resume()
                if dispatching:
                    await self._rollouter.start()
            except BaseException:
                self._was = was  # undone only in part: a later restore() does it again
                raise

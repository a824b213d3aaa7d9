"""The rollouter's state machine: RUNNING, PAUSING, PAUSED, SYNCING, CLOSED.

Every waiter waits on one condition for a predicate of the state, so ``resume()``
wakes the dispatcher at once instead of after the slowest in-flight generation.
The machine drives the engine's pause, resume and weight update; of the rollouts
it knows only whether they have drained (what a WAIT pause waits for).

A WAIT pause drains: dispatch stops, but every group already dispatched runs to its
end, the next turns of its conversations, its retries and its kept partial samples
included (``may_generate()``), and the engine is paused only once nothing is left.
Pausing the engine first would hold those next requests in the engine, and the
drain would wait for samples that wait for the drain.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Mapping
from typing import Any

from rlnb._errors import ClosedError, EngineError, WeightSyncError
from rlnb.engines import Engine, PauseMode
from rlnb.rollout._supervisor import TaskSupervisor

__all__ = ["RolloutState", "StateMachine"]


class RolloutState(enum.Enum):
    RUNNING = "running"
    PAUSING = "pausing"  # engine being told to pause; in WAIT mode, draining (the engine runs)
    PAUSED = "paused"
    SYNCING = "syncing"  # weight-sync transaction under way
    CLOSED = "closed"


class StateMachine:
    """The state of a :class:`~rlnb.rollout.Rollouter` and its transitions.

    ``drained()`` says whether a WAIT pause has nothing left to wait for (no group
    dispatched and not yet ended); the drain runs in the background under ``tasks``.
    The rollouts wait here (``wait_for``, ``wait_generating``) and say when their
    counts change (``notify``).
    """

    def __init__(self, engine: Engine, *, tasks: TaskSupervisor, drained: Callable[[], bool]) -> None:
        self._engine = engine
        self._tasks = tasks
        self._drained = drained
        self._state = RolloutState.RUNNING
        self._changed = asyncio.Condition()
        self._pause_mode: PauseMode | None = None
        self._resumed_at: float | None = None
        self._stopped_at: float | None = None  # when the state last left RUNNING (None while RUNNING)
        self._engine_death: EngineError | None = None

    @property
    def state(self) -> RolloutState:
        return self._state

    async def set(self, state: RolloutState) -> None:
        async with self._changed:
            if self._state is RolloutState.CLOSED:
                return  # terminal: a sync or pause that ends after close() leaves it closed
            self._state = state
            if state is RolloutState.RUNNING:
                self._stopped_at = None
            elif self._stopped_at is None:
                self._stopped_at = time.monotonic()
            self._changed.notify_all()

    def not_running_for(self) -> float:
        """Seconds since rollouts last stopped running (paused, syncing, closed); 0 while running."""
        return 0.0 if self._stopped_at is None else time.monotonic() - self._stopped_at

    async def notify(self) -> None:
        """Wake every waiter to check its predicate again."""
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()``; raises ClosedError once closed, waiting or not."""
        async with self._changed:
            await self._changed.wait_for(lambda: predicate() or self._state is RolloutState.CLOSED)
        if self._state is RolloutState.CLOSED:
            raise ClosedError("the rollouter is closed")

    async def wait_running(self) -> None:
        await self.wait_for(lambda: self._state is RolloutState.RUNNING)

    @property
    def draining(self) -> bool:
        """A WAIT pause is under way: dispatched groups finish, nothing new starts."""
        return self._state is RolloutState.PAUSING and self._pause_mode is PauseMode.WAIT

    def may_generate(self) -> bool:
        """Whether a dispatched sample may send its next request: rollouts run, or a
        WAIT pause is draining (it waits for that sample's group to end)."""
        return self._state is RolloutState.RUNNING or self.draining

    async def wait_generating(self) -> None:
        """Wait until a dispatched sample may go on (:meth:`may_generate`)."""
        await self.wait_for(self.may_generate)

    def check_open(self) -> None:
        """Raise ClosedError once closed, and EngineError once the engine has died."""
        if self._state is RolloutState.CLOSED:
            raise ClosedError("rollouts are closed: the session was closed (close() ends every call on it)")
        if (death := self._engine_death) is not None:
            raise EngineError(
                f"the engine died ({death}), so rollouts cannot go on: close this session and make a new one "
                "(sess.save(path) first keeps the training so far; Session.load(path) goes on from it)"
            ) from death

    @property
    def engine_dead(self) -> bool:
        return self._engine_death is not None

    def engine_died(self, error: EngineError) -> None:
        """The engine failed as a whole: every later call raises it (see ``check_open``)."""
        if self._engine_death is None:
            self._engine_death = error

    async def notify_if_drained(self) -> None:
        if self.draining and self._drained():
            await self.notify()  # a WAIT drain is waiting for this

    def take_resume_latency_ms(self) -> float | None:
        """Milliseconds since the last ``resume()``, once per resume (else None)."""
        if self._resumed_at is None:
            return None
        latency = (time.perf_counter() - self._resumed_at) * 1e3
        self._resumed_at = None
        return latency

    # -- transitions --------------------------------------------------------------------

    async def pause(self, mode: PauseMode | str) -> None:
        mode = PauseMode(mode)
        self.check_open()
        await self.after_sync()  # a sync takes milliseconds: pause right after it
        if self._state is not RolloutState.RUNNING and not (self.draining and mode is not PauseMode.WAIT):
            # Already paused: the same mode (or a milder one) changes nothing, while
            # "abort" still turns a frozen pause into partial rollouts. A draining
            # WAIT pause gives way to KEEP or ABORT: the user wants it paused now.
            if mode is not PauseMode.ABORT or self._pause_mode is PauseMode.ABORT:
                return
        self._pause_mode = mode
        await self.set(RolloutState.PAUSING)
        if mode is PauseMode.WAIT:  # the engine keeps running until the groups in flight have ended
            self._tasks.spawn(self._drain(), name="rlnb-drain")
            return
        try:
            await self._engine.pause(mode)
        finally:
            # Even if interrupted, the engine has stopped admitting: never stay PAUSING
            # with nothing left to finish the pause.
            if self._pause_mode is mode and self._state is RolloutState.PAUSING:
                await self.set(RolloutState.PAUSED)

    async def _drain(self) -> None:
        """A WAIT pause's end: once every dispatched group has ended, pause the engine
        (nothing is left in it) and become PAUSED, unless a resume or another pause
        came meanwhile."""
        await self.wait_for(lambda: self._drained() or not self.draining)
        if not self.draining:
            return
        await self._engine.pause(PauseMode.WAIT)
        if self.draining:
            await self.set(RolloutState.PAUSED)
        elif self._state is RolloutState.RUNNING:  # resumed while the engine paused: resume it again
            await self._engine.resume()

    async def resume(self) -> None:
        self.check_open()
        await self.after_sync()
        if self._state is RolloutState.RUNNING:
            return
        self._resumed_at = time.perf_counter()
        # State first, then one turn of the loop so the dispatcher goes before whatever
        # the engine's resume wakes (a request dispatched a moment early just queues).
        await self.set(RolloutState.RUNNING)
        try:
            await asyncio.sleep(0)
        finally:  # also when cancelled (Ctrl-C): never RUNNING over a paused engine
            await asyncio.shield(self._engine.resume())

    async def after_sync(self) -> None:
        """Wait out a weight sync in progress (it restores the state it found); raises
        ClosedError once closed."""
        if self._state is RolloutState.SYNCING:
            await self.wait_for(lambda: self._state is not RolloutState.SYNCING)

    async def wait_paused(self) -> None:
        await self.wait_for(lambda: self._state is RolloutState.PAUSED)

    async def sync_weights(self, weights: Mapping[str, Any], version: int) -> None:
        self.check_open()
        # Another sync, or a pause under way (a WAIT drain finishes its groups with the
        # weights they started with): wait for it, then sync.
        await self.wait_for(lambda: self._state not in (RolloutState.SYNCING, RolloutState.PAUSING))
        previous = self._state
        await self.set(RolloutState.SYNCING)
        synced = False
        try:
            if previous is RolloutState.RUNNING:
                await self._engine.pause(PauseMode.KEEP)
            await self._engine.update_weights(weights, version)
            synced = True
        except EngineError as exc:
            self.engine_died(exc)
            raise WeightSyncError(
                f"weight sync to version {version} failed: the engine died; close this session and make a new one"
            ) from exc
        except Exception as exc:
            raise WeightSyncError(
                f"weight sync to version {version} failed; rollouts stay paused "
                "(call sess.rollouts.resume() once fixed)"
            ) from exc
        finally:
            if synced and previous is RolloutState.RUNNING and self._state is not RolloutState.CLOSED:
                await self._engine.resume()
            await self.set(previous if synced else RolloutState.PAUSED)

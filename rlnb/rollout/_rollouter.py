"""The asynchronous ``Rollouter``: prompts in, rewarded groups out, pausable at any time.

It runs on the session's bridge loop. One explicit state machine governs it
(RUNNING, PAUSING, PAUSED, SYNCING, CLOSED); every waiter waits on one condition
for a predicate of that state, so ``resume()`` wakes the dispatcher at once instead
of after the slowest in-flight generation. Capacity is a semaphore of samples. No
lock is held across an await of the engine.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from rlnb._errors import BufferFull, ClosedError, RolloutError, WeightSyncError
from rlnb._samples import Group, PromptItem, Sample
from rlnb.buffer import ReplayBuffer
from rlnb.rollout._engine import Engine, GenerateRequest, PauseMode, SamplingParams

__all__ = ["PromptItem", "RolloutState", "RolloutStatistics", "Rollouter"]


class RolloutState(enum.Enum):
    RUNNING = "running"
    PAUSING = "pausing"  # engine told to pause; in WAIT mode, draining
    PAUSED = "paused"
    SYNCING = "syncing"  # weight-sync transaction under way
    CLOSED = "closed"


@dataclasses.dataclass(frozen=True)
class RolloutStatistics:
    """A snapshot of the rollouter's counters (samples unless named otherwise).

    Every dispatched sample is in exactly one of: ``in_flight`` (generating or
    queued), ``kept_partial`` (aborted by a pause, waiting to continue),
    ``finished`` or ``failed``.
    """

    state: str
    dispatching: bool
    version: int
    dispatched: int
    in_flight: int
    kept_partial: int
    finished: int
    failed: int
    continuations: int
    truncated: int
    retries: int
    groups_dispatched: int
    groups_finished: int
    groups_failed: int
    last_resume_to_dispatch_ms: float | None


RewardFn = Callable[[PromptItem, str], float]


@dataclasses.dataclass
class _Ticket:
    """How many of a group's samples have given back their capacity."""

    samples: int
    settled: int = 0


_DEFAULT_SAMPLING = SamplingParams()


class Rollouter:
    """Dispatches prompts as groups of samples to ``engine`` and puts rewarded groups in ``buffer``.

    ``prompts`` yields :class:`PromptItem`; ``encode``/``decode`` map text to token
    ids; ``reward_fn(item, completion)`` scores a completion. Create and use it on
    the bridge loop; the session wraps it for cells.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        prompts: Iterator[PromptItem],
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        reward_fn: RewardFn,
        buffer: ReplayBuffer,
        group_size: int = 8,
        max_inflight: int = 64,
        max_staleness: int | None = 1,
        groups_per_step: int = 16,
        sampling: SamplingParams = _DEFAULT_SAMPLING,
        max_continuations: int = 4,
        max_retries: int = 2,
        seed: int = 0,
    ) -> None:
        if max_inflight < group_size:
            raise ValueError(f"max_inflight ({max_inflight}) must be >= group_size ({group_size})")
        self._engine = engine
        self._prompts = prompts
        self._returned: collections.deque[PromptItem] = collections.deque()  # taken, not rolled out
        self._encode, self._decode = encode, decode
        self._reward_fn = reward_fn
        self._buffer = buffer
        self._group_size = group_size
        self._max_staleness = max_staleness
        self._groups_per_step = groups_per_step
        self._sampling = sampling
        self._max_continuations = max_continuations
        self._max_retries = max_retries
        self._seed = seed
        self._state = RolloutState.RUNNING
        self._changed = asyncio.Condition()
        self._capacity = asyncio.Semaphore(max_inflight)
        self._version = 0
        self._dispatcher: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._items: dict[asyncio.Task[Any], PromptItem] = {}  # collect()'s groups, while they run
        self._collected: list[PromptItem] = []  # the last collect()'s prompts
        self._errors: list[BaseException] = []
        self._counts = dict.fromkeys(
            (
                "dispatched",
                "finished",
                "failed",
                "continuations",
                "truncated",
                "retries",
                "groups_dispatched",
                "groups_finished",
                "groups_failed",
            ),
            0,
        )
        self._budget_used = 0  # groups dispatched into the buffer (collect()'s do not count)
        self._pause_mode: PauseMode | None = None
        self._ungrouped = 0  # samples done generating whose group has not been put yet
        self._putting = 0  # finished groups waiting for room in the buffer
        self._in_flight = 0
        self._kept_partial = 0
        self._generating = 0  # engine.generate calls outstanding (the WAIT drain waits for 0)
        self._resumed_at: float | None = None
        self._resume_to_dispatch_ms: float | None = None

    # -- state ------------------------------------------------------------------------

    @property
    def state(self) -> RolloutState:
        return self._state

    async def _set_state(self, state: RolloutState) -> None:
        async with self._changed:
            self._state = state
            self._changed.notify_all()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _wait_for(self, predicate: Callable[[], bool]) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: predicate() or self._state is RolloutState.CLOSED)
        if self._state is RolloutState.CLOSED:
            raise ClosedError("the rollouter is closed")

    def _check_open(self) -> None:
        if self._state is RolloutState.CLOSED:
            raise ClosedError("the rollouter is closed")

    # -- control ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start dispatching into the buffer in the background (idempotent)."""
        self._check_open()
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = self._spawn(self._dispatch_loop(), name="rlnb-dispatcher")

    async def stop(self) -> None:
        """Stop dispatching new groups; groups already dispatched still finish."""
        dispatcher, self._dispatcher = self._dispatcher, None
        if dispatcher is not None:
            dispatcher.cancel()
            await asyncio.gather(dispatcher, return_exceptions=True)

    @property
    def dispatching(self) -> bool:
        return self._dispatcher is not None and not self._dispatcher.done()

    async def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> None:
        """Pause generation; see :class:`PauseMode`. Returns once paused, except in
        WAIT mode, where it returns at once and the drain finishes in the background
        (``wait_paused()`` waits for it; ``resume()`` interrupts it)."""
        mode = PauseMode(mode)
        self._check_open()
        if self._state is RolloutState.SYNCING:
            raise RolloutError("cannot pause during a weight sync; try again when it returns")
        if self._state is not RolloutState.RUNNING:
            # Already paused: the same mode (or a milder one) changes nothing, while
            # "abort" still turns a frozen or draining pause into partial rollouts.
            if mode is not PauseMode.ABORT or self._pause_mode is PauseMode.ABORT:
                return
        self._pause_mode = mode
        await self._set_state(RolloutState.PAUSING)
        try:
            await self._engine.pause(mode)
        finally:
            # Even if interrupted, the engine has stopped admitting: never stay PAUSING
            # with nothing left to finish the pause.
            if mode is PauseMode.WAIT:
                self._spawn(self._drain(), name="rlnb-drain")
            else:
                await self._set_state(RolloutState.PAUSED)

    def _drained(self) -> bool:
        # Nothing generating, and every finished sample has reached its group's put.
        return self._generating == 0 and self._ungrouped == 0

    async def _drain(self) -> None:
        await self._wait_for(lambda: self._drained() or self._state is not RolloutState.PAUSING)
        if self._state is RolloutState.PAUSING:
            await self._set_state(RolloutState.PAUSED)

    async def resume(self) -> None:
        """Leave a pause: kept partial rollouts continue and dispatch goes on. Idempotent."""
        self._check_open()
        if self._state is RolloutState.RUNNING:
            return
        if self._state is RolloutState.SYNCING:
            raise RolloutError("cannot resume during a weight sync; it resumes by itself")
        self._resumed_at = time.perf_counter()
        # State first, then one turn of the loop so the dispatcher goes before whatever
        # the engine's resume wakes (a request dispatched a moment early just queues).
        await self._set_state(RolloutState.RUNNING)
        await asyncio.sleep(0)
        await self._engine.resume()

    async def wait_paused(self) -> None:
        """Wait until the state is PAUSED (a WAIT-mode drain has finished)."""
        await self._wait_for(lambda: self._state is RolloutState.PAUSED)

    async def sync_weights(self, weights: Mapping[str, Any], version: int) -> None:
        """The weight-sync transaction: pause (KEEP) → ``update_weights`` → resume.

        On failure the rollouter stays PAUSED and :class:`~rlnb.WeightSyncError` is
        raised: never half-synced. Tokens generated afterwards carry ``version``.
        """
        self._check_open()
        if self._state in (RolloutState.SYNCING, RolloutState.PAUSING):
            raise WeightSyncError(f"cannot sync weights while {self._state.value}")
        previous = self._state
        await self._set_state(RolloutState.SYNCING)
        synced = False
        try:
            if previous is RolloutState.RUNNING:
                await self._engine.pause(PauseMode.KEEP)
            await self._engine.update_weights(weights, version)
            synced = True
        except Exception as exc:
            raise WeightSyncError(
                f"weight sync to version {version} failed; rollouts stay paused (call resume() once fixed)"
            ) from exc
        finally:
            if synced and previous is RolloutState.RUNNING:
                await self._engine.resume()
            await self._set_state(previous if synced else RolloutState.PAUSED)

    async def set_reward_fn(self, reward_fn: RewardFn) -> None:
        """Score every completion from now on with ``reward_fn`` (samples already scored keep theirs)."""
        self._check_open()
        self._reward_fn = reward_fn

    async def set_version(self, version: int) -> None:
        """Tell the rollouter the learner's policy version (opens the staleness bound)."""
        self._check_open()
        self._version = version
        await self._notify()

    # -- errors -------------------------------------------------------------------------

    @property
    def returned_prompts(self) -> list[PromptItem]:
        """Prompts taken from the stream whose rollout was interrupted; they go next."""
        return list(self._returned)

    def give_back(self, items: list[PromptItem]) -> None:
        """Roll ``items`` out before anything else from the stream (a loaded checkpoint's)."""
        self._returned.extendleft(reversed(items))

    def raise_pending(self) -> None:
        """Raise background failures not yet reported: one error chained to the first,
        holding them all in ``.errors``; each failure is reported exactly once."""
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

    def _spawn(self, coro: Any, *, name: str, report: bool = True) -> asyncio.Task[Any]:
        """A supervised task: its failure is stored for ``raise_pending`` when ``report``
        (otherwise whoever awaits it raises it)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done if report else self._tasks.discard)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None and not isinstance(exc, ClosedError):
            self._errors.append(exc)

    # -- dispatch ---------------------------------------------------------------------

    def _staleness_ok(self) -> bool:
        if self._max_staleness is None:
            return True
        allowed = (self._version + self._max_staleness + 1) * self._groups_per_step
        return self._budget_used < allowed

    def _may_dispatch(self) -> bool:
        # A full buffer is backpressure: finished groups waiting to go in stop new dispatch.
        return self._state is RolloutState.RUNNING and self._staleness_ok() and self._putting == 0

    async def _acquire_group(self) -> None:
        taken = 0
        try:
            for _ in range(self._group_size):
                await self._capacity.acquire()
                taken += 1
        except BaseException:  # cancelled half-way (stop(), Ctrl-C): give back what we took
            for _ in range(taken):
                self._capacity.release()
            raise

    async def _dispatch_loop(self) -> None:
        while True:
            await self._wait_for(self._may_dispatch)
            await self._acquire_group()
            if not self._may_dispatch():  # things changed while we waited for capacity
                for _ in range(self._group_size):
                    self._capacity.release()
                continue
            self._budget_used += 1  # only groups bound for the learner count against staleness
            self._spawn_group(to_buffer=True)

    def _spawn_group(self, *, to_buffer: bool) -> asyncio.Task[Any]:
        """Start a group on the next prompt, its capacity already acquired; settle
        what its samples never will."""
        item = self._returned.popleft() if self._returned else next(self._prompts)
        self._note_dispatch()
        ticket = _Ticket(self._group_size)
        task = self._spawn(
            self._run_group(item, ticket, to_buffer=to_buffer),
            name=f"rlnb-group-{item.prompt_id}",
            report=to_buffer,  # collect() raises its groups' failures itself
        )
        task.add_done_callback(lambda _task: self._settle(ticket))
        if not to_buffer:
            self._items[task] = item
        return task

    def _settle(self, ticket: _Ticket) -> None:
        # A group cancelled before its samples ran (Ctrl-C during collect(), close)
        # still owes their capacity and their count.
        missing = ticket.samples - ticket.settled
        for _ in range(missing):
            self._capacity.release()
        self._in_flight -= missing
        self._counts["failed"] += missing
        ticket.settled = ticket.samples

    def _note_dispatch(self) -> None:
        self._counts["groups_dispatched"] += 1
        self._counts["dispatched"] += self._group_size
        self._in_flight += self._group_size
        if self._resumed_at is not None:
            self._resume_to_dispatch_ms = (time.perf_counter() - self._resumed_at) * 1e3
            self._resumed_at = None

    async def collect(self, n_groups: int, *, into: list[Group] | None = None) -> list[Group]:
        """Roll out ``n_groups`` new groups now and return them (not into the buffer).

        If interrupted, their prompts go first next time. ``into``, if given, gets
        the groups too the moment they are all done: a caller whose wait for the
        result is interrupted after that can still find them and hand their prompts
        back with :meth:`give_back_collected`.
        """
        self._check_open()
        if self._state is not RolloutState.RUNNING:
            raise RolloutError(f"rollouts are {self._state.value}; call resume() first")
        tasks: list[asyncio.Task[Any]] = []
        try:
            for _ in range(n_groups):
                await self._acquire_group()
                tasks.append(self._spawn_group(to_buffer=False))
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:  # interrupted: what we started must not go on generating
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # Their prompts go first next time: a retried step rolls out the same
            # prompts with the same per-sample seeds, so it gives the same batch.
            self._returned.extendleft(reversed([self._items[t] for t in tasks]))
            raise
        finally:
            items = [self._items.pop(task) for task in tasks if task in self._items]
        for result in results:
            if isinstance(result, BaseException):
                raise RolloutError(f"rollout failed: {result}") from result
        groups = [r for r in results if isinstance(r, Group)]
        self._collected = items
        if into is not None:
            into.extend(groups)
        return groups

    async def give_back_collected(self) -> None:
        """Hand back the prompts of the last :meth:`collect`: they go first next time
        (for a caller that never used its groups)."""
        self.give_back(self._collected)
        self._collected = []

    async def evaluate(self, items: list[PromptItem], *, max_new_tokens: int) -> list[tuple[str, float]]:
        """Greedy completions and rewards for ``items`` (not put in the buffer)."""
        self._check_open()
        if self._state is not RolloutState.RUNNING:
            raise RolloutError(f"rollouts are {self._state.value}; call resume() first")
        sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)

        async def one(item: PromptItem) -> tuple[str, float]:
            request = GenerateRequest(f"eval.{item.prompt_id}", tuple(self._encode(item.prompt)), sampling)
            result = await self._engine.generate(request)
            completion = self._decode(list(result.token_ids))
            return completion, self._reward(item, completion)

        return list(await asyncio.gather(*map(one, items)))

    # -- one group, one sample ----------------------------------------------------------

    async def _run_group(self, item: PromptItem, ticket: _Ticket, *, to_buffer: bool) -> Group | None:
        prompt_ids = tuple(self._encode(item.prompt))
        base_seed = self._seed * 1_000_003 + item.prompt_id * 1009
        coros = [self._run_sample(item, prompt_ids, i, base_seed + i, ticket) for i in range(self._group_size)]
        results = await asyncio.gather(*coros, return_exceptions=True)
        try:
            for result in results:
                if isinstance(result, asyncio.CancelledError):
                    raise result
            failures = [r for r in results if isinstance(r, BaseException)]
            if failures:
                self._counts["groups_failed"] += 1
                if not to_buffer:
                    raise failures[0]  # collect() raises it to its caller
                self._errors.append(failures[0])  # reported at the next call, counted now
                return None
            samples = tuple(r for r in results if isinstance(r, Sample))
            group = Group(prompt=item.prompt, samples=samples, prompt_id=item.prompt_id)
            self._counts["groups_finished"] += 1
            if to_buffer:
                await self._put(group)
            return group
        finally:
            self._ungrouped -= sum(isinstance(r, Sample) for r in results)
            await self._notify_if_drained()

    async def _put(self, group: Group) -> None:
        try:
            self._buffer.put_nowait(group)
        except BufferFull:  # wait for the learner off the loop; dispatch holds meanwhile
            self._putting += 1
            try:
                await asyncio.to_thread(self._buffer.put, group)
            finally:
                self._putting -= 1
                await self._notify()

    async def _run_sample(
        self, item: PromptItem, prompt_ids: tuple[int, ...], index: int, seed: int, ticket: _Ticket
    ) -> Sample:
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        continuations = 0
        finish = "aborted"
        try:
            while True:
                result = await self._generate_with_retries(item, prompt_ids, index, seed, tokens, continuations)
                tokens += result.token_ids
                logprobs += result.logprobs
                versions += result.versions
                if result.finish_reason != "aborted":
                    finish = result.finish_reason
                    break
                if continuations >= self._max_continuations:
                    self._counts["truncated"] += 1
                    break
                continuations += 1
                self._counts["continuations"] += 1
                self._kept_partial += 1
                self._in_flight -= 1
                try:
                    await self._notify_if_drained()
                    await self._wait_for(lambda: self._state is RolloutState.RUNNING)
                finally:
                    self._kept_partial -= 1
                    self._in_flight += 1
            completion = self._decode(tokens)
            reward = self._reward(item, completion)
        except BaseException:
            self._counts["failed"] += 1
            raise
        else:
            self._counts["finished"] += 1
            self._ungrouped += 1
            return Sample(
                prompt=item.prompt,
                completion=completion,
                token_ids=tuple(tokens),
                logprobs=tuple(logprobs),
                versions=tuple(versions),
                reward=reward,
                finish_reason=finish,
                resumed=continuations,
            )
        finally:
            ticket.settled += 1
            self._in_flight -= 1
            self._capacity.release()
            await self._notify_if_drained()

    async def _notify_if_drained(self) -> None:
        if self._state is RolloutState.PAUSING and self._drained():
            await self._notify()  # a WAIT drain is waiting for this

    async def _generate_with_retries(
        self,
        item: PromptItem,
        prompt_ids: tuple[int, ...],
        index: int,
        seed: int,
        prefix: list[int],
        continuation: int,
    ) -> Any:
        attempt = 0
        while True:
            await self._wait_for(lambda: self._state is RolloutState.RUNNING)
            remaining = self._sampling.max_new_tokens - len(prefix)
            request = GenerateRequest(
                request_id=f"{item.prompt_id}.{index}.{continuation}.{attempt}",
                prompt_ids=prompt_ids,
                sampling=dataclasses.replace(self._sampling, max_new_tokens=max(1, remaining)),
                prefix_ids=tuple(prefix),
                seed=seed * 31 + continuation * 7 + attempt,
            )
            self._generating += 1
            try:
                return await self._engine.generate(request)
            except (asyncio.CancelledError, ClosedError):
                raise
            except Exception as exc:
                attempt += 1
                if attempt > self._max_retries:
                    raise RolloutError(
                        f"generation for prompt {item.prompt_id} sample {index} failed {attempt} times"
                    ) from exc
                self._counts["retries"] += 1
            finally:
                self._generating -= 1

    def _reward(self, item: PromptItem, completion: str) -> float:
        attempt = 0
        while True:
            try:
                return float(self._reward_fn(item, completion))
            except Exception as exc:
                attempt += 1
                if attempt > self._max_retries:
                    raise RolloutError(
                        f"reward function failed {attempt} times on prompt {item.prompt_id} ({item.prompt!r})"
                    ) from exc
                self._counts["retries"] += 1

    # -- figures and lifecycle ------------------------------------------------------------

    def statistics(self) -> RolloutStatistics:
        return RolloutStatistics(
            state=self._state.value,
            dispatching=self.dispatching,
            version=self._version,
            in_flight=self._in_flight,
            kept_partial=self._kept_partial,
            last_resume_to_dispatch_ms=self._resume_to_dispatch_ms,
            **self._counts,
        )

    async def aclose(self) -> None:
        """Cancel every task and wait for them; idempotent."""
        if self._state is RolloutState.CLOSED:
            return
        await self._set_state(RolloutState.CLOSED)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

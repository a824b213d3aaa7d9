"""The asynchronous ``Rollouter``: prompts in, rewarded groups out, pausable at any time.

It runs on the session's bridge loop and decides what to roll out and when: the
policy-lag budget, the dispatch loop, ``collect`` and ``evaluate``. It owns the
parts that do the rest: a :class:`StateMachine` (pause, resume, the weight-sync
transaction, the WAIT drain; every wait is for a predicate of its state), a
:class:`GroupRunner` (one group, one sample), a :class:`TaskSupervisor` (every
task started, and their failures) and the :class:`Counters`. Capacity is a
semaphore of samples. No lock is held across an await of the engine.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from rlnb._errors import (
    ClosedError,
    ConfigError,
    InvalidTypeError,
    InvalidValueError,
    PromptError,
    RolloutError,
    WaitTimeoutError,
)
from rlnb._samples import Group, PromptItem
from rlnb.buffer import ReplayBuffer
from rlnb.config import DataConfig, RolloutConfig
from rlnb.engines import Engine, PauseMode, SamplingParams
from rlnb.rollout._accounting import Counters, RolloutStatistics, Ticket, is_cancellation
from rlnb.rollout._agents import Agents
from rlnb.rollout._conversation import Conversations
from rlnb.rollout._group import GroupRewardFn, GroupRunner, RewardFn
from rlnb.rollout._quiesce import Quiescence
from rlnb.rollout._reward import RunningCall
from rlnb.rollout._served import Served, Serving
from rlnb.rollout._state import RolloutState, StateMachine
from rlnb.rollout._supervisor import TaskSupervisor
from rlnb.rollout._waits import all_or_first_error, call_soon, pause_limited

__all__ = ["Rollouter"]

# What sizes the parts a rollouter makes at the start (its capacity, its thread pools):
# a live change cannot change them.
_FIXED = ("max_inflight", "reward_workers", "env_workers")

# Bad prompts skipped in a row before the stream counts as broken: a task none of whose
# prompts fit would otherwise hold the event loop for ever, looking for one that does.
MAX_SKIPPED_IN_A_ROW = 1000


class Rollouter:
    """Dispatches prompts as groups of samples to ``engine`` and puts rewarded groups in ``buffer``.

    ``config`` (:class:`~rlnb.RolloutConfig`) says how: the group size, the capacity
    (``max_inflight`` samples at once), the policy-lag budget, continuations, retries,
    the reward's timeout and threads; ``sampling`` how samples are drawn (the config's
    temperature, top-p and top-k, with the task's ``max_new_tokens`` where the config
    has none). ``seed`` (``Config.seed``) and each prompt's id seed its samples.
    ``prompts`` yields :class:`PromptItem`; ``encode``/``decode`` map text to token
    ids; ``reward_fn(item, completion)`` scores a completion, and
    ``group_reward_fn(item, samples)`` (if given) each group once its samples are
    done (a task's batched reward functions). Background dispatch
    runs at most ``max_policy_lag`` policy versions ahead of the learner: a group
    started on version v is trained on by a policy at most ``v + max_policy_lag``.
    Groups go to the learner in batches of ``groups_per_step`` in the order they
    finish, so at most ``(max_policy_lag + 1) * groups_per_step`` groups bound for
    the learner are live once a version is published, less the groups the learner
    has taken since (its update in progress will not train them: a batch dispatched
    then is trained one version later: :meth:`updating_on`). Live is counted from what is there now
    (groups generating, plus groups in the buffer's ``train`` partition); a group
    leaves the count when the learner takes it, when it fails or is cancelled, and
    when the buffer evicts it. None: no bound (only a full buffer holds dispatch
    back). Each policy update comes through :meth:`publish`, which opens the budget
    again and wakes dispatch. Create and use it on the bridge
    loop; the session wraps it for cells. ``data``: the prompt pipeline's settings, of
    which it reads ``DataConfig.on_bad_prompt``: "raise" (a prompt the task could not
    make is raised, once, as :class:`~rlnb.PromptError`) or "skip".
    ``conversations``: samples are conversations with environments (:class:`Conversations`).
    ``serving``: how the session's endpoint's calls are encoded (:attr:`served` serves
    them); ``agents``: samples are agent episodes whose calls it serves (:class:`Agents`).
    ``max_context``: the model's context (``ModelConfig.max_len``; None: not known): a
    prompt too long for it with ``max_new_tokens`` is a bad prompt, raised as a
    :class:`~rlnb.RolloutError` naming it before anything is generated, or skipped.
    A live change hands over a new config: :meth:`configure`.
    """

    def __init__(
        self,
        engine: Engine,
        config: RolloutConfig,
        *,
        sampling: SamplingParams,
        prompts: Iterator[PromptItem],
        encode: Callable[[str | tuple[dict[str, str], ...]], list[int]],
        decode: Callable[[list[int]], str],
        reward_fn: RewardFn,
        buffer: ReplayBuffer,
        seed: int,
        data: DataConfig,
        max_context: int | None,
        group_reward_fn: GroupRewardFn | None = None,
        conversations: Conversations | None = None,
        serving: Serving | None = None,
        agents: Agents | None = None,
    ) -> None:
        self._prompts = prompts
        self._buffer = buffer
        self._returned: collections.deque[PromptItem] = collections.deque()  # taken, not rolled out
        self._counts = Counters()
        self._tasks = TaskSupervisor()
        self._machine = StateMachine(engine, tasks=self._tasks, drained=self._counts.drained)
        self._runner = GroupRunner(
            engine,
            config,
            sampling=sampling,
            machine=self._machine,
            tasks=self._tasks,
            counters=self._counts,
            buffer=buffer,
            encode=encode,
            decode=decode,
            reward_fn=reward_fn,
            seed=seed,
            max_context=max_context,
            group_reward_fn=group_reward_fn,
            conversations=conversations,
            serving=serving,
            agents=agents,
        )
        self._capacity = asyncio.Semaphore(config.max_inflight)
        self._version = 0
        self._updating_on = 0  # groups the learner took for the update in progress (updating_on)
        self._dispatcher: asyncio.Task[None] | None = None
        self._items: dict[asyncio.Task[Any], PromptItem] = {}  # collect()'s groups, while they run
        self._collected: list[PromptItem] = []  # the last collect()'s prompts
        self._generating_groups = 0  # groups dispatched into the buffer, not yet ended (collect()'s do not count)
        self._halted = False  # a group bound for the buffer failed: no dispatch until start/resume/set_version
        self._resume_to_dispatch_ms: float | None = None
        self._skip_bad_prompts = data.on_bad_prompt == "skip"

    @property
    def served(self) -> Served | None:
        """The endpoint's calls, served by these rollouts (None: made without ``serving``)."""
        return self._runner.served

    # -- state (the state machine's) ------------------------------------------------------

    @property
    def state(self) -> RolloutState:
        return self._machine.state

    async def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> None:
        """Pause generation; see :class:`PauseMode`. Returns once paused, except in
        WAIT mode, where it returns at once and the drain finishes in the background:
        no group starts, and every group already dispatched runs to its end (the next
        turns of its conversations, retries and kept partial samples included) before
        the state is PAUSED (``wait_paused()`` waits for it; ``resume()`` interrupts it,
        and so does a KEEP or ABORT pause, which pauses at once). A weight sync in
        progress is waited out first."""
        await self._machine.pause(mode)

    async def resume(self) -> None:
        """Leave a pause: kept partial rollouts continue and dispatch goes on (also after
        a failed group halted it). Idempotent. A weight sync in progress is waited out first."""
        await self._machine.resume()
        await self._unhalt()

    async def wait_paused(self, timeout: float | None = None) -> None:
        """Wait until the state is PAUSED (a WAIT-mode drain has finished). Raises
        RolloutError at once if rollouts are running (nothing would pause them), and
        TimeoutError after ``timeout`` s naming what the pause still waits for."""
        if self._machine.state is RolloutState.RUNNING:
            raise RolloutError(
                "wait_paused(): rollouts are running, so nothing will pause them; call sess.rollouts.pause() first"
            )
        try:
            async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a cancel
                await self._machine.wait_paused()
        except TimeoutError:
            state, counts = self._machine.state, self._counts
            what = (
                f"{counts.groups_running} groups ({counts.in_flight} samples) are still in flight: "
                f"{counts.generating} calls to the engine, a reward or an environment in progress, "
                f"{counts.queued} samples waiting to be sent to the engine"
            )
            if state is RolloutState.PAUSED:  # the drain ended as the time ran out
                return
            if state is RolloutState.RUNNING:
                what = "rollouts were resumed meanwhile"
            raise WaitTimeoutError(
                f"wait_paused() waited {timeout:g} s and rollouts are {state.value}: {what}"
            ) from None

    def quiesce(self, timeout: float | None = None) -> Quiescence:
        """Rollouts with nothing generating inside an ``async with`` block (a checkpoint's).

        Entering stops dispatch, resumes (so kept partial rollouts finish too), pauses
        WAIT and waits for the drain: every group in flight ends, in the buffer (held
        there when it is full). Leaving puts rollouts back as they were: running or
        paused, dispatching or not. An interruption anywhere, entering included, puts
        them back too. With a dead engine nothing generates: entering only stops
        dispatch and leaving changes nothing. Entering raises TimeoutError, as
        :meth:`wait_paused` does, when the drain takes longer than ``timeout`` s.
        """
        return Quiescence(self, timeout)

    async def publish(self, weights: Mapping[str, Any], version: int) -> None:
        """A policy update reaches everything that uses its version: the engine gets
        ``weights`` (the weight-sync transaction of :meth:`sync_weights`), then the
        rollouter (policy-lag budget, dispatch woken) and the buffer (staleness
        evictions) get ``version``. All-or-nothing: if the sync fails, nothing else
        changes and :class:`~rlnb.WeightSyncError` is raised with rollouts PAUSED.
        """
        await self._machine.sync_weights(weights, version)
        self._buffer.set_version(version)
        await self.set_version(version)

    async def sync_weights(self, weights: Mapping[str, Any], version: int) -> None:
        """The weight-sync transaction alone: pause (KEEP) → ``update_weights`` → resume
        (:meth:`publish` does this and hands the version on).

        On failure the rollouter stays PAUSED and :class:`~rlnb.WeightSyncError` is
        raised: never half-synced. Tokens generated afterwards carry ``version``.
        """
        await self._machine.sync_weights(weights, version)

    # -- control ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start dispatching into the buffer in the background (idempotent)."""
        self._machine.check_open()
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = self._tasks.spawn(self._dispatch_loop(), name="rlnb-dispatcher")
            # Held groups going into the buffer (the learner took room) let dispatch go on.
            self._buffer.on_admit(functools.partial(call_soon, asyncio.get_running_loop(), self._room_made))
        await self._unhalt()
        # Each async step starts here: dispatch looks at the budget again (groups taken
        # from the buffer by hand gave their places back without waking it).
        await self._machine.notify()

    def _group_ended(self, task: asyncio.Task[Any]) -> None:
        """A group's task is done: a WAIT drain may have waited for it (a group
        cancelled before it started never told it)."""
        if self._machine.draining:
            self._tasks.spawn(self._machine.notify_if_drained(), name="rlnb-drained")

    def _room_made(self) -> None:
        if self._machine.state is not RolloutState.CLOSED:
            self._tasks.spawn(self._machine.notify(), name="rlnb-room")

    async def _unhalt(self) -> None:
        """Let dispatch go on after a failed group halted it (the caller has been told)."""
        if self._halted:
            self._halted = False
            await self._machine.notify()

    async def stop(self) -> None:
        """Stop dispatching new groups; groups already dispatched still finish."""
        dispatcher, self._dispatcher = self._dispatcher, None
        if dispatcher is not None:
            dispatcher.cancel()
            await asyncio.gather(dispatcher, return_exceptions=True)

    @property
    def engine_dead(self) -> bool:
        """Whether the engine has failed as a whole (every call but close then raises EngineError)."""
        return self._machine.engine_dead

    @property
    def dispatching(self) -> bool:
        return self._dispatcher is not None and not self._dispatcher.done()

    async def set_reward_fn(self, reward_fn: RewardFn, group_reward_fn: GroupRewardFn | None = None) -> None:
        """Score every completion from now on with ``reward_fn``, and each group with
        ``group_reward_fn`` (None: none); samples already scored keep theirs."""
        if not callable(reward_fn):
            raise InvalidTypeError(f"the reward function must be callable, got {type(reward_fn).__name__}")
        self._machine.check_open()
        self._runner.reward_fn = reward_fn
        self._runner.group_reward_fn = group_reward_fn

    @property
    def config(self) -> RolloutConfig:
        """The settings in force: the last :meth:`configure`'s, or the constructor's."""
        return self._runner.config

    @property
    def sampling(self) -> SamplingParams:
        """The sampling of groups dispatched now (``max_new_tokens`` the task's limit
        where ``RolloutConfig.max_new_tokens`` is None)."""
        return self._runner.sampling

    async def configure(self, config: RolloutConfig, sampling: SamplingParams) -> None:
        """``config`` and ``sampling`` for every group dispatched from now on (in-flight
        groups keep their size and sampling; ``statistics().old_settings_in_flight``
        counts their samples), and its policy-lag budget, which dispatch looks at again
        at once. Raises ConfigError, changing nothing, where ``config`` changes what
        sized the rollouter when it was made (``max_inflight``, ``reward_workers``,
        ``env_workers``)."""
        old = self._runner.config
        if fixed := [f for f in _FIXED if getattr(config, f) != getattr(old, f)]:
            raise ConfigError(
                f"Rollouter.configure(): RolloutConfig.{fixed[0]} cannot change ({getattr(old, fixed[0])!r} to "
                f"{getattr(config, fixed[0])!r}): it sized the rollouter when it was made; make a new one"
            )
        self._runner.configure(config, sampling)
        if self._machine.state is not RolloutState.CLOSED:
            await self._machine.notify()

    def reward_calls(self) -> list[RunningCall]:
        """The reward calls running now on the reward threads, the longest-running first
        (``args`` are the function, the prompt item and the completion); thread-safe."""
        return self._runner.reward_calls()

    async def set_version(self, version: int) -> None:
        """Tell the rollouter the learner's policy version (opens the policy-lag budget)."""
        self._machine.check_open()
        self._version = version
        self._updating_on = 0
        self._halted = False
        await self._machine.notify()

    # -- prompts and errors -------------------------------------------------------------

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
        self._tasks.raise_pending()

    # -- dispatch ---------------------------------------------------------------------

    @property
    def lag_budget(self) -> tuple[int, int | None]:
        """``(live, allowed)``: groups bound for the learner that are generating or in
        the buffer, and how many the policy-lag budget allows (None: no bound)."""
        live = self._generating_groups + self._buffer.size() + self._buffer.held()
        lag, per_step = self.config.max_policy_lag, self.config.groups_per_step
        if lag is None:
            return live, None
        # The learner is updating on a batch it took: a group dispatched now waits for
        # the update after that one, so the budget is a batch smaller until the publish.
        return live, max(0, (lag + 1) * per_step - self._updating_on)

    def updating_on(self, n_groups: int) -> None:
        """The learner took ``n_groups`` for the update in progress (0: none, the update
        gave them back): until the next :meth:`publish`, dispatch counts them as taken
        for one more version. Any thread (a plain int the dispatcher reads). Groups
        taken from the buffer otherwise (by hand, for a look) only leave the live count."""
        self._updating_on = n_groups

    def why_no_groups(self) -> str:
        """Why background rollouts are not filling the buffer now, in a sentence that
        says what to do (for an error after waiting for a batch in vain)."""
        state, counts = self._machine.state, self._counts
        live, allowed = self.lag_budget
        if state is RolloutState.CLOSED:
            return "the rollouter is closed"
        if state is not RolloutState.RUNNING:
            return f"rollouts are {state.value}: call sess.rollouts.resume()"
        if not self.dispatching:
            return "background rollouts are stopped: call sess.rollouts.start() or step() in async mode"
        if self._halted:
            return "dispatch halted after a group failed: its error was raised; the next step() goes on"
        if held := self._buffer.held():
            return (
                f"the buffer is full ({self._buffer.size()} groups, {held} more finished and waiting for room) "
                "and nothing takes from it"
            )
        groups = self._generating_groups
        generating = f"{counts.in_flight} samples are generating ({groups} groups)"
        if allowed is not None and live >= allowed:
            return (
                f"the policy-lag budget is spent ({live} of {allowed} groups live: {groups} generating, "
                f"{live - groups} in the buffer) and {generating} too slowly: is the engine stuck?"
            )
        return f"{generating}, more slowly than this wait allowed"

    def _policy_lag_ok(self) -> bool:
        live, allowed = self.lag_budget
        return allowed is None or live < allowed

    def _may_dispatch(self) -> bool:
        # A full buffer is backpressure: finished groups held for room stop new dispatch.
        return (
            self._machine.state is RolloutState.RUNNING
            and not self._halted
            and self._policy_lag_ok()
            and self._buffer.held() == 0
        )

    async def _acquire_group(self) -> int:
        """Capacity for one group of the group size in force now; returns that size
        (a group keeps it even if the settings change while it waits)."""
        size, taken = self._runner.group_size, 0
        try:
            for _ in range(size):
                await self._capacity.acquire()
                taken += 1
        except BaseException:  # cancelled half-way (stop(), Ctrl-C): give back what we took
            for _ in range(taken):
                self._capacity.release()
            raise
        return size

    async def _dispatch_loop(self) -> None:
        while True:
            await self._machine.wait_for(self._may_dispatch)
            size = await self._acquire_group()
            if not self._may_dispatch():  # things changed while we waited for capacity
                for _ in range(size):
                    self._capacity.release()
                continue
            self._spawn_group(size, to_buffer=True)  # a bad prompt raises here: the dispatcher's failure is reported
            self._generating_groups += 1  # only groups bound for the learner count against the budget

    async def _into_buffer(self, item: PromptItem, ticket: Ticket) -> None:
        """Roll out a group bound for the buffer. When it ends, its place in the budget
        is in the buffer, or free, so dispatch looks again. A group that did not reach
        the buffer (it failed, or the engine closed under it) halts dispatch until the
        next ``start``, ``resume`` or ``set_version``: a broken reward or a dead engine
        must not eat the prompt stream while nobody is looking."""
        reached = False
        try:
            reached = await self._runner.run(item, ticket, to_buffer=True) is not None
        finally:
            self._generating_groups -= 1
            if not reached:
                self._halted = True
            if self._machine.state is not RolloutState.CLOSED:
                await self._machine.notify()

    def _next_prompt(self) -> PromptItem:
        """The next prompt: a returned one first. A prompt the task could not make
        raises :class:`~rlnb.PromptError` once (the stream goes on), and one too long
        for the model's context (``GroupRunner.too_long``) a :class:`~rlnb.RolloutError`
        naming it, before anything is generated for it; either is skipped and counted
        when ``on_bad_prompt`` is "skip", up to :data:`MAX_SKIPPED_IN_A_ROW` in a row
        (then a RolloutError says that the task makes no prompt the session can use)."""
        for _ in range(MAX_SKIPPED_IN_A_ROW):
            if self._returned:
                item = self._returned.popleft()
            else:
                try:
                    item = next(self._prompts)
                except PromptError as bad:
                    self._note_bad_prompt(str(bad))
                    if not self._skip_bad_prompts:
                        raise
                    continue
            if (why := self._runner.too_long(item)) is None:
                return item
            self._note_bad_prompt(why)
            if not self._skip_bad_prompts:
                raise RolloutError(why)
        raise RolloutError(
            f"{MAX_SKIPPED_IN_A_ROW} prompts in a row were bad and skipped (DataConfig.on_bad_prompt='skip'); "
            f"the last: {self._counts.last_bad_prompt}; the task makes no prompt this session can use: fix it, "
            "or the model's context"
        )

    def _note_bad_prompt(self, why: str) -> None:
        """Count a bad prompt, ``why`` described (``statistics().rollout.last_bad_prompt``)."""
        self._counts.bad_prompts += 1
        self._counts.last_bad_prompt = why

    def _spawn_group(self, size: int, *, to_buffer: bool) -> asyncio.Task[Any]:
        """Start a group of ``size`` samples on the next prompt, its capacity already
        acquired (given back if there is no prompt); its ticket settles what its
        samples never will."""
        try:
            item = self._next_prompt()
        except BaseException:
            for _ in range(size):
                self._capacity.release()
            raise
        self._note_dispatch(size)
        ticket = Ticket(size, self._capacity, self._counts)
        task = self._tasks.spawn(
            self._into_buffer(item, ticket) if to_buffer else self._runner.run(item, ticket, to_buffer=False),
            name=f"rlnb-group-{item.prompt_id}",
            report=to_buffer,  # collect() raises its groups' failures itself
        )
        task.add_done_callback(ticket.settle_rest)
        task.add_done_callback(self._group_ended)
        if not to_buffer:
            self._items[task] = item
        return task

    def _note_dispatch(self, size: int) -> None:
        self._counts.groups_dispatched += 1
        self._counts.dispatched += size
        self._counts.in_flight += size
        if (latency := self._machine.take_resume_latency_ms()) is not None:
            self._resume_to_dispatch_ms = latency

    # -- on demand ------------------------------------------------------------------------

    async def collect(
        self,
        n_groups: int,
        *,
        into: list[Group] | None = None,
        wait: bool = False,
        paused_timeout: float | None = None,
        call: str = "rollout()",
    ) -> list[Group]:
        """Roll out ``n_groups`` new groups now and return them (not into the buffer).

        If interrupted, their prompts go first next time. ``into``, if given, gets
        the groups too the moment they are all done: a caller whose wait for the
        result is interrupted after that can still find them and hand their prompts
        back with :meth:`give_back_collected`. Raises RolloutError unless running
        (``wait``: waits until rollouts run, as background training does through a
        pause), or if a group failed (chained to its failure). ``paused_timeout``:
        once rollouts have been paused this many seconds while it waits, it gives up
        (``TimeoutError`` naming ``call``; nothing is lost, as when interrupted).
        """
        return await pause_limited(self._machine, self._collect(n_groups, into, wait), paused_timeout, call)

    async def _collect(self, n_groups: int, into: list[Group] | None, wait: bool) -> list[Group]:
        if not isinstance(n_groups, int) or isinstance(n_groups, bool) or n_groups < 1:
            raise InvalidValueError(f"rollout(n_groups={n_groups!r}): use a positive int")
        if wait:
            self._machine.check_open()
            await self._machine.wait_running()
        else:
            await self._check_running()
        tasks: list[asyncio.Task[Any]] = []
        try:
            for _ in range(n_groups):
                size = await self._acquire_group()
                tasks.append(self._spawn_group(size, to_buffer=False))
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:  # interrupted: what we started must not go on generating
            for task in tasks:
                task.cancel()
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, Exception) and not is_cancellation(result):
                    self._tasks.report(result)  # it failed before the interrupt: the next call says so
            # Their prompts go first next time: a retried step rolls out the same
            # prompts with the same per-sample seeds, so it gives the same batch.
            self._returned.extendleft(reversed([self._items[t] for t in tasks]))
            raise
        finally:
            items = [self._items.pop(task) for task in tasks if task in self._items]
        errors = [r for r in results if isinstance(r, BaseException)]
        if failures := [e for e in errors if not is_cancellation(e)]:
            raise RolloutError(f"rollout failed: {failures[0]}") from failures[0]
        if errors:  # cancelled under us: the rollouter or the engine closed
            self._machine.check_open()
            raise ClosedError(f"the rollout was cancelled: the engine closed ({errors[0]!r})") from errors[0]
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

    async def evaluate(
        self, items: list[PromptItem], *, max_new_tokens: int, paused_timeout: float | None = None
    ) -> list[tuple[str, float]]:
        """Greedy completions and rewards for ``items`` (not put in the buffer). A pause
        meanwhile is waited out, up to ``paused_timeout`` s (then ``TimeoutError``)."""
        await self._check_running()
        sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
        run = self._runner.evaluate
        results = await pause_limited(
            self._machine, all_or_first_error([run(item, sampling) for item in items]), paused_timeout, "evaluate()"
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:  # the first failure cancelled the rest: nothing goes on generating unseen
            raise RolloutError(f"evaluation failed ({len(errors)} of {len(items)} prompts): {errors[0]}") from errors[0]
        return [r for r in results if not isinstance(r, BaseException)]

    async def complete(
        self, prompts: list[str], sampling: SamplingParams, *, seed: int = 0, paused_timeout: float | None = None
    ) -> list[str]:
        """Completions of the texts ``prompts`` with ``sampling`` (nothing is rewarded or
        buffered). A pause meanwhile is waited out, up to ``paused_timeout`` s."""
        await self._check_running()
        run = self._runner.complete
        coros = [run(f"complete.{i}", p, sampling, seed + i) for i, p in enumerate(prompts)]
        results = await pause_limited(self._machine, all_or_first_error(coros), paused_timeout, "complete()")
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise RolloutError(f"generation failed: {errors[0]}") from errors[0]
        return [r for r in results if not isinstance(r, BaseException)]

    async def _check_running(self) -> None:
        """Raise RolloutError unless rollouts run; a weight sync (milliseconds, and it
        restores the state it found) is waited out, not an error."""
        self._machine.check_open()
        await self._machine.after_sync()
        if (state := self._machine.state) is not RolloutState.RUNNING:
            raise RolloutError(f"rollouts are {state.value}; call sess.rollouts.resume() first")

    # -- figures and lifecycle ------------------------------------------------------------

    def statistics(self) -> RolloutStatistics:
        """A frozen snapshot of the counters; does not block."""
        return self._counts.snapshot(
            state=self._machine.state.value,
            dispatching=self.dispatching,
            version=self._version,
            lag_budget=self.lag_budget,
            last_resume_to_dispatch_ms=self._resume_to_dispatch_ms,
            old_settings_in_flight=self._runner.old_settings_in_flight,
            queued_calls=self._runner.queued_calls(),
        )

    async def aclose(self) -> None:
        """Cancel every task and wait for them; idempotent. Then raise, as
        :meth:`raise_pending` does, the background failures no call has raised."""
        if self._machine.state is RolloutState.CLOSED:
            return
        await self._machine.set(RolloutState.CLOSED)
        self._buffer.on_admit(None)
        await self._tasks.cancel_all()
        self._runner.close()  # queued rewards fail as cancelled; reward threads end
        self._generating_groups = 0  # all ended (a group cancelled before it started never counted down)
        self._tasks.raise_pending()

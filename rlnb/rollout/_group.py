"""One group, one sample: how a dispatched prompt becomes a rewarded group.

Each sample generates (with retries), continues its partial rollout after every
abort pause (up to a limit), is decoded and rewarded; the group then goes to the
buffer or back to ``collect()``. Whatever happens, each sample settles its ticket.

The reward function runs on a :class:`~rlnb.rollout._reward.RewardPool` thread,
never on the event loop: a slow one cannot hold up dispatch, pause or any other
call on the loop, and a hung one fails its sample after ``reward_timeout``. A call of
the engine or of the reward function that raises is tried again, up to
``max_retries`` times, by one ladder (:meth:`GroupRunner._retried`).

With :class:`~rlnb.rollout._conversation.Conversations` (a task with an environment)
a sample is a conversation: its policy turns are generated here, one after another,
and the environment's side (:class:`~rlnb.rollout._conversation.ConversationRunner`)
answers each.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rlnb._errors import ClosedError, EngineError, InvalidValueError, RolloutError
from rlnb._reprs import short_repr
from rlnb._samples import Group, PromptItem, Sample
from rlnb.buffer import ReplayBuffer
from rlnb.config import RolloutConfig
from rlnb.engines import Engine, GenerateRequest, GenerateResult, PromptTooLong, SamplingParams
from rlnb.envs import Episode
from rlnb.rewards import BadValue, Scored, raised_by, reward_value
from rlnb.rollout._accounting import Counters, Ticket, is_cancellation
from rlnb.rollout._agents import AgentRunner, Agents, agent_name
from rlnb.rollout._conversation import ConversationRunner, Conversations, Tokens, transcript
from rlnb.rollout._reward import CallTimedOut, PoolFull, RewardPool, RunningCall
from rlnb.rollout._served import Node, Served, Serving
from rlnb.rollout._state import StateMachine
from rlnb.rollout._supervisor import TaskSupervisor

__all__ = ["GroupRewardFn", "GroupRunner", "RewardFn"]

_T = TypeVar("_T")

# A number, or a Scored with each reward function's value (a task's rewards.score); a
# conversation's is called with env_reward= too.
RewardFn = Callable[..., "float | Scored"]
# Once per group, after its samples: their Scored with the batched functions' values added.
GroupRewardFn = Callable[[PromptItem, list[Sample]], list[Scored]]


def _too_long(
    item: PromptItem, tokens: int, context: int | None, new: int, *, training: bool = True, engine: str | None = None
) -> str:
    """The message for ``item``'s prompt of ``tokens`` tokens, too long for ``context``
    with up to ``new`` new tokens; ``training``: a rollout's prompt (skipping it is a
    fix), not an evaluation's; ``engine``: the engine's own words, where it refused it."""
    refused = "" if engine is None else f" (the engine refused it, not retried: {engine})"
    skip = '; DataConfig(on_bad_prompt="skip") skips such prompts, counting them' if training else ""
    return (
        f"prompt {item.prompt_id} ({short_repr(item.prompt)}) takes {tokens} tokens, and with up to {new} new tokens "
        f"it needs {tokens + new} positions, more than the model's context of {context} (ModelConfig.max_len)"
        f"{refused}: make the task's prompts shorter, or use ModelConfig.max_len >= {tokens + new} or a smaller "
        f"RolloutConfig.max_new_tokens{skip}"
    )


def _scored(reward_fn: RewardFn, item: PromptItem, completion: str, *extra: float | None) -> Scored:
    """``reward_fn(item, completion)`` as a Scored (call it on a reward thread); a
    conversation's scoring also gets ``env_reward=`` (``extra``)."""
    value = reward_fn(item, completion, env_reward=extra[0]) if extra else reward_fn(item, completion)
    if isinstance(value, Scored):
        return value
    total = reward_value(value)
    assert total is not None
    return Scored(total, {})


class GroupRunner:
    """Rolls out groups of ``config.group_size`` samples drawn with ``sampling`` on
    ``engine``, as ``config`` says (continuations, retries, the reward's timeout and
    threads); counts in ``counters``, waits on ``machine``, reports background
    failures to ``tasks``. ``seed`` (``Config.seed``) and each prompt's id seed its
    samples.

    ``reward_fn`` may be replaced at any time: completions scored later use the new
    one. It runs on the runner's :class:`RewardPool`, which :meth:`close` shuts, and
    so does ``group_reward_fn`` (None: none), once per group once its samples are done.
    ``max_context``: the most prompt and completion tokens the model takes
    (``ModelConfig.max_len``; None: not known), against which each prompt is measured
    (:meth:`too_long`). ``conversations``: samples are conversations with environments.
    ``serving``: how the endpoint's calls are encoded (None: no endpoint), served by
    :attr:`served`; ``agents``: samples are agent episodes whose calls it serves.
    """

    def __init__(
        self,
        engine: Engine,
        config: RolloutConfig,
        *,
        sampling: SamplingParams,
        machine: StateMachine,
        tasks: TaskSupervisor,
        counters: Counters,
        buffer: ReplayBuffer,
        encode: Callable[[str | tuple[dict[str, str], ...]], list[int]],
        decode: Callable[[list[int]], str],
        reward_fn: RewardFn,
        seed: int,
        max_context: int | None,
        group_reward_fn: GroupRewardFn | None = None,
        conversations: Conversations | None = None,
        serving: Serving | None = None,
        agents: Agents | None = None,
    ) -> None:
        self._engine = engine
        self.config = config  # of groups started from now on (with ``sampling``: the settings)
        self.sampling = sampling
        self.settings_version = 0  # counts changes of the group size and the sampling
        self._live: collections.Counter[int] = collections.Counter()  # samples of unended groups, by settings_version
        self._max_context = max_context
        self._machine = machine
        self._tasks = tasks
        self._counts = counters
        self._buffer = buffer
        self._encode, self._decode = encode, decode
        self.reward_fn = reward_fn
        self.group_reward_fn = group_reward_fn
        self._rewards = RewardPool(max_workers=config.reward_workers)
        self._conv = (
            None
            if conversations is None
            else ConversationRunner(
                conversations, config, max_context=max_context, counters=counters, tasks=tasks, decode=decode
            )
        )
        self._seed = seed
        self.served: Served | None = None
        if serving is not None:
            self.served = Served(
                serving, policy_turn=self._policy_turn, outside=self._outside, decode=decode, max_context=max_context
            )
        self._agents: AgentRunner | None = None
        if agents is not None:
            assert self.served is not None, "agents need serving: their calls go through the endpoint"
            self._agents = AgentRunner(agents, workers=config.max_inflight)

    @property
    def group_size(self) -> int:
        """Samples of each group started from now on."""
        return self.config.group_size

    def close(self) -> None:
        """Shut the reward and environment pools: queued calls fail as cancelled, idle
        threads end, and a call in progress gets up to a second (no more than
        ``reward_timeout``) to return; after that it is stopped or abandoned (see
        :meth:`RewardPool.close`). Idempotent; call it after the groups are cancelled."""
        timeout = min(1.0, self.config.reward_timeout or 1.0)
        self._rewards.close(timeout=timeout)
        if self._conv is not None:
            self._conv.close(timeout)
        if self._agents is not None:
            self._agents.close(timeout)

    def reward_calls(self) -> list[RunningCall]:
        """Reward and environment calls running now, the longest-running first."""
        calls = self._rewards.running() + ([] if self._conv is None else self._conv.running())
        return sorted(calls, key=lambda call: -call.seconds)

    def queued_calls(self) -> tuple[int, int]:
        """``(rewards, environments)``: calls waiting for a free thread of their pool."""
        return self._rewards.queued(), 0 if self._conv is None else self._conv.queued()

    def configure(self, config: RolloutConfig, sampling: SamplingParams) -> None:
        """Groups started from now on follow ``config`` and are drawn with ``sampling``;
        those already started keep their size and sampling (:attr:`old_settings_in_flight`
        counts them). The pools keep the thread counts they were made with."""
        changed = (config.group_size, sampling) != (self.group_size, self.sampling)
        self.config, self.sampling = config, sampling
        if changed:
            self.settings_version += 1

    @property
    def old_settings_in_flight(self) -> int:
        """Samples of groups not yet ended that were started before the last settings change."""
        return sum(n for version, n in self._live.items() if version < self.settings_version)

    def too_long(self, item: PromptItem, sampling: SamplingParams | None = None) -> str | None:
        """Why ``item``'s prompt leaves the model's context too little room for
        ``sampling.max_new_tokens`` new tokens, as ``Session()`` measures it; None where
        it fits, or where no context is known or samples are conversations (their
        environment gives the prompt, measured then). ``sampling``: an evaluation's
        (the rollouts' in force by default, and the message offers to skip such prompts)."""
        if self._max_context is None or self._conv is not None or self._agents is not None:
            return None
        new = (sampling or self.sampling).max_new_tokens
        tokens = len(self._encode(item.encodable))
        if tokens + new <= self._max_context:
            return None
        return _too_long(item, tokens, self._max_context, new, training=sampling is None)

    async def run(self, item: PromptItem, ticket: Ticket, *, to_buffer: bool) -> Group | None:
        """The group for ``item``, put in the buffer too when ``to_buffer``: as many
        samples as ``ticket`` holds permits for, drawn with the sampling settings in
        force now. A failed group raises when not ``to_buffer`` (collect() reports
        it); otherwise its failure is reported to ``tasks`` and the result is None.
        Counts the group on ``ticket`` (a group cancelled before its end is counted
        by ``settle_rest``)."""
        base_seed = self._seed * 1_000_003 + item.prompt_id * 1009
        sampling, settings = self.sampling, self.settings_version
        self._live[settings] += ticket.samples
        episodes: list[Episode] = []
        try:
            results: list[Sample | BaseException]
            if self._agents is not None:
                prompt_ids, results = await self._run_agent_group(item, ticket, sampling, base_seed)
            else:
                try:
                    if self._conv is None:
                        prompt_ids = tuple(self._encode(item.encodable))
                    else:
                        episodes, prompt_ids = await self._conv.open(item, ticket.samples)
                except RolloutError as exc:  # the environment failed before any sample began
                    prompt_ids, results = (), [exc] * ticket.samples
                    for _ in range(ticket.samples):
                        ticket.end_sample(exc)
                else:
                    envs: list[Episode | None] = list(episodes) or [None] * ticket.samples
                    coros = [
                        self._run_sample(item, prompt_ids, i, base_seed + i, ticket, sampling, envs[i])
                        for i in range(ticket.samples)
                    ]
                    results = await asyncio.gather(*coros, return_exceptions=True)
            samples = [r for r in results if isinstance(r, Sample)]
            if self.group_reward_fn is not None and len(samples) == len(results):
                results = await self._reward_group(self.group_reward_fn, item, samples)
            group = self._end_group(item, prompt_ids, results, ticket, to_buffer=to_buffer)
            if group is not None and to_buffer:
                # Never waits: when the buffer is full the group is held there until the
                # learner takes room (dispatch holds meanwhile), so a pause or a weight
                # sync never waits on the learner.
                self._buffer.put_or_hold(group)
            return group
        finally:  # also when cancelled mid-group: a WAIT drain waits for this group's end
            if episodes:
                assert self._conv is not None
                await self._conv.close_all(item, episodes)
            self._live[settings] -= ticket.samples
            if not self._live[settings]:
                del self._live[settings]
            ticket.ended_task()
            await self._machine.notify_if_drained()

    def _end_group(
        self,
        item: PromptItem,
        prompt_ids: tuple[int, ...],
        results: list[Sample | BaseException],
        ticket: Ticket,
        *,
        to_buffer: bool,
    ) -> Group | None:
        """The group of ``results``, counted on ``ticket``; or its first real failure
        (else its cancellation), raised or reported as ``run`` says."""
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            failures = [e for e in errors if not is_cancellation(e)]
            error = failures[0] if failures else errors[0]
            ticket.end_group(error)
            if isinstance(error, asyncio.CancelledError) or not to_buffer:
                raise error  # collect() raises a failure to its caller
            if failures:
                self._tasks.report(error)  # reported at the next call, counted now
            return None
        samples = tuple(r for r in results if isinstance(r, Sample))
        ticket.end_group(None)
        return Group(prompt=item.prompt, samples=samples, prompt_id=item.prompt_id, prompt_ids=prompt_ids)

    async def _run_sample(
        self,
        item: PromptItem,
        prompt_ids: tuple[int, ...],
        index: int,
        seed: int,
        ticket: Ticket,
        sampling: SamplingParams,
        episode: Episode | None = None,
    ) -> Sample:
        """One sample: a completion, or with ``episode`` a conversation of policy turns
        and the environment's answers."""
        out = Tokens()
        error: BaseException | None = None
        conv = self._conv
        try:
            finish, last = "aborted", ""
            max_turns = 1 if episode is None or conv is None else conv.max_turns
            for turn in range(max_turns):
                out.turns.append(len(out.ids))
                finish = await self._policy_turn(item, prompt_ids, index, seed, turn, sampling, out)
                last = self._decode(out.ids[out.turns[-1] :])
                if episode is None or conv is None or finish == "aborted" or turn == max_turns - 1:
                    break
                answer = await conv.step(item, episode, last, turn)
                if answer.done:
                    break
                if not conv.observe(item, prompt_ids, episode, answer, out):
                    finish = "length"  # the model's context has no room for another turn
                    break
            self._counts.generating += 1  # a WAIT drain waits for the reward too: the sample is not done
            try:
                if episode is None:
                    scored = await self.reward(item, last)
                else:
                    scored = await self.reward(item, last, env_reward=episode.reward)
            finally:
                self._counts.generating -= 1
        except BaseException as exc:
            error = exc  # a failure, or a cancellation (Ctrl-C, close): the ticket tells them apart
            raise
        else:
            return Sample(
                prompt=item.prompt,
                completion=last if conv is None else conv.transcript(out),
                token_ids=tuple(out.ids),
                logprobs=tuple(out.logprobs),
                versions=tuple(out.versions),
                reward=scored.total,
                rewards=dict(scored.parts),
                finish_reason=finish,
                resumed=out.continuations,
                continued_at=tuple(out.continued_at),
                mask=tuple(out.mask),
                turns=tuple(out.turns),
                env_reward=None if episode is None else episode.reward,
            )
        finally:
            ticket.end_sample(error)

    async def _run_agent_group(
        self, item: PromptItem, ticket: Ticket, sampling: SamplingParams, base_seed: int
    ) -> tuple[tuple[int, ...], list[Sample | BaseException]]:
        """A group of agent episodes: their samples (or failures), after the prompt ids
        their first calls share (the group's prompt; the rest of each episode's first
        prompt is in its sample, masked, as an environment's tokens are)."""
        coros = [self._run_episode(item, i, base_seed + i, ticket, sampling) for i in range(ticket.samples)]
        ended = await asyncio.gather(*coros, return_exceptions=True)
        roots = [e[0] for e in ended if not isinstance(e, BaseException)]
        shared = _shared_prefix(roots) if roots else ()
        if roots and not shared:
            error = RolloutError(
                f"the agent's episodes for prompt {item.prompt_id} ({short_repr(item.prompt)}) began with "
                "prompts that share no token: a group's episodes are compared with each other, so give them "
                "the same start (take any randomness from the row)"
            )
            return (), [error if not isinstance(e, BaseException) else e for e in ended]
        results: list[Sample | BaseException] = [
            e if isinstance(e, BaseException) else _with_prompt(e[1], e[0][len(shared) :]) for e in ended
        ]
        return shared, results

    async def _run_episode(
        self, item: PromptItem, index: int, seed: int, ticket: Ticket, sampling: SamplingParams
    ) -> tuple[tuple[int, ...], Sample]:
        """One agent episode, to its end and rewarded: its first prompt's ids, and its
        sample (the tokens after that prompt)."""
        error: BaseException | None = None
        try:
            env_reward, last = await self._agent_episode(item, index, seed, sampling)
            self._counts.generating += 1  # a WAIT drain waits for the reward too: the sample is not done
            try:
                scored = await self.reward(item, last.text, env_reward=env_reward)
            finally:
                self._counts.generating -= 1
        except BaseException as exc:
            error = exc
            raise
        else:
            out = last.out
            return last.root, Sample(
                prompt=item.prompt,
                completion=transcript(out, self._decode),
                token_ids=tuple(out.ids),
                logprobs=tuple(out.logprobs),
                versions=tuple(out.versions),
                reward=scored.total,
                rewards=dict(scored.parts),
                finish_reason=last.finish,
                resumed=out.continuations,
                continued_at=tuple(out.continued_at),
                mask=tuple(out.mask),
                turns=tuple(out.turns),
                env_reward=env_reward,
            )
        finally:
            ticket.end_sample(error)

    async def _agent_episode(
        self, item: PromptItem, index: int, seed: int, sampling: SamplingParams, *, evaluation: bool = False
    ) -> tuple[float | None, Node]:
        """Run one episode of the agent for ``item`` to its end: its reward and the reply
        that ends its sample. RolloutError when the agent fails or made no call."""
        assert self._agents is not None and self.served is not None
        episode = self.served.open_episode(item, index, seed, sampling, evaluation=evaluation)
        try:
            env_reward = await self._agents.run(item, episode.id)
        except BaseException:
            self.served.end_episode(episode, failed=True)
            raise
        last = self.served.end_episode(episode, failed=False)
        if last is None:
            raise RolloutError(
                f"the agent {agent_name(self._agents.spec.agent)!r} made no call to the endpoint for prompt "
                f"{item.prompt_id} ({short_repr(item.prompt)}): it must call the policy through the client "
                "it gets (client.chat.completions.create(...)), whose calls are the sample"
            )
        return env_reward, last

    async def _outside(self, prompt_ids: tuple[int, ...], sampling: SamplingParams, seed: int) -> GenerateResult:
        """One completion of ``prompt_ids`` for a call of the endpoint outside any episode:
        it waits while rollouts are paused, and is continued after an abort pause."""
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        continuation = 0
        while True:
            await self._machine.wait_running()
            left = sampling.max_new_tokens - len(ids)
            request = GenerateRequest(
                f"served.{seed}.{continuation}",
                prompt_ids,
                dataclasses.replace(sampling, max_new_tokens=max(1, left)),
                prefix_ids=tuple(ids),
                seed=seed * 31 + continuation,
            )
            try:
                result = await self._engine.generate(request)
            except PromptTooLong as exc:
                raise InvalidValueError(f"the prompt does not fit the model's context: {exc}") from None
            ids += result.token_ids
            logprobs += result.logprobs
            versions += result.versions
            if result.finish_reason != "aborted" or len(ids) >= sampling.max_new_tokens:
                finish = "length" if result.finish_reason == "aborted" else result.finish_reason
                return GenerateResult(request.request_id, tuple(ids), tuple(logprobs), tuple(versions), finish)
            continuation += 1

    async def _policy_turn(
        self,
        item: PromptItem,
        prompt_ids: tuple[int, ...],
        index: int,
        seed: int,
        turn: int,
        sampling: SamplingParams,
        out: Tokens,
    ) -> str:
        """Generate the policy's turn number ``turn`` into ``out``, continued after each
        abort pause (up to the limit); its finish reason ("aborted": truncated)."""
        start = len(out.ids)
        while True:
            budget = sampling.max_new_tokens - (len(out.ids) - start)
            limit = self._room(prompt_ids, out)
            if limit is not None and limit < 1:
                return "length"
            result = await self._generate_with_retries(
                item, prompt_ids, index, seed, out.ids, out.continuations, sampling,
                budget if limit is None else min(budget, limit), turn,
            )  # fmt: skip
            out.add(result.token_ids, result.logprobs, result.versions, policy=True)
            if result.finish_reason != "aborted":
                return result.finish_reason
            if out.continuations >= self.config.max_continuations:
                self._counts.truncated += 1
                return "aborted"
            out.continuations += 1
            out.continued_at.append(len(out.ids))
            self._counts.continuations += 1
            await self._keep_partial()

    def _room(self, prompt_ids: tuple[int, ...], out: Tokens) -> int | None:
        """Tokens the model's context has left after a conversation or an episode so far
        (None: no limit, and a single completion is measured before it starts: :meth:`too_long`)."""
        if self._conv is not None:
            return self._conv.room(prompt_ids, out)
        if self._agents is None or self._max_context is None:
            return None
        return self._max_context - len(prompt_ids) - len(out.ids)

    async def _keep_partial(self) -> None:
        """Hold an aborted sample, counted as kept partial, until rollouts run again
        (or a WAIT pause drains its group)."""
        self._counts.kept_partial += 1
        self._counts.in_flight -= 1
        try:
            await self._machine.wait_generating()
        finally:
            self._counts.kept_partial -= 1
            self._counts.in_flight += 1

    async def _generate_with_retries(
        self,
        item: PromptItem,
        prompt_ids: tuple[int, ...],
        index: int,
        seed: int,
        prefix: list[int],
        continuation: int,
        sampling: SamplingParams,
        budget: int | None = None,
        turn: int = 0,
    ) -> GenerateResult:
        """Generate after ``prefix`` at most ``budget`` tokens (None: what ``sampling``
        leaves after the prefix), retried after an engine's failure (:meth:`_retried`)."""
        new = max(1, sampling.max_new_tokens - len(prefix) if budget is None else budget)
        later = f".t{turn}" if turn else ""  # a conversation's later turns: ids and seeds of their own
        seed += turn * 100_003

        async def attempt(n: int) -> GenerateResult:
            self._counts.queued += 1
            try:
                await self._machine.wait_generating()  # a WAIT drain lets its groups go on
            finally:
                self._counts.queued -= 1
            request = GenerateRequest(
                request_id=f"{item.prompt_id}.{index}.{continuation}.{n}{later}",
                prompt_ids=prompt_ids,
                sampling=dataclasses.replace(sampling, max_new_tokens=new),
                prefix_ids=tuple(prefix),
                seed=seed * 31 + continuation * 7 + n,
            )
            self._counts.generating += 1
            try:
                return await self._engine.generate(request)
            except PromptTooLong as exc:  # the same request fails again: not bad luck
                tokens = len(prompt_ids) + len(prefix) if exc.tokens is None else exc.tokens
                context = self._max_context if exc.context is None else exc.context
                raise RolloutError(_too_long(item, tokens, context, new, engine=str(exc))) from exc
            finally:
                self._counts.generating -= 1

        def gave_up(attempts: int, exc: Exception) -> str:
            return f"generation for prompt {item.prompt_id} sample {index} failed {attempts} times: {exc!r}"

        return await self._retried(attempt, gave_up)

    async def _retried(self, call: Callable[[int], Awaitable[_T]], gave_up: Callable[[int, Exception], str]) -> _T:
        """``await call(attempt)`` for attempt 0, 1, ...: a call that raises is made
        again, each retry counted, up to ``max_retries`` times; then a RolloutError with
        ``gave_up(attempts, error)``, chained to the last error. Never retried: a
        cancellation, a closed part, a RolloutError (the call's own verdict: a timeout,
        a bad value, a prompt too long) and a dead engine (it does not come back; the
        state machine is told). The one retry ladder of generations and rewards."""
        attempt = 0
        while True:
            try:
                return await call(attempt)
            except (asyncio.CancelledError, ClosedError, RolloutError):
                raise
            except EngineError as exc:
                self._machine.engine_died(exc)
                raise
            except Exception as exc:
                attempt += 1
                if attempt > self.config.max_retries:
                    raise RolloutError(gave_up(attempt, exc)) from exc
                self._counts.retries += 1

    async def evaluate(self, item: PromptItem, sampling: SamplingParams) -> tuple[str, float]:
        """One completion of ``item`` with ``sampling`` (not retried) and its reward. An
        abort pause meanwhile is waited out and the completion continued from its
        prefix (greedy decoding continues exactly), so a pause never scores half an answer.
        With an environment, one conversation: its transcript and reward."""
        if self._agents is not None:
            return await self._evaluate_episode(item, sampling)
        conv = self._conv
        if conv is None:
            if (why := self.too_long(item, sampling)) is not None:
                raise RolloutError(why)
            prompt_ids = tuple(self._encode(item.encodable))
            ids = await self._eval_turn(item, prompt_ids, [], sampling, 0, None)
            completion = self._decode(ids)
            return completion, await self._evaluation_reward(item, completion, completion, ids, None)
        episodes, prompt_ids = await conv.open(item, 1)
        episode, out, last = episodes[0], Tokens(), ""
        try:
            for turn in range(conv.max_turns):
                out.turns.append(len(out.ids))
                room = conv.room(prompt_ids, out)
                if room is not None and room < 1:
                    break
                ids = await self._eval_turn(item, prompt_ids, out.ids, sampling, turn, room)
                out.add(ids, [0.0] * len(ids), [0] * len(ids), policy=True)
                last = self._decode(ids)
                if turn == conv.max_turns - 1:
                    break
                answer = await conv.step(item, episode, last, turn)
                if answer.done or not conv.observe(item, prompt_ids, episode, answer, out):
                    break
            text = conv.transcript(out)
            return text, await self._evaluation_reward(item, last, text, out.ids, out.mask, env_reward=episode.reward)
        finally:
            await conv.close_all(item, episodes)

    async def _evaluate_episode(self, item: PromptItem, sampling: SamplingParams) -> tuple[str, float]:
        """One agent episode of an evaluation, each of its calls greedy: its transcript and reward."""
        env_reward, last = await self._agent_episode(item, 0, 0, sampling, evaluation=True)
        text = transcript(last.out, self._decode)
        return text, await self._evaluation_reward(
            item, last.text, text, last.out.ids, last.out.mask, env_reward=env_reward
        )

    async def _evaluation_reward(
        self,
        item: PromptItem,
        last: str,
        completion: str,
        token_ids: list[int],
        mask: list[int] | None,
        **env: float | None,
    ) -> float:
        """An evaluation's reward, as training's: the per-sample functions score ``last``
        (the last turn), then the batched ones (TRL's too) score the sample, a group of one."""
        scored = await self.reward(item, last, **env)
        if self.group_reward_fn is None:
            return scored.total
        sample = Sample(
            prompt=item.prompt,
            completion=completion,
            token_ids=tuple(token_ids),
            mask=tuple(mask) if mask else (),
            turns=(0,),
            reward=scored.total,
            rewards=dict(scored.parts),
            env_reward=env.get("env_reward"),
        )
        [result] = await self._reward_group(self.group_reward_fn, item, [sample])
        if isinstance(result, BaseException):
            raise result
        assert result.reward is not None
        return result.reward

    async def _eval_turn(
        self,
        item: PromptItem,
        prompt_ids: tuple[int, ...],
        prefix: list[int],
        sampling: SamplingParams,
        turn: int,
        room: int | None,
    ) -> list[int]:
        """One policy turn of an evaluation after ``prefix``: its token ids, continued
        after abort pauses, at most ``sampling.max_new_tokens`` (and ``room``)."""
        budget = sampling.max_new_tokens if room is None else min(sampling.max_new_tokens, room)
        tokens: list[int] = []
        continuation = 0
        while True:
            await self._machine.wait_running()
            left = budget - len(tokens)
            suffix = (f".{continuation}" if continuation else "") + (f".t{turn}" if turn else "")
            request = GenerateRequest(
                f"eval.{item.prompt_id}{suffix}",
                prompt_ids,
                dataclasses.replace(sampling, max_new_tokens=max(1, left)),
                prefix_ids=(*prefix, *tokens),
            )
            result = await self._engine.generate(request)
            tokens += result.token_ids
            if result.finish_reason != "aborted" or len(tokens) >= budget:
                return tokens
            continuation += 1

    async def complete(self, request_id: str, prompt: str, sampling: SamplingParams, seed: int) -> str:
        """One completion of the text ``prompt`` (not retried, not rewarded)."""
        request = GenerateRequest(request_id, tuple(self._encode(prompt)), sampling, seed=seed)
        result = await self._engine.generate(request)
        return self._decode(list(result.token_ids))

    async def _reward_group(
        self, group_reward_fn: GroupRewardFn, item: PromptItem, samples: list[Sample]
    ) -> list[Sample | BaseException]:
        """``samples`` rescored by ``group_reward_fn`` (on a worker thread, as
        :meth:`reward`); its failure, as a RolloutError, fails the group."""
        where = f"prompt {item.prompt_id} ({short_repr(item.prompt)}), the group's {len(samples)} completions"
        self._counts.generating += 1  # as a sample's reward: a WAIT drain waits for it
        try:
            scored: list[Scored] = await self._call_reward(
                group_reward_fn, item, samples, where=where, key=group_reward_fn, group=item
            )
        except RolloutError as exc:
            return [exc]
        finally:
            self._counts.generating -= 1
        return [
            dataclasses.replace(sample, reward=s.total, rewards=dict(s.parts))
            for sample, s in zip(samples, scored, strict=True)
        ]

    async def reward(self, item: PromptItem, completion: str, **env: float | None) -> Scored:
        """``reward_fn(item, completion)`` as a Scored, run on a worker thread.

        A function that raises is retried up to ``max_retries`` times. Raises
        RolloutError naming the prompt and completion (and the function, of several)
        when it still raises (chained), runs past ``reward_timeout`` (not retried: a
        hung call would only hang again), or returns anything but a finite number (not
        retried: a bug, not bad luck); ClosedError once closed. Once a call times out,
        the calls of the same function queued behind it and the later calls of
        ``item``'s group fail at once: the group is failed already, and each would only
        wait out its own timeout, one after another. A conversation's last turn is
        scored with ``env_reward=`` its environment's reward."""
        where = f"prompt {item.prompt_id} ({short_repr(item.prompt)}), completion {short_repr(completion)}"
        extra = (env["env_reward"],) if "env_reward" in env else ()
        fn = self.reward_fn
        scored: Scored = await self._call_reward(_scored, fn, item, completion, *extra, where=where, key=fn, group=item)
        return scored

    async def _call_reward(self, fn: Callable[..., Any], /, *args: Any, where: str, key: Any, group: Any) -> Any:
        """``fn(*args)`` on a reward thread, retried and its failures explained as :meth:`reward` says."""
        timeout = self.config.reward_timeout

        async def attempt(n: int) -> Any:
            try:
                return await self._rewards.call(fn, *args, timeout=timeout, key=key, group=group, label=where)
            except BadValue as bad:
                which = "the reward function" if bad.function is None else f"the reward function {bad.function!r}"
                may_skip = "" if bad.function is None else ", or None when it does not apply to the sample"
                raise RolloutError(
                    f"{which} returned {bad.value} for {where}; "
                    "a reward must be a finite number within float32's range, |r| <= 3.4e38 "
                    f"(int, float, bool or a numpy/torch scalar){may_skip}"
                ) from None
            except CallTimedOut as late:
                if late.earlier:
                    raise RolloutError(f"the reward function was not called for {where}: {late.fate()}") from None
                raise RolloutError(
                    f"the reward function did not return within reward_timeout={timeout} s for {where}; "
                    f"not retried ({late.fate()})"
                ) from None
            except PoolFull as full:
                raise RolloutError(
                    f"the reward function was not called for {where}: {full} earlier calls that timed out "
                    "or were cancelled are still running; is it stuck?"
                ) from None

        def gave_up(attempts: int, exc: Exception) -> str:
            name = raised_by(exc)
            which = "the reward function" if name is None else f"the reward function {name!r}"
            return f"{which} raised {exc!r} {attempts} times for {where}"

        return await self._retried(attempt, gave_up)


def _shared_prefix(prompts: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The longest start every one of ``prompts`` has."""
    first = prompts[0]
    n = len(first)
    for other in prompts[1:]:
        n = min(n, len(other))
        n = next((i for i in range(n) if other[i] != first[i]), n)
    return first[:n]


def _with_prompt(sample: Sample, rest: tuple[int, ...]) -> Sample:
    """``sample`` with ``rest`` of its prompt (past the group's) in front, masked (a
    turn of its own: a sample's first turn starts at its first token)."""
    if not rest:
        return sample
    k = len(rest)
    version = sample.versions[0] if sample.versions else 0
    return dataclasses.replace(
        sample,
        token_ids=(*rest, *sample.token_ids),
        logprobs=(*([0.0] * k), *sample.logprobs),
        versions=(*([version] * k), *sample.versions),
        mask=(*([0] * k), *sample.mask),
        turns=(0, *(t + k for t in sample.turns)),  # a sample's turns start at its first token
        continued_at=tuple(c + k for c in sample.continued_at),
    )

"""One group, one sample: how a dispatched prompt becomes a rewarded group.

Each sample generates (with retries), continues its partial rollout after every
abort pause (up to a limit), is decoded and rewarded; the group then goes to the
buffer or back to ``collect()``. Whatever happens, each sample settles its ticket.

The reward function runs on a :class:`~rlnb.rollout._reward.RewardPool` thread,
never on the event loop: a slow one cannot hold up dispatch, pause or any other
call on the loop, and a hung one fails its sample after ``reward_timeout``.

With :class:`Conversations` (a task with an environment) a sample is a
conversation: each sample gets an environment of its own (made, reset, stepped and
closed on the reward pool too), and its turns alternate: the policy generates
(continued after abort pauses as above), the environment answers, its observation's
tokens join the sample with mask 0, and the policy speaks again.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rlnb._errors import ClosedError, EngineError, RolloutError
from rlnb._reprs import short_repr
from rlnb._samples import Group, PromptItem, Sample
from rlnb.buffer import ReplayBuffer
from rlnb.engines import Engine, GenerateRequest, GenerateResult, PromptTooLong, SamplingParams
from rlnb.envs import EnvError, Episode, Turn
from rlnb.rewards import BadValue, Scored, raised_by, reward_value
from rlnb.rollout._accounting import Counters, Ticket, is_cancellation
from rlnb.rollout._reward import CallTimedOut, PoolFull, RewardPool, RunningCall
from rlnb.rollout._state import StateMachine
from rlnb.rollout._supervisor import TaskSupervisor

__all__ = ["Conversations", "GroupRewardFn", "GroupRunner", "RewardFn"]

# A number, or a Scored with each reward function's value (a task's rewards.score); a
# conversation's is called with env_reward= too.
RewardFn = Callable[..., "float | Scored"]
# Once per group, after its samples: their Scored with the batched functions' values added.
GroupRewardFn = Callable[[PromptItem, list[Sample]], list[Scored]]


@dataclasses.dataclass(frozen=True)
class Conversations:
    """How samples become conversations: ``env()`` makes each sample's environment
    (:mod:`rlnb.envs`); at most ``max_turns`` policy turns; ``encode_prompt(prompt,
    tools)`` gives a prompt's ids (``tools``: the environment's schemas, for a chat
    template); ``encode_observation(observation)`` an observation's (ValueError for
    what the tokenizer cannot encode); ``max_context``: the most prompt and
    conversation tokens the model takes (None: no limit here); ``workers``: the
    environments' calls that may run at once (threads ``rlnb-env-N``, beside the
    reward's)."""

    env: Callable[[], Any]
    max_turns: int
    encode_prompt: Callable[[Any, list[dict[str, Any]] | None], list[int]]
    encode_observation: Callable[[Any], list[int]]
    max_context: int | None = None
    workers: int = 8


def _row(item: PromptItem) -> dict[str, Any]:
    """What an environment's ``reset`` gets: the prompt's record, with its prompt, answer and id."""
    return {"prompt": item.prompt, "answer": item.answer, "prompt_id": item.prompt_id, **(item.row or {})}


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


class _Opening:
    """The environments one group is opening on a reward thread, for a caller that may
    stop waiting (cancelled, or past the timeout) while they are made: whichever of the
    two comes last closes them, so none is left open."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.episodes: list[Episode] = []
        self.done = False  # the thread has made (and reset) them all, or failed
        self.abandoned = False  # the caller stopped waiting

    def give_up(self) -> list[Episode]:
        """The caller stops waiting: the environments it must close itself (those the
        thread finished making); the thread closes any it makes from now on."""
        with self.lock:
            self.abandoned = True
            return list(self.episodes) if self.done else []


def _open_episodes(
    factory: Callable[[], Any], row: dict[str, Any], n: int, opening: _Opening
) -> tuple[list[Episode], Any]:
    """``n`` environments from ``factory``, each reset with ``row``, and the prompt they
    gave (None: the task's). Closes those made before raising, and all of them when
    ``opening`` was given up meanwhile (on a reward thread)."""
    episodes = opening.episodes
    try:
        prompts = []
        for _ in range(n):
            episodes.append(Episode(factory))
            prompts.append(episodes[-1].reset(row))
        if any(p != prompts[0] for p in prompts):
            raise EnvError(
                f"{episodes[0].name}.reset() gave different prompts for the {n} samples of one group "
                f"({short_repr(prompts[0])} and {short_repr(next(p for p in prompts if p != prompts[0]))}): "
                "a group's samples share the row, so take any randomness from it (e.g. seed with row['prompt_id'])"
            )
    except BaseException:
        with opening.lock:
            opening.done = True
        _close_episodes(episodes)
        raise
    with opening.lock:
        opening.done = True
        abandoned = opening.abandoned
    if abandoned:  # nobody takes them: close them here
        _close_episodes(episodes)
    return list(episodes), prompts[0]


def _close_episodes(episodes: list[Episode]) -> None:
    """Close each episode; raise the first failure once all are closed."""
    first: BaseException | None = None
    for episode in episodes:
        try:
            episode.close()
        except Exception as exc:
            first = first or exc
    if first is not None:
        raise first


def _scored(reward_fn: RewardFn, item: PromptItem, completion: str, *extra: float | None) -> Scored:
    """``reward_fn(item, completion)`` as a Scored (call it on a reward thread); a
    conversation's scoring also gets ``env_reward=`` (``extra``)."""
    value = reward_fn(item, completion, env_reward=extra[0]) if extra else reward_fn(item, completion)
    if isinstance(value, Scored):
        return value
    total = reward_value(value)
    assert total is not None
    return Scored(total, {})


@dataclasses.dataclass
class _Tokens:
    """A sample's tokens as they come: the parallel lists a Sample keeps, and where
    its turns and continuations began."""

    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    turns: list[int] = dataclasses.field(default_factory=list)
    continued_at: list[int] = dataclasses.field(default_factory=list)
    continuations: int = 0

    def add(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], *, policy: bool) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.mask += [int(policy)] * len(ids)


class GroupRunner:
    """Rolls out groups of ``group_size`` samples on ``engine``; counts in ``counters``,
    waits on ``machine``, reports background failures to ``tasks``.

    ``reward_fn`` may be replaced at any time: completions scored later use the new
    one. It runs on the runner's :class:`RewardPool`, which :meth:`close` shuts, and
    so does ``group_reward_fn`` (None: none), once per group once its samples are done.
    ``max_context``: the most prompt and completion tokens the model takes (None: not
    known), against which each prompt is measured (:meth:`too_long`).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        machine: StateMachine,
        tasks: TaskSupervisor,
        counters: Counters,
        buffer: ReplayBuffer,
        encode: Callable[[str | tuple[dict[str, str], ...]], list[int]],
        decode: Callable[[list[int]], str],
        reward_fn: RewardFn,
        group_size: int,
        sampling: SamplingParams,
        max_continuations: int,
        max_retries: int,
        reward_timeout: float | None,
        seed: int,
        reward_workers: int = 1,
        group_reward_fn: GroupRewardFn | None = None,
        conversations: Conversations | None = None,
        max_context: int | None = None,
    ) -> None:
        self._engine = engine
        self._conversations = conversations
        self._max_context = max_context  # the model's, ModelConfig.max_len (None: not known here)
        self._machine = machine
        self._tasks = tasks
        self._counts = counters
        self._buffer = buffer
        self._encode, self._decode = encode, decode
        self.reward_fn = reward_fn
        self.group_reward_fn = group_reward_fn
        self.group_size = group_size  # of groups started from now on (``settings``)
        self.sampling = sampling
        self.settings_version = 0  # counts changes of the two above
        self._live: collections.Counter[int] = collections.Counter()  # samples of unended groups, by settings_version
        self._max_continuations = max_continuations
        self._max_retries = max_retries
        self._reward_timeout = reward_timeout
        self._rewards = RewardPool(max_workers=reward_workers)
        # Each sample has an environment of its own, so their calls need no order: a
        # pool of their own, so that slow tools neither queue behind one another one
        # at a time nor hold up the rewards (which keep their order).
        self._envs = None if conversations is None else RewardPool(max_workers=conversations.workers, name="env")
        self._seed = seed

    def close(self) -> None:
        """Shut the reward and environment pools: queued calls fail as cancelled, idle
        threads end, and a call in progress gets up to a second (no more than
        ``reward_timeout``) to return; after that it is stopped or abandoned (see
        :meth:`RewardPool.close`). Idempotent; call it after the groups are cancelled."""
        timeout = min(1.0, self._reward_timeout or 1.0)
        self._rewards.close(timeout=timeout)
        if self._envs is not None:
            self._envs.close(timeout=timeout)

    def reward_calls(self) -> list[RunningCall]:
        """Reward and environment calls running now, the longest-running first."""
        calls = self._rewards.running() + ([] if self._envs is None else self._envs.running())
        return sorted(calls, key=lambda call: -call.seconds)

    def queued_calls(self) -> tuple[int, int]:
        """``(rewards, environments)``: calls waiting for a free thread of their pool."""
        return self._rewards.queued(), 0 if self._envs is None else self._envs.queued()

    def configure(self, group_size: int, sampling: SamplingParams) -> None:
        """Groups started from now on have ``group_size`` samples drawn with ``sampling``;
        those already started keep theirs (:attr:`old_settings_in_flight` counts them)."""
        if (group_size, sampling) != (self.group_size, self.sampling):
            self.group_size, self.sampling = group_size, sampling
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
        if self._max_context is None or self._conversations is not None:
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
            try:
                if self._conversations is None:
                    prompt_ids = tuple(self._encode(item.encodable))
                else:
                    episodes, prompt_ids = await self._open_conversations(item, ticket.samples)
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
                await self._close_conversations(item, episodes)
            self._live[settings] -= ticket.samples
            if not self._live[settings]:
                del self._live[settings]
            ticket.ended_task()
            await self._machine.notify_if_drained()

    async def _open_conversations(self, item: PromptItem, n: int) -> tuple[list[Episode], tuple[int, ...]]:
        """``n`` environments for ``item``'s samples, reset, and the prompt's ids."""
        conv = self._conversations
        assert conv is not None
        where = f"prompt {item.prompt_id} ({short_repr(item.prompt)})"
        opening = _Opening()
        try:
            episodes, prompt = await self._call_env(
                _open_episodes, conv.env, _row(item), n, opening, where=where, what="reset"
            )
        except BaseException:  # cancelled, or it ran past the timeout: the environments made are closed
            if made := opening.give_up():
                await self._close_conversations(item, made)
            raise
        try:
            prompt = item.encodable if prompt is None else prompt
            ids = tuple(conv.encode_prompt(prompt, episodes[0].tools))
        except ValueError as exc:
            await self._close_conversations(item, episodes)
            raise RolloutError(f"the environment's prompt for {where} cannot be encoded: {exc}") from None
        if conv.max_context is not None and len(ids) >= conv.max_context:  # no room for one policy token
            await self._close_conversations(item, episodes)
            env = getattr(conv.env, "__qualname__", type(conv.env).__name__)
            raise RolloutError(
                f"the environment {env}'s reset gave {where} a prompt of {len(ids)} tokens "
                f"({short_repr(prompt)}), and the model's context is {conv.max_context} (ModelConfig.max_len): "
                "no room for the policy to answer; make reset return a shorter prompt, or use a larger max_len"
            )
        return episodes, ids

    async def _close_conversations(self, item: PromptItem, episodes: list[Episode]) -> None:
        """Close a group's environments on the reward pool, also when the group was
        cancelled; a failure to close is reported to ``tasks``, the group stands. A
        cancel that lands while they close (the session closes) lets the close end
        first (it is bounded by the reward timeout), then is raised."""
        closing = asyncio.ensure_future(
            self._call_env(_close_episodes, episodes, where=f"prompt {item.prompt_id}", what="close")
        )
        cancelled = False
        while not closing.done():
            try:
                await asyncio.shield(closing)
            except asyncio.CancelledError:
                cancelled = True
        try:
            closing.result()
        except RolloutError as exc:
            self._tasks.report(exc)
        except (asyncio.CancelledError, ClosedError):  # the pool was closed: it runs nothing more
            pass
        if cancelled:
            raise asyncio.CancelledError

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
        out = _Tokens()
        error: BaseException | None = None
        try:
            finish, last = "aborted", ""
            max_turns = 1 if episode is None else self._max_turns
            for turn in range(max_turns):
                out.turns.append(len(out.ids))
                finish = await self._policy_turn(item, prompt_ids, index, seed, turn, sampling, out)
                last = self._decode(out.ids[out.turns[-1] :])
                if episode is None or finish == "aborted" or turn == max_turns - 1:
                    break
                answer = await self._env_step(item, episode, last, turn)
                if answer.done:
                    break
                if not self._observe(item, prompt_ids, episode, answer, out):
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
            conversation = episode is not None
            return Sample(
                prompt=item.prompt,
                completion=self._transcript(out) if conversation else last,
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

    async def _policy_turn(
        self,
        item: PromptItem,
        prompt_ids: tuple[int, ...],
        index: int,
        seed: int,
        turn: int,
        sampling: SamplingParams,
        out: _Tokens,
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
            if out.continuations >= self._max_continuations:
                self._counts.truncated += 1
                return "aborted"
            out.continuations += 1
            out.continued_at.append(len(out.ids))
            self._counts.continuations += 1
            await self._keep_partial()

    def _room(self, prompt_ids: tuple[int, ...], out: _Tokens) -> int | None:
        """Tokens the model's context has left after the conversation so far (None: no limit known)."""
        conv = self._conversations
        if conv is None or conv.max_context is None:
            return None
        return conv.max_context - len(prompt_ids) - len(out.ids)

    @property
    def _max_turns(self) -> int:
        return 1 if self._conversations is None else self._conversations.max_turns

    async def _env_step(self, item: PromptItem, episode: Episode, text: str, turn: int) -> Turn:
        """The environment's answer to policy turn ``turn`` (on the reward pool; a WAIT
        drain waits for it, as for a reward)."""
        where = f"prompt {item.prompt_id} ({short_repr(item.prompt)}), turn {turn + 1} {short_repr(text)}"
        self._counts.generating += 1
        try:
            answer: Turn = await self._call_env(episode.step, text, where=where, what="step")
        finally:
            self._counts.generating -= 1
        return answer

    def _observe(
        self, item: PromptItem, prompt_ids: tuple[int, ...], episode: Episode, answer: Turn, out: _Tokens
    ) -> bool:
        """Add ``answer``'s observation to ``out`` (mask 0); False when the context
        has no room for it and one more policy token. RolloutError when the tokenizer
        cannot encode it."""
        conv = self._conversations
        assert conv is not None
        if answer.observation is None:
            return True
        try:
            ids = conv.encode_observation(answer.observation)
        except ValueError as exc:
            raise RolloutError(
                f"{episode.name}.step() observation for prompt {item.prompt_id} cannot be encoded: {exc}; "
                "add the missing characters to Task.alphabet (the built-in tokenizer), or change the observation"
            ) from None
        room = self._room(prompt_ids, out)
        if room is not None and room - len(ids) < 1:
            return False
        version = out.versions[-1] if out.versions else 0
        out.add(ids, [0.0] * len(ids), [version] * len(ids), policy=False)
        return True

    def _transcript(self, out: _Tokens) -> str:
        """A conversation's text: each run of one speaker's tokens decoded on its own
        (a policy turn's text ends at its end-of-sequence)."""
        parts, start = [], 0
        bounds = sorted({*out.turns, *[i for i in range(1, len(out.mask)) if out.mask[i] != out.mask[i - 1]]})
        for end in [*bounds[1:], len(out.ids)]:
            parts.append(self._decode(out.ids[start:end]))
            start = end
        return "".join(parts)

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
        leaves after the prefix), retried after an engine's failure."""
        attempt = 0
        if budget is None:
            budget = sampling.max_new_tokens - len(prefix)
        later = f".t{turn}" if turn else ""  # a conversation's later turns: ids and seeds of their own
        seed += turn * 100_003
        while True:
            self._counts.queued += 1
            try:
                await self._machine.wait_generating()  # a WAIT drain lets its groups go on
            finally:
                self._counts.queued -= 1
            request = GenerateRequest(
                request_id=f"{item.prompt_id}.{index}.{continuation}.{attempt}{later}",
                prompt_ids=prompt_ids,
                sampling=dataclasses.replace(sampling, max_new_tokens=max(1, budget)),
                prefix_ids=tuple(prefix),
                seed=seed * 31 + continuation * 7 + attempt,
            )
            self._counts.generating += 1
            try:
                return await self._engine.generate(request)
            except (asyncio.CancelledError, ClosedError):
                raise
            except EngineError as exc:  # a dead engine does not come back: no retry
                self._machine.engine_died(exc)
                raise
            except PromptTooLong as exc:  # the same request fails again: not bad luck
                tokens = len(prompt_ids) + len(prefix) if exc.tokens is None else exc.tokens
                context = self._max_context if exc.context is None else exc.context
                raise RolloutError(_too_long(item, tokens, context, max(1, budget), engine=str(exc))) from exc
            except Exception as exc:
                attempt += 1
                if attempt > self._max_retries:
                    raise RolloutError(
                        f"generation for prompt {item.prompt_id} sample {index} failed {attempt} times: {exc!r}"
                    ) from exc
                self._counts.retries += 1
            finally:
                self._counts.generating -= 1

    async def evaluate(self, item: PromptItem, sampling: SamplingParams) -> tuple[str, float]:
        """One completion of ``item`` with ``sampling`` (not retried) and its reward. An
        abort pause meanwhile is waited out and the completion continued from its
        prefix (greedy decoding continues exactly), so a pause never scores half an answer.
        With an environment, one conversation: its transcript and reward."""
        if self._conversations is None:
            if (why := self.too_long(item, sampling)) is not None:
                raise RolloutError(why)
            prompt_ids = tuple(self._encode(item.encodable))
            completion = self._decode(await self._eval_turn(item, prompt_ids, [], sampling, 0, None))
            return completion, (await self.reward(item, completion)).total
        episodes, prompt_ids = await self._open_conversations(item, 1)
        episode, out, last = episodes[0], _Tokens(), ""
        try:
            for turn in range(self._max_turns):
                out.turns.append(len(out.ids))
                room = self._room(prompt_ids, out)
                if room is not None and room < 1:
                    break
                ids = await self._eval_turn(item, prompt_ids, out.ids, sampling, turn, room)
                out.add(ids, [0.0] * len(ids), [0] * len(ids), policy=True)
                last = self._decode(ids)
                if turn == self._max_turns - 1:
                    break
                answer = await self._env_step(item, episode, last, turn)
                if answer.done or not self._observe(item, prompt_ids, episode, answer, out):
                    break
            scored = await self.reward(item, last, env_reward=episode.reward)
            return self._transcript(out), scored.total
        finally:
            await self._close_conversations(item, episodes)

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

    async def _call_env(self, fn: Callable[..., Any], /, *args: Any, where: str, what: str) -> Any:
        """``fn(*args)``, an environment's method, on an environment thread with the
        reward timeout; not retried (an environment has state). RolloutError, chained, when
        it raises or runs past the timeout (an ``async def`` method is cancelled); a
        step's timeout fails at once the steps queued behind it and the later steps of
        its group's environments. ClosedError once closed."""
        episode = getattr(fn, "__self__", None)
        group = episode.group if what == "step" and isinstance(episode, Episode) else None
        key = (what, self._conversations.env) if group is not None and self._conversations is not None else None
        try:
            assert self._envs is not None
            value = await self._envs.call(fn, *args, timeout=self._reward_timeout, key=key, group=group, label=where)
        except CallTimedOut as late:
            if late.earlier:
                raise RolloutError(f"the environment's {what} was not called for {where}: {late.fate()}") from None
            raise RolloutError(
                f"the environment's {what} did not return within reward_timeout={self._reward_timeout} s "
                f"for {where} ({late.fate()})"
            ) from None
        except PoolFull as full:
            raise RolloutError(
                f"the environment's {what} was not called for {where}: {full} earlier calls that timed out "
                "or were cancelled are still running; is it stuck?"
            ) from None
        except (asyncio.CancelledError, ClosedError):
            raise
        except EnvError as exc:
            raise RolloutError(f"{exc} (for {where})") from None
        except Exception as exc:
            raise RolloutError(f"the environment's {what} raised {exc!r} for {where}") from exc
        if what == "reset":  # a group's environments: a timeout of one's step fails the others' at once
            Episode.new_group(value[0])
        return value

    async def _call_reward(self, fn: Callable[..., Any], /, *args: Any, where: str, key: Any, group: Any) -> Any:
        """``fn(*args)`` on a reward thread, retried and its failures explained as :meth:`reward` says."""
        attempt = 0
        while True:
            try:
                return await self._rewards.call(
                    fn, *args, timeout=self._reward_timeout, key=key, group=group, label=where
                )
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
                    f"the reward function did not return within reward_timeout={self._reward_timeout} s for {where}; "
                    f"not retried ({late.fate()})"
                ) from None
            except PoolFull as full:
                raise RolloutError(
                    f"the reward function was not called for {where}: {full} earlier calls that timed out "
                    "or were cancelled are still running; is it stuck?"
                ) from None
            except (asyncio.CancelledError, ClosedError):
                raise
            except EngineError as exc:  # a dead engine does not come back: no retry
                self._machine.engine_died(exc)
                raise
            except Exception as exc:
                attempt += 1
                if attempt > self._max_retries:
                    name = raised_by(exc)
                    which = "the reward function" if name is None else f"the reward function {name!r}"
                    raise RolloutError(f"{which} raised {exc!r} {attempt} times for {where}") from exc
                self._counts.retries += 1

"""One group, one sample: how a dispatched prompt becomes a rewarded group.

Each sample generates (with retries), continues its partial rollout after every
abort pause (up to a limit), is decoded and rewarded; the group then goes to the
buffer or back to ``collect()``. Whatever happens, each sample settles its ticket.

The reward function runs on a :class:`~rlnb.rollout._reward.RewardPool` thread,
never on the event loop: a slow one cannot hold up dispatch, pause or any other
call on the loop, and a hung one fails its sample after ``reward_timeout``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable
from typing import Any

from rlnb._errors import ClosedError, EngineError, RolloutError
from rlnb._reprs import short_repr
from rlnb._samples import Group, PromptItem, Sample
from rlnb.buffer import ReplayBuffer
from rlnb.engines import Engine, GenerateRequest, GenerateResult, SamplingParams
from rlnb.rewards import BadValue, Scored, reward_value
from rlnb.rollout._accounting import Counters, Ticket, is_cancellation
from rlnb.rollout._reward import CallTimedOut, PoolFull, RewardPool, RunningCall
from rlnb.rollout._state import StateMachine
from rlnb.rollout._supervisor import TaskSupervisor

__all__ = ["GroupRewardFn", "GroupRunner", "RewardFn"]

# A number, or a Scored with each reward function's value (a task's rewards.score).
RewardFn = Callable[[PromptItem, str], "float | Scored"]
# Once per group, after its samples: their Scored with the batched functions' values added.
GroupRewardFn = Callable[[PromptItem, list[Sample]], list[Scored]]


def _scored(reward_fn: RewardFn, item: PromptItem, completion: str) -> Scored:
    """``reward_fn(item, completion)`` as a Scored (call it on a reward thread)."""
    value = reward_fn(item, completion)
    if isinstance(value, Scored):
        return value
    total = reward_value(value)
    assert total is not None
    return Scored(total, {})


class GroupRunner:
    """Rolls out groups of ``group_size`` samples on ``engine``; counts in ``counters``,
    waits on ``machine``, reports background failures to ``tasks``.

    ``reward_fn`` may be replaced at any time: completions scored later use the new
    one. It runs on the runner's :class:`RewardPool`, which :meth:`close` shuts, and
    so does ``group_reward_fn`` (None: none), once per group once its samples are done.
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
    ) -> None:
        self._engine = engine
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
        self._seed = seed

    def close(self) -> None:
        """Shut the reward pool: queued reward calls fail as cancelled, idle threads
        end, and a call in progress gets up to a second (no more than
        ``reward_timeout``) to return; after that its thread ends when it returns.
        Idempotent; call it after the groups are cancelled."""
        self._rewards.close(timeout=min(1.0, self._reward_timeout or 1.0))

    def reward_calls(self) -> list[RunningCall]:
        """Reward calls running now, the longest-running first."""
        return self._rewards.running()

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

    async def run(self, item: PromptItem, ticket: Ticket, *, to_buffer: bool) -> Group | None:
        """The group for ``item``, put in the buffer too when ``to_buffer``: as many
        samples as ``ticket`` holds permits for, drawn with the sampling settings in
        force now. A failed group raises when not ``to_buffer`` (collect() reports
        it); otherwise its failure is reported to ``tasks`` and the result is None.
        Counts the group on ``ticket`` (a group cancelled before its end is counted
        by ``settle_rest``)."""
        prompt_ids = tuple(self._encode(item.encodable))
        base_seed = self._seed * 1_000_003 + item.prompt_id * 1009
        sampling, settings = self.sampling, self.settings_version
        coros = [self._run_sample(item, prompt_ids, i, base_seed + i, ticket, sampling) for i in range(ticket.samples)]
        self._live[settings] += ticket.samples
        try:
            results: list[Sample | BaseException] = await asyncio.gather(*coros, return_exceptions=True)
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
        finally:  # also when cancelled mid-group: its finished samples must not hold up a WAIT drain
            self._live[settings] -= ticket.samples
            if not self._live[settings]:
                del self._live[settings]
            ticket.grouped()
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
    ) -> Sample:
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        continuations = 0
        continued_at: list[int] = []  # where each continuation began, in tokens
        finish = "aborted"
        error: BaseException | None = None
        try:
            while True:
                result = await self._generate_with_retries(
                    item, prompt_ids, index, seed, tokens, continuations, sampling
                )
                tokens += result.token_ids
                logprobs += result.logprobs
                versions += result.versions
                if result.finish_reason != "aborted":
                    finish = result.finish_reason
                    break
                if continuations >= self._max_continuations:
                    self._counts.truncated += 1
                    break
                continuations += 1
                continued_at.append(len(tokens))
                self._counts.continuations += 1
                await self._keep_partial()
            completion = self._decode(tokens)
            self._counts.generating += 1  # a WAIT drain waits for the reward too: the sample is not done
            try:
                scored = await self.reward(item, completion)
            finally:
                self._counts.generating -= 1
        except BaseException as exc:
            error = exc  # a failure, or a cancellation (Ctrl-C, close): the ticket tells them apart
            raise
        else:
            return Sample(
                prompt=item.prompt,
                completion=completion,
                token_ids=tuple(tokens),
                logprobs=tuple(logprobs),
                versions=tuple(versions),
                reward=scored.total,
                rewards=dict(scored.parts),
                finish_reason=finish,
                resumed=continuations,
                continued_at=tuple(continued_at),
            )
        finally:
            ticket.end_sample(error)
            await self._machine.notify_if_drained()

    async def _keep_partial(self) -> None:
        """Hold an aborted sample, counted as kept partial, until rollouts run again."""
        self._counts.kept_partial += 1
        self._counts.in_flight -= 1
        try:
            await self._machine.notify_if_drained()
            await self._machine.wait_running()
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
    ) -> GenerateResult:
        attempt = 0
        while True:
            self._counts.queued += 1
            try:
                await self._machine.wait_running()
            finally:
                self._counts.queued -= 1
            remaining = sampling.max_new_tokens - len(prefix)
            request = GenerateRequest(
                request_id=f"{item.prompt_id}.{index}.{continuation}.{attempt}",
                prompt_ids=prompt_ids,
                sampling=dataclasses.replace(sampling, max_new_tokens=max(1, remaining)),
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
            except Exception as exc:
                attempt += 1
                if attempt > self._max_retries:
                    raise RolloutError(
                        f"generation for prompt {item.prompt_id} sample {index} failed {attempt} times"
                    ) from exc
                self._counts.retries += 1
            finally:
                self._counts.generating -= 1

    async def evaluate(self, item: PromptItem, sampling: SamplingParams) -> tuple[str, float]:
        """One completion of ``item`` with ``sampling`` (not retried) and its reward. An
        abort pause meanwhile is waited out and the completion continued from its
        prefix (greedy decoding continues exactly), so a pause never scores half an answer."""
        prompt_ids = tuple(self._encode(item.encodable))
        tokens: list[int] = []
        continuation = 0
        while True:
            await self._machine.wait_running()
            left = sampling.max_new_tokens - len(tokens)
            request = GenerateRequest(
                f"eval.{item.prompt_id}" + (f".{continuation}" if continuation else ""),
                prompt_ids,
                dataclasses.replace(sampling, max_new_tokens=max(1, left)),
                prefix_ids=tuple(tokens),
            )
            result = await self._engine.generate(request)
            tokens += result.token_ids
            if result.finish_reason != "aborted" or len(tokens) >= sampling.max_new_tokens:
                break
            continuation += 1
        completion = self._decode(tokens)
        return completion, (await self.reward(item, completion)).total

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
            scored: list[Scored] = await self._call_reward(group_reward_fn, item, samples, where=where)
        except RolloutError as exc:
            return [exc]
        finally:
            self._counts.generating -= 1
        return [
            dataclasses.replace(sample, reward=s.total, rewards=dict(s.parts))
            for sample, s in zip(samples, scored, strict=True)
        ]

    async def reward(self, item: PromptItem, completion: str) -> Scored:
        """``reward_fn(item, completion)`` as a Scored, run on a worker thread.

        A function that raises is retried up to ``max_retries`` times. Raises
        RolloutError naming the prompt and completion when it still raises (chained),
        runs past ``reward_timeout`` (not retried: a hung call would only hang again,
        on one more thread), or returns anything but a finite number (not retried: a
        bug, not bad luck); ClosedError once closed."""
        where = f"prompt {item.prompt_id} ({short_repr(item.prompt)}), completion {short_repr(completion)}"
        scored: Scored = await self._call_reward(_scored, self.reward_fn, item, completion, where=where)
        return scored

    async def _call_reward(self, fn: Callable[..., Any], /, *args: Any, where: str) -> Any:
        """``fn(*args)`` on a reward thread, retried and its failures explained as :meth:`reward` says."""
        attempt = 0
        while True:
            try:
                return await self._rewards.call(fn, *args, timeout=self._reward_timeout)
            except BadValue as bad:
                which = "the reward function" if bad.function is None else f"the reward function {bad.function!r}"
                may_skip = "" if bad.function is None else ", or None when it does not apply to the sample"
                raise RolloutError(
                    f"{which} returned {bad.value} for {where}; "
                    "a reward must be a finite number within float32's range, |r| <= 3.4e38 "
                    f"(int, float, bool or a numpy/torch scalar){may_skip}"
                ) from None
            except CallTimedOut as late:
                raise RolloutError(
                    f"the reward function did not return within reward_timeout={self._reward_timeout} s for {where}; "
                    f"not retried (its thread {late.thread} ends when the call returns)"
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
                    raise RolloutError(f"the reward function raised {exc!r} {attempt} times for {where}") from exc
                self._counts.retries += 1

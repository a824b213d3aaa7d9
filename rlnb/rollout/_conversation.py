"""Conversations: samples whose turns alternate between the policy and an environment.

With :class:`Conversations` (a task with an environment) each sample gets an
environment of its own, made, reset, stepped and closed on a pool of threads
``rlnb-env-N`` (:class:`~rlnb.rollout._reward.RewardPool`), never on the event loop.
Its turns alternate: the policy generates (the group runner's part, continued after
abort pauses), the environment answers, its observation's tokens join the sample with
mask 0, and the policy speaks again. :class:`ConversationRunner` is the environments'
side of that exchange; :class:`Tokens` holds a sample's tokens as they come, one turn
or many.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rlnb._errors import ClosedError, RolloutError
from rlnb._reprs import short_repr
from rlnb._samples import PromptItem
from rlnb.config import RolloutConfig
from rlnb.envs import EnvError, Episode, Turn
from rlnb.rollout._accounting import Counters
from rlnb.rollout._reward import CallTimedOut, PoolFull, RewardPool, RunningCall
from rlnb.rollout._supervisor import TaskSupervisor

__all__ = ["ConversationRunner", "Conversations", "Tokens", "row_of", "transcript"]


@dataclasses.dataclass(frozen=True)
class Conversations:
    """How samples become conversations: ``env()`` makes each sample's environment
    (:mod:`rlnb.envs`); at most ``max_turns`` policy turns; ``encode_prompt(prompt,
    tools)`` gives a prompt's ids (``tools``: the environment's schemas, for a chat
    template); ``encode_observation(observation)`` an observation's (ValueError for
    what the tokenizer cannot encode). How many environment calls run at once is
    ``RolloutConfig.env_workers``; the model's context is the rollouter's ``max_context``."""

    env: Callable[[], Any]
    max_turns: int
    encode_prompt: Callable[[Any, list[dict[str, Any]] | None], list[int]]
    encode_observation: Callable[[Any], list[int]]


@dataclasses.dataclass
class Tokens:
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


def transcript(out: Tokens, decode: Callable[[list[int]], str]) -> str:
    """A conversation's text: each run of one speaker's tokens decoded on its own
    (a policy turn's text ends at its end-of-sequence)."""
    parts, start = [], 0
    bounds = sorted({*out.turns, *[i for i in range(1, len(out.mask)) if out.mask[i] != out.mask[i - 1]]})
    for end in [*bounds[1:], len(out.ids)]:
        parts.append(decode(out.ids[start:end]))
        start = end
    return "".join(parts)


def row_of(item: PromptItem) -> dict[str, Any]:
    """What an environment's ``reset`` gets: the prompt's record, with its prompt, answer and id."""
    return {"prompt": item.prompt, "answer": item.answer, "prompt_id": item.prompt_id, **(item.row or {})}


class _Opening:
    """The environments one group is opening on an environment thread, for a caller that
    may stop waiting (cancelled, or past the timeout) while they are made: whichever of
    the two comes last closes them, so none is left open."""

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
    ``opening`` was given up meanwhile (on an environment thread)."""
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


class ConversationRunner:
    """The environments of a group runner's conversations (``spec``): each group's are
    opened, stepped and closed on a pool of ``config.env_workers`` threads of their
    own, each call bounded by ``config.reward_timeout``; counts in ``counters``, reports
    failures to close to ``tasks``. ``max_context``: the most prompt and conversation
    tokens the model takes (None: no limit here); ``decode`` gives a transcript's text.
    """

    def __init__(
        self,
        spec: Conversations,
        config: RolloutConfig,
        *,
        max_context: int | None,
        counters: Counters,
        tasks: TaskSupervisor,
        decode: Callable[[list[int]], str],
    ) -> None:
        self.spec = spec
        self._max_context = max_context
        self._timeout = config.reward_timeout
        self._counts, self._tasks, self._decode = counters, tasks, decode
        # Each sample has an environment of its own, so their calls need no order: a
        # pool of their own, so that slow tools neither queue behind one another one
        # at a time nor hold up the rewards (which keep their order).
        self._pool = RewardPool(max_workers=config.env_workers, name="env")

    @property
    def max_turns(self) -> int:
        return self.spec.max_turns

    def close(self, timeout: float) -> None:
        """Shut the environments' pool (see :meth:`RewardPool.close`); idempotent."""
        self._pool.close(timeout=timeout)

    def running(self) -> list[RunningCall]:
        """The environment calls running now."""
        return self._pool.running()

    def queued(self) -> int:
        """Environment calls waiting for a free thread."""
        return self._pool.queued()

    async def open(self, item: PromptItem, n: int) -> tuple[list[Episode], tuple[int, ...]]:
        """``n`` environments for ``item``'s samples, reset, and the prompt's ids.
        RolloutError when they fail, or the prompt cannot be encoded or leaves no room."""
        spec = self.spec
        where = f"prompt {item.prompt_id} ({short_repr(item.prompt)})"
        opening = _Opening()
        try:
            episodes, prompt = await self._call(
                _open_episodes, spec.env, row_of(item), n, opening, where=where, what="reset"
            )
        except BaseException:  # cancelled, or it ran past the timeout: the environments made are closed
            if made := opening.give_up():
                await self.close_all(item, made)
            raise
        try:
            prompt = item.encodable if prompt is None else prompt
            ids = tuple(spec.encode_prompt(prompt, episodes[0].tools))
        except ValueError as exc:
            await self.close_all(item, episodes)
            raise RolloutError(f"the environment's prompt for {where} cannot be encoded: {exc}") from None
        if self._max_context is not None and len(ids) >= self._max_context:  # no room for one policy token
            await self.close_all(item, episodes)
            env = getattr(spec.env, "__qualname__", type(spec.env).__name__)
            raise RolloutError(
                f"the environment {env}'s reset gave {where} a prompt of {len(ids)} tokens "
                f"({short_repr(prompt)}), and the model's context is {self._max_context} (ModelConfig.max_len): "
                "no room for the policy to answer; make reset return a shorter prompt, or use a larger max_len"
            )
        return episodes, ids

    async def close_all(self, item: PromptItem, episodes: list[Episode]) -> None:
        """Close a group's environments on the pool, also when the group was
        cancelled; a failure to close is reported to ``tasks``, the group stands. A
        cancel that lands while they close (the session closes) lets the close end
        first (it is bounded by the reward timeout), then is raised."""
        closing = asyncio.ensure_future(
            self._call(_close_episodes, episodes, where=f"prompt {item.prompt_id}", what="close")
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

    async def step(self, item: PromptItem, episode: Episode, text: str, turn: int) -> Turn:
        """The environment's answer to policy turn ``turn`` (a WAIT drain waits for it,
        as for a reward)."""
        where = f"prompt {item.prompt_id} ({short_repr(item.prompt)}), turn {turn + 1} {short_repr(text)}"
        self._counts.generating += 1
        try:
            answer: Turn = await self._call(episode.step, text, where=where, what="step")
        finally:
            self._counts.generating -= 1
        return answer

    def observe(
        self, item: PromptItem, prompt_ids: tuple[int, ...], episode: Episode, answer: Turn, out: Tokens
    ) -> bool:
        """Add ``answer``'s observation to ``out`` (mask 0); False when the context
        has no room for it and one more policy token. RolloutError when the tokenizer
        cannot encode it."""
        if answer.observation is None:
            return True
        try:
            ids = self.spec.encode_observation(answer.observation)
        except ValueError as exc:
            raise RolloutError(
                f"{episode.name}.step() observation for prompt {item.prompt_id} cannot be encoded: {exc}; "
                "add the missing characters to Task.alphabet (the built-in tokenizer), or change the observation"
            ) from None
        room = self.room(prompt_ids, out)
        if room is not None and room - len(ids) < 1:
            return False
        version = out.versions[-1] if out.versions else 0
        out.add(ids, [0.0] * len(ids), [version] * len(ids), policy=False)
        return True

    def room(self, prompt_ids: tuple[int, ...], out: Tokens) -> int | None:
        """Tokens the model's context has left after the conversation so far (None: no limit known)."""
        if self._max_context is None:
            return None
        return self._max_context - len(prompt_ids) - len(out.ids)

    def transcript(self, out: Tokens) -> str:
        """A conversation's text (:func:`transcript`)."""
        return transcript(out, self._decode)

    async def _call(self, fn: Callable[..., Any], /, *args: Any, where: str, what: str) -> Any:
        """``fn(*args)``, an environment's method, on an environment thread with the
        reward timeout; not retried (an environment has state). RolloutError, chained, when
        it raises or runs past the timeout (an ``async def`` method is cancelled); a
        step's timeout fails at once the steps queued behind it and the later steps of
        its group's environments. ClosedError once closed."""
        episode = getattr(fn, "__self__", None)
        group = episode.group if what == "step" and isinstance(episode, Episode) else None
        key = (what, self.spec.env) if group is not None else None
        try:
            value = await self._pool.call(fn, *args, timeout=self._timeout, key=key, group=group, label=where)
        except CallTimedOut as late:
            if late.earlier:
                raise RolloutError(f"the environment's {what} was not called for {where}: {late.fate()}") from None
            raise RolloutError(
                f"the environment's {what} did not return within reward_timeout={self._timeout} s "
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

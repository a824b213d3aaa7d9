"""Calls served by the session's endpoint (:mod:`rlnb.serve`), and the agent episodes
they make up.

An agent (``Task(agent=...)``) is user code that talks to the policy through an
OpenAI-compatible client: each of its calls arrives here as a :class:`ServedRequest`
naming its episode. The calls of one episode form a tree: a call whose messages (or
token ids) extend an earlier call's prompt and reply continues that branch, so its
new messages are the environment's tokens (mask 0, as in a conversation) and its
reply the policy's; any other call starts a branch of its own. When the agent
returns, the branch of its last call is the episode's sample; the completions of
other branches are counted as served but not trained (``unused``), never dropped
silently. A call that names no episode (a client in a cell, an evaluation) is
served by the engine as it stands and counted ``outside``.

Generation goes through the :class:`~rlnb.rollout._group.GroupRunner`'s own policy
turn, so an episode's call waits while rollouts are paused, is continued after an
abort pause, is retried after an engine's failure and carries each token's policy
version, exactly as a conversation's turn does.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import itertools
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from rlnb._errors import InvalidValueError
from rlnb._samples import Group, PromptItem, Sample, messages_text
from rlnb.engines import GenerateResult, SamplingParams
from rlnb.envs import tool_calls
from rlnb.rollout._conversation import Tokens

__all__ = [
    "EpisodeRecord",
    "Node",
    "Served",
    "ServedCall",
    "ServedChoice",
    "ServedRequest",
    "ServedStatistics",
    "Serving",
]

# How many served calls the log keeps for the explorer (the oldest go first).
LOG_SIZE = 512

# A policy turn into ``out``: (item, root prompt ids, sample index, seed, turn, sampling, out) -> finish reason.
PolicyTurn = Callable[[PromptItem, tuple[int, ...], int, int, int, SamplingParams, Tokens], Awaitable[str]]
# One generation outside any episode, continued after abort pauses: (prompt ids, sampling, seed).
Outside = Callable[[tuple[int, ...], SamplingParams, int], Awaitable[GenerateResult]]


@dataclasses.dataclass(frozen=True)
class Serving:
    """How the endpoint's calls become token ids: ``encode_prompt(messages_or_text,
    tools)`` a prompt's (a chat template's, with its generation prompt);
    ``encode_observation(messages_or_text)`` what comes between a reply and the next
    call's reply; ``syntax``: how the policy writes a tool call ("json" with a chat
    template, "call" for the built-in policy: see :func:`rlnb.envs.tool_calls`)."""

    encode_prompt: Callable[[Any, list[dict[str, Any]] | None], list[int]]
    encode_observation: Callable[[Any], list[int]]
    syntax: str


@dataclasses.dataclass(frozen=True)
class ServedRequest:
    """One call of the endpoint, as the rollouts serve it.

    messages: a chat call's messages (OpenAI's ``{"role", "content", ...}``); or
    prompt: a text call's prompt, text or token ids.
    tools: the tools' JSON schemas a chat template describes to the model.
    sampling: how to sample (its ``max_new_tokens`` the call's ``max_tokens``).
    n: completions to draw. stop: strings that end a completion (not returned).
    seed: a seed of the caller's (None: one of the rollouts').
    episode: the agent episode it belongs to (None: served outside rollouts).
    """

    messages: tuple[Mapping[str, Any], ...] | None = None
    prompt: str | tuple[int, ...] | None = None
    tools: tuple[Mapping[str, Any], ...] | None = None
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    episode: str | None = None


@dataclasses.dataclass(frozen=True)
class ServedChoice:
    """One completion served: the prompt's and its own token ids, the behaviour
    log-prob and policy version of each of its tokens, its text and tool calls
    (``(name, arguments)``; the text is then what the turn said besides them)."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: str  # "stop", "length", or "tool_calls"
    text: str
    tool_calls: tuple[tuple[str, dict[str, Any]], ...] = ()
    content: str = ""  # the text less its tool calls (all of it without any)

    @property
    def version(self) -> int | None:
        """The newest policy version among its tokens (None: no token)."""
        return max(self.versions) if self.versions else None


@dataclasses.dataclass(frozen=True)
class ServedCall:
    """A served call in the log (:meth:`Served.log`): when, for which episode (and
    prompt id), the request's messages or prompt, and what it got."""

    time: float
    episode: str | None
    prompt_id: int | None
    request: ServedRequest
    choices: tuple[ServedChoice, ...]
    seconds: float
    fate: str = (
        "served"  # then "sampled", "unused" (off the episode's last branch), "failed", "evaluated"; or "outside"
    )

    def as_group(self) -> Group:
        """The call as a group to look into (``sess.explore(calls)``): a sample per
        choice, its tokens all the policy's, no reward."""
        request = self.request
        if request.messages is not None:
            prompt = messages_text(request.messages)
        else:
            prompt = request.prompt if isinstance(request.prompt, str) else f"<{len(request.prompt or ())} token ids>"
        samples = tuple(
            Sample(
                prompt=prompt,
                completion=choice.text,
                token_ids=choice.token_ids,
                logprobs=choice.logprobs,
                versions=choice.versions,
                finish_reason="stop" if choice.finish_reason == "tool_calls" else choice.finish_reason,
                mask=(1,) * len(choice.token_ids),
            )
            for choice in self.choices
        )
        prompt_id = -1 if self.prompt_id is None else self.prompt_id
        return Group(prompt=prompt, samples=samples, prompt_id=prompt_id, prompt_ids=self.choices[0].prompt_ids)


@dataclasses.dataclass(frozen=True)
class ServedStatistics:
    """Served completions and what became of them: ``sampled`` (on an episode's
    sample: what the learner trains on), ``unused`` (on an episode's other branches),
    ``failed`` (of an episode that failed or was cancelled), ``evaluated`` (of an
    evaluation's episode), ``outside`` (no episode), and ``pending`` (of episodes
    still running); they add up to ``completions``. ``calls`` counts requests,
    ``tokens`` completion tokens, ``episodes_open`` the episodes running."""

    calls: int
    completions: int
    tokens: int
    sampled: int
    unused: int
    failed: int
    evaluated: int
    outside: int
    pending: int
    episodes_open: int


@dataclasses.dataclass
class Node:
    """A served completion in an episode: what the next call must repeat to continue it."""

    messages: tuple[dict[str, Any], ...] | None  # the call's messages and this reply (chat calls)
    tools: Any  # the call's tools (a continuation keeps them: the template shows them once)
    root: tuple[int, ...]  # the branch's first prompt
    out: Tokens  # everything after it: replies (mask 1) and what came between (mask 0)
    text: str  # the reply's text
    call: int  # which call of the episode made it
    choice: int  # and which of its choices it is (the last call's first is the sample)
    finish: str  # the engine's: "stop", "length" or "aborted" (continued no further)
    parent: Node | None  # the reply it continues (None: it began a branch)

    @property
    def ids(self) -> tuple[int, ...]:
        return (*self.root, *self.out.ids)


@dataclasses.dataclass
class EpisodeRecord:
    """An agent episode's calls, while its agent runs: the branches (nodes) served so
    far, and the log entries of its calls (their fate is decided at its end)."""

    id: str
    item: PromptItem
    index: int
    seed: int
    sampling: SamplingParams  # the rollouts' at the episode's start; a call's own fields win
    evaluation: bool = False  # an evaluation's: greedy whatever the call asks
    nodes: list[Node] = dataclasses.field(default_factory=list)
    calls: int = 0
    turns: int = 0  # generations so far (each choice of each call is one), for request ids and seeds
    entries: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (log number, call) of each call
    completions: int = 0
    open: bool = True

    def last(self) -> Node | None:
        """The node of the latest call (its first choice): the episode's sample."""
        return max(self.nodes, key=lambda node: (node.call, -node.choice)) if self.nodes else None


class Served:
    """The endpoint's side of the rollouts: serves :class:`ServedRequest` s, through
    ``policy_turn`` inside an episode and ``outside`` otherwise, and keeps the
    episodes' call trees until :meth:`end_episode`. ``serving`` encodes the calls,
    ``decode`` gives text; ``max_context``: the model's context (None: not known).
    """

    def __init__(
        self,
        serving: Serving,
        *,
        policy_turn: PolicyTurn,
        outside: Outside,
        decode: Callable[[list[int]], str],
        max_context: int | None,
    ) -> None:
        self._policy_turn, self._outside = policy_turn, outside
        self._encode_prompt, self._encode_observation = serving.encode_prompt, serving.encode_observation
        self._decode = decode
        self._syntax = serving.syntax
        self._max_context = max_context
        self._episodes: dict[str, EpisodeRecord] = {}
        self._log: collections.deque[tuple[int, ServedCall]] = collections.deque(maxlen=LOG_SIZE)
        self._numbers = itertools.count()
        self._fates: dict[str, int] = collections.Counter()
        self._calls = self._completions = self._tokens = 0
        self._outside_seeds = itertools.count(1)

    # -- episodes -----------------------------------------------------------------------

    def open_episode(
        self, item: PromptItem, index: int, seed: int, sampling: SamplingParams, *, evaluation: bool = False
    ) -> EpisodeRecord:
        """A new episode for sample ``index`` of ``item``'s group; its id goes into the
        agent's client. ``evaluation``: its calls are greedy, whatever they ask."""
        episode = EpisodeRecord(
            f"{item.prompt_id}-{index}-{secrets.token_hex(4)}", item, index, seed, sampling, evaluation
        )
        self._episodes[episode.id] = episode
        return episode

    def end_episode(self, episode: EpisodeRecord, *, failed: bool) -> Node | None:
        """Close ``episode``: later calls naming it are refused. Its last call's branch
        is its sample (returned; None: it made no call, or ``failed``); every other
        completion is counted unused, or failed with it. Idempotent."""
        if not episode.open:
            return None
        episode.open = False
        self._episodes.pop(episode.id, None)
        last = None if failed else episode.last()
        on_path = _branch(last)
        sampled_calls = {node.call for node in on_path}
        used = "evaluated" if episode.evaluation else "sampled"
        if failed:
            self._fates["failed"] += episode.completions
        else:
            self._fates[used] += len(on_path)
            self._fates["unused"] += episode.completions - len(on_path)
        fates = {
            number: "failed" if failed else (used if call in sampled_calls else "unused")
            for number, call in episode.entries
        }
        for i, (number, served) in enumerate(self._log):
            if number in fates:
                self._log[i] = (number, dataclasses.replace(served, fate=fates[number]))
        return last

    @property
    def episodes_open(self) -> int:
        return len(self._episodes)

    # -- serving ------------------------------------------------------------------------

    async def serve(self, request: ServedRequest) -> list[ServedChoice]:
        """The completions for ``request``. Raises InvalidValueError for a request that
        cannot be served as asked (an unknown or ended episode, a prompt the tokenizer
        cannot encode or the context cannot hold: the endpoint's 400), RolloutError
        when generation fails."""
        start = time.monotonic()
        episode = None
        if request.episode is not None:
            episode = self._episodes.get(request.episode)
            if episode is None or not episode.open:
                raise InvalidValueError(
                    f"episode {request.episode!r} is not running (it ended, or never began): "
                    "a client is made for one episode; make a new one for the next (sess.serve().client())"
                )
        self._calls += 1
        call_index = -1
        if episode is None:
            choices = await self._serve_outside(request)
        else:
            call_index = episode.calls
            episode.calls += 1
            choices = await self._serve_in(episode, request, call_index)
        self._completions += len(choices)
        self._tokens += sum(len(c.token_ids) for c in choices)
        number = next(self._numbers)
        call = ServedCall(
            time.time(),
            None if episode is None else episode.id,
            None if episode is None else episode.item.prompt_id,
            request,
            tuple(choices),
            time.monotonic() - start,
            "outside" if episode is None else "served",
        )
        self._log.append((number, call))
        if episode is None:
            self._fates["outside"] += len(choices)
        elif episode.open:
            episode.entries.append((number, call_index))
            episode.completions += len(choices)
        else:  # it ended while this call generated: the agent returned without waiting for it
            self._fates["unused"] += len(choices)
        return choices

    async def _serve_outside(self, request: ServedRequest) -> list[ServedChoice]:
        prompt_ids = tuple(self._encode(request))
        self._check_room(prompt_ids)
        seed = request.seed if request.seed is not None else next(self._outside_seeds)

        async def one(i: int) -> ServedChoice:
            result = await self._outside(prompt_ids, request.sampling, seed * 1009 + i)
            out = Tokens()
            out.add(result.token_ids, result.logprobs, result.versions, policy=True)
            return self._choice(prompt_ids, out, 0, result.finish_reason, request)

        return list(await asyncio.gather(*(one(i) for i in range(request.n))))

    async def _serve_in(self, episode: EpisodeRecord, request: ServedRequest, call: int) -> list[ServedChoice]:
        parent, between = self._continued(episode, request)
        if parent is None:
            root, base = tuple(self._encode(request)), Tokens()
        else:
            root, base = parent.root, copy.deepcopy(parent.out)
            version = base.versions[-1] if base.versions else 0
            base.add(between, [0.0] * len(between), [version] * len(between), policy=False)
        sampling = request.sampling
        if episode.evaluation:
            sampling = dataclasses.replace(sampling, temperature=0.0, top_p=1.0, top_k=0)
        if self._max_context is not None:
            room = self._max_context - len(root) - len(base.ids)
            if room < 1:
                raise InvalidValueError(
                    f"the call's prompt takes {len(root) + len(base.ids)} tokens, the whole context of "
                    f"{self._max_context} (ModelConfig.max_len): no room for a reply; end the episode, "
                    "or use a larger max_len"
                )
            sampling = dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room))

        async def one(i: int) -> ServedChoice:
            out = copy.deepcopy(base)
            turn = episode.turns
            episode.turns += 1
            out.turns.append(len(out.ids))
            seed = episode.seed if request.seed is None else request.seed
            finish = await self._policy_turn(episode.item, root, episode.index, seed, turn, sampling, out)
            choice = self._choice(root, out, out.turns[-1], finish, request)
            if request.messages is not None:
                reply = _assistant(choice)
                messages: tuple[dict[str, Any], ...] | None = (*map(dict, request.messages), reply)
            else:
                messages = None
            ended = "stop" if choice.finish_reason in ("stop", "tool_calls") else finish
            episode.nodes.append(Node(messages, request.tools, root, out, choice.text, call, i, ended, parent))
            return choice

        return list(await asyncio.gather(*(one(i) for i in range(request.n))))

    def _choice(
        self, prompt_ids: tuple[int, ...], out: Tokens, start: int, finish: str, request: ServedRequest
    ) -> ServedChoice:
        """The reply in ``out`` from ``start``, cut at the first stop string (``out`` is
        cut too: a sample holds what was served), its tool calls parsed."""
        ids = out.ids[start:]
        text = self._decode(ids)
        if request.stop and (cut := _stop_at(ids, request.stop, self._decode)) is not None:
            keep, text = cut
            del out.ids[start + keep :], out.logprobs[start + keep :], out.versions[start + keep :]
            del out.mask[start + keep :]
            out.continued_at[:] = [at for at in out.continued_at if at < len(out.ids)]
            finish = "stop"
        content, calls = text, list[tuple[str, dict[str, Any]]]()
        if request.tools:
            content, calls = tool_calls(text, syntax=self._syntax, tools=request.tools)
            if calls:
                finish = "tool_calls"
        if finish == "aborted":  # continued up to max_continuations and no further: cut short
            finish = "length"
        full = tuple(out.ids[start:])
        return ServedChoice(
            tuple(prompt_ids) + tuple(out.ids[:start]),
            full,
            tuple(out.logprobs[start:]),
            tuple(out.versions[start:]),
            finish,
            text,
            tuple(calls),
            content,
        )

    def _continued(self, episode: EpisodeRecord, request: ServedRequest) -> tuple[Node | None, list[int]]:
        """The node ``request`` continues (the one whose call and reply its own messages
        or ids repeat, the longest such) and the ids of what it adds before the next
        reply; (None, []) for a new branch."""
        best: Node | None = None
        between: list[int] = []
        for node in episode.nodes:
            if request.messages is not None and node.messages is not None:
                n = len(node.messages)
                if len(request.messages) <= n or _tools_key(request.tools) != _tools_key(node.tools):
                    continue
                if not all(_same_message(a, b) for a, b in zip(request.messages[:n], node.messages, strict=False)):
                    continue
                if best is None or n > len(best.messages or ()):
                    best = node
            elif request.prompt is not None and node.messages is None:
                ids = self._encode(request)
                if len(ids) > len(node.ids) and tuple(ids[: len(node.ids)]) == node.ids:
                    if best is None or len(node.ids) > len(best.ids):
                        best, between = node, list(ids[len(node.ids) :])
        if best is not None and request.messages is not None:
            rest = [dict(m) for m in request.messages[len(best.messages or ()) :]]
            try:
                between = list(self._encode_observation(rest))
            except ValueError as exc:
                raise InvalidValueError(f"the call's new messages cannot be encoded: {exc}") from None
        return best, between

    def _encode(self, request: ServedRequest) -> list[int]:
        try:
            if request.messages is not None:
                tools = [dict(t) for t in request.tools] if request.tools else None
                return list(self._encode_prompt([dict(m) for m in request.messages], tools))
            if isinstance(request.prompt, tuple):
                return list(request.prompt)
            return list(self._encode_prompt(request.prompt, None))
        except ValueError as exc:
            raise InvalidValueError(f"the call's prompt cannot be encoded: {exc}") from None

    def _check_room(self, prompt_ids: tuple[int, ...]) -> None:
        if self._max_context is not None and len(prompt_ids) >= self._max_context:
            raise InvalidValueError(
                f"the prompt takes {len(prompt_ids)} tokens, the whole context of {self._max_context} "
                "(ModelConfig.max_len): no room for a reply; send a shorter prompt, or use a larger max_len"
            )

    # -- what was served --------------------------------------------------------------------

    def log(self) -> list[ServedCall]:
        """The latest served calls (up to :data:`LOG_SIZE`), oldest first."""
        return [call for _, call in self._log]

    def statistics(self) -> ServedStatistics:
        pending = sum(e.completions for e in self._episodes.values())
        f = self._fates
        return ServedStatistics(
            calls=self._calls,
            completions=self._completions,
            tokens=self._tokens,
            sampled=f["sampled"],
            unused=f["unused"],
            failed=f["failed"],
            evaluated=f["evaluated"],
            outside=f["outside"],
            pending=pending,
            episodes_open=len(self._episodes),
        )


def _branch(last: Node | None) -> list[Node]:
    """``last`` and the replies it continues, back to its branch's first."""
    nodes = []
    while last is not None:
        nodes.append(last)
        last = last.parent
    return nodes


def _assistant(choice: ServedChoice) -> dict[str, Any]:
    """The assistant message a client gets back (and repeats when it goes on)."""
    message: dict[str, Any] = {"role": "assistant", "content": choice.content}
    if choice.tool_calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for name, args in choice.tool_calls
        ]
    return message


def _same_message(sent: Mapping[str, Any], served: Mapping[str, Any]) -> bool:
    """Whether a message a client sends is the one served (or the one it sent): the
    same role and content, and the same tool calls by name and arguments (a client may
    drop the ids, or write the arguments' JSON its own way)."""
    if sent.get("role") != served.get("role") or (sent.get("content") or "") != (served.get("content") or ""):
        return False
    if served.get("role") != "assistant" or not (served.get("tool_calls") or sent.get("tool_calls")):
        return sent.get("role") == "assistant" or _loose(sent) == _loose(served)
    return _calls_key(sent.get("tool_calls")) == _calls_key(served.get("tool_calls"))


def _loose(message: Mapping[str, Any]) -> tuple[Any, ...]:
    return (message.get("role"), message.get("content") or "", message.get("name"), message.get("tool_call_id"))


def _calls_key(calls: Any) -> list[tuple[Any, Any]]:
    key = []
    for call in calls or ():
        function = call.get("function", {}) if isinstance(call, Mapping) else {}
        arguments = function.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass
        key.append((function.get("name"), json.dumps(arguments, sort_keys=True, default=str)))
    return key


def _tools_key(tools: Sequence[Mapping[str, Any]] | None) -> str:
    return json.dumps([dict(t) for t in tools or ()], sort_keys=True, default=str)


def _stop_at(ids: Sequence[int], stops: Sequence[str], decode: Callable[[list[int]], str]) -> tuple[int, str] | None:
    """``(tokens kept, text)``: the fewest leading tokens whose text holds a stop string,
    and the text before it; None when none occurs."""
    text = decode(list(ids))
    first = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=None)
    if first is None:
        return None
    for keep in range(1, len(ids) + 1):
        if len(decode(list(ids[:keep]))) > first:
            return keep, text[:first]
    return len(ids), text[:first]

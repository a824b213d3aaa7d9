"""The records that flow from the rollouter through the buffer to the learner."""

from __future__ import annotations

import dataclasses
import html
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from rlnb._errors import InvalidTypeError, InvalidValueError

__all__ = ["Group", "PromptItem", "RolloutBatch", "Sample", "messages_text"]

FINISH_REASONS = ("stop", "length", "aborted")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One completion of a prompt.

    ``token_ids``, ``logprobs`` (behaviour log-probs) and ``versions`` (the policy
    version that produced each token) are parallel; ``resumed`` counts how many
    times a partial rollout was continued, and ``continued_at`` holds the token
    index where each continuation began (where a pause cut it and a resume went
    on; its tokens before and after may come from different policy versions).
    ``rewards``: each reward function's value
    by name, for a task with several (None where one did not apply); ``reward`` is
    their weighted sum.

    A conversation (a task with an environment, :mod:`rlnb.envs`) holds every turn's
    tokens after the prompt: the policy's and the environment's replies between them.
    ``mask`` has one 0/1 per token: 1 for the policy's tokens (the learner trains on
    them), 0 for the environment's (their log-prob is 0.0 and their version the
    policy turn's before them); all ones for a single completion, and when not given.
    ``turns`` holds the token index where each policy turn begins ((0,) for one
    turn); ``completion`` is the whole conversation's text, and ``env_reward`` the sum
    of its environment's turn rewards (None: it gave none, or there is no environment).
    """

    prompt: str
    completion: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    versions: tuple[int, ...] = ()
    reward: float | None = None
    finish_reason: str = "stop"
    resumed: int = 0
    rewards: dict[str, float | None] = dataclasses.field(default_factory=dict, hash=False)
    continued_at: tuple[int, ...] = ()
    mask: tuple[int, ...] = ()
    turns: tuple[int, ...] = ()
    env_reward: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "continued_at", tuple(self.continued_at))
        n = len(self.token_ids)
        for field in ("logprobs", "versions"):
            got = len(getattr(self, field))
            if got not in (0, n):
                raise InvalidValueError(
                    f"Sample.{field} has {got} entries but token_ids has {n}: give one per token or none"
                )
        mask = tuple(self.mask) if self.mask else (1,) * n
        if len(mask) != n:
            raise InvalidValueError(
                f"Sample.mask has {len(mask)} entries but token_ids has {n}: give one 0/1 per token"
            )
        if any(m not in (0, 1) for m in mask):
            raise InvalidValueError(f"Sample.mask must hold only 0 and 1, got {sorted(set(mask) - {0, 1})[:3]}")
        object.__setattr__(self, "mask", mask)
        turns = tuple(self.turns) if self.turns else (0,)
        if turns[0] != 0 or any(b < a for a, b in itertools.pairwise(turns)) or turns[-1] > n:
            raise InvalidValueError(f"Sample.turns={turns} must start at 0 and not fall, within the {n} tokens")
        object.__setattr__(self, "turns", turns)
        if self.finish_reason not in FINISH_REASONS:
            raise InvalidValueError(f"Sample.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields (floats round-trip exactly through ``json``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        seqs = {k: tuple(d.get(k, ())) for k in ("token_ids", "logprobs", "versions", "continued_at", "mask", "turns")}
        return cls(**{**d, **seqs, "rewards": dict(d.get("rewards", {}))})

    @property
    def min_version(self) -> int | None:
        """The oldest policy version that produced a token of this sample, if known."""
        return min(self.versions) if self.versions else None

    @property
    def is_conversation(self) -> bool:
        """Whether an environment spoke in this sample (some token is not the policy's)."""
        return 0 in self.mask

    def segments(self) -> list[tuple[bool, tuple[int, ...]]]:
        """The token ids in runs of one speaker: ``(is_policy, ids)``, in order."""
        out: list[tuple[bool, tuple[int, ...]]] = []
        start = 0
        for i in range(1, len(self.token_ids) + 1):
            if i == len(self.token_ids) or self.mask[i] != self.mask[start] or (i in self.turns):
                out.append((self.mask[start] == 1, self.token_ids[start:i]))
                start = i
        return out


@dataclasses.dataclass(frozen=True)
class Group:
    """The G samples of one prompt: the unit the buffer stores and GRPO normalises over.

    ``prompt_ids`` are the prompt's token ids as the engine was given them, so the
    learner reads the same ids without tokenising the text again; empty when
    unknown (a group made by hand, or by a buffer's feeder): the learner then
    encodes ``prompt`` itself.
    """

    prompt: str
    samples: tuple[Sample, ...]
    prompt_id: int = -1
    prompt_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.samples, Sequence) or isinstance(self.samples, str):
            raise InvalidTypeError(f"Group.samples must be a sequence of Sample, got {type(self.samples).__name__}")
        if not self.samples:
            raise InvalidValueError("Group.samples is empty: a group needs at least one Sample")
        for s in self.samples:
            if not isinstance(s, Sample):
                raise InvalidTypeError(f"Group.samples must hold Sample objects, got {type(s).__name__}")
        if not isinstance(self.prompt_ids, Sequence) or isinstance(self.prompt_ids, str):
            raise InvalidTypeError(
                f"Group.prompt_ids must be a sequence of token ids, got {type(self.prompt_ids).__name__}"
            )
        # Lists would make it mutable.
        object.__setattr__(self, "samples", tuple(self.samples))
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))

    def __len__(self) -> int:
        return len(self.samples)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "prompt_id": self.prompt_id,
            "prompt_ids": list(self.prompt_ids),
            "samples": [s.to_dict() for s in self.samples],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Group:
        """The group :meth:`to_dict` gave; one saved without ``prompt_ids`` (before
        they were kept) gets none."""
        samples = tuple(Sample.from_dict(s) for s in d["samples"])
        return cls(prompt=d["prompt"], samples=samples, prompt_id=d["prompt_id"], prompt_ids=d.get("prompt_ids", ()))

    @property
    def min_version(self) -> int | None:
        """The oldest policy version among the group's tokens; None if unversioned."""
        versions = [v for s in self.samples if (v := s.min_version) is not None]
        return min(versions) if versions else None


@dataclasses.dataclass(frozen=True)
class PromptItem:
    """One prompt to roll out: its id, its text and what the reward needs (``answer``,
    and for a task made from records, the whole record)."""

    prompt_id: int
    prompt: str
    answer: Any = None
    # A data set task's record, for reward functions that take ``row=``.
    row: dict[str, Any] | None = dataclasses.field(default=None, hash=False)
    # A chat prompt's messages ({"role", "content"}); ``prompt`` is then their text.
    messages: tuple[dict[str, str], ...] | None = dataclasses.field(default=None, hash=False)

    @property
    def encodable(self) -> str | tuple[dict[str, str], ...]:
        """What a tokenizer encodes: the messages of a chat prompt (through the model's
        chat template, where it has one), else the text."""
        return self.messages if self.messages is not None else self.prompt


def messages_text(messages: Sequence[Mapping[str, str]]) -> str:
    """Chat messages as plain text, for a tokenizer without a chat template (the
    built-in one) and for display: their contents, one per line."""
    return "\n".join(m.get("content") or "" for m in messages)


def _versions(sample: Sample) -> str:
    if not sample.versions:
        return "-"
    lo, hi = min(sample.versions), max(sample.versions)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _marks(sample: Sample) -> str:
    marks = []
    if sample.is_conversation or len(sample.turns) > 1:
        marks.append(
            f"{len(sample.turns)} turns" + ("" if sample.env_reward is None else f", env {sample.env_reward:g}")
        )
    if sample.resumed:
        marks.append(f"resumed x{sample.resumed}")
    if sample.finish_reason != "stop":
        marks.append(sample.finish_reason)
    return ", ".join(marks)


class RolloutBatch(list[Group]):
    """Groups returned by ``Session.rollout()``: a list that renders as a table."""

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        """(prompt, completion, reward, versions, marks) per sample."""
        out = []
        for group in self:
            for s in group.samples:
                reward = "-" if s.reward is None else f"{s.reward:.2f}"
                out.append((group.prompt, s.completion, reward, _versions(s), _marks(s)))
        return out

    def __repr__(self) -> str:
        header = ("prompt", "completion", "reward", "versions", "marks")
        rows = [header, *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        return f"RolloutBatch({len(self)} groups)\n" + "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in ("prompt", "completion", "reward", "versions", "marks"))
        body = []
        for group in self:
            for i, s in enumerate(group.samples):
                prompt = f'<td rowspan="{len(group)}"><code>{html.escape(group.prompt)}</code></td>' if i == 0 else ""
                reward = "-" if s.reward is None else f"{s.reward:.2f}"
                body.append(
                    f"<tr>{prompt}<td><code>{html.escape(s.completion)}</code></td><td>{reward}</td>"
                    f"<td>{_versions(s)}</td><td>{html.escape(_marks(s))}</td></tr>"
                )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"

"""The records that flow from the rollouter through the buffer to the learner."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ["Group", "PromptItem", "Sample"]

FINISH_REASONS = ("stop", "length", "aborted")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One completion of a prompt.

    ``token_ids``, ``logprobs`` (behaviour log-probs) and ``versions`` (the policy
    version that produced each token) are parallel; ``resumed`` counts how many
    times a partial rollout was continued.
    """

    prompt: str
    completion: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    versions: tuple[int, ...] = ()
    reward: float | None = None
    finish_reason: str = "stop"
    resumed: int = 0

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for field in ("logprobs", "versions"):
            got = len(getattr(self, field))
            if got not in (0, n):
                raise ValueError(f"Sample.{field} has {got} entries but token_ids has {n}: give one per token or none")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Sample.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields (floats round-trip exactly through ``json``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        seqs = {k: tuple(d[k]) for k in ("token_ids", "logprobs", "versions")}
        return cls(**{**d, **seqs})

    @property
    def min_version(self) -> int | None:
        """The oldest policy version that produced a token of this sample, if known."""
        return min(self.versions) if self.versions else None


@dataclasses.dataclass(frozen=True)
class Group:
    """The G samples of one prompt: the unit the buffer stores and GRPO normalises over."""

    prompt: str
    samples: tuple[Sample, ...]
    prompt_id: int = -1

    def __post_init__(self) -> None:
        if not isinstance(self.samples, Sequence) or isinstance(self.samples, str):
            raise TypeError(f"Group.samples must be a sequence of Sample, got {type(self.samples).__name__}")
        if not self.samples:
            raise ValueError("Group.samples is empty: a group needs at least one Sample")
        for s in self.samples:
            if not isinstance(s, Sample):
                raise TypeError(f"Group.samples must hold Sample objects, got {type(s).__name__}")
        object.__setattr__(self, "samples", tuple(self.samples))  # a list would make it mutable

    def __len__(self) -> int:
        return len(self.samples)

    def to_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "prompt_id": self.prompt_id, "samples": [s.to_dict() for s in self.samples]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Group:
        samples = tuple(Sample.from_dict(s) for s in d["samples"])
        return cls(prompt=d["prompt"], samples=samples, prompt_id=d["prompt_id"])

    @property
    def min_version(self) -> int | None:
        """The oldest policy version among the group's tokens; None if unversioned."""
        versions = [v for s in self.samples if (v := s.min_version) is not None]
        return min(versions) if versions else None


@dataclasses.dataclass(frozen=True)
class PromptItem:
    """One prompt to roll out: its id, its text and what the reward needs (``answer``)."""

    prompt_id: int
    prompt: str
    answer: Any = None

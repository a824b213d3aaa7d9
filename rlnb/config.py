"""``rlnb.Config``: one frozen dataclass per component, validated when it is made.

Every error names the field and the fix, and is raised before any work starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlnb._errors import ConfigError

__all__ = ["BufferConfig", "Config"]


def _require(ok: bool, field: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{field}={value!r} is invalid: {fix}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class BufferConfig:
    """The replay buffer.

    capacity: groups held per partition before ``put`` blocks.
    max_staleness: evict groups more than this many policy versions behind the
        learner (counted in statistics); ``None`` keeps every group.
    partitions: the names of the buffer's partitions.
    """

    capacity: int = 1024
    max_staleness: int | None = None
    partitions: tuple[str, ...] = ("train", "val")

    def __post_init__(self) -> None:
        _require(
            _is_int(self.capacity) and self.capacity >= 1,
            "BufferConfig.capacity",
            self.capacity,
            "use a positive number of groups, e.g. capacity=256",
        )
        _require(
            self.max_staleness is None or (_is_int(self.max_staleness) and self.max_staleness >= 0),
            "BufferConfig.max_staleness",
            self.max_staleness,
            "use None for no bound or an int >= 0, e.g. max_staleness=1",
        )
        parts = self.partitions
        _require(
            isinstance(parts, tuple)
            and len(parts) > 0
            and all(isinstance(p, str) and p for p in parts)
            and len(set(parts)) == len(parts),
            "BufferConfig.partitions",
            parts,
            'use a tuple of distinct names, e.g. ("train", "val")',
        )
        _require("train" in parts, "BufferConfig.partitions", parts, 'include "train": the learner reads it')


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a :class:`~rlnb.Session` is built from.

    seed: seeds every random number generator the session owns.
    buffer: the replay buffer (:class:`BufferConfig`).
    close_timeout: seconds ``Session.close()`` may spend in all before it gives up
        on a part that will not stop (it then warns and abandons it).
    """

    seed: int = 0
    buffer: BufferConfig = dataclasses.field(default_factory=BufferConfig)
    close_timeout: float = 5.0

    def __post_init__(self) -> None:
        _require(_is_int(self.seed) and self.seed >= 0, "Config.seed", self.seed, "use an int >= 0, e.g. seed=0")
        _require(
            isinstance(self.buffer, BufferConfig),
            "Config.buffer",
            self.buffer,
            "pass a rlnb.BufferConfig, e.g. buffer=rlnb.BufferConfig(capacity=256)",
        )
        _require(
            _is_number(self.close_timeout) and self.close_timeout > 0,
            "Config.close_timeout",
            self.close_timeout,
            "use a number of seconds > 0, e.g. close_timeout=5.0",
        )

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

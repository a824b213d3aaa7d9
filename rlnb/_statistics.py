"""Snapshots of a session's figures, for cells, gauges and tests."""

from __future__ import annotations

import dataclasses

from rlnb.buffer import BufferStatistics
from rlnb.rollout import EngineStatistics, RolloutStatistics

__all__ = ["SessionStatistics"]


@dataclasses.dataclass(frozen=True)
class SessionStatistics:
    """A snapshot of a session and its parts."""

    name: str
    closed: bool
    buffer: BufferStatistics
    rollout: RolloutStatistics
    engine: EngineStatistics

"""What the rollouter counts: live counters, capacity tickets and the frozen snapshot.

Every dispatched sample is in exactly one of: in flight, kept partial, finished or
failed; the counters move a sample from one to another without an await between.
"""

from __future__ import annotations

import asyncio
import dataclasses

__all__ = ["Counters", "RolloutStatistics", "Ticket"]


@dataclasses.dataclass(frozen=True)
class RolloutStatistics:
    """A snapshot of the rollouter's counters (samples unless named otherwise).

    Every dispatched sample is in exactly one of: ``in_flight`` (generating or
    queued), ``kept_partial`` (aborted by a pause, waiting to continue),
    ``finished`` or ``failed``.
    """

    state: str
    dispatching: bool
    version: int
    dispatched: int
    in_flight: int
    kept_partial: int
    finished: int
    failed: int
    continuations: int
    truncated: int
    retries: int
    groups_dispatched: int
    groups_finished: int
    groups_failed: int
    last_resume_to_dispatch_ms: float | None


@dataclasses.dataclass
class Counters:
    """The live counts behind :class:`RolloutStatistics`, and the gauges dispatch and
    the WAIT drain read (``generating``, ``ungrouped``, ``putting``)."""

    dispatched: int = 0
    in_flight: int = 0
    kept_partial: int = 0
    finished: int = 0
    failed: int = 0
    continuations: int = 0
    truncated: int = 0
    retries: int = 0
    groups_dispatched: int = 0
    groups_finished: int = 0
    groups_failed: int = 0
    generating: int = 0  # engine.generate calls outstanding (the WAIT drain waits for 0)
    ungrouped: int = 0  # samples done generating whose group has not been put yet
    putting: int = 0  # finished groups waiting for room in the buffer

    def drained(self) -> bool:
        """Nothing generating, and every finished sample has reached its group's put."""
        return self.generating == 0 and self.ungrouped == 0

    def snapshot(
        self, *, state: str, dispatching: bool, version: int, last_resume_to_dispatch_ms: float | None
    ) -> RolloutStatistics:
        return RolloutStatistics(
            state=state,
            dispatching=dispatching,
            version=version,
            dispatched=self.dispatched,
            in_flight=self.in_flight,
            kept_partial=self.kept_partial,
            finished=self.finished,
            failed=self.failed,
            continuations=self.continuations,
            truncated=self.truncated,
            retries=self.retries,
            groups_dispatched=self.groups_dispatched,
            groups_finished=self.groups_finished,
            groups_failed=self.groups_failed,
            last_resume_to_dispatch_ms=last_resume_to_dispatch_ms,
        )


@dataclasses.dataclass
class Ticket:
    """A dispatched group's hold on ``capacity``: one permit per sample, each given
    back exactly once, by its sample or, for samples that never ran, by ``settle_rest``."""

    samples: int
    capacity: asyncio.Semaphore
    counters: Counters
    settled: int = 0

    def settle_one(self) -> None:
        """A sample has ended (finished or failed): it leaves the in-flight count."""
        self.settled += 1
        self.counters.in_flight -= 1
        self.capacity.release()

    def settle_rest(self) -> None:
        """The group has ended: samples cancelled before they ran (Ctrl-C during
        collect(), close) still owe their capacity and count as failed."""
        missing = self.samples - self.settled
        for _ in range(missing):
            self.capacity.release()
        self.counters.in_flight -= missing
        self.counters.failed += missing
        self.settled = self.samples

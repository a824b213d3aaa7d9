"""What the rollouter counts: live counters, each group's ticket and the frozen snapshot.

Every dispatched sample is in exactly one of: in flight, kept partial, finished,
failed or cancelled; the counters move a sample from one to another without an
await between. A sample fails only if its generation or reward really failed; one
that was cancelled (Ctrl-C during collect(), close) or whose engine or rollouter
closed under it counts as cancelled: nothing went wrong, its prompt is rolled out
again or the run is over.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from rlnb._errors import ClosedError

__all__ = ["Counters", "RolloutStatistics", "Ticket", "is_cancellation"]


def is_cancellation(error: BaseException) -> bool:
    """Whether ``error`` ended work that did not fail: it was cancelled, or what it ran on closed."""
    return isinstance(error, (asyncio.CancelledError, ClosedError))


@dataclasses.dataclass(frozen=True)
class RolloutStatistics:
    """A snapshot of the rollouter's counters (samples unless named otherwise).

    Every dispatched sample is in exactly one of: ``in_flight`` (generating or
    queued), ``kept_partial`` (aborted by a pause, waiting to continue),
    ``finished``, ``failed`` (its generation or reward failed after its retries) or
    ``cancelled`` (cancelled by Ctrl-C or close before it finished; nothing failed).
    ``queued`` counts the in-flight samples that wait for rollouts to run before
    they go to the engine (dispatched just before a pause, or retried during
    one): a WAIT pause does not wait for them. A group failed if one of its
    samples failed, and was cancelled if it ended unfinished otherwise.
    ``groups_live`` counts groups bound for the learner that are generating or in
    the buffer (held ones too); background dispatch waits while it is
    ``groups_allowed`` (the policy-lag budget; None: no bound) or more.
    ``bad_prompts`` counts prompts the task's ``make_prompt`` could not make
    (raised as :class:`~rlnb.PromptError`, or skipped), ``last_bad_prompt``
    describes the last one. ``old_settings_in_flight`` counts the samples of groups
    not yet ended that were dispatched before the last change of the sampling
    settings or the group size (``Session.set``): they keep the settings they started with.
    ``reward_calls_queued`` and ``env_calls_queued`` count the reward and environment
    calls waiting for a free thread (``RolloutConfig.reward_workers``/``env_workers``):
    more than a few, step after step, is what makes rollouts slow.
    """

    state: str
    dispatching: bool
    version: int
    dispatched: int
    in_flight: int
    queued: int
    kept_partial: int
    finished: int
    failed: int
    cancelled: int
    continuations: int
    truncated: int
    retries: int
    groups_dispatched: int
    groups_finished: int
    groups_failed: int
    groups_cancelled: int
    groups_live: int
    groups_allowed: int | None
    last_resume_to_dispatch_ms: float | None
    bad_prompts: int = 0
    last_bad_prompt: str | None = None
    old_settings_in_flight: int = 0
    reward_calls_queued: int = 0
    env_calls_queued: int = 0


@dataclasses.dataclass
class Counters:
    """The live counts behind :class:`RolloutStatistics`, and the gauges dispatch and
    the WAIT drain read (``groups_running``)."""

    dispatched: int = 0
    in_flight: int = 0
    kept_partial: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    continuations: int = 0
    truncated: int = 0
    retries: int = 0
    groups_dispatched: int = 0
    groups_finished: int = 0
    groups_failed: int = 0
    groups_cancelled: int = 0
    generating: int = 0  # engine.generate, reward and environment calls outstanding
    groups_running: int = 0  # groups dispatched whose task has not ended (the WAIT drain waits for 0)
    queued: int = 0  # in-flight samples waiting for RUNNING before they go to the engine
    bad_prompts: int = 0  # prompts whose make_prompt raised (raised or skipped)
    last_bad_prompt: str | None = None

    def drained(self) -> bool:
        """Every dispatched group has ended: its samples generated, were rewarded and
        reached its end (the buffer, ``collect()``, or a failure), and its environments
        were closed. What a WAIT pause waits for."""
        return self.groups_running == 0

    def snapshot(
        self,
        *,
        state: str,
        dispatching: bool,
        version: int,
        lag_budget: tuple[int, int | None],
        last_resume_to_dispatch_ms: float | None,
        old_settings_in_flight: int = 0,
        queued_calls: tuple[int, int] = (0, 0),
    ) -> RolloutStatistics:
        return RolloutStatistics(
            state=state,
            dispatching=dispatching,
            version=version,
            dispatched=self.dispatched,
            in_flight=self.in_flight,
            queued=self.queued,
            kept_partial=self.kept_partial,
            finished=self.finished,
            failed=self.failed,
            cancelled=self.cancelled,
            continuations=self.continuations,
            truncated=self.truncated,
            retries=self.retries,
            groups_dispatched=self.groups_dispatched,
            groups_finished=self.groups_finished,
            groups_failed=self.groups_failed,
            groups_cancelled=self.groups_cancelled,
            groups_live=lag_budget[0],
            groups_allowed=lag_budget[1],
            last_resume_to_dispatch_ms=last_resume_to_dispatch_ms,
            bad_prompts=self.bad_prompts,
            last_bad_prompt=self.last_bad_prompt,
            old_settings_in_flight=old_settings_in_flight,
            reward_calls_queued=queued_calls[0],
            env_calls_queued=queued_calls[1],
        )


@dataclasses.dataclass
class Ticket:
    """A dispatched group's accounts: its hold on ``capacity`` (one permit per sample,
    each given back exactly once, by its sample or, for samples that never ran, by
    ``settle_rest``), how each of its samples ended, and how the group ended (counted once)."""

    samples: int
    capacity: asyncio.Semaphore
    counters: Counters
    settled: int = 0
    failed: int = 0  # samples of this group that really failed
    ended: bool = False  # the group is counted as finished, failed or cancelled
    running: bool = True  # its task has not ended (counted in ``counters.groups_running``)

    def __post_init__(self) -> None:
        self.counters.groups_running += 1

    def end_sample(self, error: BaseException | None) -> None:
        """A sample has ended, finished (``error`` None), cancelled or failed: it leaves
        the in-flight count and gives back its permit."""
        counts = self.counters
        if error is None:
            counts.finished += 1
        elif is_cancellation(error):
            counts.cancelled += 1
        else:
            counts.failed += 1
            self.failed += 1
        self.settled += 1
        counts.in_flight -= 1
        self.capacity.release()

    def end_group(self, error: BaseException | None) -> None:
        """Count the group once: finished (``error`` None), failed if one of its samples
        (or the group itself) really failed, cancelled otherwise. Later calls change nothing."""
        if self.ended:
            return
        self.ended = True
        if error is None:
            self.counters.groups_finished += 1
        elif self.failed or not is_cancellation(error):
            self.counters.groups_failed += 1
        else:
            self.counters.groups_cancelled += 1

    def ended_task(self) -> None:
        """The group's task is ending: it leaves ``groups_running`` (once)."""
        if self.running:
            self.running = False
            self.counters.groups_running -= 1

    def settle_rest(self, task: asyncio.Future[Any]) -> None:
        """The group's ``task`` is done: samples that never ran still owe their capacity.
        They were cancelled with the group (Ctrl-C during collect(), close) unless the
        group itself failed before starting them; the group is counted if it was not."""
        error = asyncio.CancelledError() if task.cancelled() else task.exception()
        for _ in range(self.samples - self.settled):
            self.end_sample(error if error is not None else asyncio.CancelledError())
        self.end_group(error)
        self.ended_task()

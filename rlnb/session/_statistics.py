"""Snapshots of a session's figures, for cells, gauges and tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlnb import _reprs
from rlnb.buffer import BufferStatistics
from rlnb.engines import EngineStatistics
from rlnb.rollout import RolloutStatistics
from rlnb.serve import EndpointStatistics
from rlnb.session._stall import Stall

if TYPE_CHECKING:
    from rlnb.learn import LearnerStatistics, TrainingStatistics  # torch: not at `import rlnb`

__all__ = ["SessionStatistics"]

# The metrics a reader looks for first; the rest follow in their own order.
_FIRST_METRICS = ("reward_mean", "accuracy", "loss", "kl")


@dataclasses.dataclass(frozen=True)
class SessionStatistics:
    """A snapshot of a session and its parts: training (a blocking call in the
    foreground or a background run, step, steps/s, last metrics, what a step waits
    for), rollouts, buffer and engine; ``stall``, where a step that has run too long
    waits (a :class:`~rlnb.session.Stall`; None while steps complete in time);
    ``endpoint``, the endpoint's requests and served completions (None: the session
    has not served); ``learner``, the learner's ranks (None: it runs in the
    session's process, ``LearnConfig.ranks=1``)."""

    name: str
    closed: bool
    buffer: BufferStatistics
    rollout: RolloutStatistics
    engine: EngineStatistics
    training: TrainingStatistics
    stall: Stall | None = None
    endpoint: EndpointStatistics | None = None
    learner: LearnerStatistics | None = None

    def _rows(self) -> list[tuple[str, list[str]]]:
        rows = [("session", [f"{self.name!r}, {'closed' if self.closed else 'open'}"])]
        if self.stall is not None:
            rows.append(("stall", [str(self.stall).removeprefix("rlnb: ")]))
        rows.append(("training", _training_lines(self.training)))
        if self.learner is not None:
            rows.append(("learner", self.learner.lines()))
        rows += [
            ("rollouts", _rollout_lines(self.rollout)),
            ("buffer", _buffer_lines(self.buffer)),
            ("engine", _engine_lines(self.engine)),
        ]
        if self.endpoint is not None:
            rows.append(("endpoint", _endpoint_lines(self.endpoint)))
        return rows

    def __repr__(self) -> str:
        return _reprs.text_block("SessionStatistics", self._rows())

    def _repr_html_(self) -> str:
        return _reprs.html_table("SessionStatistics", self._rows())


def _endpoint_lines(endpoint: EndpointStatistics) -> list[str]:
    served = endpoint.served
    statuses = ", ".join(f"{status}: {n}" for status, n in sorted(endpoint.by_status.items()))
    fates = ("sampled", "unused", "failed", "evaluated", "outside", "pending")
    return [
        f"{endpoint.requests} requests ({statuses or 'none'}), {endpoint.disconnected} clients gone before their reply",
        f"{served.completions} completions, {served.tokens} tokens: "
        + ", ".join(f"{getattr(served, fate)} {fate}" for fate in fates),
        f"{served.episodes_open} agent episodes open",
    ]


def _training_lines(training: Any) -> list[str]:
    rate, foreground = training.steps_per_s, training.foreground
    if training.running:
        state = "in the background"
    elif foreground is not None:
        state = f"{foreground.call} in the foreground"
    else:
        state = "idle"
    head = [
        state,
        f"step {training.step}",
        *([f"{_reprs.number(rate)} steps/s"] if rate is not None else []),
    ]
    lines = [", ".join(head)]
    metrics = _metrics(training.last_metrics)
    if metrics:
        lines.append(metrics)
    if training.waiting:
        lines.append(f"waiting: {_reprs.clip(training.waiting, 300)}")
    if training.error:
        lines.append(f"error: {_reprs.clip(training.error, 300)}")
    return lines


def _metrics(metrics: Mapping[str, float], limit: int = 5) -> str:
    names = [m for m in _FIRST_METRICS if m in metrics] + [m for m in metrics if m not in _FIRST_METRICS]
    shown = ", ".join(f"{m} {_reprs.number(metrics[m])}" for m in names[:limit])
    return shown + (f", … and {len(names) - limit} more" if len(names) > limit else "")


def _rollout_lines(r: RolloutStatistics) -> list[str]:
    if r.state != "running":  # pausing, paused, syncing, closed
        what = r.state + (", background dispatch stopped" if not r.dispatching and r.state != "closed" else "")
    elif r.dispatching and r.in_flight:
        what = "generating in the background"
    elif r.dispatching:  # held back: the policy-lag budget is spent, or the buffer is full
        spent = r.groups_allowed is not None and r.groups_live >= r.groups_allowed
        what = "dispatching in the background, held: " + (
            f"the policy-lag budget is spent ({r.groups_live} of {r.groups_allowed} groups live)"
            if spent
            else "the buffer is full"
        )
    else:  # a step (sync mode), rollout() or evaluate() generates for its caller; nothing else does
        what = "generating for a call in progress" if r.in_flight else "idle (nothing dispatched in the background)"
    return [
        f"{what}, version {r.version}",
        _reprs.pairs(
            ("in flight", r.in_flight),
            *((("of them queued", r.queued),) if r.queued else ()),
            ("kept partial", r.kept_partial),
            ("finished", r.finished),
            ("failed", r.failed),
            ("cancelled", r.cancelled),
        ),
        _reprs.pairs(("retries", r.retries), ("continuations", r.continuations), ("truncated", r.truncated)),
    ]


def _buffer_lines(b: BufferStatistics) -> list[str]:
    sizes = ", ".join(f"{p} {n} ({b.samples.get(p, 0)} samples)" for p, n in b.sizes.items())
    held = sum(b.held.values())
    lines = [
        f"groups: {sizes or 'no partitions'}" + (f"; {held} more finished, waiting for room" if held else ""),
        _reprs.pairs(("put", b.put), ("taken", b.taken), ("evicted stale", b.evicted_stale))
        + f", capacity {b.capacity} per partition"
        + (", closed" if b.closed else ""),
    ]
    if b.feeder_error:
        lines.append(f"feeder error: {_reprs.clip(b.feeder_error, 300)}")
    return lines


def _engine_lines(e: EngineStatistics) -> list[str]:
    paused = f"paused ({e.paused})" if e.paused else "not paused"
    return [
        f"version {e.version}, {paused}",
        _reprs.pairs(("waiting", e.waiting), ("running", e.running), ("finished", e.finished), ("aborted", e.aborted))
        + f"; {e.generated_tokens} tokens generated",
    ]

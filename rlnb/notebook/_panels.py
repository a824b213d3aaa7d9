"""The dashboard's panels: the live-state and resource-gauge HTML, the curves as
small SVG charts, and the callback that keeps the last batch.

Imported only when a dashboard is made: it loads :mod:`rlnb.learn` (torch, which
a session has loaded already). Nothing here holds a session.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlnb import _reprs
from rlnb._samples import Group, RolloutBatch
from rlnb.learn import Callback
from rlnb.runtime import Snapshot

if TYPE_CHECKING:
    from rlnb._statistics import SessionStatistics
    from rlnb.session import Session

__all__ = ["Curves", "LastBatch", "call", "gauges_html", "replicas_html", "rollouts_html", "state_html"]

SHOWN_GROUPS = 2  # groups of the last batch in the rollouts table
_MAX_POINTS = 400  # per curve; longer histories are thinned evenly

_STATE_COLOURS = {
    "running": "#1b7f3b",
    "syncing": "#1f5fbf",
    "pausing": "#b26a00",
    "paused": "#b26a00",
    "closed": "#666666",
}
_MUTED = "color:#666"

# The kernel cannot update the page once a restart or shutdown has begun (JupyterLab
# stops routing the old kernel's messages first), so the state panel carries its own
# epitaph: ipywidgets marks a widget whose kernel is gone with this class, and the
# CSS swaps the live state word for the line that says how the session ended.
_GONE = (
    "<style>.rlnb-gone{display:none}"
    ".jupyter-widgets-disconnected .rlnb-gone{display:inline;color:#b00020;font-weight:bold}"
    ".jupyter-widgets-disconnected .rlnb-live{display:none}</style>"
    '<span class="rlnb-gone">kernel gone: a restart or shutdown closed the session '
    "(tracker exit code 130); run the notebook again to go on</span>"
)
_LEFT = "text-align:left;padding:0 0.8em 0 0;vertical-align:top"


class LastBatch(Callback):
    """Keeps the last training batch and counts batches; holds no session.

    ``last`` is ``(count, groups)``, replaced in one assignment so a reader on
    another thread never sees a count that does not match its groups.
    """

    def __init__(self) -> None:
        self.last: tuple[int, tuple[Group, ...]] = (0, ())

    def on_batch(self, groups: Sequence[Group]) -> None:
        self.last = (self.last[0] + 1, tuple(groups))


def call(sess: Session, method: str, *, pause_mode: str, save_path: str) -> str:
    """Call the session's public ``method`` (a button's) and say what it did, in a line."""
    if method == "pause":
        sess.pause(pause_mode)
        r = sess.statistics().rollout
        if pause_mode == "abort":
            return f"paused (abort): {r.kept_partial} samples kept as partial rollouts"
        if pause_mode == "keep":
            return f"paused (keep): {r.in_flight} samples frozen in the engine"
        if r.state == "paused":
            return "paused (wait): nothing was left in flight"
        return f"pausing (wait): {r.in_flight} samples in flight finish first"
    if method == "resume":
        kept = sess.statistics().rollout.kept_partial
        sess.resume()
        return f"resumed: {kept} partial rollouts continue"
    if method == "step":
        metrics = sess.step()
        shown = ", ".join(f"{k} {metrics[k]:.3f}" for k in ("reward_mean", "accuracy", "entropy") if k in metrics)
        return f"step {sess.version}: {shown}"
    if method == "evaluate":
        return f"held-out accuracy {sess.evaluate():.3f} at step {sess.version}"
    if method == "save":
        return f"saved to {sess.save(save_path)}"
    if method == "start":
        sess.start()
        return "training in the background; stop ends it at a step boundary"
    if method == "stop":
        sess.stop()
        return f"stopped at step {sess.version}"
    raise ValueError(f"no dashboard control calls {method!r}")


def _table(rows: Sequence[tuple[str, str]]) -> str:
    """``(label, html)`` rows; the labels are escaped here, the values by the caller."""
    body = "".join(f'<tr><th style="{_LEFT}">{html.escape(k)}</th><td style="{_LEFT}">{v}</td></tr>' for k, v in rows)
    return f'<table style="border-collapse:collapse"><tbody>{body}</tbody></table>'


def state_word(state: str) -> str:
    """The rollout state as its own element, so a browser test can read it."""
    colour = _STATE_COLOURS.get(state, "#000")
    return (
        f'<span class="rlnb-state-word" data-state="{html.escape(state)}" '
        f'style="font-weight:bold;color:{colour}">{html.escape(state.upper())}</span>'
    )


def state_html(
    name: str,
    stats: SessionStatistics | None,
    tokens_per_s: float | None,
    *,
    exit_code: int | None = None,
    model: str | None = None,
) -> str:
    """The live state: the model, rollout state, policy version, training, samples,
    buffer, tokens/s.

    ``exit_code`` (not None once the session closed) turns the state word to CLOSED;
    the figures are then the last ones seen while the session was open."""
    closed = exit_code is not None
    state = "closed" if closed or stats is None or stats.closed else stats.rollout.state
    head = f'<b>session {html.escape(repr(name))}</b> <span class="rlnb-live">{state_word(state)}</span>'
    if not closed:
        head += _GONE
    if closed:
        head += f' <span class="rlnb-exit-code">closed, exit code {exit_code}</span>'
    if stats is None:
        return f"<div>{head}</div>"
    r, t = stats.rollout, stats.training
    rows = [] if model is None else [("model", html.escape(model))]
    rows += [
        ("policy version", f"{t.step} (engine {stats.engine.version})"),
        ("training", html.escape(_training(t, closed))),
    ]
    if t.waiting and not closed:
        rows.append(("a step waits for", html.escape(t.waiting)))
    rows.append(("rollouts", "dispatching" if r.dispatching else "not dispatching"))
    samples = _reprs.pairs(
        ("in flight", r.in_flight),
        ("kept partial", r.kept_partial),
        ("finished", r.finished),
        ("failed", r.failed),
        ("cancelled", r.cancelled),
    )
    rows.append(("samples", html.escape(samples)))
    rows.append(("buffer", html.escape(_buffer(stats))))
    rate = "-" if tokens_per_s is None or closed else f"{tokens_per_s:,.0f}"
    rows.append(("generated", f"{rate} tokens/s, {stats.engine.generated_tokens:,} in all"))
    replicas = stats.engine.extra.get("replicas")
    if replicas:
        rows.append(("engine replicas", replicas_html(replicas, stats.engine.extra)))
    if closed:
        head += f' <span style="{_MUTED}">(figures as last seen open)</span>'
    return f"<div>{head}</div>{_table(rows)}"


def replicas_html(replicas: Sequence[Mapping[str, Any]], extra: Mapping[str, Any]) -> str:
    """One row per engine replica (Ray): state, requests in flight, weight version,
    restarts and requests served; under it the restarts and re-queued requests in all."""
    head = "".join(f'<th style="{_LEFT};padding-right:1em">{h}</th>' for h in _REPLICA_COLUMNS)
    body = ""
    for r in replicas:
        state = str(r["state"])
        colour = "#b00020" if state == "dead" else "#000"
        cells = [str(r["index"]), f'<span style="color:{colour}">{html.escape(state)}</span>']
        cells += [str(r[k]) for k in ("in_flight", "version", "restarts", "served")]
        body += (
            f'<tr class="rlnb-replica" data-state="{html.escape(state)}">'
            + "".join(f'<td style="{_LEFT};padding-right:1em">{c}</td>' for c in cells)
            + "</tr>"
        )
    total = _reprs.pairs(("restarts", extra.get("restarts", 0)), ("re-queued requests", extra.get("requeued", 0)))
    return (
        f'<table style="border-collapse:collapse"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
        f'<div style="{_MUTED}">{html.escape(total)}</div>'
    )


_REPLICA_COLUMNS = ("replica", "state", "in flight", "version", "restarts", "served")


def _training(t: Any, closed: bool) -> str:
    if t.running and not closed:
        rate = "" if t.steps_per_s is None else f", {t.steps_per_s:.3g} steps/s"
        return f"running in the background{rate}"
    return "not running" + ("" if t.steps_per_s is None else f" (last run {t.steps_per_s:.3g} steps/s)")


def _buffer(stats: SessionStatistics) -> str:
    b = stats.buffer
    fill = ", ".join(f"{p} {n}/{b.capacity} groups ({b.samples.get(p, 0)} samples)" for p, n in b.sizes.items())
    return f"{fill or 'empty'}; evicted stale {b.evicted_stale}"


GAUGES = ("open FDs", "threads", "child processes", "event loops", "tracker runs")


def gauge_counts(snap: Snapshot) -> dict[str, int]:
    """The gauges' figures from a probe snapshot, in :data:`GAUGES` order."""
    counts = (snap.num_fds, snap.num_threads, snap.num_children, len(snap.loops), len(snap.runs))
    return dict(zip(GAUGES, counts, strict=True))


def gauges_html(now: Snapshot, baseline: Snapshot, *, final: bool = False) -> str:
    """Each gauge's count and its change since ``baseline`` ("threads 1 (+0)").

    ``final``: the counts after the session closed; a change that is not zero is
    shown in red and what is new is listed, so a leak is seen at once."""
    before = gauge_counts(baseline)
    items = []
    for gauge, value in gauge_counts(now).items():
        delta = value - before[gauge]
        colour = ("#b00020" if delta > 0 else "#1b7f3b") if final else "#666"
        items.append(
            f'<div class="rlnb-gauge" data-gauge="{gauge}" data-value="{value}" data-delta="{delta}">'
            f'{gauge} <b>{value}</b> <span style="color:{colour}">({delta:+d})</span></div>'
        )
    title = "after close, vs. before the session" if final else "this process, vs. before the session"
    out = f'<div style="{_MUTED}">{title}</div>' + "".join(items)
    if final:
        for kind, names in now.new_since(baseline).items():
            listed = html.escape(_reprs.name_list(names, width=200, each=60))
            out += f'<div style="color:#b00020">new {html.escape(kind)}: {listed}</div>'
    return out


def rollouts_html(groups: Sequence[Group], count: int) -> str:
    """The first groups of the last batch as a table (nothing before the first batch)."""
    if not groups:
        return ""
    shown = RolloutBatch(groups[:SHOWN_GROUPS])
    caption = f"last batch (#{count}): {len(shown)} of {len(groups)} groups"
    return f'<div style="{_MUTED}">{caption}</div>{shown._repr_html_()}'


class Curves:
    """reward_mean and entropy per step and held-out accuracy per evaluation, as
    three small SVG charts built from strings: a redraw costs well under a
    millisecond and never holds the GIL long enough to stall training or a click
    (a matplotlib draw took ~50 ms). Use from one thread at a time."""

    _SERIES = (("reward_mean", "reward_mean"), ("entropy", "entropy"), ("eval", "held-out accuracy"))
    WIDTH, HEIGHT = 270, 140

    def render(self, history: Sequence[Mapping[str, float]], evaluations: Sequence[tuple[int, float]]) -> str:
        """The charts as one HTML block (each chart an ``<img>`` of SVG, so that it
        survives in a saved notebook's sanitised output too)."""
        stride = max(1, len(history) // _MAX_POINTS)  # 400 points look the same as 4,000
        shown = list(history[::stride]) + ([history[-1]] if history and (len(history) - 1) % stride else [])
        steps = [float(m.get("version", i * stride + 1)) for i, m in enumerate(shown)]
        charts = []
        for key, title in self._SERIES:
            if key == "eval":
                svg = self.chart(title, [(float(v), a) for v, a in evaluations], y_range=(0.0, 1.0), dots=True)
            else:
                values = [float(m.get(key, math.nan)) for m in shown]
                svg = self.chart(title, [(x, y) for x, y in zip(steps, values, strict=True) if math.isfinite(y)])
            data = base64.b64encode(svg.encode()).decode()
            charts.append(f'<img alt="{html.escape(title)}" src="data:image/svg+xml;base64,{data}">')
        return '<div style="display:flex;gap:8px;flex-wrap:wrap">' + "".join(charts) + "</div>"

    def chart(
        self,
        title: str,
        points: Sequence[tuple[float, float]],
        *,
        y_range: tuple[float, float] | None = None,
        dots: bool = False,
    ) -> str:
        """One chart as an SVG document: a line through ``points``, its ranges labelled."""
        w, h = self.WIDTH, self.HEIGHT
        left, right, top, bottom = 40, w - 8, 20, h - 22
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
            'font-size="10">',
            f'<text x="{w / 2}" y="13" text-anchor="middle" font-size="11">{html.escape(title)}</text>',
            f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" stroke="#999"/>',
        ]
        if not points:
            middle = f'x="{(left + right) / 2}" y="{(top + bottom) / 2}"'
            parts.append(f'<text {middle} text-anchor="middle" fill="#999">no data yet</text></svg>')
            return "".join(parts)
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        x0, x1 = min(xs), max(xs)
        y0, y1 = y_range if y_range is not None else (min(ys), max(ys))
        x0, x1 = (x0 - 1, x1 + 1) if x1 == x0 else (x0, x1)
        y0, y1 = (y0 - 0.5, y1 + 0.5) if y1 == y0 else (y0, y1)
        at = [
            (left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top))
            for x, y in points
        ]
        line = " ".join(f"{px:.1f},{py:.1f}" for px, py in at)
        parts.append(f'<polyline points="{line}" fill="none" stroke="#1f77b4" stroke-width="1.4"/>')
        if dots:
            parts += [f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2.5" fill="#1f77b4"/>' for px, py in at]
        parts += [
            f'<text x="{left - 3}" y="{top + 8}" text-anchor="end">{_reprs.number(y1)}</text>',
            f'<text x="{left - 3}" y="{bottom}" text-anchor="end">{_reprs.number(y0)}</text>',
            f'<text x="{left}" y="{h - 8}">step {_reprs.number(x0)}</text>',
            f'<text x="{right}" y="{h - 8}" text-anchor="end">{_reprs.number(x1)}</text>',
            "</svg>",
        ]
        return "".join(parts)

    def close(self) -> None:
        """Nothing to release: the charts are strings."""

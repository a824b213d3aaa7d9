"""The dashboard's panels: the live-state and resource-gauge HTML, the curves drawn
with matplotlib's Agg backend, and the callback that keeps the last batch.

Imported only when a dashboard is made: it loads :mod:`rlnb.learn` (torch, which
a session has loaded already) and, on the first draw, matplotlib. Nothing here
holds a session.
"""

from __future__ import annotations

import html
import io
import math
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlnb import _reprs
from rlnb._samples import Group, RolloutBatch
from rlnb.learn import Callback
from rlnb.runtime import Snapshot

if TYPE_CHECKING:
    from rlnb._statistics import SessionStatistics
    from rlnb.session import Session

__all__ = ["Curves", "LastBatch", "call", "gauges_html", "rollouts_html", "state_html"]

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
    name: str, stats: SessionStatistics | None, tokens_per_s: float | None, *, exit_code: int | None = None
) -> str:
    """The live state: rollout state, policy version, training, samples, buffer, tokens/s.

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
    rows = [
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
    if closed:
        head += f' <span style="{_MUTED}">(figures as last seen open)</span>'
    return f"<div>{head}</div>{_table(rows)}"


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
    """reward_mean and entropy per step and held-out accuracy per evaluation, drawn
    with Agg into PNG bytes. The figure is made once and its lines are updated, so a
    redraw costs one render; no pyplot state is touched. Use from one thread at a time."""

    _SERIES = (("reward_mean", "reward_mean"), ("entropy", "entropy"), ("eval", "held-out accuracy"))

    def __init__(self) -> None:
        self._figure: Any = None
        self._lines: dict[str, Any] = {}

    def render(self, history: Sequence[Mapping[str, float]], evaluations: Sequence[tuple[int, float]]) -> bytes:
        """The curves as PNG bytes (one Agg draw, then a fast PNG encoding)."""
        from PIL import Image  # matplotlib's own dependency

        if self._figure is None:
            self._make()
        stride = max(1, len(history) // _MAX_POINTS)  # a line of 400 points looks the same and draws faster
        shown = list(history[::stride]) + ([history[-1]] if history and (len(history) - 1) % stride else [])
        steps = [int(m.get("version", i * stride + 1)) for i, m in enumerate(shown)]
        for key in ("reward_mean", "entropy"):
            self._lines[key].set_data(steps, [float(m.get(key, math.nan)) for m in shown])
        self._lines["eval"].set_data([v for v, _ in evaluations], [a for _, a in evaluations])
        for line in self._lines.values():
            line.axes.relim()
            line.axes.autoscale_view()
        canvas = self._figure.canvas
        canvas.draw()
        out = io.BytesIO()
        image = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
        image.save(out, format="png", compress_level=1)
        return out.getvalue()

    def _make(self) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        figure = Figure(figsize=(9.0, 2.3), dpi=72)
        FigureCanvasAgg(figure)
        figure.subplots_adjust(left=0.06, right=0.99, bottom=0.2, top=0.87, wspace=0.25)
        for i, (key, title) in enumerate(self._SERIES):
            ax = figure.add_subplot(1, 3, i + 1)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            ax.locator_params(nbins=4)  # fewer ticks: the axes are most of a draw's cost
            (self._lines[key],) = ax.plot([], [], "o-" if key == "eval" else "-", lw=1.2, ms=3)
            if key == "eval":
                ax.set_ylim(0.0, 1.05)  # an accuracy: a fixed scale reads better than a rescaled one
        self._figure = figure

    def close(self) -> None:
        """Drop the figure and matplotlib's cache of open font files, so a closed
        dashboard holds no file descriptor (fonts reopen on the next draw)."""
        self._figure, self._lines = None, {}
        font_manager = sys.modules.get("matplotlib.font_manager")  # never import it just to clear it
        if font_manager is not None:
            font_manager._get_font.cache_clear()

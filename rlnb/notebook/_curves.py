"""The dashboard's curves: reward, entropy and held-out accuracy as small SVG charts
with a labelled grid, built from strings (no matplotlib on the ticker thread), the
share of tokens the clip acted on (or why it cannot act), a critic's explained
variance where the algorithm learns one (``ppo``), and each reward function's
mean when a task has several; a dashed line marks each step at which live settings
changed (``Session.set``), labelled with what changed."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from rlnb import _reprs
from rlnb.config import ONE_UPDATE

if TYPE_CHECKING:
    from rlnb.config import Change, LearnConfig

__all__ = [
    "CLIP_TITLE",
    "CRITIC_TITLE",
    "DRAWABLE",
    "Curves",
    "clip_inactive",
    "clip_reason",
    "drawable",
    "marks",
    "off_chart",
    "ticks",
]

# The largest value a chart draws: float32's, the range rlnb's checks keep rewards in.
# A value beyond it (an older run's, or a hand-written metrics file's ±1e308) is left
# off the chart, as NaN is, and counted under it: an axis spanning ±1e308 is inf wide,
# and neither these charts (OverflowError) nor matplotlib (LinAlgError) can place a
# point on it, so one such run hid every other.
DRAWABLE = 3.4028234663852886e38

_MAX_POINTS = 400  # per curve; longer histories are thinned evenly
_GRID = "#e4e4e4"
_AXIS = "#999"
_MARK = "#b26a00"
_LABEL_CHARS = 26  # a mark's label is cut to this: a chart is 270 px wide
_LABEL_ROWS = 3  # rows of labels at the top of a chart; a label that fits in none is left out
_CHAR_PX = 5.0  # about the width of a character of a 9 px sans-serif label
_LOW, _HIGH = "#d62728", "#2ca02c"  # the clip's lower and upper bound's lines
CLIP_TITLE = "clip fraction"
CRITIC_TITLE = "critic: explained variance"


def clip_reason(learn: LearnConfig) -> str:
    """Why no clip acts in a step trained under ``learn`` whose record says
    ``clip_active`` 0: one update per batch (the ratio is 1 by construction), or a
    loss that has no clip."""
    return learn.why_no_clip or ONE_UPDATE


def clip_inactive(reason: str = ONE_UPDATE) -> str:
    """What the dashboard says in place of a clip fraction that cannot be anything but
    0: "clip inactive (ratio 1: one update per batch)"."""
    return f"clip inactive ({reason})"


def drawable(value: float) -> bool:
    """Whether a chart places ``value``: finite, and within ±:data:`DRAWABLE`."""
    return math.isfinite(value) and abs(value) <= DRAWABLE


def off_chart(count: int) -> str:
    """The note under a chart that left ``count`` values off."""
    return f"{count} value{'s' if count != 1 else ''} beyond ±{DRAWABLE:.2g} not drawn"


def ticks(low: float, high: float, most: int = 5, *, whole: bool = False) -> list[float]:
    """Round values from ``low`` to ``high`` for axis labels: steps of 1, 2, 2.5 or 5
    times a power of ten, at most ``most`` of them (both ends included when round);
    ``whole``: whole numbers only (policy steps). Just ``[low]`` for a range that is
    empty or not finite (its span included)."""
    if not (math.isfinite(low) and math.isfinite(high) and math.isfinite(high - low)) or high <= low:
        return [low]
    raw = max((high - low) / max(1, most - 1), 1.0 if whole else 0.0)
    power = 10 ** math.floor(math.log10(raw))
    steps = (1, 2, 5, 10) if whole else (1, 2, 2.5, 5, 10)
    step = next(m * power for m in steps if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    out = []
    value = first
    while value <= high + step * 1e-9:
        out.append(round(value, 12))
        value += step
    return out


def _label(value: float) -> str:
    return _reprs.number(int(value) if float(value).is_integer() and abs(value) < 1e6 else value)


def labels(values: list[float]) -> list[str]:
    """Axis labels for ``values``, in as few significant digits as tell them apart
    (four at least: an entropy between 2.6955 and 2.6965 read "2.696" twice)."""
    out, digits = [_label(v) for v in values], 4
    while len(set(out)) < len(out) and digits < 12:
        digits += 1
        out = [_label(v) if float(v).is_integer() else f"{v:.{digits}g}" for v in values]
    return out


def marks(changes: Iterable[Change]) -> list[tuple[float, str]]:
    """One ``(step, label)`` per policy version at which settings changed, in order:
    "lr→0.001", or "lr→0.001, top_k→5" for several at one step (a field changed twice
    there shows its last value)."""
    by_step: dict[int, dict[str, object]] = {}
    for change in changes:
        by_step.setdefault(change.step, {})[change.field] = change.new
    out = []
    for step in sorted(by_step):
        text = ", ".join(f"{field}→{_reprs.setting(new, digits=3, sep=',')}" for field, new in by_step[step].items())
        out.append((float(step), _reprs.clip(text, _LABEL_CHARS)))
    return out


class Curves:
    """reward_mean and entropy per step and held-out accuracy per evaluation, as
    three small SVG charts built from strings: a redraw costs well under a
    millisecond and never holds the GIL long enough to stall training or a click
    (a matplotlib draw took ~50 ms). Use from one thread at a time."""

    _SERIES = (("reward_mean", "reward_mean"), ("entropy", "entropy"), ("eval", "held-out accuracy"))
    WIDTH, HEIGHT = 270, 140

    def render(
        self,
        history: Sequence[Mapping[str, float]],
        evaluations: Sequence[tuple[int, float]],
        changes: Sequence[Change] = (),
        *,
        clip_reason: str = ONE_UPDATE,
    ) -> str:
        """The charts as one HTML block (each chart an ``<img>`` of SVG, so that it
        survives in a saved notebook's sanitised output too); each of ``changes``
        (``Session.changes``) is a dashed line at its step, on every chart. Where the
        steps record ``clip_active``, a "clip fraction" chart too (see :meth:`clip_chart`;
        ``clip_reason``: why a step with ``clip_active`` 0 had no clip, :func:`clip_reason`);
        where steps record a critic's ``explained_variance``, a chart of it (steps
        without a critic, before a switch to ``ppo``, are left out)."""
        changed = marks(changes)
        stride = max(1, len(history) // _MAX_POINTS)  # 400 points look the same as 4,000
        shown = list(history[::stride]) + ([history[-1]] if history and (len(history) - 1) % stride else [])
        steps = [float(m.get("version", i * stride + 1)) for i, m in enumerate(shown)]
        charts = []
        # A task with several reward functions: a chart of each one's mean per step too.
        per_function = [k for k in (history[-1] if history else {}) if k.startswith("reward/") and "/std" not in k[7:]]
        clip = [("clip", CLIP_TITLE)] if any("clip_active" in m for m in shown) else []
        # an algorithm with a critic (advantage="gae"): how well its values predict the returns
        critic = [("explained_variance", CRITIC_TITLE)] if any("explained_variance" in m for m in shown) else []
        for key, title in (*self._SERIES, *clip, *critic, *((k, k) for k in per_function)):
            tip = ""
            if key == "clip":
                svg, said = self.clip_chart(shown, steps, changed, reason=clip_reason)
                tip = f' title="{html.escape(said)}"' if said else ""
                data = base64.b64encode(svg.encode()).decode()
                charts.append(f'<img alt="{html.escape(title)}"{tip} src="data:image/svg+xml;base64,{data}">')
                continue
            if key == "eval":
                points = [(float(v), a) for v, a in evaluations]
                svg = self.chart(title, points, y_range=(0.0, 1.0), dots=True, marks=changed)
            else:
                values = [float(m.get(key, math.nan)) for m in shown]
                # Missing (NaN) is left out; ±inf and ±1e308 are counted as off the chart.
                points = [(x, y) for x, y in zip(steps, values, strict=True) if not math.isnan(y)]
                svg = self.chart(title, points, marks=changed)
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
        marks: Sequence[tuple[float, str]] = (),
        lines: Sequence[tuple[str, str, Sequence[tuple[float, float]]]] = (),
        empty: str | None = None,
        note: str = "",
    ) -> str:
        """One chart as an SVG document: a line through ``points`` over a grid whose
        lines are labelled with round values on both axes, and a dashed vertical line
        at the step of each of ``marks`` (``(step, label)``; the steps widen the x
        range), labelled unless it is too close to the last label. A point or mark
        that is not :func:`drawable` is left out, and the points left out are counted
        under the chart. ``lines``: more series, ``(label, colour, points)``, thinner
        and named in a legend; ``empty``: what a chart without points says (a line
        each, at ``\\n``; "no data yet" if None); ``note``: a line under the chart."""
        given = len(points)
        points = [(x, y) for x, y in points if drawable(x) and drawable(y)]
        lines = [
            (label, colour, [(x, y) for x, y in pts if drawable(x) and drawable(y)]) for label, colour, pts in lines
        ]
        marks = [m for m in marks if drawable(m[0])]
        off = given - len(points)
        said = "; ".join(([off_chart(off)] if off else []) + ([note] if note else []))
        w, h = self.WIDTH, self.HEIGHT
        left, right, top, bottom = 40, w - 10, 20, h - 22
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
            'font-size="10">',
            f'<text x="{w / 2}" y="13" text-anchor="middle" font-size="11">{html.escape(title)}</text>',
        ]
        size = f'width="{right - left}" height="{bottom - top}"'
        frame = f'<rect x="{left}" y="{top}" {size} fill="none" stroke="{_AXIS}"/>'
        note = (
            f'<text class="rlnb-off-chart" x="{right - 3}" y="{bottom - 4}" text-anchor="end" font-size="9" '
            'fill="#666" stroke="#fff" stroke-width="2.5" paint-order="stroke">'
            f"{html.escape(said)}</text>"
            if said
            else ""
        )
        if not points:
            rows = (empty if empty is not None else "no data yet" if not off else "nothing to draw").split("\n")
            first = (top + bottom) / 2 - 6 * (len(rows) - 1)
            texts = "".join(
                f'<text class="rlnb-empty" x="{(left + right) / 2}" y="{first + 12 * i:.1f}" text-anchor="middle" '
                f'fill="#999">{html.escape(row)}</text>'
                for i, row in enumerate(rows)
            )
            parts += [frame, f"{texts}{note}</svg>"]
            return "".join(parts)
        xs, ys = [p[0] for p in points], [p[1] for p in points + [q for *_, pts in lines for q in pts]]
        x0, x1 = min(xs + [m[0] for m in marks]), max(xs + [m[0] for m in marks])
        y0, y1 = y_range if y_range is not None else (min(ys), max(ys))
        x0, x1 = (x0 - 1, x1 + 1) if x1 == x0 else (x0, x1)
        y0, y1 = (y0 - 0.5, y1 + 0.5) if y1 == y0 else (y0, y1)

        def px(x: float) -> float:
            return left + (x - x0) / (x1 - x0) * (right - left)

        def py(y: float) -> float:
            return bottom - (y - y0) / (y1 - y0) * (bottom - top)

        ys = ticks(y0, y1, 5)
        for y, label in zip(ys, labels(ys), strict=True):
            parts.append(f'<line x1="{left}" x2="{right}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="{_GRID}"/>')
            parts.append(f'<text x="{left - 3}" y="{py(y) + 3.5:.1f}" text-anchor="end">{label}</text>')
        for x in ticks(x0, x1, 5, whole=True):
            parts.append(f'<line x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{top}" y2="{bottom}" stroke="{_GRID}"/>')
            parts.append(f'<text x="{px(x):.1f}" y="{bottom + 12}" text-anchor="middle">{_label(x)}</text>')
        parts.append(frame)
        parts.append(f'<text x="{left - 6}" y="{bottom + 12}" text-anchor="end" fill="#666">step</text>')
        parts += _marks_svg([(px(x), x, label) for x, label in marks], top, bottom, right)
        line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        for i, (label, colour, pts) in enumerate(lines):
            if pts:
                drawn = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
                parts.append(
                    f'<polyline class="rlnb-line" data-label="{html.escape(label)}" points="{drawn}" fill="none" '
                    f'stroke="{colour}" stroke-width="1" stroke-dasharray="4,2"/>'
                )
            # in the title's row, at the right: inside the frame it would hide the curve's start
            at = right - 42 * (len(lines) - 1 - i)
            parts.append(
                f'<text class="rlnb-legend" x="{at}" y="13" text-anchor="end" font-size="9" fill="{colour}">'
                f"- - {html.escape(label)}</text>"
            )
        parts.append(f'<polyline points="{line}" fill="none" stroke="#1f77b4" stroke-width="1.4"/>')
        if dots or len(points) < 3:  # a line through one or two points is hard to see
            parts += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="#1f77b4"/>' for x, y in points]
        parts.append(note)
        parts.append("</svg>")
        return "".join(parts)

    def clip_chart(
        self,
        shown: Sequence[Mapping[str, float]],
        steps: Sequence[float],
        marks: Sequence[tuple[float, str]] = (),
        *,
        reason: str = ONE_UPDATE,
    ) -> tuple[str, str]:
        """The "clip fraction" chart of the steps ``shown`` (at ``steps``) and what it
        says in words ("" when it shows a curve alone). Only the steps whose record
        has ``clip_active`` 1 are drawn (elsewhere the clip could not act and their 0
        means nothing): ``clip_fraction``, and ``clip_low_fraction`` and
        ``clip_high_fraction`` as two more lines where they differ. Where the last step
        had no clip, the chart says :func:`clip_inactive` (``reason``) instead of a
        flat 0, or under the curve of the earlier steps that had one."""
        active = [(x, m) for x, m in zip(steps, shown, strict=True) if m.get("clip_active") == 1.0]

        def series(key: str) -> list[tuple[float, float]]:
            return [(x, float(m[key])) for x, m in active if key in m and not math.isnan(float(m[key]))]

        points, low, high = series("clip_fraction"), series("clip_low_fraction"), series("clip_high_fraction")
        lines = [("low", _LOW, low), ("high", _HIGH, high)] if low != high else []
        now_inactive = bool(shown) and shown[-1].get("clip_active") == 0.0
        said = clip_inactive(reason) if now_inactive else ""
        note = ""
        if now_inactive and points:
            since = next(
                x for x, m in zip(reversed(steps), reversed(shown), strict=True) if m.get("clip_active") == 1.0
            )
            note, said = f"clip inactive after step {since:g}", f"{said} after step {since:g}"
        top = max([y for _, y in points + low + high if drawable(y)] or [0.0])
        svg = self.chart(
            CLIP_TITLE,
            points,
            y_range=(0.0, top if top > 0 else 0.1),
            marks=marks,
            lines=lines,
            empty=f"clip inactive\n({reason})" if now_inactive else None,
            note=note,
        )
        return svg, said

    def close(self) -> None:
        """Nothing to release: the charts are strings."""


def _marks_svg(marks: Sequence[tuple[float, float, str]], top: float, bottom: float, right: float) -> list[str]:
    """A dashed line at each mark's x (px), and its label beside it near the top (on
    the left of the line near the right edge), haloed in white over the curve: in the
    first of three rows where it overlaps no other label, else none."""
    parts = []
    row_ends = [-math.inf] * _LABEL_ROWS  # the right end (px) of the last label in each row
    for x, step, label in marks:
        parts.append(
            f'<line class="rlnb-change" data-step="{step:g}" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom}" '
            f'stroke="{_MARK}" stroke-width="1" stroke-dasharray="3,2"/>'
        )
        width = _CHAR_PX * len(label)
        end = x + 2 + width > right
        start = x - 2 - width if end else x + 2
        row = next((i for i, edge in enumerate(row_ends) if start > edge + 3), None)
        if row is None:
            continue
        row_ends[row] = start + width
        anchor, at = ("end", x - 2) if end else ("start", x + 2)
        parts.append(
            f'<text class="rlnb-change-label" x="{at:.1f}" y="{top + 9 + 10 * row}" text-anchor="{anchor}" '
            f'font-size="9" fill="{_MARK}" stroke="#fff" stroke-width="2.5" paint-order="stroke">'
            f"{html.escape(label)}</text>"
        )
    return parts

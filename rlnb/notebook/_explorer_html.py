"""The explorer's HTML, built from strings: a batch's groups as cards of coloured
tokens, with a caption and a legend. Everything here is a function of what
:class:`~rlnb.notebook._explorer.Explorer` computed once per batch (a :class:`Batch`
of :class:`Row` s) and of the choices it shows; nothing here holds a widget or a
session. A sample's coloured tokens are made once per quantity and kept in its row.
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlnb._samples import Group, Sample

__all__ = [
    "COLORS",
    "ENV_TITLE",
    "LOGP_FLOOR",
    "Batch",
    "Row",
    "card",
    "colour",
    "legend",
    "message",
    "number",
    "page",
    "page_label",
    "policy_versions",
    "row_meta",
    "shown_text",
    "spans",
]

# What each token can be coloured by, and what the legend calls it.
COLORS: Mapping[str, str] = {
    "behaviour": "behaviour log-prob",
    "learner": "learner log-prob",
    "ratio": "importance ratio",
    "version": "policy version",
    "advantage": "advantage",
}
LOGP_FLOOR = -4.0  # a log-prob at or below this gets the full colour (p <= 0.018)

_WHITE = (255, 255, 255)
_RED = (242, 139, 130)
_BLUE = (138, 180, 248)
_GREEN = (129, 201, 149)
_NONE = "#eeeeee"  # a token without the chosen number
_VERSION_COLOURS = ("#cfe3ff", "#ffd8a8", "#c3f0c8", "#f5c2e7", "#fff3a3", "#d5ccff", "#ffc9c9", "#b8f0ec")
_FINISH_COLOURS = {"stop": "#555", "length": "#b26a00", "aborted": "#b00020"}

# Inline styles, not a <style> block: a saved notebook's sanitised HTML keeps them.
# Widget HTML has the widgets' 28 px line height unless it is set.
_ROOT = "font-size:12px;line-height:1.45;max-width:100%"
_CAPTION = "color:#555;margin:2px 0 4px 0;overflow-wrap:anywhere"
_GRID = "display:flex;flex-wrap:wrap;gap:8px;align-items:flex-start"
_CARD = (
    "flex:0 1 19em;min-width:12em;max-width:100%;box-sizing:border-box;border:1px solid #d0d0d0;"
    "border-radius:4px;padding:4px 6px;overflow-wrap:anywhere;word-break:break-word"
)
_HEAD = "font-weight:bold;margin-bottom:2px"
_PROMPT = (
    "font-family:monospace;white-space:pre-wrap;word-break:break-all;max-height:7.5em;overflow-y:auto;"
    "background:#f4f4f4;padding:1px 4px;margin-bottom:3px"
)
_ROW = "border-top:1px solid #eee;padding:2px 0"
_META = "color:#555;font-size:11px"
_TOKENS = "font-family:monospace;font-size:13px;white-space:pre-wrap;word-break:break-all;overflow-wrap:anywhere"
_MARKER = (
    "background:#222;color:#fff;border-radius:3px;padding:0 3px;margin:0 2px;font-size:10px;"
    "font-family:sans-serif;white-space:nowrap"
)
_FLAG = (
    "background:#fff3cd;color:#7a5500;border-radius:3px;padding:0 4px;font-weight:normal;font-size:11px;"
    "white-space:nowrap"
)
_EMPTY_TEXT = "color:#999"
_TURN = (
    "background:#1f5fbf;color:#fff;border-radius:3px;padding:0 3px;margin:0 2px;font-size:10px;"
    "font-family:sans-serif;white-space:nowrap"
)
# An environment's reply: a dashed box of grey italic text, with no quantity's colour.
_ENV = (
    "border:1px dashed #999;border-radius:3px;padding:0 2px;margin:0 1px;color:#666;font-style:italic;"
    "box-decoration-break:clone;-webkit-box-decoration-break:clone"
)
_ENV_LABEL = (
    "color:#666;font-style:normal;font-family:sans-serif;font-size:10px;font-weight:bold;margin-right:3px;"
    "white-space:nowrap"
)
ENV_TITLE = "environment token (not trained on)"


def _mix(a: tuple[int, int, int], b: tuple[int, int, int], t: float) -> str:
    return "#{:02x}{:02x}{:02x}".format(*(round(x + (y - x) * t) for x, y in zip(a, b, strict=True)))


def _diverging(t: float, low: tuple[int, int, int], high: tuple[int, int, int]) -> str:
    """White at 0, ``high`` at +1, ``low`` at -1 (``t`` is clipped to [-1, 1])."""
    t = max(-1.0, min(1.0, t))
    return _mix(_WHITE, high, t) if t >= 0 else _mix(_WHITE, low, -t)


def _logp_colour(logp: float | None) -> str:
    return _NONE if logp is None else _mix(_WHITE, _RED, min(1.0, max(0.0, logp / LOGP_FLOOR)))


def shown_text(text: str) -> str:
    """A token's text as shown (escaped): newlines and tabs visible, nothing as a mark."""
    if not text:
        return "∅"
    return html.escape(text).replace("\n", "↵\n").replace("\t", "→\t")


def number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


@dataclasses.dataclass
class Row:
    """One sample with what its rendering needs, computed once."""

    group: int
    index: int
    sample: Sample
    reward: float
    advantage: float
    lag: int | None
    meta: str  # the line above its tokens, HTML
    texts: list[str]  # each token's shown text, HTML
    titles: list[str]  # each token's tooltip, escaped for an attribute
    values: dict[str, list[float | None]]  # per colour quantity, per token
    spans: dict[str, str] = dataclasses.field(default_factory=dict)  # per quantity: the tokens, coloured


@dataclasses.dataclass
class Batch:
    """A batch as the explorer shows it: its samples' rows and the scales of its colours."""

    label: str
    step: int | None  # a kept batch's step; None for groups that were not trained on
    base: int  # the policy version lags are counted from
    groups: tuple[Group, ...]
    rows: list[list[Row]]  # per group
    zero_variance: list[bool]
    learner_version: int
    learner_note: str  # why there are no learner log-probs, if there are none
    clip_eps: float
    versions: tuple[int, ...]
    max_advantage: float
    lags: tuple[int, ...]
    conversation: bool = False  # a sample holds an environment's replies or several policy turns
    served: tuple[str, ...] | None = None  # the endpoint's calls: each group's head (no reward to show)


def colour(b: Batch, quantity: str) -> Callable[[float | None], str]:
    """How a token's number of ``quantity`` becomes its background, on the batch's scales."""
    if quantity in ("behaviour", "learner"):
        return _logp_colour
    if quantity == "ratio":
        scale = math.log1p(b.clip_eps) or 0.2  # the clip range gets the full colour
        return lambda r: _NONE if r is None else _diverging(math.log(max(r, 1e-300)) / scale, _RED, _BLUE)
    if quantity == "version":
        first = b.versions[0] if b.versions else 0
        palette = _VERSION_COLOURS
        return lambda v: _NONE if v is None else palette[(int(v) - first) % len(palette)]
    top = b.max_advantage or 1.0
    return lambda a: _NONE if a is None else _diverging(a / top, _RED, _GREEN)


def spans(b: Batch, row: Row, quantity: str) -> str:
    """The sample's tokens coloured by ``quantity``: made once per quantity."""
    made = row.spans.get(quantity)
    if made is not None:
        return made
    sample = row.sample
    if not sample.token_ids:
        made = html.escape(sample.completion) or f'<span style="{_EMPTY_TEXT}">(no tokens)</span>'
    else:
        paint = colour(b, quantity)
        mask = sample.mask
        parts = []
        for i, (text, title, value) in enumerate(zip(row.texts, row.titles, row.values[quantity], strict=True)):
            env = mask[i] == 0
            if i and mask[i - 1] == 0 and not env:
                parts.append("</span>")  # the environment's reply ends
            parts += _markers(sample, i)
            extra = _EMPTY_TEXT + ";" if text == "∅" else ""
            if env:
                if i == 0 or mask[i - 1] == 1:
                    parts.append(_env_start(mask, i))
                style = f' style="{extra}"' if extra else ""
                parts.append(f'<span class="rlnb-env-token"{style} title="{title}">{text}</span>')
                continue
            style = f"{extra}background:{paint(value)};margin-right:1px"  # a gap: each token is seen
            parts.append(f'<span style="{style}" title="{title}">{text}</span>')
        if mask[-1] == 0:
            parts.append("</span>")
        made = "".join(parts)
    row.spans[quantity] = made
    return made


def page(b: Batch, state: Mapping[str, Any], ordered: list[tuple[int, list[Row]]]) -> str:
    """The whole rendering: a caption, the legend and a card per group of ``ordered``
    (a group's index and its shown rows, in the order shown) under ``state``'s choices."""
    cards, shown = [], 0
    for gi, rows in ordered:
        shown += len(rows)
        cards.append(card(b, gi, rows, state["color"]))
    total = sum(len(r) for r in b.rows)
    filters = [f"{k} {state[k]}" for k in ("finish", "lag", "advantage", "reward") if state[k] != "all"]
    caption = (
        f"<b>{html.escape(b.label)}</b>: {len(b.groups)} groups, {shown} of {total} samples shown"
        + (f" ({html.escape(', '.join(filters))})" if filters else "")
        + f" · colour: {html.escape(COLORS[state['color']])} · sorted by {html.escape(state['sort'])}"
    )
    empty = "" if cards else f'<div style="{_META}">no sample matches the filters</div>'
    return (
        f'<div class="rlnb-explorer" style="{_ROOT}"><div style="{_CAPTION}">{caption}</div>'
        f"{legend(b, state['color'])}{empty}"
        f'<div class="rlnb-groups" style="{_GRID}">{"".join(cards)}</div></div>'
    )


def card(b: Batch, gi: int, rows: list[Row], quantity: str) -> str:
    """Group ``gi``'s card: its head, its prompt and ``rows``, tokens coloured by ``quantity``."""
    group = b.groups[gi]
    rewards = [float(s.reward or 0.0) for s in group.samples]
    flag = ""
    if b.zero_variance[gi]:
        flag = (
            f' <span class="rlnb-zero-variance" style="{_FLAG}" title="every sample got reward '
            f'{rewards[0]:.3g}: its advantages are all 0, so this group gives no learning signal">'
            "zero variance</span>"
        )
    head = f"group {gi + 1} · mean reward {sum(rewards) / len(rewards):.2f}{flag}"
    if b.served is not None:
        head = html.escape(b.served[gi])
    parts = [
        f'<div class="rlnb-group" data-group="{gi}" style="{_CARD}"><div style="{_HEAD}">{head}</div>',
        f'<div class="rlnb-prompt" style="{_PROMPT}">{html.escape(group.prompt)}</div>',
    ]
    for r in rows:
        parts.append(
            f'<div class="rlnb-sample" data-sample="{r.index}" data-reward="{r.reward:.6g}" '
            f'data-advantage="{r.advantage:.6g}" data-finish="{r.sample.finish_reason}" '
            f'data-lag="{"" if r.lag is None else r.lag}" style="{_ROW}"><div style="{_META}">{r.meta}</div>'
            f'<div class="rlnb-tokens" style="{_TOKENS}">{spans(b, r, quantity)}</div></div>'
        )
    parts.append("</div>")
    return "".join(parts)


def legend(b: Batch, quantity: str) -> str:
    """What the colours of ``quantity`` and the markers mean."""

    def bar(left: str, colours: str, right: str) -> str:
        return (
            f'{left} <span style="display:inline-block;width:8em;height:0.9em;vertical-align:middle;'
            f'border:1px solid #ccc;background:linear-gradient(to right,{colours})"></span> {right}'
        )

    red, white = _mix(_WHITE, _RED, 1), "#ffffff"
    if quantity in ("behaviour", "learner"):
        what = (
            "the engine's, as it sampled"
            if quantity == "behaviour"
            else f"the current policy's (version {b.learner_version}) "
        )
        text = bar("p 1", f"{white},{red}", f"p ≤ {math.exp(LOGP_FLOOR):.2f} (log-prob ≤ {LOGP_FLOOR:g})")
        text += f" · {what}"
    elif quantity == "ratio":
        lo, hi = 1 / (1 + b.clip_eps), 1 + b.clip_eps
        blue = _mix(_WHITE, _BLUE, 1)
        text = bar(f"≤ {lo:.3g}", f"{red},{white},{blue}", f"≥ {hi:.3g}")
        text += f" · exp(learner - behaviour), learner at version {b.learner_version}"
    elif quantity == "version":
        first = b.versions[0] if b.versions else 0
        swatches = [
            f'<span style="background:{_VERSION_COLOURS[(v - first) % len(_VERSION_COLOURS)]};padding:0 4px">'
            f"v{v}</span>"
            for v in b.versions
        ]
        text = " ".join(swatches) or "no versions recorded"
    else:
        top = b.max_advantage
        text = bar(f"{-top:+.2f}", f"{red},{white},{_mix(_WHITE, _GREEN, 1)}", f"{top:+.2f}")
    note = "" if not b.learner_note or quantity not in ("learner", "ratio") else f" · {html.escape(b.learner_note)}"
    marker = f'<span style="{_MARKER}">‖ resumed</span> where a paused rollout was continued'
    if b.conversation:
        marker += (
            f' · <span class="rlnb-env" style="{_ENV}"><span style="{_ENV_LABEL}">env</span>reply</span> the '
            "environment's tokens: not trained on, so not coloured, and counted apart (tok + N env) · "
            f'<span style="{_TURN}">▸ turn 2</span> where a policy turn begins'
        )
    return f'<div class="rlnb-legend" style="{_CAPTION}">{text}{note} · {marker} · hover a token for its numbers</div>'


def page_label(step: int | None, steps: Sequence[int] | None) -> str:
    """Where the batch of ``step`` (None: groups not trained on) is among the kept
    batches' ``steps`` (None: the session is closed)."""
    if step is None:
        return f"<span style='{_META}'>groups given, not in sess.batches</span>"
    if steps is None:
        return f"<span style='{_META}'>step {step} (session closed)</span>"
    where = f"{steps.index(step) + 1} of {len(steps)} kept" if step in steps else "no longer kept"
    return f"<span style='{_META}'>step {step} · batch {where}</span>"


def message(text: str, *, error: bool = False) -> str:
    """A line for the explorer's message area (``text`` is HTML); red for an error."""
    style = "color:#b00020;line-height:1.4" if error else _META
    return f'<div style="{style}">{text}</div>'


def row_meta(
    sample: Sample, reward: float, advantage: float, lag: int | None, several: bool, *, served: bool = False
) -> str:
    """A sample's line: reward (each function's too, the environment's), advantage, finish,
    length and turns, versions, lag; ``served``: a call the endpoint served (no reward
    nor advantage: they are its episode's)."""
    parts = []
    if not served:
        parts.append(f"reward <b>{reward:.3g}</b>")
        if several and sample.rewards:
            each = ", ".join(f"{name} {number(v, '.3g')}" for name, v in sample.rewards.items())
            parts[0] += f" ({html.escape(each)})"
        parts.append(f"adv <b>{advantage:+.2f}</b>")
    finish = sample.finish_reason
    parts.append(f'<span style="color:{_FINISH_COLOURS.get(finish, "#555")}">{html.escape(finish)}</span>')
    if sample.env_reward is not None:
        parts.append(f"env reward {sample.env_reward:.3g}")
    policy = sum(sample.mask)  # what is trained on: an environment's tokens are counted apart
    env = len(sample.token_ids) - policy
    parts.append(f"{policy} tok" + (f" + {env} env" if env else ""))
    if len(sample.turns) > 1:
        parts.append(f"{len(sample.turns)} turns")
    if versions := policy_versions(sample):
        lo, hi = min(versions), max(versions)
        parts.append((f"v{lo}" if lo == hi else f"v{lo}-{hi}") + f" lag {lag}")
    if sample.resumed:
        parts.append(f"resumed x{sample.resumed}")
    return " · ".join(parts)


def policy_versions(sample: Sample) -> list[int]:
    """The versions of the policy's tokens (an environment's token copies the one before it)."""
    if len(sample.versions) != len(sample.mask):
        return list(sample.versions)
    return [v for v, m in zip(sample.versions, sample.mask, strict=True) if m]


def _markers(sample: Sample, i: int) -> list[str]:
    """What stands before token ``i``: a policy turn's start (after the first), a resume."""
    out = []
    if i and i in sample.turns:
        turn = sample.turns.index(i) + 1
        out.append(
            f'<span class="rlnb-turn" data-at="{i}" data-turn="{turn}" style="{_TURN}" '
            f'title="the policy\'s turn {turn} begins here, after {i} tokens">▸ turn {turn}</span>'
        )
    if i in sample.continued_at:
        versions = sample.versions
        before = versions[i - 1] if 0 < i <= len(versions) else "?"
        after = versions[i] if i < len(versions) else "?"
        out.append(
            f'<span class="rlnb-resumed" data-at="{i}" style="{_MARKER}" title="a pause cut this rollout '
            f'after {i} tokens and a resume continued it here (version {before} before, {after} after)">'
            "‖ resumed</span>"
        )
    return out


def _env_start(mask: Sequence[int], i: int) -> str:
    """The opening of the environment's reply that starts at token ``i``, with its label."""
    end = next((j for j in range(i, len(mask)) if mask[j]), len(mask))
    return (
        f'<span class="rlnb-env" data-at="{i}" data-tokens="{end - i}" style="{_ENV}" '
        f'title="the environment\'s reply ({end - i} tokens): not trained on, so not coloured">'
        f'<span class="rlnb-env-label" style="{_ENV_LABEL}">env</span>'
    )

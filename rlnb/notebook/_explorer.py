"""``Explorer``: one batch of rollouts, group by group and token by token (``sess.explore()``).

The groups stand side by side, each a card with its prompt and a row per sample
(reward, per function when there are several; advantage; finish reason; length;
policy versions and lag). Each completion token is coloured by a quantity chosen
above them (behaviour log-prob, learner log-prob, importance ratio, policy version,
advantage) and says its numbers on hover; where a pause cut a partial rollout and a
resume continued it, a marker stands between the two tokens. In a conversation (a
task with an environment) the environment's replies stand apart: labelled, grey and
uncoloured (the learner does not train on them, so no quantity applies), and each
policy turn after the first starts with a marker; a sample's counts and versions
are its policy tokens'.

Everything the rendering needs is computed once, when the explorer is made or
pages to a batch: the current policy's log-probs (``Session.logprobs``), the
tokens' texts, the advantages, each token's tooltip; a sample's coloured tokens
once per quantity, on first use. A control change only filters, sorts and joins
strings, on the thread that made the change; there is no thread of its own.

The explorer holds only a weak reference to the session (it needs it to page
through ``sess.batches``); ipywidgets, torch and IPython are imported only when
one is made.
"""

from __future__ import annotations

import collections
import dataclasses
import html
import math
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlnb._errors import ClosedError
from rlnb._samples import FINISH_REASONS, Group, Sample

if TYPE_CHECKING:
    from rlnb.session import Session

__all__ = ["COLORS", "FINISHES", "SIGNS", "SORTS", "Explorer"]

# What each token can be coloured by, and what the legend calls it.
COLORS: Mapping[str, str] = {
    "behaviour": "behaviour log-prob",
    "learner": "learner log-prob",
    "ratio": "importance ratio",
    "version": "policy version",
    "advantage": "advantage",
}
# Sort keys (samples within a group; groups by their first sample); "batch" keeps the batch's order.
SORTS = ("batch", "reward", "advantage", "lag", "finish", "length")
FINISHES = ("all", *FINISH_REASONS)
SIGNS = ("all", "positive", "zero", "negative")
LOGP_FLOOR = -4.0  # a log-prob at or below this gets the full colour (p <= 0.018)
_CACHED_BATCHES = 16  # batches paged to whose numbers are kept

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
_ENV_TITLE = "environment token (not trained on)"


def _mix(a: tuple[int, int, int], b: tuple[int, int, int], t: float) -> str:
    return "#{:02x}{:02x}{:02x}".format(*(round(x + (y - x) * t) for x, y in zip(a, b, strict=True)))


def _diverging(t: float, low: tuple[int, int, int], high: tuple[int, int, int]) -> str:
    """White at 0, ``high`` at +1, ``low`` at -1 (``t`` is clipped to [-1, 1])."""
    t = max(-1.0, min(1.0, t))
    return _mix(_WHITE, high, t) if t >= 0 else _mix(_WHITE, low, -t)


def _logp_colour(logp: float | None) -> str:
    return _NONE if logp is None else _mix(_WHITE, _RED, min(1.0, max(0.0, logp / LOGP_FLOOR)))


def _shown_text(text: str) -> str:
    """A token's text as shown (escaped): newlines and tabs visible, nothing as a mark."""
    if not text:
        return "∅"
    return html.escape(text).replace("\n", "↵\n").replace("\t", "→\t")


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


@dataclasses.dataclass
class _Row:
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
class _Batch:
    """A batch as the explorer shows it: its samples' rows and the scales of its colours."""

    label: str
    step: int | None  # a kept batch's step; None for groups that were not trained on
    base: int  # the policy version lags are counted from
    groups: tuple[Group, ...]
    rows: list[list[_Row]]  # per group
    zero_variance: list[bool]
    learner_version: int
    learner_note: str  # why there are no learner log-probs, if there are none
    clip_eps: float
    versions: tuple[int, ...]
    max_advantage: float
    lags: tuple[int, ...]
    conversation: bool = False  # a sample holds an environment's replies or several policy turns


class Explorer:
    """A batch of rollouts to look into: groups side by side, tokens coloured.

    Made by ``sess.explore(batch)`` (``batch`` None: the last of ``sess.batches``;
    an int indexes them; a :class:`~rlnb.learn.KeptBatch`; a list of groups such as
    ``sess.rollout(4)``). Raises ``RuntimeError`` when no batch was given and none
    has been trained yet, ``IndexError`` for an index outside ``sess.batches``,
    ``TypeError`` for anything else, :class:`~rlnb.ClosedError` for a closed
    session. Blocks while it computes the current policy's log-probs of the batch
    (between two steps, also while training runs in the background).

    Attributes: ``widget`` (an ``ipywidgets.VBox``); ``controls``, by what each sets
    (``color`` a ``ToggleButtons``; ``sort``, ``finish``, ``lag``, ``advantage`` and
    ``reward`` ``Dropdown`` s); ``buttons`` (``previous``, ``next``, ``latest``: paging
    through ``sess.batches``); ``page_label``, ``message`` and ``body`` (``HTML``);
    ``last_render_s``. Every control is :meth:`show`'s argument of the same name.

    Holds only a weak reference to the session: paging needs it open, the rest works
    on what was computed. :meth:`close` is idempotent.
    """

    def __init__(self, session: Session, batch: Any = None) -> None:
        if session.closed:
            raise ClosedError(f"session {session.name!r} is closed; explore a live session's batches")
        self.name = session.name
        self._session = weakref.ref(session)
        self._lock = threading.RLock()  # a click through a kernel subshell and a call from a cell
        self._texts: dict[int, tuple[str, str]] = {}  # token id -> (its text, as shown in HTML)
        self._cache: collections.OrderedDict[int, _Batch] = collections.OrderedDict()  # by step
        self._state: dict[str, Any] = {
            "color": "behaviour",
            "sort": "batch",
            "finish": "all",
            "lag": "all",
            "advantage": "all",
            "reward": "all",
        }
        self._closed = False
        self._handles: collections.deque[Any] = collections.deque(maxlen=32)
        self._setting = False  # show() is setting the controls: their observers stand by
        self.last_render_s: float | None = None
        self._batch = self._prepare(session, batch)
        self._html = ""
        self._build_widgets()
        self._render()

    # -- the batch ------------------------------------------------------------------------

    def _prepare(self, sess: Session, batch: Any) -> _Batch:
        """The batch's numbers, from the cache for a kept batch seen before."""
        if batch is None or (isinstance(batch, int) and not isinstance(batch, bool)):
            batch = self._kept(sess, batch)
        if isinstance(batch, Group):
            batch = [batch]
        if hasattr(batch, "groups") and hasattr(batch, "advantages") and hasattr(batch, "step"):
            step = int(batch.step)
            if (cached := self._cache.get(step)) is not None and cached.groups == tuple(batch.groups):
                self._cache.move_to_end(step)
                return cached
            made = self._cache[step] = self._compute(sess, tuple(batch.groups), kept=batch)
            while len(self._cache) > _CACHED_BATCHES:
                self._cache.popitem(last=False)
            return made
        if isinstance(batch, Sequence) and not isinstance(batch, str) and all(isinstance(g, Group) for g in batch):
            if not batch:
                raise ValueError("explore(batch=[]): the list holds no groups; pass sess.rollout(4), say")
            return self._compute(sess, tuple(batch), kept=None)
        raise TypeError(
            f"explore(batch={batch!r}): pass None (the last trained batch), an index into sess.batches, one of "
            "sess.batches, or groups such as sess.rollout(4)"
        )

    @staticmethod
    def _kept(sess: Session, index: int | None) -> Any:
        kept = sess.batches
        if not kept:
            if not sess.config.learn.keep_batches:
                why = "this session keeps none (LearnConfig.keep_batches=0)"
            else:
                why = "no step has been trained yet"
            raise RuntimeError(
                f"explore(): there is no trained batch to show ({why}): train a step with sess.step(), "
                "or look at fresh rollouts with sess.explore(sess.rollout(4))"
            )
        if index is None:
            return kept[-1]
        try:
            return kept[index]
        except IndexError:
            n = len(kept)
            raise IndexError(
                f"sess.batches[{index}] is out of range: {n} batches are kept (LearnConfig.keep_batches sets how "
                f"many); use an index in [{-n}, {n})"
            ) from None

    def _compute(self, sess: Session, groups: tuple[Group, ...], *, kept: Any) -> _Batch:
        from rlnb.learn import advantages_of

        if kept is not None:
            step: int | None = int(kept.step)
            base = int(kept.step) - 1  # the learner's version when it trained on the batch
            advantages = [list(a) for a in kept.advantages]
            clip_eps = float(kept.config.clip_eps)
            label = f"the batch of step {step}"
        else:
            step, base = None, sess.version
            rewards = [[float(s.reward or 0.0) for s in g.samples] for g in groups]
            advantages = [list(a) for a in advantages_of(rewards, scale=sess.config.learn.scale_advantages)]
            clip_eps = float(sess.config.learn.clip_eps)
            label = f"{len(groups)} groups not trained on (lags counted from version {base}, the policy now)"
        learner_version, note = sess.version, ""
        try:
            learner: list[list[list[float]]] | None = sess.logprobs(groups)
        except ClosedError:
            raise
        except Exception as exc:  # a batch the learner cannot score (made by hand, say): shown without them
            learner, note = None, f"no learner log-probs: {type(exc).__name__}: {exc}"
        several = any(len(s.rewards) > 1 for g in groups for s in g.samples)
        rows: list[list[_Row]] = []
        for gi, group in enumerate(groups):
            rows.append([])
            for si, sample in enumerate(group.samples):
                logps = None if learner is None else learner[gi][si]
                adv = advantages[gi][si] if si < len(advantages[gi]) else 0.0
                rows[-1].append(self._row(sess, gi, si, sample, adv, logps, base, several))
        zero = []
        for group in groups:
            values = [float(s.reward or 0.0) for s in group.samples]
            zero.append(max(values) - min(values) <= 1e-12)
        versions = sorted({v for g in groups for s in g.samples for v in _policy_versions(s)})
        lags = sorted({r.lag for g in rows for r in g if r.lag is not None})
        top = max((abs(r.advantage) for g in rows for r in g), default=0.0)
        talk = any(_talks(s) for g in groups for s in g.samples)
        return _Batch(
            label, step, base, groups, rows, zero, learner_version, note, clip_eps, tuple(versions), top, tuple(lags),
            conversation=talk,
        )  # fmt: skip

    def _text(self, sess: Session, token: int) -> tuple[str, str]:
        """A token's text and its HTML, decoded once per id."""
        known = self._texts.get(token)
        if known is None:
            try:
                raw = sess.tokenizer.decode([token])
            except Exception:  # an id the tokenizer does not know: shown, not fatal
                raw = "?"
            known = self._texts[token] = (raw, _shown_text(raw))
        return known

    def _row(
        self,
        sess: Session,
        gi: int,
        si: int,
        sample: Sample,
        advantage: float,
        learner: list[float] | None,
        base: int,
        several: bool,
    ) -> _Row:
        n = len(sample.token_ids)
        policy = [m == 1 for m in sample.mask]
        # An environment's token has no behaviour log-prob (0.0 stands in), no learner's
        # (Session.logprobs gives 0.0) and no advantage: the learner does not train on it.
        behaviour: list[float | None] = [None] * n
        if len(sample.logprobs) == n:
            behaviour = [b if p else None for b, p in zip(sample.logprobs, policy, strict=True)]
        versions = list(sample.versions) if len(sample.versions) == n else [None] * n
        mine: list[float | None] = list(learner[:n]) if learner is not None else []
        mine += [None] * (n - len(mine))
        mine = [a if p else None for a, p in zip(mine, policy, strict=True)]
        ratio = [
            math.exp(max(-50.0, min(50.0, a - b))) if a is not None and b is not None else None
            for a, b in zip(mine, behaviour, strict=True)
        ]
        texts, titles = [], []
        for i, token in enumerate(sample.token_ids):
            raw, text = self._text(sess, token)
            texts.append(text)
            b, a, r, v = behaviour[i], mine[i], ratio[i], versions[i]
            title = f"{raw!r} (id {token}), token {i + 1} of {n}\n"
            if not policy[i]:
                title += _ENV_TITLE
            else:
                title += (
                    f"behaviour log-prob {_number(b, '.3f')}"
                    + ("" if b is None else f" (p {math.exp(b):.3f})")
                    + f"\nlearner log-prob {_number(a, '.3f')}\nratio {_number(r, '.3f')}\n"
                    f"version {'-' if v is None else v}\nadvantage {advantage:+.3f}"
                )
            titles.append(html.escape(title, quote=True))
        own = _policy_versions(sample)
        lag = base - min(own) if own else None
        reward = float(sample.reward or 0.0)
        return _Row(
            group=gi,
            index=si,
            sample=sample,
            reward=reward,
            advantage=advantage,
            lag=lag,
            meta=_meta(sample, reward, advantage, lag, several),
            texts=texts,
            titles=titles,
            values={
                "behaviour": behaviour,
                "learner": mine,
                "ratio": ratio,
                "version": [None if v is None or not p else float(v) for v, p in zip(versions, policy, strict=True)],
                "advantage": [advantage if p else None for p in policy],
            },
        )

    # -- rendering ----------------------------------------------------------------------

    def _colour(self, quantity: str) -> Callable[[float | None], str]:
        b = self._batch
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

    def _spans(self, row: _Row, quantity: str) -> str:
        """The sample's tokens coloured by ``quantity``: made once per quantity."""
        made = row.spans.get(quantity)
        if made is not None:
            return made
        sample = row.sample
        if not sample.token_ids:
            made = html.escape(sample.completion) or f'<span style="{_EMPTY_TEXT}">(no tokens)</span>'
        else:
            colour = self._colour(quantity)
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
                style = f"{extra}background:{colour(value)};margin-right:1px"  # a gap: each token is seen
                parts.append(f'<span style="{style}" title="{title}">{text}</span>')
            if mask[-1] == 0:
                parts.append("</span>")
            made = "".join(parts)
        row.spans[quantity] = made
        return made

    def _render(self) -> None:
        started = time.perf_counter()
        self._html = self._make_html()
        if not self._closed:
            self.body.value = self._html
            self.page_label.value = self._page_text()
        self.last_render_s = time.perf_counter() - started

    def _make_html(self) -> str:
        b, st = self._batch, self._state
        cards, shown = [], 0
        for gi, rows in self._ordered():
            shown += len(rows)
            cards.append(self._card(gi, rows))
        total = sum(len(r) for r in b.rows)
        filters = [f"{k} {st[k]}" for k in ("finish", "lag", "advantage", "reward") if st[k] != "all"]
        caption = (
            f"<b>{html.escape(b.label)}</b>: {len(b.groups)} groups, {shown} of {total} samples shown"
            + (f" ({html.escape(', '.join(filters))})" if filters else "")
            + f" · colour: {html.escape(COLORS[st['color']])} · sorted by {html.escape(st['sort'])}"
        )
        empty = "" if cards else f'<div style="{_META}">no sample matches the filters</div>'
        return (
            f'<div class="rlnb-explorer" style="{_ROOT}"><div style="{_CAPTION}">{caption}</div>'
            f"{self._legend()}{empty}"
            f'<div class="rlnb-groups" style="{_GRID}">{"".join(cards)}</div></div>'
        )

    def _ordered(self) -> list[tuple[int, list[_Row]]]:
        """The groups (index, their shown rows in order) with a sample that passes the filters."""
        st = self._state
        key = _SORT_KEYS.get(st["sort"])
        out = []
        for gi, rows in enumerate(self._batch.rows):
            kept = [r for r in rows if _passes(r, st)]
            if not kept:
                continue
            if key is not None:
                kept.sort(key=key)
            out.append((gi, kept))
        if key is not None:
            out.sort(key=lambda pair: key(pair[1][0]))
        return out

    def _card(self, gi: int, rows: list[_Row]) -> str:
        b, quantity = self._batch, self._state["color"]
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
        parts = [
            f'<div class="rlnb-group" data-group="{gi}" style="{_CARD}"><div style="{_HEAD}">{head}</div>',
            f'<div class="rlnb-prompt" style="{_PROMPT}">{html.escape(group.prompt)}</div>',
        ]
        for r in rows:
            parts.append(
                f'<div class="rlnb-sample" data-sample="{r.index}" data-reward="{r.reward:.6g}" '
                f'data-advantage="{r.advantage:.6g}" data-finish="{r.sample.finish_reason}" '
                f'data-lag="{"" if r.lag is None else r.lag}" style="{_ROW}"><div style="{_META}">{r.meta}</div>'
                f'<div class="rlnb-tokens" style="{_TOKENS}">{self._spans(r, quantity)}</div></div>'
            )
        parts.append("</div>")
        return "".join(parts)

    def _legend(self) -> str:
        b, quantity = self._batch, self._state["color"]

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
        return (
            f'<div class="rlnb-legend" style="{_CAPTION}">{text}{note} · {marker} · hover a token for its numbers</div>'
        )

    def _page_text(self) -> str:
        b = self._batch
        sess = self._session()
        if b.step is None:
            return f"<span style='{_META}'>groups given, not in sess.batches</span>"
        if sess is None or sess.closed:
            return f"<span style='{_META}'>step {b.step} (session closed)</span>"
        steps = [int(k.step) for k in sess.batches]
        where = f"{steps.index(b.step) + 1} of {len(steps)} kept" if b.step in steps else "no longer kept"
        return f"<span style='{_META}'>step {b.step} · batch {where}</span>"

    # -- controls -------------------------------------------------------------------------

    def _build_widgets(self) -> None:
        import ipywidgets as w

        auto = w.Layout(width="auto")
        color = w.ToggleButtons(
            options=[(label, key) for key, label in COLORS.items()],
            value=self._state["color"],
            style={"button_width": "auto"},
            tooltips=[f"colour each token by its {label}" for label in COLORS.values()],
        )
        narrow = w.Layout(width="11em")
        self.controls: dict[str, Any] = {
            "color": color,
            "sort": w.Dropdown(options=SORTS, value="batch", description="sort", layout=narrow),
            "finish": w.Dropdown(options=FINISHES, value="all", description="finish", layout=narrow),
            "lag": w.Dropdown(options=self._lag_options(), value="all", description="lag", layout=narrow),
            "advantage": w.Dropdown(options=SIGNS, value="all", description="advantage", layout=narrow),
            "reward": w.Dropdown(options=SIGNS, value="all", description="reward", layout=narrow),
        }
        for control in self.controls.values():
            control.style.description_width = "initial"
        for name, control in self.controls.items():
            control.observe(self._changed(name), names="value")
        self.buttons: dict[str, Any] = {}
        for name, icon, tip in (
            ("previous", "arrow-left", "the batch before this one in sess.batches"),
            ("next", "arrow-right", "the batch after this one in sess.batches"),
            ("latest", "forward", "the last batch trained: sess.batches[-1]"),
        ):
            button = w.Button(description=name, icon=icon, tooltip=tip, layout=auto)
            button.on_click(self._clicked(name))
            self.buttons[name] = button
        self.page_label = w.HTML()
        self.message = w.HTML()
        self.body = w.HTML(layout=w.Layout(width="100%"))
        b = self.buttons
        pager = w.HBox([b["previous"], self.page_label, b["next"], b["latest"]], layout=w.Layout(align_items="center"))
        filters = [self.controls[k] for k in ("sort", "finish", "lag", "advantage", "reward")]
        row = w.HBox(filters, layout=w.Layout(flex_flow="row wrap"))
        self.widget = w.VBox([color, row, pager, self.message, self.body])
        self.widget.add_class("rlnb-explorer-widget")
        self._widgets = [*self.controls.values(), *b.values(), self.page_label, self.message, self.body]
        self._widgets += [pager, row, self.widget]

    def _lag_options(self) -> list[tuple[str, Any]]:
        lags = set(self._batch.lags)
        if isinstance(self._state["lag"], int):
            lags.add(self._state["lag"])
        return [("all", "all"), *((str(lag), lag) for lag in sorted(lags))]

    def _changed(self, name: str) -> Callable[[dict[str, Any]], None]:
        def on_change(change: dict[str, Any]) -> None:
            if not self._setting:
                self._act(lambda: self.show(**{name: change["new"]}))

        return on_change

    def _clicked(self, name: str) -> Callable[[Any], None]:
        return lambda _button: self._act(getattr(self, name))

    def _act(self, fn: Callable[[], object]) -> None:
        """A control's change or a click: done, and any error said in ``message``, never raised."""
        try:
            fn()
        except Exception as exc:
            text = html.escape(f"{type(exc).__name__}: {exc}")
            self.message.value = f'<div style="color:#b00020;line-height:1.4">{text}</div>'

    def show(
        self,
        *,
        color: str | None = None,
        sort: str | None = None,
        finish: str | None = None,
        lag: int | str | None = None,
        advantage: str | None = None,
        reward: str | None = None,
        page: int | None = None,
    ) -> None:
        """Change what is shown, as the controls do, and render once. ``color``: one of
        :data:`COLORS` (``"behaviour"``, ``"learner"``, ``"ratio"``, ``"version"``,
        ``"advantage"``); ``sort``: one of :data:`SORTS` (largest first; ``"finish"``:
        stop, length, aborted; ``"batch"``: the batch's order), samples within each
        group and groups by their first sample; filters: ``finish`` (one of
        :data:`FINISHES`), ``lag`` (``"all"`` or a version lag: the policy version the
        batch was trained at minus a sample's oldest token version), ``advantage`` and
        ``reward`` (one of :data:`SIGNS`); ``page``: an index into ``sess.batches``
        (the session must be open). Raises ``ValueError`` for a value not among the
        choices, ``IndexError`` for a page outside them, before anything changes."""
        wanted = {"color": color, "sort": sort, "finish": finish, "lag": lag, "advantage": advantage}
        wanted["reward"] = reward
        changes = {k: v for k, v in wanted.items() if v is not None}
        for key, value in changes.items():
            _check_choice(key, value)
        with self._lock:
            self._check_open()
            if page is not None:
                if isinstance(page, bool) or not isinstance(page, int):
                    raise TypeError(f"show(page={page!r}): pass an index into sess.batches, e.g. -1 for the last")
                sess = self._live("page through sess.batches")
                self._batch = self._prepare(sess, self._kept(sess, page))
            self._state.update(changes)
            self._sync_controls()
            self.message.value = ""
            self._render()

    def _sync_controls(self) -> None:
        self._setting = True
        try:
            lags = self._lag_options()
            if list(self.controls["lag"].options) != lags:
                self.controls["lag"].options = lags
            for key, control in self.controls.items():
                if control.value != self._state[key]:
                    control.value = self._state[key]
        finally:
            self._setting = False

    def previous(self) -> None:
        """Show the batch before this one in ``sess.batches`` (the newest kept one when
        these groups are not among them). Says so in ``message`` at the oldest."""
        self._move(-1)

    def next(self) -> None:
        """Show the batch after this one in ``sess.batches``. Says so in ``message`` at the newest."""
        self._move(+1)

    def latest(self) -> None:
        """Show the last batch trained (``sess.batches[-1]``)."""
        self.show(page=-1)

    def _move(self, by: int) -> None:
        with self._lock:
            self._check_open()
            sess = self._live("page through sess.batches")
            steps = [int(k.step) for k in sess.batches]
            if not steps:
                raise RuntimeError("no batch has been trained yet: sess.step() trains one")
            here = self._batch.step
            if here is None:
                target = len(steps) - 1 if by < 0 else None
            elif here in steps:
                target = steps.index(here) + by
            else:  # dropped from sess.batches since: the oldest kept one is next to it
                target = 0
            if target is None or not 0 <= target < len(steps):
                end = "oldest" if by < 0 else "newest"
                self.message.value = f'<div style="{_META}">this is the {end} batch kept (sess.batches)</div>'
                return
            self.show(page=target)

    def _live(self, what: str) -> Session:
        sess = self._session()
        if sess is None or sess.closed:
            raise ClosedError(f"session {self.name!r} is closed: the explorer cannot {what}; it still shows this batch")
        return sess

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this explorer is closed: make another with sess.explore()")

    # -- display and close ----------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def session(self) -> Session | None:
        """The session, while it is alive (the explorer holds only a weak reference)."""
        return self._session()

    @property
    def state(self) -> dict[str, Any]:
        """What is shown now: the colour, the sort, the filters and the batch's step
        (None for groups that were not trained on)."""
        with self._lock:
            return {**self._state, "step": self._batch.step}

    def html(self) -> str:
        """The current rendering as an HTML string (what the widget's body shows, and
        what a saved notebook keeps)."""
        return self._html

    def _static_bundle(self) -> dict[str, str]:
        return {"text/html": self._html, "text/plain": repr(self)}

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """The widget and the HTML of its current rendering (a front-end without widgets,
        or a saved notebook, shows the HTML); only the HTML once closed."""
        if self._closed:
            return self._static_bundle()
        return {**self._static_bundle(), **self.widget._repr_mimebundle_(), "text/plain": repr(self)}

    def _ipython_display_(self) -> None:
        from IPython.display import display

        bundle = self._repr_mimebundle_()
        handle = display(bundle, raw=True, display_id=True)
        if handle is not None and not self._closed:
            self._handles.append(handle)  # close() swaps it for the static copy

    def __repr__(self) -> str:
        b = self._batch
        samples = sum(len(r) for r in b.rows)
        status = "closed" if self._closed else f"colour {self._state['color']}, sorted by {self._state['sort']}"
        return f"<rlnb Explorer of {b.label} ({len(b.groups)} groups, {samples} samples): {status}>"

    def close(self) -> None:
        """Turn every display of the explorer into the HTML it shows now and close its
        widgets; :meth:`html` still works. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handles, self._handles = list(self._handles), collections.deque(maxlen=32)
        try:
            for handle in handles:
                handle.update(self._static_bundle(), raw=True)
        finally:
            for widget in self._widgets:
                for part in (widget, getattr(widget, "layout", None), getattr(widget, "style", None)):
                    if part is not None:
                        part.close()

    def __enter__(self) -> Explorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _meta(sample: Sample, reward: float, advantage: float, lag: int | None, several: bool) -> str:
    """A sample's line: reward (each function's too, the environment's), advantage, finish,
    length and turns, versions, lag."""
    parts = [f"reward <b>{reward:.3g}</b>"]
    if several and sample.rewards:
        each = ", ".join(f"{name} {_number(v, '.3g')}" for name, v in sample.rewards.items())
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
    if versions := _policy_versions(sample):
        lo, hi = min(versions), max(versions)
        parts.append((f"v{lo}" if lo == hi else f"v{lo}-{hi}") + f" lag {lag}")
    if sample.resumed:
        parts.append(f"resumed x{sample.resumed}")
    return " · ".join(parts)


def _policy_versions(sample: Sample) -> list[int]:
    """The versions of the policy's tokens (an environment's token copies the one before it)."""
    if len(sample.versions) != len(sample.mask):
        return list(sample.versions)
    return [v for v, m in zip(sample.versions, sample.mask, strict=True) if m]


def _talks(sample: Sample) -> bool:
    """Whether a sample is a conversation: an environment spoke, or the policy took several turns."""
    return sample.is_conversation or len(sample.turns) > 1


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


def _sign(value: float) -> str:
    return "positive" if value > 1e-12 else "negative" if value < -1e-12 else "zero"


def _passes(row: _Row, state: Mapping[str, Any]) -> bool:
    if state["finish"] != "all" and row.sample.finish_reason != state["finish"]:
        return False
    if state["lag"] != "all" and row.lag != state["lag"]:
        return False
    if state["advantage"] != "all" and _sign(row.advantage) != state["advantage"]:
        return False
    return state["reward"] == "all" or _sign(row.reward) == state["reward"]


# Each sort key puts the largest first (a smaller key sorts earlier).
_SORT_KEYS: dict[str, Callable[[_Row], Any]] = {
    "reward": lambda r: -r.reward,
    "advantage": lambda r: -r.advantage,
    "lag": lambda r: -(r.lag if r.lag is not None else -1),
    "finish": lambda r: FINISH_REASONS.index(r.sample.finish_reason),
    "length": lambda r: -sum(r.sample.mask),  # the policy's tokens
}


def _check_choice(key: str, value: Any) -> None:
    choices: Sequence[Any] = {
        "color": tuple(COLORS),
        "sort": SORTS,
        "finish": FINISHES,
        "advantage": SIGNS,
        "reward": SIGNS,
    }.get(key, ())
    if key == "lag":
        if value == "all" or (isinstance(value, int) and not isinstance(value, bool)):
            return
        raise ValueError(f"show(lag={value!r}): pass 'all' or a version lag, a whole number such as 0 or 1")
    if value not in choices:
        raise ValueError(f"show({key}={value!r}): choose one of {', '.join(map(repr, choices))}")

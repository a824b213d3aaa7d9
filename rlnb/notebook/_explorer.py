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
import html
import math
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlnb._errors import BatchIndexError, ClosedError, InvalidTypeError, InvalidValueError, StateError
from rlnb._samples import FINISH_REASONS, Group, Sample
from rlnb.notebook._explorer_html import (
    COLORS,
    ENV_TITLE,
    Batch,
    Row,
    message,
    number,
    page,
    page_label,
    policy_versions,
    row_meta,
    shown_text,
)
from rlnb.rollout import ServedCall

if TYPE_CHECKING:
    # what the explorer uses of a session: rlnb.session imports this layer, never the reverse
    from rlnb.notebook._protocol import NotebookSession as Session

__all__ = ["COLORS", "FINISHES", "SIGNS", "SORTS", "Explorer"]

# Sort keys (samples within a group; groups by their first sample); "batch" keeps the batch's order.
SORTS = ("batch", "reward", "advantage", "lag", "finish", "length")
FINISHES = ("all", *FINISH_REASONS)
SIGNS = ("all", "positive", "zero", "negative")
_CACHED_BATCHES = 16  # batches paged to whose numbers are kept


class Explorer:
    """A batch of rollouts to look into: groups side by side, tokens coloured.

    Made by ``sess.explore(batch)`` (``batch`` None: the last of ``sess.batches``;
    an int indexes them; a :class:`~rlnb.learn.KeptBatch`; a list of groups such as
    ``sess.rollout(4)``; calls the endpoint served, ``sess.serve().log()``, each a
    group of its choices). Raises ``RuntimeError`` when no batch was given and none
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
        self._cache: collections.OrderedDict[int, Batch] = collections.OrderedDict()  # by step
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

    def _prepare(self, sess: Session, batch: Any) -> Batch:
        """The batch's numbers, from the cache for a kept batch seen before."""
        if batch is None or (isinstance(batch, int) and not isinstance(batch, bool)):
            batch = self._kept(sess, batch)
        if isinstance(batch, Group):
            batch = [batch]
        served = isinstance(batch, Sequence) and bool(batch) and all(isinstance(c, ServedCall) for c in batch)
        heads = None
        if served:  # the endpoint's calls (sess.serve().log()): each a group of its choices
            calls = [call for call in batch if call.choices]
            heads = tuple(_call_head(call) for call in calls)
            batch = [call.as_group() for call in calls]
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
                raise InvalidValueError("explore(batch=[]): the list holds no groups; pass sess.rollout(4), say")
            label = f"{len(batch)} calls served by the endpoint, a row per choice" if served else None
            return self._compute(sess, tuple(batch), kept=None, label=label, served=heads)
        raise InvalidTypeError(
            f"explore(batch={batch!r}): pass None (the last trained batch), an index into sess.batches, one of "
            "sess.batches, groups such as sess.rollout(4), or the endpoint's calls, sess.serve().log()"
        )

    @staticmethod
    def _kept(sess: Session, index: int | None) -> Any:
        kept = sess.batches
        if not kept:
            if not sess.config.learn.keep_batches:
                why = "this session keeps none (LearnConfig.keep_batches=0)"
            else:
                why = "no step has been trained yet"
            raise StateError(
                f"explore(): there is no trained batch to show ({why}): train a step with sess.step(), "
                "or look at fresh rollouts with sess.explore(sess.rollout(4))"
            )
        if index is None:
            return kept[-1]
        try:
            return kept[index]
        except IndexError:
            n = len(kept)
            raise BatchIndexError(
                f"sess.batches[{index}] is out of range: {n} batches are kept (LearnConfig.keep_batches sets how "
                f"many); use an index in [{-n}, {n})"
            ) from None

    def _compute(
        self,
        sess: Session,
        groups: tuple[Group, ...],
        *,
        kept: Any,
        label: str | None = None,
        served: tuple[str, ...] | None = None,
    ) -> Batch:
        from rlnb.learn import advantages_of

        if kept is not None:
            step: int | None = int(kept.step)
            base = int(kept.step) - 1  # the learner's version when it trained on the batch
            advantages = [list(a) for a in kept.advantages]
            clip_eps = float(kept.config.resolved_algorithm.clip_high)
            label = f"the batch of step {step}"
        else:
            step, base = None, sess.version
            rewards = [[float(s.reward or 0.0) for s in g.samples] for g in groups]
            algorithm = sess.config.learn.resolved_algorithm
            advantages = [list(a) for a in advantages_of(rewards, algorithm=algorithm, groups=groups)]
            clip_eps = float(algorithm.clip_high)
            label = label or f"{len(groups)} groups not trained on (lags counted from version {base}, the policy now)"
        learner_version, note = sess.version, ""
        try:
            learner: list[list[list[float]]] | None = sess.logprobs(groups)
        except ClosedError:
            raise
        except Exception as exc:  # a batch the learner cannot score (made by hand, say): shown without them
            learner, note = None, f"no learner log-probs: {type(exc).__name__}: {exc}"
        several = any(len(s.rewards) > 1 for g in groups for s in g.samples)
        rows: list[list[Row]] = []
        for gi, group in enumerate(groups):
            rows.append([])
            for si, sample in enumerate(group.samples):
                logps = None if learner is None else learner[gi][si]
                adv = advantages[gi][si] if si < len(advantages[gi]) else 0.0
                rows[-1].append(self._row(sess, gi, si, sample, adv, logps, base, several, served=served is not None))
        zero = []
        for group in groups:
            values = [float(s.reward or 0.0) for s in group.samples]
            zero.append(served is None and max(values) - min(values) <= 1e-12)
        versions = sorted({v for g in groups for s in g.samples for v in policy_versions(s)})
        lags = sorted({r.lag for g in rows for r in g if r.lag is not None})
        top = max((abs(r.advantage) for g in rows for r in g), default=0.0)
        talk = any(_talks(s) for g in groups for s in g.samples)
        return Batch(
            label, step, base, groups, rows, zero, learner_version, note, clip_eps, tuple(versions), top, tuple(lags),
            conversation=talk, served=served,
        )  # fmt: skip

    def _text(self, sess: Session, token: int) -> tuple[str, str]:
        """A token's text and its HTML, decoded once per id."""
        known = self._texts.get(token)
        if known is None:
            try:
                raw = sess.tokenizer.decode([token])
            except Exception:  # an id the tokenizer does not know: shown, not fatal
                raw = "?"
            known = self._texts[token] = (raw, shown_text(raw))
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
        *,
        served: bool = False,
    ) -> Row:
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
                title += ENV_TITLE
            else:
                title += (
                    f"behaviour log-prob {number(b, '.3f')}"
                    + ("" if b is None else f" (p {math.exp(b):.3f})")
                    + f"\nlearner log-prob {number(a, '.3f')}\nratio {number(r, '.3f')}\n"
                    f"version {'-' if v is None else v}\nadvantage {advantage:+.3f}"
                )
            titles.append(html.escape(title, quote=True))
        own = policy_versions(sample)
        lag = base - min(own) if own else None
        reward = float(sample.reward or 0.0)
        return Row(
            group=gi,
            index=si,
            sample=sample,
            reward=reward,
            advantage=advantage,
            lag=lag,
            meta=row_meta(sample, reward, advantage, lag, several, served=served),
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

    def _render(self) -> None:
        started = time.perf_counter()
        self._html = page(self._batch, self._state, self._ordered())
        if not self._closed:
            self.body.value = self._html
            self.page_label.value = self._page_text()
        self.last_render_s = time.perf_counter() - started

    def _ordered(self) -> list[tuple[int, list[Row]]]:
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

    def _page_text(self) -> str:
        sess = self._session()
        steps = None if sess is None or sess.closed else [int(k.step) for k in sess.batches]
        return page_label(self._batch.step, steps)

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
            self.message.value = message(html.escape(f"{type(exc).__name__}: {exc}"), error=True)

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
                    raise InvalidTypeError(
                        f"show(page={page!r}): pass an index into sess.batches, e.g. -1 for the last"
                    )
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
                raise StateError("no batch has been trained yet: sess.step() trains one")
            here = self._batch.step
            if here is None:
                target = len(steps) - 1 if by < 0 else None
            elif here in steps:
                target = steps.index(here) + by
            else:  # dropped from sess.batches since: the oldest kept one is next to it
                target = 0
            if target is None or not 0 <= target < len(steps):
                end = "oldest" if by < 0 else "newest"
                self.message.value = message(f"this is the {end} batch kept (sess.batches)")
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


def _call_head(call: ServedCall) -> str:
    """A served call's card head: what became of it, its episode (or none), how long it took."""
    where = f"episode {call.episode}" if call.episode is not None else "outside any episode"
    return f"{call.fate} · {where} · {call.seconds * 1000:.0f} ms"


def _talks(sample: Sample) -> bool:
    """Whether a sample is a conversation: an environment spoke, or the policy took several turns."""
    return sample.is_conversation or len(sample.turns) > 1


def _sign(value: float) -> str:
    return "positive" if value > 1e-12 else "negative" if value < -1e-12 else "zero"


def _passes(row: Row, state: Mapping[str, Any]) -> bool:
    if state["finish"] != "all" and row.sample.finish_reason != state["finish"]:
        return False
    if state["lag"] != "all" and row.lag != state["lag"]:
        return False
    if state["advantage"] != "all" and _sign(row.advantage) != state["advantage"]:
        return False
    return state["reward"] == "all" or _sign(row.reward) == state["reward"]


# Each sort key puts the largest first (a smaller key sorts earlier).
_SORT_KEYS: dict[str, Callable[[Row], Any]] = {
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
        raise InvalidValueError(f"show(lag={value!r}): pass 'all' or a version lag, a whole number such as 0 or 1")
    if value not in choices:
        raise InvalidValueError(f"show({key}={value!r}): choose one of {', '.join(map(repr, choices))}")

"""``Dashboard``: a session's live notebook dashboard (ipywidgets).

One per session (``sess.dashboard()``). It holds only a weak reference to the
session; its one ticker thread sets widget values (ipykernel sends them from any
thread) and its buttons call the session's public methods on the thread that
clicks. When the session closes, every display of the dashboard is replaced by a
static copy (HTML, the curves as SVG images), so a saved notebook never shows a dead widget.

While a blocking call (``train()``, ``step()``, ``wait()``, ...) holds the kernel's
main thread, the ticker turns off every button that cannot run beside it and says
why; where clicks reach the kernel meanwhile (through JupyterLab's kernel subshell,
once a click has shown it), pause, resume and the settings' Apply stay on. A click
the kernel held back until the call returned is refused rather than run late (see
``_clicks``).

A banner at the top says the most severe finding of ``sess.diagnose()``, wrapped to its width
(at most every ``DIAGNOSE_INTERVAL`` s, never per tick), and its toggle shows them all.

A collapsed "settings" section holds an input per live setting and an Apply button
that calls ``Session.set`` with the fields edited (:meth:`Dashboard.apply_settings`
from code); the curves mark each change at its step. A collapsed "explorer" section
shows the last trained batch in an :class:`~rlnb.notebook.Explorer` once it is first
opened (:meth:`Dashboard.explore` from code); the ticker never draws it.

ipywidgets and IPython are imported only when a dashboard is made.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import html
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from rlnb._errors import ClosedError, ConfigError, InvalidValueError
from rlnb.notebook import _clicks
from rlnb.runtime import release_output_pipes, snapshot

if TYPE_CHECKING:
    from rlnb.config import Change
    from rlnb.notebook._explorer import Explorer
    from rlnb.notebook._protocol import NotebookSession
    from rlnb.session.reports import SessionStatistics

__all__ = ["Dashboard", "dashboard"]

# s between ticks: 2 updates a second (at most 4 are allowed). Every widget value a
# tick changes is a message the kernel serialises and signs while training runs:
# measured, 4 Hz with every panel cost ~5 % of background training's steps/s.
DEFAULT_INTERVAL = 0.5
CURVES_INTERVAL = 2.0  # s between redraws of the curves and the rollouts table, at least
DIAGNOSE_INTERVAL = 2.0  # s between sess.diagnose() calls for the findings banner, at least
_TIME_SHARE = 40  # and at least this many times a draw's duration: drawing takes <= 2.5 %
_TOKENS_WINDOW = 2.0  # s of engine token counts the tokens/s figure is taken over
_JOIN_TIMEOUT = 2.0
PAUSE_MODES = ("abort", "keep", "wait")
# (session method, icon, what it calls); the buttons are keyed, and labelled, by the method
_CONTROLS = (
    ("start", "play", "sess.training.start()"),
    ("stop", "stop", "sess.training.stop(); sess.rollouts.stop(): training and background generation"),
    ("pause", "pause", "sess.rollouts.pause(mode)"),
    ("resume", "play-circle", "sess.rollouts.resume()"),
    ("step", "step-forward", "sess.step()"),
    ("evaluate", "check", "sess.evaluate()"),
    ("save", "save", "sess.save(path)"),
)

_CACHE: weakref.WeakKeyDictionary[Any, Dashboard] = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.RLock()  # a session closing while its dashboard is made closes it inside


def dashboard(session: NotebookSession, *, interval: float = DEFAULT_INTERVAL) -> Dashboard:
    """The live :class:`Dashboard` of ``session``: made (and its ticker started) on
    the first call, the same one afterwards until it or the session closes.
    ``interval`` applies to a new one. Raises :class:`~rlnb.ClosedError` for a
    closed session. Does not block."""
    with _CACHE_LOCK:
        dash = _CACHE.get(session)
        if dash is None or dash.closed:
            dash = _CACHE[session] = Dashboard(session, interval=interval)
        return dash


def _session_closed(ref: weakref.ReferenceType[Dashboard]) -> None:
    """The session's close callback: it reaches the dashboard, never the other way round."""
    dash = ref()
    if dash is not None:
        dash._shutdown(session_closed=True)


class Dashboard:
    """Buttons, live state, resource gauges, curves and the last rollouts of a session.

    Get it with ``sess.dashboard()`` (or :func:`dashboard`); show it by leaving it
    last in a cell. It holds only a weak reference to the session. Attributes:

    - ``widget``: the ``ipywidgets.VBox`` holding everything below;
    - ``buttons``: ``ipywidgets.Button`` by the session method each calls (``start``,
      ``stop``, ``pause``, ``resume``, ``step``, ``evaluate``, ``save``; ``stop`` also
      stops background generation: ``sess.training.stop(); sess.rollouts.stop()``);
      ``pause_mode`` (a ``Dropdown``) and ``save_path`` (a ``Text``) are their arguments;
    - ``notice``: why buttons are off, when they are (``HTML``);
    - ``message``: the last action's result or error (``HTML``);
    - ``state``, ``gauges``, ``curves``, ``rollouts``: the panels (``HTML`` each);
    - ``diagnosis``: the most severe finding of ``sess.diagnose()`` (``HTML``, wrapped),
      ``diagnosis_toggle`` (a ``ToggleButton``) shows ``diagnosis_all``, every finding;
      ``findings``: the last :class:`~rlnb.session.Findings` (None before the first);
    - ``settings``: an input by live setting (:data:`rlnb.config.LIVE_FIELDS`: a
      ``FloatText``, an ``IntText``, or a ``Text`` where empty means None and for
      ``reward_weights``, "1, 0.5"), filled from ``sess.config``; ``apply_button``
      calls :meth:`apply_settings` with the fields edited, and ``settings_message``
      says what changed or why not; ``settings_panel`` is the collapsed ``Accordion``
      holding them;
    - ``explorer_panel``: a collapsed ``Accordion`` that, when first opened, makes
      ``explorer`` (an :class:`~rlnb.notebook.Explorer` of the last trained batch,
      None until then; its own buttons page to newer batches) or says in
      ``explorer_message`` why it cannot yet;
    - ``ticks`` and ``last_tick_s``: how many updates ran and what the last one took.

    Apply is on whenever the session is open, beside background training too (a
    change reaches the learner at its next step and rollouts for groups dispatched
    after it); while a blocking call holds the kernel it is on only where clicks
    reach the kernel meanwhile (a kernel subshell), as pause and resume: it then runs
    beside the call on the subshell's thread. Each tick shows values changed
    elsewhere (``sess.set(...)`` in a cell) in the inputs no one is editing.

    A ticker thread ``rlnb-<name>-dashboard`` calls :meth:`tick` every ``interval``
    seconds until :meth:`close` or the session's close, which replaces every display
    of the dashboard by :meth:`static_html`. A click from the page that the kernel
    held back while a blocking call ran is refused, saying so (see ``_clicks``).
    """

    def __init__(self, session: NotebookSession, *, interval: float = DEFAULT_INTERVAL) -> None:
        if not (isinstance(interval, int | float) and interval > 0):
            raise InvalidValueError(f"Dashboard(interval={interval!r}): use a positive number of seconds")
        if session.closed:
            raise ClosedError(f"session {session.name!r} is closed; a dashboard needs a live session")
        from rlnb.notebook import _curves, _panels, _settings

        self.name = session.name
        self.model = session.model_description  # with a LoRA model's parameter counts
        self.interval = float(interval)
        self._mode = session.config.mode
        self._session = weakref.ref(session)
        # The tokenizer's decode, for conversations' turns in the rollouts table: also at
        # the last render, after the session is gone (it holds no reference to the session).
        self._decode = session.tokenizer.decode
        self._baseline = session.baseline
        self._exit_code: int | None = None
        self._closed = False
        self._lock = threading.RLock()  # button states, busy set, closed flag, handles
        self._tick_lock = threading.Lock()  # one tick at a time (ticker, or a caller)
        self._stop = threading.Event()
        # Set by a tick skipped while another ran (which may have read the session before
        # the skipped caller's change, a click's): the ticker ticks again at once. Also
        # wakes the ticker to stop.
        self._again = threading.Event()
        self._busy: set[str] = set()
        self._handles: collections.deque[Any] = collections.deque(maxlen=32)
        self._stats: SessionStatistics | None = None
        self._page: dict[str, Any] | None = None  # the page's last click that came through a subshell
        self._pinned: dict[str, Any] | None = None  # what the ticker's updates are sent as caused by
        self._tokens: collections.deque[tuple[float, int]] = collections.deque()
        self._next_curves = 0.0
        self._next_diagnosis = 0.0
        self.findings: Any = None
        self._drawn: tuple[int, int, int] = (0, 0, 0)
        self._routed: str | None = None  # the subshell the inputs' messages were last routed to
        self._shown_batch = 0
        self.ticks = 0
        self.last_tick_s: float | None = None
        self._curves = _curves.Curves()
        self._batch = _panels.LastBatch()
        self._settings = _settings.SettingsPanel(session.config)
        self._build_widgets()
        self._thread = threading.Thread(target=self._run, name=f"rlnb-{self.name}-dashboard", daemon=True)
        session.callbacks.append(self._batch)
        try:
            self._thread.start()
        except BaseException:
            session.callbacks.remove(self._batch)
            self._close_widgets()
            raise
        # last: if the session closed meanwhile, this closes the dashboard at once
        session.on_close(_session_closed, weakref.ref(self))

    # -- widgets ----------------------------------------------------------------------

    def _build_widgets(self) -> None:
        import ipywidgets as w

        auto = w.Layout(width="auto")
        self.buttons: dict[str, Any] = {}
        for method, icon, calls in _CONTROLS:
            button = w.Button(description=method, icon=icon, tooltip=calls, layout=auto)
            button.on_click(functools.partial(self._act, method))
            self.buttons[method] = button
        self.pause_mode = w.Dropdown(options=PAUSE_MODES, value="abort", layout=w.Layout(width="6.5em"))
        self.save_path = w.Text(value=f"checkpoints/{self.name}", layout=w.Layout(width="12em"))
        b = self.buttons
        row = [b["start"], b["stop"], b["pause"], self.pause_mode, b["resume"], b["step"], b["evaluate"], b["save"]]
        controls = w.HBox([*row, self.save_path], layout=w.Layout(flex_flow="row wrap"))
        self.notice = w.HTML()
        self.message = w.HTML()
        self.state = w.HTML(value=self._state_html(), layout=w.Layout(margin="0 2em 0 0"))
        self.gauges = w.HTML()
        self.curves = w.HTML(layout=w.Layout(display="none"))
        self.rollouts = w.HTML()
        panels = w.HBox([self.state, self.gauges], layout=w.Layout(flex_flow="row wrap"))
        settings = self._settings
        self.settings, self.apply_button, self.settings_message = settings.inputs, settings.button, settings.message
        self.settings_panel = settings.widget
        self.apply_button.on_click(self._apply_clicked)
        self._explorer: Explorer | None = None
        self.explorer_message = w.HTML()
        self._explorer_box = w.VBox([self.explorer_message])
        self.explorer_panel = w.Accordion(children=[self._explorer_box], titles=("explorer",), selected_index=None)
        self.explorer_panel.observe(self._explorer_toggled, names="selected_index")
        self.diagnosis = w.HTML(layout=w.Layout(flex="1 1 0%", min_width="0"))
        self.diagnosis_toggle = w.ToggleButton(
            description="all findings", tooltip="sess.diagnose(): every finding", layout=w.Layout(display="none")
        )
        self.diagnosis_all = w.HTML(layout=w.Layout(display="none"))
        self.diagnosis_toggle.observe(self._diagnosis_toggled, names="value")
        # as wide as the dashboard and no wider: the banner wraps inside it
        row = w.Layout(align_items="center", width="100%", max_width="100%")
        self._diagnosis_row = w.HBox([self.diagnosis, self.diagnosis_toggle], layout=row)
        board = [controls, self.notice, self.message, panels, self.curves, self.settings_panel]
        board += [self.explorer_panel, self.rollouts]
        board[:0] = [self._diagnosis_row, self.diagnosis_all]  # the findings banner on top
        self.widget = w.VBox(board)
        classes = [(controls, "controls"), (self.notice, "notice"), (self.message, "message"), (self.state, "state")]
        classes += [(self.gauges, "gauges"), (self.curves, "curves"), (self.rollouts, "rollouts")]
        classes += [(self._diagnosis_row, "diagnosis"), (self.diagnosis_all, "diagnosis")]
        for widget, name in [*classes, (self.widget, "dashboard")]:
            widget.add_class(f"rlnb-{name}")
        self._widgets = [*b.values(), self.pause_mode, self.save_path, controls, panels, self.widget]
        self._widgets += [self.notice, self.message, self.state, self.gauges, self.curves, self.rollouts]
        self._widgets += [self.diagnosis, self.diagnosis_toggle, self.diagnosis_all, self._diagnosis_row]
        self._widgets += [*settings.widgets, self.explorer_message, self._explorer_box, self.explorer_panel]

    def _close_widgets(self) -> None:
        if self._explorer is not None:
            self._explorer.close()
        for widget in self._widgets:  # their layouts and styles are widgets with comms too
            for part in (widget, getattr(widget, "layout", None), getattr(widget, "style", None)):
                if part is not None:
                    part.close()

    def _say(self, text: str, *, error: bool = False) -> None:
        text = text if len(text) <= 600 else text[:599] + "…"
        style = ' style="color:#b00020;line-height:1.4"' if error else ' style="line-height:1.4"'
        kind = "error" if error else "ok"
        self.message.value = f'<div class="rlnb-{kind}"{style}>{html.escape(text)}</div>'

    # -- the ticker -------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def session(self) -> NotebookSession | None:
        """The session, while it is alive (the dashboard holds only a weak reference)."""
        return self._session()

    def _run(self) -> None:
        while not self._stop.is_set():
            if (page := self._page) is not None and page is not self._pinned:
                _clicks.send_as_caused_by(page)
                self._pinned = page
                self._route_inputs(page)
            self._again.clear()
            self.tick()
            if not self._again.is_set():
                self._again.wait(self.interval)

    def _route_inputs(self, page: dict[str, Any]) -> None:
        """Once per subshell: route what the page sends about each input and button
        (typed values, clicks) to that subshell, where this thread's updates now say
        they come from. A widget's messages otherwise go where its last update came
        from, perhaps the busy main shell: a value typed there would reach the kernel
        after the Apply click that reads it."""
        subshell = (page.get("header") or {}).get("subshell_id")
        if subshell == self._routed:
            return
        self._routed = subshell
        for widget in (*self.buttons.values(), self.pause_mode, self.save_path):
            widget.send_state("disabled")
        self._settings.route()

    @property
    def live_clicks(self) -> bool:
        """Whether the page's clicks reach the kernel while a cell runs (through a
        kernel subshell, as a click has shown)."""
        return self._page is not None

    def tick(self, *, wait: bool = True, curves: bool = True) -> None:
        """Update every panel from the session now (the ticker does this each
        ``interval``): one ``statistics()``, one probe snapshot, and the curves at
        most every ``CURVES_INTERVAL`` s. Never raises: a failure shows in ``message``.
        ``wait=False`` skips the update if one is under way: the ticker then updates
        again once it has ended (the one under way may have read the session before
        this caller's change; a click's effect shows at once, not an interval later);
        ``curves=False`` leaves the curves for the ticker."""
        if not self._tick_lock.acquire(blocking=wait):
            self._again.set()
            return
        try:
            if self._closed:
                return
            started = time.perf_counter()
            try:
                self._update(curves=curves)
            except Exception as exc:
                self._say(f"dashboard update failed: {exc!r}", error=True)
            self.last_tick_s = time.perf_counter() - started
            self.ticks += 1
        finally:
            self._tick_lock.release()

    def _update(self, *, curves: bool = True) -> None:
        sess = self._session()
        if sess is None:  # collected without a close callback: nothing left to show
            self._stop.set()
            self._again.set()
            return
        if sess.closed:
            return  # its close callback is about to run
        try:
            stats = sess.statistics(raise_errors=False)  # a failure stays for the user's next call
        except ClosedError:
            return
        if stats.training.error is not None:
            self._say(f"background training failed: {stats.training.error}", error=True)
        if stats.rollout.state == "syncing" and self._stats is not None:
            # a weight sync is a moment of the state it interrupts (paused, say), not a state to show
            steady = dataclasses.replace(stats.rollout, state=self._stats.rollout.state)
            stats = dataclasses.replace(stats, rollout=steady)
        self._stats = stats
        self._settings.refresh(sess.config)  # a change made in code shows here
        now = time.monotonic()
        self._tokens.append((now, stats.engine.generated_tokens))
        while len(self._tokens) > 2 and now - self._tokens[1][0] >= _TOKENS_WINDOW:
            self._tokens.popleft()
        self.state.value = self._state_html()
        from rlnb.notebook import _panels

        self.gauges.value = _panels.gauges_html(snapshot(), self._baseline)
        self._sync_buttons(stats)
        if curves and now >= self._next_diagnosis:
            self._diagnose(sess)
        if curves and now >= self._next_curves:
            self._draw_curves(sess.history, sess.evaluations, sess.changes, self._clip_reason(sess))
            step, groups = self._batch.last  # a table of many samples: at the curves' pace
            if step != self._shown_batch:
                self._shown_batch = step
                self.rollouts.value = _panels.rollouts_html(groups, step, decode=self._decode)

    def _diagnose(self, sess: NotebookSession) -> None:
        """The findings banner from ``sess.diagnose()`` (nothing logged, nothing raised),
        at most every ``DIAGNOSE_INTERVAL`` s and at most 1/_TIME_SHARE of the time. A
        failure shows in the banner; the last findings stay."""
        from rlnb.notebook import _panels

        started = time.monotonic()
        try:
            self.findings = findings = sess.diagnose(track=False, raise_errors=False)
        except Exception as exc:
            self.diagnosis.value = _panels.diagnosis_failed_html(exc)
            return
        finally:
            self._next_diagnosis = started + max(DIAGNOSE_INTERVAL, _TIME_SHARE * (time.monotonic() - started))
        self.diagnosis.value = _panels.diagnosis_html(findings)
        self.diagnosis_all.value = _panels.findings_html(findings)
        self.diagnosis_toggle.description = f"all {len(findings)} findings"
        self.diagnosis_toggle.layout.display = None if len(findings) > 1 else "none"

    def _diagnosis_toggled(self, change: dict[str, Any]) -> None:
        self.diagnosis_all.layout.display = None if change["new"] else "none"

    def _all_findings_static(self) -> str:
        if self.findings is None or len(self.findings) < 2:
            return ""
        return f"<details><summary>all {len(self.findings)} findings</summary>{self.diagnosis_all.value}</details>"

    def _state_html(self) -> str:
        from rlnb.notebook import _panels

        rate = None
        if len(self._tokens) >= 2:
            (t0, n0), (t1, n1) = self._tokens[0], self._tokens[-1]
            rate = (n1 - n0) / (t1 - t0) if t1 > t0 else None
        return _panels.state_html(
            self.name, self._stats, rate, exit_code=self._exit_code, model=self.model, mode=self._mode
        )

    @staticmethod
    def _clip_reason(sess: NotebookSession) -> str:
        """Why a step of ``sess`` whose record says ``clip_active`` 0 had no clip."""
        from rlnb.notebook import _curves

        return _curves.clip_reason(sess.config.learn)

    def _draw_curves(
        self,
        history: list[dict[str, float]],
        evaluations: list[tuple[int, float]],
        changes: list[Change],
        clip_reason: str,
    ) -> None:
        """Redraw when the data changed, at most every ``CURVES_INTERVAL`` s and
        never more than 1/_TIME_SHARE of the time."""
        key = (len(history), len(evaluations), len(changes))
        if key == self._drawn:
            return
        started = time.monotonic()
        self.curves.value = self._curves.render(history, evaluations, changes, clip_reason=clip_reason)
        self.curves.layout.display = None
        self._drawn = key
        self._next_curves = started + max(CURVES_INTERVAL, _TIME_SHARE * (time.monotonic() - started))

    # -- the buttons ------------------------------------------------------------------

    def _sync_buttons(self, stats: SessionStatistics | None) -> None:
        """Enable what can be used now and say why the rest is off; a busy button is
        left to its handler."""
        from rlnb.notebook import _panels

        stats = None if self._closed else stats
        usable = _panels.usable(stats, live_clicks=self.live_clicks)
        notice = _panels.controls_notice(stats, live_clicks=self.live_clicks)
        settings = _panels.settings_usable(stats, live_clicks=self.live_clicks)
        with self._lock:
            for method, button in self.buttons.items():
                if method not in self._busy:
                    button.disabled = not usable[method]
            self.pause_mode.disabled = self.save_path.disabled = self._closed
            busy = "apply" in self._busy
            self._settings.set_disabled(button=busy or not settings, inputs=self._closed)
            self.notice.value = f'<div style="color:#666;line-height:1.4">{html.escape(notice)}</div>' if notice else ""

    def _from_page(self, button: Any) -> dict[str, Any] | None:
        """The page's message behind a click on ``button``, or None (code called
        ``click()``); a message through a subshell becomes the one the ticker's
        updates are sent as caused by, so the next clicks go there too."""
        page = _clicks.page_message(button)
        if page is not None and _clicks.through_a_subshell(page):
            self._page = page
        return page

    def _act(self, method: str, _button: Any = None) -> None:
        """A click: call the session's ``method`` (busy meanwhile) and say what happened.
        A click from the page that was made while a blocking call held the kernel is
        refused instead (see ``_clicks``)."""
        button = self.buttons[method]
        page = self._from_page(button)
        with self._lock:
            if self._closed or method in self._busy:
                return
            refused = self._refusal(method, button, page) if page is not None else None
            if refused is None:
                self._busy.add(method)
                button.disabled, button.description = True, f"{method}…"
        if refused is not None:
            self._say(refused, error=True)
            return
        try:
            text = self._call(method)
        except Exception as exc:
            self._say(f"{method}() failed: {type(exc).__name__}: {exc}", error=True)
        else:
            self._say(text)
        finally:
            with self._lock:
                button.description = method
                self._busy.discard(method)
        # Show the effect (and the buttons' new states) at once, unless the ticker is
        # drawing: a click must never wait for the curves.
        self.tick(wait=False, curves=False)

    def _refusal(self, method: str, button: Any, page: dict[str, Any]) -> str | None:
        """Why a click from the page (its message ``page``) on ``method`` must not run now, or None."""
        sess = self._session()
        if sess is None or sess.closed:
            return None  # the call says the session is closed
        from rlnb.notebook import _panels

        stats = sess.statistics(raise_errors=False)
        why_off = _panels.controls_notice(stats, live_clicks=self.live_clicks)
        return _clicks.refusal(method, stats, off=button.disabled, why_off=why_off, made=_clicks.made_at(page))

    def _apply_clicked(self, _button: Any = None) -> None:
        """A click on the settings' Apply: :meth:`apply_settings` with the fields edited
        (busy meanwhile), its outcome said in the panel, never raised. A click from the
        page that a blocking call held back is refused, as any button's (``_clicks``)."""
        button = self.apply_button
        page = self._from_page(button)
        with self._lock:
            if self._closed or "apply" in self._busy:
                return
            refused = self._refusal("apply", button, page) if page is not None else None
            if refused is None:
                self._busy.add("apply")
                button.disabled, button.description = True, "apply…"
        if refused is not None:
            self._settings.say(refused, error=True)
            return
        values: dict[str, Any] | None = None
        try:
            values = self._settings.edited()
            if values:
                self.apply_settings(**values)
            else:
                self._settings.say("nothing to apply: no field was edited (the inputs show the values in force)")
        except ConfigError as exc:
            if values is None:  # a value typed that is not one; apply_settings says its own
                self._settings.say(str(exc), error=True)
        except Exception as exc:
            self._settings.say(f"{type(exc).__name__}: {exc}", error=True)
        finally:
            with self._lock:
                button.description = "apply"
                self._busy.discard("apply")
        self.tick(wait=False, curves=False)

    # -- the explorer -------------------------------------------------------------------

    @property
    def explorer(self) -> Explorer | None:
        """The explorer in the "explorer" section, once the section was opened (or
        :meth:`explore` called); None before."""
        return self._explorer

    def explore(self) -> Explorer:
        """What opening the "explorer" section does: the first time, make an
        :class:`~rlnb.notebook.Explorer` of the last trained batch (``sess.explore()``)
        and show it there, opened; afterwards the same one (its ``latest`` button shows
        newer batches). Raises ``RuntimeError`` while no step has been trained and
        :class:`~rlnb.ClosedError` once the session or this dashboard is closed.
        Blocks while the explorer computes the batch's log-probs (between two steps)."""
        from rlnb.notebook._explorer import Explorer

        with self._lock:
            explorer = self._explorer
        if explorer is None:
            sess = self._session()
            if self._closed or sess is None or sess.closed:
                raise ClosedError(f"this dashboard of session {self.name!r} is closed: use sess.explore()")
            made = Explorer(sess)
            with self._lock:
                if self._closed:
                    made.close()
                    raise ClosedError(f"this dashboard of session {self.name!r} is closed: use sess.explore()")
                if self._explorer is None:  # else another thread made one meanwhile
                    self._explorer = made
                    self._explorer_box.children = [self.explorer_message, made.widget]
                    self.explorer_message.value = ""
                explorer = self._explorer
            if explorer is not made:
                made.close()
        self.explorer_panel.selected_index = 0
        return explorer

    def _explorer_toggled(self, change: dict[str, Any]) -> None:
        """The section was opened or closed: opened the first time, make the explorer,
        or say why not (opening it again tries again)."""
        if change["new"] is None or self._explorer is not None or self._closed:
            return
        try:
            self.explore()
        except Exception as exc:
            text = html.escape(str(exc) if isinstance(exc, RuntimeError) else f"{type(exc).__name__}: {exc}")
            self.explorer_message.value = (
                f'<div style="color:#666;line-height:1.4">{text} (close and open this section again, '
                "or call dash.explore())</div>"
            )

    def apply_settings(self, **values: Any) -> list[Change]:
        """What the settings' Apply does: ``sess.set(**values)`` (live settings by name,
        as :meth:`~rlnb.Session.set` takes them), then the panel says what changed
        ("set at step 11: lr 0.0001 → 0.001 (from the next update)") and its
        inputs show the values now in force. Returns the changes.

        Raises :class:`~rlnb.ConfigError` for a setting or value ``set`` refuses,
        before anything changes (the panel shows the message too, in red), and
        :class:`~rlnb.ClosedError` once the session or this dashboard is closed.
        Blocks only while ``set`` hands rollout settings to the event loop
        (milliseconds); may run beside background training, and beside a foreground
        call from another thread (a click through a kernel subshell)."""
        sess = self._session()
        if self._closed or sess is None or sess.closed:
            raise ClosedError(
                f"this dashboard of session {self.name!r} is closed: use sess.set(...) or a new sess.dashboard()"
            )
        try:
            changes = sess.set(**values)
        except ConfigError as exc:
            # the refused values go, or every later Apply would send them again and fail
            self._settings.refresh(sess.config)
            back = self._settings.reset(self._settings.refused(values)) if set(values) <= set(self.settings) else ""
            self._settings.say(str(exc).rstrip(".") + back if back else str(exc), error=True)
            raise
        except Exception as exc:
            self._settings.say(f"{type(exc).__name__}: {exc}", error=True)
            raise
        from rlnb.notebook import _settings

        self._settings.refresh(sess.config, force=values.keys())
        self._settings.say(_settings.changes_text(changes))
        return changes

    def _call(self, method: str) -> str:
        from rlnb.notebook import _panels

        sess = self._session()
        if sess is None or sess.closed:
            raise ClosedError(f"session {self.name!r} is closed")
        path = self.save_path.value.strip() or f"checkpoints/{self.name}"
        return _panels.call(sess, method, pause_mode=self.pause_mode.value, save_path=path)

    # -- display and close ------------------------------------------------------------

    def _ipython_display_(self) -> None:
        from IPython.display import HTML, display

        with self._lock:  # a close in between would miss this display's handle
            if self._closed:
                display(HTML(self.static_html()))
                return
            handle = display(self.widget, display_id=True)
            if handle is not None:
                self._handles.append(handle)

    def static_html(self) -> str:
        """The dashboard as plain HTML (the state, the gauges, the last message and
        rollouts, the curves as inline SVG images): what replaces it once closed."""
        if self._exit_code is not None:  # the state panel says how it closed
            head = ""
        else:
            status = "open; this is a copy of its dashboard" + (" (closed)" if self._closed else "")
            head = f"<div><b>rlnb session {html.escape(repr(self.name))}</b>: {status}</div>"
        parts = (
            head,
            f'<div class="rlnb-diagnosis">{self.diagnosis.value}{self._all_findings_static()}</div>',
            f'<div class="rlnb-message">{self.message.value}</div>',
            f'<div style="display:flex;flex-wrap:wrap;gap:2em"><div class="rlnb-state">{self.state.value}</div>',
            f'<div class="rlnb-gauges">{self.gauges.value}</div></div>',
            f'<div class="rlnb-curves">{self.curves.value}</div>{self._settings.static_html()}',
            f'<div class="rlnb-rollouts">{self.rollouts.value}</div>',
        )
        return f'<div class="rlnb-dashboard rlnb-static">{"".join(parts)}</div>'

    def _repr_html_(self) -> str:
        return self.static_html()

    def __repr__(self) -> str:
        if self._exit_code is not None:
            status = f"session closed, exit code {self._exit_code}"
        else:
            status = "closed" if self._closed else f"live, ticking every {self.interval:g} s"
        stats = None if self._closed else self._stats
        state = "" if stats is None else f", rollouts {stats.rollout.state}, step {stats.training.step}"
        return f"<rlnb Dashboard of session {self.name!r}: {status}{state}>"

    def close(self) -> None:
        """Stop the ticker (joined within milliseconds), take the dashboard's callback
        off the session and replace every display by :meth:`static_html`. The session
        goes on; ``sess.dashboard()`` makes a new dashboard. Idempotent. Blocks briefly."""
        self._shutdown(session_closed=False)

    def _shutdown(self, *, session_closed: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._again.set()
        if self._thread is not threading.current_thread() and self._thread.ident is not None:
            self._thread.join(_JOIN_TIMEOUT)
        with self._tick_lock:  # a tick from a click handler has finished too
            pass
        # The kernel's output pipes of the ticker and of every other thread that has ended
        # (ipykernel sweeps them every 10 s): the last frame's gauges count what is left.
        release_output_pipes()
        try:
            self._final_frame(session_closed)
        finally:
            self._close_widgets()

    def _final_frame(self, session_closed: bool) -> None:
        """Draw the last frame from the figures the session closed with, then swap
        every display for its static copy."""
        from IPython.display import HTML

        from rlnb.notebook import _curves, _panels

        sess = self._session()
        history, evaluations = ([], []) if sess is None else (sess.history, sess.evaluations)
        changes = [] if sess is None else sess.changes
        clip_reason = _curves.ONE_UPDATE if sess is None else self._clip_reason(sess)
        if sess is not None:
            self._settings.keep(sess.config)  # the static copy shows the settings it closed with
            if self._batch in sess.callbacks:
                sess.callbacks.remove(self._batch)
            if session_closed:
                self._exit_code = sess.exit_code
                try:
                    self._stats = sess.statistics(raise_errors=False)
                except Exception:  # the last figures seen open stay
                    pass
            self._diagnose(sess)  # the findings it closed with
            with _CACHE_LOCK:
                if _CACHE.get(sess) is self:
                    del _CACHE[sess]
        del sess
        try:
            if history or evaluations:
                self._draw_curves(history, evaluations, changes, clip_reason)
            step, groups = self._batch.last
            if step != self._shown_batch:
                self.rollouts.value = _panels.rollouts_html(groups, step, decode=self._decode)
        finally:
            self._curves.close()
        self.state.value = self._state_html()
        self.gauges.value = _panels.gauges_html(snapshot(), self._baseline, final=session_closed)
        self._sync_buttons(None)
        static = HTML(self.static_html())
        with self._lock:
            handles = list(self._handles)
        for handle in handles:
            handle.update(static)

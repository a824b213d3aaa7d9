"""The dashboard's panels as HTML: the live state (training and generation, each in
its own words), what the buttons can do now and why, the resource gauges, the last
batch, the callback that keeps that batch, and the findings banner (``diagnose()``).

Imported only when a dashboard is made: it loads :mod:`rlnb.learn` (torch, which
a session has loaded already). Nothing here holds a session.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlnb import _reprs
from rlnb._errors import InvalidValueError
from rlnb._samples import Group, RolloutBatch, Sample
from rlnb.learn import Callback
from rlnb.notebook._explorer import _talks
from rlnb.runtime import Snapshot

if TYPE_CHECKING:
    from rlnb.notebook._protocol import NotebookSession
    from rlnb.session.reports import SessionStatistics

__all__ = [
    "LastBatch",
    "beside",
    "call",
    "controls_notice",
    "diagnosis_failed_html",
    "diagnosis_html",
    "findings_html",
    "gauges_html",
    "generation_state",
    "generation_text",
    "kept_html",
    "ranks_html",
    "replicas_html",
    "rollouts_html",
    "settings_usable",
    "state_html",
    "training_state",
    "training_text",
    "usable",
]

SHOWN_GROUPS = 2  # groups of the last batch in the rollouts table
METHODS = ("start", "stop", "pause", "resume", "step", "evaluate", "save")

_COLOURS = {
    "running": "#1b7f3b",
    "background": "#1b7f3b",
    "foreground": "#1f5fbf",
    "pausing": "#b26a00",
    "paused": "#b26a00",
    "stopped": "#666666",
    "idle": "#666666",
    "closed": "#666666",
}
_MUTED = "color:#666"
_COMPACT = "line-height:1.4"  # widget HTML takes the widgets' 28 px line height otherwise
_LEFT = "text-align:left;padding:0 0.8em 0 0;vertical-align:top"

# The kernel cannot update the page once a restart or shutdown has begun (JupyterLab
# stops routing the old kernel's messages first), so the state panel carries its own
# epitaph: ipywidgets marks a widget whose kernel is gone with this class (and draws a
# broken-link icon on each of its parts, hidden here), and the CSS swaps the live
# state for the line that says how the session ended.
_GONE = (
    "<style>.rlnb-gone{display:none}"
    ".jupyter-widgets-disconnected .rlnb-gone{display:block;color:#b00020;font-weight:bold}"
    ".jupyter-widgets-disconnected .rlnb-live{display:none}"
    ".rlnb-dashboard .jupyter-widgets-disconnected::before,"
    ".rlnb-dashboard.jupyter-widgets-disconnected::before{display:none!important}"
    # the buttons, the notice, the gauges, the settings and the findings spoke of a process that is gone
    ".rlnb-controls.jupyter-widgets-disconnected,.rlnb-notice.jupyter-widgets-disconnected,"
    ".rlnb-gauges.jupyter-widgets-disconnected,.rlnb-settings.jupyter-widgets-disconnected,"
    ".rlnb-diagnosis.jupyter-widgets-disconnected"
    "{display:none!important}</style>"
    '<div class="rlnb-gone">kernel gone: a restart or shutdown closed the session '
    "(tracker exit code 130); run the notebook again to go on</div>"
)


class LastBatch(Callback):
    """Keeps the last trained batch and the step it trained; holds no session.

    ``last`` is ``(step, groups)`` (``(0, ())`` before the first step), replaced in
    one assignment so a reader on another thread never sees a step that does not
    match its groups. A batch that was not trained on (an interrupted step) is not kept.
    """

    def __init__(self) -> None:
        self.last: tuple[int, tuple[Group, ...]] = (0, ())
        self._batch: tuple[Group, ...] = ()

    def on_batch(self, groups: Sequence[Group]) -> None:
        self._batch = tuple(groups)

    def on_step_end(self, metrics: Mapping[str, float]) -> None:
        step = int(metrics.get("version", self.last[0] + 1))
        self.last = (step, self._batch)


# -- what the session is doing ------------------------------------------------------------


def training_state(stats: SessionStatistics | None, *, closed: bool = False) -> str:
    """``"closed"``, ``"foreground"`` (a blocking call such as ``train()`` holds the
    kernel), ``"background"`` (``start()``'s thread trains) or ``"idle"``."""
    if closed or stats is None or stats.closed:
        return "closed"
    t = stats.training
    if t.running:
        return "background"
    return "foreground" if t.foreground is not None and t.foreground.call != "wait()" else "idle"


def generation_state(stats: SessionStatistics | None, *, closed: bool = False) -> str:
    """``"closed"``, ``"pausing"``, ``"paused"``, ``"running"`` (dispatching in the
    background or generating for a step; a weight sync is a moment of it) or
    ``"stopped"`` (nothing in flight and nothing dispatching)."""
    if closed or stats is None or stats.closed:
        return "closed"
    r = stats.rollout
    if r.state in ("pausing", "paused", "closed"):
        return r.state
    return "running" if r.dispatching or r.in_flight else "stopped"


def _word(kind: str, state: str, text: str) -> str:
    """A state as its own element (``rlnb-<kind>-word``, ``data-state``), so a browser test can read it."""
    colour = _COLOURS.get(state, "#000")
    return (
        f'<span class="rlnb-{kind}-word" data-state="{html.escape(state)}" '
        f'style="font-weight:bold;color:{colour}">{html.escape(text)}</span>'
    )


def state_html(
    name: str,
    stats: SessionStatistics | None,
    tokens_per_s: float | None,
    *,
    exit_code: int | None = None,
    model: str | None = None,
    mode: str | None = None,
) -> str:
    """The live state: a head line with training's and generation's state words, then
    the model, policy version, training, generation, samples, buffer, tokens/s.

    ``exit_code`` (not None once the session closed) turns both words to CLOSED;
    the figures are then those the session closed with. ``mode``: the config's."""
    closed = exit_code is not None
    training, generation = training_state(stats, closed=closed), generation_state(stats, closed=closed)
    words = (
        f"training {_word('training', training, training.upper())} · "
        f"generation {_word('state', generation, _generation_word(stats, generation))}"
    )
    head = f'<b>session {html.escape(repr(name))}</b> <span class="rlnb-live">{words}</span>'
    if closed:
        head += f' <span class="rlnb-exit-code">closed, exit code {exit_code}</span>'
        table = "" if stats is None else _table(_rows(stats, None, model, mode, closed=True))
        return f'<div style="{_COMPACT}">{head}</div>{table}'
    if stats is None:
        return f'<div style="{_COMPACT}">{head}</div>{_GONE}'
    table = _table(_rows(stats, tokens_per_s, model, mode, closed=False))
    return f'<div style="{_COMPACT}">{head}</div>{_GONE}<div class="rlnb-live">{table}</div>'


def _generation_word(stats: SessionStatistics | None, state: str) -> str:
    mode = None if stats is None else stats.engine.paused
    return f"{state.upper()} ({mode})" if state in ("pausing", "paused") and mode else state.upper()


def _rows(
    stats: SessionStatistics, tokens_per_s: float | None, model: str | None, mode: str | None, *, closed: bool
) -> list[tuple[str, str]]:
    r, t = stats.rollout, stats.training
    rows = [] if model is None else [("model", html.escape(model))]
    rows += [
        ("policy version", f"{t.step} (engine {stats.engine.version})"),
        ("training", html.escape(training_text(stats, closed=closed))),
    ]
    if t.waiting and not closed:
        rows.append(("a step waits for", html.escape(t.waiting)))
    rows.append(("generation", html.escape(generation_text(stats, mode, closed=closed))))
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
    learner = getattr(stats, "learner", None)
    if learner is not None:
        rows.append(("learner ranks", ranks_html(learner)))
    return rows


def training_text(stats: SessionStatistics, *, closed: bool = False) -> str:
    """Training in a sentence: idle, a foreground call and its progress, or the
    background run and its steps/s (and where its batches come from while generation pauses)."""
    t = stats.training
    rate = "" if t.steps_per_s is None else f", {t.steps_per_s:.3g} steps/s"
    state = training_state(stats, closed=closed)
    if state == "closed":
        return f"ended at step {t.step}" + ("" if t.steps_per_s is None else f" (last run {t.steps_per_s:.3g} steps/s)")
    if state == "foreground":
        assert t.foreground is not None
        progress = t.foreground.progress(t.step)
        return f"{t.foreground.call} in the foreground" + (f": {progress}" if progress else "") + rate
    if state == "background":
        text = f"in the background{rate}"
        if generation_state(stats) in ("pausing", "paused"):
            groups = sum(stats.buffer.sizes.values())
            text += f"; generation is paused, so it trains on the {groups} groups in the buffer"
        return text
    return "idle" + ("" if t.steps_per_s is None else f" (last run {t.steps_per_s:.3g} steps/s)")


def generation_text(stats: SessionStatistics, mode: str | None = None, *, closed: bool = False) -> str:
    """Generation in a sentence: running (how, and how many in flight), pausing,
    paused (mode, what was kept) or stopped (and what starts it)."""
    r, state = stats.rollout, generation_state(stats, closed=closed)
    pause_mode = stats.engine.paused or "?"
    if state == "closed":
        return f"closed ({r.cancelled} cancelled in all)"
    if state == "pausing":
        return f"pausing ({pause_mode}): {r.in_flight} in flight finish first"
    if state == "paused":
        kept = {"abort": f"{r.kept_partial} kept as partial rollouts", "keep": f"{r.in_flight} frozen in the engine"}
        return f"paused ({pause_mode}): " + kept.get(pause_mode, f"{r.in_flight} in flight, {r.kept_partial} kept")
    if state == "running":
        if r.dispatching:
            full = [p for p, n in stats.buffer.sizes.items() if n >= stats.buffer.capacity]
            if not r.in_flight and full:
                return f"in the background, held: the buffer is full ({full[0]} {stats.buffer.capacity} groups)"
            budget = "" if r.groups_allowed is None else f", {r.groups_live} of {r.groups_allowed} groups allowed live"
            return f"in the background: {r.in_flight} in flight{budget}"
        if mode == "sync":
            return f"for the step in progress (sync mode): {r.in_flight} in flight"
        return f"{r.in_flight} in flight; nothing new is dispatched in the background"
    if mode == "sync":
        return "stopped: each step rolls out its own batch (sync mode)"
    return "stopped: sess.training.start(), step() or sess.rollouts.start() starts it"


def _buffer(stats: SessionStatistics) -> str:
    b = stats.buffer
    fill = ", ".join(f"{p} {n}/{b.capacity} groups ({b.samples.get(p, 0)} samples)" for p, n in b.sizes.items())
    return f"{fill or 'empty'}; evicted stale {b.evicted_stale}"


def _table(rows: Sequence[tuple[str, str]]) -> str:
    """``(label, html)`` rows; the labels are escaped here, the values by the caller."""
    body = "".join(
        f'<tr><th style="{_LEFT};white-space:nowrap">{html.escape(k)}</th><td style="{_LEFT}">{v}</td></tr>'
        for k, v in rows
    )
    return f'<table style="border-collapse:collapse;max-width:36em;{_COMPACT}"><tbody>{body}</tbody></table>'


# -- the findings banner ------------------------------------------------------------------

_SEVERITY_COLOURS = {"critical": "#b00020", "warning": "#b26a00", "info": "#666666"}
# wrapped, never cut: a finding's fix is the part that matters, and it comes last
_BANNER = f"{_COMPACT};white-space:normal;overflow-wrap:anywhere;max-width:100%"


def diagnosis_html(findings: Sequence[Any]) -> str:
    """The most severe of ``findings`` (``Session.diagnose()``'s, most severe first) as
    a banner: its severity in its colour, its code, what was seen and the fix, wrapped
    to the dashboard's width (the whole text is its tooltip too). None: a muted line
    that says so."""
    if not findings:
        return (
            f'<div class="rlnb-finding-top" data-severity="none" style="{_BANNER};{_MUTED}">'
            "diagnose(): nothing looks wrong</div>"
        )
    top = findings[0]
    more = f" (and {len(findings) - 1} more)" if len(findings) > 1 else ""
    full = html.escape(f"{top.severity} [{top.code}] {top.what}; fix: {top.fix}{more}")
    colour = _SEVERITY_COLOURS.get(top.severity, "#000")
    return (
        f'<div class="rlnb-finding-top" data-severity="{html.escape(top.severity)}" '
        f'data-code="{html.escape(top.code)}" title="{full}" style="{_BANNER}">'
        f'<b style="color:{colour}">{html.escape(top.severity)}</b> <code>{html.escape(top.code)}</code> '
        f'{html.escape(top.what)} <span style="{_MUTED}">fix: {html.escape(top.fix)}</span></div>'
    )


def findings_html(findings: Sequence[Any]) -> str:
    """Every finding as a table (what the banner's toggle shows); empty for none."""
    render = getattr(findings, "_repr_html_", None)
    return render() if findings and render is not None else ""


def diagnosis_failed_html(exc: BaseException) -> str:
    """The banner when ``diagnose()`` itself failed (the last findings stay in the table)."""
    text = html.escape(_reprs.clip(f"diagnose() failed: {type(exc).__name__}: {exc}", 300))
    return f'<div class="rlnb-finding-top" data-severity="error" style="{_BANNER};color:#b00020">{text}</div>'


# -- the buttons ---------------------------------------------------------------------------


def beside(call: str) -> frozenset[str]:
    """The buttons that may run beside the blocking ``call`` (its text in the
    statistics, e.g. ``"train(until=150)"``), on another thread: pause and resume, the
    settings' ``apply`` (``Session.set`` changes settings between two steps, the
    foreground's as the background's), and stop while ``wait()`` waits on the
    background run."""
    both = {"pause", "resume", "apply"}
    return frozenset({*both, "stop"} if call == "wait()" else both)


def settings_usable(stats: SessionStatistics | None, *, live_clicks: bool = False) -> bool:
    """Whether the settings' Apply can run now: while the session is open, beside
    background training too; beside a blocking call only where clicks reach the
    kernel meanwhile (``live_clicks``), as pause and resume."""
    if stats is None or stats.closed:
        return False
    return stats.training.foreground is None or live_clicks


def usable(stats: SessionStatistics | None, *, live_clicks: bool = False) -> dict[str, bool]:
    """Which buttons can run now. While a blocking call holds the kernel's main thread,
    only those that may run beside it, and only if clicks reach the kernel meanwhile
    (``live_clicks``: JupyterLab sends them through a kernel subshell); a click that
    would wait for the call is never queued."""
    if stats is None or stats.closed:
        return dict.fromkeys(METHODS, False)
    training, state = stats.training.running, stats.rollout.state
    running = state in ("running", "syncing")  # a sync is a moment of a running state
    now = {
        "start": not training,
        "stop": training or stats.rollout.dispatching,
        "pause": running,
        "resume": state in ("pausing", "paused"),
        "step": not training and running,
        "evaluate": not training and running,
        "save": not training,
    }
    if (call := stats.training.foreground) is not None:
        allowed = beside(call.call) if live_clicks else frozenset()
        now = {method: on and method in allowed for method, on in now.items()}
    return now


def controls_notice(stats: SessionStatistics | None, *, live_clicks: bool = False) -> str:
    """Why buttons are off now, in a line (empty when nothing needs saying)."""
    if stats is None or stats.closed:
        return ""
    t = stats.training
    if t.foreground is not None:
        progress = t.foreground.progress(t.step)
        what = f"{t.foreground.call} is running in the foreground" + (f", at {progress}" if progress else "")
        stop = "stop waiting (training goes on)" if t.foreground.call == "wait()" else "stop it"
        if live_clicks:
            works = " and ".join(sorted(beside(t.foreground.call) & set(METHODS), key=METHODS.index))
            return (
                f"{what}: {works} work meanwhile, and so does the settings' apply; the other buttons are off "
                f"until it returns; interrupt the kernel (■) to {stop}"
            )
        return (
            f"{what}: the kernel runs clicks only once it returns, so the buttons are off until then "
            f"(a click is never run late); interrupt the kernel (■) to {stop}"
        )
    if t.running:
        return "training in the background: stop it to step, evaluate or save"
    if stats.rollout.state in ("pausing", "paused"):
        return "generation is paused: resume it to step or evaluate"
    return ""


def call(sess: NotebookSession, method: str, *, pause_mode: str, save_path: str) -> str:
    """Call the session's public ``method`` (a button's) and say what it did, in a line.
    The stop button ends background training and background generation both:
    ``sess.training.stop(); sess.rollouts.stop()``."""
    if method == "pause":
        sess.rollouts.pause(pause_mode)
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
        sess.rollouts.resume()
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
        sess.training.start()
        return "training in the background; stop ends it at a step boundary, and background generation with it"
    if method == "stop":
        sess.training.stop()
        sess.rollouts.stop()
        r = sess.statistics().rollout
        finishing = f"; {r.in_flight} samples in flight finish into the buffer" if r.in_flight else ""
        return f"stopped at step {sess.version}: training and background generation{finishing}"
    raise InvalidValueError(f"no dashboard control calls {method!r}")


# -- engine replicas, gauges, the last batch ------------------------------------------------


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


def ranks_html(learner: Any) -> str:
    """One row per learner rank (``LearnConfig.ranks`` > 1): state, process and node,
    its share of the last step in seconds, and the memory of its parameters,
    gradients and optimiser state and of its process; under it, the strategy and a
    dead rank's line."""
    head = "".join(f'<th style="{_LEFT};padding-right:1em">{h}</th>' for h in _RANK_COLUMNS)
    body = ""
    for r in learner.each:
        colour = "#b00020" if r.state == "dead" else "#000"
        step = "—" if r.step_seconds is None else f"{r.step_seconds:.3g} s"
        cells = [
            str(r.rank),
            f'<span style="color:{colour}">{html.escape(r.state)}</span>',
            f"{r.pid} on {html.escape(r.node)}",
            step,
            *map(_reprs.mebibytes, (r.parameter_bytes, r.gradient_bytes, r.optimizer_bytes, r.rss_bytes)),
        ]
        body += (
            f'<tr class="rlnb-rank" data-state="{html.escape(r.state)}">'
            + "".join(f'<td style="{_LEFT};padding-right:1em">{c}</td>' for c in cells)
            + "</tr>"
        )
    below = f"{len(learner.each)} ranks ({learner.parallelism})" + (f"; {learner.dead}" if learner.dead else "")
    return (
        f'<table style="border-collapse:collapse"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
        f'<div style="{_MUTED}">{html.escape(below)}</div>'
    )


_RANK_COLUMNS = ("rank", "state", "process", "last step", "parameters", "gradients", "optimiser", "process memory")

GAUGES = ("open FDs", "threads", "child processes", "event loops", "tracker runs")


def gauge_counts(snap: Snapshot) -> dict[str, int]:
    """The gauges' figures from a probe snapshot, in :data:`GAUGES` order."""
    counts = (snap.num_fds, snap.num_threads, snap.num_children, len(snap.loops), len(snap.runs))
    return dict(zip(GAUGES, counts, strict=True))


def gauges_html(now: Snapshot, baseline: Snapshot, *, final: bool = False) -> str:
    """Each gauge's count and its change since ``baseline`` ("threads 1 (+0)").

    ``final``: the counts after the session closed; a change that is not zero is
    shown in red and what is new is listed, so a leak is seen at once, and under them
    what libraries keep for the life of the process (not counted; see :func:`kept_html`)."""
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
            names = [_tail(name) for name in names] if kind == "fds" else names
            listed = html.escape(_reprs.name_list(names, width=200, each=60))
            out += f'<div class="rlnb-new" style="color:#b00020">new {html.escape(kind)}: {listed}</div>'
        out += kept_html(now)
    return f'<div style="{_COMPACT}">{out}</div>'


def kept_html(now: Snapshot) -> str:
    """What each library keeps for the life of the process once closed (Ray's driver
    after ``ray.shutdown()``: its threads, sockets and log files), which the gauges
    leave out: a line each, with the library's own reason."""
    out = ""
    for kept in getattr(now, "process_long", ()):
        targets = list(kept.fds.values())
        kinds = _reprs.pairs(
            ("log files", sum(t.startswith("/") for t in targets)),
            ("sockets", sum(t.startswith("socket:") for t in targets)),
            ("event FDs", sum(t.startswith("anon_inode:") for t in targets)),
        )
        threads = _reprs.name_list(_counted(kept.threads), width=120, each=24)
        text = f"{kept.owner} keeps {len(targets)} FDs ({kinds}) and {len(kept.threads)} threads ({threads}), "
        text += f"not counted above: {kept.reason}"
        out += f'<div class="rlnb-kept" style="{_MUTED};max-width:26em">{html.escape(text)}</div>'
    return out


def _counted(names: Sequence[str]) -> list[str]:
    """["a", "b", "a"] as ["a x2", "b"]."""
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return [f"{name} x{n}" if n > 1 else name for name, n in counts.items()]


def _tail(fd: str, keep: int = 44) -> str:
    """ "fd 58 -> /a/long/path/to/a/file" with the path's end kept: the file's name says most."""
    head, arrow, target = fd.partition(" -> ")
    return fd if len(target) <= keep else f"{head}{arrow}…{target[-keep:]}"


def rollouts_html(groups: Sequence[Group], step: int, *, decode: Callable[[Sequence[int]], str] | None = None) -> str:
    """The first groups of the batch that trained step ``step``, as a table (nothing
    before the first step). A conversation shows turn by turn: each policy turn and
    each environment reply in a block of its own, its text ``decode(ids)`` (pass the
    session's ``tokenizer.decode``); without ``decode``, its whole text in one block
    under its turns' count. The environment's reward, where it gave one, stands by the
    sample's reward."""
    if not groups:
        return ""
    shown = RolloutBatch(groups[:SHOWN_GROUPS])
    caption = f"the batch of step {step}: {len(shown)} of {len(groups)} groups"
    # Widget HTML and a saved notebook's output are styled differently (headers centred
    # in one, cells right-aligned in the other): align every cell here, the same in both.
    cell = f'style="{_LEFT};padding:1px 1em 1px 0"'
    head = "".join(f"<th {cell}>{h}</th>" for h in ("prompt", "completion", "reward", "versions", "marks"))
    rows = iter(shown.rows())  # the reward, versions and marks as RolloutBatch says them
    body = []
    for group in shown:
        for i, sample in enumerate(group.samples):
            _, text, reward, versions, marks = next(rows)
            prompt = (
                f'<td {cell} rowspan="{len(group)}"><code>{html.escape(group.prompt)}</code></td>' if i == 0 else ""
            )
            said = _conversation(sample, decode) if _talks(sample) else f"<code>{html.escape(text)}</code>"
            if sample.env_reward is not None:
                reward += f' <span class="rlnb-env-reward" style="{_MUTED}">(env {sample.env_reward:.2f})</span>'
            body.append(
                f"<tr>{prompt}<td {cell}>{said}</td><td {cell}>{reward}</td>"
                f"<td {cell}>{versions}</td><td {cell}>{html.escape(marks)}</td></tr>"
            )
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    return f'<div class="rlnb-batch" style="{_COMPACT}"><div style="{_MUTED}">{caption}</div>{table}</div>'


_SPEAKER = "font-size:10px;font-weight:bold;font-family:sans-serif;margin-right:0.4em;white-space:nowrap"
_POLICY_TURN = "margin:1px 0;white-space:pre-wrap;overflow-wrap:anywhere"
# The environment's reply: set apart by a dashed rule, grey and italic (it is not trained on).
_ENV_TURN = f"{_POLICY_TURN};border-left:2px dashed #999;padding-left:4px;color:#666;font-style:italic"


def _conversation(sample: Sample, decode: Callable[[Sequence[int]], str] | None) -> str:
    """A conversation's turns, one block each in order, with their speaker."""
    segments = sample.segments()
    policy = sum(1 for is_policy, _ in segments if is_policy)
    env = len(segments) - policy
    if decode is None:  # the turns' token ids are known, their texts are not
        count = f"{policy} policy turn{'s' * (policy != 1)}, {env} env repl{'ies' if env != 1 else 'y'}"
        return (
            f'<div class="rlnb-conversation" data-turns="{policy}"><div style="{_MUTED}">{count}</div>'
            f'<code style="white-space:pre-wrap">{html.escape(sample.completion)}</code></div>'
        )
    blocks, turn = [], 0
    for is_policy, ids in segments:
        try:
            text = decode(ids)
        except Exception:  # an id the tokenizer does not know: shown, not fatal
            text = "?"
        shown = f"<code>{html.escape(text)}</code>" if text else f'<span style="{_MUTED}">(empty)</span>'
        if is_policy:
            turn += 1
            blocks.append(
                f'<div class="rlnb-turn" data-speaker="policy" data-turn="{turn}" style="{_POLICY_TURN}">'
                f'<span style="{_SPEAKER}">policy</span>{shown}</div>'
            )
        else:
            blocks.append(
                f'<div class="rlnb-turn rlnb-env" data-speaker="env" data-turn="{turn}" style="{_ENV_TURN}" '
                f'title="the environment\'s reply to turn {turn}: not trained on">'
                f'<span style="{_SPEAKER}">env</span>{shown}</div>'
            )
    return f'<div class="rlnb-conversation" data-turns="{policy}">{"".join(blocks)}</div>'

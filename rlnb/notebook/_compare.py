"""``rlnb.compare``: several runs' curves on shared axes, with the steps where a live
setting was changed marked on them.

A run is a session (read while it trains, held only by a weak reference) or a run
directory's ``metrics.jsonl`` (a finished run, or one still being written). The
figure is drawn with matplotlib's object API on the Agg canvas (no pyplot state), so
it can be drawn from any thread. The widget is an ``ipywidgets.Image`` of that figure
that one ticker thread redraws while a session trains, at most every
``REDRAW_INTERVAL`` seconds and only when some run has more data.

matplotlib, ipywidgets and IPython are imported only when something is drawn or shown.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import io
import json
import math
import os
import threading
import time
import types
import weakref
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlnb._errors import BackgroundError, ClosedError, InvalidTypeError, InvalidValueError
from rlnb.algorithms import Algorithm
from rlnb.config import algorithm_label
from rlnb.notebook._curves import drawable, off_chart

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Change", "Comparison", "Run", "compare"]

DEFAULT_METRICS = ("reward_mean", "eval_accuracy")
POLL_INTERVAL = 0.25  # s between looks at the runs' sizes (a few len() calls)
REDRAW_INTERVAL = 2.0  # s between redraws, at least (a draw to PNG costs ~100 ms)
_TIME_SHARE = 20  # and at least this many times a draw's duration
_JOIN_TIMEOUT = 2.0
_DPI = 90
_SOURCE_HINT = "pass an rlnb.Session or a run directory (a str or os.PathLike holding metrics.jsonl)"
_DIR_HINT = (
    "expected a run directory holding metrics.jsonl, as `rlnb train --run-dir DIR` or "
    'Config(track=TrackConfig(backends=("jsonl",), run_dir=DIR)) write'
)


def _value(value: Any) -> str:
    if isinstance(value, Algorithm):  # as the run's records write it: "dapo", "custom (loss=...)"
        value = algorithm_label(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        text = str(value)
        return text if len(text) <= 40 else text[:39] + "…"
    return f"{value:.3g}"


@dataclasses.dataclass(frozen=True)
class Change:
    """A live setting changed at a policy version: ``field`` went from ``old`` to ``new``."""

    step: float
    field: str
    old: Any
    new: Any
    time: float | None = None

    @property
    def label(self) -> str:
        """``"lr 0.0001→0.001"``: numbers with three significant digits."""
        return f"{self.field} {_value(self.old)}→{_value(self.new)}"


@dataclasses.dataclass(frozen=True)
class Run:
    """One run's data as last read: ``curves`` maps each metric compared to its
    ``(step, value)`` points (absent: the run has none), ``changes`` its change
    marks; ``source`` is ``"session"`` or ``"run dir"``; ``live``: an open session."""

    name: str
    source: str
    curves: Mapping[str, tuple[tuple[float, float], ...]]
    changes: tuple[Change, ...]
    live: bool


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def _curves(points: Mapping[str, list[tuple[float, float]]]) -> Mapping[str, tuple[tuple[float, float], ...]]:
    return types.MappingProxyType({k: tuple(v) for k, v in points.items() if v})


class _SessionSource:
    """A session, held by a weak reference; its last reading outlives it."""

    source = "session"

    def __init__(self, session: Any, name: str, metrics: Sequence[str]) -> None:
        self.name = name
        self._metrics = metrics
        self._ref = weakref.ref(session)
        self.key: Hashable = None
        self.last = Run(name, self.source, _curves({}), (), live=not session.closed)

    @staticmethod
    def _key(sess: Any) -> Hashable:
        return (len(sess.history), len(sess.evaluations), len(getattr(sess, "changes", ())))

    def poll(self) -> tuple[bool, Hashable]:
        sess = self._ref()
        if sess is None:  # collected: its last reading stands
            return False, self.key
        return not sess.closed, self._key(sess)

    def read(self) -> Run:
        sess = self._ref()
        if sess is None:
            if self.last.live:
                self.last = dataclasses.replace(self.last, live=False)
            return self.last
        live = not sess.closed
        history, evaluations = list(sess.history), list(sess.evaluations)
        records = tuple(getattr(sess, "changes", ()))
        del sess
        points: dict[str, list[tuple[float, float]]] = {m: [] for m in self._metrics}
        for i, step in enumerate(history):
            x = _number(step.get("version", i + 1))
            for metric in self._metrics:
                y = _number(step.get(metric))
                if x is not None and y is not None and metric != "eval_accuracy":
                    points[metric].append((x, y))
        if "eval_accuracy" in points:
            points["eval_accuracy"] = [(float(v), float(a)) for v, a in evaluations if _number(a) is not None]
        changes = tuple(Change(float(c.step), str(c.field), c.old, c.new, getattr(c, "time", None)) for c in records)
        self.key = (len(history), len(evaluations), len(records))
        self.last = Run(self.name, self.source, _curves(points), changes, live)
        return self.last


class _DirSource:
    """A run directory's ``metrics.jsonl``, read again whenever its size or time changes."""

    source = "run dir"

    def __init__(self, path: Path, name: str, metrics: Sequence[str]) -> None:
        self.name = name
        self.path = path
        self._metrics = metrics
        self.key: Hashable = None
        self.last = Run(name, self.source, _curves({}), (), live=False)

    def poll(self) -> tuple[bool, Hashable]:
        try:
            stat = self.path.stat()
        except OSError:  # gone since: its last reading stands
            return False, self.key
        return False, (stat.st_size, stat.st_mtime_ns)

    def read(self) -> Run:
        _, key = self.poll()
        if key == self.key:
            return self.last
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return self.last
        points: dict[str, list[tuple[float, float]]] = {m: [] for m in self._metrics}
        changes = []
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a killed writer's half line
                continue
            if not isinstance(record, dict) or (step := _number(record.get("step"))) is None:
                continue
            event = record.get("event")
            if event == "change":
                field = record.get("field", "?")
                changes.append(Change(step, str(field), record.get("old"), record.get("new"), record.get("time")))
            elif event is None:
                for metric in self._metrics:
                    if (y := _number(record.get(metric))) is not None:
                        points[metric].append((step, y))
        self.key = key
        self.last = Run(self.name, self.source, _curves(points), tuple(changes), live=False)
        return self.last


_Source = _SessionSource | _DirSource


def _check_metrics(metrics: Any) -> tuple[str, ...]:
    fix = 'use a non-empty sequence of metric names, e.g. metrics=("reward_mean", "eval_accuracy")'
    if isinstance(metrics, str):
        raise InvalidTypeError(f"rlnb.compare(metrics={metrics!r}) is invalid: {fix[:-1]} or metrics=({metrics!r},)")
    if not isinstance(metrics, Sequence) or not all(isinstance(m, str) and m for m in metrics):
        raise InvalidTypeError(f"rlnb.compare(metrics={metrics!r}) is invalid: {fix}")
    if not metrics:
        raise InvalidValueError(f"rlnb.compare(metrics={metrics!r}) is empty: {fix}")
    if len(set(metrics)) != len(metrics):
        raise InvalidValueError(f"rlnb.compare(metrics={metrics!r}) names a metric twice: name each once")
    return tuple(metrics)


def _metrics_file(run: str | os.PathLike[str], position: int) -> Path:
    path = Path(run)
    where = f"rlnb.compare() argument {position}"
    if path.is_file() and path.suffix == ".jsonl":
        return path
    if not path.exists():
        raise FileNotFoundError(f"{where}: run directory {os.fspath(path)!r} does not exist; {_DIR_HINT}")
    if not path.is_dir():
        raise NotADirectoryError(f"{where}: {os.fspath(path)!r} is not a directory; {_DIR_HINT}")
    if not (path / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{where}: {os.fspath(path / 'metrics.jsonl')!r} does not exist; {_DIR_HINT}")
    return path / "metrics.jsonl"


def _source(run: Any, position: int, metrics: Sequence[str]) -> tuple[Any, Path | None]:
    """``(session, None)`` or ``(None, metrics file)``; raises for anything else."""
    where = f"rlnb.compare() argument {position}"
    if isinstance(run, bytes) or (isinstance(run, os.PathLike) and isinstance(os.fspath(run), bytes)):
        raise InvalidTypeError(f"{where} is a bytes path ({run!r:.60}): use a str or pathlib.Path")
    if isinstance(run, str | os.PathLike):
        return None, _metrics_file(run, position)
    if all(hasattr(run, a) for a in ("name", "closed", "history", "evaluations")):
        return run, None
    fix = "unpack it: rlnb.compare(*runs)" if isinstance(run, list | tuple) else _SOURCE_HINT
    raise InvalidTypeError(f"{where} is {run!r:.60} (type {type(run).__name__}): {fix}")


def compare(*runs: Any, metrics: Sequence[str] = DEFAULT_METRICS) -> Comparison:
    """Several runs' curves on shared axes: one subplot per metric, one line per run,
    x the policy version (step), and a dashed mark in the run's colour at each step
    where one of its live settings changed (numbered, and named in the legend).

    ``runs``: sessions (``rlnb.Session``, held by a weak reference only) and run
    directories holding ``metrics.jsonl`` (or such a file itself); ``metrics``:
    names from a session's ``history`` or a run's step records; ``"eval_accuracy"``
    is a session's ``evaluations``. A metric no run has shows "no data".

    Leave the result last in a cell to show it: a widget that follows the sessions
    while any is open (and an image for front-ends without widgets), an image when
    all are finished. Raises ``TypeError``/``ValueError`` for bad arguments and
    ``FileNotFoundError`` for a missing run directory, before anything is drawn.
    Does not block: it reads the runs, draws nothing and starts no thread.
    """
    metrics = _check_metrics(metrics)
    if not runs:
        raise InvalidValueError(
            "rlnb.compare() got no runs: pass sessions or run directories, "
            'e.g. rlnb.compare(sess_a, sess_b, "runs/baseline")'
        )
    found = [_source(run, i, metrics) for i, run in enumerate(runs, 1)]
    sources: list[_Source] = []
    names: collections.Counter[str] = collections.Counter()
    for session, path in found:
        name = str(session.name) if path is None else path.resolve().parent.name or os.fspath(path.resolve().parent)
        names[name] += 1
        name = name if names[name] == 1 else f"{name} ({names[name]})"  # the legend tells them apart
        sources.append(_SessionSource(session, name, metrics) if path is None else _DirSource(path, name, metrics))
    comparison = Comparison(sources, metrics)
    comparison.runs()  # reads each run once: a session collected before the first draw still shows
    return comparison


class Comparison:
    """Made by :func:`rlnb.compare`. It holds sessions by weak references only.

    - :meth:`figure` draws a matplotlib ``Figure`` from the current data; :meth:`save`
      writes it as PNG or SVG; :meth:`runs` is the data as read, a frozen snapshot.
    - ``widget`` (made on first use) is an ``ipywidgets.Image``; while any session is
      open a ticker thread ``rlnb-compare`` redraws it when a run has more data, at
      most every ``REDRAW_INTERVAL`` seconds. The ticker ends by itself once every
      session is closed or collected (the widget keeps its last image, and each
      display of the comparison becomes that image) and on :meth:`close`.
    """

    def __init__(self, sources: Sequence[_Source], metrics: Sequence[str]) -> None:
        self.metrics = tuple(metrics)
        self.names = tuple(s.name for s in sources)
        self._sources = list(sources)
        self._lock = threading.Lock()  # closed flag, the thread, the widget, the handles
        self._draw_lock = threading.RLock()  # one reading-and-drawing at a time
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._widget: Any = None
        self._handles: collections.deque[Any] = collections.deque(maxlen=32)
        self._png = b""
        self._drawn: Hashable = None
        self._next_draw = self._last_draw = 0.0
        self._error: BaseException | None = None
        self.redraws = 0

    # -- data and drawing ----------------------------------------------------------------

    def runs(self) -> tuple[Run, ...]:
        """Each run's data now (a collected session's as last read). Does not block."""
        with self._draw_lock:
            return tuple(source.read() for source in self._sources)

    @property
    def live(self) -> bool:
        """Whether any of the sessions compared is still open."""
        return any(source.poll()[0] for source in self._sources)

    @property
    def closed(self) -> bool:
        return self._closed

    def figure(self) -> Figure:
        """The comparison drawn now, as a ``matplotlib.figure.Figure`` (Agg canvas, no
        pyplot state). Raises what a failed refresh on the ticker thread raised."""
        self._raise_ticker_error()
        return self._figure(self.runs())

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the comparison drawn now to ``path``, PNG or SVG by its suffix (making
        its parent directories); returns the path. Blocks while drawing (~0.2 s)."""
        if not isinstance(path, str | os.PathLike) or isinstance(os.fspath(path), bytes):
            raise InvalidTypeError(f"Comparison.save(path={path!r}): use a str or pathlib.Path ending in .png or .svg")
        out = Path(path)
        kind = out.suffix.lower().lstrip(".")
        if kind not in ("png", "svg"):
            raise InvalidValueError(f"Comparison.save(path={os.fspath(path)!r}): use a path ending in .png or .svg")
        figure = self.figure()
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            figure.savefig(out, format=kind)
        finally:
            _release_fonts()
        return out

    def _figure(self, runs: Sequence[Run]) -> Figure:
        from matplotlib.figure import Figure  # Agg: no GUI, safe from any thread
        from matplotlib.lines import Line2D
        from matplotlib.ticker import MaxNLocator

        fig = Figure(figsize=(8.0, 0.9 + 2.3 * len(self.metrics)), dpi=_DPI, layout="constrained")
        axes = fig.subplots(len(self.metrics), 1, sharex=True, squeeze=False)[:, 0]
        colours = {run.name: f"C{i % 10}" for i, run in enumerate(runs)}
        # A step or value beyond ±3.4e38 (a run holding ±1e308) is not drawn: an axis
        # that wide overflows, and every draw failed (LinAlgError), hiding the other runs.
        marks = sorted(
            ((c.step, run.name, c) for run in runs for c in run.changes if drawable(c.step)), key=lambda m: m[0]
        )
        for ax, metric in zip(axes, self.metrics, strict=True):
            ax.set_ylabel(metric)
            ax.grid(alpha=0.3)
            drawn = off = 0
            for run in runs:
                given = run.curves.get(metric, ())
                points = [(x, y) for x, y in given if drawable(x) and drawable(y)]
                drawn, off = drawn + len(points), off + len(given) - len(points)
                if points:
                    xs, ys = zip(*points, strict=True)
                    dots = metric == "eval_accuracy" or len(points) < 3  # a line through 1-2 points is hard to see
                    ax.plot(xs, ys, color=colours[run.name], lw=1.4, marker="o" if dots else None, ms=3, label=run.name)
            if not drawn:
                ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="#999")
            if off:
                ax.text(
                    0.99, 0.03, off_chart(off), transform=ax.transAxes, ha="right", va="bottom", fontsize=7,
                    color="#666", gid="rlnb-off-chart",
                )  # fmt: skip
            for step, name, change in marks:
                ax.axvline(step, color=colours[name], lw=0.9, ls="--", alpha=0.8, label=change.label, gid="rlnb-change")
        axes[-1].set_xlabel("policy version (step)")
        axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
        self._number_marks(axes[0], marks, colours)
        handles = [Line2D([], [], color=colours[run.name], lw=1.4, label=run.name) for run in runs]
        for i, (step, name, change) in enumerate(marks, 1):
            label = f"{i} · {name} at step {step:g}: {change.label}"
            handles.append(Line2D([], [], color=colours[name], lw=0.9, ls="--", label=label))
        fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)
        return fig

    @staticmethod
    def _number_marks(ax: Any, marks: Sequence[tuple[float, str, Change]], colours: Mapping[str, str]) -> None:
        """A number above each change mark (the legend says what changed), raised a
        row when it would overlap its neighbour's."""
        if not marks:
            return
        low, high = ax.get_xlim()
        gap = (high - low) / 40 or 1.0
        level, last = 0, -math.inf
        for i, (step, name, _) in enumerate(marks, 1):
            level = (level + 1) % 3 if step - last < gap else 0
            last = step
            ax.annotate(
                str(i),
                xy=(step, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(0, 2 + 9 * level),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
                fontweight="bold",
                color=colours[name],
                annotation_clip=False,
                gid="rlnb-change-number",
            )

    def _render(self) -> bytes:
        """Read every run and draw it to PNG; remembers what it drew and when."""
        import matplotlib.figure  # noqa: F401  # its first import is no part of a draw's cost

        with self._draw_lock:
            started = self._last_draw = time.monotonic()
            runs = self.runs()
            out = io.BytesIO()
            try:
                self._figure(runs).savefig(out, format="png")
            finally:
                _release_fonts()
            self._png = out.getvalue()
            self._drawn = tuple(source.key for source in self._sources)
            self._next_draw = started + max(REDRAW_INTERVAL, _TIME_SHARE * (time.monotonic() - started))
            self.redraws += 1
            return self._png

    def refresh(self) -> None:
        """Read the runs and redraw the widget now (if it has been made). Blocks ~0.2 s."""
        self._raise_ticker_error()
        png = self._render()
        with self._lock:
            if self._widget is not None and not self._closed:
                self._widget.value = png

    def _raise_ticker_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise BackgroundError(f"the comparison's refresh on its ticker thread failed: {error!r}") from error

    # -- the widget and its ticker -------------------------------------------------------

    @property
    def widget(self) -> Any:
        """The ``ipywidgets.Image`` of the comparison, made (and its ticker started while
        a session is open) on first use. Raises :class:`~rlnb.ClosedError` after :meth:`close`."""
        with self._lock:
            if self._closed:
                raise ClosedError("this comparison is closed: its figure() and save() still work")
            if self._widget is None:
                import ipywidgets

                widget = ipywidgets.Image(value=self._render(), format="png")
                widget.add_class("rlnb-compare")
                self._widget = widget
                if self.live:
                    self._thread = threading.Thread(target=self._run, name="rlnb-compare", daemon=True)
                    try:
                        self._thread.start()
                    except BaseException:
                        self._thread, self._widget = None, None
                        widget.layout.close()
                        widget.close()
                        raise
            return self._widget

    def _poll(self) -> tuple[bool, Hashable]:
        polled = [source.poll() for source in self._sources]
        return any(live for live, _ in polled), tuple(key for _, key in polled)

    def _run(self) -> None:
        try:
            seen: Hashable = None
            changed = time.monotonic()
            while True:
                live, key = self._poll()
                if key != seen:
                    seen, changed = key, time.monotonic()
                if key != self._drawn:
                    # The last frame comes at most REDRAW_INTERVAL after the one before once
                    # every session is closed, or once no run has grown for REDRAW_INTERVAL
                    # (they ended, their sessions still open): not at the paced rate.
                    settled = not live or time.monotonic() - changed >= REDRAW_INTERVAL
                    due = min(self._next_draw, self._last_draw + REDRAW_INTERVAL) if settled else self._next_draw
                    wait = due - time.monotonic()
                    if not live and wait > 0 and self._stop.wait(wait):
                        return  # closed meanwhile: close() shows the last image
                    if not live or wait <= 0:  # else: at a later look
                        self._widget.value = self._render()
                if not live:  # every session closed or collected: the last image stays
                    self._update_displays(self._static_bundle())
                    return
                if self._stop.wait(POLL_INTERVAL):
                    return
        except Exception as exc:  # surfaces at the next figure(), save() or refresh()
            self._error = exc

    # -- display and close ---------------------------------------------------------------

    def _static_bundle(self) -> dict[str, str]:
        """The image with every step read now (the last drawn one if nothing came since)."""
        png = self._png if self._png and self._poll()[1] == self._drawn else self._render()
        return {"image/png": base64.b64encode(png).decode("ascii"), "text/plain": repr(self)}

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """The widget and a PNG of it while a session is open (a front-end without
        widgets, or a saved notebook, shows the image); only the PNG otherwise."""
        if self._closed or not self.live:
            self._render()
            return self._static_bundle()
        bundle = self.widget._repr_mimebundle_()
        return {**self._static_bundle(), **bundle, "text/plain": repr(self)}

    def _ipython_display_(self) -> None:
        from IPython.display import display

        bundle = self._repr_mimebundle_()
        handle = display(bundle, raw=True, display_id=True)
        with self._lock:
            if handle is not None and "application/vnd.jupyter.widget-view+json" in bundle:
                self._handles.append(handle)  # its image replaces the widget when the ticker ends

    def _update_displays(self, bundle: dict[str, str]) -> None:
        with self._lock:
            handles, self._handles = list(self._handles), collections.deque(maxlen=32)
        for handle in handles:
            handle.update(bundle, raw=True)

    def __repr__(self) -> str:
        names = ", ".join(repr(n) for n in self.names)
        status = "closed" if self._closed else "live" if self.live else "finished"
        return f"<rlnb Comparison of {names} ({', '.join(self.metrics)}): {status}>"

    def close(self) -> None:
        """Stop the ticker (joined within milliseconds), turn each display into the last
        image and close the widget. :meth:`figure`, :meth:`save` and :meth:`runs` still
        work. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread, widget = self._thread, self._widget
        self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_TIMEOUT)
        try:
            if widget is not None:
                self._update_displays(self._static_bundle())
        finally:
            if widget is not None:
                widget.layout.close()
                widget.close()

    def __enter__(self) -> Comparison:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release_fonts() -> None:
    """matplotlib keeps each font file it drew with open for the life of the process;
    close them (they reopen on use) so a comparison holds no file descriptor."""
    from matplotlib import font_manager

    font_manager._get_font.cache_clear()  # type: ignore[attr-defined]

"""The console, jsonl and live-plot backends (wandb's is in ``_wandb``)."""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rlnb import _reprs
from rlnb.runtime import notebook_cell, release_output_pipes

__all__ = ["ConsoleBackend", "JsonlBackend", "PlotBackend", "keep_earlier_run"]

log = logging.getLogger("rlnb")

# The PNG text key of the run that drew a curves.png, so that a later run can tell it apart.
_PNG_RUN_KEY = "rlnb run"

# What the console line and the plot show, in this order, when a step has them.
HEADLINE = (
    "reward_mean",
    "accuracy",
    "eval_accuracy",
    "response_length",
    "entropy",
    "kl",
    "grad_norm",
    "warmup/steps",
    "warmup/sft_loss",
)


class ConsoleBackend:
    """One compact line every ``every`` steps (and for any step with an eval). In a
    notebook the line updates in place: a cell that trains (``train()``, ``step()``)
    has its own line, and a background run keeps one line where it first appeared
    (ipykernel 7 sends a thread's output to whichever cell ran last, so it would
    otherwise follow the user from cell to cell). In a terminal it is printed above
    any progress bar."""

    name = "console"

    def __init__(self, every: int = 10) -> None:
        self.every = every
        self._handle: Any = None
        self._key: tuple[str, int] | None = None  # whose line the handle is: a cell's, or a thread's
        self._threads: set[threading.Thread] = set()  # other threads that displayed a line
        self._last = ""

    @staticmethod
    def format(metrics: Mapping[str, float], step: int) -> str:
        """The line of a step: its :data:`HEADLINE` figures, and ``clip_fraction`` where
        its record says a clip could act (``clip_active`` 1; with one update per batch
        the ratio is 1 and the fraction is 0 by construction, which says nothing)."""
        parts = [f"step {step}"]
        parts += [f"{k} {metrics[k]:.3g}" for k in HEADLINE if k in metrics]
        if metrics.get("clip_active") == 1.0 and "clip_fraction" in metrics:
            parts.append(f"clip_fraction {metrics['clip_fraction']:.3g}")
        return " | ".join(parts)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if not any(k in metrics for k in HEADLINE):  # e.g. diagnose()'s counts: nothing to headline
            return
        if step % self.every and not any(k in metrics for k in ("eval_accuracy", "warmup/steps")):
            return
        self._last = self.format(metrics, step)
        self._show(self._last)

    def _show(self, line: str) -> None:
        cell = notebook_cell()
        if cell is None:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stdout)
            return
        thread = threading.current_thread()
        key = ("cell", cell) if thread is threading.main_thread() else ("thread", thread.ident or 0)
        if self._handle is None or key != self._key:
            from IPython.display import display

            self._handle = display({"text/plain": line}, raw=True, display_id=True)
            self._key = key
            if thread is not threading.main_thread():
                self._threads.add(thread)
        else:
            self._handle.update({"text/plain": line}, raw=True)

    def log_change(self, change: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> None:
        old, new = _reprs.setting(change["old"]), _reprs.setting(change["new"])
        line = f"rlnb: step {change['step']}: {change['field']} {old} -> {new}"
        if notebook_cell() is None:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def finish(self, exit_code: int) -> None:
        line = f"rlnb: run finished with exit code {exit_code}" + (f" ({self._last})" if self._last else "")
        if self._handle is not None:
            self._handle.update({"text/plain": line}, raw=True)  # where the run's last line is
        elif notebook_cell() is None:
            print(line, file=sys.stdout, flush=True)
        # The kernel's output pipes of the training threads that showed a line: gone now,
        # not in ipykernel's next sweep (an FD each, counted against a closed session).
        release_output_pipes(self._threads)
        self._threads.clear()


def keep_earlier_run(path: Path, run_id: str | None, earlier: Callable[[Path], str | None]) -> Path | None:
    """Move the file ``path`` aside where another run wrote it, so that this run
    (``run_id``) writes its own and the earlier one is kept: to
    ``<stem>-<its run id><suffix>`` (``earlier(path)`` reads that id; None: not
    known, "earlier" then), or the first free ``-2``, ``-3``... after it (logged on
    the "rlnb" logger: re-running a cell does this each time). A missing or empty
    file, or one of this run (a checkpoint's run goes on), stays. Returns where it
    went (None: it stayed)."""
    try:
        if not path.is_file() or path.stat().st_size == 0:
            return None
        found = earlier(path)
    except OSError:
        found = None
    if run_id is not None and found == run_id:
        return None
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", found)[:64] if found else "earlier"
    aside, n = path.with_name(f"{path.stem}-{tag}{path.suffix}"), 1
    while os.path.lexists(aside):
        n += 1
        aside = path.with_name(f"{path.stem}-{tag}-{n}{path.suffix}")
    path.rename(aside)
    log.info("rlnb: %s was written by another run (%s): kept as %s", path, found or "not named", aside.name)
    return aside


def _jsonl_run_id(path: Path) -> str | None:
    """The run id of the start record on the first line of the jsonl file ``path``."""
    with path.open("rb") as f:
        first = f.readline(1 << 16)
    try:
        record = json.loads(first)
    except ValueError:
        return None
    run = record.get("run_id") if isinstance(record, dict) and record.get("event") == "start" else None
    return run if isinstance(run, str) and run else None


def _png_run_id(path: Path) -> str | None:
    """The run id a curves PNG was drawn for (its ``rlnb run`` text chunk)."""
    from PIL import Image  # matplotlib's own dependency

    try:
        with Image.open(path) as image:
            run = image.info.get(_PNG_RUN_KEY)  # text chunks before the image data: not decoded
    except Exception:  # not a PNG, or a damaged one: not known
        return None
    return run if isinstance(run, str) and run else None


class JsonlBackend:
    """One JSON object per step in ``path``, flushed as written (a killed process
    keeps every step it logged), and a last line with the exit code. An earlier
    run's file there is kept beside it (:func:`keep_earlier_run`); a run that goes
    on from a checkpoint (the same ``run_id``) appends to its own."""

    name = "jsonl"

    def __init__(self, path: Path, *, run_id: str) -> None:
        self.path = path
        keep_earlier_run(path, run_id, _jsonl_run_id)
        self._file = path.open("a")
        self._lock = threading.Lock()
        self._write({"event": "start", "run_id": run_id, "time": time.time()})

    def _write(self, record: Mapping[str, Any]) -> None:
        with self._lock:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._write({"step": step, **metrics})

    def log_change(self, change: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> None:
        self._write({"event": "change", **change})

    def finish(self, exit_code: int) -> None:
        try:
            self._write({"event": "finish", "exit_code": exit_code, "time": time.time()})
        finally:
            self._file.close()


class PlotBackend:
    """Reward and accuracy curves, drawn with matplotlib's Agg backend into a PNG.

    ``widget`` is an ``ipywidgets.Image`` showing it (made on first access; its
    value may be set from any thread, so the plot follows a run that trains in
    the background). The PNG is saved to ``path`` at most every ``min_interval``
    seconds while logging, and less often when drawing is slow, so that it
    takes at most ``1 / 20`` of the run's time (a long run's figure takes
    0.1-0.2 s to draw); once more at finish. The PNG records ``run_id``; one of
    another run already at ``path`` is kept beside it (:func:`keep_earlier_run`)."""

    _TIME_SHARE = 20  # wait at least this many times a draw's duration before the next

    name = "plot"

    def __init__(self, path: Path, *, min_interval: float = 1.0, run_id: str | None = None) -> None:
        self.path = path
        self.run_id = run_id
        keep_earlier_run(path, run_id, _png_run_id)
        self.min_interval = min_interval
        self.series: dict[str, list[tuple[int, float]]] = {}
        self._widget: Any = None
        self._next_draw = 0.0
        self._lock = threading.Lock()

    @property
    def widget(self) -> Any:
        if self._widget is None:
            import ipywidgets

            self._widget = ipywidgets.Image(format="png")
            png = self.render()
            if png:
                self._widget.value = png
        return self._widget

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        with self._lock:
            for key in ("reward_mean", "accuracy", "eval_accuracy"):
                if key in metrics:
                    self.series.setdefault(key, []).append((step, float(metrics[key])))
        if time.monotonic() >= self._next_draw:
            self._draw()

    def figure(self) -> Any:
        """The current curves as a matplotlib ``Figure`` (None before the first step).

        A curve has one point per step, its latest value: an evaluation before the
        warm-up and one after it share step 0 (the warm-up does not change the
        policy's version), and the earlier one is a hollow marker, not a vertical jump."""
        from matplotlib.figure import Figure  # Agg: no GUI, safe from any thread

        with self._lock:
            series = {k: list(v) for k, v in self.series.items()}
        if not series:
            return None
        fig = Figure(figsize=(6, 3), dpi=90)
        ax = fig.add_subplot()
        labels = {"reward_mean": "train reward", "accuracy": "train accuracy", "eval_accuracy": "held-out accuracy"}
        for key, points in series.items():
            latest = dict(points)  # step -> its last value, in step order
            style = "o-" if key == "eval_accuracy" else "-"
            (line,) = ax.plot(list(latest), list(latest.values()), style, lw=1.2, ms=3, label=labels[key])
            earlier = [p for p, after in itertools.pairwise(points) if after[0] == p[0]]
            if earlier:
                steps, values = zip(*earlier, strict=True)
                ax.plot(steps, values, "o", ms=4, mfc="none", color=line.get_color(), clip_on=False)
        ax.set_xlabel("step")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        return fig

    def render(self) -> bytes:
        """The current curves as PNG bytes (empty before the first step)."""
        fig = self.figure()
        if fig is None:
            return b""
        out = io.BytesIO()
        fig.savefig(out, format="png", metadata={_PNG_RUN_KEY: self.run_id} if self.run_id else None)
        return out.getvalue()

    def _draw(self) -> None:
        started = time.monotonic()
        png = self.render()
        self._next_draw = started + max(self.min_interval, self._TIME_SHARE * (time.monotonic() - started))
        if not png:
            return
        if self._widget is not None:
            self._widget.value = png
        tmp = self.path.with_suffix(".png.tmp")
        tmp.write_bytes(png)
        tmp.replace(self.path)

    def finish(self, exit_code: int) -> None:
        try:
            self._draw()
        finally:
            # matplotlib caches open font files for the life of the process; drop
            # them so a finished run holds no file descriptor (they reopen on use)
            from matplotlib import font_manager

            font_manager._get_font.cache_clear()  # type: ignore[attr-defined]

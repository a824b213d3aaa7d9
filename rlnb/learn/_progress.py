"""Progress bars for training loops, suited to where the output goes: a notebook's
widget bar, a terminal's tqdm bar, or a plain line every few seconds in a file or
CI log (where a bar's carriage returns pile up into one huge line)."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, TextIO

from rlnb._errors import ConfigError
from rlnb.runtime import notebook_cell

__all__ = ["progress_bar"]

INTERVAL_ENV = "RLNB_PROGRESS_INTERVAL"
DEFAULT_INTERVAL = 5.0


def progress_bar(total: int, desc: str, enabled: bool = True) -> Any:
    """A progress bar for ``total`` steps that starts no monitor thread (tqdm's would
    outlive the session); use it as a context manager, with ``update(n)`` and
    ``set_postfix(**fields)``.

    In a notebook it is tqdm's widget bar, shown through a display handle that is
    replaced by the bar's final text when it closes, so a saved notebook shows
    that line instead of "Error displaying widget: model not found". When stderr is
    a terminal it is tqdm's text bar there. Otherwise (a file, a pipe, a CI log) it
    writes one plain line to stderr every ``RLNB_PROGRESS_INTERVAL`` seconds (5 by
    default) and a last one when it closes. Raises ConfigError when that variable
    is not a number >= 0."""
    if not enabled:
        return _terminal_bar(total=total, desc=desc, disable=True)
    interval = progress_interval()
    if notebook_cell() is not None:
        return _notebook_bar(total=total, desc=desc, leave=True)
    stream = sys.stderr
    if stream is not None and stream.isatty():
        return _terminal_bar(total=total, desc=desc, leave=True)
    return PlainProgress(total, desc, interval=interval, file=stream)


def progress_interval() -> float:
    """Seconds between a plain bar's lines: ``RLNB_PROGRESS_INTERVAL``, else 5."""
    text = os.environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_INTERVAL
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{INTERVAL_ENV}={text!r} is invalid: use a number of seconds >= 0, e.g. 5")
    return value


class PlainProgress:
    """A bar for a file or a log: no carriage returns, a line on ``update`` once
    ``interval`` seconds have passed since the last one, and a last line on close,
    e.g. ``rlnb rl: step 75/125 (60%), 9.1 s, 8.2 steps/s, reward 0.378``."""

    def __init__(self, total: int, desc: str, *, interval: float, file: TextIO | None) -> None:
        self.total = total
        self.desc = desc
        self.interval = interval
        self.file = file
        self.n = 0
        self.disable = False
        self.postfix: dict[str, Any] = {}
        self._started = self._last = time.monotonic()
        self._closed = False

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True, **fields: Any) -> None:
        """Fields shown on the next line (tqdm's signature; nothing is written now)."""
        self.postfix = {**(ordered_dict or {}), **fields}

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.interval and self.n < self.total:  # close() writes the last line
            self._last = now
            self._write(f"{self.desc}: step {self.n}/{self.total}{self._percent()}, {self._figures(now)}")

    def close(self) -> None:
        """Write the last line (once); nothing for a bar of no steps."""
        if self._closed:
            return
        self._closed = True
        if self.total or self.n:
            line = f"{self.desc}: {self.n}/{self.total} steps{self._percent()} in {self._figures(time.monotonic())}"
            self._write(line + ("  (stopped early)" if self.n < self.total else ""))

    def _percent(self) -> str:
        return f" ({100 * self.n // self.total}%)" if self.total else ""

    def _figures(self, now: float) -> str:
        elapsed = now - self._started
        rate = self.n / elapsed if elapsed > 0 else 0.0
        fields = "".join(f", {key} {value}" for key, value in self.postfix.items())
        return f"{elapsed:.1f} s, {rate:.3g} steps/s{fields}"

    def _write(self, line: str) -> None:
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()


def _terminal_bar(**kwargs: Any) -> Any:
    from tqdm import tqdm

    class Bar(tqdm):
        monitor_interval = 0

    return Bar(**kwargs)


def _notebook_bar(**kwargs: Any) -> Any:
    from IPython.display import display
    from tqdm.notebook import tqdm as notebook_tqdm

    class NotebookBar(notebook_tqdm):
        monitor_interval = 0

        def __init__(self, **kw: Any) -> None:
            super().__init__(display=False, **kw)
            self._handle = display(self.container, display_id=True)

        def close(self) -> None:
            if self.disable:
                return
            super().close()
            text = self.format_meter(**self.format_dict)
            if self.total and self.n < self.total:
                text += "  (stopped early)"
            self._handle.update({"text/plain": text}, raw=True)

    return NotebookBar(**kwargs)

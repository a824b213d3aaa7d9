"""Progress bars for training loops, in a notebook or a terminal."""

from __future__ import annotations

from typing import Any

__all__ = ["progress_bar"]


def progress_bar(total: int, desc: str, enabled: bool = True) -> Any:
    """A tqdm bar that renders as a widget in a notebook and as text in a terminal,
    and starts no monitor thread (tqdm's would outlive the session)."""
    from tqdm.auto import tqdm

    class Bar(tqdm):
        monitor_interval = 0

    return Bar(total=total, desc=desc, disable=not enabled, leave=True)

"""Progress bars for training loops, in a notebook or a terminal."""

from __future__ import annotations

from typing import Any

from rlnb.runtime import notebook_cell

__all__ = ["progress_bar"]


def progress_bar(total: int, desc: str, enabled: bool = True) -> Any:
    """A tqdm bar that starts no monitor thread (tqdm's would outlive the session).

    In a notebook it is tqdm's widget bar, shown through a display handle that is
    replaced by the bar's final text when it closes, so a saved notebook shows
    that line instead of "Error displaying widget: model not found". Elsewhere it
    is tqdm's text bar."""
    if enabled and notebook_cell() is not None:
        return _notebook_bar(total=total, desc=desc, leave=True)
    from tqdm import tqdm

    class Bar(tqdm):
        monitor_interval = 0

    return Bar(total=total, desc=desc, disable=not enabled, leave=True)


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

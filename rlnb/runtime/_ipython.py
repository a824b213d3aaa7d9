"""Where code is running: inside a Jupyter kernel, and in which cell. Never imports
IPython just to look."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["ipython_shell", "notebook_cell"]


def ipython_shell() -> Any:
    """The running IPython shell, or None (IPython not loaded, or no shell)."""
    ipython = sys.modules.get("IPython")
    return None if ipython is None else ipython.get_ipython()


def notebook_cell() -> int | None:
    """The execution count of the cell running now in a Jupyter kernel, else None."""
    shell = ipython_shell()
    if shell is None or type(shell).__name__ != "ZMQInteractiveShell":
        return None
    return int(shell.execution_count)

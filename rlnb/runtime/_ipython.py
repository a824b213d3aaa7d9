"""Where code is running: inside a Jupyter kernel, and in which cell; and the
kernel's per-thread output pipes. Never imports IPython just to look."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["history_file", "ipython_shell", "notebook_cell", "output_pipes", "release_output_pipes"]


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


def _iopub() -> Any:
    return getattr(getattr(ipython_shell(), "kernel", None), "iopub_thread", None)


def output_pipes() -> dict[threading.Thread, Any]:
    """The kernel's output pipe (a zmq socket) of each thread that has one; empty
    outside a Jupyter kernel. See :func:`release_output_pipes`."""
    iopub = _iopub()
    pipes, lock = getattr(iopub, "_event_pipes", None), getattr(iopub, "_event_pipe_gc_lock", None)
    if not isinstance(pipes, dict) or lock is None:
        return {}
    with lock:
        return dict(pipes)


def history_file() -> str | None:
    """The IPython history database's path, or None (no shell, or history off)."""
    path = getattr(getattr(ipython_shell(), "history_manager", None), "hist_file", None)
    return None if path is None or str(path) == ":memory:" else str(path)


def release_output_pipes(threads: Iterable[threading.Thread] | None = None) -> int:
    """Close the kernel's output pipes of those ``threads`` that have ended (of every
    ended thread: None); returns how many were closed (0 outside a Jupyter kernel).

    ipykernel gives every thread that sends output or widget updates a zmq socket of
    its own (an eventfd) and closes those of ended threads only in a sweep every
    10 s, so a closed session's threads would still hold FDs for seconds. This is
    that sweep, done at once for the threads a part owned (ipykernel 6.19 and later;
    elsewhere nothing to do)."""
    iopub = _iopub()
    pipes = getattr(iopub, "_event_pipes", None)
    lock = getattr(iopub, "_event_pipe_gc_lock", None)
    if not isinstance(pipes, dict) or lock is None:
        return 0
    fds: list[int] = []
    with lock:
        for thread in list(pipes) if threads is None else threads:
            if not thread.is_alive() and (socket := pipes.pop(thread, None)) is not None:
                fds.append(socket.FD)
                socket.close()
    _wait_closed(fds, timeout=1.0)
    return len(fds)


def _wait_closed(fds: list[int], *, timeout: float) -> None:
    """Wait until ``fds`` are closed, up to ``timeout`` s: zmq closes a socket's FD on
    its own thread a moment after ``close()`` returns."""
    deadline, tick = time.monotonic() + timeout, threading.Event()
    while fds and time.monotonic() < deadline:
        fds = [fd for fd in fds if _is_eventfd(fd)]
        if fds:
            tick.wait(0.001)


def _is_eventfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
    except OSError:  # closed (or no /proc to look in)
        return False

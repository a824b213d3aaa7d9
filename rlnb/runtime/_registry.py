"""The process-wide registry of live sessions, and the hooks that close them.

Re-running the cell that made a session closes the old one (same name); atexit,
SIGTERM and a Jupyter kernel's shutdown request close them all. The kernel hook is
what keeps a kernel restart graceful: jupyter_client SIGTERMs the kernel 2.5 s after
a restart request, and when the kernel has child processes (dataloader workers,
engines) ipykernel waits on them far longer than that, so exit hooks alone may never
run. The hook closes sessions, and so reaps their children, before ipykernel starts
signalling them.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

from rlnb._errors import exit_code_for
from rlnb.runtime._interrupts import redeliver_lost_interrupts
from rlnb.runtime._ipython import ipython_shell

__all__ = [
    "close_all",
    "install_hooks",
    "lookup_session",
    "register_session",
    "replace_session",
    "sessions",
    "unregister_session",
]

log = logging.getLogger("rlnb")

# Bounded so that exit and kernel restart stay well inside jupyter_client's 2.5 s.
HOOK_TIMEOUT = 2.0


class Closeable(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def close(self, timeout: float | None = ...) -> None: ...


_LOCK = threading.RLock()
_LIVE: dict[str, Closeable] = {}


def register_session(obj: Closeable) -> None:
    """Record ``obj`` as the live session under ``obj.name`` and install exit hooks."""
    with _LOCK:
        _LIVE[obj.name] = obj
    install_hooks()


def unregister_session(obj: Closeable) -> None:
    """Forget ``obj`` if it is still the one registered under its name."""
    with _LOCK:
        if _LIVE.get(obj.name) is obj:
            del _LIVE[obj.name]


def lookup_session(name: str) -> Closeable | None:
    """The live session called ``name``, if any."""
    with _LOCK:
        return _LIVE.get(name)


def replace_session(name: str) -> None:
    """Close the live session called ``name``, if any, and say so on stderr (a re-run
    cell makes its session anew under the same name)."""
    previous = lookup_session(name)
    if previous is not None:
        previous.close()
        # stdout: a notice, not an error (a notebook shows stderr in red)
        print(f"rlnb: closed the earlier session {name!r} before making its replacement")


def sessions() -> list[Any]:
    """The live sessions of this process, oldest first."""
    with _LOCK:
        return list(_LIVE.values())


def close_all(timeout: float | None = 5.0, *, exit_code: int | None = None) -> None:
    """Close every live session, newest first, within about ``timeout`` seconds in all.

    ``exit_code`` is what their tracker runs report (0 success, 1 failure, 130
    SIGINT, 143 SIGTERM; by default each session decides). Every session is closed
    even if another fails; failures are raised together afterwards as an
    :class:`ExceptionGroup`. Blocks.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    errors: list[Exception] = []
    for obj in reversed(sessions()):
        remaining = None if deadline is None else max(0.05, deadline - time.monotonic())
        try:
            if exit_code is None:
                obj.close(timeout=remaining)
            else:
                obj.close(timeout=remaining, exit_code=exit_code)
        except Exception as exc:
            errors.append(exc)
        finally:
            unregister_session(obj)
    if errors:
        raise ExceptionGroup(f"rlnb.close_all(): {len(errors)} session(s) failed to close", errors)


def _close_all_quietly(reason: str, exit_code: int | None = None) -> None:
    """Close everything from a hook: never raise, say what happened on the log."""
    if not sessions():
        return
    start = time.monotonic()
    names = [s.name for s in sessions()]
    try:
        close_all(timeout=HOOK_TIMEOUT, exit_code=exit_code)
    except Exception:
        log.exception("rlnb: closing sessions on %s failed", reason)
    log.info(
        "rlnb: closed %d session(s) %s on %s in %.1f ms",
        len(names),
        names,
        reason,
        (time.monotonic() - start) * 1e3,
    )


# -- hooks ----------------------------------------------------------------------

_HOOKS_LOCK = threading.Lock()
_atexit_installed = False
_sigterm_installed = False


def install_hooks() -> None:
    """Install the atexit hook, a SIGTERM handler, the kernel hook and the hook that
    presses a lost Ctrl-C again; idempotent."""
    global _atexit_installed, _sigterm_installed
    with _HOOKS_LOCK:
        redeliver_lost_interrupts()
        if not _atexit_installed:
            atexit.register(_close_at_exit)
            _atexit_installed = True
        if not _sigterm_installed and threading.current_thread() is threading.main_thread():
            _sigterm_installed = _install_sigterm_handler()
        _install_kernel_hook()


def take_back_sigterm() -> None:
    """Install rlnb's SIGTERM handler again (from the main thread) where a library put its
    own in its place after rlnb's hooks were installed (verifiers' environments do, when
    made): SIGTERM closes every session, then ends the process as by default."""
    global _sigterm_installed
    with _HOOKS_LOCK:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _sigterm_installed = _install_sigterm_handler()


def _close_at_exit() -> None:
    """At interpreter exit: a script that died of an uncaught exception reports it as
    its runs' exit code (Python keeps it in ``sys.last_value`` for atexit to see). An
    interactive session's last error says nothing about the run: there, each session decides."""
    crash = getattr(sys, "last_value", None)
    interactive = hasattr(sys, "ps1") or bool(sys.flags.interactive) or ipython_shell() is not None
    _close_all_quietly("interpreter exit", exit_code=None if interactive else exit_code_for(crash) or None)


def _install_sigterm_handler() -> bool:
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN or previous is None:  # someone chose to ignore it, or not Python's
        return True

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        _close_all_quietly("SIGTERM", exit_code=143)
        if callable(previous):
            previous(signum, frame)
        else:  # default action: die by SIGTERM, as we would have without this handler
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    return True


def _install_kernel_hook() -> None:
    """Inside a Jupyter kernel, close sessions first thing on a shutdown request."""
    kernel = getattr(ipython_shell(), "kernel", None)
    if kernel is None or getattr(kernel, "_rlnb_hooked", False):
        return
    original: Callable[..., Any] = kernel.do_shutdown

    def do_shutdown(restart: bool) -> Any:
        # the run was cut short by the user, as by the interrupt the restart sends first
        _close_all_quietly("kernel restart" if restart else "kernel shutdown", exit_code=130)
        _stop_process_long_helpers()
        # The process is about to exit. Its last garbage collections walk every
        # object torch made (0.5 s of a ~0.8 s exit after `import torch` here),
        # eating into the 2.5 s jupyter_client allows before SIGTERM. Frozen
        # objects are skipped by them; modules are still torn down and refcounts
        # still run finalisers.
        gc.freeze()
        return original(restart)

    kernel.do_shutdown = do_shutdown
    kernel._rlnb_hooked = True


def _stop_process_long_helpers() -> None:
    """Stop multiprocessing's forkserver and resource tracker (the prompt loader's
    workers start them) before the kernel exits: ipykernel SIGTERMs the kernel's
    children and waits for them, and the tracker ignores SIGTERM."""
    for module, name in (
        ("multiprocessing.forkserver", "_forkserver"),
        ("multiprocessing.resource_tracker", "_resource_tracker"),
    ):
        helper = getattr(sys.modules.get(module), name, None)
        try:
            if helper is not None:
                helper._stop()
        except Exception:  # best effort on the way out
            log.debug("rlnb: stopping %s failed", module, exc_info=True)


def _after_fork_in_child() -> None:
    # A forked child does not own its parent's sessions: its hooks must not close them.
    global _LOCK, _HOOKS_LOCK
    _LOCK = threading.RLock()
    _HOOKS_LOCK = threading.Lock()
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

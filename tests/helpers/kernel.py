"""A real Jupyter kernel, driven through jupyter_client.

Tests get one through the ``open_kernel`` fixture (tests/conftest.py), which puts
them in the system tier; the functions here act on the kernel it yields."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import psutil
import zmq
from jupyter_client import BlockingKernelClient, KernelManager

# Starting a kernel takes seconds on a loaded 2-core machine; be generous.
TIMEOUT = 60.0

# What the ``open_kernel`` fixture gives: ``with open_kernel() as (km, kc):``.
OpenKernel = Callable[[], AbstractContextManager[tuple[KernelManager, BlockingKernelClient]]]


def _close_blocking_loop() -> None:
    # jupyter_client's blocking API runs its coroutines on an event loop that
    # jupyter_core makes for this thread and never closes; its FDs would leak.
    # jupyter_core makes a fresh loop on next use once this one is closed.
    loop = asyncio.get_event_loop()  # the loop jupyter_core set as this thread's current one
    loop.close()
    asyncio.set_event_loop(None)


@contextlib.contextmanager
def kernel(tmp_path: Path) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    """A started python3 kernel and a connected client; everything released on exit."""
    ctx = zmq.Context()  # our own, so that we can close it whatever jupyter_client does
    km = KernelManager(kernel_name="python3", context=ctx, connection_file=str(tmp_path / "kernel.json"))
    kc: BlockingKernelClient | None = None
    try:
        # IPYTHONDIR: keep the kernel's history database out of the home directory.
        km.start_kernel(env={**os.environ, "IPYTHONDIR": str(tmp_path / "ipython")})
        kc = km.client(context=ctx)
        kc.start_channels()
        kc.wait_for_ready(timeout=TIMEOUT)
        yield km, kc
    finally:
        if kc is not None:
            if km.has_kernel:  # a kernel that a test restarted may still be starting: shut it down once up
                with contextlib.suppress(RuntimeError):  # it died (a test killed it): nothing to wait for
                    kc.wait_for_ready(timeout=TIMEOUT)
            kc.stop_channels()
        if km.has_kernel:  # the test stopped early, or the restarted kernel is still up
            km.shutdown_kernel(now=False)
        ctx.destroy(linger=0)
        _close_blocking_loop()


def run_cell(kc: BlockingKernelClient, code: str, timeout: float = TIMEOUT) -> tuple[str, dict[str, Any]]:
    """Execute ``code`` in the kernel; return its stdout and the execute_reply content."""
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            out.append(msg["content"]["text"])

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    return "".join(out), reply["content"]


def ok(kc: BlockingKernelClient, code: str, timeout: float = TIMEOUT) -> str:
    """Execute ``code``, fail on an error reply, return its stdout."""
    out, content = run_cell(kc, code, timeout)
    assert content["status"] == "ok", "\n".join(content.get("traceback", [])) or content
    return out


def cell_output(kc: BlockingKernelClient, code: str, timeout: float = 120.0) -> str:
    """Execute ``code`` and return everything its cell shows: both streams, displays,
    results and a traceback, in order."""
    texts: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        content = msg["content"]
        if msg["msg_type"] == "stream":
            texts.append(content["text"])
        elif msg["msg_type"] in ("display_data", "execute_result"):
            texts.append(content["data"].get("text/plain", "") + "\n")
        elif msg["msg_type"] == "error":
            texts.append("\n".join(content["traceback"]))

    kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    return "".join(texts)


def stop_gracefully(km: KernelManager, log_file: Path, *, restart: bool) -> None:
    """Restart or shut down the kernel and check it exited by itself after rlnb's hook
    ran: its log (``log_file``, rlnb's logger at INFO) says it closed session 'k'."""
    assert km.provisioner is not None
    old = km.provisioner.process  # restart replaces it: keep the old Popen for its returncode
    kernel_proc = psutil.Process(old.pid)
    children = kernel_proc.children(recursive=True)
    # A pidfd turns readable when the process exits, without reaping it (its Popen does).
    pidfd = os.pidfd_open(old.pid)
    exited_at: list[float] = []

    def watch() -> None:
        select.select([pidfd], [], [], TIMEOUT)
        exited_at.append(time.time())

    watcher = threading.Thread(target=watch, name="kernel-exit-watch")
    watcher.start()
    requested = time.time()
    try:
        if restart:
            km.restart_kernel(now=False)
        else:
            km.shutdown_kernel(now=False)
    finally:
        watcher.join()
        os.close(pidfd)

    # Negative means killed by a signal: jupyter_client's SIGTERM/SIGKILL fallbacks.
    assert old.returncode == 0, f"old kernel did not exit by itself: returncode {old.returncode}"
    reason = "kernel restart" if restart else "kernel shutdown"
    text = log_file.read_text()
    found = re.search(rf"^(\d+\.\d+) INFO rlnb: closed 1 session\(s\) \['k'\] on {reason} in ", text, re.M)
    assert found, f"no close line for {reason} in the rlnb log:\n{text}"
    logged = float(found[1])
    assert requested <= logged < exited_at[0]
    assert not kernel_proc.is_running()
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"children of the old kernel survived: {alive}"
    # Reported, not asserted: timing goals belong to the benchmarks on this noisy machine.
    print(
        f"\n{reason}: rlnb hook logged {logged - requested:.3f} s and the old kernel exited "
        f"{exited_at[0] - requested:.3f} s after the request"
    )

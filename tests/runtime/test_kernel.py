"""rlnb inside a real Jupyter kernel, driven through jupyter_client: restart, shutdown, interrupt."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from jupyter_client import BlockingKernelClient

import rlnb
from tests.helpers import wait_until
from tests.helpers.kernel import TIMEOUT, OpenKernel, ok, stop_gracefully

pytestmark = [pytest.mark.slow]

SETUP = """
import logging, os, sys
import rlnb
handler = logging.FileHandler({log!r})
handler.setFormatter(logging.Formatter("%(created).6f %(levelname)s %(message)s"))
logging.getLogger("rlnb").addHandler(handler)
logging.getLogger("rlnb").setLevel(logging.INFO)
sess = rlnb.Session(name="k")
async def answer():
    return 42
assert sess.bridge.run(answer()) == 42
sess.buffer.put(rlnb.Group(prompt="p", samples=(rlnb.Sample(prompt="p", completion="c"),)))
print(os.getpid(), sys.executable, rlnb.__file__, sep="\\n")
"""

INTERRUPTIBLE = """
import asyncio, pathlib, threading
cleaned = threading.Event()
async def nap():
    pathlib.Path({marker!r}).touch()  # tells the test the coroutine is running
    try:
        await asyncio.sleep(60)
    finally:
        cleaned.set()
sess.bridge.run(nap())
"""


def start_session(kc: BlockingKernelClient, log_file: Path) -> int:
    """Make session 'k' with a live loop thread in the kernel; check it runs our rlnb."""
    pid, executable, module = ok(kc, SETUP.format(log=str(log_file))).split()
    assert executable == sys.executable  # jupyter_client swapped kernel.json's "python" for ours
    assert module == rlnb.__file__
    return int(pid)


def test_restart_closes_sessions_and_exits_gracefully(tmp_path: Path, open_kernel: OpenKernel) -> None:
    log_file = tmp_path / "rlnb.log"
    with open_kernel() as (km, kc):
        pid = start_session(kc, log_file)
        assert km.provisioner is not None and km.provisioner.process.pid == pid
        stop_gracefully(km, log_file, restart=True)
        assert km.provisioner.process.pid != pid
        # Read the answer from the shell reply alone: the client's IOPub socket may still be
        # re-subscribing to the new kernel and miss its messages, the idle status that
        # execute_interactive() waits for among them (it timed out so once in CI).
        msg_id = kc.execute("import rlnb", user_expressions={"live": "rlnb.sessions()"})
        while (reply := kc.get_shell_msg(timeout=TIMEOUT))["parent_header"].get("msg_id") != msg_id:
            pass
        assert reply["content"]["user_expressions"]["live"]["data"]["text/plain"] == "[]"


def test_shutdown_closes_sessions_and_exits_gracefully(tmp_path: Path, open_kernel: OpenKernel) -> None:
    log_file = tmp_path / "rlnb.log"
    with open_kernel() as (km, kc):
        start_session(kc, log_file)
        stop_gracefully(km, log_file, restart=False)
        assert not km.has_kernel


def test_interrupt_cancels_the_bridge_call_and_keeps_the_session(tmp_path: Path, open_kernel: OpenKernel) -> None:
    marker = tmp_path / "coroutine-started"
    with open_kernel() as (km, kc):
        start_session(kc, tmp_path / "rlnb.log")
        # stop_on_error=False: after an error reply ipykernel aborts requests that reach it
        # before its own "stop aborting" message, and the next cell here can (a race).
        msg_id = kc.execute(INTERRUPTIBLE.format(marker=str(marker)), stop_on_error=False)
        # Interrupt only once the coroutine runs: before that, run() would cancel it unstarted.
        wait_until(marker.exists, "the coroutine to start", TIMEOUT)
        km.interrupt_kernel()
        while True:
            reply = kc.get_shell_msg(timeout=TIMEOUT)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert ok(kc, "print(cleaned.is_set())").strip() == "True"  # the coroutine's finally ran
        assert ok(kc, "print(sess.bridge.run(answer()))").strip() == "42"
        assert ok(kc, "sess.close(); print(rlnb.sessions())").strip() == "[]"
        km.shutdown_kernel(now=False)

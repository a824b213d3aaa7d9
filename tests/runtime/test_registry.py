from __future__ import annotations

import os
import signal
import subprocess
import textwrap

import pytest

import rlnb
from tests.helpers.processes import PythonProcesses

# A script that makes a session with a live loop thread, logs rlnb's lifecycle to
# stderr, says "ready" and then waits to be told what to do.
SCRIPT = textwrap.dedent(
    """
    import logging, signal, sys, threading
    import rlnb
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    {before}
    sess = rlnb.Session(name="script")

    async def noop():
        return None

    sess.bridge.run(noop())
    print("ready", flush=True)
    {after}
    """
)


def start_script(
    start_python: PythonProcesses, before: str = "", after: str = "threading.Event().wait(30)"
) -> subprocess.Popen[str]:
    return start_python("-c", SCRIPT.format(before=before, after=after))


def wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"


def test_close_all_closes_every_session_newest_first() -> None:
    closed: list[str] = []
    sessions = [rlnb.Session(name=f"s{i}") for i in range(3)]
    for sess in sessions:
        original = sess.close

        def record(timeout: float | None = None, _orig=original, _name=sess.name) -> None:
            closed.append(_name)
            _orig(timeout=timeout)

        sess.close = record  # type: ignore[method-assign]
    assert rlnb.sessions() == sessions
    rlnb.close_all(timeout=5)
    assert closed == ["s2", "s1", "s0"]
    assert rlnb.sessions() == []


def test_close_all_closes_the_rest_when_one_fails() -> None:
    good, bad = rlnb.Session(name="good"), rlnb.Session(name="bad")
    real_close = bad.close

    def failing_close(timeout: float | None = None) -> None:
        real_close(timeout=timeout)
        raise RuntimeError("cannot close")

    bad.close = failing_close  # type: ignore[method-assign]
    with pytest.raises(ExceptionGroup) as info:
        rlnb.close_all()
    assert [str(e) for e in info.value.exceptions] == ["cannot close"]
    assert good.closed and bad.closed
    assert rlnb.sessions() == []


def test_sigterm_closes_sessions_then_dies_by_sigterm(start_python: PythonProcesses) -> None:
    proc = start_script(start_python)
    wait_ready(proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM  # the default action still happens
    assert "closed 1 session(s) ['script'] on SIGTERM" in err


def test_sigterm_chains_to_a_handler_installed_before(start_python: PythonProcesses) -> None:
    before = (
        "def mine(signum, frame):\n"
        "    print('own handler ran, session closed:', sess.closed, flush=True)\n"
        "    sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, mine)"
    )
    proc = start_script(start_python, before=before)
    wait_ready(proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 3
    assert "own handler ran, session closed: True" in out
    assert "on SIGTERM" in err


def test_normal_exit_closes_sessions_through_atexit(start_python: PythonProcesses) -> None:
    proc = start_script(start_python, after="")
    wait_ready(proc)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "closed 1 session(s) ['script'] on interpreter exit" in err


def test_a_forked_child_does_not_own_its_parents_sessions() -> None:
    sess = rlnb.Session(name="parent")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_fd)
            os.write(write_fd, repr([s.name for s in rlnb.sessions()]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as reader:
        seen_by_child = reader.read()
    os.waitpid(pid, 0)
    assert seen_by_child == "[]"
    assert rlnb.sessions() == [sess]
    sess.close()

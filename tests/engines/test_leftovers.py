"""What a killed engine process leaves on disk (``rlnb/engines/_leftovers.py``): found
while it runs, removed once it is gone. vLLM's own case is in tests/engines/test_vllm.py
and tests/session/test_session_vllm.py; here plain processes stand in for it."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
import textwrap
import threading
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from rlnb.engines._leftovers import engine_files, remove_leftovers, socket_dir
from tests.helpers.processes import PythonProcesses

# A process that binds a Unix socket and makes a shared-memory segment, says where,
# and waits to be killed, as vLLM's EngineCore does.
HOLDER = """
import socket, sys, time
from multiprocessing import shared_memory
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen()
shm = shared_memory.SharedMemory(create=True, size=4096)
print(shm.name, flush=True)
time.sleep(600)
"""


def test_a_killed_processs_socket_and_shared_memory_are_found_then_removed(
    tmp_path: Path, start_python: PythonProcesses
) -> None:
    where = str(tmp_path / "engine.sock")
    holder = start_python("-c", textwrap.dedent(HOLDER), where)
    assert holder.stdout is not None
    name = holder.stdout.readline().strip()
    shm = f"/dev/shm/{name.lstrip('/')}"
    try:
        found = engine_files([holder.pid])
        assert {where, shm} <= found
        holder.kill()
        holder.wait()
        assert os.path.exists(where) and os.path.exists(shm), "a killed process leaves both"
        assert remove_leftovers(found) >= 2
        assert not os.path.lexists(where) and not os.path.exists(shm)
        assert remove_leftovers(found) == 0  # nothing left to remove
    finally:
        if os.path.exists(shm):
            os.unlink(shm)


def test_only_sockets_and_shared_memory_not_mapped_here_are_removed(tmp_path: Path) -> None:
    plain = tmp_path / "a-file"
    plain.write_text("kept")
    kept = shared_memory.SharedMemory(create=True, size=4096)  # this process maps it
    try:
        assert remove_leftovers([str(plain), f"/dev/shm/{kept.name.lstrip('/')}", str(tmp_path / "gone")]) == 0
        assert plain.read_text() == "kept"
        assert os.path.exists(f"/dev/shm/{kept.name.lstrip('/')}")
    finally:
        kept.close()
        kept.unlink()


def test_a_segment_removed_here_is_not_reported_as_leaked_at_exit(start_python: PythonProcesses) -> None:
    """The creator registered it with the resource tracker that processes spawned from
    here share; removed, it is taken off, so no warning at this process's exit."""
    code = """
    from multiprocessing import shared_memory
    from rlnb.engines._leftovers import remove_leftovers
    shm = shared_memory.SharedMemory(create=True, size=4096)  # registered with the tracker
    shm.close()  # as if its creator had been killed: named, and mapped by no one
    print(remove_leftovers(["/dev/shm/" + shm.name.lstrip("/")]))
    """
    proc = start_python("-c", textwrap.dedent(code))
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out.strip()) == (0, "1"), err
    assert "leaked" not in err and "Traceback" not in err, err


# A killed holder's semaphore, as vLLM's EngineCore leaves its workers' lock: made by a
# spawned process, so registered with this process's resource tracker, and mapped by
# its creator under a name glibc has already unlinked. A lock this process made and
# the holder also maps stays.
SEMAPHORE_HOLDER = """
import multiprocessing, os, sys, time
from rlnb.engines._leftovers import engine_files, remove_leftovers


def hold(ours, conn):
    lock = multiprocessing.get_context("spawn").Lock()
    conn.send(lock._semlock.name)
    time.sleep(600)


def path(name):
    return "/dev/shm/sem." + name.lstrip("/")


if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    ours = ctx.Lock()
    here, there = ctx.Pipe()
    holder = ctx.Process(target=hold, args=(ours, there))
    holder.start()
    name = here.recv()
    found = engine_files([holder.pid])
    holder.kill()
    holder.join()
    left = os.path.exists(path(name))
    removed = remove_leftovers(found)
    print(path(name) in found, path(ours._semlock.name) in found, left, removed, os.path.exists(path(name)),
          os.path.exists(path(ours._semlock.name)))
"""


def test_a_killed_processs_semaphore_is_found_removed_and_not_reported_as_leaked(
    tmp_path: Path, start_python: PythonProcesses
) -> None:
    script = tmp_path / "holder.py"
    script.write_text(SEMAPHORE_HOLDER)
    proc = start_python(str(script))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    found, ours_found, left, removed, still, ours_still = out.split()
    assert found == "True", "the holder's semaphore is found through the inode of its unlinked first name"
    assert ours_found == "True", "this process's lock, which the holder maps by its name, is seen too"
    assert left == "True", "a killed creator leaves its semaphore"
    assert (removed, still) == ("1", "False"), "removed: the one that is not this process's"
    assert ours_still == "True", "this process's own lock stays"
    assert "leaked" not in err, err


def test_the_socket_dir_is_named_for_vllm_for_the_block_and_removed_with_what_is_in_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    with socket_dir() as where:
        assert where is not None and os.environ["VLLM_RPC_BASE_PATH"] == where
        assert os.path.dirname(where) == tempfile.gettempdir()
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(os.path.join(where, "endpoint"))
    assert "VLLM_RPC_BASE_PATH" not in os.environ
    assert stat.S_ISSOCK(os.lstat(os.path.join(where, "endpoint")).st_mode)
    assert remove_leftovers([where]) == 1 and not os.path.exists(where)

    base = tempfile.mkdtemp(prefix="base-")  # short: pytest's tmp_path would be too long
    try:
        monkeypatch.setenv("VLLM_RPC_BASE_PATH", base)  # the user's choice is the base
        with socket_dir() as where:
            assert where is not None and os.path.dirname(where) == base
        assert os.environ["VLLM_RPC_BASE_PATH"] == base
    finally:
        shutil.rmtree(base)

    long = tmp_path / ("x" * 90)
    long.mkdir()
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(long))
    with socket_dir() as where:  # a socket there would pass the 107 bytes a path may have
        assert where is None and os.environ["VLLM_RPC_BASE_PATH"] == str(long)


def test_a_plain_directory_is_not_removed(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    assert remove_leftovers([str(mine)]) == 0 and mine.is_dir()


def test_two_starts_at_once_take_turns_and_leave_the_variable_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    inside, release = threading.Event(), threading.Event()
    made: list[str | None] = []

    def first() -> None:
        with socket_dir() as where:
            made.append(where)
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(10)
    threading.Timer(0.2, release.set).start()
    with socket_dir() as where:  # waits for the first block to end
        assert release.is_set() and where is not None and os.path.dirname(where) == tempfile.gettempdir()
        made.append(where)
    thread.join(10)
    assert "VLLM_RPC_BASE_PATH" not in os.environ  # not the first's directory
    assert remove_leftovers([p for p in made if p]) == 2

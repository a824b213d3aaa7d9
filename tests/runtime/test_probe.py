from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import threading

import psutil
import pytest
from ipykernel.subshell import SubshellThread  # imported here: its first import opens FDs for good
from IPython.core.history import HistorySavingThread

import rlnb
from rlnb.probe import snapshot
from rlnb.runtime._probe import register_run, unregister_run
from rlnb.testing import no_leaks


def test_snapshot_sees_threads_fds_children_loops_and_runs() -> None:
    before = snapshot()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="probe-thread")
    thread.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    owner = object()
    register_run(owner, "jsonl:run-1")
    try:
        with open(__file__) as handle, rlnb.AsyncBridge(name="probe-bridge") as bridge:

            async def noop() -> None:
                return None

            bridge.run(noop())
            found = snapshot().new_since(before)
            assert any("'probe-thread'" in t for t in found["threads"])
            assert any("'probe-bridge'" in t for t in found["threads"])
            assert any(f"fd {handle.fileno()} -> {__file__}" == f for f in found["fds"])
            assert [c for c in found["children"] if f"pid {child.pid}" in c]
            assert found["loops"] == ["probe-bridge"]
            assert found["runs"] == ["jsonl:run-1"]
    finally:
        unregister_run(owner)
        child.kill()
        child.wait()
        stop.set()
        thread.join()
    assert snapshot().new_since(before) == {}


def test_a_zombie_child_counts_as_dead() -> None:
    before = snapshot()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    proc = psutil.Process(child.pid)
    # Let it exit without reaping it: it stays a zombie until wait().
    for _ in range(500):
        if proc.status() == psutil.STATUS_ZOMBIE:
            break
        threading.Event().wait(0.01)
    assert proc.status() == psutil.STATUS_ZOMBIE
    assert "children" not in snapshot().new_since(before)
    child.wait()


def test_snapshots_are_frozen() -> None:
    snap = snapshot()
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.loops = ()  # type: ignore[misc]


def test_no_leaks_names_a_leaked_thread_and_passes_once_it_is_gone() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="leaky-worker")
    with pytest.raises(rlnb.LeakError, match="'leaky-worker'"), no_leaks(grace=0.05):
        thread.start()
    stop.set()
    thread.join()
    with no_leaks():
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()


def test_no_leaks_names_a_leaked_fd_and_a_leaked_child() -> None:
    handle = None
    child = None
    try:
        with pytest.raises(rlnb.LeakError) as info, no_leaks(grace=0.05, process_grace=0.1):
            handle = open(__file__)
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        message = str(info.value)
        assert f"-> {__file__}" in message
        assert f"pid {child.pid}" in message
    finally:
        if handle is not None:
            handle.close()
        if child is not None:
            child.kill()
            child.wait()


def test_no_leaks_waits_out_a_child_that_is_exiting() -> None:
    with no_leaks():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    child.wait()


def test_the_no_leaks_fixture_is_available_to_any_test(no_leaks: object) -> None:
    assert isinstance(no_leaks, rlnb.probe.Snapshot)


def test_a_snapshot_reads_as_a_few_short_lines_counts_first() -> None:
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait, name=f"repr-worker-{i}-with-a-longish-name") for i in range(12)]
    for thread in threads:
        thread.start()
    try:
        snap = snapshot()
        text = repr(snap)
    finally:
        stop.set()
        for thread in threads:
            thread.join()

    lines = text.splitlines()
    assert 3 <= len(lines) <= 10, text
    assert all(len(line) < 100 for line in lines), text
    for kind, count in [("fds", snap.num_fds), ("threads", snap.num_threads), ("children", snap.num_children)]:
        assert re.search(rf"^\s*{kind}\s+{count}\b", text, re.MULTILINE), (kind, text)
    assert "MainThread" in text
    # 13 threads do not fit on a line: the rest are counted, not listed
    assert re.search(r"… and \d+ more", text), text
    assert sum(line.count("repr-worker-") for line in lines) < 12


def test_a_snapshot_names_children_loops_and_runs() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    owner = object()
    register_run(owner, "jsonl:repr-run")
    try:
        with rlnb.AsyncBridge(name="repr-bridge") as bridge:

            async def noop() -> None:
                return None

            bridge.run(noop())  # the loop starts on first use
            text = repr(snapshot())
    finally:
        unregister_run(owner)
        child.kill()
        child.wait()
    assert re.search(rf"children\s+1: {child.pid} \S", text), text
    assert re.search(r"loops\s+1: repr-bridge", text), text
    assert re.search(r"runs\s+1: jsonl:repr-run", text), text


def test_a_snapshot_renders_as_an_html_table_that_escapes_names() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="<b>bold</b>")
    thread.start()
    try:
        page = snapshot()._repr_html_()
    finally:
        stop.set()
        thread.join()
    assert page.startswith("<table>") and page.endswith("</table>")
    assert "&lt;b&gt;bold&lt;/b&gt;" in page
    assert "<b>" not in page
    for kind in ("fds", "threads", "children", "loops", "runs"):
        assert f">{kind}</th>" in page


def test_fds_and_threads_noted_as_process_long_are_nobodys_leak() -> None:
    from rlnb.runtime import note_process_long

    before = snapshot()
    r, w = os.pipe()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="kept-for-good")
    thread.start()
    try:
        assert snapshot().new_since(before), "a new pipe and thread show before they are noted"
        note_process_long(fds=[r, w], threads=[thread])
        assert not snapshot().new_since(before)
    finally:
        stop.set()
        thread.join()
        os.close(r)
        os.close(w)
    r2, w2 = os.pipe()  # the same FD numbers, now another pipe: a leak like any other
    try:
        assert {r2, w2} == {r, w} and snapshot().new_since(before)
    finally:
        os.close(r2)
        os.close(w2)


def test_the_jupyter_kernels_own_threads_are_nobodys_leak() -> None:
    """IPython's history writer and ipykernel's subshell threads start when the kernel
    needs them, maybe after a session was made; they are the kernel's for its life."""
    before = snapshot()
    stop = threading.Event()

    class KernelThread(threading.Thread):
        def run(self) -> None:
            stop.wait()

    KernelThread.__module__ = SubshellThread.__module__
    kernels = KernelThread(name="subshell-1234")
    ours = threading.Thread(target=stop.wait, name="not-the-kernels")
    for thread in (kernels, ours):
        thread.start()
    try:
        assert HistorySavingThread.__module__ == "IPython.core.history"  # left out the same way
        assert list(snapshot().new_since(before)["threads"]) == [f"'not-the-kernels' (ident {ours.ident})"]
    finally:
        stop.set()
        for thread in (kernels, ours):
            thread.join()

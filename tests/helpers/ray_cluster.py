"""What the Ray tests share: a small config, a head node of a cluster the session did
not start (the ``ray_head_node`` fixture, tests/conftest.py), and Ray's processes and
replicas as a test sees them."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

import rlnb
from rlnb.engines._ray_cluster import is_ray_process
from tests.helpers import small_config, wait_until

# How long each stage of `ray start --head` may take: seconds on an idle machine, minutes
# while the rest of the suite runs beside the Ray tests (scripts/test.sh) on two cores.
START_TIMEOUT = 300.0

SMALL = small_config(
    data=rlnb.DataConfig(num_workers=1),  # multiprocessing's forkserver runs beside Ray: close leaves it be
    ray=rlnb.RayConfig(engine_replicas=2),
)


def ray_processes(root: psutil.Process | None = None) -> list[psutil.Process]:
    """Ray's processes under ``root`` (this process by default)."""
    return [p for p in (root or psutil.Process()).children(recursive=True) if is_ray_process(p)]


def replicas(sess: rlnb.Session) -> list[dict[str, Any]]:
    return sess.statistics().engine.extra["replicas"]


def ray_links(under: Path) -> set[Path]:
    """The short links to long log dirs that Ray's sockets are reached through, those
    to a dir under ``under`` (a test's own: the Ray tests run two at a time)."""
    found = set()
    for link in Path(tempfile.gettempdir()).glob("rlnb-ray-*"):
        try:
            target = Path(os.readlink(link))
        except OSError:  # removed meanwhile, or not a link
            continue
        if target.is_relative_to(under) or target.is_relative_to(under.resolve()):
            found.add(link)
    return found


def free_port() -> int:
    """A loopback port nothing listens on (once this returns)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def live_name(proc: psutil.Process) -> str:
    """``proc``'s name; "" for a process that has exited (a zombie, or gone)."""
    try:
        return "" if proc.status() == psutil.STATUS_ZOMBIE else proc.name()
    except psutil.Error:
        return ""


def socket_fds() -> dict[int, str]:
    """This process's open sockets, by FD."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (or the listing's own)
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


def answers(port: int) -> bool:
    """Whether something listens on the loopback ``port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def head_node(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A Ray cluster that is not the session's: ``ray start --head --block`` (its
    processes die with it), on loopback, with its temp dir short enough for sockets.
    Yields its address and its process; its log is ``tmp_path / "head.log"``."""
    temp = Path(tempfile.mkdtemp(prefix="rlnb-head-"))
    port = free_port()
    command = [
        str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={port}",
        "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
        f"--temp-dir={temp}",
    ]  # fmt: skip
    env = {**os.environ}  # the caller set RAY_AUTH_MODE
    with (tmp_path / "head.log").open("wb") as log:
        head = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        address = f"127.0.0.1:{port}"
        wait_until(
            lambda: {p.name() for p in ray_processes(psutil.Process(head.pid))} >= {"gcs_server", "raylet"},
            "the head node's GCS and raylet",
            timeout=START_TIMEOUT,
        )
        wait_until(lambda: answers(port), "the head node's GCS to listen", timeout=START_TIMEOUT)
        # a driver attaches through the head's raylet: its port answers seconds before it has started
        raylet_log = temp / "session_latest" / "logs" / "raylet.out"
        wait_until(
            lambda: raylet_log.is_file() and "Raylet of id" in raylet_log.read_text(errors="replace"),
            "the head node's raylet to start",
            timeout=START_TIMEOUT,
        )
        yield address, head
    finally:
        everyone = [psutil.Process(head.pid), *ray_processes(psutil.Process(head.pid))]
        for proc in everyone:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(everyone, timeout=10.0)
        head.wait()
        shutil.rmtree(temp, ignore_errors=True)


# A cluster of ``nodes`` simulated nodes (Ray's own test utility: a raylet each, one CPU
# each) in a process of its own, so that the test's driver attaches to it as a session
# attaches to a real multi-node cluster.
NODES = """
import signal, sys, time
from ray.cluster_utils import Cluster
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # shut down below: no stale address left in /tmp/ray
cluster = Cluster(
    initialize_head=True,
    head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False},
)
for _ in range(int(sys.argv[1]) - 1):
    cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
cluster.wait_for_nodes()
print("ADDRESS", cluster.address, flush=True)
try:
    time.sleep(3600)
finally:
    cluster.shutdown()
"""


@contextlib.contextmanager
def simulated_nodes(nodes: int, tmp_path: Path) -> Iterator[str]:
    """A Ray cluster of ``nodes`` nodes on this machine that the session did not start;
    yields its address. Every process of it is killed at the end. Its output goes to
    ``tmp_path / "nodes.log"``."""
    log = (tmp_path / "nodes.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-c", NODES, str(nodes)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("ADDRESS"), (tmp_path / "nodes.log").read_text()[-3000:]
        yield line.split()[1]
    finally:
        everyone = [psutil.Process(proc.pid), *ray_processes(psutil.Process(proc.pid))]
        proc.terminate()  # the cluster shuts itself down; what is left is killed
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        for each in everyone:
            with contextlib.suppress(psutil.Error):
                each.kill()
        psutil.wait_procs(everyone, timeout=10.0)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        log.close()

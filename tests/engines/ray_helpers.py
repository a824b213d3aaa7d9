"""What the Ray tests share: a small config, and Ray's processes and replicas as a test sees them."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import psutil

import rlnb
from rlnb.engines._ray_cluster import is_ray_process

SMALL = rlnb.Config(
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    data=rlnb.DataConfig(num_workers=1),  # multiprocessing's forkserver runs beside Ray: close leaves it be
    rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
    ray=rlnb.RayConfig(engine_replicas=2),
)


def ray_processes(root: psutil.Process | None = None) -> list[psutil.Process]:
    """Ray's processes under ``root`` (this process by default)."""
    return [p for p in (root or psutil.Process()).children(recursive=True) if is_ray_process(p)]


def replicas(sess: rlnb.Session) -> list[dict[str, Any]]:
    return sess.statistics().engine.extra["replicas"]


def ray_links() -> set[Path]:
    """The short links to long log dirs that Ray's sockets are reached through."""
    return set(Path(tempfile.gettempdir()).glob("rlnb-ray-*"))


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


def cell_output(kc: Any, code: str, timeout: float = 120.0) -> str:
    """Execute ``code`` in the kernel behind the client ``kc`` and return everything its
    cell shows: both streams, displays, results and a traceback, in order."""
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

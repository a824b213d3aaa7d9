"""What the Ray tests share: a small config, and Ray's processes and replicas as a test sees them."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import psutil

import rlnb
from rlnb.rollout._ray_cluster import is_ray_process

SMALL = rlnb.Config(
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    data=rlnb.DataConfig(num_workers=1),  # multiprocessing's forkserver runs beside Ray: close leaves it be
    rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
    ray=rlnb.RayConfig(engine_replicas=2),
)


def ray_processes(root: psutil.Process | None = None) -> list[psutil.Process]:
    """Ray's processes under ``root`` (this process by default)."""
    return [p for p in (root or psutil.Process()).children(recursive=True) if is_ray_process(p)]


def replicas(sess: rlnb.Session) -> list[dict[str, int | str]]:
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

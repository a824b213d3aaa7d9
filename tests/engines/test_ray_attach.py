"""A session attached to a Ray cluster it did not start (``RayConfig.address``): a head
node started with ``ray start``, on loopback, which the session leaves running.

It runs after test_ray.py, in the same process (scripts/test.sh): most of its time
is the vLLM replica's start."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import ray

import rlnb
import rlnb.models
from tests.engines.ray_helpers import SMALL, free_port, live_name, ray_processes, replicas
from tests.helpers import exited, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.ray]


def answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def head_node(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A Ray cluster that is not the session's: ``ray start --head --block`` (its
    processes die with it), on loopback, with its temp dir short enough for sockets."""
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
            timeout=60.0,
        )
        wait_until(lambda: answers(port), "the head node's GCS to listen", timeout=60.0)
        # a driver attaches through the head's raylet: its port answers seconds before it has started
        raylet_log = temp / "session_latest" / "logs" / "raylet.out"
        wait_until(
            lambda: raylet_log.is_file() and "Raylet of id" in raylet_log.read_text(errors="replace"),
            "the head node's raylet to start",
            timeout=120.0,
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


def test_a_session_attached_to_a_running_cluster_leaves_it_running_without_its_actors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The head and this driver agree on token authentication: a driver given an explicit
    # address sends a token only when RAY_AUTH_MODE says "token" (Ray's rule), and a local
    # cluster started earlier in this process (if any) turned it on, for the life of the process.
    monkeypatch.setenv("RAY_AUTH_MODE", os.environ.get("RAY_AUTH_MODE") or "disabled")
    with head_node(tmp_path) as (address, head):
        cluster = {p.pid for p in ray_processes(psutil.Process(head.pid)) if p.name() in ("gcs_server", "raylet")}
        ray_config = rlnb.RayConfig(engine_replicas=2, address=address, num_cpus=1, start_timeout=600)
        llama = rlnb.ModelConfig(path=str(rlnb.models.tiny_llama(tmp_path / "llama")), max_len=32)
        vllm = rlnb.EngineConfig(kind="vllm", max_batch=64)
        # The cell run again and again, attaching as the first run did; the replicas serve
        # the built-in policy, then a Hugging Face model on the "hf" engine, then the same
        # model on vLLM (one replica: a vLLM start is the costly part).
        runs = [
            ("tiny", SMALL.replace(ray=ray_config)),
            ("hf", SMALL.replace(ray=ray_config, model=llama)),
            ("vllm", SMALL.replace(ray=dataclasses.replace(ray_config, engine_replicas=1), model=llama, engine=vllm)),
        ]
        if importlib.util.find_spec("vllm") is None and os.environ.get("RLNB_REQUIRE_VLLM") != "1":
            runs.pop()  # test_vllm.py says why vLLM's tests skip
        for kind, config in runs:
            with rlnb.Session(config, name="attached") as sess:
                assert sess.statistics().engine.extra["ray_owned"] is False
                assert isinstance(sess.policy, rlnb.models.TinyPolicy if kind == "tiny" else rlnb.models.HFPolicy)
                assert sess.step()["version"] == 1
                assert all(int(r["served"]) > 0 for r in replicas(sess)), replicas(sess)
                assert {v for g in sess.rollout(2) for s in g.samples for v in s.versions} == {1}
                under_head = psutil.Process(head.pid).children(recursive=True)
                # the last run's replicas may still be exiting (zombies, or gone while listed)
                actors = [p for p in under_head if live_name(p).startswith("ray::_Replica")]
                assert len(actors) == config.ray.engine_replicas, (kind, actors)
                engine = [p for p in under_head if live_name(p).startswith("VLLM::")]
                if kind == "vllm" and len(engine) != 2:  # seen once in CI: not listed at the first look
                    wait_until(
                        lambda: len(vllm_under(head.pid)) == 2,
                        "vLLM's EngineCore and Worker under the replica",
                        timeout=30,
                    )
                    under_head = psutil.Process(head.pid).children(recursive=True)
                    engine = vllm_under(head.pid)
                assert len(engine) == (2 if kind == "vllm" else 0), engine  # EngineCore and its Worker
                theirs = {p.pid for p in [psutil.Process(head.pid), *under_head]}
                assert [p for p in ray_processes() if p.pid not in theirs] == [], "an attached session starts none"
            assert not ray.is_initialized()
            wait_until(
                lambda: all(exited(p) for p in actors + engine),  # noqa: B023
                "the session's replicas (and their vLLM engines) to exit",
                timeout=10.0,
            )
            alive = {p.pid for p in ray_processes(psutil.Process(head.pid)) if p.name() in ("gcs_server", "raylet")}
            assert alive == cluster, "the cluster that was there before is still running"


def vllm_under(pid: int) -> list[psutil.Process]:
    """vLLM's processes (named ``VLLM::...``) under the process ``pid``."""
    return [p for p in psutil.Process(pid).children(recursive=True) if live_name(p).startswith("VLLM::")]

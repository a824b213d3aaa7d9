"""A session attached to a Ray cluster it did not start (``RayConfig.address``): a head
node started with ``ray start``, on loopback, which the session leaves running.

It runs after test_ray.py, in the same process (scripts/test.sh): most of its time
is the vLLM replica's start."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
from pathlib import Path

import psutil
import pytest

import rlnb
import rlnb.models
from tests.helpers import exited, wait_until
from tests.helpers.ray_cluster import SMALL, live_name, ray_processes, replicas

pytestmark = [pytest.mark.slow]


def test_a_session_attached_to_a_running_cluster_leaves_it_running_without_its_actors(
    tmp_path: Path, ray_head_node: tuple[str, subprocess.Popen[bytes]]
) -> None:
    import ray  # here, not at the top: importing Ray takes seconds of every collection

    address, head = ray_head_node
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
        runs.pop()  # the vllm fixture (tests/conftest.py) says why vLLM's tests skip
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
            if kind == "vllm" and len(engine) != 2:  # seen twice in CI: not listed at the first look
                try:
                    wait_until(
                        lambda: len(vllm_under(head.pid)) == 2,
                        "vLLM's EngineCore and Worker under the replica",
                        timeout=30,
                    )
                except AssertionError as exc:  # say where they are: not named yet, or not under the head
                    raise AssertionError(f"{exc}; {process_tree(head.pid)}; elsewhere: {vllm_anywhere()}") from None
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


def process_tree(pid: int) -> str:
    """The processes under ``pid``: pid, parent and name of each."""
    under = psutil.Process(pid).children(recursive=True)
    return "under the head: " + ", ".join(f"{p.pid} (parent {p.ppid()}) {live_name(p) or '<exited>'}" for p in under)


def vllm_anywhere() -> list[tuple[int, int, str]]:
    """Every process named ``VLLM::...`` on the machine: pid, parent, name."""
    return [(p.pid, p.ppid(), live_name(p)) for p in psutil.process_iter() if live_name(p).startswith("VLLM::")]


def vllm_under(pid: int) -> list[psutil.Process]:
    """vLLM's processes (named ``VLLM::...``) under the process ``pid``."""
    return [p for p in psutil.Process(pid).children(recursive=True) if live_name(p).startswith("VLLM::")]

"""A session whose learner runs on two ranks (``LearnConfig(ranks=2)``): Ray actors on
a local cluster the session starts, a gloo process group between them. It trains as
one process does, carries live settings, what-if and checkpoints across 1 and 2
ranks, says which rank died, and leaves no process behind."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import rlnb
from tests.helpers import ctrl_c_once, exited, wait_until
from tests.helpers.kernel import OpenKernel, ok
from tests.helpers.processes import PythonProcesses
from tests.helpers.ray_cluster import ray_processes, simulated_nodes

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.ray]

COMPARED = ("loss", "policy_loss", "grad_norm", "entropy", "reward_mean", "lr", "version")


def config(ranks: int, **learn: Any) -> rlnb.Config:
    return rlnb.Config(
        model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
        rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
        learn=rlnb.LearnConfig(ranks=ranks, lr=3e-3, **learn),
        data=rlnb.DataConfig(num_workers=0),
        seed=1,
    )


def same(a: dict[str, float], b: dict[str, float]) -> None:
    for key in COMPARED:
        assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (key, a[key], b[key])


def test_two_ranks_train_as_one_process_and_a_checkpoint_goes_between_them(tmp_path: Path) -> None:
    import ray

    with rlnb.Session(config(1), name="one") as one:
        whole = sum(p.numel() * p.element_size() for p in one._learner.policy.parameters())  # type: ignore[attr-defined]
        alone = one.train(3, progress=False)
        one.set(lr=1e-3)
        alone.append(one.step())
        with pytest.raises(rlnb.StateError, match=r"LearnConfig.ranks=1\): there is nothing to restart"):
            one.restart_learner()
        one.save(tmp_path / "one")
        alone_next = one.step()
    with rlnb.Session(config(2), name="two") as two:
        assert ray.is_initialized()
        ranks = [p for p in ray_processes() if "_Rank" in " ".join(p.cmdline())]
        assert len(ranks) == 2, "one process per rank"
        split = two.train(3, progress=False)
        two.set(lr=1e-3)  # a live setting reaches the ranks with the next step
        split.append(two.step())
        for a, b in zip(alone, split, strict=True):
            same(a, b)
        seen = two.statistics().learner  # each rank: alive, its step time and memory
        assert seen is not None and seen.parallelism == "fsdp" and seen.dead is None
        assert [(r.rank, r.state, r.node) for r in seen.each] == [
            (0, "running", "127.0.0.1"),
            (1, "running", "127.0.0.1"),
        ]
        assert {r.pid for r in seen.each} == {p.pid for p in ranks}
        assert sum(r.parameter_bytes for r in seen.each) == whole  # FSDP2: each rank keeps its shard
        for r in seen.each:
            assert r.step_seconds is not None and r.step_seconds > 0
            assert 0.4 * whole < r.parameter_bytes == r.gradient_bytes < 0.6 * whole  # about half each
            assert 0 < r.optimizer_bytes - 2 * r.parameter_bytes < 1024  # AdamW: two moments, and a step count each
            assert r.rss_bytes > r.parameter_bytes
        assert "rank 1: running, pid" in repr(two.statistics())
        dash = two.dashboard()  # a row per rank
        dash.tick()
        assert dash.state.value.count('<tr class="rlnb-rank" data-state="running">') == 2
        assert "2 ranks (fsdp)" in dash.state.value
        dash.close()
        assert split[-1]["lr"] == 1e-3
        assert two.complete("12+34=")  # the engine serves the mirror of rank 0's weights
        # what-if trains a copy in this process: the ranks' weights stay
        two.what_if(lr=1e-2)
        two.save(tmp_path / "ckpt")
        # a fork is a session of its own with a new group of ranks; closing it leaves this one's
        with two.fork("two-fork") as forked:
            theirs = forked.statistics().learner
            assert theirs is not None and not {r.pid for r in theirs.each} & {r.pid for r in seen.each}
            assert forked.version == two.version and forked.step()["version"] == two.version + 1
        split_next = two.step()
        same(alone_next, split_next)
        # the background run drives the ranks too
        two.training.start(2)
        two.training.wait()
        assert two.version == 7
        everyone = ray_processes()
    assert not ray.is_initialized()
    assert all(exited(p) for p in everyone) and ray_processes() == []
    # 2 -> 1 rank and 1 -> 2: the checkpoint's weights and optimiser state resume exactly
    with rlnb.Session.load(tmp_path / "ckpt", ranks=1, name="back") as back:
        same(split_next, back.step())
    with rlnb.Session.load(tmp_path / "one", ranks=2, name="up") as up:
        assert up.config.learn.ranks == 2
        same(alone_next, up.step())
    assert ray_processes() == []


def test_a_rank_killed_mid_step_is_an_error_naming_it_restart_learner_goes_on_and_close_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    # Where Ray would look for a cluster to join (as it would read the address a killed
    # `ray start` left in /tmp/ray/ray_current_cluster): a session's own cluster is new.
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")

    class KillRank1(rlnb.learn.Callback):
        def on_batch(self, groups: Any) -> None:
            ray.kill(sess._learner.group.actors[1], no_restart=True)  # type: ignore[attr-defined]

    # async: rollouts go on meanwhile; a short deadline for the hung rank below
    sess = rlnb.Session(config(2, rank_timeout=8).replace(mode="async"), name="dies")
    try:
        sess.step()
        # Ctrl-C while the ranks step: the step finishes on every rank first, then the interrupt
        group = sess._learner.group  # type: ignore[attr-defined]
        stepping = threading.Event()

        def call(method: str, *args: Any) -> list[Any]:
            stepping.set()
            return type(group).call(group, method, *args)

        group.call = call
        with ctrl_c_once(stepping):
            sess.step()
        del group.call
        assert sess.version == 2
        sess.rollouts.pause("wait")  # rollouts paused and resumed between steps: the ranks do not notice
        sess.rollouts.resume()
        assert sess.step()["version"] == 3  # rank 0's own count: the ranks and this process agree
        pid = sess._learner.group.pids[1]  # type: ignore[attr-defined]
        sess.callbacks.append(KillRank1())
        with pytest.raises(rlnb.TrainingError, match=rf"learner rank 1 \(pid {pid}, on 127.0.0.1\) died during step"):
            sess.step()
        assert sess.version == 3  # the step was not taken
        seen = sess.statistics().learner
        assert seen is not None and [r.state for r in seen.each] == ["running", "dead"]
        assert seen.dead == f"rank 1 (pid {pid}, on 127.0.0.1) died during step"
        assert [f.code for f in sess.diagnose() if f.severity == "critical"][:1] == ["learner-rank-dead"]
        with pytest.raises(rlnb.TrainingError, match="the learner's ranks are gone: rank 1"):
            sess.step()
        # new ranks from the last step's weights, the session going on
        sess.callbacks.clear()
        kept = {k: v.clone() for k, v in sess.policy.state_dict().items()}
        old = [p for p in ray_processes() if "_Rank" in " ".join(p.cmdline())]
        seen = sess.restart_learner()
        assert [r.state for r in seen.each] == ["running", "running"] and seen.dead is None
        assert all(exited(p) for p in old)  # the old group's survivor too
        assert pid not in {r.pid for r in seen.each}
        assert sess.step()["version"] == 4
        assert any(not torch.equal(v, kept[k]) for k, v in sess.policy.state_dict().items())
        # a rank that hangs (its loss function never returns): an error within the deadline, never a hang
        namespace: dict[str, Any] = {}
        exec(HANGS_ON_RANK_1, namespace)  # a function of no module: Ray sends it by value
        sess.set(algorithm=rlnb.Algorithm(loss=namespace["hangs_on_rank_1"]))
        pid = sess._learner.group.pids[1]  # type: ignore[attr-defined]
        started = time.monotonic()
        hung = rf"learner rank 1 \(pid {pid}, on 127.0.0.1\) hung during step: rank 0 waited for it in a collective"
        with pytest.raises(rlnb.TrainingError, match=hung) as raised:
            sess.step()
        assert "\n" not in str(raised.value) and time.monotonic() - started < 60
        assert sess.version == 4 and sess.statistics().learner.each[1].state == "dead"  # type: ignore[union-attr]
        everyone = ray_processes()
    finally:
        sess.close()
    assert all(exited(p) for p in everyone) and ray_processes() == []
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


HANGS_ON_RANK_1 = """
import time
import torch.distributed as dist

def hangs_on_rank_1(inputs):
    if dist.is_initialized() and dist.get_rank() == 1:  # on rank 1, not in the dry run here
        time.sleep(600)
    return -inputs.logp
"""


OWNER = """
import sys, time, rlnb
config = rlnb.Config(
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    data=rlnb.DataConfig(num_workers=0),
    learn=rlnb.LearnConfig(ranks=2),
    ray=rlnb.RayConfig(engine_replicas=1),  # the ranks and an engine replica on one cluster
)
sess = rlnb.Session(config, name="owner")
sess.step()
assert sess.statistics().engine.extra["replicas"][0]["version"] == 1
print("READY", *(r.pid for r in sess.statistics().learner.each), flush=True)
time.sleep(600)
"""


def test_a_sigkilled_owner_leaves_no_rank_and_no_ray_process(start_python: PythonProcesses) -> None:
    owner = start_python("-c", OWNER)
    assert owner.stdout is not None
    line = owner.stdout.readline()
    assert line.startswith("READY"), owner.communicate(timeout=30)[1][-3000:]
    pids = [int(pid) for pid in line.split()[1:]]
    everyone = ray_processes(psutil.Process(owner.pid))
    assert len(pids) == 2 and set(pids) <= {p.pid for p in everyone}
    assert len(everyone) >= 5, everyone  # GCS, raylet, two ranks, a replica
    owner.kill()
    owner.wait(10)
    wait_until(lambda: all(exited(p) for p in everyone), "every rank and Ray process of the killed owner to exit")


CELL = """
import rlnb
sess = rlnb.Session(rlnb.Config(
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    data=rlnb.DataConfig(num_workers=0),
    learn=rlnb.LearnConfig(ranks=2),
), name="ranks-kernel")
sess.training.start(3)
sess.training.wait()
"""


def test_a_rerun_cell_and_a_kernel_restart_leave_no_rank_process(open_kernel: OpenKernel) -> None:
    with open_kernel() as (km, kc):
        ok(kc, CELL)
        assert km.provisioner is not None
        kernel = psutil.Process(km.provisioner.process.pid)
        first = [p for p in ray_processes(kernel) if "_Rank" in " ".join(p.cmdline())]
        assert len(first) == 2, first
        ok(kc, CELL)  # the cell again: the session of that name closes first, its ranks with it
        assert all(exited(p) for p in first)
        everyone = ray_processes(kernel)
        assert sum("_Rank" in " ".join(p.cmdline()) for p in everyone) == 2, everyone
        km.restart_kernel(now=False)  # rlnb's shutdown hook closes the session: its ranks and Ray
        wait_until(lambda: all(exited(p) for p in everyone), "every rank and Ray process of the old kernel to exit")


def test_the_cli_trains_on_two_learner_ranks(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    done = run_cli(
        "train", "--steps", "3", "--run-dir", str(tmp_path), "--learner-ranks", "2", "--learner-strategy", "ddp",
        "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[rl] 3 steps" in done.stdout and "exit code 0" in done.stdout
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2, 3]


def test_two_ranks_on_a_simulated_two_node_cluster_one_per_node_train(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    # A driver given an address sends a token only when RAY_AUTH_MODE says so (Ray's rule).
    monkeypatch.setenv("RAY_AUTH_MODE", os.environ.get("RAY_AUTH_MODE") or "disabled")
    with simulated_nodes(2, tmp_path) as address:
        # ppo: a critic beside the policy, sharded as it is
        two = config(2, algorithm="ppo").replace(ray=rlnb.RayConfig(address=address, strategy="STRICT_SPREAD"))
        with rlnb.Session(two, name="nodes") as sess:
            for _ in range(3):
                assert sess.step()["value_loss"] > 0
            seen = sess.statistics().learner
            assert seen is not None and len({r.node_id for r in seen.each}) == 2, seen  # one rank per node
            assert sess.version == 3
            critic = sess._learner.critic  # type: ignore[attr-defined]  # rank 0's, fetched whole
            assert (
                critic is not None and float(critic.head.weight.detach().abs().sum()) > 0
            )  # it learnt (it starts at 0)
            head = {k: v.clone() for k, v in critic.head.state_dict().items()}
            sess.save(tmp_path / "ppo")
        assert not ray.is_initialized()  # the session disconnected; the cluster it did not start goes on
    with rlnb.Session.load(tmp_path / "ppo", ranks=1, name="one-critic") as back:  # the critic goes on on one process
        assert back._learner.critic is not None  # type: ignore[attr-defined]
        for key, value in back._learner.critic.head.state_dict().items():  # type: ignore[attr-defined]
            assert torch.equal(value, head[key]), key
        assert back.step()["version"] == 4


def test_a_hugging_face_models_lora_adapter_trains_on_ranks_and_its_engine_serves_the_merge(tmp_path: Path) -> None:
    from rlnb.models import tiny_llama

    llama = tiny_llama(tmp_path / "llama", hidden_size=64, intermediate_size=128)
    model = rlnb.ModelConfig(path=str(llama), max_len=32, lora=rlnb.LoraConfig(r=4, alpha=8))
    with rlnb.Session(config(2, kl_coef=0.01).replace(model=model), name="lora-ranks") as sess:  # LoRA's KL reference
        before = {k: v.clone() for k, v in sess.policy.state_dict().items()}
        for _ in range(2):
            sess.step()
        after = sess.policy.state_dict()
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        assert changed and all("lora_" in k for k in changed)  # only the adapter trains and syncs
        assert sess.statistics().engine.version == 2  # the engine took the merged weights
        assert sess.statistics().learner.parallelism == "fsdp"  # type: ignore[union-attr]

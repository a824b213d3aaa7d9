"""Engine replicas as Ray actors (``RayConfig``), on a real local Ray cluster that the
session starts and owns. Run in the loopback-only namespace (scripts/test.sh);
test_ray_attach.py attaches to one it did not start, and test_ray_config.py checks
what needs no cluster."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

import rlnb
import rlnb.models
from tests.helpers import exited, wait_until
from tests.helpers.kernel import OpenKernel, cell_output, ok
from tests.helpers.ray_cluster import SMALL, free_port, ray_links, ray_processes, replicas, socket_fds
from tests.serve.helpers import assert_serves

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.ray]


DIED = re.compile(r"rlnb: Ray replica (\d) died \(pid (\d+), ([^)]+)\) (.*); its logs: (\S+)\n")


def test_a_session_on_two_replicas_trains_pauses_survives_a_kill_and_leaves_no_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray  # here, not at the top: importing Ray takes seconds of every collection

    links = ray_links(tmp_path)
    run_dir = tmp_path / "a-run-dir-too-long-for-the-sockets-of-ray"
    with rlnb.Session(SMALL.replace(track=rlnb.TrackConfig(run_dir=str(run_dir))), name="ray") as sess:
        assert ray.is_initialized() and len(replicas(sess)) == 2
        assert list(run_dir.glob("ray/session_*/logs/raylet.out")), "Ray's logs go under the run dir"
        assert len(ray_links(tmp_path) - links) == 1, "its sockets, through a link with a short path"
        log_dir = Path(sess.statistics().engine.extra["log_dir"])  # the real path, not the link close removes
        assert log_dir.parent.parent == run_dir.resolve() / "ray" and (log_dir / "raylet.out").is_file()
        assert all(Path(f).parent == log_dir and Path(f).is_file() for r in replicas(sess) for f in r["logs"])
        assert all(r["state"] == "running" for r in replicas(sess))
        assert len(ray_processes()) >= 4, "a local cluster of the session's own: GCS, raylet, two replicas"

        # Rollouts spread over both replicas; each learner step's weights reach both.
        for _ in range(3):
            sess.step()
        assert sess.version == 3
        assert [r["version"] for r in replicas(sess)] == [3, 3]
        assert all(int(r["served"]) > 0 for r in replicas(sess)), replicas(sess)

        # Pause in every mode across the replicas; "abort" keeps partial rollouts.
        sess.rollouts.start()
        wait_until(lambda: sess.statistics().engine.running > 0, "rollouts in flight on the replicas")
        for mode in ("abort", "keep", "wait"):
            sess.rollouts.pause(mode)
            if mode == "wait":
                sess.rollouts.wait_paused()
            assert sess.statistics().engine.paused == mode
            if mode != "keep":
                assert sess.statistics().engine.running == 0, mode  # nothing generating
            sess.rollouts.resume()
        sess.rollouts.stop()
        assert sess.step()["version"] == 4
        assert_serves(sess, "12+34=")  # the endpoint serves the replicas

        # A replica killed from outside mid-generation: its requests go to the other,
        # the replica is remade with the current weights, and it is counted.
        victim = sess._engine._slots[0].actor  # type: ignore[attr-defined]

        def kill_when_busy() -> None:
            # the victim's own requests in flight, not only the other replica's (seen once in CI:
            # killed while it had none, nothing was requeued)
            wait_until(lambda: int(replicas(sess)[0]["in_flight"]) > 0, "rollouts in flight on replica 0", timeout=60)
            ray.kill(victim)

        killer = threading.Thread(target=kill_when_busy)
        victim_pid = int(replicas(sess)[0]["pid"])
        victim_err = next(f for f in replicas(sess)[0]["logs"] if f.endswith(".err"))
        capsys.readouterr()
        killer.start()
        assert sess.step()["version"] == 5
        killer.join()
        assert sess.step()["version"] == 6  # training goes on
        # said in one line, with the dead worker's log file
        said = DIED.findall(capsys.readouterr().out)
        assert len(said) == 1 and said[0][:2] == ("0", str(victim_pid)) and said[0][4] == victim_err, said
        # the weights it was remade with: step 5's (v4), or v5's if it was found dead at the sync
        assert said[0][3] in (f"and was remade with weights v{v} (restart 1 of 3)" for v in (4, 5)), said
        assert replicas(sess)[0]["died"] == f"pid {victim_pid}, {said[0][2]}"
        stats = sess.statistics().engine.extra
        assert stats["restarts"] == 1 and replicas(sess)[0]["restarts"] == 1
        assert [r["state"] for r in replicas(sess)] == ["running", "running"]
        # Found dead by a request: its requests ran again on the other replica. A kill that
        # lands once its requests have ended (ray.kill is asynchronous; seen three times in
        # CI under load) is found by the sync's pause, the sync itself or the resume after
        # it, with nothing to run again.
        found_by = replicas(sess)[0]["found_by"]
        assert found_by in ("a request", "pause()", "the weight sync", "resume()"), found_by
        if found_by == "a request":
            assert stats["requeued"] >= 1, stats
        assert [r["version"] for r in replicas(sess)] == [6, 6]
        dash = sess.dashboard()  # one row per replica, and the restart
        dash.tick()
        assert dash.state.value.count('<tr class="rlnb-replica" data-state="running">') == 2
        assert "restarts 1, re-queued requests" in dash.state.value
        everyone = ray_processes()
        forkserver = multiprocessing.forkserver._forkserver._forkserver_pid
        assert forkserver is not None
    assert not ray.is_initialized()
    assert psutil.Process(forkserver).is_running(), "close killed a process that is not Ray's"
    assert all(exited(p) for p in everyone)
    assert ray_processes() == []
    assert ray_links(tmp_path) == links
    # What Ray's driver keeps in this process for good, and why: the probe says it.
    kept = {k.owner: k for k in rlnb.probe.snapshot().process_long}["Ray"]
    assert "ray.shutdown()" in kept.reason and "for the life of the process" in kept.reason
    assert any(target.startswith(str(log_dir)) for target in kept.fds.values()), kept.fds  # its own log files
    assert {"gcs_client_io_s", "worker.io"} <= set(kept.threads), kept.threads  # its C++ threads
    sess.close()  # idempotent


def test_ray_started_again_in_the_same_process_leaves_nothing_that_comes_back(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cell re-run starts Ray again in the same kernel: the new session closes the
    earlier one, and its cluster, first. Ray's driver then kept exporting metrics to the
    gone cluster after close, on a new socket every few seconds (each seen by a later
    test's leak check): the session turns Ray's metrics off."""
    monkeypatch.setenv("RAY_metrics_report_interval_ms", "1000")  # were they on, every second
    config = SMALL.replace(ray=rlnb.RayConfig(engine_replicas=1), data=rlnb.DataConfig(num_workers=0))
    first = rlnb.Session(config, name="again")  # the cell, run once
    first.step()
    (replica,) = (psutil.Process(r["pid"]) for r in replicas(first))
    with rlnb.Session(config, name="again") as sess:  # and again
        assert "closed the earlier session 'again'" in capsys.readouterr().out
        assert first.closed and exited(replica)
        sess.step()
    before = socket_fds()
    deadline = time.monotonic() + 4.0  # Ray exports every second here
    while time.monotonic() < deadline:
        assert socket_fds() == before, "a socket came or went after Ray was shut down"
        time.sleep(0.02)


OWNER = """
import sys, time, rlnb
config = rlnb.Config(
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    data=rlnb.DataConfig(num_workers=0),
    ray=rlnb.RayConfig(engine_replicas=2, log_dir=sys.argv[1]),
)
sess = rlnb.Session(config, name="owner")
sess.step()
print("READY", flush=True)
time.sleep(600)
"""


def test_a_sigkilled_owner_leaves_no_ray_process(tmp_path: Path) -> None:
    log, links = tmp_path / "owner.log", ray_links(tmp_path)
    with log.open("w") as err:
        owner = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(OWNER), str(tmp_path / "ray-logs-of-the-process-to-be-killed")],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        assert line.startswith("READY"), log.read_text()[-3000:]
        assert log.read_text() == "", "Ray writes nothing on stderr (a red box in a notebook)"
        everyone = ray_processes(psutil.Process(owner.pid))
        assert len(everyone) >= 4
        killed = time.monotonic()
        owner.kill()
        owner.wait(10)
        wait_until(
            lambda: all(exited(p) for p in everyone),
            "every Ray process of the killed owner to exit",
            timeout=10.0,
        )
        print(f"Ray's processes gone {time.monotonic() - killed:.2f} s after SIGKILL of their owner")
        wait_until(lambda: ray_links(tmp_path) == links, "the guard to remove the link to Ray's log dir", timeout=5.0)
    finally:
        owner.kill()
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()


# Imported by every Python process that Ray starts in the test below: the first
# dashboard agent takes a minute to start, as on a very busy machine.
SLOW_AGENT = """
import os, sys, time
if sys.argv and sys.argv[0].endswith(os.path.join("dashboard", "agent.py")):
    try:
        os.close(os.open(os.environ["RLNB_TEST_SLOW_AGENT"], os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        pass
    else:
        time.sleep(60)
"""


def test_a_start_whose_raylet_aborts_is_cleaned_up_and_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a busy machine Ray's agents can take longer to start than the raylet waits
    for their ports; the raylet then aborts and ``ray.init`` raises after 30 s. Made to
    happen here (the first agent sleeps): the session removes what that start left and
    starts again."""
    import ray  # here, not at the top: importing Ray takes seconds of every collection

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_AGENT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("RLNB_TEST_SLOW_AGENT", str(tmp_path / "slowed"))
    real_init, starts = ray.init, []

    def init(**options: object) -> object:
        starts.append(options)
        return real_init(**options)

    monkeypatch.setattr(ray, "init", init)
    run_dir = tmp_path / "run"
    config = SMALL.replace(ray=rlnb.RayConfig(engine_replicas=1), track=rlnb.TrackConfig(run_dir=str(run_dir)))
    with rlnb.Session(config, name="slow-start") as sess:
        assert len(starts) == 2
        sess.step()
        assert replicas(sess)[0]["state"] == "running"
    assert not ray_processes(), "every Ray process of both starts is gone, the sleeping agent too"
    first, second = sorted((run_dir / "ray").glob("session_2*"))  # both starts' logs are kept
    assert "Timed out waiting for file" in (first / "logs" / "raylet.err").read_text()
    assert "Timed out waiting for file" not in (second / "logs" / "raylet.err").read_text()


@pytest.mark.parametrize(
    ("error", "attempts"),
    [
        (Exception("The current node timed out during startup. This could happen because ..."), 3),
        (OSError("No space left on device"), 1),  # not a slow start: not tried again
    ],
)
def test_a_local_cluster_that_does_not_start_is_an_engine_error_naming_its_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception, attempts: int
) -> None:
    import ray  # here, not at the top: importing Ray takes seconds of every collection

    calls = []

    def init(**options: object) -> None:
        calls.append(options)
        raise error

    monkeypatch.setattr(ray, "init", init)
    config = SMALL.replace(ray=rlnb.RayConfig(engine_replicas=1), track=rlnb.TrackConfig(run_dir=str(tmp_path)))
    with pytest.raises(rlnb.EngineError) as caught:
        rlnb.Session(config, name="no-start")
    assert len(calls) == attempts
    message = str(caught.value)
    assert f"Ray's local cluster did not start ({type(error).__name__}: {error})" in message
    assert f"after {attempts} attempt(s) within RayConfig.start_timeout=120.0 s" in message
    assert f"its logs are in {tmp_path.resolve() / 'ray' / 'session_latest' / 'logs'}" in message
    assert caught.value.__cause__ is error
    assert not ray_links(tmp_path)  # the short link to the log dir is removed


def test_an_address_where_nothing_listens_is_a_config_error_at_once() -> None:
    import ray  # here, not at the top: importing Ray takes seconds of every collection

    port = free_port()  # closed again: nothing listens there
    config = SMALL.replace(ray=rlnb.RayConfig(engine_replicas=2, address=f"127.0.0.1:{port}"))
    # the check's own message, at once: not Ray's minute of retries
    with pytest.raises(rlnb.ConfigError, match=rf"RayConfig.address='127.0.0.1:{port}' is invalid: nothing answers"):
        rlnb.Session(config, name="nowhere")
    assert not ray.is_initialized()


KERNEL_CELL = """
import rlnb
sess = rlnb.Session(rlnb.Config(
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    data=rlnb.DataConfig(num_workers=0),
    ray=rlnb.RayConfig(engine_replicas=2),
), name="ray-kernel")
sess.step()
"""

# A replica killed as notebook 07 kills one; the cell waits until Ray's raylet has
# reported the death (else as long as it took to come), so that it shows if printed.
KILL_CELL = """
import os, signal, time
os.kill(sess.statistics().engine.extra["replicas"][1]["pid"], signal.SIGKILL)
while sess.statistics().engine.extra["replicas"][1]["restarts"] == 0:
    sess.step()
deadline = time.monotonic() + 15.0
while not sess.statistics().engine.extra.get("reports") and time.monotonic() < deadline:
    time.sleep(0.1)
"""


def test_a_kernel_restart_leaves_no_ray_process_of_the_session(open_kernel: OpenKernel) -> None:
    with open_kernel() as (km, kc):
        ok(kc, KERNEL_CELL)
        # A killed replica shows in the cell as one line of rlnb's, with its log file:
        # not as the raylet's report (nine lines guessing at the OOM killer).
        shown = cell_output(kc, KILL_CELL)
        assert "(raylet)" not in shown and "OOM" not in shown, shown
        said = DIED.findall(shown)
        assert len(said) == 1 and said[0][0] == "1" and said[0][2] == "Ray: SYSTEM_ERROR", shown
        assert said[0][3].startswith("and was remade with weights v"), shown
        assert Path(said[0][4]).is_file() and said[0][4].endswith(f"-{said[0][1]}.err"), said
        assert km.provisioner is not None
        everyone = ray_processes(psutil.Process(km.provisioner.process.pid))
        assert len(everyone) >= 4, everyone  # GCS, raylet, two replicas (and Ray's agents)
        asked = time.monotonic()
        km.restart_kernel(now=False)  # rlnb's shutdown hook closes the session, and Ray with it
        wait_until(
            lambda: all(exited(p) for p in everyone),
            "every Ray process of the old kernel's session to exit",
            timeout=5.0,
        )
        print(f"Ray's processes gone {time.monotonic() - asked:.2f} s after the restart was asked for")

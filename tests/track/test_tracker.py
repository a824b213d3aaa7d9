"""The tracker finishes every run it starts, with the right exit code, whatever happens."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import pytest

import rlnb
from rlnb.track import EXIT_FAILURE, EXIT_OK, EXIT_SIGINT, EXIT_SIGTERM, Tracker, TrackerError, exit_code_for, read_run
from tests.helpers import Hooks, cause_chain, small_config, wait_until
from tests.helpers.kernel import OpenKernel, ok, stop_gracefully
from tests.helpers.processes import PythonProcesses

SMALL = small_config()


def tracked(run_dir: Path, backends: tuple[str, ...] = ("jsonl", "wandb")) -> rlnb.Config:
    return SMALL.replace(track=rlnb.TrackConfig(backends=backends, run_dir=str(run_dir)))


def jsonl(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wandb_run(run_dir: Path) -> rlnb.track.WandbRunFile:
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return read_run(files[0])


def test_a_normal_close_finishes_every_backend_with_exit_code_0(wandb_offline: Path) -> None:
    with rlnb.Session(tracked(wandb_offline), name="track") as sess:
        history = sess.train(2, progress=False)
        accuracy = sess.evaluate(20)
        run_id = sess.tracker.run_id
    records = jsonl(wandb_offline)
    assert records[0] == {"event": "start", "run_id": run_id, "time": records[0]["time"]}
    assert [r["step"] for r in records if "reward_mean" in r] == [1, 2]
    assert records[-2] == {"step": 2, "eval_accuracy": accuracy, "eval_seconds": records[-2]["eval_seconds"]}
    assert 0 < records[-2]["eval_seconds"] < 60  # what the evaluation cost, in seconds
    assert records[-1]["event"] == "finish" and records[-1]["exit_code"] == EXIT_OK
    run = wandb_run(wandb_offline)
    assert run.run_id == run_id and run.exit_code == EXIT_OK
    steps = [h for h in run.history if "reward_mean" in h]
    assert [h["_step"] for h in steps] == [1, 2]
    assert [h["reward_mean"] for h in steps] == pytest.approx([m["reward_mean"] for m in history])
    assert run.summary["eval_accuracy"] == accuracy
    assert run.config["learn"]["lr"] == SMALL.learn.lr  # the session's config goes with the run


@pytest.mark.parametrize(("error", "code"), [(RuntimeError, EXIT_FAILURE), (KeyboardInterrupt, EXIT_SIGINT)])
def test_an_error_or_interrupt_inside_train_is_the_runs_exit_code(
    wandb_offline: Path, error: type[BaseException], code: int
) -> None:
    hooks = Hooks()
    with pytest.raises(error):
        with rlnb.Session(tracked(wandb_offline), name="track", callbacks=[hooks]) as sess:
            sess.train(1, progress=False)
            hooks.batch = lambda groups: (_ for _ in ()).throw(error("in the update"))
            sess.train(2, progress=False)
    assert jsonl(wandb_offline)[-1]["exit_code"] == code
    run = wandb_run(wandb_offline)
    assert run.exit_code == code
    assert [h["_step"] for h in run.history if "reward_mean" in h] == [1]  # what was logged is kept


def test_close_after_a_background_failure_no_call_raised_reports_1_and_raises_it(tmp_path: Path) -> None:
    sess = rlnb.Session(tracked(tmp_path, ("jsonl",)), name="track")
    sess.rollouts.set_reward(lambda completion, answer: 1 / 0)
    sess.rollouts.start()
    wait_until(lambda: sess.statistics(raise_errors=False).rollout.groups_failed > 0, "a group to fail")
    with pytest.raises(rlnb.RolloutError, match="background rollout") as raised:
        sess.close()
    assert any(isinstance(e, ZeroDivisionError) for e in cause_chain(raised.value))
    assert sess.closed and jsonl(tmp_path)[-1]["exit_code"] == EXIT_FAILURE
    sess.close()  # raised once: closing again is a no-op


def test_close_after_a_failed_background_run_reports_1_and_raises_it(tmp_path: Path) -> None:
    hooks = Hooks()
    sess = rlnb.Session(tracked(tmp_path, ("jsonl",)), name="track", callbacks=[hooks])
    hooks.batch = lambda groups: (_ for _ in ()).throw(RuntimeError("in the update"))
    sess.training.start(2)
    wait_until(lambda: not sess.training.running, "the background run to fail")
    with pytest.raises(rlnb.TrainingError) as raised:
        sess.close()
    assert any("in the update" in str(e) for e in cause_chain(raised.value))
    assert jsonl(tmp_path)[-1]["exit_code"] == EXIT_FAILURE


def test_a_script_that_dies_of_an_uncaught_error_finishes_its_run_with_1(
    tmp_path: Path, start_python: PythonProcesses
) -> None:
    script = (
        "import rlnb\n"
        f"config = rlnb.Config(track=rlnb.TrackConfig(backends=('jsonl',), run_dir={str(tmp_path)!r}))\n"
        "sess = rlnb.Session(config, name='script')\n"
        "raise RuntimeError('the script crashed')\n"
    )
    done = start_python("-c", script)
    _, err = done.communicate(timeout=120)
    assert done.returncode == 1 and "the script crashed" in err
    assert jsonl(tmp_path)[-1]["exit_code"] == EXIT_FAILURE


class Failing:
    """A backend that fails at everything."""

    name = "failing"

    def __init__(self) -> None:
        self.finish_calls = 0

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        raise OSError("disk full, say")

    def finish(self, exit_code: int) -> None:
        self.finish_calls += 1
        raise SystemExit("wandb's way of failing")  # guarded like any other failure


def test_a_failing_backend_never_stops_another_and_is_reported(tmp_path: Path) -> None:
    failing = Failing()
    tracker = Tracker(rlnb.TrackConfig(backends=("jsonl",), run_dir=str(tmp_path)), extra_backends=[failing])
    with pytest.warns(RuntimeWarning, match="'failing' failed to log"):
        tracker.log({"reward_mean": 0.5}, step=1)
    tracker.log({"reward_mean": 0.6}, step=2)  # warned once only (warnings are errors here)
    with pytest.raises(TrackerError, match=r"failing \(SystemExit"):
        tracker.finish(EXIT_OK)
    tracker.finish(EXIT_OK)  # idempotent: nothing runs twice
    assert failing.finish_calls == 1
    records = jsonl(tmp_path)
    assert [r.get("reward_mean") for r in records[1:3]] == [0.5, 0.6]
    assert records[-1]["event"] == "finish" and records[-1]["exit_code"] == EXIT_OK


def test_bad_tracker_input_is_refused_before_any_backend_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(rlnb.ConfigError, match=r"TrackConfig.backends=.*unknown backend\(s\) \[.tensorboard.\]"):
        rlnb.TrackConfig(backends=("jsonl", "tensorboard"), run_dir=str(tmp_path))
    with pytest.raises(rlnb.ConfigError, match=r"TrackConfig.run_dir=None .*give a directory"):
        rlnb.TrackConfig(backends=("wandb",))
    with pytest.raises(rlnb.ConfigError, match=r"Tracker\(config=\['jsonl'\]\) takes a rlnb.TrackConfig"):
        Tracker(["jsonl"])  # type: ignore[arg-type]  # the settings come as a TrackConfig
    with pytest.raises(rlnb.ConfigError, match=r"Tracker\(extra_backends=\[\.\.\., 'jsonl', \.\.\.\]\).*TrackConfig"):
        Tracker(rlnb.TrackConfig(run_dir=str(tmp_path)), extra_backends=["jsonl"])  # type: ignore[list-item]
    with pytest.raises(rlnb.ConfigError, match=r"TrackConfig\.run_dir=None is invalid"):
        rlnb.TrackConfig(backends=("jsonl",))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    with pytest.raises(rlnb.ConfigError, match="'online' needs a wandb API key"):
        rlnb.TrackConfig(backends=("wandb",), run_dir=str(tmp_path), wandb_mode="online")
    assert list(tmp_path.iterdir()) == []  # nothing was written


def test_exit_codes() -> None:
    assert exit_code_for(None) == EXIT_OK
    assert exit_code_for(ValueError()) == EXIT_FAILURE
    assert exit_code_for(KeyboardInterrupt()) == EXIT_SIGINT
    assert exit_code_for(SystemExit(3)) == 3 and exit_code_for(SystemExit()) == EXIT_OK


def test_recreating_a_session_finishes_its_run_first(tmp_path: Path) -> None:
    first = rlnb.Session(tracked(tmp_path / "a", ("jsonl",)), name="again")
    first.step()
    second = rlnb.Session(tracked(tmp_path / "b", ("jsonl",)), name="again")
    try:
        assert jsonl(tmp_path / "a")[-1]["event"] == "finish"
        assert first.tracker.finished and not second.tracker.finished
    finally:
        second.close()


def test_a_loaded_checkpoint_resumes_the_same_run(tmp_path: Path) -> None:
    with rlnb.Session(tracked(tmp_path / "run", ("jsonl",)), name="ckpt") as sess:
        sess.step()
        sess.save(tmp_path / "ckpt")
        run_id = sess.tracker.run_id
    with rlnb.Session.load(tmp_path / "ckpt", name="ckpt") as sess:
        assert sess.tracker.run_id == run_id
        sess.step()
    starts = [r for r in jsonl(tmp_path / "run") if r.get("event") == "start"]
    assert [r["run_id"] for r in starts] == [run_id, run_id]
    assert [r["step"] for r in jsonl(tmp_path / "run") if "reward_mean" in r] == [1, 2]


def test_the_plot_backend_draws_a_png_for_a_widget_and_the_run_dir(tmp_path: Path) -> None:
    tracker = Tracker(rlnb.TrackConfig(backends=("plot",), run_dir=str(tmp_path)))
    plot: Any = tracker.backend("plot")
    widget = plot.widget
    for step in range(1, 4):
        tracker.log({"reward_mean": step / 10, "eval_accuracy": step / 5}, step=step)
    drawn = threading.Thread(target=tracker.log, args=({"reward_mean": 0.5}, 4))  # from any thread
    drawn.start()
    drawn.join()
    tracker.finish()
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert widget.value == png
    assert [s for s, _ in plot.series["reward_mean"]] == [1, 2, 3, 4]
    widget.close()


def test_evaluations_at_one_step_are_one_point_on_the_curve_and_the_earlier_a_hollow_marker(tmp_path: Path) -> None:
    from rlnb.track._backends import PlotBackend

    plot = PlotBackend(tmp_path / "curves.png")
    plot.log({"eval_accuracy": 0.0}, 0)  # the initial policy
    plot.log({"eval_accuracy": 0.3}, 0)  # after the warm-up: still version 0
    for step in (1, 2):
        plot.log({"reward_mean": 0.2 * step}, step)
    plot.log({"eval_accuracy": 0.5}, 2)
    lines = plot.figure().axes[0].get_lines()
    curve = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in lines}
    assert curve["held-out accuracy"] == ([0, 2], [0.3, 0.5])  # no vertical jump at step 0
    assert curve["train reward"] == ([1, 2], [0.2, 0.4])
    (marker,) = [line for line in lines if line.get_label().startswith("_")]  # not in the legend
    assert (list(marker.get_xdata()), list(marker.get_ydata())) == ([0], [0.0])
    assert marker.get_markerfacecolor() == "none" and marker.get_linestyle() == "None"
    plot.finish(0)


def test_a_slow_plot_is_redrawn_less_often_so_drawing_stays_a_small_share_of_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlnb.track._backends import PlotBackend

    plot = PlotBackend(tmp_path / "curves.png", min_interval=0.0)
    renders: list[float] = []

    def slow_render() -> bytes:  # a long run's figure: 0.1 s to draw
        renders.append(time.monotonic())
        time.sleep(0.1)
        return b"png"

    monkeypatch.setattr(plot, "render", slow_render)
    for step in range(10):  # well within the 20 x 0.1 s the first draw earns
        plot.log({"reward_mean": 0.5}, step)
    assert len(renders) == 1
    plot.finish(0)  # the last curves are always drawn
    assert len(renders) == 2 and (tmp_path / "curves.png").read_bytes() == b"png"


def test_sigterm_to_rlnb_train_finishes_the_run_with_143(tmp_path: Path, start_python: PythonProcesses) -> None:
    run_dir = tmp_path / "run"
    proc = start_python(
        "-m", "rlnb", "train", "--steps", "100000", "--run-dir", str(run_dir), "--warmup-steps", "0",
        "--eval-every", "1000", "--tracker", "jsonl,wandb", "--no-progress", "--num-workers", "1",
        stdout=subprocess.DEVNULL,
    )  # fmt: skip

    def logged_a_step() -> bool:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        return any("reward_mean" in line for line in _lines(run_dir / "metrics.jsonl"))

    wait_until(logged_a_step, "training to log a step", 120, every=0.1)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM  # it still dies by SIGTERM, after closing
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"children outlived the script: {alive}"
    assert jsonl(run_dir)[-1]["exit_code"] == EXIT_SIGTERM
    run = wandb_run(run_dir)
    assert run.exit_code == EXIT_SIGTERM and any("reward_mean" in h for h in run.history)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


KERNEL_SETUP = """
import logging, os, sys
import rlnb
handler = logging.FileHandler({log!r})
handler.setFormatter(logging.Formatter("%(created).6f %(levelname)s %(message)s"))
logging.getLogger("rlnb").addHandler(handler)
logging.getLogger("rlnb").setLevel(logging.INFO)
config = rlnb.Config(
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
    track=rlnb.TrackConfig(backends=("jsonl", "wandb"), run_dir={run_dir!r}),
)
sess = rlnb.Session(config, name="k")
sess.train(2, progress=False)
print(os.getpid(), sys.executable, rlnb.__file__, sep="\\n")
"""


@pytest.mark.slow
def test_a_kernel_restart_finishes_the_run_with_130(tmp_path: Path, open_kernel: OpenKernel) -> None:
    log_file, run_dir = tmp_path / "rlnb.log", tmp_path / "run"
    with open_kernel() as (km, kc):
        ok(kc, KERNEL_SETUP.format(log=str(log_file), run_dir=str(run_dir)))
        stop_gracefully(km, log_file, restart=True)  # the old kernel exited by itself
    assert jsonl(run_dir)[-1]["exit_code"] == EXIT_SIGINT
    run = wandb_run(run_dir)
    assert run.exit_code == EXIT_SIGINT
    assert [h["_step"] for h in run.history if "reward_mean" in h] == [1, 2]

"""A run dir is one run's: a session refuses the run dir of another live session
(both appended to one ``metrics.jsonl``, wandb dir and ``curves.png``), and what an
earlier run left there is kept beside the new run's files, never appended to,
replaced or deleted (``rlnb train`` deleted an earlier ``metrics.jsonl``, a plot
replaced an earlier ``curves.png``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

import rlnb
from rlnb.cli import main
from rlnb.probe import snapshot
from rlnb.track import Tracker
from tests.helpers import small_config


def tracked(run_dir: Path, backends: tuple[str, ...] = ("jsonl", "plot")) -> rlnb.Config:
    return small_config(track=rlnb.TrackConfig(backends=backends, run_dir=str(run_dir)))


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_session_refuses_the_run_dir_of_another_live_session(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    with rlnb.Session(tracked(run_dir), name="a") as a:
        a.step()
        written = (run_dir / "metrics.jsonl").read_text()
        a.save(tmp_path / "ckpt")
        before = snapshot()
        message = re.escape(
            f"Session(name='b'): TrackConfig.run_dir={str(run_dir)!r} is the run dir of the live session 'a', and "
            "two sessions in one run dir write one metrics.jsonl, curves.png and wandb dir between them; nothing was "
            f"built or closed: give this session a run dir of its own, e.g. run_dir={str(run_dir) + '-b'!r}, or "
            "close session 'a' first"
        )
        with pytest.raises(rlnb.ConfigError, match=message):  # it shared the run dir
            rlnb.Session(tracked(run_dir), name="b")
        with pytest.raises(rlnb.ConfigError, match="is the run dir of the live session 'a'"):  # another spelling
            rlnb.Session(tracked(tmp_path / "." / "run" / ".." / "run", ("console",)), name="b")
        with pytest.raises(rlnb.ConfigError, match="is the run dir of the live session 'a'"):  # its checkpoint
            rlnb.Session.load(tmp_path / "ckpt", name="b")
        capsys.readouterr()
        status = main(["train", "--task", "addition", "--steps", "1", "--run-dir", str(run_dir), "--no-progress"])
        assert status == 2  # rlnb train in the same process: it deleted a's metrics.jsonl first
        assert "rlnb train: error: Session(name='run'): TrackConfig.run_dir=" in capsys.readouterr().err
        assert snapshot().new_since(before) == {}
        assert [s.name for s in rlnb.sessions()] == ["a"] and not a.closed
        assert (run_dir / "metrics.jsonl").read_text() == written and (run_dir / "curves.png").is_file()
        assert sorted(p.name for p in run_dir.iterdir()) == ["curves.png", "metrics.jsonl"]
        a.step()  # a goes on as it was
    again = rlnb.Session(tracked(run_dir), name="again")  # closed: its run dir is free
    again.close()


def test_the_cell_that_made_a_session_can_run_again_with_its_run_dir(tmp_path: Path) -> None:
    first = rlnb.Session(tracked(tmp_path), name="cell")
    first.step()
    second = rlnb.Session(tracked(tmp_path), name="cell")  # re-running the cell: the first is replaced
    try:
        assert first.closed and not second.closed
        second.step()
    finally:
        second.close()
    kept = records(tmp_path / f"metrics-{first.tracker.run_id}.jsonl")
    assert [r.get("run_id") for r in kept if r.get("event") == "start"] == [first.tracker.run_id]
    assert kept[-1]["event"] == "finish" and [r["step"] for r in kept if "reward_mean" in r] == [1]
    own = records(tmp_path / "metrics.jsonl")
    assert [r.get("run_id") for r in own if r.get("event") == "start"] == [second.tracker.run_id]


def test_what_an_earlier_run_left_in_the_run_dir_is_kept(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier = '{"event": "start", "run_id": "earlier1", "time": 1.0}\n{"step": 1, "reward_mean": 0.25}\n'
    (run_dir / "metrics.jsonl").write_text(earlier)
    with Tracker(rlnb.TrackConfig(backends=("plot",), run_dir=str(run_dir), run_id="plotted1")) as plot_run:
        plot_run.log({"reward_mean": 0.5}, step=1)
    png = (run_dir / "curves.png").read_bytes()
    (run_dir / "notes.md").write_text("mine")
    with rlnb.Session(tracked(run_dir), name="next") as sess:
        sess.step()
        run_id = sess.tracker.run_id
    # the earlier records and curves, as they were, beside this run's own
    assert (run_dir / "metrics-earlier1.jsonl").read_text() == earlier  # it was appended to
    assert (run_dir / "curves-plotted1.png").read_bytes() == png  # it was replaced
    assert (run_dir / "notes.md").read_text() == "mine"
    own = records(run_dir / "metrics.jsonl")
    assert own[0]["run_id"] == run_id and [r["step"] for r in own if "reward_mean" in r] == [1]
    # a file of rlnb's name that rlnb cannot name a run of, and a name already taken
    (run_dir / "metrics.jsonl").write_text("my own notes\n")
    (run_dir / "curves.png").write_bytes(b"not a png")
    (run_dir / "metrics-earlier.jsonl").write_text("taken\n")
    with Tracker(rlnb.TrackConfig(backends=("jsonl", "plot"), run_dir=str(run_dir))) as tracker:
        tracker.log({"reward_mean": 1.0}, step=1)
    assert (run_dir / "metrics-earlier-2.jsonl").read_text() == "my own notes\n"
    assert (run_dir / "metrics-earlier.jsonl").read_text() == "taken\n"
    assert (run_dir / "curves-earlier.png").read_bytes() == b"not a png"
    assert records(run_dir / "metrics.jsonl")[0]["run_id"] == tracker.run_id


def test_rlnb_train_keeps_an_earlier_runs_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier = '{"event": "start", "run_id": "earlier1", "time": 1.0}\n{"step": 1, "reward_mean": 0.25}\n'
    (run_dir / "metrics.jsonl").write_text(earlier)
    argv = ["train", "--task", "sort", "--steps", "1", "--warmup-steps", "0", "--group-size", "2",
            "--groups-per-step", "2", "--eval-prompts", "2", "--num-workers", "0", "--tracker", "jsonl",
            "--run-dir", str(run_dir), "--quiet"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr()
    assert (run_dir / "metrics-earlier1.jsonl").read_text() == earlier  # it was deleted
    own = records(run_dir / "metrics.jsonl")
    assert own[0]["event"] == "start" and own[0]["run_id"] != "earlier1"
    assert [r["step"] for r in own if "reward_mean" in r] == [1]  # this run's records only

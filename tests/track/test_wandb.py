"""The wandb backend makes its run at the first log: a session that logs nothing
(a cell run again before it trained) leaves no empty run behind."""

from __future__ import annotations

from pathlib import Path

import rlnb
from rlnb.track import read_run
from tests.helpers import small_config

SMALL = small_config()


def runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_rerunning_a_session_cell_makes_one_run_the_one_that_logged(wandb_offline: Path) -> None:
    config = SMALL.replace(track=rlnb.TrackConfig(backends=("wandb",), run_dir=str(wandb_offline)))
    first = rlnb.Session(config, name="cell")
    assert not first.tracker.backend("wandb").started  # type: ignore[attr-defined]
    second = rlnb.Session(config, name="cell")  # the cell run again: the first closes, having logged nothing
    assert first.closed and runs(wandb_offline) == []
    with second:
        second.step()
        run_id = second.tracker.run_id
    (path,) = runs(wandb_offline)
    run = read_run(path)
    assert run.run_id == run_id and run.exit_code == 0
    assert [h["_step"] for h in run.history if "reward_mean" in h] == [1]


def test_a_session_that_never_logs_leaves_no_run(tmp_path: Path) -> None:
    config = SMALL.replace(track=rlnb.TrackConfig(backends=("jsonl", "wandb"), run_dir=str(tmp_path)))
    with rlnb.Session(config, name="quiet") as sess:
        sess.rollout(1)
    assert runs(tmp_path) == [] and not (tmp_path / "wandb").exists()

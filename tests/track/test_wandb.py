"""The wandb backend makes its run at the first log: a session that logs nothing
(a cell run again before it trained) leaves no empty run behind."""

from __future__ import annotations

from pathlib import Path

import rlnb
from rlnb.track import read_run

SMALL = rlnb.Config(
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
    data=rlnb.DataConfig(num_workers=0),
)


def runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_rerunning_a_session_cell_makes_one_run_the_one_that_logged(tmp_path: Path) -> None:
    config = SMALL.replace(track=rlnb.TrackConfig(backends=("wandb",), run_dir=str(tmp_path)))
    first = rlnb.Session(config, name="cell")
    assert not first.tracker.backend("wandb").started  # type: ignore[attr-defined]
    second = rlnb.Session(config, name="cell")  # the cell run again: the first closes, having logged nothing
    assert first.closed and runs(tmp_path) == []
    with second:
        second.step()
        run_id = second.tracker.run_id
    (path,) = runs(tmp_path)
    run = read_run(path)
    assert run.run_id == run_id and run.exit_code == 0
    assert [h["_step"] for h in run.history if "reward_mean" in h] == [1]


def test_a_session_that_never_logs_leaves_no_run(tmp_path: Path) -> None:
    config = SMALL.replace(track=rlnb.TrackConfig(backends=("jsonl", "wandb"), run_dir=str(tmp_path)))
    with rlnb.Session(config, name="quiet") as sess:
        sess.rollout(1)
    assert runs(tmp_path) == [] and not (tmp_path / "wandb").exists()

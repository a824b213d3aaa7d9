"""Saving into a directory: missing parents are made, and a path that cannot be
written gets an error that names what is wrong and what to do about it."""

from __future__ import annotations

import errno
import pathlib
from pathlib import Path
from typing import Any

import pytest

import rlnb
from rlnb._files import write_error

CONFIG = rlnb.Config(
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=2),
    data=rlnb.DataConfig(num_workers=0),
)


def refuse_mkdir_under(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Making a directory under ``root`` fails as it does for a user who may not write there."""
    real = pathlib.Path.mkdir

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.is_relative_to(root) and not self.exists():
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)


def test_the_message_says_what_is_wrong_and_only_a_full_disk_asks_for_space(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("a file")
    missing = tmp_path / "nonexistent" / "dir" / "ckpt"
    denied = PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "nonexistent"))
    cases = {
        "missing": write_error(denied, "a checkpoint", missing),
        "a file in the way": write_error(
            NotADirectoryError(errno.ENOTDIR, "Not a directory", str(tmp_path / "notes.txt" / "sub")),
            "a checkpoint",
            tmp_path / "notes.txt" / "sub" / "ckpt",
        ),
        "full": write_error(OSError(errno.ENOSPC, "No space left on device"), "a checkpoint", tmp_path / "ckpt"),
        "denied": write_error(PermissionError(errno.EACCES, "Permission denied"), "the model", tmp_path / "out"),
    }
    assert cases["missing"] == (
        f"cannot save a checkpoint to {missing}: its directory {missing.parent} does not exist and cannot be made "
        f"({denied}); nothing there was changed: choose a path you can write to (or make {missing.parent} first), "
        "and save again"
    )
    assert f"{tmp_path / 'notes.txt'} is a file, not a directory" in cases["a file in the way"]
    assert "No space left on device" in cases["full"]
    assert "free some space" in cases["full"]
    assert "Permission denied" in cases["denied"] and "choose a path you can write to" in cases["denied"]
    assert ["free some space" in m for m in cases.values()] == [False, False, True, False]


def test_save_makes_missing_parent_directories(tmp_path: Path) -> None:
    with rlnb.Session(CONFIG, name="save-parents") as sess:
        saved = sess.save(tmp_path / "nonexistent" / "dir" / "ckpt")
    assert saved == tmp_path / "nonexistent" / "dir" / "ckpt"
    assert (saved / "checkpoint.json").is_file()
    with rlnb.Session.load(saved, name="save-parents") as again:
        assert again.version == 0


def test_save_where_a_missing_directory_cannot_be_made_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "nonexistent" / "dir" / "ckpt"
    with rlnb.Session(CONFIG, name="save-denied") as sess:
        refuse_mkdir_under(tmp_path, monkeypatch)
        with pytest.raises(rlnb.CheckpointError) as info:
            sess.save(target)
    message = str(info.value)
    assert message.startswith(f"cannot save a checkpoint to {target}: its directory {target.parent} does not exist")
    assert "Permission denied" in message and f"make {target.parent} first" in message
    assert "free some space" not in message
    assert list(tmp_path.iterdir()) == []


def test_save_pretrained_makes_missing_parents_and_says_why_a_path_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers", reason="the 'hf' extra (transformers) is not installed")
    from rlnb.models import tiny_llama

    model = tiny_llama(tmp_path / "models" / "tiny-llama", seed=0)
    config = CONFIG.replace(model=rlnb.ModelConfig(path=str(model), max_len=32))
    with rlnb.Session(config, name="export-parents") as sess:
        out = sess.save_pretrained(tmp_path / "exports" / "new" / "model")
        assert (out / "config.json").is_file()
        (tmp_path / "a-file").write_text("keep me")
        with pytest.raises(OSError, match=r"a-file is a file, not a directory.*write to"):
            sess.save_pretrained(tmp_path / "a-file" / "model")
        refuse_mkdir_under(tmp_path / "denied", monkeypatch)
        with pytest.raises(PermissionError) as info:
            sess.save_pretrained(tmp_path / "denied" / "model")
    message = str(info.value)
    assert f"its directory {tmp_path / 'denied'} does not exist and cannot be made" in message
    assert "free some space" not in message
    assert (tmp_path / "a-file").read_text() == "keep me"

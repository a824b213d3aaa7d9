"""Saving into a directory: missing parents are made, a path that cannot be written
gets an error that names what is wrong and what to do about it, a directory holding
anything rlnb did not write is refused, and what a killed save left is cleaned up."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pathlib
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import rlnb
import rlnb._files
from rlnb._files import write_error
from tests.helpers import small_config

CONFIG = small_config(rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=2))


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
        with pytest.raises(rlnb.CheckpointError, match=r"a-file is a file, not a directory.*write to"):
            sess.save_pretrained(tmp_path / "a-file" / "model")
        refuse_mkdir_under(tmp_path / "denied", monkeypatch)
        with pytest.raises(rlnb.CheckpointError) as info:
            sess.save_pretrained(tmp_path / "denied" / "model")
    message = str(info.value)
    assert f"its directory {tmp_path / 'denied'} does not exist and cannot be made" in message
    assert "free some space" not in message
    assert (tmp_path / "a-file").read_text() == "keep me"


# -- saving never removes a file rlnb did not write ----------------------------------------


def files_under(root: Path) -> dict[str, bytes]:
    """Every file below ``root`` (hidden ones too) and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    pytest.importorskip("transformers", reason="the 'hf' extra (transformers) is not installed")
    from rlnb.models import tiny_llama

    return tiny_llama(tmp_path / "models" / "tiny-llama", seed=0)


def test_save_pretrained_never_removes_a_file_it_did_not_write(
    tmp_path: Path, llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "train.jsonl").write_text('{"prompt": "1+1="}\n')
    (project / "analysis.ipynb").write_text("{}")
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("a private key")
    monkeypatch.setenv("HOME", str(home))
    mine = tmp_path / "models" / "mine"  # a model rlnb saved, with the user's notes
    shutil.copytree(llama, mine)
    (mine / "NOTES.md").write_text("what this model is for")
    (tmp_path / "empty").mkdir()
    before = files_under(tmp_path)
    config = CONFIG.replace(model=rlnb.ModelConfig(path=str(llama), max_len=32))
    with rlnb.Session(config, name="export-safe") as sess:
        refused: list[tuple[str | Path, str]] = [
            (project, "it is a non-empty directory that holds no model rlnb saved"),
            ("~", "holds no model rlnb saved"),
            (mine, "it holds a model rlnb saved, but also 'NOTES.md', which a save would lose"),
        ]
        for where, words in refused:
            with pytest.raises(rlnb.CheckpointError, match=re.escape(words)) as info:
                sess.save_pretrained(where)
            assert "nothing there was changed" in str(info.value) and "new or empty directory" in str(info.value)
        for cwd in (project, tmp_path / "empty"):
            monkeypatch.chdir(cwd)
            with pytest.raises(rlnb.CheckpointError, match="it is the current directory"):
                sess.save_pretrained(".")
            assert Path.cwd() == cwd and Path(".").resolve() == cwd  # still there, still the one it was
        with pytest.raises(rlnb.CheckpointError, match="it holds the current directory"):
            sess.save_pretrained(tmp_path)
    assert files_under(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "home", "models", "project"]  # no staging left


def test_no_save_replaces_what_a_live_session_reads_or_writes(tmp_path: Path, llama: Path) -> None:
    """Its base model (rlnb wrote it, with a marker: it used to be replaced by the
    adapter, and the run's checkpoint no longer loaded), a directory holding it, its
    run dir; refused by every save before anything is written. Inside the run dir is fine."""
    from rlnb.models import HFPolicy, tiny_llama

    before = files_under(llama)
    run_dir = tmp_path / "run"
    config = CONFIG.replace(
        model=rlnb.ModelConfig(path=str(llama), max_len=32, lora=rlnb.LoraConfig(r=4, alpha=8)),
        track=rlnb.TrackConfig(backends=("jsonl",), run_dir=str(run_dir)),
    )
    base = re.escape(
        f"cannot save the model to {llama}: it is the base model (ModelConfig.path) of the live session 'lora'"
    )
    with rlnb.Session(config, name="lora") as sess:
        sess.step()
        checkpoint = sess.save(run_dir / "ckpt")  # inside its run dir: a directory of its own
        for save in (
            lambda: sess.save_pretrained(llama, adapter_only=True),
            lambda: sess.save_pretrained(llama),
            lambda: HFPolicy.save_pretrained(sess.policy, llama, adapter_only=True),  # type: ignore[arg-type]
            lambda: tiny_llama(llama, seed=1),
        ):
            with pytest.raises(rlnb.CheckpointError, match=base + ".*nothing there was changed"):
                save()
        with pytest.raises(rlnb.CheckpointError, match=re.escape(f"it holds {llama}, which is the base model")):
            sess.save_pretrained(llama.parent)
        with pytest.raises(
            rlnb.CheckpointError, match=re.escape(f"{run_dir}: it is the run dir (TrackConfig.run_dir)")
        ):
            sess.save(run_dir)
        with pytest.raises(rlnb.CheckpointError, match="it is the base model"):
            sess.tokenizer.save_pretrained(llama)
        with rlnb.Session(small_config(), name="other") as other:  # another session's inputs are as safe
            with pytest.raises(rlnb.CheckpointError, match=re.escape(f"{run_dir}: it is the run dir") + ".*'lora'"):
                other.save(run_dir)
        for flag in ("yes", 1, None):
            with pytest.raises(rlnb.ConfigError, match=re.escape(f"save_pretrained(adapter_only={flag!r}) is invalid")):
                sess.save_pretrained(tmp_path / "adapter", adapter_only=flag)  # type: ignore[arg-type]
        assert not (tmp_path / "adapter").exists()
        sess.save_pretrained(tmp_path / "adapter", adapter_only=True)
    assert files_under(llama) == before
    with rlnb.Session.load(checkpoint, name="lora") as loaded:  # the base model the adapter needs is there
        assert loaded.step()["version"] == 2
    tiny_llama(llama, seed=1)  # no live session reads it now: rlnb's own model, replaced


def test_save_pretrained_replaces_only_a_model_it_wrote_unchanged(tmp_path: Path, llama: Path) -> None:
    config = CONFIG.replace(model=rlnb.ModelConfig(path=str(llama), max_len=32))
    with rlnb.Session(config, name="export-again") as sess:
        out = sess.save_pretrained(tmp_path / "export")
        written = json.loads((out / "rlnb.json").read_text())["files"]
        assert sorted(p.name for p in out.iterdir()) == sorted(["rlnb.json", *written])
        assert "model.safetensors" in written and "tokenizer.json" in written
        sess.step()
        assert sess.save_pretrained(out) == out  # its own, unchanged: replaced whole
        (out / "README.md").write_text("# my model card")
        with pytest.raises(rlnb.CheckpointError, match=r"but also 'README.md', which a save would lose"):
            sess.save_pretrained(out)
        assert (out / "README.md").read_text() == "# my model card"
        (out / "README.md").unlink()
        edited = (out / "generation_config.json").read_text().replace("}", ', "temperature": 0.7}', 1)
        (out / "generation_config.json").write_text(edited)
        with pytest.raises(rlnb.CheckpointError, match=r"'generation_config.json' \(changed since rlnb wrote it\)"):
            sess.save_pretrained(out)
        assert (out / "generation_config.json").read_text() == edited
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask  # not private to its writer, as mkdtemp made it
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o666 & ~umask}


def test_save_never_replaces_a_directory_holding_more_than_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (tmp_path / "empty").mkdir()
    with rlnb.Session(CONFIG, name="save-safe") as sess:
        saved = sess.save("~/ckpt")  # ~ is expanded, as save_pretrained does
        assert saved == home / "ckpt" and (saved / "checkpoint.json").is_file()
        (saved / "notes.txt").write_text("keep me")
        (saved / "plots").mkdir()
        with pytest.raises(rlnb.CheckpointError, match=r"holds a checkpoint, but also 'notes.txt', 'plots/'"):
            sess.save(saved)
        monkeypatch.chdir(tmp_path / "empty")
        with pytest.raises(rlnb.CheckpointError, match="it is the current directory"):
            sess.save(".")
        assert Path.cwd() == tmp_path / "empty"
    assert (saved / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "empty" / "~").exists()
    with rlnb.Session.load("~/ckpt", name="save-safe") as sess:  # and loads from ~ too
        assert sess.version == 0


def test_saving_to_a_symlink_saves_into_the_directory_it_names(tmp_path: Path) -> None:
    (tmp_path / "disk").mkdir()
    (tmp_path / "ckpt").symlink_to(tmp_path / "disk" / "ckpt")  # not there yet
    with rlnb.Session(CONFIG, name="save-link") as sess:
        assert sess.save(tmp_path / "ckpt") == tmp_path / "disk" / "ckpt"
        sess.step()
        sess.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt").is_symlink() and (tmp_path / "ckpt" / "checkpoint.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "disk"]
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["ckpt"]
    with rlnb.Session.load(tmp_path / "ckpt", name="save-link") as sess:
        assert sess.version == 1


def test_tiny_policy_save_never_replaces_another_models_files(tmp_path: Path) -> None:
    from rlnb.models import TinyPolicy

    policy = TinyPolicy(rlnb.ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2), seed=0)
    hf = tmp_path / "hf-model"  # config.json and model.safetensors, but another program's
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (hf / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(rlnb.CheckpointError, match="it is a non-empty directory that holds no TinyPolicy"):
        policy.save(hf)
    assert files_under(hf) == {
        "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
        "model.safetensors": b"weights",
    }
    policy.save(tmp_path / "policy")
    policy.save(tmp_path / "policy")  # its own: replaced
    (tmp_path / "policy" / "notes.txt").write_text("keep me")
    with pytest.raises(rlnb.CheckpointError, match=r"but also 'notes\.txt'"):
        policy.save(tmp_path / "policy")
    assert TinyPolicy.load(tmp_path / "policy").seed == 0


def test_tiny_llama_never_writes_among_other_files(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the 'hf' extra (transformers) is not installed")
    from rlnb.models import tiny_llama

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    with pytest.raises(rlnb.CheckpointError, match="it is a non-empty directory that holds no model rlnb saved"):
        tiny_llama(tmp_path / "mine")
    assert files_under(tmp_path) == {"mine/config.json": b"{}"}


# -- what a killed save left ---------------------------------------------------------------


@contextlib.contextmanager
def held_lock(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s lock as a live save holds its staging directory's."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def test_the_next_save_or_load_removes_what_a_killed_save_left_and_nothing_else(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    with rlnb.Session(CONFIG, name="leftovers") as sess:
        sess.save(ckpt)
        dead, live = tmp_path / ".ckpt.rlnb-k1ll3d00", tmp_path / ".ckpt.rlnb-l1ve0000"
        for leftover in (dead, live):  # as a save killed while writing leaves its staging directory
            leftover.mkdir()
            (leftover / "model.safetensors").write_bytes(b"half")
        for user in (".ckpt.backup", ".ckpt.rlnb-mine", "ckpt.rlnb-k1ll3d01", ".other.rlnb-k1ll3d02"):
            (tmp_path / user).mkdir()  # names rlnb does not give its staging directories of ckpt
        with held_lock(live):
            with rlnb.Session.load(ckpt, name="leftovers-loaded"):
                pass
            assert not dead.exists() and live.exists()  # a live save's is left alone
        sess.save(ckpt)
        assert not live.exists()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".ckpt.backup", ".ckpt.rlnb-mine", ".other.rlnb-k1ll3d02", "ckpt", "ckpt.rlnb-k1ll3d01"]


def test_a_save_by_renames_killed_between_them_is_put_back_by_the_next_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the system cannot swap two directories in one step, the old one is renamed
    aside and the new one into place: a kill in between leaves no checkpoint at the path."""
    monkeypatch.setattr(rlnb._files, "_exchange", lambda a, b: False)
    ckpt = tmp_path / "ckpt"
    with rlnb.Session(CONFIG, name="renames") as sess:
        sess.save(ckpt)
        sess.save(ckpt)  # by renames
        ckpt.rename(tmp_path / ".ckpt.old")  # what a kill between the renames leaves
        (tmp_path / ".ckpt.rlnb-n3wn3w00").mkdir()  # and the new one, not yet moved in
    with rlnb.Session.load(ckpt, name="renames") as sess:
        assert sess.version == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_full_disk_while_safetensors_or_transformers_write_is_a_checkpoint_error(
    tmp_path: Path, llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Simulated here (tests/test_faults.py fills a real tmpfs where it may mount one)."""
    from safetensors import SafetensorError

    from rlnb.models import HFPolicy

    def full(*args: Any, **kwargs: Any) -> None:
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    config = CONFIG.replace(model=rlnb.ModelConfig(path=str(llama), max_len=32))
    with rlnb.Session(config, name="export-full") as sess:
        out = sess.save_pretrained(tmp_path / "export")
        before = files_under(out)
        monkeypatch.setattr(HFPolicy, "write_pretrained", full)
        with pytest.raises(rlnb.CheckpointError) as info:
            sess.save_pretrained(out)
    assert str(info.value).startswith(f"cannot save the model to {out}: [Errno 28] No space left on device")
    assert "free some space" in str(info.value)
    assert isinstance(info.value.__cause__, SafetensorError)
    assert files_under(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "models"]

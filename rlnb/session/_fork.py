"""What ``Session.fork`` needs besides the new session: the name check, the fork's
run dir, the parent's state captured, and what the new session is given after."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlnb._errors import ConfigError
from rlnb.config import Config
from rlnb.runtime import lookup_session, sessions

if TYPE_CHECKING:
    from rlnb.data import PromptLoader
    from rlnb.learn import Trainer

__all__ = ["capture", "check_name", "fork_config", "paths_in_use"]

Restore = tuple[dict[str, Any], dict[str, dict[str, Any]], Path]  # a checkpoint's (manifest, tensors, path)


def check_name(name: object, parent: str) -> None:
    """Raise ConfigError unless ``name`` may name a fork of the session ``parent``: a
    fork never replaces a session, so it must not be a live one's."""
    if not isinstance(name, str) or not name.strip() or name == parent:
        raise ConfigError(
            f"fork(name={name!r}) is invalid: give the new session a name of its own, e.g. "
            f"fork({parent + '-b'!r}) (its name must differ from this session's, {parent!r})"
        )
    if (live := lookup_session(name)) is not None and not live.closed:
        raise ConfigError(
            f"fork(name={name!r}) is invalid: a live session is called {name!r} ({live!r}), and a fork never "
            f"replaces one: pick another name, e.g. fork({_free_name(name)!r}), or close it first "
            "(rlnb.sessions() lists the live ones)"
        )


def fork_config(config: Config, name: str) -> Config:
    """The fork's config: ``config``, its tracker writing to a run dir of its own."""
    if (run_dir := config.track.run_dir) is None:
        return config
    sibling = _fork_run_dir(Path(run_dir), name)
    return config.replace(track=dataclasses.replace(config.track, run_dir=str(sibling), run_id=None))


def capture(trainer: Trainer, *, prompts: PromptLoader, parent: str, reward: str | None) -> Restore:
    """The parent's state as a checkpoint held in memory (tensors copied), with
    rollouts quiesced meanwhile: what the fork is built from."""
    from rlnb import checkpoint

    with trainer.quiesced("fork()"):
        manifest, tensors = checkpoint.capture(trainer, prompts=prompts, name=parent, run_id=None, reward=reward)
        tensors = {stem: {k: v.clone() for k, v in state.items()} for stem, state in tensors.items()}
    manifest["format_version"] = checkpoint.FORMAT_VERSION  # as write() would record it
    return manifest, tensors, Path(f"<fork of {parent!r}>")


def paths_in_use(config: Config, task: Any) -> list[tuple[Path, str]]:
    """What a session of ``config`` and ``task`` reads or writes while it lives, with
    what each is: no save may replace them or a directory holding them
    (``rlnb._files.check_not_in_use``)."""
    used = []
    if config.model.path is not None:
        used.append((Path(config.model.path), "the base model (ModelConfig.path)"))
    if config.track.run_dir is not None:
        used.append((Path(config.track.run_dir), "the run dir (TrackConfig.run_dir)"))
    records = getattr(task, "records", None)
    if (path := _records_file(records)) is not None:
        used.append((path, f"the records file of task {task.name!r}"))
    return used


def _records_file(records: Any) -> Path | None:
    """The file a task's records were read from, if they were (``Records.source`` is
    its path's repr then)."""
    path = getattr(records, "path", None)
    if path is None:
        source = getattr(records, "source", None)
        if isinstance(source, str) and source[:1] in "'\"" and source:
            with contextlib.suppress(ValueError, SyntaxError):
                path = ast.literal_eval(source)
    if not isinstance(path, str | os.PathLike) or not os.path.isfile(path):
        return None
    return Path(path)


def _free_name(name: str) -> str:
    """``name`` with the first suffix ``-2``, ``-3``... that no live session has."""
    taken = {s.name for s in sessions()}
    return next(f"{name}-{n}" for n in range(2, len(taken) + 3) if f"{name}-{n}" not in taken)


def _fork_run_dir(run_dir: Path, name: str) -> Path:
    """The run dir of a fork called ``name`` of a session whose run dir is ``run_dir``:
    ``<run_dir>-<name>``, made safe as a file name (other characters become ``_``, and
    a hash of ``name`` keeps two names apart: "x y" and "x?y" differ), or where that is
    a live session's or holds files, the first free ``-2``, ``-3``... after it (said
    on stdout: a notice, as a replaced session's)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    if safe != name or len(safe) > 64:
        safe = f"{safe[:48]}-{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"
    wanted = run_dir.with_name(f"{run_dir.name}-{safe}")
    live = {os.path.realpath(s.config.track.run_dir) for s in sessions() if s.config.track.run_dir is not None}
    candidate, n = wanted, 1
    while (
        os.path.realpath(candidate) in live
        or (candidate.is_dir() and any(candidate.iterdir()))
        or (os.path.lexists(candidate) and not candidate.is_dir())
    ):
        n += 1
        candidate = wanted.with_name(f"{wanted.name}-{n}")
    if candidate != wanted:
        why = "is a live session's run dir" if os.path.realpath(wanted) in live else "holds another run's files"
        print(f"rlnb: fork {name!r} writes its run to {candidate} ({wanted} {why})")
    return candidate

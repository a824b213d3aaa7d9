"""Saving a directory so that nothing is lost. The new directory is written beside the
old one and swapped in, so a kill at any moment leaves one whole there; a directory
that holds anything rlnb did not write is refused, never replaced; what a killed save
left beside its target is removed by the next save or load of that path; and every
failure to write is a :class:`~rlnb.CheckpointError` that names the path and the cause.
Ctrl-C waits until each step that must not be cut short is done."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlnb._errors import CheckpointError, ConfigError
from rlnb.runtime import defer_interrupts, sessions

__all__ = [
    "MODEL_MARKER",
    "as_path",
    "check_not_in_use",
    "check_owned",
    "check_run_dir_free",
    "clean_leftovers",
    "io_error",
    "remove_dir",
    "replace_dir",
    "save_place",
    "sha256",
    "write_dir",
    "write_error",
    "write_model_dir",
]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h
# Every model directory rlnb writes (save_pretrained, tiny_llama) holds this file: the
# SHA-256 of each file rlnb wrote there, so a later save can tell that it holds nothing else.
MODEL_MARKER = "rlnb.json"
_MODEL_FORMAT = "rlnb-model-directory"
# A save writes into ".NAME.rlnb-XXXXXXXX" (tempfile's 8 random characters) beside NAME;
# a swap by renames (no RENAME_EXCHANGE) moves the old directory aside to ".NAME.old".
_STAGING = ".rlnb-"
# Rust libraries (safetensors, tokenizers) report an OS error as "... (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``); False where the system or file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a C library without it
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def remove_dir(path: Path) -> None:
    """``shutil.rmtree(path)``, ignoring errors, with Ctrl-C held back until it is done:
    rmtree opens each directory before its own ``try``, so a Ctrl-C landing in
    between would leave that directory's FD open for good."""
    with defer_interrupts("removing a directory"):
        shutil.rmtree(path, ignore_errors=True)


def replace_dir(staging: Path, target: Path) -> None:
    """Move the directory ``staging`` to ``target``. A directory already at ``target``
    is swapped out in one atomic step where the system allows (Linux), then removed:
    a kill at any moment leaves the old or the new one there, whole. Elsewhere the old
    one is renamed aside (``.NAME.old``, locked while this save lives) and put back if
    the move fails, or by the next save or load after a kill. A Ctrl-C waits until the
    new one is in place and the old one gone."""
    with defer_interrupts("replacing a directory"):
        if target.is_dir() and _exchange(staging, target):
            shutil.rmtree(staging, ignore_errors=True)  # it holds the old one now
            return
        old = _aside(target)
        if os.path.lexists(old):
            clean_leftovers(target)  # a killed save's; one a live save holds stays
            if os.path.lexists(old):
                raise OSError(errno.EBUSY, f"another save to this path is under way ({old} is there)")
        lock = _lock(target) if target.is_dir() else None
        try:
            try:
                if target.exists():
                    target.rename(old)
                staging.rename(target)
            except BaseException:
                if not target.exists() and old.exists():  # the new one never got there
                    old.rename(target)
                raise
            shutil.rmtree(old, ignore_errors=True)
        finally:
            if lock is not None:
                os.close(lock)


def _aside(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


def _lock(directory: Path) -> int | None:
    """An FD of ``directory`` (not a link to one) holding an exclusive ``flock``, which
    the system drops when the process dies, however it dies; None if another FD holds
    it, or it cannot be opened or locked (some network file systems)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return None
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def clean_leftovers(target: Path) -> None:
    """Remove what killed saves to ``target`` left beside it: their staging directories
    (``.NAME.rlnb-XXXXXXXX``, a half-written new one or, once swapped, the old one) and
    an old one renamed aside (``.NAME.old``), which is put back first where ``target``
    is missing (the kill came between the two renames). A live save holds a lock on
    its own, so only a dead writer's are touched; errors are ignored."""
    pattern = re.compile(rf"\.{re.escape(target.name)}(?:{re.escape(_STAGING)}[a-z0-9_]{{8}}|\.old)")
    try:
        with os.scandir(target.parent) as entries:
            found = sorted((e.name for e in entries if pattern.fullmatch(e.name)), key=lambda n: not n.endswith(".old"))
    except OSError:
        return
    for name in found:  # the one aside first: it may have to go back
        entry = target.parent / name
        with defer_interrupts("removing what a killed save left"):
            lock = _lock(entry)
            if lock is None:
                continue
            try:
                if name.endswith(".old") and not os.path.lexists(target):
                    entry.rename(target)
                else:
                    shutil.rmtree(entry, ignore_errors=True)
            except OSError:
                pass
            finally:
                os.close(lock)


def as_path(path: Any, *, call: str, argument: str) -> Path:
    """``path``, the ``argument`` of ``call``, as a :class:`~pathlib.Path` with ``~``
    expanded; :class:`CheckpointError` if it is not a path."""
    if not isinstance(path, str | os.PathLike) or os.fspath(path) in ("", b""):
        raise CheckpointError(f"{call}({argument}={path!r}): pass a directory path (str or pathlib.Path), e.g. 'ckpt'")
    return Path(os.path.expanduser(os.fsdecode(path)))


def save_place(path: Any, what: str, *, call: str, argument: str) -> Path:
    """``path``, the ``argument`` of ``call``, as the directory to save ``what`` to:
    ``~`` expanded, absolute, and a symbolic link followed to the directory it names.

    Raises :class:`CheckpointError` for something that is not a path, a file, what
    a live session reads or writes (:func:`check_not_in_use`), and the current
    directory, one that holds it, or a mount point (a save replaces the directory
    itself, so it would pull it from under the process or fail)."""
    target = Path(os.path.abspath(as_path(path, call=call, argument=argument)))
    if target.is_symlink():
        target = target.resolve()  # the link stays; the directory it names is saved
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"cannot save {what} to {target}: it is a file; choose a directory path")
    if target.is_dir():
        real, here = target.resolve(), _cwd()
        where = None
        if here is not None and real == here:
            where = "it is the current directory"
        elif here is not None and real in here.parents:
            where = f"it holds the current directory, {here}"
        elif os.path.ismount(real):
            where = "it is a mount point"
        if where is not None:
            raise CheckpointError(
                f"cannot save {what} to {target}: {where}, and a save replaces the whole directory; "
                f"nothing there was changed: choose a directory inside it, e.g. {str(target / 'out')!r}"
            )
    check_not_in_use(target, what)
    return target


def check_not_in_use(target: Path, what: str) -> None:
    """Refuse to save ``what`` to ``target`` where that would replace or remove what a
    live session reads or writes: its base model, its records file or its run dir
    (each session's ``_paths_in_use()``), or a directory that holds one. Inside a
    run dir is fine (``run/ckpt``): a save replaces only its own directory. Raises
    :class:`CheckpointError` naming the path, the session and why, before anything is
    written (rlnb may have written the directory itself: ``tiny_llama`` marks its own)."""
    real = Path(os.path.realpath(target))
    for session in sessions():
        in_use = getattr(session, "_paths_in_use", None)
        if in_use is None or getattr(session, "closed", False):
            continue
        for path, why in in_use():
            used = Path(os.path.realpath(path))
            if used != real and real not in used.parents:
                continue
            where = "it is" if used == real else f"it holds {used}, which is"
            raise CheckpointError(
                f"cannot save {what} to {target}: {where} {why} of the live session {session.name!r}, and a save "
                "replaces the whole directory; nothing there was changed: choose another directory, e.g. "
                f"{str(target.with_name(target.name + '-saved'))!r}"
            )


def check_run_dir_free(run_dir: str | os.PathLike[str] | None, name: str) -> None:
    """Refuse ``TrackConfig.run_dir`` for a session called ``name`` where it is the run
    dir of another live session: both would write one ``metrics.jsonl``, ``curves.png``
    and wandb dir. A live session called ``name`` is not another (it is being replaced:
    its run dir is free). Raises :class:`ConfigError` naming the dir, the session and
    the fix; closes nothing."""
    if run_dir is None:
        return
    real = os.path.realpath(run_dir)
    for session in sessions():
        if session.name == name or getattr(session, "closed", False):
            continue
        theirs = getattr(getattr(session, "config", None), "track", None)
        if theirs is None or theirs.run_dir is None or os.path.realpath(theirs.run_dir) != real:
            continue
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        other = Path(real).with_name(f"{Path(real).name}-{safe}")
        raise ConfigError(
            f"Session(name={name!r}): TrackConfig.run_dir={os.fspath(run_dir)!r} is the run dir of the live session "
            f"{session.name!r}, and two sessions in one run dir write one metrics.jsonl, curves.png and wandb dir "
            f"between them; nothing was built or closed: give this session a run dir of its own, e.g. "
            f"run_dir={str(other)!r}, or close session {session.name!r} first (rlnb.sessions() lists the live ones)"
        )


def _cwd() -> Path | None:
    try:
        return Path.cwd().resolve()
    except OSError:  # it was removed
        return None


def check_owned(target: Path, what: str, kind: str, foreign: Callable[[Path], list[str] | None]) -> None:
    """Refuse to save ``what`` over the directory ``target`` unless it is missing, empty,
    or holds a ``kind`` and nothing else: a save replaces the whole directory.

    ``foreign(target)`` is None where ``target`` holds no ``kind``, else the names of
    what it holds that rlnb did not write there. Raises :class:`CheckpointError`."""
    try:
        if not target.is_dir() or not any(target.iterdir()):
            return
        others = foreign(target)
    except OSError as exc:
        raise CheckpointError(write_error(exc, what, target)) from exc
    if others is None:
        fix = f"it is a non-empty directory that holds no {kind}; nothing there was changed: choose"
    elif others:
        shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        fix = (
            f"it holds a {kind}, but also {shown}, which a save would lose (it replaces the whole directory); "
            "nothing there was changed: move them out, or choose"
        )
    else:
        return
    raise CheckpointError(f"cannot save {what} to {target}: {fix} a new or empty directory")


def write_error(exc: OSError, what: str, target: Path) -> str:
    """The message for ``exc``, raised while saving ``what`` into the new directory
    ``target`` (its missing parents made first, as ``mkdir -p`` does): what went wrong
    and what to do. Only a full disk gets "free some space"."""
    detail = str(exc)
    fix = "choose a path you can write to"
    blocker = next((p for p in reversed(target.parents) if os.path.lexists(p) and not os.path.isdir(p)), None)
    if blocker is not None:
        reason = f"{blocker} is a file, not a directory"
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
        reason, fix = detail, "free some space or choose a path on another disk"
    elif not os.path.isdir(target.parent):
        reason = f"its directory {target.parent} does not exist and cannot be made ({detail})"
        fix = f"{fix} (or make {target.parent} first)"
    else:
        reason = detail
    return f"cannot save {what} to {target}: {reason}; nothing there was changed: {fix}, and save again"


def io_error(exc: BaseException) -> OSError | None:
    """The OS error ``exc`` reports: ``exc`` itself, or one that safetensors or tokenizers
    (Rust) carry in their message ("... (os error 28)"); None for any other error."""
    if isinstance(exc, OSError):
        return exc
    found = _RUST_OS_ERROR.search(str(exc)) if isinstance(exc, Exception) else None
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def sha256(path: Path) -> str:
    """The SHA-256 of the file ``path``, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_dir(target: Path, fill: Callable[[Path], None], what: str) -> Path:
    """Save ``what`` as the directory ``target``: ``fill(staging)`` writes it into a new
    hidden directory beside ``target`` (missing parents are made), which then replaces
    ``target`` (:func:`replace_dir`). Check ``target`` first (:func:`save_place`,
    :func:`check_owned`). Returns ``target``.

    A failure or Ctrl-C leaves ``target`` as it was and removes the staging directory;
    a kill leaves it for the next save or load (:func:`clean_leftovers`). Raises
    :class:`CheckpointError` naming ``target`` and the cause for every I/O failure (a
    full disk included, whichever library was writing)."""
    staging = lock = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with defer_interrupts("making a staging directory"):  # so that its name is known and its lock closed
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}{_STAGING}", dir=target.parent))
            lock = _lock(staging)  # until it is swapped in: another save or load leaves it alone
        fill(staging)
        _share(staging)
        replace_dir(staging, target)
    except BaseException as exc:
        if staging is not None:
            remove_dir(staging)
        error = io_error(exc)
        if error is None:
            raise
        raise CheckpointError(write_error(error, what, target)) from exc
    finally:
        if lock is not None:
            os.close(lock)
    return target


def _share(staging: Path) -> None:
    """Give what ``staging`` holds the permissions the process's umask gives new files
    (``mkdtemp`` and safetensors make theirs private)."""
    umask = os.umask(0)
    os.umask(umask)
    for root, dirs, files in os.walk(staging):
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask, follow_symlinks=False)
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~umask, follow_symlinks=False)
    staging.chmod(0o777 & ~umask)


def write_model_dir(path: Any, fill: Callable[[Path], None], *, call: str, argument: str) -> Path:
    """Save a model as the directory ``path``: ``fill(staging)`` writes its files, and
    :data:`MODEL_MARKER` records each one's SHA-256. A directory already there is
    replaced only if it holds a model saved so and nothing else, unchanged; anything
    else non-empty is refused. See :func:`write_dir` for the rest."""
    from rlnb import __version__

    target = save_place(path, "the model", call=call, argument=argument)
    clean_leftovers(target)
    check_owned(target, "the model", "model rlnb saved", _not_in_marker)

    def fill_and_mark(staging: Path) -> None:
        fill(staging)
        files = {name: sha256(staging / name) for name in _files_below(staging)}
        marker = {"format": _MODEL_FORMAT, "rlnb": __version__, "files": files}
        (staging / MODEL_MARKER).write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")

    return write_dir(target, fill_and_mark, "the model")


def _files_below(root: Path) -> list[str]:
    """The path of every file (and link) below ``root``, relative to it, with ``/``."""
    found = []
    for where, _, files in os.walk(root):
        found += [Path(where, name).relative_to(root).as_posix() for name in files]
    return sorted(found)


def _not_in_marker(target: Path) -> list[str] | None:
    """What ``target`` holds besides the files its :data:`MODEL_MARKER` names with
    their SHA-256 (a file changed since counts too); None without a marker."""
    try:
        marker = json.loads((target / MODEL_MARKER).read_text(encoding="utf-8"))
        files = marker["files"] if marker.get("format") == _MODEL_FORMAT else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(files, dict):
        return None
    others = []
    for where, dirs, names in os.walk(target):
        for name in names:
            path = Path(where, name)
            rel = path.relative_to(target).as_posix()
            if rel == MODEL_MARKER:
                continue
            if rel not in files or path.is_symlink():
                others.append(repr(rel))
            elif sha256(path) != files[rel]:
                others.append(f"{rel!r} (changed since rlnb wrote it)")
        for name in dirs:  # a directory none of whose files rlnb wrote: empty, or a link
            rel = Path(where, name).relative_to(target).as_posix()
            if not any(f.startswith(f"{rel}/") for f in files):
                others.append(repr(f"{rel}/"))
    return sorted(others)

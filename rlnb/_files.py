"""Putting a new directory where an old one is, so that a kill at any moment leaves one whole,
removing directories, so that a Ctrl-C at any moment leaves nothing half done, and saying
why a directory could not be written."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from pathlib import Path

from rlnb.runtime import defer_interrupts

__all__ = ["remove_dir", "replace_dir", "write_error"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h


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
    one is renamed aside first and put back if the move fails. A Ctrl-C waits until
    the new one is in place and the old one gone."""
    with defer_interrupts("replacing a directory"):
        if target.is_dir() and _exchange(staging, target):
            shutil.rmtree(staging, ignore_errors=True)  # it holds the old one now
            return
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        try:
            if target.exists():
                target.rename(old)
            staging.rename(target)
        except BaseException:
            if not target.exists() and old.exists():  # the new one never got there
                old.rename(target)
            raise
        shutil.rmtree(old, ignore_errors=True)


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

"""What an engine's processes leave on disk when they are killed, and its removal.

vLLM's processes talk over ZMQ ``ipc://`` endpoints, Unix sockets named by UUID in
the temp dir, and its message queues live in shared memory (``/dev/shm/psm_*``, with
a semaphore beside them). A process that exits cleanly unlinks what it made; one
that is killed, as ``AsyncLLM.shutdown`` kills EngineCore and its Worker, does not:
each engine start left seven sockets in /tmp and two shared-memory segments
(~400 MB of address space each, the pages written stay in RAM), until the owning
process exited and its resource tracker removed them (and a semaphore) with a
warning on stderr, at every exit of a script that had used vLLM. The engine starts
vLLM with its sockets in a directory of its own (:func:`socket_dir`; vLLM's
``VLLM_RPC_BASE_PATH``), notes the shared memory its processes map while they run,
and removes both once the processes are gone; its guard (``remove PATH``) does it
if the owner dies first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterable, Iterator

import psutil

__all__ = ["engine_files", "listening_sockets", "remove_leftovers", "socket_dir"]

_SHM = "/dev/shm/"
_RPC_BASE = "VLLM_RPC_BASE_PATH"
# A Unix socket's path holds at most 107 bytes; vLLM's names are 36 (a UUID).
_MAX_SOCKET_DIR = 107 - 37
# The variable is the process's: two engines starting at once in one process take turns,
# so that neither restores the other's directory (removed at its close) as the base.
_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def socket_dir() -> Iterator[str | None]:
    """A new directory for vLLM's ``ipc://`` sockets, in its usual place (the
    ``VLLM_RPC_BASE_PATH`` set here, or the temp dir), named in ``VLLM_RPC_BASE_PATH``
    for the block: vLLM reads it when it names a socket, in this process and in the
    processes it spawns meanwhile, which inherit it. Yields None, changing nothing,
    where the directory's path would leave a socket's too long. One block at a time
    in a process."""
    with _ENV_LOCK:
        before = os.environ.get(_RPC_BASE)
        base = before or tempfile.gettempdir()
        if len(base) + len("/rlnb-vllm-xxxxxxxx") > _MAX_SOCKET_DIR:
            yield None
            return
        path = tempfile.mkdtemp(prefix="rlnb-vllm-", dir=base)
        os.environ[_RPC_BASE] = path
        try:
            yield path
        finally:
            if before is None:
                os.environ.pop(_RPC_BASE, None)
            else:
                os.environ[_RPC_BASE] = before


def listening_sockets(pid: int) -> set[str]:
    """The paths of the Unix sockets process ``pid`` has bound (none if it is gone)."""
    try:
        conns = psutil.Process(pid).net_connections(kind="unix")
    except (psutil.Error, OSError):
        return set()
    return {c.laddr for c in conns if isinstance(c.laddr, str) and c.laddr.startswith("/")}


def _shared_memory(pid: int) -> set[str]:
    """The files in /dev/shm that process ``pid`` maps and that still have a name.

    A semaphore's creator maps it under another name: glibc's ``sem_open`` makes it as
    a temporary file, maps that, links it to the semaphore's name and unlinks the
    temporary one, so the mapping reads ``/dev/shm/sem.XXXXXX (deleted)``. Such a
    file is found by its inode, under the name it still has (vLLM's EngineCore
    makes one for its workers, a multiprocessing lock)."""
    found, unlinked = set(), set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or not fields[5].startswith(_SHM):
                    continue
                if fields[5].endswith(" (deleted)\n"):
                    unlinked.add(int(fields[4]))
                else:
                    found.add(fields[5].rstrip("\n"))
    except (OSError, ValueError):  # gone, or not Linux
        pass
    return found | _named(unlinked) if unlinked else found


def _named(inodes: set[int]) -> set[str]:
    """The paths in /dev/shm of the files with these inode numbers."""
    try:
        with os.scandir(_SHM) as entries:
            return {entry.path for entry in entries if entry.inode() in inodes}
    except OSError:
        return set()


def engine_files(pids: Iterable[int]) -> set[str]:
    """What the processes ``pids`` (an engine's own) would leave behind if killed:
    the Unix sockets they bound and the shared memory they map."""
    found: set[str] = set()
    for pid in pids:
        found |= listening_sockets(pid) | _shared_memory(pid)
    return found


def remove_leftovers(paths: Iterable[str]) -> int:
    """Unlink those of ``paths`` still there, once their processes are gone: a
    :func:`socket_dir` and what is in it, Unix sockets, and files in /dev/shm that
    this process does not map itself (so nothing still in use here loses its
    name). A shared-memory segment or semaphore is also
    taken off this process's resource tracker, where its (killed) creator registered
    it, so that it is not reported as leaked at exit. Returns how many it removed."""
    ours = _shared_memory(os.getpid())
    removed = 0
    for path in sorted(paths):
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode) and os.path.basename(path).startswith("rlnb-vllm-"):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
            continue
        shm = path.startswith(_SHM) and stat.S_ISREG(mode) and path not in ours
        if not (stat.S_ISSOCK(mode) or shm):
            continue
        try:
            os.unlink(path)
        except OSError:
            continue
        removed += 1
        if shm:
            _untrack(os.path.basename(path))
    return removed


def _untrack(name: str) -> None:
    """Take shared memory ``name`` (a file name in /dev/shm) off this process's
    resource tracker, if it runs (processes spawned from here share it)."""
    from multiprocessing import resource_tracker

    if getattr(resource_tracker._resource_tracker, "_fd", None) is None:
        return  # no tracker here: nothing was registered with one
    kind, key = ("semaphore", "/" + name[4:]) if name.startswith("sem.") else ("shared_memory", "/" + name)
    with contextlib.suppress(Exception):
        # register first: the tracker reports an error for a name it does not hold
        resource_tracker.register(key, kind)
        resource_tracker.unregister(key, kind)

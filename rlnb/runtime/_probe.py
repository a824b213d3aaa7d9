"""A frozen snapshot of what this process holds: FDs, threads, children, loops, runs.

Gauges and the leak checker read these snapshots, never live internals.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import psutil

from rlnb import _reprs
from rlnb.runtime import _bridge, _ipython

__all__ = [
    "ChildInfo",
    "ProcessLong",
    "Snapshot",
    "note_process_long",
    "open_runs",
    "register_run",
    "snapshot",
    "unregister_run",
]

_RUNS_LOCK = threading.Lock()
_RUNS: dict[int, str] = {}


def register_run(obj: object, label: str) -> None:
    """Record an open tracker run owned by ``obj`` (the tracker calls this)."""
    with _RUNS_LOCK:
        _RUNS[id(obj)] = label


def unregister_run(obj: object) -> None:
    """Forget the run owned by ``obj``; a no-op if it was never registered."""
    with _RUNS_LOCK:
        _RUNS.pop(id(obj), None)


def open_runs() -> tuple[str, ...]:
    """Labels of open tracker runs, plus a live global ``wandb.run`` if wandb is loaded."""
    with _RUNS_LOCK:
        runs = set(_RUNS.values())
    wandb = sys.modules.get("wandb")  # never import it just to look
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is not None:
        runs.add(f"wandb:{getattr(run, 'id', '?')}")
    return tuple(sorted(runs))


@dataclasses.dataclass(frozen=True)
class ChildInfo:
    pid: int
    name: str
    cmdline: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.cmdline or self.name})"


@dataclasses.dataclass(frozen=True)
class ProcessLong:
    """What a library keeps for the life of the process once its user has closed it,
    and why: left out of every snapshot's counts, and said here instead.

    ``owner`` names the library ("Ray"); ``reason`` says, in a sentence, why it keeps
    them and what frees them; ``fds`` maps each FD it keeps (still open, still pointing
    where it did when noted) to what it points at; ``threads`` names its threads still
    alive, Python's and the library's own native ones (which Python does not list).
    """

    owner: str
    reason: str
    fds: Mapping[int, str]
    threads: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What the process held at one moment.

    ``fds`` maps each open FD to what it points at; ``threads`` maps thread ident to
    name; ``children`` holds live (non-zombie) descendants; ``loops`` names the rlnb
    bridges whose loop is open; ``runs`` labels open tracker runs. ``process_long``
    says what libraries keep for the life of the process (noted with
    :func:`note_process_long`, with an owner), which the other fields leave out.
    """

    fds: Mapping[int, str]
    threads: Mapping[int, str]
    children: frozenset[ChildInfo]
    loops: tuple[str, ...]
    runs: tuple[str, ...]
    process_long: tuple[ProcessLong, ...] = ()

    @property
    def num_fds(self) -> int:
        return len(self.fds)

    @property
    def num_threads(self) -> int:
        return len(self.threads)

    @property
    def num_children(self) -> int:
        return len(self.children)

    def new_since(self, before: Snapshot) -> dict[str, list[str]]:
        """What this snapshot holds that ``before`` did not, by kind (empty kinds omitted)."""
        found = {
            "threads": [f"{name!r} (ident {i})" for i, name in self.threads.items() if i not in before.threads],
            "fds": [f"fd {fd} -> {target}" for fd, target in self.fds.items() if before.fds.get(fd) != target],
            "children": [str(c) for c in self.children if c.pid not in {b.pid for b in before.children}],
            "loops": [name for name in self.loops if name not in before.loops],
            "runs": [run for run in self.runs if run not in before.runs],
        }
        return {kind: items for kind, items in found.items() if items}

    def _rows(self) -> list[tuple[str, list[str]]]:
        kinds = {
            "fds": (self.num_fds, _fd_kinds(self.fds.values())),
            "threads": (self.num_threads, _reprs.name_list(self.threads.values())),
            "children": (
                self.num_children,
                _reprs.name_list(f"{c.pid} {c.name}" for c in sorted(self.children, key=lambda c: c.pid)),
            ),
            "loops": (len(self.loops), _reprs.name_list(self.loops)),
            "runs": (len(self.runs), _reprs.name_list(self.runs)),
        }
        width = max(len(str(count)) for count, _ in kinds.values())
        return [
            (kind, [f"{count:>{width}}: {names}" if names else f"{count:>{width}}"])
            for kind, (count, names) in kinds.items()
        ]

    def __repr__(self) -> str:
        return _reprs.text_block("probe.Snapshot", self._rows())

    def _repr_html_(self) -> str:
        return _reprs.html_table("probe.Snapshot", self._rows())


def _fd_kinds(targets: Iterable[str]) -> str:
    """What the FDs point at, by kind: "9 files, 6 pipes, 4 sockets"."""
    counts: dict[str, int] = {}
    for target in targets:
        if target.startswith("/dev/"):
            kind = "device"
        elif target.startswith("/"):
            kind = "file"
        elif target.startswith(("pipe:", "socket:")):
            kind = target.split(":", 1)[0]
        elif target.startswith("anon_inode:"):
            kind = "anon inode"
        elif target == "?":  # the platform lets us count FDs but not look at them
            continue
        else:
            kind = "other"
        counts[kind] = counts.get(kind, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{n} {kind}{'' if n == 1 else 's'}" for kind, n in ranked)


def _open_fds() -> dict[int, str]:
    fd_dir = "/proc/self/fd"
    if not os.path.isdir(fd_dir):  # not Linux: count only
        return {i: "?" for i in range(psutil.Process().num_fds())} if hasattr(psutil.Process, "num_fds") else {}
    fds: dict[int, str] = {}
    for entry in os.listdir(fd_dir):
        try:
            fds[int(entry)] = os.readlink(f"{fd_dir}/{entry}")
        except OSError:  # the listing's own FD, or one closed meanwhile
            continue
    return fds


def _live_children() -> frozenset[ChildInfo]:
    children = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            with proc.oneshot():
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue  # dead, waiting to be reaped
                children.add(ChildInfo(proc.pid, proc.name(), " ".join(proc.cmdline())[:200]))
        except psutil.Error:  # exited meanwhile
            continue
    return frozenset(children)


_NOTED_FDS: dict[int, str] = {}  # fd -> what it pointed to when noted
_NOTED_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@dataclasses.dataclass
class _Owner:
    """What one library was noted to keep, and why."""

    reason: str
    fds: dict[int, str] = dataclasses.field(default_factory=dict)
    threads: weakref.WeakSet[threading.Thread] = dataclasses.field(default_factory=weakref.WeakSet)
    native: dict[int, str] = dataclasses.field(default_factory=dict)  # OS thread id -> its name when noted


_OWNERS: dict[str, _Owner] = {}
_OWNERS_LOCK = threading.Lock()


def note_process_long(
    *,
    fds: Iterable[int] = (),
    threads: Iterable[threading.Thread] = (),
    native_threads: Iterable[int] = (),
    owner: str | None = None,
    reason: str | None = None,
) -> None:
    """Mark FDs and threads that a library keeps for the life of the
    process, such as pyzmq's garbage-collector thread and its context, as nobody's
    leak: :func:`snapshot` leaves them out from now on (an FD while it points where
    it pointed when noted).

    With ``owner`` (and ``reason``, a sentence saying why it keeps them) they are
    also said in :attr:`Snapshot.process_long`, with the library's own native threads
    (``native_threads``: OS thread ids, which Python's thread list leaves out)."""
    open_now = _open_fds()
    targets = {fd: open_now[fd] for fd in fds if fd in open_now}
    kept = list(threads)
    _NOTED_FDS.update(targets)
    _NOTED_THREADS.update(kept)
    if owner is None:
        return
    names = {tid: name for tid in native_threads if (name := _native_thread_name(tid)) is not None}
    with _OWNERS_LOCK:
        note = _OWNERS.setdefault(owner, _Owner(reason or ""))
        note.reason = reason or note.reason
        note.fds.update(targets)
        note.threads.update(kept)
        note.native.update(names)


def _native_thread_name(tid: int) -> str | None:
    """The name the OS knows thread ``tid`` of this process by; None once it has ended."""
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _process_long() -> tuple[ProcessLong, ...]:
    """What each owner noted that it still holds (FDs still pointing where they did,
    threads still alive); owners that hold nothing any more are left out."""
    if not _OWNERS:
        return ()
    open_fds = _open_fds()
    with _OWNERS_LOCK:  # copied under the lock: noting may happen on another thread
        notes = [(owner, n.reason, set(n.fds), list(n.threads), dict(n.native)) for owner, n in _OWNERS.items()]
    found = []
    for owner, reason, noted_fds, threads, native in notes:
        fds = {fd: target for fd, target in open_fds.items() if fd in noted_fds and _noted(fd, target)}
        names = [t.name for t in threads if t.is_alive()]
        names += [name for tid, name in native.items() if _native_thread_name(tid) == name]
        if fds or names:
            found.append(ProcessLong(owner, reason, fds, tuple(sorted(names))))
    return tuple(found)


def _noted(fd: int, target: str) -> bool:
    """``fd`` was noted as process-long and still points where it did (a file deleted
    since, such as a library's log file, is still the same file)."""
    noted = _NOTED_FDS.get(fd)
    return noted is not None and (target == noted or target == f"{noted} (deleted)")


def _process_long_helpers() -> tuple[frozenset[int], frozenset[int]]:
    """The pids and FDs of multiprocessing's forkserver and resource tracker: started
    once (by the prompt loader's workers) and kept for the life of the process, like
    the loop backend's FDs, they are nobody's leak."""
    pids: set[int | None] = set()
    fds: set[int | None] = set()
    if (forkserver := sys.modules.get("multiprocessing.forkserver")) is not None:
        server = getattr(forkserver, "_forkserver", None)
        pids.add(getattr(server, "_forkserver_pid", None))
        fds.add(getattr(server, "_forkserver_alive_fd", None))
    if (tracker_module := sys.modules.get("multiprocessing.resource_tracker")) is not None:
        tracker = getattr(tracker_module, "_resource_tracker", None)
        pids.add(getattr(tracker, "_pid", None))
        fds.add(getattr(tracker, "_fd", None))
    return frozenset(p for p in pids if p is not None), frozenset(f for f in fds if f is not None)


# Threads that the Jupyter kernel and IPython start when they need them (IPython's
# history writer after the first cell, a subshell thread when JupyterLab asks for
# one) and keep for the kernel's life: the kernel's, not a session's.
_KERNEL_PACKAGES = frozenset({"IPython", "ipykernel"})


def _process_long_thread(thread: threading.Thread) -> bool:
    return thread in _NOTED_THREADS or type(thread).__module__.partition(".")[0] in _KERNEL_PACKAGES


# A kernel thread's FDs never change while it lives: found once per thread.
_KERNEL_THREAD_FDS: weakref.WeakKeyDictionary[threading.Thread, frozenset[int]] = weakref.WeakKeyDictionary()


def _kernel_fds(open_fds: Mapping[int, str]) -> frozenset[int]:
    """The FDs that the Jupyter kernel opens for itself when it needs them, like its
    threads: a subshell's (JupyterLab asks for one once a notebook is open: its event
    loop's epoll and self-pipe, its zmq socket pairs' eventfds), the output pipe a
    kernel thread gets the first time it sends (the control thread, on its first
    reply), and IPython's history database and its journal."""
    fds: set[int] = set()
    pipes = _ipython.output_pipes()
    for thread in threading.enumerate():
        if type(thread).__module__.partition(".")[0] != "ipykernel":
            continue
        if (found := _KERNEL_THREAD_FDS.get(thread)) is None:
            found = _KERNEL_THREAD_FDS[thread] = _thread_fds(thread)
        fds |= found
        if (pipe := pipes.get(thread)) is not None:
            fds |= _thread_fds_of([pipe])
    if history := _ipython.history_file():
        fds |= {fd for fd, target in open_fds.items() if target.startswith(history)}
    return frozenset(fds)


def _thread_fds(thread: threading.Thread) -> frozenset[int]:
    fds: set[int] = set()
    loop = getattr(getattr(thread, "io_loop", None), "asyncio_loop", None)
    if (selector := getattr(loop, "_selector", None)) is not None:
        fds.add(selector.fileno())
    fds |= {sock.fileno() for sock in (getattr(loop, "_ssock", None), getattr(loop, "_csock", None)) if sock}
    pairs = [getattr(thread, name, None) for name in ("shell_channel_to_subshell", "subshell_to_shell_channel")]
    sockets = [getattr(pair, side, None) for pair in pairs for side in ("from_socket", "to_socket")]
    return frozenset(fd for fd in fds | _thread_fds_of(sockets) if fd >= 0)


def _thread_fds_of(sockets: Iterable[Any]) -> frozenset[int]:
    """The FDs of zmq ``sockets`` (a socket's FD is its mailbox's eventfd)."""
    fds = set()
    for sock in sockets:
        try:
            fd = sock.FD if sock is not None and not sock.closed else None
        except Exception:  # closed meanwhile
            continue
        if isinstance(fd, int):
            fds.add(fd)
    return frozenset(fds)


def snapshot() -> Snapshot:
    """Take a :class:`Snapshot` of this process now. Does not block."""
    helper_pids, helper_fds = _process_long_helpers()
    open_fds = _open_fds()
    helper_fds |= _kernel_fds(open_fds)
    return Snapshot(
        fds={fd: target for fd, target in open_fds.items() if fd not in helper_fds and not _noted(fd, target)},
        threads={t.ident or 0: t.name for t in threading.enumerate() if t.is_alive() and not _process_long_thread(t)},
        children=frozenset(c for c in _live_children() if c.pid not in helper_pids),
        loops=_bridge.live_loops(),
        runs=open_runs(),
        process_long=_process_long(),
    )


def keep_zmq_gc() -> None:
    """Start pyzmq's garbage collector (a thread and a zmq context of its own, which
    track buffers sent without copying, such as the weights a sync sends) and mark
    its thread and FDs as kept for the life of the process, as the forkserver is.
    pyzmq would start it on the first such send and never stop it."""
    from zmq.utils.garbage import gc

    if gc.is_alive() and gc._push is not None:
        return
    before = _anon_fds()
    if not gc.is_alive():
        gc.start()
    gc._push_socket  # noqa: B018 - made on first use: made now, with the rest
    thread = gc.thread
    note_process_long(fds=_anon_fds() - before, threads=[] if thread is None else [thread])


def _anon_fds() -> set[int]:
    """The eventfd and epoll FDs open now: what a zmq context and its sockets open."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("anon_inode:[event"):
                out.add(int(name))
        except OSError:  # closed meanwhile
            pass
    return out


def warm_up_kernel_messages() -> None:
    """In a Jupyter kernel, start pyzmq's garbage collector now (:func:`keep_zmq_gc`).

    pyzmq starts it the first time the kernel sends a large buffer without copying
    it, such as a widget's image, and keeps it for the life of the process: started
    and marked before a session takes its baseline, it is never counted as the
    session's (a closed dashboard's gauges would say so otherwise)."""
    if _ipython.notebook_cell() is not None and "zmq" in sys.modules:
        keep_zmq_gc()

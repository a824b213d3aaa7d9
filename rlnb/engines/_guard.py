"""A watchdog that kills an engine's processes when the process that owns them dies.

vLLM's ``AsyncLLM`` runs ``EngineCore`` in a child process and a ``Worker`` under
that; a local Ray cluster runs its agents beside the raylet. If the owner is
killed (SIGKILL, SIGTERM, an OOM kill), they do not notice and keep running,
holding memory and cores. ``VLLMEngine`` and ``RayEngine`` start this guard
(:class:`Guard`) as a plain subprocess in a session of its own (a Ctrl-C meant for
the owner's process group does not reach it). The guard:

* waits for the owner's death on a pidfd (so a forked child holding a copy of the
  command pipe cannot hide it), and treats the command pipe closing without
  ``bye`` as a death too (the owner exited without closing the engine);
* learns whom to kill from lines on stdin: ``watch PID START`` (a pid and its
  start time, so a reused pid is never hit), ``arm`` / ``disarm`` (while armed,
  every new spawned child of the owner is watched: the window in which
  ``EngineCore`` exists but its pid is not yet known), ``remove PATH`` (a link,
  socket, shared-memory file or directory to delete once the processes are gone),
  ``bye`` (the engine closed: exit without killing); and also watches any
  descendant of the owner whose process title vLLM set to ``VLLM::...``;
* on the owner's death, SIGKILLs every watched process still alive and its
  descendants, waits for them, removes the paths, and exits.

It runs as a script (``python _guard.py OWNER_PID``) and its script part imports
nothing from rlnb, so it starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import psutil

POLL = 0.2  # seconds between looks at the owner's descendants
KILL_WAIT = 3.0


def _key(proc: psutil.Process) -> tuple[int, float] | None:
    try:
        return proc.pid, proc.create_time()
    except psutil.Error:
        return None


def _gone(proc: psutil.Process) -> bool:
    """Exited: no such process, or a zombie its parent has still to reap."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


class _Watch:
    def __init__(self, owner: int) -> None:
        self.owner = owner
        self.watched: set[tuple[int, float]] = set()
        self.remove: list[str] = []
        self.armed = False
        try:
            self.owner_proc: psutil.Process | None = psutil.Process(owner)
        except psutil.NoSuchProcess:
            self.owner_proc = None
        # Processes that were there before: another engine's, not this one's to kill.
        self.seen = {p.pid for p in self._descendants()}

    def owner_alive(self) -> bool:
        if self.owner_proc is None:
            return False
        try:
            return self.owner_proc.is_running() and self.owner_proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def scan(self) -> None:
        """Watch the owner's descendants that belong to vLLM."""
        if self.owner_proc is None:
            return
        try:
            descendants = self.owner_proc.children(recursive=True)
        except psutil.Error:
            return
        for proc in descendants:
            if proc.pid in self.seen:
                continue
            try:
                if proc.name().startswith("VLLM::") or (self.armed and "spawn_main" in " ".join(proc.cmdline())):
                    key = _key(proc)
                    if key is not None:
                        self.watched.add(key)
                        self.seen.add(proc.pid)
                elif self.armed:
                    self.seen.add(proc.pid)  # started while armed but not by vLLM: never ours
            except psutil.Error:
                continue

    def command(self, line: str) -> bool:
        """Apply one command; False once told ``bye``."""
        words = line.split()
        if not words:
            return True
        if words[0] == "bye":
            return False
        if words[0] == "watch" and len(words) == 3:
            self.watched.add((int(words[1]), float(words[2])))
        elif words[0] == "remove" and len(words) == 2:
            self.remove.append(words[1])
        elif words[0] == "arm":
            self.scan()
            self.armed = True
        elif words[0] == "disarm":
            self.scan()
            self.armed = False
        return True

    def _descendants(self) -> list[psutil.Process]:
        try:
            return [] if self.owner_proc is None else self.owner_proc.children(recursive=True)
        except psutil.Error:
            return []

    def kill(self) -> int:
        """SIGKILL every watched process still alive, and its descendants; how many."""
        targets: dict[int, psutil.Process] = {}
        for pid, start in self.watched:
            try:
                proc = psutil.Process(pid)
                if proc.create_time() != start:
                    continue  # the pid was reused
                for p in [proc, *proc.children(recursive=True)]:
                    targets[p.pid] = p
            except psutil.Error:
                continue
        for proc in targets.values():
            try:
                proc.kill()
            except psutil.Error:
                pass
        deadline = time.monotonic() + KILL_WAIT
        while time.monotonic() < deadline and not all(map(_gone, targets.values())):
            time.sleep(0.01)
        return len(targets)


class Guard:
    """The watchdog as its owner drives it: a subprocess told which pids to kill (and
    which paths to remove) if this process dies."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to our process group must not reach it
        )
        self._lock = threading.Lock()

    def send(self, line: str) -> None:
        with self._lock:
            stdin = self.proc.stdin
            if stdin is None or stdin.closed:
                return
            try:
                stdin.write(line.encode() + b"\n")
                stdin.flush()
            except OSError:  # it died: nothing to tell
                pass

    def watch(self, pids: Sequence[int]) -> list[psutil.Process]:
        procs = []
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                self.send(f"watch {pid} {proc.create_time()!r}")
                procs.append(proc)
            except psutil.NoSuchProcess:
                continue
        return procs

    def close(self, *, kill: bool, timeout: float = 5.0) -> None:
        """Let it go (``kill``: after it kills what it watches)."""
        if not kill:
            self.send("bye")
        with self._lock:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # an old kernel: poll instead
        return None


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    owner = int(argv[1])
    guard = _Watch(owner)
    pidfd = _pidfd(owner)
    stdin = sys.stdin.fileno()
    buffered = b""
    watch = [stdin] + ([pidfd] if pidfd is not None else [])
    while guard.owner_alive():
        ready, _, _ = select.select(watch, [], [], POLL)
        if pidfd is not None and pidfd in ready:
            break  # the owner died
        if stdin in ready:
            chunk = os.read(stdin, 4096)
            if not chunk:
                break  # the owner's end closed without "bye": it exited or died
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            if not all(guard.command(line.decode()) for line in lines):
                return 0
        guard.scan()
    started = time.monotonic()
    killed = guard.kill()
    for path in guard.remove:
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
    print(
        f"rlnb guard: owner {owner} died; killed {killed} engine processes in {time.monotonic() - started:.2f}s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""Ray as a :class:`~rlnb.engines._ray.RayEngine` uses it: a local cluster that the
session starts and owns (its processes watched by a guard, its logs in the run
dir), or a running cluster it attaches to and leaves be; and the raylet's reports of
replicas that died, which the engine answers in its own words."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil

from rlnb._errors import ConfigError, EngineError

__all__ = ["RayCluster", "is_ray_process", "report_deaths"]

# Ray's driver keeps these after ray.shutdown(); said beside the gauges, which leave them out.
KEPT_AFTER_SHUTDOWN = (
    "Ray's core worker keeps its threads, event loops, sockets and log files in this process after "
    "ray.shutdown(), for the life of the process (a few FDs more per ray.init); a kernel restart frees them"
)


class RayCluster:
    """Ray as this session uses it: started here (owned) or attached to."""

    def __init__(self, ray: Any, *, connected: bool, owned: bool, guard: Any) -> None:
        self.ray, self.owned, self._guard = ray, owned, guard
        self.connected = connected  # this session called ray.init (and disconnects at close)
        self.placement: Any = None
        self.link: str | None = None  # a short path to the log dir, for Ray's sockets
        self.logs: str | None = None  # where this process's Ray session keeps its logs (the real path)
        self._procs: dict[int, psutil.Process] = {}
        self._fds_before = _open_fds()
        self._threads_before = set(_native_threads())
        self._closed = False

    @classmethod
    def connect(cls, ray: Any, config: Any, name: str, log_dir: str | None, *, cpus: float = 0.0) -> RayCluster:
        """Ray as ``config`` (a :class:`~rlnb.RayConfig`) says: attached to a running
        cluster, or a local one of the session's own with room for the engine's
        replicas and ``cpus`` more (the learner's ranks)."""
        if ray.is_initialized():  # another session's Ray, or the user's: use it, leave it be
            cluster = cls(ray, connected=False, owned=False, guard=None)
            cluster.logs = _logs_dir(ray)
            return cluster
        options = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR"}
        if config.address is not None:
            _check_reachable(config.address)
            cluster = cls(ray, connected=True, owned=False, guard=None)
            try:
                with _no_driver_metrics():
                    ray.init(address=config.address, namespace=f"rlnb-{name}", **options)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                cluster.close()
                raise ConfigError(
                    f"RayConfig.address={config.address!r} is invalid: no Ray cluster answered there ({exc}); "
                    "start one with `ray start --head`, or use address=None for a local cluster of the session's own "
                    "(a cluster with token authentication also needs RAY_AUTH_MODE=token in this process's environment)"
                ) from None
            cluster.logs = _logs_dir(ray)
            return cluster
        return cls._start(ray, config, name, log_dir, options, cpus)

    @classmethod
    def _start(
        cls, ray: Any, config: Any, name: str, log_dir: str | None, options: dict[str, Any], cpus: float = 0.0
    ) -> RayCluster:
        """A local cluster of the session's own. On a busy machine Ray's Python agents
        can take longer to import than the raylet waits for them (30 s; the raylet
        then aborts and ``ray.init`` raises): such a start is cleaned up and tried
        again, with the imports now cached, while ``start_timeout`` allows."""
        from rlnb.engines._guard import Guard

        deadline = time.monotonic() + config.start_timeout
        needed = int(config.engine_replicas * config.num_cpus + cpus + 0.999)
        attempt = 0
        while True:
            attempt += 1
            cluster = cls(ray, connected=True, owned=True, guard=Guard())
            try:
                if log_dir is not None:
                    options["_temp_dir"] = cluster.temp_dir(log_dir)
                with _single_node(ray):
                    ray.init(
                        # "local": a new cluster, always. None would join any Ray found on the
                        # machine (a GCS process, or the address a `ray start` left in
                        # /tmp/ray/ray_current_cluster, stale once it was killed) and fail there.
                        address="local",
                        # Room for the learner's ranks twice: a fork of this session (or a
                        # second one in this process) joins this cluster and places its own.
                        num_cpus=max(needed + int(cpus), os.cpu_count() or 1),
                        namespace=f"rlnb-{name}",
                        _node_ip_address="127.0.0.1",
                        _system_config=dict(_NO_METRICS),  # Ray adds to it: a new one per start
                        **options,
                    )
            except Exception as exc:
                _kill_failed_node(exc)
                cluster.close()
                logs = Path(log_dir).resolve() if log_dir else Path(tempfile.gettempdir(), "ray")
                logs = logs / "session_latest" / "logs"
                if attempt < _START_ATTEMPTS and _slow_start(exc) and deadline - time.monotonic() > _RAY_START_WAIT:
                    continue
                raise EngineError(
                    f"Ray's local cluster did not start ({type(exc).__name__}: {exc}) after {attempt} "
                    f"attempt(s) within RayConfig.start_timeout={config.start_timeout} s; its logs are in {logs} "
                    "(raylet.err, dashboard_agent.log). On a busy machine a longer start_timeout allows "
                    "another attempt"
                ) from exc
            except BaseException:
                cluster.close()
                raise
            cluster.logs = _logs_dir(ray)
            cluster.watch_new()
            return cluster

    def temp_dir(self, log_dir: str) -> str:
        """Ray's temp dir for logs in ``log_dir``. Ray makes its Unix sockets in there,
        and a socket's path must be short (108 bytes): a long ``log_dir`` is reached
        through a link in the system's temp dir, which close (or the guard) removes."""
        real = Path(log_dir).resolve()
        real.mkdir(parents=True, exist_ok=True)
        if len(str(real)) <= _SHORT_DIR:
            return str(real)
        link = os.path.join(tempfile.gettempdir(), f"rlnb-ray-{secrets.token_hex(4)}")
        os.symlink(real, link)
        self.link = link
        if self._guard is not None:
            self._guard.send(f"remove {link}")
        return link

    def hear_deaths(self, workers: Mapping[str, Callable[[str, str], None] | None]) -> None:
        """The raylet's report of each of these workers' deaths goes to its callback, not
        to the cell (:func:`report_deaths`)."""
        report_deaths(self.ray, workers)

    def watch_new(self) -> None:
        """Tell the guard about Ray's processes started since the last look (only
        Ray's: the prompt loader's workers and multiprocessing's forkserver are not)."""
        if self._guard is None:
            return
        for proc in psutil.Process().children(recursive=True):
            if proc.pid not in self._procs and is_ray_process(proc):
                self._procs[proc.pid] = proc
                self._guard.watch([proc.pid])

    def close(self, timeout: float | None = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        ray = self.ray
        if self.placement is not None and ray.is_initialized():
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.placement)
            except Exception:  # the cluster is gone already
                pass
        if not self.connected:
            return
        self.watch_new()
        if ray.is_initialized():
            ray.shutdown()
        # Ray's core worker keeps its threads, event loops, sockets and log files after
        # shutdown, for the life of the process: Ray's, not this session's, so the leak
        # checks leave them out and the probe says why.
        from rlnb.runtime import note_process_long

        open_now = _open_fds()
        note_process_long(
            fds=[fd for fd, where in open_now.items() if self._fds_before.get(fd) != where],
            native_threads=[tid for tid in _native_threads() if tid not in self._threads_before],
            owner="Ray",
            reason=KEPT_AFTER_SHUTDOWN,
        )
        if not self.owned:
            return
        deadline = time.monotonic() + (timeout or 10.0)
        alive = [p for p in self._procs.values() if _running(p)]
        _, alive = psutil.wait_procs(alive, timeout=max(0.0, deadline - time.monotonic()))
        for proc in alive:  # Ray's agents outlive ray.shutdown() for a while
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=2.0)
        if self.link is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.link)
        if self._guard is not None:
            self._guard.close(kill=False)


# Ray's metrics feed its dashboard, which a session does not start. Once a process has
# called ray.init a second time, the driver's metrics exporter outlives ray.shutdown():
# it tries to reach the gone cluster's metrics agent every few seconds for good, each
# try on a new socket (attached, it stays connected to the cluster). Off for a cluster
# of the session's own (every process of it) and for this driver when it attaches.
_NO_METRICS = {"enable_metrics_collection": False}


@contextlib.contextmanager
def _no_driver_metrics() -> Iterator[None]:
    """Turn Ray's metrics off for this process's driver while ``ray.init`` reads its
    settings (a cluster attached to takes no ``_system_config``; its own processes
    keep theirs)."""
    name, before = "RAY_enable_metrics_collection", os.environ.get("RAY_enable_metrics_collection")
    os.environ[name] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _logs_dir(ray: Any) -> str | None:
    """Where the Ray session this process is connected to keeps its logs, as a real
    path (not through the short link, which close removes); None if Ray does not say."""
    try:
        logs = ray._private.worker._global_node.get_logs_dir_path()
    except Exception:  # another Ray version, or a client connection: no local node
        return None
    return os.path.realpath(logs) if logs else None


# -- the raylet's reports of dead workers ----------------------------------------------------

# Ray's driver prints every error the cluster publishes for its job, from a thread of
# its own; for a worker that dies, the raylet's paragraph guessing at the cause (the OOM
# killer, `ray stop --force`, a segfault). For a replica the engine remakes, the engine
# says what happened instead, in one line with the worker's log file: the raylet's
# report about one of those workers goes to the engine, every other message prints.
_WORKER_ID = re.compile(r"Worker ID: ([0-9a-f]+)")
_REPORTS_LOCK = threading.Lock()
_REPORTED: dict[str, Callable[[str, str], None] | None] = {}  # worker id -> whom to tell (None: nobody now)


def report_deaths(ray: Any, workers: Mapping[str, Callable[[str, str], None] | None]) -> None:
    """Hand the raylet's report of each of these workers' deaths to its callback, as
    ``callback(worker_id, report)`` on Ray's printing thread, instead of printing it
    (``None``: drop it, the worker's engine has closed). Where Ray prints some other
    way (another version), its reports print as they did."""
    _take_over_printer(ray)
    with _REPORTS_LOCK:
        _REPORTED.update(workers)


def _take_over_printer(ray: Any) -> None:
    module: Any = getattr(getattr(ray, "_private", None), "worker", None)
    printer = getattr(module, "print_to_stdstream", None)
    if printer is None or getattr(printer, "_rlnb_reports", False):
        return

    @functools.wraps(printer)
    def print_to_stdstream(data: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(data, dict) and data.get("pid") == "raylet" and _reported(data.get("lines") or []):
            return None
        return printer(data, *args, **kwargs)

    print_to_stdstream._rlnb_reports = True  # type: ignore[attr-defined]
    module.print_to_stdstream = print_to_stdstream


def _reported(lines: list[str]) -> bool:
    """Whether every line is a report about a worker registered here (each then sent on)."""
    callbacks = []
    for line in lines:
        found = _WORKER_ID.search(line) if isinstance(line, str) else None
        with _REPORTS_LOCK:
            if found is None or found[1] not in _REPORTED:
                return False
            callbacks.append((_REPORTED[found[1]], found[1], line))
    for callback, worker_id, line in callbacks:
        if callback is not None:
            with contextlib.suppress(Exception):  # Ray's printing thread must go on
                callback(worker_id, line)
    return bool(callbacks)


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """ConfigError at once if nothing listens at a ``HOST:PORT`` (or ``ray://HOST:PORT``)
    address: Ray itself retries for over a minute, warning on stderr all the while."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", or a form Ray checks itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(
            f"RayConfig.address={address!r} is invalid: nothing answers at {host}:{port} ({exc.strerror or exc}); "
            f"start a cluster there with `ray start --head --port={port}`, or use address=None for a local "
            "cluster of the session's own"
        ) from None


@contextlib.contextmanager
def _single_node(ray: Any) -> Iterator[None]:
    """Keep a session's own cluster on loopback. Ray turns ``_node_ip_address="127.0.0.1"``
    into "this machine's address" by probing a route to 8.8.8.8 (a C++ warning on stderr
    where there is none: a red box in a notebook). It skips that and keeps loopback when
    it is not to form a multi-node cluster, as on macOS and Windows
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``); a cluster of the session's own never is."""
    constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
    if constants is None or not hasattr(constants, "ENABLE_RAY_CLUSTER"):
        yield  # another Ray version: its own way
        return
    before = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = before


# Attempts at starting a local cluster, and how long Ray's ``ray.init`` waits for its
# raylet to register before it gives up (``raylet_start_wait_time_s``, hard-coded in Ray).
_START_ATTEMPTS = 3
_RAY_START_WAIT = 30.0


def _kill_failed_node(exc: BaseException) -> None:
    """Kill, through Ray's own handles, the processes that a ``ray.init`` which raised
    had started (Ray leaves them running: nobody holds its node any more). Its node is
    found in the failure's traceback; close then kills whatever remains."""
    tb = exc.__traceback__
    while tb is not None:
        node: Any = tb.tb_frame.f_locals.get("self")
        if type(node).__name__ == "Node" and hasattr(node, "kill_all_processes"):
            with contextlib.suppress(Exception):
                node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            return
        tb = tb.tb_next


def _slow_start(exc: BaseException) -> bool:
    """``ray.init``'s failure when its raylet did not register in time (it aborts when
    its agents are slow to write their ports: a busy machine, a cold page cache)."""
    return "timed out during startup" in str(exc)


# Ray's sockets are <temp dir>/session_<date>_<time>_<pid>/sockets/plasma_store, 64
# bytes past the temp dir; a Unix socket's path has 107.
_SHORT_DIR = 40


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _native_threads() -> dict[int, str]:
    """This process's threads that are a library's own (C++ ones, such as Ray's and
    gRPC's), by OS thread id: not Python's, and not named as the process is (OpenMP's
    threads keep its name). Empty where /proc cannot tell."""
    python = {t.native_id for t in threading.enumerate()}
    found: dict[int, str] = {}
    try:
        with open("/proc/self/comm") as f:
            own = f.read().strip()
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # ended meanwhile
            continue
        if int(task) not in python and name != own:
            found[int(task)] = name
    return found


def _open_fds() -> dict[int, str]:
    """This process's open FDs and what each points to."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (or the listing's own)
            continue
    return out


def is_ray_process(proc: psutil.Process) -> bool:
    """One of Ray's own processes: GCS, raylet, a worker or actor (``ray::...``), or
    one of Ray's Python scripts (its log monitor, agents). Zombies and the gone: no."""
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        name, cmdline = proc.name(), proc.cmdline()
    except psutil.Error:
        return False
    if name in ("raylet", "gcs_server") or name.startswith("ray::"):
        return True
    # python [-u] .../ray/.../log_monitor.py ...: the script is the first argument that is not a flag
    script = next((arg for arg in cmdline[1:] if not arg.startswith("-")), "")
    return f"{os.sep}ray{os.sep}" in script and script.endswith(".py")

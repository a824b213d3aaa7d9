"""``OpenEnvServer``: an OpenEnv environment's server as a child process this process owns.

An OpenEnv environment is a FastAPI app (``create_fastapi_app(MyEnvironment, MyAction,
MyObservation)``) that clients drive over a WebSocket. The server runs the app with
uvicorn in a process of its own (:mod:`rlnb.envs._openenv_run`) on a free loopback
port, writes its output to a log file (uvicorn logs a traceback for each client that
disconnects: noise a notebook should not show), and goes away with its owner:
``close()``, the end of a ``with`` block, the owning session's close
(``sess.on_close(server.close)``), or the death of this process.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlnb._errors import ClosedError, ConfigError, RlnbError
from rlnb._reprs import short_repr

__all__ = ["OpenEnvServer", "OpenEnvServerError"]

_RUN = Path(__file__).with_name("_openenv_run.py")
POLL_S = 0.05  # between two looks at /health
LOG_TAIL = 2000  # characters of the server's log an error quotes


class OpenEnvServerError(RlnbError, RuntimeError):
    """The OpenEnv server did not start (it exited, or /health never answered in time);
    the message quotes the end of its log."""


class OpenEnvServer:
    """Serves an OpenEnv app in a child process on ``host`` and a free port, until
    :meth:`close`. A context manager. Blocks until ``GET /health`` answers healthy.

    app: where the server finds the app: ``"module:attr"`` (uvicorn's form; the module
        must be importable from ``cwd``, so an environment written in a notebook goes in
        a file first, e.g. with ``%%writefile guess_env.py``), or a function of no
        arguments that makes the app, defined in such a module.
    factory: ``app``'s ``"module:attr"`` names a function that makes the app.
    host: the address to listen on; loopback unless you mean to share it.
    port: the port; 0 (the default) picks a free one.
    cwd: the server's working directory, which it imports ``app`` from (this
        process's by default).
    env: environment variables to set for the server, beside this process's.
    log: the file the server's output goes to; by default a temporary one that
        :meth:`close` removes. :attr:`log_path` says where it is.
    start_timeout_s: how long to wait for ``/health`` (importing openenv alone takes
        seconds).
    stop_timeout_s: how long :meth:`close` waits after SIGTERM before SIGKILL.

    The server's process group is killed when this process dies, however it dies.
    Raises :class:`~rlnb.ConfigError` for an ``app`` it cannot name, and
    :class:`OpenEnvServerError` when the server exits or stays unhealthy.
    """

    def __init__(
        self,
        app: str | Any,
        *,
        factory: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        log: str | os.PathLike[str] | None = None,
        start_timeout_s: float = 60.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        self.app = _app_spec(app)
        factory = factory or inspect.isfunction(app)
        self.host = host
        self.stop_timeout_s = stop_timeout_s
        self._own_log = log is None
        if log is None:
            fd, name = tempfile.mkstemp(prefix="rlnb-openenv-", suffix=".log")
            os.close(fd)
            log = name
        self.log_path = Path(log)
        self._proc: subprocess.Popen[bytes] | None = None
        self._closed = False
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            self.port: int = sock.getsockname()[1]
            self._start(sock, factory, cwd, env)
        except BaseException:
            sock.close()
            self.close()
            raise
        sock.close()  # the server holds its own copy
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        """The base URL a client connects to (``http://127.0.0.1:PORT``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server process's id (None once closed)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.url
        return f"OpenEnvServer({self.app!r}, {state})"

    def __enter__(self) -> OpenEnvServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(
        self, sock: socket.socket, factory: bool, cwd: str | os.PathLike[str] | None, env: Mapping[str, str] | None
    ) -> None:
        command = [sys.executable, str(_RUN), "--app", self.app, "--fd", str(sock.fileno())]
        command += ["--owner", str(os.getpid())]
        if factory:
            command.append("--factory")
        environ = {**os.environ, **(env or {})}
        with open(self.log_path, "ab") as out:
            self._proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=(sock.fileno(),),
                cwd=os.fspath(cwd) if cwd is not None else None,
                env=environ,
                start_new_session=True,  # a group of its own: close() kills what it started too
            )

    def _wait_healthy(self, timeout: float) -> None:
        assert self._proc is not None
        health = f"{self.url}/health"
        deadline = time.monotonic() + timeout
        # A proxy set for the notebook's internet access must not take a loopback request.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while True:
            code = self._proc.poll()
            if code is not None:
                raise OpenEnvServerError(
                    f"the OpenEnv server for app={self.app!r} exited with code {code} before GET {health} "
                    f"answered; its log ({self.log_path}) ends:\n{self._log_tail()}"
                )
            with contextlib.suppress(OSError, ValueError):
                with opener.open(health, timeout=1.0) as answer:
                    if json.loads(answer.read()).get("status") == "healthy":
                        return
            if time.monotonic() >= deadline:
                raise OpenEnvServerError(
                    f"the OpenEnv server for app={self.app!r} did not answer GET {health} with "
                    f'{{"status": "healthy"}} within start_timeout_s={timeout}; its log ({self.log_path}) '
                    f"ends:\n{self._log_tail()}"
                )
            time.sleep(POLL_S)

    def _log_tail(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return text[-LOG_TAIL:] or "(empty)"

    def check(self) -> None:
        """Raise :class:`~rlnb.ClosedError` once closed, or :class:`OpenEnvServerError`
        if the server has exited."""
        if self._closed:
            raise ClosedError(f"{self!r} is closed; start another OpenEnvServer")
        if self._proc is not None and (code := self._proc.poll()) is not None:
            raise OpenEnvServerError(
                f"the OpenEnv server for app={self.app!r} exited with code {code}; its log ({self.log_path}) "
                f"ends:\n{self._log_tail()}"
            )

    def close(self) -> None:
        """Stop the server: SIGTERM to its process group, SIGKILL after
        ``stop_timeout_s``; remove the log file if it made it. Idempotent; blocks
        until the process is gone."""
        self._closed = True
        proc, self._proc = self._proc, None
        if proc is not None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc, signal.SIGKILL)  # what the server started, even if it exited
            proc.wait()
        if self._own_log:
            with contextlib.suppress(OSError):
                self.log_path.unlink()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _app_spec(app: Any) -> str:
    """``"module:attr"`` for ``app``. Raises ConfigError for what a server process cannot import."""
    if isinstance(app, str):
        module, _, attr = app.partition(":")
        if module and attr and all(part.isidentifier() for part in (*module.split("."), *attr.split("."))):
            return app
        raise ConfigError(f"OpenEnvServer(app={app!r}) is invalid: name the app as 'module:attr', e.g. 'guess_env:app'")
    if not inspect.isfunction(app):  # an app object does not know the name its module holds it by
        raise ConfigError(
            f"OpenEnvServer(app={short_repr(app)}) is invalid: name the app as 'module:attr' (e.g. "
            "'guess_env:app'), or pass the function of no arguments that makes it"
        )
    module, name = app.__module__, app.__qualname__
    if module == "__main__" or "<" in name:
        raise ConfigError(
            f"OpenEnvServer(app={short_repr(app)}) is invalid: the server runs in another process, which cannot "
            "import what a notebook or script defines; put the environment in a module file (in a notebook: "
            "%%writefile my_env.py) and pass app='my_env:app'"
        )
    return f"{module}:{name}"

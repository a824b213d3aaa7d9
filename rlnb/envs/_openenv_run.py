"""The process an :class:`~rlnb.envs.OpenEnvServer` starts: an OpenEnv app served by uvicorn.

Run as a script (``python _openenv_run.py --app module:attr --fd N --owner PID``),
it imports nothing from rlnb. It serves on the listening socket it inherits as ``fd``
(the owner bound it to a free loopback port, so no other process can take the port
between the choice and the bind), and kills its process group when the owner dies:
``PR_SET_PDEATHSIG`` would follow the owner's thread that started it, not the
owner, so a thread watches the owner's pidfd instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any


def _die_with(owner: int) -> None:
    """Kill this process group once ``owner`` (the parent) is gone."""
    try:
        fd: int | None = os.pidfd_open(owner)
    except (AttributeError, OSError):  # an old kernel: poll the parent instead
        fd = None
    if os.getppid() != owner:  # it died before we watched it
        os.killpg(os.getpid(), signal.SIGKILL)
    while True:
        if fd is not None:
            select.select([fd], [], [])
        else:
            time.sleep(0.2)
        if fd is not None or os.getppid() != owner:
            os.killpg(os.getpid(), signal.SIGKILL)


def _load(spec: str, factory: bool) -> Any:
    module_name, _, attr = spec.partition(":")
    value: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        value = getattr(value, part)
    return value() if factory else value


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--app", required=True)
    parser.add_argument("--factory", action="store_true")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--owner", type=int, required=True)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv[1:])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a notebook's interrupt is for the owner
    threading.Thread(target=_die_with, args=(args.owner,), name="owner-watch", daemon=True).start()
    sys.path[0] = os.getcwd()  # not this file's folder: the app's modules are the owner's
    app = _load(args.app, args.factory)

    import uvicorn

    sock = socket.socket(fileno=args.fd)
    # No keepalive pings: a client's event loop runs only while rlnb calls its environment, so
    # between two turns (a long generation, a pause) it cannot answer them, and uvicorn would
    # close the session 40 s on. On loopback a client that dies closes its connection anyway.
    config = uvicorn.Config(app, log_level=args.log_level, lifespan="auto", ws_ping_interval=None)
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""A real Jupyter kernel for benchmarks, driven through jupyter_client."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from rlnb._errors import BackgroundError

__all__ = ["Kernel"]

TIMEOUT = 120.0


class Kernel:
    """A python3 kernel started in ``workdir`` (its history and connection file go
    there); ``ok(code)`` runs a cell and returns its stdout, raising on an error.
    Use it as a context manager: the kernel is shut down on exit."""

    def __init__(self, workdir: Path) -> None:
        try:
            import zmq
            from jupyter_client import KernelManager
        except ImportError as exc:  # pragma: no cover - the dev and notebook extras have it
            raise BackgroundError("this benchmark needs jupyter_client: pip install 'rlnb[dev]'") from exc
        self._ctx = zmq.Context()
        self._km = KernelManager(kernel_name="python3", context=self._ctx, connection_file=str(workdir / "kernel.json"))
        self._km.start_kernel(env={**os.environ, "IPYTHONDIR": str(workdir / "ipython")}, cwd=str(workdir))
        self._kc: Any = self._km.client(context=self._ctx)
        self._kc.start_channels()
        self._kc.wait_for_ready(timeout=TIMEOUT)

    def ok(self, code: str, timeout: float = TIMEOUT) -> str:
        out: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                out.append(msg["content"]["text"])

        reply = self._kc.execute_interactive(code, timeout=timeout, output_hook=hook)["content"]
        if reply["status"] != "ok":
            raise BackgroundError(f"the kernel raised {reply.get('ename')}: {reply.get('evalue')}")
        return "".join(out)

    def close(self) -> None:
        self._kc.stop_channels()
        if self._km.has_kernel:
            self._km.shutdown_kernel(now=False)
        self._ctx.destroy(linger=0)
        # jupyter_client's blocking API runs on a loop jupyter_core made for this thread
        try:
            loop = asyncio.get_event_loop()
        except RuntimeError:
            return
        loop.close()
        asyncio.set_event_loop(None)

    def __enter__(self) -> Kernel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

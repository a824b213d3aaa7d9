"""Python processes a test starts: ``python -c CODE``, a script, ``python -m rlnb``.

Tests get them through the ``start_python`` and ``run_cli`` fixtures
(tests/conftest.py), which put them in the integration tier."""

from __future__ import annotations

import subprocess
import sys
from typing import Any


class PythonProcesses:
    """``self(*args, **popen_options)`` starts ``python ARGS`` (this interpreter) with
    its stdout and stderr piped as text; ``close()`` kills each one still running,
    reaps them all and closes their pipes."""

    def __init__(self) -> None:
        self._started: list[subprocess.Popen[str]] = []

    def __call__(self, *args: str, **options: Any) -> subprocess.Popen[str]:
        options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **options}
        proc: subprocess.Popen[str] = subprocess.Popen([sys.executable, *args], **options)
        self._started.append(proc)
        return proc

    def close(self) -> None:
        while self._started:
            proc = self._started.pop()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()


def run_cli(*args: str, timeout: float = 300, **options: Any) -> subprocess.CompletedProcess[str]:
    """``python -m rlnb ARGS`` to its end (``timeout`` seconds at most); its stdout and
    stderr captured as text unless ``options`` say otherwise (``subprocess.run``'s)."""
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **options}
    return subprocess.run([sys.executable, "-m", "rlnb", *args], timeout=timeout, check=False, **options)

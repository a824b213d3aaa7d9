"""What every benchmark returns: figures, and targets judged as ratios within one run."""

from __future__ import annotations

import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Target:
    """One goal: ``value`` compared with ``limit`` by ``op`` (``<=`` or ``>=``)."""

    name: str
    value: float
    op: str
    limit: float
    unit: str = ""

    @property
    def ok(self) -> bool:
        return self.value <= self.limit if self.op == "<=" else self.value >= self.limit

    def line(self) -> str:
        mark = "PASS" if self.ok else "MISS"
        return f"  [{mark}] {self.name}: {self.value:.3g}{self.unit} (target {self.op} {self.limit:g}{self.unit})"


@dataclasses.dataclass(frozen=True)
class BenchResult:
    name: str
    figures: dict[str, Any]
    targets: tuple[Target, ...]

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.targets)

    def to_json(self) -> str:
        return json.dumps(
            {
                "bench": self.name,
                "ok": self.ok,
                "figures": self.figures,
                "targets": {t.name: {"value": t.value, "op": t.op, "limit": t.limit, "ok": t.ok} for t in self.targets},
            },
            sort_keys=True,
        )

    def report(self) -> str:
        lines = [f"rlnb bench {self.name}"]
        lines += [f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}" for k, v in self.figures.items()]
        lines += [t.line() for t in self.targets]
        return "\n".join(lines)


def time_calls_us(fn: Callable[[], object], n: int) -> list[float]:
    """Wall time of ``n`` calls of ``fn``, each in microseconds."""
    out = []
    for _ in range(n):
        start = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - start) / 1e3)
    return out


def time_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1e6


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[98] if len(xs) > 1 else xs[0]


def peak_rss_mib() -> float:
    """This process's peak RSS in MiB: Linux's ``VmHWM``, not ``ru_maxrss``, which a
    process started by ``fork`` and ``exec`` inherits from its parent (a bench that
    measures each variant in a child of its own would read its own peak there)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class ChildFailed(Exception):
    """A benchmark's child process exited non-zero or printed nothing: its exit status
    and the last lines of its stderr."""

    def __init__(self, returncode: int, stderr: list[str]) -> None:
        super().__init__(f"exited {returncode}")
        self.returncode, self.stderr = returncode, stderr


def json_from_child(code: str, spec: Any, timeout: float) -> dict[str, Any]:
    """Run ``python -c code SPEC`` (``spec`` as JSON) in a fresh process and return the
    JSON of its last line of stdout. Raises :class:`ChildFailed`, or
    ``subprocess.TimeoutExpired`` after ``timeout`` s."""
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, timeout=timeout, check=False
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ChildFailed(proc.returncode, proc.stderr.strip().splitlines()[-20:])
    figures: dict[str, Any] = json.loads(lines[-1])
    return figures

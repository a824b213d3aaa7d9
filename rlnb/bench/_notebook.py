"""``rlnb bench notebook``: a real Jupyter kernel with background training running.

- **Kernel responsiveness:** the round trip of a trivial cell (execute request to
  reply, through jupyter_client) while a session trains in the background.
- **Button to quiescent:** from ``click()`` of the dashboard's Pause button (mode
  "abort") to the engine holding no request, timed inside the kernel.
- **Dashboard overhead:** background training steps/s with a live dashboard (its
  ticker updating the widgets) over steps/s without one, interleaved in one run.
  Each round's dashboard is made, and has drawn once, before its clock starts:
  the target is the cost of keeping it up to date, not of building it.

The kernel listens on 127.0.0.1 only; run it inside a loopback-only network
namespace where that is the rule (``../shared/bin/netns-run`` in this project).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from rlnb.bench._common import BenchResult, Target, median, p99

SETUP = """
import json, statistics, threading, time
import rlnb
sess = rlnb.Session(rlnb.Config(seed=0), name="bench-notebook")
sess.step()  # warm: the first step pays for lazy imports
sess.start()
"""

# Pause (abort) by the dashboard's button, then wait for the engine to hold nothing.
PAUSE = """
dash = sess.dashboard()
dash.pause_mode.value = "abort"
tick, times = threading.Event(), []
for _ in range({n}):
    sess.resume()
    deadline = time.monotonic() + 5
    while sess.statistics().engine.running == 0 and time.monotonic() < deadline:
        tick.wait(0.001)
    start = time.perf_counter()
    dash.buttons["pause"].click()
    while (e := sess.statistics().engine).running or e.waiting:
        tick.wait(0.0002)
    times.append((time.perf_counter() - start) * 1e3)
sess.resume()
print(json.dumps(times))
"""

# Steps/s of background runs with and without a live dashboard, interleaved.
OVERHEAD = """
sess.stop()
dash.close()
rates = {{"plain": [], "dashboard": []}}
for _ in range({rounds}):
    for kind in ("plain", "dashboard"):
        board = sess.dashboard() if kind == "dashboard" else None
        while board is not None and board.ticks < 2:  # built, and drawn once
            tick.wait(0.01)
        start = time.perf_counter()
        sess.start(steps={steps})
        sess.wait()
        rates[kind].append({steps} / (time.perf_counter() - start))
        if board is not None:
            board.close()
print(json.dumps(rates))
"""


def run(*, cells: int = 100, clicks: int = 50, rounds: int = 5, steps: int = 60) -> BenchResult:
    from rlnb.bench._kernel import Kernel

    with tempfile.TemporaryDirectory(prefix="rlnb-bench-") as tmp, Kernel(Path(tmp)) as kernel:
        kernel.ok(SETUP)
        round_trips = []
        for _ in range(cells):
            start = time.perf_counter()
            kernel.ok("1")
            round_trips.append((time.perf_counter() - start) * 1e3)
        pause_ms = json.loads(kernel.ok(PAUSE.format(n=clicks)))
        rates = json.loads(kernel.ok(OVERHEAD.format(rounds=rounds, steps=steps)))
        kernel.ok("sess.close()")
    ratio = median(rates["dashboard"]) / median(rates["plain"])
    figures: dict[str, Any] = {
        "cell_round_trip_median_ms": round(median(round_trips), 2),
        "cell_round_trip_p99_ms": round(p99(round_trips), 2),
        "pause_click_to_quiescent_median_ms": round(median(pause_ms), 2),
        "pause_click_to_quiescent_p99_ms": round(p99(pause_ms), 2),
        "steps_per_s_plain": [round(r, 2) for r in rates["plain"]],
        "steps_per_s_dashboard": [round(r, 2) for r in rates["dashboard"]],
        "dashboard_over_plain": round(ratio, 3),
        "cpus": os.cpu_count(),
    }
    return BenchResult(
        "notebook",
        figures,
        (
            Target("cell_round_trip_p99", figures["cell_round_trip_p99_ms"], "<=", 50.0, " ms"),
            Target("pause_click_to_quiescent_p99", figures["pause_click_to_quiescent_p99_ms"], "<=", 100.0, " ms"),
            Target("dashboard_over_plain_steps_per_s", ratio, ">=", 0.95),
        ),
    )

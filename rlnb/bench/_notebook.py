"""``rlnb bench notebook``: a real Jupyter kernel with background training running.

- **Kernel responsiveness:** the round trip of a trivial cell (execute request to
  reply, through jupyter_client) while a session trains in the background.
- **Button to quiescent:** from ``click()`` of the dashboard's Pause button (mode
  "abort") to the engine holding no request, timed inside the kernel.
- **Apply to the new lr:** from ``click()`` of the settings panel's Apply, with a
  new lr typed in, to the end of the first step whose record has that lr, against
  the median step time of the same background run (step end to step end). Each
  click lands at a random moment of a step, as a person's would. A step reads the
  learner's settings when its update starts, after its rollouts (sync mode), so a
  click during the rollouts is trained on in that step and one during the update
  in the next: with clicks spread evenly over a step of time T whose rollouts take
  R, the median is 1.5 T - R, within one step when rollouts take half of it or more.
  Also reported: how long the click's handler took, and the share of clicks the
  step under way took up.
- **Dashboard overhead:** background training steps/s with a live dashboard (its
  ticker updating the widgets) over steps/s without one, interleaved in one run.
  Each round's dashboard is made, and has drawn once, before its clock starts:
  the target is the cost of keeping it up to date, not of building it.
- **Explorer render:** ``sess.explore()`` of the last batch (16 groups x 8 samples,
  addition) while training runs in the background, then ``show(color=..., sort=...)``
  once per colour quantity: its HTML built (each colour's first use colours every
  token) and set as the widget's value, timed in the kernel. The last explorer stays
  shown for the rest of the benchmark, whose other targets must hold beside it.

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
sess.training.start()
"""

# The explorer of the last 16 x 8 batch: made, then each colour shown once (sorted
# differently each time); the last one stays displayed while the rest runs.
EXPLORER = """
from IPython.display import display
quantities = ("behaviour", "learner", "ratio", "version", "advantage")
sorts = ("reward", "advantage", "lag", "length", "batch")
made, renders, sizes, ex = [], [], [], None
for _ in range({n}):
    if ex is not None:
        ex.close()
    start = time.perf_counter()
    ex = sess.explore()
    made.append((time.perf_counter() - start) * 1e3)
    for quantity, order in zip(quantities, sorts):
        start = time.perf_counter()
        ex.show(color=quantity, sort=order)
        renders.append((time.perf_counter() - start) * 1e3)
        sizes.append(len(ex.html()))
samples = ex.html().count('class="rlnb-sample"')
display(ex)
print(json.dumps({{"made": made, "renders": renders, "sizes": sizes, "samples": samples}}))
"""

# Pause (abort) by the dashboard's button, then wait for the engine to hold nothing.
PAUSE = """
dash = sess.dashboard()
dash.pause_mode.value = "abort"
tick, times = threading.Event(), []
for _ in range({n}):
    sess.rollouts.resume()
    deadline = time.monotonic() + 5
    while sess.statistics().engine.running == 0 and time.monotonic() < deadline:
        tick.wait(0.001)
    start = time.perf_counter()
    dash.buttons["pause"].click()
    while (e := sess.statistics().engine).running or e.waiting:
        tick.wait(0.0002)
    times.append((time.perf_counter() - start) * 1e3)
sess.rollouts.resume()
print(json.dumps(times))
"""

# Apply a new lr from the settings panel, then wait for the first step trained with it.
APPLY = """
import random
from rlnb.learn import Callback
class Ends(Callback):
    def __init__(self):
        self.times, self.lr, self.at, self.seen = [], None, None, threading.Event()
    def on_step_end(self, metrics):
        now = time.perf_counter()
        self.times.append(now)
        if self.lr is not None and self.at is None and metrics["lr"] == self.lr:
            self.at, self.version = now, int(metrics["version"])
            self.seen.set()
ends, rng, applied, handler, same = Ends(), random.Random(0), [], [], 0
sess.callbacks.append(ends)
while len(ends.times) < 3:
    tick.wait(0.01)
for i in range({n}):
    gaps = sorted(b - a for a, b in zip(ends.times, ends.times[1:]))
    tick.wait(rng.uniform(0, gaps[len(gaps) // 2]))  # a random moment of a step
    lr = (2e-4, 1e-4)[i % 2]
    ends.lr, ends.at = lr, None
    ends.seen.clear()
    dash.settings["lr"].value = lr
    before = sess.version
    start = time.perf_counter()
    dash.apply_button.click()
    handler.append((time.perf_counter() - start) * 1e3)
    if not ends.seen.wait(60) or "set at step" not in dash.settings_message.value:
        raise RuntimeError(f"no step trained with lr={{lr}} within 60 s: {{dash.settings_message.value}}")
    applied.append((ends.at - start) * 1e3)
    same += ends.version == before + 1
sess.callbacks.remove(ends)
gaps = [(b - a) * 1e3 for a, b in zip(ends.times, ends.times[1:])]
print(json.dumps({{"applied": applied, "steps": gaps, "handler": handler, "same": same / {n}}}))
"""

# Steps/s of background runs with and without a live dashboard, interleaved.
OVERHEAD = """
sess.training.stop()
dash.close()
rates = {{"plain": [], "dashboard": []}}
for _ in range({rounds}):
    for kind in ("plain", "dashboard"):
        board = sess.dashboard() if kind == "dashboard" else None
        while board is not None and board.ticks < 2:  # built, and drawn once
            tick.wait(0.01)
        start = time.perf_counter()
        sess.training.start(steps={steps})
        sess.training.wait()
        rates[kind].append({steps} / (time.perf_counter() - start))
        if board is not None:
            board.close()
print(json.dumps(rates))
"""


def run(
    *, cells: int = 100, clicks: int = 50, applies: int = 20, rounds: int = 5, steps: int = 60, explorers: int = 20
) -> BenchResult:
    from rlnb.bench._kernel import Kernel

    with tempfile.TemporaryDirectory(prefix="rlnb-bench-") as tmp, Kernel(Path(tmp)) as kernel:
        kernel.ok(SETUP)
        round_trips = []
        for _ in range(cells):
            start = time.perf_counter()
            kernel.ok("1")
            round_trips.append((time.perf_counter() - start) * 1e3)
        explorer = json.loads(kernel.ok(EXPLORER.format(n=explorers)))
        pause_ms = json.loads(kernel.ok(PAUSE.format(n=clicks)))
        apply = json.loads(kernel.ok(APPLY.format(n=applies), timeout=60.0 * applies))
        rates = json.loads(kernel.ok(OVERHEAD.format(rounds=rounds, steps=steps)))
        kernel.ok("ex.close()\nsess.close()")
    ratio = median(rates["dashboard"]) / median(rates["plain"])
    apply_ms, step_ms = median(apply["applied"]), median(apply["steps"])
    figures: dict[str, Any] = {
        "cell_round_trip_median_ms": round(median(round_trips), 2),
        "cell_round_trip_p99_ms": round(p99(round_trips), 2),
        "pause_click_to_quiescent_median_ms": round(median(pause_ms), 2),
        "pause_click_to_quiescent_p99_ms": round(p99(pause_ms), 2),
        "apply_click_to_new_lr_median_ms": round(apply_ms, 1),
        "apply_click_to_new_lr_max_ms": round(max(apply["applied"]), 1),
        "step_time_median_ms": round(step_ms, 1),
        "apply_over_step_time": round(apply_ms / step_ms, 3),
        "apply_handler_median_ms": round(median(apply["handler"]), 2),
        "apply_taken_by_the_step_under_way": round(apply["same"], 2),
        "steps_per_s_plain": [round(r, 2) for r in rates["plain"]],
        "steps_per_s_dashboard": [round(r, 2) for r in rates["dashboard"]],
        "dashboard_over_plain": round(ratio, 3),
        "explorer_samples": explorer["samples"],
        "explorer_make_median_ms": round(median(explorer["made"]), 1),
        "explorer_render_16x8_median_ms": round(median(explorer["renders"]), 2),
        "explorer_render_16x8_p99_ms": round(p99(explorer["renders"]), 2),
        "explorer_html_median_kb": round(median(explorer["sizes"]) / 1024, 1),
        "cpus": os.cpu_count(),
    }
    return BenchResult(
        "notebook",
        figures,
        (
            Target("cell_round_trip_p99", figures["cell_round_trip_p99_ms"], "<=", 50.0, " ms"),
            Target("pause_click_to_quiescent_p99", figures["pause_click_to_quiescent_p99_ms"], "<=", 100.0, " ms"),
            Target("dashboard_over_plain_steps_per_s", ratio, ">=", 0.95),
            Target("apply_click_to_new_lr_over_step_time", apply_ms / step_ms, "<=", 1.0),
            Target("explorer_render_16x8_p99", figures["explorer_render_16x8_p99_ms"], "<=", 200.0, " ms"),
        ),
    )

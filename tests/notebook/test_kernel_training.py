"""Training in a real Jupyter kernel, driven through jupyter_client as JupyterLab
would: background training leaves the kernel free, the interrupt button stops a
foreground train() in one line and never touches a background run, %rlnb works,
and a restart with training, the dashboard and an offline wandb run is graceful."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_client import BlockingKernelClient, KernelManager

from rlnb.track import EXIT_SIGINT, read_run
from tests.helpers import wait_until
from tests.helpers.kernel import TIMEOUT, OpenKernel, ok, run_cell

pytestmark = [pytest.mark.slow]

SETUP = """
import rlnb
config = rlnb.Config(
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
    track=rlnb.TrackConfig(backends=("wandb",), run_dir={run_dir!r}),
)
sess = rlnb.Session(config, name="k")
"""


def value(kc: BlockingKernelClient, expression: str) -> str:
    """``expression`` evaluated in the kernel, as its repr (read from the reply, not stdout)."""
    reply = kc.execute_interactive("", user_expressions={"v": expression}, timeout=TIMEOUT)
    assert reply["content"]["status"] == "ok", reply["content"]
    result = reply["content"]["user_expressions"]["v"]
    assert result["status"] == "ok", result
    return str(result["data"]["text/plain"])


# A cell that waits on the background run and creates ``marker`` once its main thread is
# inside the wait (a file made before the call could let the interrupt land between the
# two, a KeyboardInterrupt of the cell's own line: a race of the test, not of the session).
MARK_INSIDE_WAIT = """
import sys, threading, time
def _mark(main=threading.main_thread().ident):
    while True:
        frame = sys._current_frames().get(main)
        while frame is not None and frame.f_code.co_name != "wait_with_progress":
            frame = frame.f_back
        if frame is not None:
            open({marker!r}, "w").close()
            return
        time.sleep(0.005)
threading.Thread(target=_mark, daemon=True).start()
sess.training.wait()
"""


def interrupt_when(km: KernelManager, kc: BlockingKernelClient, code: str, ready: str) -> dict[str, Any]:
    """Run ``code`` and press the interrupt button once it has created the file
    ``ready``; return the execute reply's content."""
    # stop_on_error=False: after an error reply ipykernel aborts requests that reach it
    # before its own "stop aborting" message, and the next cell here can (a race).
    msg_id = kc.execute(code, stop_on_error=False)
    # the shell is busy with ``code``: the file says it has started
    wait_until(Path(ready).exists, f"{ready} to appear", TIMEOUT)
    km.interrupt_kernel()
    while True:
        reply = kc.get_shell_msg(timeout=TIMEOUT)
        if reply["parent_header"].get("msg_id") == msg_id:
            return dict(reply["content"])


def test_background_training_leaves_the_kernel_free_and_ctrl_c_is_one_line(
    tmp_path: Path, open_kernel: OpenKernel
) -> None:
    with open_kernel() as (km, kc):
        ok(kc, SETUP.format(run_dir=str(tmp_path / "run")))
        ok(kc, "sess.training.start()")
        started = time.monotonic()
        ok(kc, "1 + 1")  # a quick cell returns while training goes on
        quick = time.monotonic() - started
        first = int(value(kc, "sess.version"))
        assert value(kc, "sess.training.running") == "True"
        marker = tmp_path / "waiting"
        # The interrupt button while a cell waits on the background run: the wait stops,
        # the run goes on (SIGINT reaches the kernel's main thread only).
        reply = interrupt_when(km, kc, MARK_INSIDE_WAIT.format(marker=str(marker)), str(marker))
        assert reply["status"] == "error" and reply["ename"] == "Interrupted", reply
        assert len(reply["traceback"]) == 1 and "the background run goes on" in reply["traceback"][0]
        assert value(kc, "sess.training.running") == "True"
        wait_until(
            lambda: int(value(kc, "sess.version")) > first + 2,
            # say why: the statistics name what a step waits for
            lambda: (
                f"background training to go on after the interrupt:\n{value(kc, 'sess.statistics()')}\n"
                f"{value(kc, 'sess.stacks()')}"
            ),
            TIMEOUT,
        )
        ok(kc, "sess.training.stop()")
        assert value(kc, "sess.training.running") == "False"

        # Ctrl-C in a foreground train(): one line that says what was kept; train() goes on.
        marker = tmp_path / "training"
        code = (
            "class Mark(rlnb.learn.Callback):\n"
            f"    def on_step_end(self, m): open({str(marker)!r}, 'w').close()\n"
            "sess.callbacks.append(Mark())\n"
            "target = sess.version + 10000\n"
            "sess.train(until=target, progress=False)"
        )
        reply = interrupt_when(km, kc, code, str(marker))
        assert reply["status"] == "error" and reply["ename"] == "TrainingInterrupted", reply
        assert len(reply["traceback"]) == 1, reply["traceback"]  # one line, not a traceback
        assert "call train(until=" in reply["traceback"][0]
        stopped = int(value(kc, "sess.version"))
        assert int(value(kc, "len(sess.history)")) == stopped  # every step kept, none half-done
        ok(kc, "sess.callbacks.clear(); sess.train(2, progress=False)")
        assert int(value(kc, "sess.version")) == stopped + 2
        print(f"\na quick cell took {quick * 1e3:.1f} ms while training ran in the background")


def test_rlnb_magic_lists_shows_and_closes_sessions(tmp_path: Path, open_kernel: OpenKernel) -> None:
    with open_kernel() as (_, kc):
        ok(kc, "%load_ext rlnb\n%load_ext rlnb")  # idempotent
        ok(kc, SETUP.format(run_dir=str(tmp_path / "run")).replace('backends=("wandb",)', "backends=()"))
        listing = value(kc, "get_ipython().run_line_magic('rlnb', '')")
        assert "'k'" in listing and "step 0" in listing and "threads" in listing
        shown, _ = run_cell(kc, "board = get_ipython().run_line_magic('rlnb', 'dashboard k'); print(type(board))")
        assert "Dashboard" in shown
        out, _ = run_cell(kc, "%rlnb close")
        assert "closed 1 session(s) ['k']" in out
        assert value(kc, "rlnb.sessions()") == "[]"
        out, content = run_cell(kc, "%rlnb frobnicate")
        assert content["status"] == "error" and "usage: %rlnb" in content["evalue"]
        ok(kc, "%unload_ext rlnb\n%unload_ext rlnb")


def test_a_restart_while_training_with_the_dashboard_and_wandb_is_graceful(
    tmp_path: Path, open_kernel: OpenKernel
) -> None:
    run_dir = tmp_path / "run"
    with open_kernel() as (km, kc):
        ok(kc, SETUP.format(run_dir=str(run_dir)))
        ok(kc, "board = sess.dashboard(); sess.training.start()")
        wait_until(lambda: int(value(kc, "sess.version")) >= 2, "two steps of background training", TIMEOUT)
        assert km.provisioner is not None
        old = psutil.Process(km.provisioner.process.pid)
        family = [old, *old.children(recursive=True)]
        requested = time.monotonic()
        km.restart_kernel(now=False)
        _, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, f"processes of the old kernel survived: {alive}"
        took = time.monotonic() - requested
        assert old.pid not in {p.pid for p in psutil.Process().children(recursive=True)}
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    run = read_run(files[0])
    assert run.exit_code == EXIT_SIGINT  # the restart cut the run short, and said so
    assert [h["_step"] for h in run.history if "reward_mean" in h][:2] == [1, 2]
    print(
        f"\nrestart with background training: the old kernel and its children were gone {took:.2f} s after the request"
    )


def test_the_console_line_lives_in_the_cell_that_trains(tmp_path: Path, open_kernel: OpenKernel) -> None:
    made = SETUP.format(run_dir=str(tmp_path / "run")).replace('backends=("wandb",)', 'backends=("console",)')
    made = made.replace("rlnb.TrackConfig(", "rlnb.TrackConfig(console_every=2, ")
    with open_kernel() as (_, kc):
        first: list[dict[str, Any]] = []
        kc.execute_interactive(made, timeout=TIMEOUT, output_hook=first.append)
        assert not [m for m in first if m["msg_type"] == "display_data"]  # nothing shown where it was made
        for step in (2, 4):
            msgs: list[dict[str, Any]] = []
            reply = kc.execute_interactive("sess.train(2, progress=False)", timeout=TIMEOUT, output_hook=msgs.append)
            assert reply["content"]["status"] == "ok"
            # a new output in the cell that trains (an update of another cell's would be
            # update_display_data), which shows this cell's steps
            new = [m["content"]["data"].get("text/plain", "") for m in msgs if m["msg_type"] == "display_data"]
            assert len(new) == 1 and f"step {step} |" in new[0], [m["msg_type"] for m in msgs]


CLICK_EVERY_BUTTON = """
import json
board = sess.dashboard()
b, seen = board.buttons, {{}}
b["step"].click(); seen["step"] = sess.version
b["evaluate"].click(); seen["evaluate"] = len(sess.evaluations)
board.save_path.value = {path!r}; b["save"].click(); seen["save"] = board.message.value
b["start"].click(); seen["start"] = sess.training.running
for mode in ("abort", "keep", "wait"):
    board.pause_mode.value = mode; b["pause"].click(); sess.rollouts.wait_paused(timeout=60)
    seen[mode] = sess.statistics().rollout.state
    b["resume"].click(); seen[mode + " resumed"] = sess.statistics().rollout.state
b["stop"].click(); seen["stop"] = sess.training.running
print(json.dumps(seen))
"""


def test_every_dashboard_button_in_a_kernel_does_what_its_method_does(tmp_path: Path, open_kernel: OpenKernel) -> None:
    import json

    made = SETUP.format(run_dir=str(tmp_path / "run")).replace('backends=("wandb",)', "backends=()")
    with open_kernel() as (_, kc):
        ok(kc, made)
        seen = json.loads(ok(kc, CLICK_EVERY_BUTTON.format(path=str(tmp_path / "ckpt"))))
    assert seen["step"] == 1 and seen["evaluate"] == 1
    assert "saved to" in seen["save"] and (tmp_path / "ckpt" / "checkpoint.json").is_file()
    assert seen["start"] is True and seen["stop"] is False
    # background training syncs weights after every step: the state may read "syncing"
    # for a moment, which restores the state it found
    for mode in ("abort", "keep", "wait"):
        assert seen[mode] in ("paused", "syncing") and seen[mode + " resumed"] in ("running", "syncing"), seen


def test_live_settings_fork_and_what_if_in_a_kernel(open_kernel: OpenKernel) -> None:
    """Sync mode, from cells: a change is one line, a refused one is the error's one
    line (no traceback into rlnb), a fork steps as its parent does, a what-if shows
    its table and changes nothing, and every session closes."""
    from tests.helpers.kernel import cell_output

    setup = """
import rlnb
config = rlnb.Config(
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
    data=rlnb.DataConfig(num_workers=0),
    track=rlnb.TrackConfig(backends=("console",)),
)
sess = rlnb.Session(config, name="k")
sess.step()
"""
    with open_kernel() as (_, kc):
        ok(kc, setup)
        shown = cell_output(kc, "sess.set(lr=1e-3, temperature=0.7)")
        assert "rlnb: step 1: lr 0.0001 -> 0.001" in shown and "rlnb: step 1: temperature 1 -> 0.7" in shown, shown
        assert "Change(step=1, field='lr', old=0.0001, new=0.001" in shown, shown
        refused = re.sub(r"\x1b\[[0-9;]*m", "", cell_output(kc, "sess.set(lr=-1)"))  # no colours
        assert "ConfigError: LearnConfig.lr=-1 is invalid: use a learning rate > 0" in refused, refused
        assert "rlnb/config.py" not in refused and "_experiment_cells" not in refused, refused  # the call's own line
        assert value(kc, "sess.config.learn.lr") == "0.001"
        same = ok(
            kc,
            "b = sess.fork('k-b')\n"
            "x, y = sess.step(), b.step()\n"
            "print(all(x[k] == y[k] for k in x if k != 'train_tokens_per_s'), b.changes == sess.changes)",
        )
        assert same.strip().endswith("True True"), same
        table = cell_output(kc, "sess.what_if(lr=1e-2)")
        assert "what if lr=0.01, on the batch of step 2" in table and "update_kl" in table, table
        assert ok(kc, "print(sess.version, len(sess.history))").strip() == "2 2"
        closed = ok(kc, "b.close(); sess.close(); print(rlnb.sessions())")
        assert closed.strip().endswith("[]"), closed

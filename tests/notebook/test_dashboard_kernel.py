"""The dashboard in a real Jupyter kernel, driven through jupyter_client as a
frontend would: shown with a display id, a button clicked over its comm, and on
close every widget closed and the display swapped for the static copy."""

from __future__ import annotations

import contextlib
import queue
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import BlockingKernelClient

from tests.helpers import wait_until
from tests.helpers.kernel import TIMEOUT, OpenKernel, ok

pytestmark = [pytest.mark.slow]

SETUP = """
import rlnb
sess = rlnb.Session(rlnb.Config(
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
    data=rlnb.DataConfig(num_workers=0),
), name="k")
"""


def execute(kc: BlockingKernelClient, code: str) -> list[dict[str, Any]]:
    """Run ``code``; return every IOPub message it caused (an error reply fails)."""
    msgs: list[dict[str, Any]] = []
    reply = kc.execute_interactive(code, timeout=TIMEOUT, output_hook=msgs.append)
    assert reply["content"]["status"] == "ok", reply["content"]
    return msgs


def read_until(kc: BlockingKernelClient, done: Any, what: str) -> list[dict[str, Any]]:
    """IOPub messages from outside any cell (a click's), until ``done(msgs)``."""
    msgs: list[dict[str, Any]] = []

    def arrived() -> bool:
        if done(msgs):
            return True
        with contextlib.suppress(queue.Empty):
            msgs.append(kc.get_iopub_msg(timeout=0.1))
        return done(msgs)

    def instead() -> str:
        said = [v for m in msgs if m["msg_type"] == "comm_msg" for v in _texts(m)]
        return f"{what}; the widgets said {said[-8:]}"

    wait_until(arrived, instead, TIMEOUT)
    return msgs


def _texts(msg: dict[str, Any]) -> list[str]:
    """A widget update's texts (a message's value, a button's label), shortened."""
    state = msg["content"]["data"].get("state", {})
    return [str(state[k])[:160] for k in ("value", "description") if isinstance(state.get(k), str)]


def states(msgs: list[dict[str, Any]], comm_id: str, key: str) -> list[Any]:
    """The values ``key`` took in the state updates of widget ``comm_id``."""
    return [
        m["content"]["data"]["state"][key]
        for m in msgs
        if m["msg_type"] == "comm_msg"
        and m["content"]["comm_id"] == comm_id
        and key in m["content"]["data"].get("state", {})
    ]


def test_show_click_and_close_in_a_real_kernel(open_kernel: OpenKernel) -> None:
    with open_kernel() as (_, kc):
        ok(kc, SETUP)
        shown = execute(kc, "sess.dashboard()")
        (display,) = [m for m in shown if m["msg_type"] == "display_data"]
        assert "application/vnd.jupyter.widget-view+json" in display["content"]["data"]
        display_id = display["content"]["transient"]["display_id"]
        opened = {m["content"]["comm_id"]: m["content"]["data"]["state"] for m in shown if m["msg_type"] == "comm_open"}
        for m in shown:  # classes are added after a widget opens
            if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] in opened:
                opened[m["content"]["comm_id"]].update(m["content"]["data"].get("state", {}))
        step = next(i for i, s in opened.items() if s["_model_name"] == "ButtonModel" and s["description"] == "step")
        message = next(i for i, s in opened.items() if "rlnb-message" in s.get("_dom_classes", ()))

        click = kc.session.msg(
            "comm_msg", {"comm_id": step, "data": {"method": "custom", "content": {"event": "click"}}}
        )
        kc.shell_channel.send(click)
        after = read_until(kc, lambda msgs: states(msgs, step, "description")[-1:] == ["step"], "the step's end")
        assert states(after, step, "description") == ["step…", "step"]  # busy while the step ran
        assert "step 1: reward_mean" in states(after, message, "value")[-1]
        assert not [m for m in after if m["msg_type"] in ("stream", "error")]
        assert ok(kc, "print(sess.version)").strip() == "1"

        closing = execute(kc, "sess.close()")
        (update,) = [m for m in closing if m["msg_type"] == "update_display_data"]
        assert update["content"]["transient"]["display_id"] == display_id
        static = update["content"]["data"]["text/html"]
        assert "closed, exit code 0" in static and "data:image/svg+xml;base64," in static
        closed = {m["content"]["comm_id"] for m in closing if m["msg_type"] == "comm_close"}
        assert set(opened) <= closed  # every widget, layout and style: no model left for a saved notebook
        threads = ok(kc, "import threading; print([t.name for t in threading.enumerate()])")
        assert "rlnb-" not in threads


def opened_widgets(msgs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every widget the messages opened, by comm id, with the state it has after them."""
    opened = {m["content"]["comm_id"]: m["content"]["data"]["state"] for m in msgs if m["msg_type"] == "comm_open"}
    for m in msgs:  # classes are added after a widget opens
        if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] in opened:
            opened[m["content"]["comm_id"]].update(m["content"]["data"].get("state", {}))
    return opened


def widget(opened: dict[str, dict[str, Any]], *, button: str | None = None, css: str | None = None) -> str:
    """The comm id of the button labelled ``button``, or of the widget with class ``css``."""
    for comm_id, s in opened.items():
        if button is not None and s["_model_name"] == "ButtonModel" and s["description"] == button:
            return comm_id
        if css is not None and css in s.get("_dom_classes", ()):
            return comm_id
    raise AssertionError(f"no widget {button or css}")


def click(kc: BlockingKernelClient, comm_id: str, *, subshell: str | None = None) -> None:
    """What the page sends when a button is clicked (through ``subshell``, as JupyterLab
    does by default, or to the main shell)."""
    msg = kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {"method": "custom", "content": {"event": "click"}}})
    if subshell is not None:
        msg["header"]["subshell_id"] = subshell
    kc.shell_channel.send(msg)


def paused_and_on(message: str, resume: str) -> Callable[[list[dict[str, Any]]], bool]:
    """Whether the messages show the pause said so and the ``resume`` button come on: a
    person clicks it only then (the page sends no click for a button that is off)."""

    def done(msgs: list[dict[str, Any]]) -> bool:
        return "paused (abort)" in "".join(states(msgs, message, "value")) and False in states(msgs, resume, "disabled")

    return done


def make_subshell(kc: BlockingKernelClient) -> str:
    """Ask the kernel for a subshell, as JupyterLab does for widgets' messages; its id."""
    kc.control_channel.send(kc.session.msg("create_subshell_request", {}))
    reply = kc.control_channel.get_msg(timeout=TIMEOUT)["content"]
    assert reply["status"] == "ok", reply
    return str(reply["subshell_id"])


SLOW_STEPS = """
import time
from rlnb.learn import Callback
class Slow(Callback):
    def on_step_end(self, metrics):
        time.sleep(0.1)
sess.callbacks.append(Slow())
"""


def test_a_click_made_during_a_foreground_train_is_refused_not_run_late(
    tmp_path: Path, open_kernel: OpenKernel
) -> None:
    from rlnb.notebook._clicks import CLICK_GRACE

    with open_kernel() as (_, kc):
        ok(kc, SETUP)
        opened = opened_widgets(execute(kc, "sess.dashboard()"))
        pause, message = widget(opened, button="pause"), widget(opened, css="rlnb-message")
        state = widget(opened, css="rlnb-state")
        started = tmp_path / "training"
        # ~2.5 s of steps (a tenth of a second each at least): the ticker sees the call
        ok(kc, SLOW_STEPS)
        msg_id = kc.execute(f"open({str(started)!r}, 'w').close(); sess.train(25, progress=False)")
        wait_until(started.exists, "the cell to start", TIMEOUT)
        click(kc, pause)  # the kernel is busy: it holds the click until train() returns

        def refused(msgs: list[dict[str, Any]]) -> bool:
            return any("not run" in v for v in states(msgs, message, "value"))

        during = read_until(kc, refused, "the refused click")
        replies = [m for m in during if m["msg_type"] == "status" and m["parent_header"].get("msg_id") == msg_id]
        assert replies, "the click was handled before the cell ended"
        (said,) = [v for v in states(during, message, "value") if "not run" in v]
        assert "pause: not run. It was clicked while train(until=25) held the kernel" in said
        assert "pause…" not in states(during, pause, "description")  # it never ran
        # meanwhile the ticker showed the call and turned the buttons off
        assert True in states(during, pause, "disabled")
        assert any('data-state="foreground"' in v and "train(until=25)" in v for v in states(during, state, "value"))
        assert ok(kc, "print(sess.statistics().rollout.state, sess.version)").split() == ["running", "25"]

        # A click made once the call returned and the button came on, as a person sees it: it runs.
        on = "print(sess.dashboard().buttons['pause'].disabled)"
        wait_until(lambda: ok(kc, on).strip() == "False", "the pause button to come on after the call", TIMEOUT)
        time.sleep(CLICK_GRACE + 0.1)
        click(kc, pause)
        after = read_until(kc, lambda msgs: states(msgs, pause, "description")[-1:] == ["pause"], "the pause")
        assert "paused (abort)" in states(after, message, "value")[-1]
        assert ok(kc, "print(sess.statistics().rollout.state)").strip() == "paused"
        ok(kc, "sess.close()")


def test_through_a_subshell_pause_and_resume_work_beside_a_foreground_train(
    tmp_path: Path, open_kernel: OpenKernel
) -> None:
    with open_kernel() as (_, kc):
        ok(kc, SETUP.replace("rlnb.Config(", "rlnb.Config(mode='async', "))
        ok(kc, SLOW_STEPS)
        opened = opened_widgets(execute(kc, "sess.dashboard()"))
        subshell = make_subshell(kc)  # JupyterLab makes one and sends clicks with its id
        pause, resume, step = (widget(opened, button=name) for name in ("pause", "resume", "step"))
        message, state = widget(opened, css="rlnb-message"), widget(opened, css="rlnb-state")
        paused_and_resume_on = paused_and_on(message, resume)

        # A first click shows the dashboard the page's subshell: ipykernel routes a widget's
        # clicks to where its last update came from, and the dashboard's updates now say so.
        click(kc, pause, subshell=subshell)
        read_until(kc, paused_and_resume_on, "the first pause")
        click(kc, resume, subshell=subshell)
        read_until(kc, lambda msgs: "resumed" in "".join(states(msgs, message, "value")), "the first resume")
        assert ok(kc, "print(sess.dashboard().live_clicks)").strip() == "True"
        started = tmp_path / "training"
        msg_id = kc.execute(f"open({str(started)!r}, 'w').close(); sess.train(30, progress=False)")
        wait_until(started.exists, "the cell to start", TIMEOUT)

        def busy(msgs: list[dict[str, Any]]) -> bool:
            return any('data-state="foreground"' in v for v in states(msgs, state, "value"))

        during = read_until(kc, busy, "the foreground call in the panel")
        click(kc, step, subshell=subshell)
        during += read_until(kc, lambda msgs: bool(states(msgs, message, "value")), "the step's answer")
        assert "step: not run. train(until=30) is running in the foreground" in states(during, message, "value")[-1]
        click(kc, pause, subshell=subshell)
        during += read_until(kc, paused_and_resume_on, "pause")
        click(kc, resume, subshell=subshell)
        during += read_until(kc, lambda msgs: "resumed" in "".join(states(msgs, message, "value")), "resume")
        ended = [m for m in during if m["msg_type"] == "status" and m["parent_header"].get("msg_id") == msg_id]
        assert not [m for m in ended if m["content"]["execution_state"] == "idle"], "the cell had ended: not beside it"
        notice = widget(opened, css="rlnb-notice")
        assert any("pause and resume work meanwhile" in v for v in states(during, notice, "value"))
        assert "step…" not in states(during, step, "description")
        reply = kc.get_shell_msg(timeout=TIMEOUT)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=TIMEOUT)
        assert reply["content"]["status"] == "ok", reply["content"]
        assert ok(kc, "print(sess.version)").strip() == "30"
        ok(kc, "sess.close()")


def stepped_in_the_foreground(state: str) -> Callable[[list[dict[str, Any]]], bool]:
    """Whether the messages show the state panel ``state`` with a foreground call at
    policy version 1 or later: a step into the call."""

    def done(msgs: list[dict[str, Any]]) -> bool:
        for value in states(msgs, state, "value"):
            version = re.search(r"policy version</th><td[^>]*>(\d+) ", value)
            if 'data-state="foreground"' in value and version is not None and int(version[1]) >= 1:
                return True
        return False

    return done


def send_value(kc: BlockingKernelClient, comm_id: str, value: Any, *, subshell: str) -> None:
    """What the page sends when something is typed into an input widget."""
    data = {"method": "update", "state": {"value": value}, "buffer_paths": []}
    msg = kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
    msg["header"]["subshell_id"] = subshell
    kc.shell_channel.send(msg)


def test_through_a_subshell_apply_reads_what_was_typed_beside_a_foreground_train(
    tmp_path: Path, open_kernel: OpenKernel
) -> None:
    """A value typed into the settings panel while a cell trains reaches the kernel
    before the Apply click that reads it: once a click has shown the dashboard the
    page's subshell, its ticker routes every input's messages there, so a typed value
    does not wait behind the busy main shell while the click runs at once."""
    with open_kernel() as (_, kc):
        ok(kc, SETUP)
        ok(kc, SLOW_STEPS)
        opened = opened_widgets(execute(kc, "sess.dashboard()"))
        subshell = make_subshell(kc)
        pause, resume = widget(opened, button="pause"), widget(opened, button="resume")
        lr, apply = widget(opened, css="rlnb-setting-lr"), widget(opened, css="rlnb-settings-apply")
        message, said = widget(opened, css="rlnb-message"), widget(opened, css="rlnb-settings-message")
        state = widget(opened, css="rlnb-state")
        click(kc, pause, subshell=subshell)
        seen = read_until(kc, paused_and_on(message, resume), "the pause")
        click(kc, resume, subshell=subshell)
        seen += read_until(kc, lambda m: "resumed" in "".join(states(m, message, "value")), "the resume")

        def routed(msgs: list[dict[str, Any]]) -> bool:
            # the ticker, having seen a click through the subshell, sends each input's state
            # as caused by it; ipykernel then routes what the page sends about it there
            return any(
                m["msg_type"] == "comm_msg"
                and m["content"]["comm_id"] == lr
                and "disabled" in m["content"]["data"].get("state", {})
                and m["parent_header"].get("subshell_id") == subshell
                for m in seen + msgs
            )

        read_until(kc, routed, "the inputs' messages routed to the subshell")
        started = tmp_path / "training"
        msg_id = kc.execute(f"open({str(started)!r}, 'w').close(); sess.train(30, progress=False)")
        wait_until(started.exists, "the cell to start", TIMEOUT)
        during = read_until(kc, stepped_in_the_foreground(state), "a step of the foreground train")
        send_value(kc, lr, 2e-4, subshell=subshell)
        click(kc, apply, subshell=subshell)
        during += read_until(kc, lambda m: bool(states(m, said, "value")), "Apply's outcome")
        ended = [m for m in during if m["msg_type"] == "status" and m["parent_header"].get("msg_id") == msg_id]
        assert not [m for m in ended if m["content"]["execution_state"] == "idle"], "the cell had ended: not beside it"
        assert "set at step" in states(during, said, "value")[-1], states(
            during, said, "value"
        )  # not "nothing to apply"
        assert "lr 0.0001 → 0.0002" in states(during, said, "value")[-1]
        reply = kc.get_shell_msg(timeout=TIMEOUT)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=TIMEOUT)
        assert reply["content"]["status"] == "ok", reply["content"]
        out = ok(
            kc, "(c,) = sess.changes; print(c.step, sorted({m['lr'] for m in sess.history if m['version'] > c.step}))"
        )
        step, lrs = out.split(" ", 1)
        assert 0 < int(step) < 30 and lrs.strip() in ("[0.0002]", "[0.0001, 0.0002]"), out
        ok(kc, "sess.close()")


CLOSE_LEAVES_NOTHING = """
import rlnb
from rlnb.runtime import snapshot
sess = rlnb.Session(rlnb.Config(
    mode="async",
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
    track=rlnb.TrackConfig(backends=("console",), console_every=2),
), name="k")
dash = sess.dashboard()
sess.training.start(steps=6)
"""


def test_close_returns_once_what_it_closed_is_gone_and_the_last_frame_says_so(open_kernel: OpenKernel) -> None:
    with open_kernel() as (_, kc):
        ok(kc, CLOSE_LEAVES_NOTHING)
        # JupyterLab asks the kernel for a subshell once a notebook is open: its thread
        # and FDs are the kernel's, made after the session's baseline
        make_subshell(kc)
        ok(kc, "sess.training.wait()")  # the training thread wrote console lines: ipykernel gave it a pipe
        out = ok(kc, "sess.close(); print(snapshot().new_since(sess.baseline))")
        assert out.strip() == "{}", out  # at once: close() returned once everything was gone
        gauges = ok(kc, "print(dash.gauges.value)")  # the last frame was drawn after that
        assert 'data-gauge="open FDs"' in gauges and "rlnb-new" not in gauges, gauges


def test_a_background_runs_console_line_stays_where_it_appeared(open_kernel: OpenKernel) -> None:
    with open_kernel() as (_, kc):
        ok(kc, CLOSE_LEAVES_NOTHING.replace("sess.training.start(steps=6)", "sess.training.start(steps=30)"))
        msgs = execute(kc, "import time; time.sleep(0.5)")
        msgs += execute(kc, "sess.training.wait()")  # ipykernel 7 sends a thread's output to the cell that ran last
        msgs += execute(kc, "sess.close()")
        lines = [m for m in msgs if m["msg_type"] in ("display_data", "update_display_data")]
        lines = [m for m in lines if m["content"]["data"].get("text/plain", "").startswith(("step ", "rlnb: run"))]
        shown = [m for m in lines if m["msg_type"] == "display_data"]
        assert len(shown) <= 1, [m["parent_header"].get("msg_id") for m in shown]  # one line, not one per cell
        ids = {m["content"]["transient"]["display_id"] for m in lines}
        assert len(ids) == 1 and "exit code 0" in lines[-1]["content"]["data"]["text/plain"]


def test_a_click_made_after_a_dashboard_action_ended_runs_however_soon(tmp_path: Path, open_kernel: OpenKernel) -> None:
    """A click queued behind another dashboard action (save, on the page's subshell)
    is refused only if it was made while that action ran; one made after it ended
    runs, even a moment later (the page's message says when it was made)."""
    with open_kernel() as (_, kc):
        ok(kc, f"import os\nos.chdir({str(tmp_path)!r})")
        ok(kc, SETUP)
        opened = opened_widgets(execute(kc, "sess.dashboard()"))
        subshell = make_subshell(kc)
        pause, resume, save = (widget(opened, button=name) for name in ("pause", "resume", "save"))
        message = widget(opened, css="rlnb-message")
        click(kc, pause, subshell=subshell)
        read_until(kc, paused_and_on(message, resume), "the pause")
        click(kc, save, subshell=subshell)

        def saved_and_resume_on(msgs: list[dict[str, Any]]) -> bool:
            said = states(msgs, message, "value")
            return any("saved" in v for v in said) and states(msgs, save, "description")[-1:] == ["save"]

        read_until(kc, saved_and_resume_on, "the save")
        click(kc, resume, subshell=subshell)  # at once: the save has ended
        after = read_until(kc, lambda msgs: bool(states(msgs, message, "value")), "the resume's answer")
        assert "resumed" in states(after, message, "value")[-1], states(after, message, "value")
        assert ok(kc, "print(sess.statistics().rollout.state)").strip() == "running"
        ok(kc, "sess.close()")

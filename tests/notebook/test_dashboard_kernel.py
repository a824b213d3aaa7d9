"""The dashboard in a real Jupyter kernel, driven through jupyter_client as a
frontend would: shown with a display id, a button clicked over its comm, and on
close every widget closed and the display swapped for the static copy."""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import BlockingKernelClient

from tests.runtime.test_kernel import TIMEOUT, kernel, ok

pytestmark = [pytest.mark.netns, pytest.mark.slow]

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
    deadline = time.monotonic() + TIMEOUT
    while not done(msgs):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {TIMEOUT} s; got {[m['msg_type'] for m in msgs]}")
        try:
            msgs.append(kc.get_iopub_msg(timeout=0.1))
        except queue.Empty:
            continue
    return msgs


def states(msgs: list[dict[str, Any]], comm_id: str, key: str) -> list[Any]:
    """The values ``key`` took in the state updates of widget ``comm_id``."""
    return [
        m["content"]["data"]["state"][key]
        for m in msgs
        if m["msg_type"] == "comm_msg"
        and m["content"]["comm_id"] == comm_id
        and key in m["content"]["data"].get("state", {})
    ]


def test_show_click_and_close_in_a_real_kernel(tmp_path: Path) -> None:
    with kernel(tmp_path) as (_, kc):
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

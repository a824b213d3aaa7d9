"""``sess.explore()`` in a real Jupyter kernel, driven through jupyter_client as a
frontend would: shown as a widget with a static HTML copy beside it, a control
changed over its comm, and on close the display swapped for that copy."""

from __future__ import annotations

import contextlib
import queue
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
sess.step()
"""


def execute(kc: BlockingKernelClient, code: str) -> list[dict[str, Any]]:
    """Run ``code``; return every IOPub message it caused (an error reply fails)."""
    msgs: list[dict[str, Any]] = []
    reply = kc.execute_interactive(code, timeout=TIMEOUT, output_hook=msgs.append)
    assert reply["content"]["status"] == "ok", reply["content"]
    return msgs


def widgets(msgs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every widget the messages opened, by comm id, with the state it has after them."""
    opened = {m["content"]["comm_id"]: m["content"]["data"]["state"] for m in msgs if m["msg_type"] == "comm_open"}
    for m in msgs:
        if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] in opened:
            opened[m["content"]["comm_id"]].update(m["content"]["data"].get("state", {}))
    return opened


def test_explore_in_a_real_kernel_is_a_widget_with_html_beside_it(open_kernel: OpenKernel) -> None:
    with open_kernel() as (_, kc):
        ok(kc, SETUP)
        shown = execute(kc, "ex = sess.explore()\nex")
        (display,) = [m for m in shown if m["msg_type"] in ("display_data", "execute_result")]
        data = display["content"]["data"]
        assert "application/vnd.jupyter.widget-view+json" in data
        assert 'class="rlnb-explorer"' in data["text/html"] and "the batch of step 1" in data["text/html"]
        assert not [m for m in shown if m["msg_type"] in ("stream", "error")]
        opened = widgets(shown)
        colour = next(i for i, s in opened.items() if s["_model_name"] == "ToggleButtonsModel")
        body = next(
            i for i, s in opened.items() if s["_model_name"] == "HTMLModel" and "rlnb-explorer" in s.get("value", "")
        )

        # the page picks "policy version" (the fourth button): the kernel renders and sends the body
        index = opened[colour]["_options_labels"].index("policy version")
        update = {"method": "update", "state": {"index": index}, "buffer_paths": []}
        kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": colour, "data": update}))
        values: list[str] = []

        def rendered() -> bool:
            with contextlib.suppress(queue.Empty):
                msg = kc.get_iopub_msg(timeout=0.1)
                if msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] == body:
                    values.append(msg["content"]["data"].get("state", {}).get("value", ""))
            return any("colour: policy version" in v for v in values)

        wait_until(rendered, "the body rendered again", TIMEOUT)
        assert ok(kc, "print(ex.state['color'])").strip() == "version"

        # shown with a display id: close swaps it for the static copy of what it showed last
        closing = execute(kc, "ex.close()")
        (swap,) = [m for m in closing if m["msg_type"] == "update_display_data"]
        assert swap["content"]["transient"] == display["content"]["transient"]
        assert set(swap["content"]["data"]) == {"text/html", "text/plain"}
        assert "colour: policy version" in swap["content"]["data"]["text/html"]
        assert {m["content"]["comm_id"] for m in closing if m["msg_type"] == "comm_close"} >= {colour, body}
        ok(kc, "sess.close()")

"""A kernel restarted in the middle of a tool call: the session closes by itself, the
environments' threads do not hold the kernel up, and nothing is left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import wait_until
from tests.helpers.kernel import TIMEOUT, OpenKernel, ok, stop_gracefully

pytestmark = [pytest.mark.slow]

SETUP = """
import logging, os, pathlib, threading
import rlnb
from rlnb.envs import Turn
handler = logging.FileHandler({log!r})
handler.setFormatter(logging.Formatter("%(created).6f %(levelname)s %(message)s"))
logging.getLogger("rlnb").addHandler(handler)
logging.getLogger("rlnb").setLevel(logging.INFO)
calls = threading.Event()

class SlowTool:
    # Every policy turn calls a tool that answers in two minutes: a slow service.
    def reset(self, row):
        return None

    def step(self, completion):
        pathlib.Path({marker!r}).touch()
        calls.wait(120)
        return Turn(observation="1", done=True)

def one(rng):
    return "1=", "1"

rlnb.data.register_task(rlnb.data.Task(
    "slow_tool", alphabet="0123456789=", make_prompt=one,
    reward=None, max_new_tokens=4, env=SlowTool, max_turns=2,
), replace=True)
config = rlnb.Config(
    task="slow_tool", mode="async", model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=2, reward_timeout=None),
)
sess = rlnb.Session(config, name="k")
sess.training.start()
"""


def test_a_kernel_restart_during_a_tool_call_closes_everything(tmp_path: Path, open_kernel: OpenKernel) -> None:
    log_file, marker = tmp_path / "rlnb.log", tmp_path / "tool-called"
    with open_kernel() as (km, kc):
        ok(kc, SETUP.format(log=str(log_file), marker=str(marker)))
        wait_until(marker.exists, "a tool call to start", TIMEOUT)
        stop_gracefully(km, log_file, restart=True)  # exits by itself, after closing 'k'; no child left
        msg_id = kc.execute("import rlnb", user_expressions={"live": "rlnb.sessions()"})
        while (reply := kc.get_shell_msg(timeout=TIMEOUT))["parent_header"].get("msg_id") != msg_id:
            pass
        assert reply["content"]["user_expressions"]["live"]["data"]["text/plain"] == "[]"

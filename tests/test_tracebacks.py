"""What a user sees when a session call fails or is interrupted: the call's line
and one message, not the bridge's and futures' frames under it; a Ctrl-C is one
line (``rlnb.Interrupted``) that says what was kept and how to go on."""

from __future__ import annotations

import dataclasses
import re
import sys
import threading
import traceback

import pytest

import rlnb
from tests.helpers import ctrl_c_once, small_config
from tests.helpers.kernel import OpenKernel, cell_output, ok

CONFIG = small_config(rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=2, max_new_tokens=4))


def frames(error: BaseException) -> list[str]:
    return [f"{f.name} ({f.filename.rsplit('/', 1)[-1]})" for f in traceback.extract_tb(error.__traceback__)]


def test_an_error_rlnb_raises_shows_the_call_not_the_bridge_under_it() -> None:
    with rlnb.Session(CONFIG, name="tb") as sess:
        sess.pause()
        for call in (sess.evaluate, lambda: sess.rollout(1), sess.step):
            with pytest.raises(rlnb.RolloutError, match=r"rollouts are paused; call resume\(\) first") as raised:
                call()
            # this test's frame, the lambda's where there is one, then the session call's own
            shown = frames(raised.value)
            assert len(shown) <= 3 and shown[-1].endswith("(_errors.py)"), shown
            assert not any(f.endswith(("(_bridge.py)", "(_base.py)")) for f in shown), shown
        sess.resume()
        with pytest.raises(rlnb.RolloutError, match="call pause") as raised:
            sess.wait_paused()  # nothing will pause them: it says so at once
        assert len(frames(raised.value)) == 2


def test_a_reward_that_raises_keeps_its_own_traceback_as_the_cause() -> None:
    def reward(completion: str, answer: str) -> float:
        raise ZeroDivisionError("the user's bug")

    config = CONFIG.replace(rollout=dataclasses.replace(CONFIG.rollout, max_retries=0))
    with rlnb.Session(config, name="tb") as sess:
        sess.set_reward(reward)
        with pytest.raises(rlnb.RolloutError) as raised:
            sess.rollout(1)
        causes = []
        error: BaseException | None = raised.value
        while error is not None:
            causes.append(error)
            error = error.__cause__
        user = [e for e in causes if isinstance(e, ZeroDivisionError)]
        assert user and any("reward" in f for f in frames(user[0])), [frames(e) for e in causes]


def set_once_blocked_in(function: str, event: threading.Event) -> None:
    """Set ``event`` once the main thread is inside ``function`` (so a Ctrl-C lands there)."""
    main = threading.main_thread().ident
    for _ in range(2000):
        frame = sys._current_frames().get(main or 0)
        while frame is not None:
            if frame.f_code.co_name == function:
                event.set()
                return
            frame = frame.f_back
        threading.Event().wait(0.005)


def test_ctrl_c_in_wait_is_one_line_and_the_run_goes_on() -> None:
    with rlnb.Session(CONFIG, name="tb") as sess:
        sess.start(steps=10_000)
        started = threading.Event()
        threading.Thread(target=set_once_blocked_in, args=("wait_ended", started), daemon=True).start()
        with ctrl_c_once(started):
            try:
                sess.wait()
            except rlnb.Interrupted as exc:
                assert exc._render_traceback_() == [
                    "KeyboardInterrupt: wait() was interrupted; "
                    "the background run goes on: stop() ends it, wait() waits again"
                ]
                raise
        assert sess.training
        sess.stop()


ANSI = re.compile(r"\x1b\[[0-9;]*m")

KERNEL_SETUP = """
import rlnb
sess = rlnb.Session(rlnb.Config(task="addition", seed=0,
    rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=2, max_new_tokens=4)), name="tb")
sess.pause()
"""


def test_in_a_notebook_a_deliberate_error_shows_the_users_line_and_the_message(open_kernel: OpenKernel) -> None:
    with open_kernel() as (_, kc):
        ok(kc, KERNEL_SETUP)
        shown = ANSI.sub("", cell_output(kc, "sess.evaluate()"))
        assert "RolloutError: rollouts are paused; call resume() first" in shown, shown
        assert "sess.evaluate()" in shown, shown
        # rlnb's own wrapper frame is not shown, nor is anything under it
        assert "_errors.py" not in shown and "with_traceback" not in shown, shown
        assert len(shown.strip().splitlines()) <= 6, shown
        # an error that is not deliberate (a bug inside rlnb) keeps every frame
        broken = "kept, sess._rollouter = sess._rollouter, None\nsess.wait_paused(timeout=1)"
        bug = ANSI.sub("", cell_output(kc, broken))
        assert "AttributeError" in bug and "_session.py" in bug, bug
        ok(kc, "sess._rollouter = kept\nsess.close()")

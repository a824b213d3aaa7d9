"""What a user sees when a session call fails or is interrupted: an error rlnb gives
on purpose (an ``RlnbError``) is the call's line and one message, not the bridge's and
futures' frames under it (in a notebook, no rlnb frame at all; a cause keeps its
frames); a bug inside rlnb keeps every frame, and so does everything under
``RLNB_FULL_TRACEBACKS=1``; a Ctrl-C is one line (``rlnb.Interrupted``) that says what
was kept and how to go on."""

from __future__ import annotations

import dataclasses
import re
import sys
import threading
import traceback
import types
from collections.abc import Callable
from typing import Any

import pytest

import rlnb
import rlnb.rollout._state
from rlnb._errors import public_call
from tests.helpers import ctrl_c_once, small_config
from tests.helpers.kernel import OpenKernel, cell_output, ok

CONFIG = small_config(rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=2, max_new_tokens=4))
PAUSED = r"rollouts are paused; call (sess\.rollouts\.)?resume\(\) first"


def frames(error: BaseException) -> list[str]:
    return [f"{f.name} ({f.filename.rsplit('/', 1)[-1]})" for f in traceback.extract_tb(error.__traceback__)]


def injected_bug(module: types.ModuleType, name: str) -> Callable[..., Any]:
    """A function ``name`` that raises KeyError('injected') from a ``raise`` statement
    in ``module``'s file: an internal bug as rlnb's own code would raise it."""
    namespace: dict[str, Any] = {}
    exec(
        compile(f"def {name}(*args, **kwargs):\n    raise KeyError('injected')\n", module.__file__ or "", "exec"),
        namespace,
    )
    return namespace[name]


def test_an_error_rlnb_raises_shows_the_call_not_the_bridge_under_it() -> None:
    with rlnb.Session(CONFIG, name="tb") as sess:
        sess.rollouts.pause()
        for call in (sess.evaluate, lambda: sess.rollout(1), sess.step):
            with pytest.raises(rlnb.RolloutError, match=PAUSED) as raised:
                call()
            # this test's frame, the lambda's where there is one, then the session call's own
            shown = frames(raised.value)
            assert len(shown) <= 3 and shown[-1].endswith("(_errors.py)"), shown
            assert not any(f.endswith(("(_bridge.py)", "(_base.py)")) for f in shown), shown
        sess.rollouts.resume()
        with pytest.raises(rlnb.RolloutError, match=r"call .*pause") as raised:
            sess.rollouts.wait_paused()  # nothing will pause them: it says so at once
        assert len(frames(raised.value)) == 2


def test_a_reward_that_raises_keeps_its_own_traceback_as_the_cause() -> None:
    def reward(completion: str, answer: str) -> float:
        raise ZeroDivisionError("the user's bug")

    config = CONFIG.replace(rollout=dataclasses.replace(CONFIG.rollout, max_retries=0))
    with rlnb.Session(config, name="tb") as sess:
        sess.rollouts.set_reward(reward)
        with pytest.raises(rlnb.RolloutError) as raised:
            sess.rollout(1)
        causes = []
        error: BaseException | None = raised.value
        while error is not None:
            causes.append(error)
            error = error.__cause__
        user = [e for e in causes if isinstance(e, ZeroDivisionError)]
        assert user and any("reward" in f for f in frames(user[0])), [frames(e) for e in causes]


def test_an_internal_bug_keeps_every_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    with rlnb.Session(CONFIG, name="tb") as sess:
        with monkeypatch.context() as patch:
            patch.setattr(
                rlnb.rollout._state.StateMachine, "check_open", injected_bug(rlnb.rollout._state, "check_open")
            )
            with pytest.raises(KeyError, match="injected") as raised:
                sess.rollout(1)
        shown = frames(raised.value)
        # from this test down through the bridge to the line that raised, on the loop's thread
        assert shown[-1] == "check_open (_state.py)", shown
        assert any(f.endswith("(_bridge.py)") for f in shown) and any(f.endswith("(_rollouter.py)") for f in shown)
        assert not hasattr(raised.value, "_render_traceback_"), "a bug is never rendered short in IPython"


def test_full_tracebacks_keep_every_frame_of_a_deliberate_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLNB_FULL_TRACEBACKS", "1")
    with rlnb.Session(CONFIG, name="tb") as sess:
        sess.rollouts.pause()
        with pytest.raises(rlnb.RolloutError, match=PAUSED) as raised:
            sess.rollout(1)
        shown = frames(raised.value)
        assert any(f.endswith("(_bridge.py)") for f in shown) and any(f.endswith("(_rollouter.py)") for f in shown)
        assert not hasattr(raised.value, "_render_traceback_")


class PausesWrongly(rlnb.learn.Callback):
    def __init__(self) -> None:
        self.session: rlnb.Session | None = None

    def on_step_end(self, metrics: Any) -> None:
        assert self.session is not None
        self.session.rollouts.pause("bogus")  # the user's own mistake, inside their callback


def test_a_deliberate_error_keeps_the_users_frames_under_the_call() -> None:
    callback = PausesWrongly()
    with rlnb.Session(CONFIG, name="tb", callbacks=[callback]) as sess:
        callback.session = sess
        with pytest.raises(rlnb.InvalidValueError, match="pause") as raised:
            sess.step()
        shown = frames(raised.value)
        # down to the callback's line, no further: what rlnb did under it is not shown
        assert shown[-1] == "on_step_end (test_tracebacks.py)", shown
        # a notebook shows none of rlnb's frames, the trainer's between the two lines included
        rendered = "\n".join(raised.value._render_traceback_())  # type: ignore[attr-defined]
        assert "sess.step()" in rendered and 'pause("bogus")' in rendered, rendered
        assert "/rlnb/" not in rendered, rendered


def test_a_converted_error_is_still_caught_as_the_builtin() -> None:
    with rlnb.Session(CONFIG, name="tb") as sess:
        try:
            sess.rollouts.pause("bogus")
        except ValueError as exc:
            assert isinstance(exc, rlnb.InvalidValueError) and "pause(mode='bogus')" in str(exc), repr(exc)
        else:
            pytest.fail("pause('bogus') was accepted")
        with pytest.raises(TypeError) as raised:
            sess.rollouts.set_reward("x")  # type: ignore[arg-type]
        assert isinstance(raised.value, rlnb.InvalidTypeError), repr(raised.value)


@public_call("nothing was lost")
def interrupted_call() -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("full", [False, True])
def test_a_ctrl_c_is_one_line_unless_full_tracebacks_are_asked_for(monkeypatch: pytest.MonkeyPatch, full: bool) -> None:
    if full:
        monkeypatch.setenv("RLNB_FULL_TRACEBACKS", "1")
    with pytest.raises(rlnb.Interrupted) as raised:
        interrupted_call()
    shown = raised.value._render_traceback_()
    if not full:
        assert shown == ["KeyboardInterrupt: interrupted_call() was interrupted; nothing was lost"]
        assert raised.value.__cause__ is None
    else:  # where the Ctrl-C landed: the KeyboardInterrupt, chained, with its frames
        assert isinstance(raised.value.__cause__, KeyboardInterrupt)
        assert any("raise KeyboardInterrupt" in line for line in shown), shown


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
        sess.training.start(steps=10_000)
        started = threading.Event()
        threading.Thread(target=set_once_blocked_in, args=("wait_ended", started), daemon=True).start()
        with ctrl_c_once(started):
            try:
                sess.training.wait()
            except rlnb.Interrupted as exc:
                [line] = exc._render_traceback_()
                assert line.startswith("KeyboardInterrupt: wait() was interrupted; the background run goes on: "), line
                raise
        assert sess.training.running
        sess.training.stop()


ANSI = re.compile(r"\x1b\[[0-9;]*m")
RLNB_FRAME = re.compile(r"File [^\n]*[/\\]rlnb[/\\]")  # how IPython names a frame in rlnb's code
CAUSED = "The above exception was the direct cause of the following exception:"

KERNEL_SETUP = """
import os
import rlnb
sess = rlnb.Session(rlnb.Config(task="addition", seed=0,
    rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=2, max_new_tokens=4, max_retries=0)), name="tb")
sess.rollouts.pause()
"""


def test_in_a_notebook_a_deliberate_error_shows_no_rlnb_frame(open_kernel: OpenKernel) -> None:
    with open_kernel() as (_, kc):
        ok(kc, KERNEL_SETUP)
        shown = ANSI.sub("", cell_output(kc, "sess.evaluate()"))
        assert re.search(f"RolloutError: {PAUSED}", shown), shown
        assert "sess.evaluate()" in shown and not RLNB_FRAME.search(shown), shown
        assert "_errors.py" not in shown and "with_traceback" not in shown, shown
        assert len(shown.strip().splitlines()) <= 6, shown
        # the user's own frames all show, down to their line that called rlnb
        shown = ANSI.sub("", cell_output(kc, "def check():\n    return sess.evaluate()\n\ncheck()"))
        assert "----> 4 check()" in shown and "----> 2     return sess.evaluate()" in shown, shown
        assert not RLNB_FRAME.search(shown), shown
        # a converted error is still the builtin it stands for
        caught = ok(kc, "try:\n    sess.rollouts.pause('bogus')\nexcept ValueError as e:\n    print(type(e).__name__)")
        assert caught.strip() == "InvalidValueError", caught
        # a failing reward function keeps its traceback, as the cause; the error itself none of rlnb's
        ok(
            kc,
            "sess.rollouts.resume()\n"
            "def reward(completion, answer):\n    return 1 / 0\n"
            "sess.rollouts.set_reward(reward)",
        )
        shown = ANSI.sub("", cell_output(kc, "sess.rollout(1)"))
        assert "ZeroDivisionError" in shown and "return 1 / 0" in shown and CAUSED in shown, shown
        last = shown.rsplit(CAUSED, 1)[1]
        assert "RolloutError" in last and "sess.rollout(1)" in last and not RLNB_FRAME.search(last), shown
        ok(kc, "sess.close()")


def test_in_a_notebook_a_bug_and_full_tracebacks_keep_every_frame(open_kernel: OpenKernel) -> None:
    with open_kernel() as (_, kc):
        ok(kc, KERNEL_SETUP + "sess.rollouts.resume()")
        # a bug deep in rlnb: a KeyError from a raise statement in rollout/_state.py
        ok(
            kc,
            "import rlnb.rollout._state as state\n"
            "namespace = {}\n"
            "source = 'def check_open(self):\\n    raise KeyError(\\'injected\\')'\n"
            "exec(compile(source, state.__file__, 'exec'), namespace)\n"
            "kept, state.StateMachine.check_open = state.StateMachine.check_open, namespace['check_open']",
        )
        bug = ANSI.sub("", cell_output(kc, "sess.rollout(1)"))
        ok(kc, "state.StateMachine.check_open = kept")
        assert "KeyError: 'injected'" in bug and "sess.rollout(1)" in bug, bug
        for where in ("_bridge.py", "_rollouter.py", "_state.py"):
            assert re.search(rf"File [^\n]*[/\\]rlnb[/\\][^\n]*{where}", bug), (where, bug)
        # RLNB_FULL_TRACEBACKS=1: a deliberate error keeps every frame too, this wrapper's included
        ok(kc, "sess.rollouts.pause()\nos.environ['RLNB_FULL_TRACEBACKS'] = '1'")
        full = ANSI.sub("", cell_output(kc, "sess.rollout(1)"))
        assert re.search(f"RolloutError: {PAUSED}", full), full
        assert len(RLNB_FRAME.findall(full)) >= 3 and "_errors.py" in full and "_bridge.py" in full, full
        ok(kc, "del os.environ['RLNB_FULL_TRACEBACKS']\nsess.close()")

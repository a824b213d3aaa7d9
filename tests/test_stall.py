"""The stall explainer: a step that runs too long says where it waits
(``statistics().stall``, one stdout line), and ``stacks()`` says on which line.

Each case is built to stall: a reward that hangs, rollouts left paused while the
background run waits for a batch, an engine that stops producing tokens. Each test
sets ``Config(stall_after=1)``; the default rule is tested on its own."""

from __future__ import annotations

import random
import threading
import time

import pytest

import rlnb
from rlnb.data import Task, register_task
from rlnb.engines import FakeEngine
from rlnb.session._stall import MIN_STALL_S, stall_limit
from tests.helpers import small_config, wait_until


def _stalled(sess: rlnb.Session) -> rlnb.session.Stall:
    wait_until(lambda: sess.statistics().stall is not None, "a stall", timeout=15)
    stall = sess.statistics().stall
    assert stall is not None
    return stall


def test_a_reward_that_hangs_is_named_with_its_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    gate = threading.Event()

    def hangs(completion: str, answer: object) -> float:
        gate.wait(30)
        return 0.0

    rollout = rlnb.RolloutConfig(group_size=4, groups_per_step=2, reward_timeout=None)
    with rlnb.Session(small_config(stall_after=1.0, rollout=rollout), name="stall") as sess:
        sess.rollouts.set_reward(hangs)
        step = threading.Thread(target=sess.step)
        step.start()
        try:
            stall = _stalled(sess)
            assert stall.where == "reward", stall
            assert "the reward function 'hangs' (test_stall.py, line" in stall.what and "on prompt 0" in stall.what
            assert "RolloutConfig.reward_timeout (now no limit)" in stall.fix
            assert "stall     no step has completed for" in repr(sess.statistics())
            wait_until(lambda: "the reward function 'hangs'" in capsys.readouterr().out, "the stdout line", timeout=5)
            first = sess.diagnose()[0]  # the stall comes first, naming the function
            assert (first.severity, first.code) == ("critical", "stall") and "'hangs'" in first.what, first
            where = sess.stacks()
            assert "--- thread rlnb-reward-" in where and "in hangs" in where and "gate.wait(30)" in where
            assert f"--- thread rlnb-{sess.name}" in where and "tasks on its event loop" in where
        finally:
            gate.set()
            step.join()
        assert sess.statistics().stall is None and sess.version == 1


def test_rollouts_left_paused_while_the_background_run_waits_say_resume() -> None:
    with rlnb.Session(small_config(mode="async", stall_after=1.0), name="stall") as sess:
        sess.rollouts.pause()
        sess.training.start(steps=1)
        stall = _stalled(sess)
        assert stall.where == "paused" and stall.fix == "call sess.rollouts.resume()", stall
        assert "resume()" in sess.diagnose()[0].fix
        sess.rollouts.resume()
        sess.training.wait()
        assert sess.statistics().stall is None


def test_an_engine_that_stops_producing_tokens_is_named() -> None:
    engine = FakeEngine(lengths=4, token_delay=60.0)  # the first token never comes in time
    with rlnb.Session(small_config(stall_after=1.0), name="stall", engine=engine) as sess:
        errors: list[BaseException] = []

        def step() -> None:
            try:
                sess.step()
            except BaseException as exc:  # the close below ends it
                errors.append(exc)

        stepping = threading.Thread(target=step)
        stepping.start()
        # Nothing looks at the session until the step has begun: the engine is still named
        # the moment the step stalls (the watch saw the token count before the step began).
        time.sleep(0.3)
        stall = _stalled(sess)
        assert stall.where == "engine", stall
        assert "the engine has 16 requests in flight and has produced no token for" in stall.what
        first = sess.diagnose()[0]
        assert first.code == "stall" and "the engine has 16 requests in flight" in first.what, first
        sess.close(timeout=2)
        stepping.join(10)
        assert not stepping.is_alive() and errors


def test_steps_that_complete_are_no_stall_and_the_default_rule() -> None:
    with rlnb.Session(small_config(), name="stall") as sess:
        sess.train(2, progress=False)
        assert sess.statistics().stall is None
    assert stall_limit(None, []) == MIN_STALL_S == 30.0
    assert stall_limit(None, [0.1, 0.2, 0.3]) == 30.0
    assert stall_limit(None, [4.0, 5.0, 60.0]) == 50.0  # 10 x the median
    assert stall_limit(2.5, [100.0]) == 2.5
    with pytest.raises(rlnb.ConfigError, match=r"Config\.stall_after=0 is invalid"):
        rlnb.Config(stall_after=0)


SLOW = threading.Event()  # set: make_prompt takes 6 s (it runs on the session's loop with num_workers=0)


def slow_prompt(rng: random.Random) -> tuple[str, str]:
    if SLOW.is_set():
        threading.Event().wait(6.0)  # the slowness under test
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}+{b}=", str(a + b)


@pytest.mark.slow  # seconds of waiting or drawing: the integration tier
def test_a_make_prompt_that_blocks_the_event_loop_is_named() -> None:
    register_task(Task("slow-prompts", "0123456789+=", slow_prompt, lambda c, a: 0.0, max_new_tokens=4), replace=True)
    with rlnb.Session(small_config(task="slow-prompts", stall_after=1.0), name="stall") as sess:
        sess.step()  # the stall watch runs from the first training call
        SLOW.set()
        stepping = threading.Thread(target=sess.step)
        stepping.start()
        try:
            wait_until(lambda: (s := sess.statistics().stall) is not None and s.where == "loop", "a loop stall", 15)
            stall = sess.statistics().stall
            assert stall is not None and "the session's event loop has not run for" in stall.what
            assert "slow_prompt" in stall.what and "DataConfig.num_workers=0" in stall.fix, stall
        finally:
            SLOW.clear()
            stepping.join(30)

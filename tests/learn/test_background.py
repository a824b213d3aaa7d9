"""Background training through the session: start, stop, wait, pause in between,
failures that surface, Ctrl-C elsewhere, and close while it runs."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

import rlnb
from rlnb.learn import Callback
from tests.helpers import press_ctrl_c, small_config, wait_until

CONFIG = small_config()


class StepEvents(Callback):
    """Sets an event at each completed step, so tests wait on steps, not on time."""

    def __init__(self) -> None:
        self.stepped = threading.Condition()
        self.threads: set[str] = set()

    def on_step_end(self, metrics: Mapping[str, float]) -> None:
        self.threads.add(threading.current_thread().name)
        with self.stepped:
            self.stepped.notify_all()

    def wait_steps(self, sess: rlnb.Session, version: int) -> None:
        with self.stepped:
            assert self.stepped.wait_for(lambda: sess.version >= version, timeout=20), f"step {version} never came"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_start_returns_at_once_and_stop_ends_at_a_step_boundary(mode: str) -> None:
    events = StepEvents()
    with rlnb.Session(CONFIG.replace(mode=mode), name=f"bg-{mode}", callbacks=[events]) as sess:
        sess.training.start()
        assert sess.training.running
        assert len(sess.rollout(1)) == 1  # the kernel is free: other calls work meanwhile
        events.wait_steps(sess, 3)
        sess.training.stop()
        assert not sess.training.running
        done = sess.version
        assert done >= 3 and len(sess.history) == done  # every step completed whole, none half
        assert [m["version"] for m in sess.history] == list(range(1, done + 1))
        assert sess.statistics().engine.version == done  # and synced
        assert events.threads == {f"rlnb-bg-{mode}-train"}  # off the kernel's main thread
        sess.step()  # foreground training works again
        assert sess.version == done + 1


def test_start_with_steps_then_wait() -> None:
    with rlnb.Session(CONFIG, name="bg-steps") as sess:
        sess.step()
        sess.training.start(3)
        sess.training.wait(timeout=60)
        assert not sess.training.running and sess.version == 4
        stats = sess.statistics()
        assert stats.rollout.version == 4


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_pause_holds_background_training_and_says_so(mode: str) -> None:
    events = StepEvents()
    with rlnb.Session(CONFIG.replace(mode=mode), name=f"bg-pause-{mode}", callbacks=[events]) as sess:
        sess.training.start()
        events.wait_steps(sess, 1)
        sess.rollouts.pause()
        wait_until(lambda: sess.statistics().training.waiting is not None, "the step to wait")
        held = sess.version
        waiting = sess.statistics().training.waiting
        assert waiting is not None and "paused" in waiting
        time.sleep(0.3)  # nothing trains while paused (an upper bound would need a clock)
        assert sess.version <= held + 1 and sess.training.running  # at most the step already updating
        sess.rollouts.resume()
        events.wait_steps(sess, sess.version + 2)
        sess.training.stop()


def test_a_pause_that_lands_as_a_background_step_starts_its_rollout_is_waited_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pause between the background step's look at the state and its rollout once
    failed the run ("rollouts are paused; call resume() first"; seen once from the
    dashboard's pause button in a kernel). Made to land exactly there."""
    events = StepEvents()
    with rlnb.Session(CONFIG, name="bg-pause-race", callbacks=[events]) as sess:
        rollouter = sess._rollouter
        collect, landed = rollouter.collect, threading.Event()

        async def pause_then_collect(*args: object, **kwargs: object) -> object:
            if not landed.is_set():
                await rollouter.pause("keep")  # the user's pause, a moment too late to be seen
                landed.set()
            return await collect(*args, **kwargs)

        monkeypatch.setattr(rollouter, "collect", pause_then_collect)
        sess.training.start()
        assert landed.wait(10)
        wait_until(lambda: "paused" in (sess.statistics().training.waiting or ""), "the step to wait for resume()")
        assert sess.training.running and sess.version == 0
        sess.rollouts.resume()
        events.wait_steps(sess, 2)
        sess.training.stop()


def test_bad_steps_are_refused_before_any_thread_starts() -> None:
    with rlnb.Session(CONFIG, name="bg-bad") as sess:
        for steps in (0, -1, 1.5, True, "3"):
            with pytest.raises(ValueError, match=r"start\(steps="):
                sess.training.start(steps)  # type: ignore[arg-type]
        assert not sess.training.running
        assert not [t for t in threading.enumerate() if t.name == "rlnb-bg-bad-train"]


def test_calls_that_train_refuse_while_a_background_run_goes(tmp_path: Path) -> None:
    with rlnb.Session(CONFIG, name="bg-busy") as sess:
        sess.training.start()
        for call in (sess.step, lambda: sess.train(1), sess.warmup, sess.evaluate, lambda: sess.save(tmp_path)):
            with pytest.raises(RuntimeError, match=r"call stop\(\) first"):
                call()
        with pytest.raises(RuntimeError, match=r"stop\(\) first"):
            sess.training.start()
        sess.training.stop()


def test_a_background_failure_is_raised_chained_at_the_next_call() -> None:
    original = ValueError("my plotting code")

    class Broken(Callback):
        def on_step_end(self, metrics: Mapping[str, float]) -> None:
            if metrics["version"] == 2:
                raise original

    with rlnb.Session(CONFIG, name="bg-fail", callbacks=[Broken()]) as sess:
        sess.training.start()
        wait_until(lambda: not sess.training.running, "the run to end")
        with pytest.raises(rlnb.TrainingError, match="after 1 step") as info:
            sess.statistics()
        assert info.value.__cause__ is original
        sess.statistics()  # reported once
        assert sess.version == 2  # the failing step had completed its update


def test_ctrl_c_in_another_cell_leaves_the_background_run_going() -> None:
    events = StepEvents()
    with rlnb.Session(CONFIG, name="bg-ctrl-c", callbacks=[events]) as sess:
        sess.training.start()
        events.wait_steps(sess, 1)
        presser = threading.Timer(0.2, press_ctrl_c)
        presser.start()
        with pytest.raises(KeyboardInterrupt):
            sess.training.wait()  # the cell waiting for the run is interrupted, not the run
        presser.join()
        assert sess.training.running
        events.wait_steps(sess, sess.version + 2)
        sess.training.stop()


def test_close_stops_the_run_and_the_tracker_records_an_interrupt(tmp_path: Path) -> None:
    events = StepEvents()
    track = rlnb.TrackConfig(backends=("jsonl",), run_dir=str(tmp_path))
    sess = rlnb.Session(CONFIG.replace(track=track), name="bg-close", callbacks=[events])
    sess.training.start()
    events.wait_steps(sess, 2)
    sess.close()  # within close_timeout: a part abandoned past it warns, and warnings fail tests
    assert not [t for t in threading.enumerate() if t.name == "rlnb-bg-close-train"]
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "finish" and last["exit_code"] == 130


def test_ctrl_c_in_train_says_in_one_line_what_was_kept_and_history_keeps_the_steps() -> None:
    class PressAtStep(Callback):
        def on_step_end(self, metrics: Mapping[str, float]) -> None:
            if metrics["version"] == 2:
                press_ctrl_c()  # held back until the step completes

    with rlnb.Session(CONFIG, name="fg-ctrl-c", callbacks=[PressAtStep()]) as sess:
        with pytest.raises(rlnb.TrainingInterrupted) as info:
            sess.train(until=5, progress=False)
        assert isinstance(info.value, KeyboardInterrupt)
        message = str(info.value)
        assert "stopped at step 2" in message and "completed" in message and "train(until=5)" in message
        assert info.value._render_traceback_() == [f"KeyboardInterrupt: {message}"]  # one line in a notebook
        assert [m["version"] for m in sess.history] == [1, 2]  # the interrupted call's steps are kept
        sess.callbacks.clear()
        assert [m["version"] for m in sess.train(until=5, progress=False)] == [3, 4, 5]
        assert sess.train(until=5, progress=False) == []  # already there
        with pytest.raises(ValueError, match="one of them"):
            sess.train(2, until=9)


def test_signal_handlers_are_untouched_by_background_training() -> None:
    before = signal.getsignal(signal.SIGINT)
    with rlnb.Session(CONFIG, name="bg-signals") as sess:
        sess.training.start()
        assert signal.getsignal(signal.SIGINT) is before
        sess.training.stop()

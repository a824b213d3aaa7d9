"""The session's dashboard, in-process: ipywidgets without a frontend, buttons
pressed with ``Button.click()`` as ipywidgets' own tests do, real sessions."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import rlnb
import rlnb.notebook
from rlnb.learn import Callback
from rlnb.notebook import Dashboard
from tests.helpers import small_config, wait_until

CONFIG = small_config()


def tickers(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"rlnb-{name}-dashboard"]


def gauge(dash: Dashboard, name: str) -> tuple[int, int]:
    """(value, change since the baseline) of one gauge, as the HTML says it."""
    found = re.search(rf'data-gauge="{name}" data-value="(\d+)" data-delta="(-?\d+)"', dash.gauges.value)
    assert found, dash.gauges.value
    return int(found[1]), int(found[2])


def state_word(dash: Dashboard) -> str:
    """Generation's state word as the panel shows it ("PAUSED (abort)")."""
    found = re.search(r'class="rlnb-state-word"[^>]*>([A-Z]+(?: \(\w+\))?)<', dash.state.value)
    assert found, dash.state.value
    return found[1]


def training_word(dash: Dashboard) -> str:
    found = re.search(r'class="rlnb-training-word"[^>]*>([A-Z]+)<', dash.state.value)
    assert found, dash.state.value
    return found[1]


def row(dash: Dashboard, label: str) -> str:
    """The text of one row of the state table."""
    found = re.search(rf"<th[^>]*>{label}</th><td[^>]*>(.*?)</td>", dash.state.value)
    assert found, dash.state.value
    return found[1]


class FakeHandle:
    """What ``IPython.display.display(..., display_id=True)`` returns: records updates."""

    def __init__(self) -> None:
        self.updates: list[Any] = []

    def update(self, obj: Any) -> None:
        self.updates.append(obj)


@pytest.fixture
def shown(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, FakeHandle | None]]]:
    """Swap IPython's ``display`` for one that records what is displayed and its handle."""
    import IPython.display

    displayed: list[tuple[Any, FakeHandle | None]] = []

    def display(obj: Any, *, display_id: bool | None = None) -> FakeHandle | None:
        handle = FakeHandle() if display_id else None
        displayed.append((obj, handle))
        return handle

    monkeypatch.setattr(IPython.display, "display", display)
    yield displayed


def test_importing_the_notebook_layer_loads_no_widgets() -> None:
    code = (
        "import sys, rlnb.notebook; "
        "print(sorted(m for m in ('torch', 'ipywidgets', 'matplotlib', 'IPython') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_all_is_sorted_and_complete() -> None:
    public = {name for name in dir(rlnb.notebook) if not name.startswith(("_", "@"))}
    assert rlnb.notebook.__all__ == sorted(rlnb.notebook.__all__)
    assert set(rlnb.notebook.__all__) == public
    assert {"Dashboard", "RolloutBatch", "dashboard"} <= set(rlnb.notebook.__all__)


def test_one_dashboard_and_one_ticker_per_session(shown: list[tuple[Any, FakeHandle | None]]) -> None:
    import ipywidgets

    with rlnb.Session(CONFIG, name="dash-one") as sess:
        dash = sess.dashboard()
        assert isinstance(dash, Dashboard) and isinstance(dash.widget, ipywidgets.VBox)
        assert sess.dashboard() is dash and rlnb.notebook.dashboard(sess) is dash
        dash._ipython_display_()
        dash._ipython_display_()  # shown twice, as re-running the cell does
        assert [obj for obj, _ in shown] == [dash.widget, dash.widget]
        assert all(handle is not None for _, handle in shown)
        assert len(tickers("dash-one")) == 1
        ticker = tickers("dash-one")[0]
        assert ticker.daemon
        assert set(dash.buttons) == {"start", "stop", "pause", "resume", "step", "evaluate", "save"}
        assert dash.pause_mode.options == ("abort", "keep", "wait")
        assert dash.save_path.value == "checkpoints/dash-one"
        for widget, name in [(dash.state, "state"), (dash.gauges, "gauges"), (dash.message, "message")]:
            assert f"rlnb-{name}" in widget._dom_classes
        assert "live, ticking every 0.5 s" in repr(dash)
    assert not ticker.is_alive()


def test_start_stop_step_evaluate_and_save_call_the_session(tmp_path: Path) -> None:
    with rlnb.Session(CONFIG, name="dash-buttons") as sess:
        dash = sess.dashboard()
        buttons = dash.buttons

        buttons["step"].click()
        assert sess.version == 1
        assert "step 1: reward_mean" in dash.message.value and "rlnb-ok" in dash.message.value

        buttons["evaluate"].click()
        assert len(sess.evaluations) == 1
        assert f"held-out accuracy {sess.evaluations[0][1]:.3f}" in dash.message.value

        dash.save_path.value = str(tmp_path / "ckpt")
        buttons["save"].click()
        assert (tmp_path / "ckpt").is_dir() and any((tmp_path / "ckpt").iterdir())
        assert f"saved to {tmp_path / 'ckpt'}" in dash.message.value

        assert buttons["stop"].disabled and not buttons["start"].disabled
        buttons["start"].click()
        assert sess.training.running and "training in the background" in dash.message.value
        # the click refreshes the buttons unless the ticker is mid-tick: then its tick does
        wait_until(lambda: buttons["start"].disabled and not buttons["stop"].disabled, "the training buttons")
        assert buttons["step"].disabled and buttons["evaluate"].disabled and buttons["save"].disabled
        assert buttons["start"].description == "start"  # busy only while its handler runs

        buttons["stop"].click()
        assert not sess.training.running
        assert f"stopped at step {sess.version}" in dash.message.value
        wait_until(lambda: not buttons["start"].disabled and buttons["stop"].disabled, "the idle buttons")
        assert not buttons["step"].disabled


@pytest.mark.parametrize("mode", ["abort", "keep", "wait"])
def test_pause_in_each_mode_then_resume(mode: str) -> None:
    with rlnb.Session(CONFIG.replace(mode="async"), name=f"dash-pause-{mode}") as sess:
        dash = sess.dashboard()
        sess.rollouts.start()
        wait_until(lambda: sess.statistics().rollout.finished > 0, "rollouts to go on")
        dash.pause_mode.value = mode
        dash.buttons["pause"].click()
        if mode == "wait":
            assert re.search(r"paus(ed|ing) \(wait\)", dash.message.value), dash.message.value
            sess.rollouts.wait_paused(timeout=20)
        else:
            assert f"paused ({mode}):" in dash.message.value
        stats = sess.statistics().rollout
        assert stats.state == "paused"
        if mode == "abort":
            assert f"{stats.kept_partial} samples kept as partial rollouts" in dash.message.value
        # one tick sets the state word, then the buttons: wait for both
        wait_until(lambda: state_word(dash) == f"PAUSED ({mode})" and dash.buttons["pause"].disabled, "paused")
        assert not dash.buttons["resume"].disabled
        assert dash.buttons["step"].disabled  # a step needs running rollouts

        dash.buttons["resume"].click()
        assert sess.statistics().rollout.state == "running" and "resumed:" in dash.message.value
        # the click's own refresh is skipped while the ticker is mid-tick: it ticks again once that ends
        wait_until(lambda: state_word(dash) == "RUNNING" and dash.buttons["resume"].disabled, "the running panel")
        assert "in the background: " in row(dash, "generation")
        assert not dash.buttons["pause"].disabled


def test_a_clicks_effect_shows_at_once_even_when_its_refresh_met_the_tickers() -> None:
    """A click refreshes the panel itself, unless the ticker is mid-tick (drawing the
    curves, say): that tick may have read the session before the click, so the ticker
    ticks again as soon as it ends, not an interval later. Here the interval is a
    minute and the ticker's tick is held while the click runs."""
    with rlnb.Session(CONFIG.replace(mode="async"), name="dash-again") as sess:
        dash = rlnb.notebook.Dashboard(sess, interval=60.0)
        try:
            sess.rollouts.start()
            wait_until(lambda: not dash.buttons["pause"].disabled, "the pause button to come on")
            with dash._tick_lock:  # the ticker is mid-tick: the click's refresh is skipped
                dash.buttons["pause"].click()
                assert "paused (abort)" in dash.message.value
                assert dash.buttons["resume"].disabled, "not refreshed yet"
            wait_until(lambda: not dash.buttons["resume"].disabled, "resume to come on", timeout=10.0)
            assert state_word(dash) == "PAUSED (abort)"
        finally:
            dash.close()


def test_an_error_shows_inline_and_nothing_reaches_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    with rlnb.Session(CONFIG, name="dash-error") as sess:
        dash = sess.dashboard()
        capsys.readouterr()
        sess.training.start()
        busy: list[tuple[bool, str]] = []
        button = dash.buttons["step"]
        button.observe(lambda change: busy.append((button.disabled, change["new"])), names="description")
        button.click()  # disabled while training, but a click from code still reaches the handler
        assert busy[0] == (True, "step…") and busy[-1][1] == "step"
        assert "rlnb-error" in dash.message.value
        assert "step() failed: StateError: step() cannot run while training goes on" in dash.message.value
        assert sess.training.running  # nothing else happened
        sess.training.stop()
    out = capsys.readouterr()
    assert out.err == "" and out.out == ""


def test_the_error_text_is_escaped(tmp_path: Path) -> None:
    (tmp_path / "<b>a-file").write_text("")
    with rlnb.Session(CONFIG, name="dash-escape") as sess:
        dash = sess.dashboard()
        dash.save_path.value = str(tmp_path / "<b>a-file" / "ckpt")  # a directory inside a file: fails
        dash.buttons["save"].click()
        assert "save() failed" in dash.message.value and "rlnb-error" in dash.message.value
        assert "<b>a-file" not in dash.message.value and "&lt;b&gt;a-file" in dash.message.value


def test_state_and_gauges_follow_the_session() -> None:
    with rlnb.Session(CONFIG.replace(mode="async"), name="dash-live") as sess:
        dash = sess.dashboard()
        wait_until(lambda: dash.ticks > 0, "the first tick")
        # a fresh session does nothing: it says so, in each of its two words
        assert (training_word(dash), state_word(dash)) == ("IDLE", "STOPPED"), dash.state.value
        assert row(dash, "training") == "idle" and row(dash, "generation").startswith("stopped: sess.training.start()")
        assert "policy version</th>" in dash.state.value
        assert "model</th><td" in dash.state.value and "tiny policy (d_model 32, 1 layer) on CPU" in dash.state.value
        threads_before, _ = gauge(dash, "threads")

        sess.training.start()  # a training thread, rollouts dispatching, tokens generated
        wait_until(lambda: sess.version >= 2, "two steps")
        wait_until(lambda: gauge(dash, "threads")[0] > threads_before, "the training thread in the gauges")
        wait_until(lambda: gauge(dash, "event loops")[1] == 1, "the session's bridge loop in the gauges")
        wait_until(lambda: training_word(dash) == "BACKGROUND", "training in the state")
        wait_until(lambda: row(dash, "training").startswith("in the background, "), "its steps/s")
        wait_until(lambda: state_word(dash) == "RUNNING", "generation in the state")
        wait_until(lambda: re.search(r"[1-9][\d,]* tokens/s", dash.state.value) is not None, "tokens/s")
        wait_until(lambda: "<table>" in dash.rollouts.value, "the last rollouts")
        assert re.search(r"the batch of step \d+: 2 of 4 groups", dash.rollouts.value), dash.rollouts.value
        training_threads = gauge(dash, "threads")[0]
        sess.training.stop()
        shows_version = re.compile(rf"policy version</th><td[^>]*>{sess.version} \(engine {sess.version}\)")
        wait_until(lambda: shows_version.search(dash.state.value) is not None, "the last version")
        wait_until(lambda: gauge(dash, "threads")[0] < training_threads, "the training thread to go")
        wait_until(lambda: dash.curves.value != b"", "the curves")
        # reward, entropy, held-out accuracy, and the clip: inactive with one update per batch
        assert dash.curves.value.count("data:image/svg+xml;base64,") == 4
        assert 'alt="clip fraction" title="clip inactive (ratio 1: one update per batch)"' in dash.curves.value
        assert "clip inactive (ratio 1: one update per batch)" in dash.static_html()


def test_the_clip_chart_draws_the_fraction_where_a_clip_acts_and_says_why_not_elsewhere() -> None:
    import dataclasses

    several = CONFIG.replace(learn=dataclasses.replace(CONFIG.learn, epochs=2))
    with rlnb.Session(several, name="dash-clip") as sess:
        dash = sess.dashboard()
        sess.train(3, progress=False)
    assert sess.history[-1]["clip_active"] == 1.0
    closed = dash.static_html()  # the last frame, drawn at the close
    assert re.search(r'<img alt="clip fraction" src="data:image/svg\+xml', closed) and "clip inactive" not in closed
    with rlnb.Session(CONFIG, name="dash-clip") as sess:
        dash = sess.dashboard()
        sess.train(3, progress=False)
    assert 'alt="clip fraction" title="clip inactive (ratio 1: one update per batch)"' in dash.static_html()


def test_the_state_shows_one_row_per_engine_replica() -> None:
    """With Ray replicas the engine reports each one; the state panel lists them
    (a live cluster's rows are checked in tests/engines/test_ray.py)."""
    import dataclasses

    from rlnb.notebook import _panels

    with rlnb.Session(CONFIG, name="dash-replicas") as sess:
        stats = sess.statistics()
    assert "engine replicas" not in _panels.state_html("s", stats, None)  # one in-process engine
    replicas = [
        {"index": 0, "state": "running", "in_flight": 3, "served": 40, "version": 7, "restarts": 1, "pid": 11},
        {"index": 1, "state": "dead", "in_flight": 0, "served": 9, "version": 5, "restarts": 2, "pid": 12},
    ]
    extra = {"replicas": replicas, "restarts": 3, "requeued": 4}
    shown = _panels.state_html(
        "s", dataclasses.replace(stats, engine=dataclasses.replace(stats.engine, extra=extra)), None
    )
    rows = re.findall(r'<tr class="rlnb-replica" data-state="(\w+)">(.*?)</tr>', shown)
    assert [state for state, _ in rows] == ["running", "dead"]
    cells = [re.findall(r"<td[^>]*>(?:<span[^>]*>)?([^<]*)", row) for _, row in rows]
    assert cells == [["0", "running", "3", "7", "1", "40"], ["1", "dead", "0", "5", "2", "9"]]
    assert "restarts 3, re-queued requests 4" in shown


def test_no_rollouts_table_before_the_first_step() -> None:
    with rlnb.Session(CONFIG, name="dash-empty") as sess:
        dash = sess.dashboard()
        wait_until(lambda: dash.ticks > 1, "two ticks")
        assert dash.rollouts.value == "" and dash.curves.value == ""


def test_closing_the_session_stops_the_ticker_and_leaves_a_static_copy(
    shown: list[tuple[Any, FakeHandle | None]],
) -> None:
    sess = rlnb.Session(CONFIG, name="dash-close")
    dash = sess.dashboard()
    callbacks = len(sess.callbacks)
    dash._ipython_display_()
    sess.step()
    wait_until(lambda: dash.curves.value != b"", "the curves")
    ticker = tickers("dash-close")[0]
    started = time.monotonic()
    sess.close(exit_code=1)
    print(f"\nsession close with a dashboard: {(time.monotonic() - started) * 1e3:.1f} ms")
    assert not ticker.is_alive() and dash.closed
    assert len(sess.callbacks) == callbacks - 1  # its last-batch callback is gone
    assert (training_word(dash), state_word(dash)) == ("CLOSED", "CLOSED") and "closed, exit code 1" in dash.state.value
    for name in ("open FDs", "threads", "child processes", "event loops", "tracker runs"):
        assert gauge(dash, name)[1] == 0, dash.gauges.value  # everything released
    assert "after close" in dash.gauges.value and "threads <b>" in dash.gauges.value
    assert all(button.disabled for button in dash.buttons.values())

    static = dash.static_html()
    assert "exit code 1" in static and "data:image/svg+xml;base64," in static and "rlnb-state-word" in static
    ((_, handle),) = shown
    assert handle is not None and len(handle.updates) == 1
    assert handle.updates[0].data == static  # the widget's output became the static copy
    assert dash._repr_html_() == static and "exit code 1" in repr(dash)

    dash._ipython_display_()  # shown again once closed: static, no widget
    assert shown[-1][1] is None and "exit code 1" in shown[-1][0].data
    dash.close()  # idempotent after the session closed it


def test_the_session_can_be_collected_while_its_dashboard_lives() -> None:
    sess = rlnb.Session(CONFIG, name="dash-gc")
    dash = sess.dashboard()
    dash.buttons["step"].click()
    wait_until(lambda: dash.ticks > 1, "ticks")
    ref = weakref.ref(sess)
    sess.close()
    del sess
    gc.collect()
    assert ref() is None
    assert dash.session is None and dash.closed
    assert "exit code 0" in dash.static_html()


def test_dashboard_close_is_idempotent_and_a_new_one_can_follow() -> None:
    with rlnb.Session(CONFIG, name="dash-twice") as sess:
        callbacks = len(sess.callbacks)
        dash = sess.dashboard()
        assert len(sess.callbacks) == callbacks + 1
        ticker = tickers("dash-twice")[0]
        dash.close()
        dash.close()
        assert not ticker.is_alive()  # joined by the first close()
        assert len(sess.callbacks) == callbacks
        assert "open; this is a copy" in dash.static_html()
        dash.buttons["step"].click()  # a closed dashboard's buttons do nothing
        assert sess.version == 0

        again = sess.dashboard()
        assert again is not dash and not again.closed and len(tickers("dash-twice")) == 1
    assert again.closed and not tickers("dash-twice")


def test_a_dashboard_needs_a_live_session() -> None:
    sess = rlnb.Session(CONFIG, name="dash-closed")
    sess.close()
    with pytest.raises(rlnb.ClosedError):
        sess.dashboard()
    with pytest.raises(rlnb.ClosedError):
        rlnb.notebook.dashboard(sess)


def test_a_background_failure_shows_in_the_dashboard() -> None:
    class Boom(Callback):
        def on_step_end(self, metrics: Any) -> None:
            raise ValueError("boom")

    with rlnb.Session(CONFIG, name="dash-boom", callbacks=[Boom()]) as sess:
        dash = sess.dashboard()
        sess.training.start()
        wait_until(lambda: "background training failed" in dash.message.value, "the failure in the message")
        assert "boom" in dash.message.value and "rlnb-error" in dash.message.value
        with pytest.raises(rlnb.TrainingError) as info:  # the dashboard did not swallow it
            sess.statistics()
        assert str(info.value.__cause__) == "boom"


@pytest.mark.slow  # seconds of waiting or drawing: the integration tier
def test_the_cost_of_a_tick() -> None:
    with rlnb.Session(CONFIG, name="dash-cost") as sess:
        dash = rlnb.notebook.dashboard(sess, interval=60.0)  # its ticker ticks once, then waits
        wait_until(lambda: dash.ticks == 1, "the ticker's one tick")
        draws = []
        for _ in range(2):  # a first draw and a redraw
            sess.step()
            wait_until(lambda: time.monotonic() >= dash._next_curves, "the curves to be due", timeout=60)
            started = time.perf_counter()
            dash.tick()
            draws.append(time.perf_counter() - started)
        ticks = []
        for _ in range(50):
            started = time.perf_counter()
            dash.tick()
            ticks.append(time.perf_counter() - started)
        assert dash.curves.value.count("data:image/svg+xml;base64,") == 4
        ticks.sort()
        print(
            f"\ndashboard tick: median {ticks[25] * 1e3:.2f} ms, max {ticks[-1] * 1e3:.2f} ms; one that draws "
            f"the curves {draws[0] * 1e3:.1f} ms the first time, {draws[1] * 1e3:.1f} ms after (at most once a second)"
        )
        started = time.perf_counter()
        dash.close()
        print(f"dash.close() with a 60 s interval: {(time.perf_counter() - started) * 1e3:.1f} ms")


class _OnStep(Callback):
    """Runs ``fn`` inside the step whose policy version is ``at`` (on the training thread)."""

    def __init__(self, at: int, fn: Any) -> None:
        self.at, self.fn = at, fn

    def on_step_end(self, metrics: Any) -> None:
        if int(metrics["version"]) == self.at:
            self.fn()


def test_a_foreground_train_shows_as_such_and_turns_every_button_off() -> None:
    seen: dict[str, Any] = {}
    with rlnb.Session(CONFIG, name="dash-fg") as sess:
        dash = sess.dashboard()

        def look() -> None:  # the cell is busy training: only the ticker can tell the page
            wait_until(lambda: "step 3 of 5 (60 %)" in row(dash, "training"), "the train() call in the panel")
            wait_until(lambda: all(b.disabled for b in dash.buttons.values()), "every button off")
            seen.update(word=training_word(dash), row=row(dash, "training"), notice=dash.notice.value)
            seen["stats"] = sess.statistics(raise_errors=False).training

        sess.callbacks.append(_OnStep(3, look))
        sess.train(5, progress=False)
        assert seen["word"] == "FOREGROUND"
        assert seen["row"].startswith("train(until=5) in the foreground: step 3 of 5 (60 %)")
        assert "train(until=5) is running in the foreground, at step 3 of 5 (60 %)" in seen["notice"]
        assert "buttons are off until then" in seen["notice"]
        foreground = seen["stats"].foreground
        assert foreground.call == "train(until=5)" and (foreground.first, foreground.last) == (0, 5)
        after = sess.statistics().training
        assert after.foreground is None and after.last_foreground is not None
        assert after.last_foreground.call == "train(until=5)" and after.last_foreground.ended >= foreground.started
        wait_until(lambda: training_word(dash) == "IDLE" and not dash.buttons["step"].disabled, "the buttons back")
        assert dash.notice.value == ""


def test_wait_is_a_foreground_call_with_a_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    with rlnb.Session(CONFIG, name="dash-wait") as sess:
        dash = sess.dashboard()
        shown: list[Any] = []

        def in_wait() -> None:  # step 2 may end before the main thread has called wait(): wait for it
            waiting = lambda: (f := sess.statistics(raise_errors=False).training.foreground) and f.call == "wait()"  # noqa: E731
            wait_until(lambda: bool(waiting()), "wait() to begin")
            shown.append(sess.statistics(raise_errors=False).training)

        sess.callbacks.append(_OnStep(2, in_wait))
        capsys.readouterr()
        sess.training.start(steps=4)
        sess.training.wait()
        assert sess.version == 4
        (during,) = shown
        assert during.running and during.foreground is not None and during.foreground.call == "wait()"
        err = capsys.readouterr().err
        assert "rlnb dash-wait (background): 4/4 steps (100%)" in err, err
        del dash


def test_training_on_while_generation_pauses_says_where_its_batches_come_from() -> None:
    with rlnb.Session(CONFIG.replace(mode="async"), name="dash-paused-training") as sess:
        dash = sess.dashboard()
        sess.training.start()
        wait_until(lambda: sess.version >= 1 and sess.statistics().buffer.sizes.get("train", 0) >= 1, "a batch")
        sess.rollouts.pause("abort")
        wait_until(lambda: state_word(dash) == "PAUSED (abort)", "generation paused")
        # the learner may go on from what the buffer holds: legitimate, and said so
        assert training_word(dash) == "BACKGROUND"
        wait_until(lambda: "generation is paused, so it trains on the" in row(dash, "training"), "the reason")
        sess.rollouts.resume()
        sess.training.stop()


@pytest.mark.slow  # seconds of waiting or drawing: the integration tier
def test_the_last_frame_shows_the_figures_the_session_closed_with(
    shown: list[tuple[Any, FakeHandle | None]],
) -> None:
    sess = rlnb.Session(CONFIG.replace(mode="async"), name="dash-final")
    sess.train(3, progress=False)  # before the dashboard: the batch shown is named by its step, not counted
    dash = rlnb.notebook.dashboard(sess, interval=60.0)  # its ticker ticks once, then waits
    wait_until(lambda: dash.ticks == 1, "the ticker's one tick")
    dash.buttons["step"].click()

    def drawn() -> bool:  # the table follows at the curves' pace: tick until it is drawn
        dash.tick()
        return "the batch of step 4:" in dash.rollouts.value

    wait_until(drawn, "step 4's batch")
    sess.training.start()
    wait_until(lambda: sess.version >= 7, "background steps")
    sess.close()
    version = sess.version
    assert version >= 7
    assert row(dash, "policy version") == f"{version} (engine {version})"  # not the one tick's 3
    assert row(dash, "samples").startswith("in flight 0,")
    assert row(dash, "generation").startswith("closed (")
    assert row(dash, "training").startswith(f"ended at step {version}")
    assert f"the batch of step {version}:" in dash.rollouts.value
    assert f"the batch of step {version}:" in dash.static_html()


def test_stop_ends_background_generation_too() -> None:
    with rlnb.Session(CONFIG.replace(mode="async"), name="dash-stop") as sess:
        dash = sess.dashboard()
        sess.rollouts.start()  # generating into the buffer, nothing training
        wait_until(lambda: not dash.buttons["stop"].disabled, "stop on for background rollouts")
        dash.buttons["stop"].click()
        assert not sess.statistics().rollout.dispatching
        assert "training and background generation" in dash.message.value

        dash.buttons["start"].click()
        wait_until(lambda: sess.version >= 1 and sess.statistics().rollout.dispatching, "training")
        dash.buttons["stop"].click()
        stats = sess.statistics()
        assert not sess.training.running and not stats.rollout.dispatching
        assert f"stopped at step {sess.version}: training and background generation" in dash.message.value
        wait_until(lambda: dash.buttons["stop"].disabled, "stop off once everything stopped")
        assert "sess.rollouts.stop()" in dash.buttons["stop"].tooltip


def test_a_session_that_tracks_nothing_holds_no_tracker_run() -> None:
    with rlnb.Session(CONFIG, name="dash-no-run") as sess:  # the console backend only
        dash = sess.dashboard()
        wait_until(lambda: dash.ticks > 0, "a tick")
        assert gauge(dash, "tracker runs") == (0, 0)

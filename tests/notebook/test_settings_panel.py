"""The dashboard's settings panel, in-process: real sessions, ipywidgets without a
frontend, Apply pressed with ``Button.click()`` as ipywidgets' own tests do."""

from __future__ import annotations

import base64
import dataclasses
import datetime
import itertools
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import rlnb
from rlnb.config import LIVE_FIELDS, live_value
from rlnb.learn import Callback
from rlnb.learn._foreground import ForegroundCall
from rlnb.notebook import Dashboard, _clicks, _panels
from rlnb.notebook._curves import Curves, marks
from rlnb.notebook._settings import parse, shown_value
from tests.helpers import wait_until

CONFIG = rlnb.Config(
    task="addition",
    seed=0,
    data=rlnb.DataConfig(num_workers=0),
    rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=2, max_new_tokens=4),
    model=rlnb.ModelConfig(d_model=32, n_layers=1),
)


@pytest.fixture
def sess(request: pytest.FixtureRequest) -> Iterator[rlnb.Session]:
    with rlnb.Session(CONFIG, name=f"settings-{request.node.name[:40]}") as session:
        yield session


def said(dash: Dashboard) -> str:
    """The panel's message as text."""
    return re.sub(r"<[^>]+>", "", dash.settings_message.value).replace("&#x27;", "'").replace("&gt;", ">")


def svgs(dash: Dashboard) -> list[str]:
    """The curves' SVG documents."""
    return [base64.b64decode(data).decode() for data in re.findall(r"base64,([^\"]+)", dash.curves.value)]


def test_every_live_setting_has_an_input_filled_from_the_config(sess: rlnb.Session) -> None:
    import ipywidgets

    dash = sess.dashboard()
    assert list(dash.settings) == list(LIVE_FIELDS)
    values = {field: box.value for field, box in dash.settings.items()}
    assert values == {
        "lr": 1e-4, "lr_decay_steps": "", "algorithm": "grpo", "clip_low": 0.2, "clip_high": 0.2,
        "entropy_coef": 0.0, "kl_coef": 0.0, "clip_eps": 0.2, "is_cap": 2.0, "max_grad_norm": 1.0,
        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": "4", "max_policy_lag": "1",
        "groups_per_step": 2, "group_size": 4, "reward_weights": "",
    }  # fmt: skip
    assert isinstance(dash.settings["lr"], ipywidgets.FloatText)
    assert isinstance(dash.settings["top_k"], ipywidgets.IntText)
    assert isinstance(dash.settings["max_new_tokens"], ipywidgets.Text)
    assert dash.settings["max_new_tokens"].placeholder == "None: task's"
    # collapsed: the dashboard is no taller by default than a one-line header
    assert isinstance(dash.settings_panel, ipywidgets.Accordion) and dash.settings_panel.selected_index is None
    assert dash.settings_panel in dash.widget.children and "rlnb-settings" in dash.settings_panel._dom_classes
    assert not dash.apply_button.disabled


def test_apply_changes_lr_from_the_next_step_and_says_so(sess: rlnb.Session) -> None:
    sess.step()
    dash = sess.dashboard()
    dash.settings["lr"].value = 1e-3
    dash.apply_button.click()
    assert sess.config.learn.lr == 1e-3
    ((step, field, old, new),) = [(c.step, c.field, c.old, c.new) for c in sess.changes]
    assert (step, field, old, new) == (1, "lr", 1e-4, 1e-3)
    assert "rlnb-ok" in dash.settings_message.value
    assert said(dash) == "set at step 1: lr 0.0001 → 0.001 (from the next update)"
    assert dash.apply_button.description == "apply"
    sess.step()
    assert sess.history[-1]["lr"] == 1e-3 and sess.history[-2]["lr"] == 1e-4
    dash.apply_button.click()  # the input now shows the value in force: nothing is edited
    assert said(dash).startswith("nothing to apply") and len(sess.changes) == 1


def test_only_the_fields_edited_are_applied_together(sess: rlnb.Session) -> None:
    dash = sess.dashboard()
    dash.settings["temperature"].value = 0.7
    dash.settings["max_new_tokens"].value = ""  # None: the task's
    dash.settings["reward_weights"].value = "2"
    dash.apply_button.click()
    assert [c.field for c in sess.changes] == ["temperature", "max_new_tokens", "reward_weights"]
    r = sess.config.rollout
    assert (r.temperature, r.max_new_tokens, r.reward_weights) == (0.7, None, (2.0,))
    assert sess.config.learn == CONFIG.learn
    assert "temperature 1 → 0.7 (for groups dispatched from now on)" in said(dash)
    assert "max_new_tokens 4 → None" in said(dash) and "reward_weights None → (2)" in said(dash)
    assert dash.settings["reward_weights"].value == "2"


@pytest.mark.parametrize(
    ("field", "typed", "named"),
    [
        ("lr", -1.0, "LearnConfig.lr=-1.0 is invalid: use a learning rate > 0"),
        ("group_size", 1, "RolloutConfig.group_size=1 is invalid: use an int >= 2"),
        ("lr_decay_steps", "ten", "lr_decay_steps='ten' is not a whole number"),
        ("reward_weights", "1, x", "reward_weights='1, x' is not a list of numbers"),
        ("reward_weights", "1, 2", "RolloutConfig.reward_weights=(1.0, 2.0) is invalid"),
    ],
)
def test_a_bad_value_is_said_in_the_panel_and_nothing_changes(
    sess: rlnb.Session, capsys: pytest.CaptureFixture[str], field: str, typed: Any, named: str
) -> None:
    dash = sess.dashboard()
    capsys.readouterr()
    dash.settings["temperature"].value = 0.5  # applied with it, or not at all
    dash.settings[field].value = typed
    dash.apply_button.click()
    assert "rlnb-error" in dash.settings_message.value and "b00020" in dash.settings_message.value
    assert said(dash).startswith(named), said(dash)
    assert sess.config == CONFIG and sess.changes == []
    # the refused value goes (left, it would fail every later Apply); what was typed beside it stays
    in_force = live_value(CONFIG, field)
    assert dash.settings[field].value == shown_value(field, in_force)
    assert re.search(r"[^.]\. Nothing was applied; back to the value in force: \w+ [^ ]+\.$", said(dash)), said(dash)
    assert dash.settings["temperature"].value == 0.5
    assert dash.message.value == ""  # the panel says it, not the dashboard's line
    dash.apply_button.click()  # the next Apply applies what is left
    assert said(dash) == "set at step 0: temperature 1 → 0.5 (for groups dispatched from now on)", said(dash)
    assert [c.field for c in sess.changes] == ["temperature"]
    out = capsys.readouterr()
    assert out.err == "" and out.out == ""


def test_apply_settings_does_what_the_click_does_and_raises_from_code(sess: rlnb.Session) -> None:
    dash = sess.dashboard()
    (change,) = dash.apply_settings(kl_coef=0.0, clip_eps=0.1)  # kl_coef as it is: no change
    assert (change.field, change.new) == ("clip_eps", 0.1) and dash.settings["clip_eps"].value == 0.1
    assert said(dash) == "set at step 0: clip_eps 0.2 → 0.1 (from the next update)"
    with pytest.raises(rlnb.ConfigError, match="is_cap"):
        dash.apply_settings(is_cap=0.5)
    assert "LearnConfig.is_cap=0.5 is invalid" in said(dash) and live_value(sess.config, "is_cap") == 2.0
    with pytest.raises(rlnb.ConfigError, match="not a setting"):
        dash.apply_settings(learning_rate=1e-3)
    dash.close()
    with pytest.raises(rlnb.ClosedError, match=r"use sess\.set"):
        dash.apply_settings(lr=1e-3)


def test_a_change_made_in_code_shows_at_the_next_tick_but_not_over_an_edit(sess: rlnb.Session) -> None:
    dash = sess.dashboard()
    dash.settings["top_k"].value = 3  # being edited
    sess.set(temperature=0.8, top_k=5, max_policy_lag=None)
    dash.tick()
    assert dash.settings["temperature"].value == 0.8 and dash.settings["max_policy_lag"].value == ""
    assert dash.settings["top_k"].value == 3  # what is typed stays
    dash.apply_button.click()  # and is still the edit
    assert sess.config.rollout.top_k == 3 and "top_k 5 → 3" in said(dash)
    assert sess.config.rollout.temperature == 0.8


class _OnStep(Callback):
    def __init__(self, at: int, fn: Any) -> None:
        self.at, self.fn = at, fn

    def on_step_end(self, metrics: Any) -> None:
        if int(metrics["version"]) == self.at:
            self.fn()


def test_apply_while_training_in_the_background(sess: rlnb.Session) -> None:
    dash = sess.dashboard()
    sess.training.start()
    try:
        wait_until(lambda: sess.version >= 2, "two background steps")
        wait_until(lambda: not dash.apply_button.disabled, "apply on beside background training")
        dash.settings["lr"].value = 2e-4
        dash.apply_button.click()
        (change,) = sess.changes
        assert change.new == 2e-4 and said(dash).startswith(f"set at step {change.step}: lr 0.0001 → 0.0002")
        # a step under way keeps the lr it started with; the one after it has the new one
        wait_until(lambda: sess.version >= change.step + 2, "two steps after the change", timeout=60)
    finally:
        sess.training.stop()
    after = {int(m["version"]): m["lr"] for m in sess.history if m["version"] > change.step}
    assert after[change.step + 2] == 2e-4 and set(after.values()) <= {1e-4, 2e-4}
    first = min(v for v, lr in after.items() if lr == 2e-4)
    assert all(lr == 2e-4 for v, lr in after.items() if v >= first)


def test_apply_beside_a_foreground_train_from_another_thread(sess: rlnb.Session) -> None:
    """What a click through a kernel subshell does: Apply on another thread while
    ``train()`` holds the main thread."""
    dash = sess.dashboard()
    seen: dict[str, Any] = {}

    def click() -> None:
        seen["usable"] = _panels.settings_usable(sess.statistics(raise_errors=False), live_clicks=True)
        dash.settings["kl_coef"].value = 0.0  # unchanged: not edited
        dash.settings["max_grad_norm"].value = 0.5
        dash.apply_button.click()

    def at_step_2() -> None:
        clicker = threading.Thread(target=click, name="subshell")
        clicker.start()
        clicker.join(10)

    sess.callbacks.append(_OnStep(2, at_step_2))
    sess.train(4, progress=False)
    assert seen["usable"] is True
    ((step, field, new),) = [(c.step, c.field, c.new) for c in sess.changes]
    assert (step, field, new) == (2, "max_grad_norm", 0.5) and sess.config.learn.max_grad_norm == 0.5
    assert sess.version == 4


def test_apply_is_off_while_a_foreground_call_holds_the_kernel_unless_clicks_reach_it(sess: rlnb.Session) -> None:
    idle = sess.statistics()
    call = ForegroundCall("train(until=150)", started=0.0, thread="MainThread", first=0, last=150)
    busy = dataclasses.replace(idle, training=dataclasses.replace(idle.training, foreground=call))
    assert _panels.settings_usable(idle) and not _panels.settings_usable(busy)
    assert _panels.settings_usable(busy, live_clicks=True)
    assert not _panels.settings_usable(dataclasses.replace(idle, closed=True), live_clicks=True)
    assert not _panels.settings_usable(None)
    notice = _panels.controls_notice(busy, live_clicks=True)
    assert "pause and resume work meanwhile, and so does the settings' apply" in notice
    # a click through a subshell runs beside the call; one the kernel held back is refused
    assert _clicks.refusal("apply", busy, off=False, why_off="") is None
    assert "apply: not run" in (_clicks.refusal("apply", busy, off=True, why_off="off") or "")
    assert "step: not run" in (_clicks.refusal("step", busy, off=False, why_off="") or "")


def test_a_click_is_refused_only_if_made_while_the_call_held_the_kernel(sess: rlnb.Session) -> None:
    """A click handled just after a call on this thread ended was held back by it only
    if the page made it before the call ended: one made after it runs, however soon."""
    idle = sess.statistics()
    now = time.monotonic()
    save = ForegroundCall("save()", started=now - 0.6, thread="subshell", ended=now - 0.05)
    save = dataclasses.replace(save, thread_id=threading.get_ident())
    just_after = dataclasses.replace(idle, training=dataclasses.replace(idle.training, last_foreground=save))
    held = _clicks.refusal("resume", just_after, off=False, why_off="", made=now - 0.3)
    assert held is not None and "clicked while save() held the kernel" in held
    assert _clicks.refusal("resume", just_after, off=False, why_off="", made=now - 0.01) is None
    # a message with no date: taken as held back, as before
    assert _clicks.refusal("resume", just_after, off=False, why_off="") is not None
    # the page's date, as Jupyter's header has it (an aware datetime, or ISO text in UTC)
    page = {"header": {"date": datetime.datetime.now(datetime.UTC)}}
    assert abs((_clicks.made_at(page) or 0.0) - time.monotonic()) < 5.0
    text = {"header": {"date": datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")}}
    assert abs((_clicks.made_at(text) or 0.0) - time.monotonic()) < 5.0
    assert _clicks.made_at({"header": {}}) is None


def test_the_curves_mark_each_change_at_its_step(sess: rlnb.Session) -> None:
    dash = rlnb.notebook.dashboard(sess, interval=60.0)  # its ticker ticks once, then waits
    wait_until(lambda: dash.ticks == 1, "the ticker's one tick")
    sess.train(2, progress=False)
    dash.apply_settings(lr=1e-3, temperature=0.9)
    sess.train(4, progress=False)
    wait_until(lambda: dash._next_curves <= time.monotonic(), "the curves to be due", timeout=60)
    dash.tick()
    charts = svgs(dash)
    assert len(charts) == 4 and "no data yet" in charts[2]  # held-out accuracy: nothing evaluated
    assert "clip inactive" in charts[3]  # one update per batch: no clip fraction to draw
    for svg in charts[:2]:  # one line and one label for the two changes at step 2, on each chart
        assert re.findall(r'class="rlnb-change" data-step="(\d+)"', svg) == ["2"]
        assert re.findall(r'class="rlnb-change-label"[^>]*>([^<]+)<', svg) == ["lr→0.001, temperature→0.9"]
    static = dash.static_html()
    assert "settings</b>: lr 0.001 · " in static and "temperature 0.9" in static


def test_marks_share_a_step_and_leave_out_labels_that_would_overlap() -> None:
    from rlnb.config import Change

    changes = [Change(5, "lr", 1e-4, 1e-3), Change(5, "lr", 1e-3, 3e-4), Change(6, "top_k", 0, 5)]
    changes += [Change(6, "reward_weights", None, (1.0, 0.5)), Change(40, "max_new_tokens", 4, None)]
    assert marks(changes) == [(5.0, "lr→0.0003"), (6.0, "top_k→5, reward_weights→(…"), (40.0, "max_new_tokens→None")]
    many = [Change(s, "lr", 1e-4, 1e-3) for s in range(1, 11)]
    svg = Curves().chart("reward_mean", [(float(x), 0.5) for x in range(1, 11)], marks=marks(many))
    assert svg.count('class="rlnb-change"') == 10
    labels = re.findall(r'class="rlnb-change-label" x="([\d.]+)" y="([\d.]+)"', svg)
    assert 3 <= len(labels) < 10  # three rows of labels, none over another
    rows: dict[str, list[float]] = {}
    for x, y in labels:
        rows.setdefault(y, []).append(float(x))
    assert all(b - a >= 45 for xs in rows.values() for a, b in itertools.pairwise(xs))


def test_parse_reads_what_is_typed() -> None:
    assert parse("reward_weights", " 1, 0.5 ") == (1.0, 0.5) and parse("reward_weights", "(1 2)") == (1.0, 2.0)
    assert parse("reward_weights", "") is None and parse("max_policy_lag", "None") is None
    assert parse("lr_decay_steps", "3_000") == 3000 and parse("lr", 0.5) == 0.5
    with pytest.raises(rlnb.ConfigError, match="every weight must be a finite number"):
        parse("reward_weights", "1, inf")


def test_closing_the_session_leaves_the_final_settings_and_closes_every_widget() -> None:
    sess = rlnb.Session(CONFIG, name="settings-close")
    dash = sess.dashboard()
    dash.apply_settings(top_p=0.9)
    sess.set(lr=5e-4)  # made in code, after the panel's last word
    panel = [dash.settings_panel, dash.apply_button, dash.settings_message, *dash.settings.values()]
    sess.close()
    assert dash.apply_button.disabled and all(box.disabled for box in dash.settings.values())
    static = dash.static_html()
    assert "<b>settings</b>: lr 0.0005 · " in static and "top_p 0.9" in static
    assert "set at step 0: top_p 1 → 0.9" in static  # the last change applied here
    for widget in panel:
        assert widget.comm is None and widget.layout.comm is None


def test_a_change_echoes_its_time_as_a_person_reads_it() -> None:
    from rlnb.config import Change

    change = Change(20, "lr", 1e-4, 4e-4, time=time.mktime((2026, 12, 6, 9, 30, 5, 0, 0, -1)))
    assert repr(change) == "Change(step=20, field='lr', old=0.0001, new=0.0004, time='2026-12-06 09:30:05')"
    assert str(change) == "step 20: lr 0.0001 -> 0.0004"

"""The dashboard's panels from statistics snapshots: what the state words say in
each situation, which buttons are on and why, and what Ray keeps after close."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import pytest

import rlnb
from rlnb.learn._foreground import ForegroundCall
from rlnb.notebook import _panels
from rlnb.session import SessionStatistics
from tests.helpers import small_config

CONFIG = small_config(rollout=rlnb.RolloutConfig())


@pytest.fixture
def idle() -> SessionStatistics:
    """A fresh session's snapshot (it outlives the session)."""
    with rlnb.Session(CONFIG, name="panels") as sess:
        return sess.statistics()


def words(page: str) -> tuple[str, str]:
    """(training, generation): the two state words' data-state."""
    found = dict(re.findall(r'class="rlnb-(training|state)-word" data-state="(\w+)"', page))
    return found["training"], found["state"]


def with_(stats: SessionStatistics, **parts: dict[str, object]) -> SessionStatistics:
    return dataclasses.replace(
        stats, **{name: dataclasses.replace(getattr(stats, name), **changes) for name, changes in parts.items()}
    )


def test_a_fresh_session_is_idle_and_generates_nothing(idle: SessionStatistics) -> None:
    page = _panels.state_html("s", idle, None, mode="async")
    assert words(page) == ("idle", "stopped")  # not a green RUNNING
    assert "sess.training.start(), step() or sess.rollouts.start() starts it" in page
    assert _panels.usable(idle) == {
        "start": True, "stop": False, "pause": True, "resume": False, "step": True, "evaluate": True, "save": True,
    }  # fmt: skip
    assert _panels.controls_notice(idle) == ""


def test_sync_mode_generating_for_a_step_is_running(idle: SessionStatistics) -> None:
    stats = with_(idle, rollout={"in_flight": 126, "dispatching": False})
    page = _panels.state_html("s", stats, None, mode="sync")
    assert words(page)[1] == "running"  # not "not dispatching" with 126 in flight
    assert "for the step in progress (sync mode): 126 in flight" in page


def test_a_foreground_call_turns_every_button_off_and_says_why(idle: SessionStatistics) -> None:
    call = ForegroundCall("train(until=150)", started=0.0, thread="MainThread", first=0, last=150)
    stats = with_(idle, training={"foreground": call, "step": 41})
    page = _panels.state_html("s", stats, None, mode="sync")
    assert words(page)[0] == "foreground"
    assert "train(until=150) in the foreground: step 41 of 150 (27 %)" in page
    # clicks held back until the call returns: every button off
    assert not any(_panels.usable(stats).values())
    notice = _panels.controls_notice(stats)
    assert notice.startswith("train(until=150) is running in the foreground, at step 41 of 150 (27 %)")
    assert "the kernel runs clicks only once it returns" in notice
    assert "interrupt the kernel (■) to stop it" in notice
    # clicks that arrive at once (a kernel subshell): pause and resume may run beside it
    live = _panels.usable(stats, live_clicks=True)
    assert {m for m, on in live.items() if on} == {"pause"}  # resume once paused
    assert "pause and resume work meanwhile" in _panels.controls_notice(stats, live_clicks=True)

    # train(300) from step 734: the share is of the call's 300 steps, and says so
    later = with_(
        idle,
        training={"foreground": dataclasses.replace(call, call="train(until=1034)", first=734, last=1034), "step": 740},
    )
    assert "at step 740 of 1034, 6 of 300 (2 %)" in _panels.controls_notice(later)

    wait = dataclasses.replace(call, call="wait()", first=None)
    waiting = with_(idle, training={"foreground": wait, "running": True})
    assert words(_panels.state_html("s", waiting, None))[0] == "background"  # wait() only waits on it
    assert "to stop waiting (training goes on)" in _panels.controls_notice(waiting)
    assert {m for m, on in _panels.usable(waiting, live_clicks=True).items() if on} == {"stop", "pause"}


def test_paused_generation_names_its_mode_and_training_says_where_batches_come_from(idle: SessionStatistics) -> None:
    stats = with_(
        idle,
        rollout={"state": "paused", "kept_partial": 12},
        engine={"paused": "abort"},
        training={"running": True, "steps_per_s": 4.2},
        buffer={"sizes": {"train": 30}},
    )
    page = _panels.state_html("s", stats, None, mode="async")
    assert words(page) == ("background", "paused")
    assert ">PAUSED (abort)<" in page and "paused (abort): 12 kept as partial rollouts" in page
    assert "in the background, 4.2 steps/s; generation is paused, so it trains on the 30 groups in the buffer" in page
    pausing = with_(stats, rollout={"state": "pausing", "in_flight": 8}, engine={"paused": "wait"})
    assert "pausing (wait): 8 in flight finish first" in _panels.state_html("s", pausing, None)


def test_stop_is_on_while_anything_runs_in_the_background(idle: SessionStatistics) -> None:
    assert _panels.usable(with_(idle, rollout={"dispatching": True}))["stop"]
    assert _panels.usable(with_(idle, training={"running": True}))["stop"]


def test_a_closed_state_shows_the_final_figures_and_no_epitaph(idle: SessionStatistics) -> None:
    closed = dataclasses.replace(idle, closed=True)
    page = _panels.state_html("s", closed, 123.0, exit_code=0)
    assert words(page) == ("closed", "closed") and "closed, exit code 0" in page
    assert "rlnb-gone" not in page and "- tokens/s" in page
    live = _panels.state_html("s", idle, None)
    # a kernel restart: the page hides the live figures and each part's broken-link icon
    assert ".jupyter-widgets-disconnected .rlnb-live{display:none}" in live
    assert "jupyter-widgets-disconnected::before{display:none!important}" in live


def test_the_last_batch_is_named_by_the_step_it_trained() -> None:
    batch = _panels.LastBatch()
    groups = [rlnb.Group(prompt="p", samples=(rlnb.Sample(prompt="p", completion="c"),))]
    batch.on_batch(groups)
    assert batch.last == (0, ())  # not trained yet
    batch.on_step_end({"version": 151.0})
    assert batch.last == (151, tuple(groups))
    page = _panels.rollouts_html(groups, 151)
    assert "the batch of step 151: 1 of 1 groups" in page
    cells = re.findall(r"<t[hd][ >][^>]*", page)
    assert cells and all("text-align:left" in c for c in cells), cells  # headers over their columns


def test_what_a_library_keeps_for_the_process_is_said_after_close() -> None:
    from types import SimpleNamespace

    ray = SimpleNamespace(
        owner="Ray",
        reason="its core worker keeps them after ray.shutdown(); a kernel restart frees them",
        fds={14: "anon_inode:[eventpoll]", 19: "socket:[1]", 26: "/runs/ray/logs/python-core-driver-01_1.log"},
        threads=("event_engine", "event_engine", "grpc_global_tim"),
    )
    page = _panels.kept_html(SimpleNamespace(process_long=(ray,)))  # type: ignore[arg-type]
    (kept,) = re.findall(r'<div class="rlnb-kept"[^>]*>([^<]*)</div>', page)
    assert kept.startswith("Ray keeps 3 FDs (log files 1, sockets 1, event FDs 1) and 3 threads")
    assert "event_engine x2, grpc_global_tim" in kept and "a kernel restart frees them" in kept


def conversation() -> rlnb.Group:
    """A conversation by hand (ids 0 to 3 decode as "a", "b", "<c>", "d"): the policy says "ab", the
    environment "<c>", the policy "d"; beside it a single completion."""
    talk = rlnb.Sample(
        "p", "ab<c>d", (0, 1, 2, 3), (-0.1, -0.2, 0.0, -0.3), (0, 0, 0, 0), reward=1.0,
        mask=(1, 1, 0, 1), turns=(0, 3), env_reward=0.5,
    )  # fmt: skip
    single = rlnb.Sample("p", "ab", (0, 1), (-0.1, -0.2), (0, 0), reward=0.0)
    return rlnb.Group(prompt="p", samples=(talk, single))


def decode(ids: Sequence[int]) -> str:
    return "".join(("a", "b", "<c>", "d")[i] for i in ids)


def turns(page: str) -> list[tuple[str, str]]:
    """(speaker, text) of each block of a conversation, in order."""
    found = re.findall(
        r'<div class="rlnb-turn[^"]*" data-speaker="(\w+)"[^>]*><span[^>]*>(\w+)</span>(.*?)</div>', page
    )
    assert all(speaker == label for speaker, label, _ in found)
    return [(speaker, re.sub("<[^>]+>", "", text)) for speaker, _, text in found]


def test_a_conversation_shows_turn_by_turn_with_its_speakers() -> None:
    page = _panels.rollouts_html([conversation()], 7, decode=decode)
    assert turns(page) == [("policy", "ab"), ("env", "&lt;c&gt;"), ("policy", "d")]
    (env,) = re.findall(r'<div class="rlnb-turn rlnb-env"[^>]*>', page)
    assert "dashed" in env and "font-style:italic" in env and "not trained on" in env
    assert 'data-speaker="env" data-turn="1"' in env  # the reply to the first turn
    assert '1.00 <span class="rlnb-env-reward"' in page and "(env 0.50)" in page
    # the single completion beside it, as ever: its text in one cell, no reward of an environment
    rows = re.findall(r"<tr>.*?</tr>", page)
    assert len(rows) == 3 and "<code>ab</code></td><td" in rows[2] and "rlnb-env" not in rows[2]
    cells = re.findall(r"<t[hd][ >][^>]*", page)
    assert all("text-align:left" in c for c in cells)
    # without the tokenizer the turns' texts are unknown: the whole text, with its turns counted
    page = _panels.rollouts_html([conversation()], 7)
    assert turns(page) == [] and "2 policy turns, 1 env reply" in page and "ab&lt;c&gt;d" in page


def test_single_completions_show_as_the_rollout_batch_table_does() -> None:
    single = conversation().samples[1]
    groups = [rlnb.Group(prompt="<p>", samples=(single, dataclasses.replace(single, completion="<b>", resumed=1)))]
    page = _panels.rollouts_html(groups, 1, decode=decode)
    (table,) = re.findall(r"<table>.*</table>", page)
    assert re.sub(r' style="[^"]*"', "", table) == rlnb.RolloutBatch(groups)._repr_html_()

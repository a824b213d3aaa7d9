"""SessionStatistics reads as a short block of text and a small HTML table."""

from __future__ import annotations

import dataclasses
import re

import pytest

import rlnb
from rlnb.learn import TrainingStatistics
from rlnb.session import SessionStatistics
from tests.helpers import small_config

CONFIG = small_config(rollout=rlnb.RolloutConfig())


@pytest.fixture
def stats() -> SessionStatistics:
    with rlnb.Session(CONFIG, name="repr") as sess:
        sess.rollout(1)
        return sess.statistics()  # a frozen snapshot: it outlives the session


def with_training(stats: SessionStatistics, training: TrainingStatistics) -> SessionStatistics:
    return dataclasses.replace(stats, training=training)


def assert_readable(text: str) -> list[str]:
    lines = text.splitlines()
    assert 5 <= len(lines) <= 20, text
    assert all(len(line) < 100 for line in lines), text
    return lines


def test_statistics_read_as_short_lines_with_the_counts(stats: SessionStatistics) -> None:
    text = repr(stats)
    assert_readable(text)
    for section in ("session", "rollouts", "buffer", "engine"):
        assert re.search(rf"^\s*{section}\s", text, re.MULTILINE), (section, text)
    assert "'repr', open" in text
    assert f"finished {stats.rollout.finished}" in text and stats.rollout.finished > 0
    assert f"put {stats.buffer.put}" in text
    assert f"capacity {stats.buffer.capacity}" in text
    assert f"{stats.engine.generated_tokens} tokens generated" in text
    assert re.search(r"^\s*training\s+idle, step 0", text, re.MULTILINE), text


def test_a_training_section_shows_step_rate_metrics_waiting_and_error(stats: SessionStatistics) -> None:
    metrics = {f"extra_{i}": float(i) for i in range(10)} | {"accuracy": 0.25, "reward_mean": 0.4375}
    training = TrainingStatistics(
        running=True,
        step=12,
        steps_per_s=3.14159,
        last_metrics=metrics,
        waiting="for rollouts <version 3>",
        error="RuntimeError: " + "x" * 300 + "\nTraceback line",
    )
    text = repr(with_training(stats, training))
    assert_readable(text)
    assert re.search(r"^\s*training\s+in the background, step 12, 3.142 steps/s", text, re.MULTILINE), text
    assert "reward_mean 0.4375, accuracy 0.25" in text  # the metrics a reader looks for come first
    assert "… and" in text  # not all twelve metrics
    assert "waiting: for rollouts <version 3>" in text
    assert "error: RuntimeError: xxx" in text and "Traceback" not in text

    page = with_training(stats, training)._repr_html_()
    assert "&lt;version 3&gt;" in page and "<version" not in page


def test_a_stopped_training_without_rate_or_metrics_is_one_line(stats: SessionStatistics) -> None:
    text = repr(with_training(stats, TrainingStatistics(False, 0, None, {}, None, None)))
    training_lines = [line for line in text.splitlines() if "step 0" in line]
    assert len(training_lines) == 1 and "idle" in training_lines[0] and "steps/s" not in text, text


def test_a_foreground_call_shows_as_the_call_with_its_progress(stats: SessionStatistics) -> None:
    from rlnb.learn._foreground import ForegroundCall

    call = ForegroundCall("train(until=150)", started=0.0, thread="MainThread", first=10, last=150)
    training = TrainingStatistics(False, 41, 3.1, {}, None, None, foreground=call)
    text = repr(with_training(stats, training))
    assert re.search(r"^\s*training\s+train\(until=150\) in the foreground, step 41, 3.1 steps/s", text, re.M), text
    assert call.progress(41) == "step 41 of 150, 31 of 140 (22 %)"  # the share is of the call's own steps
    assert dataclasses.replace(call, first=0).progress(41) == "step 41 of 150 (27 %)"


def test_cancelled_rollouts_show_apart_from_failed_ones(stats: SessionStatistics) -> None:
    rollout = dataclasses.replace(stats.rollout, cancelled=7)
    assert "cancelled 7" in repr(dataclasses.replace(stats, rollout=rollout))


def test_statistics_render_as_an_html_table(stats: SessionStatistics) -> None:
    page = stats._repr_html_()
    assert page.startswith("<table>") and page.endswith("</table>")
    for section in ("session", "rollouts", "buffer", "engine"):
        assert f">{section}</th>" in page
    assert "&#x27;repr&#x27;" in page  # the quoted name, escaped


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({}, "idle (nothing dispatched in the background)"),
        ({"in_flight": 126}, "generating for a call in progress"),  # a sync step's own rollout
        ({"dispatching": True, "in_flight": 8}, "generating in the background"),
        ({"dispatching": True, "groups_live": 32, "groups_allowed": 32}, "held: the policy-lag budget is spent"),
        ({"state": "paused", "in_flight": 8, "queued": 8}, "paused, background dispatch stopped"),
    ],
)
def test_the_rollouts_line_says_what_generates_and_why(
    stats: SessionStatistics, change: dict[str, object], said: str
) -> None:
    rollout = dataclasses.replace(stats.rollout, **{"dispatching": False, "in_flight": 0, **change})
    text = repr(dataclasses.replace(stats, rollout=rollout))
    line = next(line for line in text.splitlines() if line.strip().startswith("rollouts"))
    assert said in line and "not dispatching" not in text, text
    if rollout.queued:
        assert "of them queued 8" in text

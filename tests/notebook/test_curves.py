"""The dashboard's SVG curves: a grid with round labels on both axes."""

from __future__ import annotations

import re

from rlnb.notebook._curves import Curves, ticks


def test_ticks_are_round_and_within_the_range() -> None:
    assert ticks(0.0, 1.0) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert ticks(1.0, 151.0) == [50.0, 100.0, 150.0]
    assert ticks(0.13, 0.61) == [0.2, 0.4, 0.6]
    assert ticks(2.0, 2.0) == [2.0]
    assert ticks(1.0, 2.0, whole=True) == [1.0, 2.0]  # steps: no step 1.25
    assert ticks(0.0, 10.0, whole=True) == [0.0, 5.0, 10.0]


def test_a_chart_has_a_labelled_grid() -> None:
    svg = Curves().chart("reward_mean", [(float(x), x / 200) for x in range(1, 152)])
    labels = re.findall(r'<text[^>]*text-anchor="(?:end|middle)">([^<]+)</text>', svg)
    assert {"0.2", "0.4", "0.6", "50", "100", "150"} <= set(labels), labels
    assert svg.count('stroke="#e4e4e4"') >= 6  # grid lines, not just the ends
    assert "no data yet" in Curves().chart("entropy", [])


def test_each_reward_function_of_a_task_with_several_gets_a_chart() -> None:
    history = [
        {"version": v, "reward_mean": 0.5, "entropy": 1.0, "reward/exact_match": 0.1 * v, "reward/exact_match/std": 0.0}
        for v in range(1, 4)
    ]
    html = Curves().render(history, [])
    assert re.findall(r'alt="([^"]+)"', html) == ["reward_mean", "entropy", "held-out accuracy", "reward/exact_match"]
    assert re.findall(r'alt="([^"]+)"', Curves().render([{"reward_mean": 1.0}], [])) == [
        "reward_mean",
        "entropy",
        "held-out accuracy",
    ]  # one function: no extra chart

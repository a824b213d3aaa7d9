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


def test_close_values_get_labels_that_tell_them_apart() -> None:
    # an entropy between 2.6953 and 2.6964 had its ticks read "2.696", "2.696", "2.695"
    svg = Curves().chart("entropy", [(float(x), 2.6953 + x * 1e-4) for x in range(1, 12)])
    ys = re.findall(r'<text[^>]*text-anchor="end">([^<]+)</text>', svg)
    values = [y for y in ys if y != "step"]
    assert len(values) >= 3 and len(set(values)) == len(values), values
    assert all(float(v) == round(float(v), 5) for v in values), values


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


def test_values_beyond_float32s_range_are_left_off_and_counted_and_the_rest_draws() -> None:
    import base64

    history = [
        {"version": 1, "reward_mean": 1e308, "entropy": 1.0},
        {"version": 2, "reward_mean": -1e308, "entropy": float("inf")},
        {"version": 3, "reward_mean": 0.5, "entropy": 0.9},
    ]
    # Before: OverflowError (an axis from -1e308 to 1e308 is inf wide), every frame.
    html = Curves().render(history, [(3, 0.5)])
    reward, entropy = (base64.b64decode(data).decode() for data in re.findall(r"base64,([^\"]+)", html)[:2])
    assert "2 values beyond ±3.4e+38 not drawn" in reward and "<circle" in reward  # the one point left
    assert "1 value beyond ±3.4e+38 not drawn" in entropy and "<polyline" in entropy
    assert "nothing to draw" in Curves().chart("reward_mean", [(1.0, 1e308)], marks=[(1.0, "lr→0.1")])
    svg = Curves().chart("reward_mean", [(1.0, 3.4e38), (2.0, -3.4e38)], marks=[(2.0, "lr→0.1"), (1e308, "far")])
    assert "not drawn" not in svg and svg.count('class="rlnb-change"') == 1  # within the range: drawn
    assert ticks(-1e308, 1e308) == [-1e308]


def _charts(html: str) -> dict[str, tuple[str, str]]:
    """``{alt: (title, svg)}`` of the charts of a rendered block."""
    import base64

    found = re.findall(r'<img alt="([^"]+)"(?: title="([^"]*)")? src="data:image/svg\+xml;base64,([^"]+)">', html)
    return {alt: (title, base64.b64decode(data).decode()) for alt, title, data in found}


def _texts(svg: str) -> list[str]:
    return re.findall(r"<text[^>]*>([^<]*)</text>", svg)


def clip_step(version: int, active: float, fraction: float = 0.0, low: float = 0.0, high: float = 0.0) -> dict:
    return {
        "version": version,
        "reward_mean": 0.5,
        "entropy": 1.0,
        "clip_active": active,
        "clip_fraction": fraction,
        "clip_low_fraction": low,
        "clip_high_fraction": high,
    }


def test_a_clip_that_cannot_act_is_said_instead_of_a_flat_zero() -> None:
    html = Curves().render([clip_step(v, 0.0) for v in range(1, 6)], [])
    assert list(_charts(html)) == ["reward_mean", "entropy", "held-out accuracy", "clip fraction"]
    title, svg = _charts(html)["clip fraction"]
    assert title == "clip inactive (ratio 1: one update per batch)"  # the chart's tooltip
    assert _texts(svg) == ["clip fraction", "clip inactive", "(ratio 1: one update per batch)"]
    assert "<polyline" not in svg  # no flat line at 0
    # several updates per batch with a loss that has no clip: the reason says so
    html = Curves().render([clip_step(1, 0.0)], [], clip_reason="the loss 'sapo' has no clip")
    assert "(the loss &#x27;sapo&#x27; has no clip)" in _texts(_charts(html)["clip fraction"][1])


def test_a_clip_that_acts_draws_its_fraction_and_its_bounds_where_they_differ() -> None:
    steps = [clip_step(v, 1.0, fraction=0.05 * v, low=0.01 * v, high=0.04 * v) for v in range(1, 6)]
    title, svg = _charts(Curves().render(steps, []))["clip fraction"]
    assert title == "" and "clip inactive" not in svg
    assert svg.count("<polyline") == 3 and {"- - low", "- - high"} <= set(_texts(svg))
    same = [clip_step(v, 1.0, fraction=0.05 * v, low=0.02 * v, high=0.02 * v) for v in range(1, 6)]
    _, svg = _charts(Curves().render(same, []))["clip fraction"]
    assert svg.count("<polyline") == 1 and "- - low" not in _texts(svg)
    # a clip that stopped acting: the curve of the steps that had one, and since when
    title, svg = _charts(Curves().render([*steps, clip_step(6, 0.0), clip_step(7, 0.0)], []))["clip fraction"]
    assert title == "clip inactive (ratio 1: one update per batch) after step 5"
    assert "clip inactive after step 5" in _texts(svg)
    # a run recorded before clip_active: no clip chart (its 0s could mean either)
    assert "clip fraction" not in _charts(Curves().render([{"version": 1, "clip_fraction": 0.0}], []))


def test_a_critics_explained_variance_gets_a_chart_from_the_step_that_has_one() -> None:
    history = [{"version": v, "reward_mean": 0.5, "entropy": 1.0} for v in (1, 2)]
    history += [{"version": v, "reward_mean": 0.5, "entropy": 1.0, "explained_variance": 0.1 * v} for v in (3, 4, 5)]
    charts = _charts(Curves().render(history, []))
    assert list(charts) == ["reward_mean", "entropy", "held-out accuracy", "critic: explained variance"]
    svg = charts["critic: explained variance"][1]
    assert "<polyline" in svg and "critic: explained variance" in _texts(svg)
    assert "critic" not in "".join(_charts(Curves().render(history[:2], [])))  # no critic, no chart

"""The console backend's line: what it shows of a step."""

from __future__ import annotations

from rlnb.track._backends import ConsoleBackend


def test_the_console_line_shows_the_clip_fraction_only_where_a_clip_could_act() -> None:
    step = {"reward_mean": 0.5, "clip_fraction": 0.0, "clip_low_fraction": 0.0, "clip_high_fraction": 0.0}
    # one update per batch: the ratio is 1 and the fraction 0 by construction, not a measure
    assert ConsoleBackend.format({**step, "clip_active": 0.0}, 3) == "step 3 | reward_mean 0.5"
    acting = {**step, "clip_active": 1.0, "clip_fraction": 0.125}
    assert ConsoleBackend.format(acting, 3) == "step 3 | reward_mean 0.5 | clip_fraction 0.125"

"""The frame a dashboard of a session on Ray replicas closes with: after a normal
close its replicas are "closed", not "dead" (a replica that died stays "dead")."""

from __future__ import annotations

import re

import pytest

import rlnb
from tests.helpers.ray_cluster import SMALL

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.ray]


def test_after_a_normal_close_the_replicas_are_closed_not_dead() -> None:
    sess = rlnb.Session(SMALL, name="ray-closed")
    try:
        dash = sess.dashboard()
        sess.step()
    finally:
        sess.close()
    states = [r["state"] for r in sess.statistics(raise_errors=False).engine.extra["replicas"]]
    assert states == ["closed", "closed"], states
    frame = dash.static_html()
    assert re.findall(r'class="rlnb-replica" data-state="(\w+)"', frame) == ["closed", "closed"], frame

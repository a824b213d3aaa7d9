"""A short soak: sessions made and closed over and over leave nothing behind.

The same cycles as ``rlnb bench soak``, fewer of them (the bench runs 1,000 per variant).
"""

from __future__ import annotations

import json

import pytest

import rlnb
from rlnb.bench import _soak
from rlnb.cli import BENCHES, main
from tests.helpers import assert_counts_add_up

CYCLES = 30


def _counts_add_up(sess: rlnb.Session) -> None:
    assert_counts_add_up(sess.statistics().rollout)
    assert sess.version == 1 and len(sess.history) == 1


@pytest.mark.slow
@pytest.mark.parametrize("variant", _soak.VARIANTS, ids=lambda v: v.name)
def test_a_short_soak_leaves_nothing_behind(variant: _soak.Variant) -> None:
    result = _soak.soak(variant, CYCLES, warmup=3, before_close=_counts_add_up)
    print(f"{variant.name}: {result}")  # the figures, for `pytest -s`
    assert result.growth == {"fds": 0, "threads": 0, "os_threads": 0, "children": 0}, result.left_behind
    assert not result.left_behind
    assert result.rss_growth_mib <= _soak.rss_allowance_mib(CYCLES)
    assert result.cycles == CYCLES and result.cycles_per_s > 0


def test_the_allowance_grows_with_the_cycles() -> None:
    assert _soak.rss_allowance_mib(0) == _soak.RSS_BASE_MIB
    assert _soak.rss_allowance_mib(1000) == _soak.RSS_BASE_MIB + _soak.RSS_PER_1000_MIB


@pytest.mark.slow  # four variants' sessions, two of them with loader workers
def test_bench_soak_prints_one_json_object_with_its_targets(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "soak" in BENCHES
    run = _soak.run
    monkeypatch.setattr(_soak, "run", lambda: run(cycles=2, warmup=1))
    assert main(["bench", "soak", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bench"] == "soak" and result["figures"]["cycles"] == 2
    names = [v.name for v in _soak.VARIANTS]
    assert names == ["sync_w0", "sync_w1", "async_w0", "async_w1"]
    kinds = ("fds", "threads", "os_threads", "children", "rss", "fds_peak", "threads_peak", "children_peak")
    assert set(result["targets"]) == {f"{name}_{kind}_growth" for name in names for kind in kinds}
    for name in names:
        assert result["figures"][f"{name}_cycles_per_s"] > 0
        assert f"{name}_heap_growth_mib" in result["figures"]

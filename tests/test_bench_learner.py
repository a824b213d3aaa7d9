"""``rlnb bench learner`` (rlnb/bench/_learner.py): the learner on 1 and on 2 ranks in
one run. A small run here (a small policy, 2 measured steps): the figures are there and
sane, memory per rank is one process's ("ddp"), the ranks take the step one process
takes; not how fast they are (the machine's cores decide that)."""

from __future__ import annotations

import json

import pytest

import rlnb
from rlnb.bench import _learner
from rlnb.cli import BENCH_OPTIONS, BENCHES, main


def test_ranks_are_parsed_with_one_always_among_them_and_a_bad_value_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _learner.parse_ranks("1,2") == (1, 2)
    assert _learner.parse_ranks("4, 2") == (1, 2, 4)  # 1 is every figure's baseline
    assert _learner.parse_ranks([2]) == (1, 2)
    for bad in ("", "0,2", "two", "1,-1"):
        with pytest.raises(rlnb.ConfigError, match="--ranks"):
            _learner.parse_ranks(bad)
    assert "learner" in BENCHES and BENCH_OPTIONS["ranks"] == "learner"
    assert main(["bench", "learner", "--ranks", "x"]) == 2
    assert "--ranks 'x' is invalid" in capsys.readouterr().err
    assert main(["bench", "ray", "--ranks", "2"]) == 2  # another benchmark's flag
    assert "--ranks applies to 'learner' only" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.ray
def test_bench_learner_gives_each_rank_count_its_time_breakdown_and_memory() -> None:
    result = _learner.run(ranks="1,2", steps=2, d_model=32, n_layers=1, n_heads=2, group_size=2, groups_per_step=2)
    out = json.loads(result.to_json())
    assert out["bench"] == "learner"
    figures = out["figures"]
    for key in ("ranks1", "ranks2"):
        assert figures[f"{key}_steps_timed"] == 2
        for name in ("update_s", "tokens_per_s", "step_s", "per_rank_parameters_bytes", "per_rank_optimizer_bytes"):
            assert figures[f"{key}_{name}"] > 0, (key, name)
        assert figures[f"{key}_update_s"] < figures[f"{key}_step_s"]  # the update is a part of the step
    # "ddp": every rank holds what one process holds, not 1/2 of it
    assert figures["ranks2_strategy"] == "ddp"
    assert figures["ranks2_per_rank_over_one_process"] == 1.0
    for part in ("parameters", "gradients", "optimizer"):
        assert figures[f"ranks2_per_rank_{part}_bytes"] == figures[f"ranks1_per_rank_{part}_bytes"]
    assert len(figures["ranks2_rss_mib_each"]) == 2 and min(figures["ranks2_rss_mib_each"]) > 0
    assert 0 < figures["ranks2_scaling_efficiency"] < 1.5
    # the breakdown: a rank's own time is inside the driver's, the rest is Ray's and the copy's
    assert 0 < figures["ranks2_rank_s"] < figures["ranks2_update_s"]
    assert figures["ranks2_ray_call_s"] > 0 and figures["ranks2_mirror_s"] >= 0
    assert 0 < figures["ranks2_rank_cpu_s"] <= figures["ranks2_rank_s"] * 1.05
    assert 0 < figures["ranks2_all_reduce_s"] < figures["ranks2_rank_s"]
    assert figures["ranks2_start_s"] > 0 and figures["ranks2_close_s"] > 0
    targets = out["targets"]
    assert set(targets) == {"max_loss_difference", "ranks_per_rank_over_one_process"}
    assert out["ok"], targets  # both hold on any machine: the same steps, no more memory per rank
    assert "rlnb bench learner" in result.report()

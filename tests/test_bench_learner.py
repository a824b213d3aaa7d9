"""``rlnb bench learner`` (rlnb/bench/_learner.py): the learner on 1 and on 2 ranks in
one run, with each strategy. A small run here (a small policy, 2 measured steps): the
figures are there and sane, a "fsdp" rank holds about half of one process's bytes and
a "ddp" rank all of them, the ranks take the step one process takes; not how fast they
are (the machine's cores decide that)."""

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


def test_strategies_are_parsed_in_one_order_and_a_bad_value_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert _learner.parse_strategies("fsdp,ddp") == ("fsdp", "ddp")
    assert _learner.parse_strategies(" ddp, fsdp ,ddp") == ("fsdp", "ddp")
    assert _learner.parse_strategies("ddp") == ("ddp",)
    assert _learner.parse_strategies(["fsdp"]) == ("fsdp",)
    for bad in ("", ",", "zero", "fsdp,deepspeed", "FSDP"):
        with pytest.raises(rlnb.ConfigError, match="--strategy"):
            _learner.parse_strategies(bad)
    assert BENCH_OPTIONS["strategy"] == "learner"
    assert main(["bench", "learner", "--strategy", "fsdp,zero"]) == 2  # refused before any session starts
    assert "--strategy 'fsdp,zero' is invalid" in capsys.readouterr().err
    assert main(["bench", "ray", "--strategy", "ddp"]) == 2  # another benchmark's flag
    assert "--strategy applies to 'learner' only" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.ray
def test_bench_learner_gives_each_rank_count_and_strategy_its_time_breakdown_and_memory() -> None:
    result = _learner.run(ranks="1,2", steps=2, d_model=32, n_layers=1, n_heads=2, group_size=2, groups_per_step=2)
    out = json.loads(result.to_json())
    assert out["bench"] == "learner"
    figures = out["figures"]
    assert figures["ranks1_steps_timed"] == 4  # stepped beside each of the 2-rank sessions
    for key in ("ranks1", "ranks2", "ranks2_ddp"):
        assert figures[f"{key}_steps_timed"] >= 2
        for name in ("update_s", "tokens_per_s", "step_s", "per_rank_parameters_bytes", "per_rank_optimizer_bytes"):
            assert figures[f"{key}_{name}"] > 0, (key, name)
        assert figures[f"{key}_update_s"] < figures[f"{key}_step_s"]  # the update is a part of the step
    # "fsdp" (the default, ranks2_*): each rank keeps about half; "ddp": all of one process's
    assert figures["ranks2_strategy"] == "fsdp" and figures["ranks2_ddp_strategy"] == "ddp"
    assert 0.45 <= figures["ranks2_per_rank_over_one_process"] <= 0.55
    assert figures["ranks2_ddp_per_rank_over_one_process"] == 1.0
    for part in ("parameters", "gradients", "optimizer"):
        whole = figures[f"ranks1_per_rank_{part}_bytes"]
        assert figures[f"ranks2_ddp_per_rank_{part}_bytes"] == whole
        assert whole / 2 <= figures[f"ranks2_per_rank_{part}_bytes"] <= whole * 0.55, part
    for key in ("ranks2", "ranks2_ddp"):
        assert len(figures[f"{key}_rss_mib_each"]) == 2 and min(figures[f"{key}_rss_mib_each"]) > 0
        assert 0 < figures[f"{key}_scaling_efficiency"] < 1.5
        # the breakdown: a rank's own time is inside the driver's, the rest is Ray's and the copy's
        assert 0 < figures[f"{key}_rank_s"] < figures[f"{key}_update_s"]
        assert figures[f"{key}_ray_call_s"] > 0 and figures[f"{key}_mirror_s"] >= 0
        assert 0 < figures[f"{key}_rank_cpu_s"] <= figures[f"{key}_rank_s"] * 1.05
        assert figures[f"{key}_start_s"] > 0 and figures[f"{key}_close_s"] > 0
        assert figures[f"{key}_max_loss_difference"] <= 1e-3
    # each strategy's collectives: DDP's one all-reduce, FSDP2's gathers and reduce-scatters
    # (one block: the root's and the block's weights, the block's again, both units' gradients)
    assert 0 < figures["ranks2_ddp_all_reduce_s"] < figures["ranks2_ddp_rank_s"]
    assert 0 < figures["ranks2_gather_scatter_s"] < figures["ranks2_update_s"]
    assert figures["ranks2_gather_scatter_messages"] == 5
    assert "ranks2_all_reduce_s" not in figures and "ranks2_ddp_gather_scatter_s" not in figures
    targets = out["targets"]
    assert set(targets) == {"max_loss_difference", "fsdp_per_rank_over_share", "ddp_per_rank_over_one_process"}
    assert out["ok"], targets  # all hold on any machine: the same steps, each strategy's memory per rank
    assert "rlnb bench learner" in result.report()

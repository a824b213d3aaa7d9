from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlnb.bench import _bridge, _close
from rlnb.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rlnb", *args], capture_output=True, text=True, timeout=120)


def test_demo_rolls_out_pauses_resumes_and_leaves_nothing_behind() -> None:
    proc = run_cli("demo", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["task"] == "addition" and result["groups_finished"] >= 4
    assert result["samples_dispatched"] == result["samples_accounted"]
    assert result["engine_running_at_pause"] == 0
    assert result["left_behind"] == {}
    assert "RolloutBatch(2 groups)" in proc.stdout
    assert "left behind after close: nothing" in proc.stdout


def test_bench_close_prints_one_json_object_with_its_targets() -> None:
    proc = run_cli("bench", "close", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["bench"] == "close"
    assert set(result["targets"]) == {"feeder_close_p99", "session_close_median", "close_all_3_median"}
    assert result["figures"]["feeder_poll_interval_s"] == 5.0


def test_bench_bridge_measures_all_methods_in_one_run() -> None:
    result = _bridge.run(rounds=1, calls=50, slow_calls=5)
    for method in ("handoff", "bridge", "loop_per_call", "asyncio_run", "shared"):
        assert result.figures[f"{method}_median_us"] > 0
    assert result.figures["fd_growth_1000_calls"] == 0
    assert {t.name for t in result.targets} == {
        "bridge_over_handoff",
        "loop_per_call_over_bridge",
        "fd_growth_1000_calls",
    }
    assert "rlnb bench bridge" in result.report()


def test_bench_close_runs_with_few_repeats() -> None:
    result = _close.run(repeats=5, poll_interval=5.0)
    assert result.figures["feeder_close_p99_ms"] < 5000  # it did not wait out the poll interval


def test_unknown_commands_are_rejected_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "nope"])
    assert info.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_bench_rollout_measures_resume_pause_and_batching_in_one_run() -> None:
    from rlnb.bench import _rollout

    result = _rollout.run(trials=5, pause_trials=3, requests=32)
    assert result.figures["in_flight_at_resume_min"] >= 64
    assert result.figures["drain_all_ms"] > result.figures["resume_to_dispatch_p99_ms"]
    assert result.figures["continuous_tokens_per_s"] > 0 and result.figures["static_tokens_per_s"] > 0
    assert {t.name for t in result.targets} == {"resume_to_dispatch_p99", "pause_abort_p99", "continuous_over_static"}

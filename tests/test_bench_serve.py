"""``rlnb bench serve`` (rlnb/bench/_serve.py): the endpoint against the same engine in
process, in one run.

The command runs small (``--quick``) in this process: the report's shape, and that its
figures are sane; not the targets, which depend on the machine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rlnb.bench import _serve
from rlnb.cli import BENCHES, main


@pytest.mark.netns  # it listens on loopback
def test_bench_serve_quick_reports_tokens_and_latency_of_both_ways_in_at_each_concurrency(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "serve", "--quick", "--tokens", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # stdout is that one line

    assert out["bench"] == "serve"
    figures = out["figures"]
    assert "requests of 24 new tokens" in figures["workload"]
    for n in (1, 8):
        for variant in ("in_process", "endpoint"):
            for key in ("tokens_per_s", "p50_ms", "p99_ms"):
                value = figures[f"c{n}_{variant}_{key}"]
                assert math.isfinite(value) and value > 0, (n, variant, key, value)
            assert figures[f"c{n}_{variant}_p50_ms"] <= figures[f"c{n}_{variant}_p99_ms"]
            for role in ("clients", "loop", "engine"):  # CPU ms per short request, by thread
                value = figures[f"c{n}_{variant}_cpu_ms_{role}"]
                assert math.isfinite(value) and value >= 0, (n, variant, role, value)
        assert figures[f"c{n}_endpoint_cpu_ms_clients"] > 0  # the openai client ran on its own thread
        assert figures[f"c{n}_latency_samples"] == n * 3 * 3  # n clients x 3 requests x 3 rounds
        ratio = figures[f"c{n}_endpoint_over_in_process_tokens"]
        assert math.isfinite(ratio) and ratio > 0
    assert "c32_endpoint_tokens_per_s" not in figures  # --quick: 1 and 8 clients
    targets = out["targets"]
    assert set(targets) == {"endpoint_over_in_process_tokens_c1", "endpoint_over_in_process_tokens_c8"}
    assert all(t["op"] == ">=" and t["limit"] == 0.8 for t in targets.values())


def test_bench_serve_alternates_which_variant_goes_first() -> None:
    assert list(_serve._orders(3)) == [
        ("in_process", "endpoint"),
        ("endpoint", "in_process"),
        ("in_process", "endpoint"),
    ]


def test_quick_and_model_are_for_bench_serve_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert "serve" in BENCHES
    assert main(["bench", "bridge", "--quick"]) == 2
    assert "--quick applies to 'serve' only" in capsys.readouterr().err
    assert main(["bench", "close", "--model", "/nowhere"]) == 2
    assert "--model applies to 'serve' only" in capsys.readouterr().err
    assert main(["bench", "lora", "--tokens", "256"]) == 2
    assert "--tokens applies to 'serve' only" in capsys.readouterr().err


def test_bench_serve_refuses_a_model_that_is_not_a_directory_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "serve", "--model", str(tmp_path / "nope")]) == 2  # before anything listens
    err = capsys.readouterr().err
    assert err.startswith("rlnb bench serve: error: ModelConfig.path=") and len(err.splitlines()) == 1

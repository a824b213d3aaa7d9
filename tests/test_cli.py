"""``rlnb``: whole runs through ``python -m rlnb`` (the ``run_cli`` fixture); what is
refused before anything starts, through ``rlnb.cli.main`` in this process."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rlnb.bench import _bridge, _close, _train
from rlnb.cli import main

RunCli = Callable[..., subprocess.CompletedProcess[str]]


def in_process(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[Any, str, str]:
    """``rlnb ARGV`` through ``rlnb.cli.main`` in this process: its exit status, stdout and stderr."""
    try:
        status: Any = main(list(argv))
    except SystemExit as exc:  # argparse's errors
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


def test_train_writes_its_run_dir_and_ends_with_one_json_line(tmp_path: Path, run_cli: RunCli) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train", "--task", "sort", "--steps", "3", "--run-dir", str(run_dir), "--warmup-steps", "2",
        "--eval-every", "2", "--eval-prompts", "20", "--num-workers", "1", "--no-progress", "--json",
        "--lr", "2e-4", "--lr-decay-steps", "2", "--algorithm", "dapo",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # stdout is that one line
    assert result["task"] == "sort" and result["steps"] == 3 and result["warmup_steps"] == 2
    assert result["algorithm"] == "dapo" and "[rl] dapo (rlnb.algorithms), up to 3 steps" in proc.stderr
    for key in ("eval_accuracy_init", "eval_accuracy_start", "eval_accuracy_end"):
        assert 0.0 <= result[key] <= 1.0
    assert result["seconds"] >= result["warmup_seconds"] + result["rl_seconds"]
    assert result["generated_tokens_per_s"] > 0 and result["peak_rss_mib"] > 0
    assert "[warm-up] supervised, 2 steps" in proc.stderr  # the warm-up is a stage of its own (stderr: --json)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["event"] == "start" and records[-1] == {**records[-1], "event": "finish", "exit_code": 0}
    assert [r["warmup/steps"] for r in records if "warmup/steps" in r] == [2]
    assert [r["step"] for r in records if "reward_mean" in r] == [1, 2, 3]
    assert [r["lr"] for r in records if "reward_mean" in r] == pytest.approx([2e-4, 1e-4, 0.0])  # linear decay
    evals = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    assert [step for step, _ in evals] == [0, 0, 2, 3]  # initial, after the warm-up, steps 2 and 3
    assert evals[-1][1] == result["eval_accuracy_end"]
    assert {"reward_mean", "entropy", "clip_fraction", "grad_norm", "staleness"} <= set(records[-3])
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_rejects_bad_input_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    status, _, err = in_process(capsys, "train", "--task", "nope", "--steps", "3", "--run-dir", str(tmp_path / "run"))
    assert status == 2
    assert "Config.task='nope' is unknown: use one of" in err
    assert not (tmp_path / "run").exists()
    status, _, err = in_process(
        capsys, "train", "--steps", "3", "--run-dir", str(tmp_path / "run"), "--algorithm", "ppo2"
    )
    assert status == 2 and "argument --algorithm: invalid choice: 'ppo2' (choose from 'grpo', 'dr_grpo'" in err
    status, _, err = in_process(capsys, "train", "--steps", "3", "--run-dir", str(tmp_path / "run"), "--lr", "-1")
    assert status == 2 and "LearnConfig.lr=-1.0 is invalid" in err
    status, _, err = in_process(
        capsys, "train", "--steps", "3", "--run-dir", str(tmp_path / "run"), "--lr-decay-steps", "0"
    )
    assert status == 2 and "LearnConfig.lr_decay_steps=0 is invalid" in err
    status, _, err = in_process(
        capsys, "train", "--steps", "3", "--run-dir", str(tmp_path / "run"), "--tracker", "console,tensorboard"
    )
    assert status == 2 and "TrackConfig.backends=('console', 'tensorboard') is invalid" in err
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    status, _, err = in_process(
        capsys, "train", "--steps", "3", "--run-dir", str(tmp_path / "run"), "--tracker", "wandb"
    )
    assert status == 2 and "'online' needs a wandb API key" in err
    assert not (tmp_path / "run").exists()  # nothing started


@pytest.mark.slow
def test_the_demo_learns_and_rl_does_most_of_it(tmp_path: Path, run_cli: RunCli) -> None:
    proc = run_cli("demo", "--json", "--no-progress", "--run-dir", str(tmp_path / "demo"), timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["task"] == "reverse" and result["warmup_task"] == "sloppy_reverse"
    assert result["steps"] == 150 and result["warmup_steps"] == 120
    assert result["eval_accuracy_init"] <= 0.1  # an untrained policy
    assert 0.2 <= result["eval_accuracy_start"] <= 0.7  # the warm-up taught the format and the teacher's slip
    # RL unlearns the slip (seed 0 measured +0.40; the bar of the demo is +0.25, median of seeds 0-2)
    assert result["rl_gain"] == pytest.approx(result["eval_accuracy_end"] - result["eval_accuracy_start"])
    assert result["rl_gain"] >= 0.2
    assert result["reward_last"] >= result["reward_first"] + 0.1
    assert 0 < result["eval_seconds"] < result["rl_seconds"]
    assert "[done] learning came from: warm-up +" in proc.stderr and "RL +" in proc.stderr
    assert (tmp_path / "demo" / "curves.png").is_file() and (tmp_path / "demo" / "metrics.jsonl").is_file()


def test_train_on_another_task_imitates_that_tasks_own_answers(tmp_path: Path, run_cli: RunCli) -> None:
    """The demo's sloppy teacher writes reversals only: --task addition warms up on
    addition's answers, unless --warmup-task says otherwise."""
    proc = run_cli(
        "train", "--task", "addition", "--steps", "1", "--warmup-steps", "1", "--eval-prompts", "4",
        "--num-workers", "0", "--run-dir", str(tmp_path / "run"), "--no-progress", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["warmup_task"] is None
    assert "[warm-up] supervised, 1 steps of 128 correct answers" in proc.stderr
    proc = run_cli(
        "train", "--steps", "1", "--warmup-steps", "1", "--warmup-task", "none", "--eval-prompts", "4",
        "--num-workers", "0", "--run-dir", str(tmp_path / "run2"), "--no-progress", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["task"] == "reverse" and result["warmup_task"] is None


@pytest.mark.slow  # ~10 s: the engine process imports torch
def test_bench_train_measures_every_mode_in_one_run() -> None:
    result = _train.run(steps=2, longtail_steps=2, max_new_tokens=8, rounds=1, ray=False)  # Ray: its own pass
    figures = result.figures
    assert figures["steps_per_s"] > 0 and figures["generated_tokens_per_s"] > 0
    for mode in ("sync", "async", "async_process"):
        assert figures[f"{mode}_s_per_step"] > 0 and figures[f"{mode}_generated_tokens_per_s"] > 0
        assert 0 <= figures[f"{mode}_learner_idle"] < 1
    assert figures["ray"] == "not run" and "async_ray1_s_per_step" not in figures
    assert [t.name for t in result.targets] == ["async_over_sync_speedup", "async_process_over_sync"]
    assert "rlnb bench train" in result.report()


def test_bench_close_prints_one_json_object_with_its_targets(run_cli: RunCli) -> None:
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


@pytest.mark.slow  # ~10 s
def test_bench_rollout_measures_resume_pause_and_batching_in_one_run() -> None:
    from rlnb.bench import _rollout

    result = _rollout.run(trials=5, pause_trials=3, requests=32)
    assert result.figures["in_flight_at_resume_min"] >= 64
    assert result.figures["drain_all_ms"] > result.figures["resume_to_dispatch_p99_ms"]
    assert result.figures["continuous_tokens_per_s"] > 0 and result.figures["static_tokens_per_s"] > 0
    assert {t.name for t in result.targets} == {"resume_to_dispatch_p99", "pause_abort_p99", "continuous_over_static"}


@pytest.mark.usefixtures("wandb_offline")
def test_bench_close_times_a_session_with_an_offline_wandb_run(capsys: pytest.CaptureFixture[str]) -> None:
    result = _close.run(repeats=3, tracker="wandb")
    assert 0 < result.figures["wandb_session_close_median_ms"] <= result.figures["wandb_session_close_max_ms"]
    assert "wandb_session_close_max" in {t.name for t in result.targets}
    assert in_process(capsys, "bench", "train", "--tracker", "wandb")[0] == 2  # close only


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlnb.data import reverse
    from rlnb.models import tiny_llama

    # the characters of the demo's task, which train uses by default (as make-tiny-llama does)
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model", seed=1, alphabet=reverse.alphabet)


def test_train_a_hugging_face_model_from_its_directory(tmp_path: Path, tiny_llama_dir: Path, run_cli: RunCli) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train", "--model", str(tiny_llama_dir), "--steps", "2", "--run-dir", str(run_dir), "--warmup-steps", "2",
        "--eval-prompts", "20", "--num-workers", "0", "--no-progress", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"Hugging Face model {str(tiny_llama_dir)!r} (float32, learner on cpu) on the 'hf' engine" in proc.stderr
    assert "[warm-up] supervised, 2 steps" in proc.stderr and "[rl] 2 steps in" in proc.stderr
    result = json.loads(proc.stdout)
    assert result["model"] == str(tiny_llama_dir) and result["engine"] == "hf"
    assert result["steps"] == 2 and result["warmup_steps"] == 2 and result["generated_tokens_per_s"] > 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward_mean" in r] == [1, 2]
    assert records[-1] == {**records[-1], "event": "finish", "exit_code": 0}


def test_model_flags_the_config_refuses_fail_before_starting(
    tmp_path: Path, tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = str(tmp_path / "run")
    refused = {
        ("--model", str(tiny_llama_dir), "--engine", "tiny"): (
            f"--engine tiny: EngineConfig.kind='tiny' is invalid: the 'tiny' engine serves the built-in policy, "
            f"and ModelConfig.path={str(tiny_llama_dir)!r} is a Hugging Face model"
        ),
        ("--engine", "hf"): "--engine hf: EngineConfig.kind='hf' is invalid",
        ("--model", "/nonexistent"): "ModelConfig.path='/nonexistent' is invalid: no such directory",
        ("--model", str(tiny_llama_dir), "--task", "addition"): (
            f"ModelConfig.path={str(tiny_llama_dir)!r} is invalid for task 'addition': its tokenizer cannot write "
            "'0123456789+'"
        ),
        ("--dtype", "bfloat16"): "--dtype bfloat16 applies to a --model only",
        ("--dtype", "float16"): "argument --dtype: invalid choice: 'float16' (choose from 'float32', 'bfloat16')",
        ("--device", "cuda"): "--device cuda applies to a --model only",
        ("--model", str(tiny_llama_dir), "--device", "gpu"): "--device gpu: ModelConfig.device='gpu' is invalid",
        # this machine has no GPU: refused before the model is loaded or a run dir made
        ("--model", str(tiny_llama_dir), "--device", "cuda"): (
            "ModelConfig.device='cuda' is invalid: torch sees no CUDA device here"
        ),
        ("--engine", "sglang"): "argument --engine: invalid choice: 'sglang' (choose from 'tiny', 'hf', 'vllm')",
    }
    for flags, message in refused.items():
        status, out, err = in_process(capsys, "train", "--steps", "2", "--run-dir", run_dir, *flags)
        assert (status, out) == (2, ""), flags
        assert err.startswith(f"rlnb train: error: {message}") and err.count("\n") == 1, err
    status, _, err = in_process(
        capsys, "demo", "--run-dir", run_dir, "--model", str(tiny_llama_dir), "--engine", "tiny"
    )
    assert status == 2 and err.startswith("rlnb demo: error: --engine tiny: EngineConfig.kind=")
    assert not (tmp_path / "run").exists()  # nothing started


def test_make_tiny_llama_writes_a_model_that_train_accepts(
    tmp_path: Path, tiny_llama_dir: Path, run_cli: RunCli
) -> None:
    model = tmp_path / "tl"
    proc = run_cli("make-tiny-llama", str(model), "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{model}\n"
    # the seed reaches tiny_llama(): the same weights as the fixture's, built with seed=1
    assert (model / "model.safetensors").read_bytes() == (tiny_llama_dir / "model.safetensors").read_bytes()
    proc = run_cli(
        "train", "--model", str(model), "--dtype", "bfloat16", "--steps", "1", "--warmup-steps", "0",
        "--eval-prompts", "10", "--num-workers", "0", "--run-dir", str(tmp_path / "run"), "--no-progress", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"Hugging Face model {str(model)!r} (bfloat16, learner on cpu) on the 'hf' engine" in proc.stderr
    result = json.loads(proc.stdout)
    assert (result["model"], result["engine"], result["steps"]) == (str(model), "hf", 1)
    again = run_cli("make-tiny-llama", str(model))  # it would overwrite the model
    assert again.returncode == 2
    assert again.stderr.startswith(f"rlnb make-tiny-llama: error: {str(model)!r} is not an empty directory")


# Prompts made in the CLI's own process: a loader worker's forkserver imports torch again
# (~2 CPU-seconds a run); the run with a worker is test_train_writes_its_run_dir_....
SHORT_RUN = ("train", "--task", "sort", "--steps", "3", "--warmup-steps", "2", "--eval-every", "2",
             "--eval-prompts", "20", "--num-workers", "0")  # fmt: skip


def test_json_keeps_stdout_to_one_line_and_a_log_gets_plain_progress_lines(tmp_path: Path, run_cli: RunCli) -> None:
    log = tmp_path / "stderr.log"
    with log.open("w") as stderr:  # a file, as in a CI log: no terminal
        proc = run_cli(*SHORT_RUN, "--run-dir", str(tmp_path / "run"), "--json", stderr=stderr)
    shown = log.read_text()
    assert proc.returncode == 0, shown
    assert len(proc.stdout.splitlines()) == 1 and json.loads(proc.stdout)["steps"] == 3
    assert "\r" not in shown
    progress = [line for line in shown.splitlines() if re.match(r"rlnb (run warm-up|rl): ", line)]
    assert [line.split(" in ")[0] for line in progress] == [
        "rlnb run warm-up: 2/2 steps (100%)",
        "rlnb rl: 3/3 steps (100%)",
    ]  # a short run: the last line of each bar only
    assert re.search(r", [\d.]+ steps/s, reward [\d.]+, eval_acc [\d.]+$", progress[1]), progress[1]
    # the stage lines and the console tracker's, all on stderr
    assert "[rl] 3 steps in" in shown and "step 3 | eval_accuracy" in shown and len(shown.splitlines()) < 20


def test_quiet_prints_only_the_results_line(tmp_path: Path, run_cli: RunCli) -> None:
    proc = run_cli(*SHORT_RUN, "--run-dir", str(tmp_path / "run"), "--json", "--quiet")
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    assert len(proc.stdout.splitlines()) == 1 and json.loads(proc.stdout)["steps"] == 3
    assert (tmp_path / "run" / "metrics.jsonl").is_file()  # it still writes its run dir
    proc = run_cli(*SHORT_RUN, "--run-dir", str(tmp_path / "run"), "--quiet")
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    assert re.fullmatch(
        rf"rlnb train: 3 RL steps after 2 warm-up steps in [\d.]+ s; held-out accuracy "
        rf"[\d.]+ -> [\d.]+ -> [\d.]+; run dir {re.escape(str(tmp_path / 'run'))}\n",
        proc.stdout,
    ), proc.stdout


def _sums(path: Path, n: int = 60) -> Path:
    path.write_text(
        "".join(json.dumps({"question": f"{a}+{a % 7}=", "result": str(a + a % 7)}) + "\n" for a in range(n))
    )
    return path


def test_train_on_a_data_file_with_two_rewards_records_each(tmp_path: Path, run_cli: RunCli) -> None:
    proc = run_cli(
        "train", "--data", str(_sums(tmp_path / "sums.jsonl")), "--prompt-field", "question", "--answer-field",
        "result", "--reward", r"exact_match,regex_format:\d{1,3}", "--reward-weights", "1,0.2", "--eval-size", "0.2",
        "--steps", "2", "--warmup-steps", "1", "--eval-prompts", "4", "--num-workers", "0",
        "--run-dir", str(tmp_path / "run"), "--no-progress", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["task"] == "data:sums"
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [s for s in steps if "reward_mean" in s][-1]
    assert {"reward/exact_match", "reward/regex_format", "reward/regex_format/std"} <= set(last)
    assert last["reward_mean"] == pytest.approx(last["reward/exact_match"] + 0.2 * last["reward/regex_format"])


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--task", "sort"], ["--data", "--task sort", "give one"]),
        (["--prompt-field", "q"], ["--prompt-field", "record 0 has no field 'q'"]),
        (["--reward", "exact_match,nope"], ["--reward 'nope' is unknown", "regex_format:PATTERN"]),
        (["--reward", "length_penalty:x"], ["--reward length_penalty:x", "whole number"]),
        (["--reward", r"regex_format:\d{1,3},math_answer,nope"], ["--reward 'nope' is unknown"]),
        (["--reward-weights", "1,2"], ["--reward-weights", "one number per reward function (1)"]),
        (["--eval-size", "60"], ["--eval-size", "60 of the 60 records"]),
        (["--eval-size", "0"], ["--eval-size 0", "e.g. --eval-size 0.1"]),
        (["--eval-size", "1.5"], ["--eval-size"]),
    ],
)
def test_bad_data_flags_are_one_line_naming_the_flag(
    args: list[str], words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _sums(tmp_path / "sums.jsonl")
    flags = ["--prompt-field", "question", "--answer-field", "result", "--eval-size", "0.2", "--steps", "1"]
    code = main(["train", "--data", str(data), *flags, "--run-dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--lora-r", "8"], ["--lora-r 8", "LoRA adapts a Hugging Face model (ModelConfig.path)"]),
        (["--lora-r", "0", "--model", "DIR"], ["--lora-r 0", "LoraConfig.r=0 is invalid"]),
    ],
)
def test_a_bad_lora_flag_is_one_line_naming_it(
    args: list[str], words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [str(tmp_path) if a == "DIR" else a for a in args]
    assert main(["train", "--steps", "1", "--run-dir", str(tmp_path / "run"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(word in err for word in words), err
    assert not (tmp_path / "run").exists()

"""The shipped notebooks run top to bottom in a real kernel, and re-running cells is safe."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import nbformat

pytestmark = [pytest.mark.slow]

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
Execute = Callable[..., "nbformat.NotebookNode"]  # the execute_notebook fixture


def text_of(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def run_notebook(
    execute: Execute,
    name: str,
    *,
    rerun_first: bool = False,
    timeout: float = 120,
    interrupt: str | None = None,
    restart_before: str | None = None,
) -> tuple[list[str], list[nbformat.NotebookNode]]:
    """Run ``notebooks/<name>.ipynb`` with ``execute`` (the ``execute_notebook`` fixture),
    optionally re-running its first code cell, as a user would (``interrupt`` and
    ``restart_before`` as for tests/helpers/notebooks.py's ``execute``); check that
    no cell wrote to stderr or raised, but for the interrupted one; return each code
    cell's text, and the code cells."""
    import nbformat  # here: importing it (jsonschema's format checkers) costs every collection seconds

    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    if rerun_first:
        first = next(c for c in nb.cells if c.cell_type == "code")
        nb.cells.insert(nb.cells.index(first) + 1, nbformat.v4.new_code_cell(first.source))
    done = execute(nb, timeout=timeout, interrupt=interrupt, restart_before=restart_before)
    cells = [c for c in done.cells if c.cell_type == "code"]
    for cell in cells:
        for out in cell.get("outputs", []):
            if cell.source != interrupt:
                assert out["output_type"] != "error", f"{name}: {cell.source!r} raised {out.get('ename')}"
            assert out.get("name") != "stderr", f"{name}: {cell.source!r} wrote to stderr: {out.get('text')}"
    return [text_of(c) for c in cells], cells


def interrupted(cell: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The one error output of a cell stopped with the interrupt button."""
    errors = [out for out in cell.get("outputs", []) if out["output_type"] == "error"]
    assert len(errors) == 1, f"{cell.source!r} was not interrupted: {cell.get('outputs')}"
    return errors[0]


def number_after(text: str, label: str) -> float:
    return float(re.search(rf"{re.escape(label)}\s*([-+0-9.e]+)", text)[1])  # type: ignore[index]


LEARNING = re.compile(
    r"learning came from: warm-up ([-+]\d\.\d+) \((\d\.\d+) -> (\d\.\d+)\), RL ([-+]\d\.\d+) \((\d\.\d+) -> (\d\.\d+)\)"
)  # the line `rlnb demo` ends with


def test_01_quickstart_learns_by_rl_in_the_background_and_leaves_nothing(execute_notebook: Execute) -> None:
    out, cells = run_notebook(execute_notebook, "01-quickstart", rerun_first=True)
    assert "closed the earlier session 'quickstart'" in out[1]
    assert "RolloutBatch(2 groups)" in out[2] and "length" in out[2]  # the marks the text explains
    before, warm = number_after(out[3], "accuracy before:"), number_after(out[3], "after the warm-up:")
    assert warm > before
    assert "'version': 1" in out[4]
    dashboard = next(c for c in cells if c.source == "sess.dashboard()")
    static = dashboard.outputs[0]["data"]["text/html"]  # the widget became its static copy on close
    assert "quickstart" in static and "exit code 0" in static and "data:image/svg+xml;base64" in static
    assert re.search(r"training\s+(running|in the background)", out[7]), out[7]  # the cell ran while it trained
    assert "accuracy after 151 RL steps" in out[8], out[8]
    found = LEARNING.search(out[8])
    assert found, out[8]
    warmup_gain, start, warmed, rl_gain, rl_start, end = (float(x) for x in found.groups())
    assert math.isclose(warmed - start, warmup_gain, abs_tol=1e-6) and warmed == rl_start, found[0]
    assert math.isclose(end - rl_start, rl_gain, abs_tol=1e-6), found[0]
    assert rl_gain >= 0.15, found[0]  # RL does the learning, as in `rlnb demo`
    assert "closed (tracker exit code 0)" in out[-1] and "live sessions: []" in out[-1]


def test_02_pause_and_resume_keeps_partial_rollouts_with_their_versions(execute_notebook: Execute) -> None:
    out, cells = run_notebook(execute_notebook, "02-pause-and-resume")
    assert number_after(out[2], "paused:") > 0  # samples kept as partial rollouts
    assert "policy version 1 | engine version 1" in out[3]
    assert "groups hold continued samples" in out[4]
    assert int(out[4].split(" of ")[0]) > 0
    assert re.search(r"0-1\s+resumed x1", out[4]), out[4]  # a prefix from version 0, the rest from 1
    explorer = next(o for o in cells[5].outputs if "text/html" in o.get("data", {}))["data"]["text/html"]
    assert "colour: policy version" in explorer and "resumed" in explorer, explorer[:500]
    assert "paused, engine paused in 'keep' mode" in out[6]
    assert "closed (tracker exit code 0)" in out[-1]


def test_03_grpo_by_hand_matches_the_step_and_ctrl_c_is_one_line(execute_notebook: Execute) -> None:
    stop = "history = sess.train(until=2000)"
    out, cells = run_notebook(execute_notebook, "03-step-through-grpo", interrupt=stop)
    lines = dict(line.split(":", 1) for line in out[1].splitlines())
    assert lines["by hand"].split() == lines["rlnb"].split()
    found = re.search(r"gradient norm by hand (\d+\.\d+), step\(\) says (\d+\.\d+)", out[3])
    assert found, out[3]
    by_hand, reported = float(found[1]), float(found[2])
    assert reported > 0.1 and math.isclose(by_hand, reported, rel_tol=1e-5), found[0]  # the notebook's own check
    assert "0.50" in out[4]  # the swapped reward's partial credit
    error = interrupted(cells[5])
    assert error["ename"] == "TrainingInterrupted" and len(error["traceback"]) == 1, error  # one line
    assert "call train(until=2000) again to go on" in error["traceback"][0], error
    found = re.search(r"(\d+) steps in the history, the last at version (\d+)", out[6])
    then = re.search(r"3 more steps: the last at version (\d+)", out[6])
    assert found and then, out[6]
    (steps, version), after = (int(x) for x in found.groups()), int(then[1])
    assert 1 < steps == version < 2000 and after == version + 3, found[0]  # nothing lost, and train() goes on


def test_04_your_own_task_learns(execute_notebook: Execute) -> None:
    out, _ = run_notebook(execute_notebook, "04-your-own-task")
    said = [line for cell in out for line in cell.splitlines() if line.startswith("rlnb: task 'times7'")]
    assert said == [
        "rlnb: task 'times7' makes its prompts in this process, not in loader workers: its make_prompt is "
        "defined in this notebook, which a worker cannot import (define them in a .py module to use workers)"
    ]
    found = re.search(r"accuracy: (\d\.\d+) at first, (\d\.\d+) after the warm-up, (\d\.\d+) after RL", out[2])
    assert found, out[2]
    start, warm, end = (float(x) for x in found.groups())
    assert start < warm < end, found[0]  # the warm-up helps, and RL adds to it


def test_05_a_checkpoint_continues_exactly_after_a_kernel_restart(tmp_path: Path, execute_notebook: Execute) -> None:
    import nbformat

    nb = nbformat.read(NOTEBOOKS / "05-checkpoints-and-restarts.ipynb", as_version=4)
    heading = next(i for i, c in enumerate(nb.cells) if c.source.startswith("## Restart the kernel here"))
    after_restart = next(c for c in nb.cells[heading:] if c.cell_type == "code").source
    out, _ = run_notebook(execute_notebook, "05-checkpoints-and-restarts", restart_before=after_restart)
    assert "'checkpoint.json'" in out[0] and "'model.safetensors'" in out[0]
    assert "loaded at step 5" in out[2]
    # Engine batching may round the behaviour log-probs' last bits differently: 1e-6 was once 1.9e-6.
    assert re.search(r"largest relative difference \S+; the same three steps \(to 1e-5\): True", out[3]), out[3]
    assert (tmp_path / "runs" / "05" / "checkpoint" / "checkpoint.json").is_file()
    assert (tmp_path / "runs" / "05" / "continued.json").is_file()


def test_06_your_own_model_learns_and_transformers_writes_what_it_writes(
    tmp_path: Path, execute_notebook: Execute
) -> None:
    out, _ = run_notebook(execute_notebook, "06-your-own-model", rerun_first=True)
    assert out[0] == "LlamaForCausalLM: 331,648 parameters on cpu\n", out[0]
    assert "closed the earlier session 'own-model'" in out[1]
    found = re.search(r"accuracy: (\d\.\d+) at first, (\d\.\d+) after the warm-up, (\d\.\d+) after RL", out[2])
    assert found, out[2]
    start, warm, end = (float(x) for x in found.groups())
    assert start < warm < end, found[0]  # the warm-up helps, and RL adds to it
    assert "transformers writes the same: True" in out[4], out[4]
    assert (tmp_path / "runs" / "models" / "reverse-trained" / "model.safetensors").is_file()


def test_08_your_records_and_two_rewards_train_a_lora_adapter_that_peft_loads(
    tmp_path: Path, execute_notebook: Execute
) -> None:
    # ~75 s on an idle 2-core machine: a full fine-tune for the base, then LoRA
    out, cells = run_notebook(execute_notebook, "08-your-data-your-rewards-lora", timeout=300)
    assert '"question": ' in out[0] and '"answer": ' in out[0], out[0]
    lora = re.search(r"LoRA r=16 on all-linear, ([\d,]+) trainable of ([\d,]+) parameters", out[3])
    assert lora, out[3]
    dashboard = next(c for c in cells if c.source == "sess.dashboard()")
    assert lora[0] in dashboard.outputs[0]["data"]["text/html"]  # the dashboard's model row says the same
    before = number_after(out[5], "accuracy of the base model:")
    warm = number_after(out[5], "accuracy after the warm-up:")
    found = re.search(r"accuracy after 120 RL steps: (\d\.\d+)", out[5])
    assert found, out[5]
    after = float(found[1])
    # Measured with the LoRA session's seed 0, 1, 2: 0.42 -> 0.73/0.76/0.72 -> 0.85/0.81/0.83.
    assert warm >= before + 0.15 and after >= warm + 0.04, (before, warm, after)
    for name in ("exact_match", "format"):  # a curve per reward function
        assert re.search(rf"reward/{name}: \d\.\d+ over the first 20 steps, \d\.\d+ over the last 20", out[8]), out[8]
    assert any("image/png" in o.get("data", {}) for o in cells[8].outputs)
    assert "transformers + peft generate the same: True" in out[6], out[6]
    assert (tmp_path / "runs" / "08" / "adapter" / "adapter_model.safetensors").is_file()
    assert "closed (tracker exit code 0)" in out[7], out[7]


def test_09_settings_change_mid_run_forks_part_ways_and_what_if_leaves_the_run_alone(
    tmp_path: Path, execute_notebook: Execute
) -> None:
    # ~60 s on an idle 2-core machine: a warm-up, 60 background steps, two forks of 40
    out, cells = run_notebook(execute_notebook, "09-experiment-live", timeout=240)
    assert number_after(out[0], "accuracy after the warm-up:") > 0.3
    dashboard = cells[1].outputs[0]["data"]["text/html"]  # the static copy that replaced it at close
    assert "rlnb-dashboard rlnb-static" in dashboard
    assert "Change(step=" in out[2] and "field='lr', old=0.0001, new=0.0004" in out[2], out[2]
    found = re.search(r"changed at step (\d+): lr 0.0001 -> 0.0004", out[3])
    assert found and int(found[1]) >= 20, out[3]
    lrs = re.search(r"lr of steps \d+ to \d+ : \[(.*)\]", out[3])
    assert lrs, out[3]
    values = [float(v) for v in lrs[1].split(",")]
    assert values[0] == 1e-4 and values[2:] == [4e-4, 4e-4], values  # the step updating at the change keeps its lr
    assert "config now: 0.0004" in out[3]
    assert "cold starts at step 60 with temperature 0.6" in out[4], out[4]
    assert "hot starts at step 60 with temperature 1.4" in out[4], out[4]
    assert any("image/png" in o.get("data", {}) for o in cells[5].outputs), "the comparison shows an image"
    means = dict(re.findall(r"(cold|hot): mean reward of its last 20 steps (\d\.\d+)", out[6]))
    assert float(means["cold"]) > float(means["hot"]), out[6]  # a cold branch samples its best guess more often
    assert (tmp_path / "09-compare.png").stat().st_size > 10_000
    clip, lr = _what_if(out[7]), _what_if(out[8])
    # A tighter clip range clips more. Whether the update then moves the policy less
    # depends on the batch (Adam scales what is left): 0.0213 against 0.0207 was seen.
    assert clip["clip_fraction"][2] > clip["clip_fraction"][1], out[7]
    # Five times the lr moves the policy much further; how much further depends on the
    # batch (2.99x and over 3x measured on two runs' step-60 batches).
    assert lr["update_kl"][2] > 2 * lr["update_kl"][1], out[8]
    assert "live sessions: []" in out[9]


def test_10_a_tool_written_in_a_cell_is_learnt_by_rl_and_a_pause_keeps_conversations(
    execute_notebook: Execute,
) -> None:
    # ~50 s on an idle 2-core machine: a warm-up of 150 steps and 60 RL steps
    out, cells = run_notebook(execute_notebook, "10-tools-and-conversations", timeout=240)
    assert "'required': ['a', 'b']" in out[0]  # the schema a chat template gets
    assert out[1].splitlines() == [
        "Turn(observation='=1776;', reward=None, done=False)",
        "Turn(observation='=?;', reward=None, done=False)",  # a call that does not parse: an answer, not a crash
        "Turn(observation=None, reward=None, done=True)",
    ]
    before = number_after(out[2], "after the warm-up:")
    assert re.search(r"mask\s+1+0+1+", out[3]) and "turns begin at tokens (0, " in out[3], out[3]
    explorer = cells[3].outputs[-1]["data"]["text/html"]
    assert "rlnb-env" in explorer  # the tool's tokens drawn apart from the policy's
    paused = re.search(r"state: paused, conversations kept mid-turn: (\d+), failed: 0", out[4])
    assert paused and int(paused[1]) > 0, out[4]  # async rollouts were in flight: kept, not lost
    found = re.search(r"held-out accuracy: (\d\.\d+) after the warm-up -> (\d\.\d+) after (\d+) RL steps", out[5])
    assert found and float(found[1]) == before and int(found[3]) == 60, out[5]
    assert float(found[2]) >= before + 0.2, out[5]  # RL learnt to call the tool
    calls = re.search(r"(\d+) of (\d+) samples of step \d+ called the tool", out[6])
    assert calls and int(calls[1]) > 0.8 * int(calls[2]), out[6]
    assert "live sessions: []" in out[7]


def test_11_five_algorithms_from_one_run_what_if_of_each_and_a_loss_written_in_a_cell(
    execute_notebook: Execute,
) -> None:
    # ~60 s on an idle 2-core machine (100 s at a load of 10): a warm-up, 3 steps, five forks of 30 steps
    # side by side, a sixth of 30
    out, cells = run_notebook(execute_notebook, "11-algorithms-side-by-side", timeout=240)
    names = ["grpo", "dapo", "gspo", "cispo", "rloo"]
    presets = cells[0].outputs[0]["data"]["text/markdown"]  # rlnb.algorithms() as a table
    assert all(f"| `{name}` |" in presets for name in names), presets
    trunk = number_after(out[1], "held-out accuracy")
    assert any("image/png" in o.get("data", {}) for o in cells[2].outputs), "the comparison shows an image"
    found = re.findall(
        r"(\w+) +(\d+) steps  reward (\d\.\d+)  clipped (\d\.\d+)  tokens counted +(\d+)  held-out accuracy (\d\.\d+)",
        out[3],
    )
    branches = {name: [float(v) for v in values] for name, *values in found}
    assert list(branches) == names, out[3]
    assert {v[0] for v in branches.values()} == {33}, out[3]  # 3 steps of the trunk, 30 of its own
    # each trained with its algorithm: GSPO's narrow sequence clip acts on many tokens,
    # the token clips on few, CISPO's bounded weight drops no gradient, DAPO masks the cut completions
    assert branches["gspo"][2] > 0.2 > 10 * max(branches[n][2] for n in ("grpo", "dapo", "rloo")), out[3]
    assert branches["cispo"][2] == 0, out[3]
    assert branches["dapo"][3] < branches["grpo"][3], out[3]
    dapo = _what_if(out[4])
    assert dapo["tokens_counted"][2] < dapo["tokens_counted"][1], out[4]  # a flat group and cut completions left out
    header, *lines = out[5].splitlines()
    assert header.split() == names, out[5]  # a column per algorithm
    table = {line.split()[0]: dict(zip(names, map(float, line.split()[1:]), strict=True)) for line in lines}
    assert len(set(table["loss"].values())) == 5, out[5]  # CISPO's and GRPO's update_kl may print alike
    assert table["clip_fraction"]["gspo"] > 0.3 and table["clip_fraction"]["cispo"] == 0, out[5]
    assert table["update_kl"]["gspo"] < table["update_kl"]["grpo"], out[5]  # the clip dropped most gradients
    counted = table["tokens_counted"]
    assert counted["dapo"] < counted["grpo"] == counted["gspo"] == counted["cispo"] == counted["rloo"], out[5]
    assert table["groups_dropped"]["grpo"] == 0, out[5]
    mine = _what_if(out[6])
    assert "the loss '__main__.my_loss' is a function: a clip inside it is not measured" in out[6], out[6]
    assert mine["logp_change_positive"][2] < mine["logp_change_positive"][1], out[6]  # a tenth of the weight
    assert mine["update_kl"][2] > 0, out[6]
    trained = re.search(r"mine: held-out accuracy (\d\.\d+) at the fork -> (\d\.\d+) after (\d+) steps", out[7])
    assert trained and float(trained[1]) == trunk and int(trained[3]) == 33, out[7]
    assert float(trained[2]) > trunk, out[7]  # the loss written in the cell learnt
    assert any("image/png" in o.get("data", {}) for o in cells[7].outputs), "the second comparison shows an image"
    assert "live sessions: []" in out[8]


def test_12_an_openai_agent_and_a_verifiers_environment_train_through_the_endpoint(
    execute_notebook: Execute,
) -> None:
    # ~100 s on an idle 2-core machine: two warm-ups, 35 RL steps of agents' tool loops
    # through the endpoint, 30 of a verifiers environment
    out, cells = run_notebook(execute_notebook, "12-any-agent", timeout=420)
    assert re.search(r"<rlnb Endpoint http://127\.0\.0\.1:\d+/v1 model='agents'>", out[0]), out[0]
    assert re.search(r"finish_reason=\w+ policy_version=0", out[1]) and "prompt ids [1, " in out[1], out[1]
    before = number_after(out[2], "after the warm-up:")
    assert re.search(r"mask\s+1+0+1+", out[3]) and "turns begin at tokens (0, " in out[3], out[3]
    explorer = cells[3].outputs[-1]["data"]["text/html"]
    assert "rlnb-env" in explorer  # the tool results the agent sent back, drawn apart from the policy's tokens
    assert re.search(r"paused: \d+ replies kept mid-way, \d+ episodes open, 0 failed", out[4]), out[4]
    found = re.search(r"held-out accuracy: (\d\.\d+) after the warm-up -> (\d\.\d+) after (\d+) RL steps", out[4])
    assert found and float(found[1]) == before and int(found[3]) == 35, out[4]
    assert float(found[2]) >= before + 0.2, out[4]  # the agent learnt to call its tool
    assert re.search(r"\d+ requests, by status \{200: \d+\}", out[5]) and "failed=0" in out[5], out[5]
    assert "calls served by the endpoint" in cells[5].outputs[-1]["data"]["text/html"]
    vf = re.search(r"verifiers: held-out accuracy (\d\.\d+) after the warm-up -> (\d\.\d+) after 30 RL steps", out[6])
    assert vf and float(vf[2]) >= float(vf[1]) + 0.1, out[6]
    assert "sampled=1920" in out[6] and "failed=0" in out[6], out[6]
    assert "live sessions: []" in out[7]


def _what_if(text: str) -> dict[str, list[float]]:
    """A WhatIf's rows: metric -> [recorded, now, what if] (recorded NaN where the step has none)."""
    rows = {}
    for line in text.splitlines():
        name, *numbers = line.split()
        try:
            values = [float(n) for n in numbers]
        except ValueError:
            continue  # the title and the header
        if re.fullmatch(r"[a-z_]+", name) and len(values) in (2, 3):
            rows[name] = [math.nan] * (3 - len(values)) + values
    return rows


@pytest.mark.ray  # runs with the other Ray tests, one at a time
@pytest.mark.timeout(900)
def test_07_ray_replicas_survive_a_killed_one_and_close_leaves_no_ray_process(
    tmp_path: Path, execute_notebook: Execute
) -> None:
    # ~1.5 minutes on an idle 2-core machine. A re-run of the first cell (Ray started
    # again in the kernel) is tests/engines/test_ray.py's.
    out, _ = run_notebook(execute_notebook, "07-scale-out-on-ray", timeout=400)
    warm = number_after(out[1], "accuracy after the warm-up:")
    found = re.search(r"accuracy after 150 RL steps: (\d\.\d+)", out[2])
    assert found, out[2]
    assert float(found[1]) >= warm + 0.1, (warm, found[0])  # RL learnt, on the replicas
    replicas = re.findall(r"replica (\d): (\w+), weights v(\d+), (\d) restart", out[2])
    assert replicas == [("0", "running", "150", "0"), ("1", "running", "150", "1")], out[2]
    children = re.search(r"child processes: (\d+) before close, (\d+) after", out[3])
    assert children and int(children[1]) > 0 and children[2] == "0", out[3]
    assert (tmp_path / "runs" / "07-ray" / "ray").exists()  # Ray's logs under the run dir


@pytest.mark.ray  # runs with the other Ray tests, one at a time
@pytest.mark.timeout(600)
def test_13_one_process_and_two_ranks_learn_alike_and_a_killed_rank_is_named(execute_notebook: Execute) -> None:
    # ~2 minutes on an idle 2-core machine: two warm-ups and 2 x 30 RL steps, a local Ray cluster
    out, cells = run_notebook(execute_notebook, "13-more-than-one-learner", timeout=500)
    runs = re.findall(r"(\d) rank\(s\): held-out accuracy (\d\.\d+) after the warm-up -> (\d\.\d+) after 30", out[0])
    assert [r[0] for r in runs] == ["1", "2"], out[0]
    assert runs[0][1] == runs[1][1], out[0]  # the same warm-up on both
    for _, before, after in runs:
        assert float(after) >= float(before) + 0.05, out[0]  # RL learnt, on one process and on two ranks
    same = re.search(r"reward_mean the same \(to 1e-3\) at (\d+) of 30 steps", out[0])
    assert same and int(same[1]) >= 5, out[0]  # the first steps at least: then sampling may part them
    assert "image/png" in cells[1].outputs[-1]["data"]
    assert "learner ranks" in cells[2].outputs[-1]["data"]["text/html"]  # the dashboard's rows per rank
    assert re.search(r"rank 1: running, pid \d+ on 127\.0\.0\.1, step", out[3]), out[3]
    assert "2 ranks (fsdp)" in out[3], out[3]
    shares = [float(x) for x in re.findall(r"rank \d keeps (\d\.\d+) of one process's weights", out[3])]
    assert len(shares) == 2 and all(0.4 < x < 0.6 for x in shares), out[3]  # FSDP2: about half each
    assert re.search(r"RanksDied: learner rank 1 \(pid \d+, on 127\.0\.0\.1\) died during step", out[4]), out[4]
    assert "['learner-rank-dead']" in out[4], out[4]
    assert "(raylet)" not in "".join(out), out[4]  # the death is rlnb's one line, not the raylet's block
    assert "restarted: running, running" in out[5] and re.search(r"step \d+ taken on the new ranks", out[5]), out[5]
    children = re.search(r"child processes: (\d+) before close, (\d+) after", out[6])
    assert children and int(children[1]) > 0 and children[2] == "0", out[6]
    assert "live sessions: []" in out[6]

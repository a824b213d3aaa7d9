"""The shipped notebooks run top to bottom in a real kernel, and re-running cells is safe."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import nbformat
import pytest
import zmq.asyncio
from jupyter_client import AsyncKernelManager
from nbclient import NotebookClient

pytestmark = [pytest.mark.netns, pytest.mark.slow]

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def execute(nb: nbformat.NotebookNode, tmp_path: Path, *, timeout: float = 120) -> nbformat.NotebookNode:
    """Run ``nb`` in a fresh kernel (each cell within ``timeout`` seconds) and shut
    everything down; the async API avoids jupyter_core's helper threads and loops,
    which nothing would close."""
    ctx = zmq.asyncio.Context()  # our own, so that it is closed whatever the client does
    km = AsyncKernelManager(kernel_name="python3", context=ctx, connection_file=str(tmp_path / "kernel.json"))
    client = NotebookClient(nb, km=km, timeout=timeout, resources={"metadata": {"path": str(tmp_path)}})

    async def run() -> nbformat.NotebookNode:
        try:
            # IPYTHONDIR: keep the kernel's history database out of the home directory.
            return await client.async_execute(env={**os.environ, "IPYTHONDIR": str(tmp_path / "ipython")})
        finally:
            if client.kc is not None:
                client.kc.stop_channels()
            if km.has_kernel:  # a km passed in is ours to shut down, not nbclient's
                await km.shutdown_kernel(now=False)

    try:
        return asyncio.run(run())
    finally:
        ctx.destroy(linger=0)


def text_of(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def run_notebook(
    name: str, tmp_path: Path, *, rerun_first: bool = False, timeout: float = 120
) -> tuple[list[str], list[nbformat.NotebookNode]]:
    """Run ``notebooks/<name>.ipynb`` (optionally re-running its first code cell, as a
    user would); check that no cell wrote to stderr or raised; return each code cell's
    text, and the code cells."""
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    if rerun_first:
        first = next(c for c in nb.cells if c.cell_type == "code")
        nb.cells.insert(nb.cells.index(first) + 1, nbformat.v4.new_code_cell(first.source))
    done = execute(nb, tmp_path, timeout=timeout)
    cells = [c for c in done.cells if c.cell_type == "code"]
    for cell in cells:
        for out in cell.get("outputs", []):
            assert out["output_type"] != "error", f"{name}: {cell.source!r} raised {out.get('ename')}"
            assert out.get("name") != "stderr", f"{name}: {cell.source!r} wrote to stderr: {out.get('text')}"
    return [text_of(c) for c in cells], cells


def number_after(text: str, label: str) -> float:
    return float(re.search(rf"{re.escape(label)}\s*([-+0-9.e]+)", text)[1])  # type: ignore[index]


def test_01_quickstart_learns_in_the_background_and_leaves_nothing(tmp_path: Path) -> None:
    out, cells = run_notebook("01-quickstart", tmp_path, rerun_first=True)
    assert "closed the earlier session 'quickstart'" in out[1]
    assert "RolloutBatch(2 groups)" in out[2]
    before, warm = number_after(out[3], "accuracy before:"), number_after(out[3], "after the warm-up:")
    assert warm > before
    assert "'version': 1" in out[4]
    dashboard = next(c for c in cells if c.source == "sess.dashboard()")
    static = dashboard.outputs[0]["data"]["text/html"]  # the widget became its static copy on close
    assert "quickstart" in static and "exit code 0" in static and "data:image/svg+xml;base64" in static
    assert re.search(r"training\s+running", out[7]), out[7]  # the cell ran while training went on
    after = number_after(out[8], "RL steps:")
    assert "after 151 RL steps" in out[8] and after > warm  # the RL stage learned
    assert "closed (tracker exit code 0)" in out[-1] and "live sessions: []" in out[-1]


def test_02_pause_and_resume_keeps_partial_rollouts_with_their_versions(tmp_path: Path) -> None:
    out, _ = run_notebook("02-pause-and-resume", tmp_path)
    assert number_after(out[2], "paused:") > 0  # samples kept as partial rollouts
    assert "policy version 1 | engine version 1" in out[3]
    assert "groups hold continued samples" in out[4]
    assert int(out[4].split(" of ")[0]) > 0
    assert re.search(r"0-1\s+resumed x1", out[4]), out[4]  # a prefix from version 0, the rest from 1
    assert "paused, engine paused in 'keep' mode" in out[5]
    assert "closed (tracker exit code 0)" in out[-1]


def test_03_grpo_by_hand_matches_the_step(tmp_path: Path) -> None:
    out, _ = run_notebook("03-step-through-grpo", tmp_path)
    lines = dict(line.split(":", 1) for line in out[1].splitlines())
    assert lines["by hand"].split() == lines["rlnb"].split()
    by_hand, reported = re.findall(r"[-+]\d\.\d+e[-+]\d+", out[2])
    assert abs(float(by_hand) - float(reported)) <= 1e-3 * max(abs(float(reported)), 1e-4)
    assert "0.50" in out[3]  # the swapped reward's partial credit
    assert "60 steps in the history, the last at version 60" in out[-1]


def test_04_your_own_task_learns(tmp_path: Path) -> None:
    out, _ = run_notebook("04-your-own-task", tmp_path)
    found = re.search(r"accuracy: (\d\.\d+) at first, (\d\.\d+) after the warm-up, (\d\.\d+) after RL", out[2])
    assert found, out[2]
    start, warm, end = (float(x) for x in found.groups())
    assert start < warm < end, found[0]  # the warm-up helps, and RL adds to it


def test_05_a_checkpoint_continues_exactly(tmp_path: Path) -> None:
    out, _ = run_notebook("05-checkpoints-and-restarts", tmp_path)
    assert "'checkpoint.json'" in out[0] and "'model.safetensors'" in out[0]
    assert "loaded at step 5" in out[2]
    assert "the same three steps: True" in out[3]
    assert (tmp_path / "runs" / "checkpoints" / "05" / "checkpoint.json").is_file()


def test_06_your_own_model_learns_and_transformers_writes_what_it_writes(tmp_path: Path) -> None:
    out, _ = run_notebook("06-your-own-model", tmp_path, rerun_first=True)
    assert out[0] == "LlamaForCausalLM: 331,648 parameters on cpu\n", out[0]
    assert "closed the earlier session 'own-model'" in out[1]
    found = re.search(r"accuracy: (\d\.\d+) at first, (\d\.\d+) after the warm-up, (\d\.\d+) after RL", out[2])
    assert found, out[2]
    start, warm, end = (float(x) for x in found.groups())
    assert start < warm < end, found[0]  # the warm-up helps, and RL adds to it
    assert "transformers writes the same: True" in out[4], out[4]
    assert (tmp_path / "runs" / "models" / "reverse-trained" / "model.safetensors").is_file()


@pytest.mark.ray  # runs with the other Ray tests, one at a time
@pytest.mark.timeout(900)
def test_07_ray_replicas_survive_a_killed_one_and_close_leaves_no_ray_process(tmp_path: Path) -> None:
    # ~2.5 minutes on an idle 2-core machine: two Ray starts (the first cell runs twice)
    out, _ = run_notebook("07-scale-out-on-ray", tmp_path, rerun_first=True, timeout=400)
    assert "closed the earlier session 'ray'" in out[1]  # and its Ray cluster: a new one starts
    warm = number_after(out[2], "accuracy after the warm-up:")
    found = re.search(r"accuracy after 150 RL steps: (\d\.\d+)", out[3])
    assert found, out[3]
    assert float(found[1]) >= warm + 0.1, (warm, found[0])  # RL learnt, on the replicas
    replicas = re.findall(r"replica (\d): (\w+), weights v(\d+), (\d) restart", out[3])
    assert replicas == [("0", "running", "150", "0"), ("1", "running", "150", "1")], out[3]
    children = re.search(r"child processes: (\d+) before close, (\d+) after", out[4])
    assert children and int(children[1]) > 0 and children[2] == "0", out[4]
    assert (tmp_path / "runs" / "07-ray" / "ray").exists()  # Ray's logs under the run dir

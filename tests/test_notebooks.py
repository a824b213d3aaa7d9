"""The shipped notebooks run top to bottom in a real kernel, and re-running cells is safe."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import nbformat
import pytest
import zmq.asyncio
from jupyter_client import AsyncKernelManager
from nbclient import NotebookClient

pytestmark = [pytest.mark.netns, pytest.mark.slow]

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def execute(nb: nbformat.NotebookNode, tmp_path: Path) -> nbformat.NotebookNode:
    """Run ``nb`` in a fresh kernel and shut everything down; the async API avoids
    jupyter_core's helper threads and loops, which nothing would close."""
    ctx = zmq.asyncio.Context()  # our own, so that it is closed whatever the client does
    km = AsyncKernelManager(kernel_name="python3", context=ctx, connection_file=str(tmp_path / "kernel.json"))
    client = NotebookClient(nb, km=km, timeout=120, resources={"metadata": {"path": str(tmp_path)}})

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


def stream_of(cell: nbformat.NotebookNode) -> str:
    """What the cell printed (not the displays, which later cells may update in place)."""
    return "".join(out.get("text", "") for out in cell.get("outputs", []) if out.get("output_type") == "stream")


def test_quickstart_runs_and_leaves_no_session(tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    # Re-run the cell that makes the session, as a user would, right after it ran once.
    nb.cells.insert(nb.cells.index(code_cells[0]) + 1, nbformat.v4.new_code_cell(code_cells[0].source))
    done = execute(nb, tmp_path)
    outputs = [text_of(c) for c in done.cells if c.cell_type == "code"]
    assert "closed the earlier session 'quickstart'" in outputs[1]
    assert "'train': 6" in outputs[2]
    assert "['0+0=', '1+1=', '2+2=', '3+3=']" in outputs[3]
    assert "2 of 4 groups ready" in outputs[4]
    assert "loops: ('rlnb-quickstart',)" in outputs[5]
    assert outputs[-1].strip() == "[] ()"


def test_rollouts_notebook_pauses_and_resumes_without_losing_samples(tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOKS / "rollouts.ipynb", as_version=4)
    done = execute(nb, tmp_path)
    outputs = [text_of(c) for c in done.cells if c.cell_type == "code"]
    table = done.cells[3].outputs[0]["data"]
    assert "<table>" in table["text/html"] and "+" in table["text/html"]
    assert "'train': 16" in outputs[2]  # (0 + 1 + 1) versions x 8 groups: the staleness budget
    assert outputs[3].startswith("paused | engine running: 0")
    state, counts = outputs[4].split("|", 1)
    assert state.strip() == "running"
    dispatched, total = (
        int(x) for x in counts.replace("dispatched:", "").split("= finished + partial + failed + in flight:")
    )
    assert dispatched == total
    assert outputs[-1].strip() == "[]"


def test_training_notebook_steps_saves_loads_and_runs_async(tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOKS / "training.ipynb", as_version=4)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    # re-run the cell that makes the session and the warm-up cell, as a user would
    nb.cells.insert(nb.cells.index(code_cells[0]) + 1, nbformat.v4.new_code_cell(code_cells[0].source))
    done = execute(nb, tmp_path)
    outputs = [stream_of(c) for c in done.cells if c.cell_type == "code"]
    assert "closed the earlier session 'training'" in outputs[1]
    before = float(outputs[1].rsplit(":", 1)[1])
    after = float(outputs[2].rsplit(":", 1)[1])
    assert after > before  # the warm-up taught it something
    assert "'version': 1" in outputs[3]
    rollout_cell = next(c for c in done.cells if c.source == "sess.rollout(2)")
    assert "<table>" in rollout_cell.outputs[0]["data"]["text/html"]
    widget_cell = next(c for c in done.cells if c.source.startswith('sess.tracker.backend("plot").widget'))
    assert "application/vnd.jupyter.widget-view+json" in widget_cell.outputs[0]["data"]
    assert outputs[6].startswith("version 5")
    assert "loaded at version 5" in outputs[7]
    paused, version = outputs[8].strip().splitlines()
    assert paused.startswith("paused: paused")
    dispatched, total = (
        int(x) for x in paused.split("dispatched", 1)[1].split("= finished + partial + failed + in flight")
    )
    assert dispatched == total
    assert version == "version 5.0"
    assert outputs[-1].strip() == "[]"
    assert (tmp_path / "checkpoint" / "checkpoint.json").is_file()
    assert (tmp_path / "runs" / "training" / "curves.png").is_file()
    finishes = [
        line
        for line in (tmp_path / "runs" / "training" / "metrics.jsonl").read_text().splitlines()
        if '"finish"' in line
    ]
    assert len(finishes) == 4  # the re-run cell's, the one replaced by the load, the loaded one's, the async one's

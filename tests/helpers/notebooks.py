"""Notebooks run top to bottom in a real kernel through nbclient.

Tests get :func:`execute` through the ``execute_notebook`` fixture (tests/conftest.py),
which puts them in the system tier."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import nbformat
import zmq.asyncio
from jupyter_client import AsyncKernelManager
from nbclient import NotebookClient

INTERRUPT_AFTER = 3.0  # seconds from a cell's start to the interrupt button


def execute(
    nb: nbformat.NotebookNode,
    tmp_path: Path,
    *,
    timeout: float = 120,
    interrupt: str | None = None,
    restart_before: str | None = None,
) -> nbformat.NotebookNode:
    """Run ``nb`` in a fresh kernel (each cell within ``timeout`` seconds) and shut
    everything down; the async API avoids jupyter_core's helper threads and loops,
    which nothing would close. As a user would: the cell whose source is ``interrupt``
    gets the interrupt button (■) a few seconds after it starts, and the kernel is
    restarted (Kernel ▸ Restart Kernel) before the cell whose source is ``restart_before``."""
    ctx = zmq.asyncio.Context()  # our own, so that it is closed whatever the client does
    km = AsyncKernelManager(kernel_name="python3", context=ctx, connection_file=str(tmp_path / "kernel.json"))
    sources = [c.source for c in nb.cells]
    for source in (interrupt, restart_before):
        assert source is None or source in sources, f"no cell {source!r}"
    restarts: list[tuple[int | None, int | None]] = []  # the kernel's pid before and after

    async def before_cell(cell: nbformat.NotebookNode, cell_index: int) -> None:
        if cell.source == restart_before:
            old = km.provisioner.pid if km.provisioner else None
            await km.restart_kernel(now=False)
            assert client.kc is not None
            await client.kc.wait_for_ready(timeout=timeout)
            restarts.append((old, km.provisioner.pid if km.provisioner else None))

    async def cell_sent(cell: nbformat.NotebookNode, cell_index: int) -> None:
        if cell.source == interrupt:  # the execute request is on its way: the cell is running
            await asyncio.sleep(INTERRUPT_AFTER)
            await km.interrupt_kernel()

    if interrupt is not None:  # its error is the test's to look at, and the cells after it still run
        cell = nb.cells[sources.index(interrupt)]
        cell.metadata["tags"] = [*cell.metadata.get("tags", []), "raises-exception"]
    client = NotebookClient(
        nb,
        km=km,
        timeout=timeout,
        resources={"metadata": {"path": str(tmp_path)}},
        on_cell_execute=before_cell,
        on_cell_complete=cell_sent,
    )

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
        done = asyncio.run(run())
    finally:
        ctx.destroy(linger=0)
    if restart_before is not None:
        assert len(restarts) == 1 and None not in restarts[0] and len(set(restarts[0])) == 2, restarts
    return done

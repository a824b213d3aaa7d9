"""The shipped notebooks in a real JupyterLab, driven through a real Chromium."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import psutil
import pytest

from tests.browser import (
    CHROMIUM,
    browser,
    cell_outputs,
    error_outputs,
    execution_counts,
    jupyterlab,
    kernel_processes,
    open_notebook,
    restart_kernel,
    run_all_cells,
    screenshot,
)

pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason=f"needs Debian's Chromium at {CHROMIUM} (apt-get install chromium)"
    ),
]

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "notebooks" / "01-quickstart.ipynb"
SCREENSHOTS = ROOT / "runs" / "browser"  # ignored by git; kept to look at after a run


def test_quickstart_runs_in_jupyterlab_and_restarts_clean(tmp_path: Path) -> None:
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    shutil.copy(QUICKSTART, notebooks)
    with jupyterlab(notebooks) as url, browser() as page:
        open_notebook(page, url, QUICKSTART.name)
        run_all_cells(page, timeout=240)  # about 40 s on 2 cores: a warm-up and 150 GRPO steps

        shot = screenshot(page, tmp_path, "quickstart.png")
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, SCREENSHOTS / shot.name)
        assert None not in execution_counts(page), "not every cell ran"
        assert error_outputs(page) == []
        last = cell_outputs(page)[-1]  # what tests/test_notebooks.py expects of it, as the page shows it
        assert "closed (tracker exit code 0)" in last and "live sessions: []" in last, last

        (kernel,) = kernel_processes()
        old = [kernel, *kernel.children(recursive=True)]
        start = time.monotonic()
        restart_kernel(page)  # returns once the new kernel is idle
        _, alive = psutil.wait_procs(old, timeout=max(0.0, start + 5.0 - time.monotonic()))
        assert not alive, f"5 s after the restart the old kernel's processes are still there: {alive}"
        (new,) = kernel_processes()
        assert new.pid != kernel.pid

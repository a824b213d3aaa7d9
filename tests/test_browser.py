"""The shipped notebooks in a real JupyterLab, driven through a real Chromium."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any

import nbformat
import psutil
import pytest
from playwright.sync_api import Page

from tests.browser import (
    CHROMIUM,
    browser,
    cell_outputs,
    error_outputs,
    execution_counts,
    jupyterlab,
    kernel_processes,
    menu,
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


PAUSE_RESUME = ROOT / "notebooks" / "02-pause-and-resume.ipynb"


def state_word(page: Page) -> str:
    return str(page.locator(".rlnb-dashboard .rlnb-state-word").first.get_attribute("data-state"))


def gauge(page: Page, name: str) -> int:
    value = page.locator(f'.rlnb-dashboard .rlnb-gauge[data-gauge="{name}"]').first.get_attribute("data-value")
    return int(value or -1)


def press(page: Page, method: str) -> None:
    """Click the dashboard's button for ``method`` (its label; an icon may precede it)."""
    page.locator(".rlnb-dashboard button", has_text=re.compile(rf"^\W*{method}\s*$")).first.click()


def saved_widget_state(path: Path) -> dict[str, Any] | None:
    """The widget state saved in the notebook at ``path``, or None (not yet there)."""
    try:
        widgets = nbformat.read(path, as_version=4).metadata.get("widgets", {})
    except Exception:  # a file being written
        return None
    state: dict[str, Any] | None = widgets.get("application/vnd.jupyter.widget-state+json")
    return state


def wait_for(page: Page, condition: str, arg: object, timeout: float = 60.0) -> None:
    page.wait_for_function(condition, arg=arg, timeout=timeout * 1000)


def test_the_dashboard_pauses_resumes_and_stops_background_training_in_jupyterlab(tmp_path: Path) -> None:
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    nb = nbformat.read(PAUSE_RESUME, as_version=4)
    assert "sess.close()" in nb.cells[-1].source
    nb.cells[-1] = nbformat.v4.new_code_cell("sess.start()")  # leave it training in the background
    nbformat.write(nb, notebooks / PAUSE_RESUME.name)
    with jupyterlab(notebooks) as url, browser(height=1800) as page:
        open_notebook(page, url, PAUSE_RESUME.name)
        run_all_cells(page, timeout=240)
        assert error_outputs(page) == []
        board = page.locator(".rlnb-dashboard").first
        board.scroll_into_view_if_needed()
        word = ".rlnb-dashboard .rlnb-state-word"
        wait_for(page, "s => document.querySelector(s)?.dataset.state === 'running'", word)

        press(page, "pause")  # mode "abort", the dropdown's default
        wait_for(page, "s => document.querySelector(s)?.dataset.state === 'paused'", word)
        press(page, "resume")
        wait_for(page, "s => document.querySelector(s)?.dataset.state === 'running'", word)
        version = ".rlnb-dashboard .rlnb-state"
        seen = page.locator(version).first.inner_text()
        wait_for(page, "([s, before]) => document.querySelector(s)?.innerText !== before", [version, seen])

        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        board.screenshot(path=str(SCREENSHOTS / "dashboard.png"))  # training in the background
        threads = '.rlnb-dashboard .rlnb-gauge[data-gauge="threads"]'
        # The most seen over a second: the reward pool's thread leaves after a second idle,
        # so a reading on a slow machine may still catch the count without it.
        training_threads = max(gauge(page, "threads") for _ in range(10) if page.wait_for_timeout(100) is None)
        press(page, "stop")  # the trainer's thread ends: the threads gauge shows it
        wait_for(page, "([s, n]) => Number(document.querySelector(s)?.dataset.value) < n", [threads, training_threads])
        assert error_outputs(page) == []
        screenshot(page, tmp_path, "pause-and-resume.png")
        shutil.copy(tmp_path / "pause-and-resume.png", SCREENSHOTS / "pause-and-resume.png")

        # Saved while the session is open, the notebook keeps the widgets' state (the
        # set-up turns on Lab's "Save Jupyter widget state"): it reopens showing the
        # dashboard's last frame, not "model not found".
        saved = notebooks / PAUSE_RESUME.name
        menu(page, "File", "Save Notebook")
        deadline = time.monotonic() + 30
        while not (state := saved_widget_state(saved)):  # the server may be mid-write
            assert time.monotonic() < deadline, "the notebook was not saved with its widget state"
            time.sleep(0.05)
        values = [m["state"].get("value", "") for m in state["state"].values()]
        assert any("rlnb-state-word" in str(v) for v in values), "no dashboard state saved"

        (kernel,) = kernel_processes()
        old = [kernel, *kernel.children(recursive=True)]
        start = time.monotonic()
        restart_kernel(page)
        _, alive = psutil.wait_procs(old, timeout=max(0.0, start + 5.0 - time.monotonic()))
        assert not alive, f"5 s after the restart the old kernel's processes are still there: {alive}"
        # the kernel's shutdown hook closed the session (the tracker got 130); the page can
        # no longer hear from that kernel, so the dashboard's own CSS says so
        page.locator(".rlnb-dashboard .rlnb-gone").first.wait_for(state="visible", timeout=30_000)
        assert "exit code 130" in page.locator(".rlnb-dashboard .rlnb-gone").first.inner_text()
        assert not page.locator(".rlnb-dashboard .rlnb-live").first.is_visible()
        screenshot(page, SCREENSHOTS, "after-restart.png")

"""Notebooks in a real JupyterLab, driven through a real Chromium (the ``open_lab`` and
``open_browser`` fixtures): a small one of the test's own, the shipped 02, and one that
puts the dashboard through a full buffer, a foreground train and close."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import psutil
import pytest
from playwright.sync_api import Locator, Page

from tests.helpers import wait_until
from tests.helpers.browser import (
    cell_outputs,
    error_outputs,
    execution_counts,
    kernel_processes,
    menu,
    open_file_browser,
    open_notebook,
    restart_kernel,
    run_all_cells,
    run_cell,
    screenshot,
    wait_for_idle,
    write_notebook,
)

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOTS = ROOT / "runs" / "browser"  # ignored by git; kept to look at after a run
OpenLab = Callable[..., AbstractContextManager[str]]  # the open_lab fixture
OpenBrowser = Callable[..., AbstractContextManager[Page]]  # the open_browser fixture

# A notebook 01 would run (tests/test_notebooks.py runs 01 itself): a session with a
# loader worker, its dashboard, training in the background, close. Seconds, not 01's minute.
SMALL = [
    """import rlnb

config = rlnb.Config(
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
)
sess = rlnb.Session(config, name="small")
sess""",
    "sess.dashboard()",
    "sess.training.start(steps=5)",
    "sess.training.wait()\nprint(sess.version)",
    'sess.close()\nprint(sess)\nprint("live sessions:", rlnb.sessions())',
]


def test_a_notebook_runs_in_jupyterlab_and_restarts_clean(
    tmp_path: Path, open_lab: OpenLab, open_browser: OpenBrowser
) -> None:
    notebooks = tmp_path / "notebooks"
    write_notebook(notebooks / "small.ipynb", SMALL)
    with open_lab(notebooks) as url, open_browser() as page:
        open_notebook(page, url, "small.ipynb")
        run_all_cells(page, timeout=240)

        shot = screenshot(page, tmp_path, "small.png")
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, SCREENSHOTS / shot.name)
        assert None not in execution_counts(page), "not every cell ran"
        assert error_outputs(page) == []
        last = cell_outputs(page)[-1]
        assert "closed (tracker exit code 0)" in last and "live sessions: []" in last, last

        (kernel,) = kernel_processes()
        old = [kernel, *kernel.children(recursive=True)]
        start = time.monotonic()
        restart_kernel(page)  # returns once the new kernel is idle
        _, alive = psutil.wait_procs(old, timeout=max(0.0, start + 5.0 - time.monotonic()))
        assert not alive, f"5 s after the restart the old kernel's processes are still there: {alive}"
        (new,) = kernel_processes()
        assert new.pid != kernel.pid


def test_notebook_10_shows_conversations_in_jupyterlab(
    tmp_path: Path, open_lab: OpenLab, open_browser: OpenBrowser
) -> None:
    # Its cells up to the first explorer, then the close: the kernel test runs the rest
    # (tests/test_notebooks.py); here what matters is how a conversation looks.
    import nbformat  # here: importing it (jsonschema's format checkers) costs every collection seconds

    nb = nbformat.read(ROOT / "notebooks" / "10-tools-and-conversations.ipynb", as_version=4)
    explorer = next(i for i, c in enumerate(nb.cells) if "sess.explore(batch)" in c.source)
    nb.cells = [*nb.cells[: explorer + 1], *nb.cells[-2:]]
    # A shorter warm-up: 20 steps already make the policy call the tool on some prompts
    # (3 of 16 samples; 150 teach it the answers too), and the warm-up was half this test.
    (setup,) = (c for c in nb.cells if "rlnb.WarmupConfig(steps=150," in c.source)
    setup.source = setup.source.replace("rlnb.WarmupConfig(steps=150,", "rlnb.WarmupConfig(steps=20,")
    assert "sess.close()" in nb.cells[-1].source
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    nbformat.write(nb, notebooks / "10-tools-and-conversations.ipynb")
    with open_lab(notebooks) as url, open_browser() as page:
        open_notebook(page, url, "10-tools-and-conversations.ipynb")
        run_all_cells(page, timeout=300)
        assert None not in execution_counts(page), "not every cell ran"
        assert error_outputs(page) == []
        explorer = page.locator(".rlnb-env").first  # the tool's tokens, drawn apart from the policy's
        explorer.wait_for(state="visible")
        explorer.scroll_into_view_if_needed()
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "10-explorer.png"))
        shutil.copy(screenshot(page, tmp_path, "10-tools-and-conversations.png"), SCREENSHOTS)
        assert "live sessions: []" in cell_outputs(page)[-1]


PAUSE_RESUME = ROOT / "notebooks" / "02-pause-and-resume.ipynb"
# Run again once a setting changed: the steps after the last change, and each one's lr.
AFTER_THE_CHANGE = """import json, threading
if sess.changes:
    change, tick = sess.changes[-1], threading.Event()
    for _ in range(1200):  # a minute at most: two steps after the change
        if sess.version >= change.step + 2:
            break
        tick.wait(0.05)
    after = [(int(m["version"]), m["lr"]) for m in sess.history if m["version"] > change.step]
    print(json.dumps({"step": change.step, "new": change.new, "after": after[:2]}))"""


def state_word(page: Page) -> str:
    return str(page.locator(".rlnb-dashboard .rlnb-state-word").first.get_attribute("data-state"))


def gauge(page: Page, name: str) -> int:
    value = page.locator(f'.rlnb-dashboard .rlnb-gauge[data-gauge="{name}"]').first.get_attribute("data-value")
    return int(value or -1)


def press(page: Page, method: str) -> None:
    """Click the dashboard's button for ``method`` (its label; an icon may precede it)
    as a person does: once it is on, and has been for a moment."""
    button = page.locator(".rlnb-dashboard button", has_text=re.compile(rf"^\W*{method}\s*$")).first
    button.wait_for(state="visible")
    while button.is_disabled():
        page.wait_for_timeout(50)
    page.wait_for_timeout(300)  # nobody clicks a button the moment it comes on
    button.click()


def change_lr_from_the_settings_panel(page: Page, board: Locator) -> None:
    """Open the dashboard's settings, type a new lr, Apply it while training goes on
    in the background, see the panel say so and the curves mark it; a screenshot of
    the dashboard with the settings open, then close them again."""
    settings = board.locator(".rlnb-settings").first
    header = settings.locator(".jupyter-widget-Collapse-header").first
    header.click()
    lr = settings.locator(".rlnb-setting-lr input").first
    lr.wait_for(state="visible")
    assert lr.input_value() == "0.0001"
    lr.fill("0.0002")
    press(page, "apply")
    said = ".rlnb-dashboard .rlnb-settings-message"
    wait_for(page, "s => document.querySelector(s)?.innerText.includes('lr 0.0001 → 0.0002')", said)
    assert page.locator(f"{said} .rlnb-error").count() == 0
    assert lr.input_value() == "0.0002"
    marked = "s => [...document.querySelectorAll(s)].some(i => atob(i.src.split(',')[1]).includes('rlnb-change'))"
    wait_for(page, marked, ".rlnb-dashboard .rlnb-curves img")  # at the curves' pace: within a few seconds
    board.screenshot(path=str(SCREENSHOTS / "settings.png"))
    header.click()
    lr.wait_for(state="hidden")


def saved_widget_state(path: Path) -> dict[str, Any] | None:
    """The widget state saved in the notebook at ``path``, or None (not yet there)."""
    import nbformat

    try:
        widgets = nbformat.read(path, as_version=4).metadata.get("widgets", {})
    except Exception:  # a file being written
        return None
    state: dict[str, Any] | None = widgets.get("application/vnd.jupyter.widget-state+json")
    return state


def wait_for(page: Page, condition: str, arg: object, timeout: float = 60.0) -> None:
    page.wait_for_function(condition, arg=arg, timeout=timeout * 1000)


def test_the_dashboard_pauses_resumes_and_stops_background_training_in_jupyterlab(
    tmp_path: Path, open_lab: OpenLab, open_browser: OpenBrowser
) -> None:
    import nbformat

    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    nb = nbformat.read(PAUSE_RESUME, as_version=4)
    assert "sess.close()" in nb.cells[-1].source
    nb.cells[-1] = nbformat.v4.new_code_cell("sess.training.start()")  # leave it training in the background
    nb.cells.append(nbformat.v4.new_code_cell(AFTER_THE_CHANGE))  # says nothing until a change
    nbformat.write(nb, notebooks / PAUSE_RESUME.name)
    with open_lab(notebooks) as url, open_browser(height=1800) as page:
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
        started = time.monotonic()
        change_lr_from_the_settings_panel(page, board)
        check = sum(cell.cell_type == "code" for cell in nb.cells) - 1
        run_cell(page, check)  # Shift+Enter in the last cell adds an empty one below it
        printed = "([s, i]) => document.querySelectorAll(s)[i]?.querySelector('.jp-OutputArea')?.innerText"
        wait_for(page, printed + ".includes('\"after\"')", [".jp-Notebook .jp-CodeCell", check])
        wait_for_idle(page)
        said = json.loads(cell_outputs(page)[check])
        assert said["new"] == 0.0002, said
        # the step under way when Apply was clicked may keep the old lr; the one after it has the new
        (first, lr1), (second, lr2) = said["after"]
        assert (first, second) == (said["step"] + 1, said["step"] + 2) and lr2 == 0.0002 and lr1 in (0.0001, 0.0002)
        print(f"\nthe settings panel's part: {time.monotonic() - started:.1f} s")
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
        # the server may be mid-write: a notebook that does not parse has no state yet
        wait_until(lambda: bool(saved_widget_state(saved)), "the notebook saved with its widget state", 30)
        state = saved_widget_state(saved)
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
        # ipywidgets draws a broken-link icon on every part of a widget whose kernel is gone;
        # the epitaph says it once instead
        icons = page.evaluate(
            """() => [...document.querySelectorAll('.rlnb-dashboard .jupyter-widgets-disconnected')]
                .filter(el => getComputedStyle(el, '::before').display !== 'none'
                              && getComputedStyle(el, '::before').content !== 'none').length"""
        )
        assert icons == 0, f"{icons} broken-link icons on the dashboard after the restart"
        assert not page.locator(".rlnb-dashboard .rlnb-controls").first.is_visible()  # nothing to click
        screenshot(page, SCREENSHOTS, "after-restart.png")


TRUTH = [
    """import time
import rlnb

config = rlnb.Config(
    task="reverse",
    mode="async",
    seed=0,
    rollout=rlnb.RolloutConfig(max_policy_lag=None, max_new_tokens=20),
    buffer=rlnb.BufferConfig(capacity=48),
)
sess = rlnb.Session(config, name="truth")
sess.dashboard()""",
    "sess.training.start()",
    "sess.train(30)",
    "sess.close()\nprint(sess.version)",
]


def training_word(page: Page) -> str:
    return str(page.locator(".rlnb-dashboard .rlnb-training-word").first.get_attribute("data-state"))


def state_row(page: Page, label: str) -> str:
    """The text of one row of the dashboard's state table."""
    row = page.locator(".rlnb-dashboard .rlnb-state tr", has=page.locator(f"th:text-is('{label}')")).first
    return str(row.locator("td").first.inner_text())


def test_the_dashboard_tells_the_truth_through_a_full_buffer_pause_a_foreground_train_and_close(
    tmp_path: Path, open_lab: OpenLab, open_browser: OpenBrowser
) -> None:
    """At 1280x800 with the file browser open, as a new user sees it: a wait-mode pause
    with a full buffer while training goes on in the background, clicks while a cell
    trains in the foreground, and the frame the session closes with.

    JupyterLab sends clicks through a kernel subshell, so they reach the kernel while
    a cell runs (the dashboard keeps them going there once a click has shown it the
    subshell): pause and resume work beside a foreground train(), the rest is off. A
    click the kernel held back until a cell ended is refused, not run late: that path
    is driven through jupyter_client in tests/notebook/test_dashboard_kernel.py."""
    notebooks = tmp_path / "notebooks"
    write_notebook(notebooks / "truth.ipynb", TRUTH)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    generation = ".rlnb-dashboard .rlnb-state-word"
    with open_lab(notebooks) as url, open_browser(height=800) as page:
        open_notebook(page, url, "truth.ipynb")
        open_file_browser(page)
        run_cell(page, 0)
        wait_for_idle(page)
        page.locator(".rlnb-dashboard .rlnb-training-word").first.wait_for()
        assert (training_word(page), state_word(page)) == ("idle", "stopped")  # not a green RUNNING

        run_cell(page, 1)  # train in the background until the buffer is full
        wait_for(page, "s => document.querySelector(s)?.innerText.includes('train 48/48 groups')",
                 ".rlnb-dashboard .rlnb-state", timeout=120)  # fmt: skip
        board = page.locator(".rlnb-dashboard").first
        board.scroll_into_view_if_needed()
        fits = page.evaluate(
            """() => {
                const board = document.querySelector('.rlnb-dashboard').getBoundingClientRect();
                const curves = document.querySelector('.rlnb-dashboard .rlnb-curves').getBoundingClientRect();
                const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer');
                return [curves.bottom - board.top, panel.clientHeight, board.width];
            }"""
        )
        print(f"\ndashboard down to the curves: {fits[0]:.0f} of {fits[1]} px, {fits[2]:.0f} px wide")
        assert fits[0] <= fits[1], f"the dashboard needs {fits[0]:.0f} px down to its curves; the panel shows {fits[1]}"
        page.screenshot(path=str(SCREENSHOTS / "truth-full-buffer.png"))

        page.locator(".rlnb-dashboard select").first.select_option("wait")
        press(page, "pause")  # a wait-mode pause with a full buffer, training on: it must settle
        wait_for(page, "s => document.querySelector(s)?.dataset.state === 'paused'", generation, timeout=60)
        assert training_word(page) == "background"
        wait_for(page, "s => document.querySelector(s)?.innerText.includes('generation is paused, so it trains')",
                 ".rlnb-dashboard .rlnb-state")  # fmt: skip
        assert "PAUSED (wait)" in page.locator(generation).first.inner_text()
        page.screenshot(path=str(SCREENSHOTS / "truth-wait-pause.png"))
        press(page, "resume")
        wait_for(page, "s => document.querySelector(s)?.dataset.state === 'running'", generation)
        press(page, "stop")  # training and background generation both
        wait_for(page, "s => document.querySelector(s)?.dataset.state === 'stopped'", generation)
        assert training_word(page) == "idle"

        page.locator(".rlnb-dashboard select").first.select_option("abort")
        run_cell(page, 2)  # train() in the foreground: the kernel's main thread is busy
        word = ".rlnb-dashboard .rlnb-training-word"
        wait_for(page, "s => document.querySelector(s)?.dataset.state === 'foreground'", word, timeout=60)
        notice = page.locator(".rlnb-dashboard .rlnb-notice").first
        wait_for(page, "s => document.querySelector(s)?.innerText.includes('pause and resume work meanwhile')",
                 ".rlnb-dashboard .rlnb-notice")  # fmt: skip
        assert "train(until=" in notice.inner_text()
        off = page.eval_on_selector_all(
            ".rlnb-dashboard button", "bs => bs.filter(b => b.disabled).map(b => b.innerText.trim())"
        )
        assert {"start", "stop", "step", "evaluate", "save"} <= set(off), off
        press(page, "pause")  # beside the running cell: it runs now, not when the cell ends
        wait_for(page, "s => document.querySelector(s)?.dataset.state === 'paused'", generation)
        assert training_word(page) == "foreground"
        wait_for(page, "s => document.querySelector(s)?.innerText.includes('rollouts are paused')",
                 ".rlnb-dashboard .rlnb-state")  # fmt: skip  # the step waits for the resume
        page.screenshot(path=str(SCREENSHOTS / "truth-foreground.png"))
        press(page, "resume")
        wait_for_idle(page, timeout=180)  # the train() cell finishes
        assert error_outputs(page) == []
        assert "resumed" in page.locator(".rlnb-dashboard .rlnb-message").first.inner_text()

        run_cell(page, 3)
        wait_for_idle(page)
        page.locator(".rlnb-dashboard.rlnb-static").first.wait_for()
        version = cell_outputs(page)[3].strip()
        assert state_row(page, "policy version") == f"{version} (engine {version})"  # not the last tick's
        assert (training_word(page), state_word(page)) == ("closed", "closed")
        deltas = page.eval_on_selector_all(".rlnb-dashboard .rlnb-gauge", "els => els.map(e => e.dataset.delta)")
        new = page.eval_on_selector_all(".rlnb-dashboard .rlnb-new", "els => els.map(e => e.innerText)")
        assert deltas and set(deltas) == {"0"}, (deltas, new)  # nothing left behind, at once
        assert new == []
        assert error_outputs(page) == []
        page.locator(".rlnb-dashboard").first.scroll_into_view_if_needed()
        page.screenshot(path=str(SCREENSHOTS / "truth-closed.png"))


FACE = [
    """import rlnb

config = rlnb.Config(
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
    data=rlnb.DataConfig(num_workers=0),
)
sess = rlnb.Session(config, name="face")
sess.rollouts.set_reward(lambda completion, answer: 0.0)  # every group alike: findings with long fixes
sess.dashboard()""",
    "sess.train(12, progress=False)",
    "sess.close()",
]


def click_once_on(page: Page, method: str) -> None:
    """Click the dashboard's button for ``method`` the moment it is on (no pause first)."""
    button = page.locator(".rlnb-dashboard button", has_text=re.compile(rf"^\W*{method}\s*$")).first
    button.wait_for(state="visible")
    while button.is_disabled():
        page.wait_for_timeout(20)
    button.click()


def test_the_banner_wraps_a_refused_apply_goes_back_and_a_click_after_save_runs(
    tmp_path: Path, open_lab: OpenLab, open_browser: OpenBrowser
) -> None:
    """At 1280 px with the file browser open (a dashboard ~850 px wide): the findings
    banner wraps inside the dashboard, its fix readable; Apply with lr -1 is refused,
    says so and puts lr back, so the next Apply works; a resume clicked the moment
    save() has ended runs (only a click made while a call ran is refused)."""
    notebooks = tmp_path / "notebooks"
    write_notebook(notebooks / "face.ipynb", FACE)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with open_lab(notebooks) as url, open_browser(height=1000) as page:
        open_notebook(page, url, "face.ipynb")
        open_file_browser(page)
        run_cell(page, 0)
        wait_for_idle(page)
        run_cell(page, 1)
        wait_for_idle(page, timeout=120)
        assert error_outputs(page) == []
        banner = ".rlnb-dashboard .rlnb-finding-top"
        wait_for(page, "s => document.querySelector(s)?.dataset.severity === 'critical'", banner)
        board = page.locator(".rlnb-dashboard").first
        board.scroll_into_view_if_needed()
        sizes = page.evaluate(
            """s => {
                const board = document.querySelector('.rlnb-dashboard').getBoundingClientRect();
                const top = document.querySelector(s);
                const fix = top.querySelector('span').getBoundingClientRect();
                const banner = top.getBoundingClientRect();
                return {board: [board.left, board.right], banner: [banner.left, banner.right, banner.height],
                        fix: [fix.left, fix.right, fix.bottom], clipped: top.scrollWidth > top.clientWidth + 1};
            }""",
            banner,
        )
        print(f"\nbanner {sizes}")
        page.screenshot(path=str(SCREENSHOTS / "face-banner.png"))
        assert sizes["banner"][1] <= sizes["board"][1] + 1, sizes  # not wider than the dashboard
        assert sizes["fix"][1] <= sizes["board"][1] + 1 and not sizes["clipped"], sizes  # the fix is all there
        assert sizes["banner"][2] > 30, sizes  # on more than one line

        # Apply with a value the config refuses: said, and lr is back to the value in force
        settings = board.locator(".rlnb-settings").first
        settings.locator(".jupyter-widget-Collapse-header").first.click()
        lr = settings.locator(".rlnb-setting-lr input").first
        temperature = settings.locator(".rlnb-setting-temperature input").first
        lr.wait_for(state="visible")
        lr.fill("-1")
        lr.press("Tab")
        click_once_on(page, "apply")
        said = ".rlnb-dashboard .rlnb-settings-message"
        wait_for(page, "s => document.querySelector(s)?.innerText.includes('lr=-1')", said)
        assert page.locator(f"{said} .rlnb-error").count() == 1
        assert "back to the value in force: lr 0.0001" in page.locator(said).first.inner_text()
        wait_for(page, "s => document.querySelector(s)?.value === '0.0001'", ".rlnb-dashboard .rlnb-setting-lr input")
        temperature.fill("0.7")
        temperature.press("Tab")
        click_once_on(page, "apply")
        wait_for(page, "s => document.querySelector(s)?.innerText.includes('temperature 1 → 0.7')", said)
        assert page.locator(f"{said} .rlnb-error").count() == 0
        board.screenshot(path=str(SCREENSHOTS / "face-apply.png"))

        # save, then resume the moment save has ended: it runs
        message = ".rlnb-dashboard .rlnb-message"
        press(page, "pause")
        wait_for(page, "s => document.querySelector(s)?.dataset.state === 'paused'", ".rlnb-dashboard .rlnb-state-word")
        press(page, "save")
        wait_for(page, "s => document.querySelector(s)?.innerText.includes('saved to')", message)
        click_once_on(page, "resume")
        wait_for(page, "s => !document.querySelector(s)?.innerText.includes('saved to')", message)
        assert "resumed" in page.locator(message).first.inner_text(), page.locator(message).first.inner_text()
        run_cell(page, 2)
        wait_for_idle(page)
        assert error_outputs(page) == []

"""Drive notebooks in a real JupyterLab through a real Chromium.

``jupyterlab(root)`` serves ``root`` on 127.0.0.1 and ``browser()`` opens a
Playwright page on Debian's Chromium; the functions below act on that page as a
user would (menus, buttons, dialogs) and read what the user would see. Tests get
the first two through the ``open_lab`` and ``open_browser`` fixtures
(tests/conftest.py), which mark them ``netns``: they run only inside a
loopback-only network namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from tests.helpers import wait_until

if TYPE_CHECKING:
    from playwright.sync_api import Page

CHROMIUM = Path("/usr/bin/chromium")
# Headless, and nothing that phones home: the namespace has no route out anyway, but
# a browser that keeps retrying the network wastes CPU on a 2-core machine.
CHROMIUM_ARGS = (
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
# Lab's user settings for the tests: every cell stays in the DOM (no windowing), no
# blank space after the last cell (so a screenshot can fit the notebook), and no
# "would you like news?" toast covers it.
LAB_SETTINGS: Mapping[str, Mapping[str, Any]] = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none", "scrollPastEnd": False},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}
# Lab renders a traceback with the stderr MIME type too, so this finds both.
STDERR_OUTPUT = '.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]'
# The status bar's "Python 3 (ipykernel) | Idle". The toolbar's execution indicator
# also says "idle" while the notebook has no kernel yet, so it is not enough alone.
KERNEL_STATUS = '#jp-main-statusbar .jp-StatusBar-TextItem[title^="Change kernel"]'
EXECUTION_INDICATOR = ".jp-Notebook-ExecutionIndicator"
CODE_PROMPTS = ".jp-Notebook .jp-CodeCell .jp-InputPrompt"
NOTEBOOK_SCROLLER = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer"


# --- the server ---------------------------------------------------------------


@contextlib.contextmanager
def jupyterlab(root: Path, *, start_timeout: float = 90.0, stop_timeout: float = 10.0) -> Iterator[str]:
    """Serve ``root`` with JupyterLab on 127.0.0.1 and yield its base URL (ends in ``/``).

    No token, no password, no browser; its runtime, config and data directories
    and the kernels' IPython directory live in a temporary directory, never in
    $HOME. Blocks until the HTTP API answers; raises ``RuntimeError`` with the
    server's log if it exits or does not answer within ``start_timeout``. On exit
    sends SIGTERM to its process group (SIGKILL after ``stop_timeout``) and kills
    any kernel that outlived it."""
    with tempfile.TemporaryDirectory(prefix="rlnb-lab-") as tmp:
        home = Path(tmp)
        env = _lab_env(home)
        _write_settings(home / "config" / "lab" / "user-settings", LAB_SETTINGS)
        log_path = home / "lab.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterlab", *_lab_args(root)],
                cwd=root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so that one signal reaches all of it
            )
        try:
            yield _wait_until_serving(proc, home / "runtime", log_path, start_timeout)
        finally:
            _stop_group(proc, stop_timeout)


def _lab_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER_")}
    env.update(
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTER_DATA_DIR=str(home / "data"),
        JUPYTER_PLATFORM_DIRS="0",
        IPYTHONDIR=str(home / "ipython"),
        PYTHONUNBUFFERED="1",
    )
    return env


def _lab_args(root: Path) -> list[str]:
    return [
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        "--ServerApp.port=0",  # the OS picks a free port; the server writes it to its runtime file
        "--ServerApp.port_retries=0",
        "--IdentityProvider.token=",
        "--ServerApp.password=",
        "--ServerApp.disable_check_xsrf=True",
        f"--ServerApp.root_dir={root}",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.news_url=None",
        "--LabApp.extension_manager=readonly",  # no PyPI look-ups
        "--ServerApp.allow_root=True",  # CI and containers run as root
        "--ServerApp.log_level=INFO",
    ]


def _write_settings(user_settings: Path, settings: Mapping[str, Mapping[str, Any]]) -> None:
    for plugin, values in settings.items():
        path = user_settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def _wait_until_serving(proc: subprocess.Popen[bytes], runtime: Path, log: Path, timeout: float) -> str:
    info = runtime / f"jpserver-{proc.pid}.json"
    url = ""

    def serving() -> bool:
        nonlocal url
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        if info.is_file():
            with contextlib.suppress(ValueError):  # written but not complete yet
                url = str(json.loads(info.read_text())["url"])
                return _answers(url)
        return False

    wait_until(serving, lambda: f"JupyterLab to answer:\n{log.read_text(errors='replace')}", timeout, every=0.1)
    return url if url.endswith("/") else url + "/"


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/api/status", timeout=2) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _stop_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the server's group, SIGKILL after ``timeout``. Kernels run in sessions of
    their own, out of the group's reach: any that outlive the server are killed."""
    family: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        family = psutil.Process(proc.pid).children(recursive=True)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _, alive = psutil.wait_procs(family, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout)


def kernel_processes() -> list[psutil.Process]:
    """The ipykernel processes this test process started (through a JupyterLab); a
    kernel's forked children (prompt-loader workers) share its command line and are
    left out."""
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any("ipykernel" in part for part in p.cmdline()):
                found.append(p)
    pids = {p.pid for p in found}
    return [p for p in found if p.ppid() not in pids]


# --- the browser ---------------------------------------------------------------


@contextlib.contextmanager
def browser(*, width: int = 1280, height: int = 1000, timeout: float = 30.0) -> Iterator[Page]:
    """Yield a Playwright ``Page`` (sync API) in a fresh headless Debian Chromium profile.

    ``timeout`` (seconds) is the page's default for actions and waits. On exit closes
    the browser, stops Playwright and waits for its node driver to exit (killing it
    and raising ``RuntimeError`` if it does not within 10 s)."""
    from playwright.sync_api import sync_playwright

    before = {p.pid for p in psutil.Process().children()}
    with tempfile.TemporaryDirectory(prefix="rlnb-chromium-") as profile:
        playwright = sync_playwright().start()
        driver = [p for p in psutil.Process().children() if p.pid not in before]
        try:
            context = playwright.chromium.launch_persistent_context(
                profile,
                executable_path=str(CHROMIUM),
                headless=True,
                args=list(CHROMIUM_ARGS),
                viewport={"width": width, "height": height},
                env={k: v for k, v in os.environ.items() if k != "DISPLAY"},
            )
            try:
                context.set_default_timeout(timeout * 1000)
                page = context.pages[0] if context.pages else context.new_page()
                yield page
            finally:
                context.close()
        finally:
            playwright.stop()
            _, alive = psutil.wait_procs(driver, timeout=10)
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            if alive:
                raise RuntimeError(f"Playwright's driver outlived playwright.stop(): {alive}")


# --- the notebook --------------------------------------------------------------


def write_notebook(path: Path, sources: list[str]) -> None:
    """Write a python3 notebook of code cells with ``sources`` to ``path`` (its directory made)."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


# --- acting on the page -----------------------------------------------------------


def open_notebook(page: Page, base_url: str, path: str, *, timeout: float = 60.0) -> None:
    """Open ``path`` (relative to the server's root) in Lab and wait until its kernel is idle."""
    page.goto(f"{base_url}lab/tree/{path}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=timeout * 1000)
    wait_for_idle(page, timeout=timeout)


def menu(page: Page, top: str, item: str) -> None:
    """Click ``top`` in the menu bar, then the entry that starts with ``item``."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(rf"^{re.escape(top)}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(rf"^{re.escape(item)}")).first.click()


def run_all_cells(page: Page, *, timeout: float = 120.0) -> None:
    """Run > Run All Cells, then wait until the run is over and the kernel is idle.

    Lab shows "[*]:" on every cell it queues and a number once the cell has run; a
    cell's number alone does not say which run it is from (a restart starts counting
    at 1 again), so this watches for the stars. A run that stops at an error ends
    too: read the outputs (:func:`error_outputs`) to tell."""
    page.evaluate(
        """prompts => {
            window.__rlnbQueued?.observer.disconnect();
            const queued = new Set();
            const observer = new MutationObserver(records => {
                for (const r of records) {
                    const prompt = r.target.closest?.(prompts.split(' ').pop());
                    // replaced text nodes keep what they said, so no "[*]:" is missed
                    if (prompt && [...r.addedNodes].some(n => n.textContent.includes('*'))) queued.add(prompt);
                }
            });
            observer.observe(document.querySelector('.jp-Notebook'), {childList: true, subtree: true});
            window.__rlnbQueued = {observer, queued};
        }""",
        CODE_PROMPTS,
    )
    menu(page, "Run", "Run All Cells")
    try:
        page.wait_for_function(
            """prompts => {
                const all = [...document.querySelectorAll(prompts)];
                const queued = window.__rlnbQueued.queued;
                return all.every(p => queued.has(p)) && !all.some(p => p.textContent.includes('*'));
            }""",
            arg=CODE_PROMPTS,
            timeout=timeout * 1000,
        )
    finally:
        page.evaluate("() => { window.__rlnbQueued?.observer.disconnect(); delete window.__rlnbQueued; }")
    wait_for_idle(page, timeout=timeout)


def run_cell(page: Page, index: int) -> None:
    """Run the notebook's ``index``-th code cell (Shift+Enter in it) and return at once."""
    cell = page.locator(".jp-Notebook .jp-CodeCell").nth(index)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")


def open_file_browser(page: Page) -> None:
    """Show the file browser in the left sidebar, as Lab starts for a new user."""
    if not page.locator("#filebrowser").is_visible():
        page.locator('.jp-SideBar [data-id="filebrowser"]').click()
    page.locator("#filebrowser").wait_for(state="visible")


def wait_for_idle(page: Page, *, timeout: float = 60.0) -> None:
    """Wait until the notebook has a kernel, connected and idle, and no cell is queued."""
    page.wait_for_function(
        """([status, indicator, prompts]) => {
            const text = document.querySelector(status)?.textContent ?? '';
            if (text.startsWith('No Kernel') || !text.endsWith('| Idle')) return false;
            if (document.querySelector(indicator)?.getAttribute('data-status') !== 'idle') return false;
            return ![...document.querySelectorAll(prompts)].some(p => p.textContent.includes('*'));
        }""",
        arg=[KERNEL_STATUS, EXECUTION_INDICATOR, CODE_PROMPTS],
        timeout=timeout * 1000,
    )


def kernel_status(page: Page) -> str:
    """What Lab's status bar says of the kernel, e.g. "Python 3 (ipykernel) | Idle"."""
    return str(page.locator(KERNEL_STATUS).first.text_content() or "")


def cell_outputs(page: Page) -> list[str]:
    """The text of each code cell's outputs, in order, without the "[n]:" prompts
    (empty for a cell without output)."""
    texts: list[str] = page.eval_on_selector_all(
        ".jp-Notebook .jp-CodeCell",
        """cells => cells.map(cell => {
            const area = cell.querySelector('.jp-OutputArea');
            if (!area) return '';
            const outputs = area.querySelectorAll(':scope > .jp-OutputArea-child > .jp-OutputArea-output');
            return [...outputs].map(o => o.innerText).join('');
        })""",
    )
    return texts


def execution_counts(page: Page) -> list[int | None]:
    """Each code cell's execution count as its prompt shows it (None for "[ ]:" or "[*]:")."""
    prompts: list[str] = page.eval_on_selector_all(CODE_PROMPTS, "nodes => nodes.map(n => n.textContent)")
    return [int(m[1]) if (m := re.fullmatch(r"\[(\d+)\]:", p.strip())) else None for p in prompts]


def error_outputs(page: Page) -> list[str]:
    """The text of every stderr box on the page, tracebacks included."""
    found: list[str] = page.eval_on_selector_all(STDERR_OUTPUT, "nodes => nodes.map(n => n.innerText)")
    return found


def click_button(page: Page, text: str) -> None:
    """Click the (one) visible button whose label is exactly ``text``, e.g. a widget's."""
    page.get_by_role("button", name=text, exact=True).click()


def restart_kernel(page: Page, *, timeout: float = 60.0) -> None:
    """Kernel > Restart Kernel…, confirm the dialog, and wait until the new kernel is idle."""
    menu(page, "Kernel", "Restart Kernel…")
    dialog = page.locator(".jp-Dialog")
    # The server answers the restart request once the new kernel is up; until then
    # the page may still show the old kernel as idle.
    with page.expect_response(
        lambda r: r.request.method == "POST" and r.url.split("?")[0].endswith("/restart"), timeout=timeout * 1000
    ) as response:
        dialog.locator(".jp-Dialog-button.jp-mod-accept").click()
    if not response.value.ok:
        raise RuntimeError(f"restart failed: {response.value.status} {response.value.status_text}")
    dialog.wait_for(state="detached")
    wait_for_idle(page, timeout=timeout)


def screenshot(page: Page, directory: Path, name: str, *, whole_notebook: bool = True) -> Path:
    """Save a PNG of what the browser shows as ``directory/name`` and return its path.

    Lab scrolls inside the notebook panel, not the page, so ``whole_notebook`` makes
    the window tall enough for the whole notebook for the shot (then restores it)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    size = page.viewport_size
    hidden, shown = 0, 0
    if whole_notebook and size is not None:
        hidden, shown = page.evaluate(
            """scroller => {
                const el = document.querySelector(scroller);
                return el ? [Math.max(0, el.scrollHeight - el.clientHeight), el.clientHeight] : [0, 0];
            }""",
            NOTEBOOK_SCROLLER,
        )
    if hidden and size is not None:
        page.set_viewport_size({"width": size["width"], "height": size["height"] + hidden})
        # the panel lays out again on resize: wait until it has grown by as much
        page.wait_for_function(
            "([scroller, height]) => document.querySelector(scroller)?.clientHeight >= height",
            arg=[NOTEBOOK_SCROLLER, shown + hidden],
        )
    try:
        page.screenshot(path=str(path))
    finally:
        if hidden and size is not None:
            page.set_viewport_size(size)
    return path

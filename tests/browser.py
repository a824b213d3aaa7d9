"""Drive the shipped notebooks in a real JupyterLab through a real Chromium.

``jupyterlab(root)`` serves ``root`` on 127.0.0.1 and ``browser()`` opens a
Playwright page on Debian's Chromium; the functions below act on that page as a
user would (menus, buttons, dialogs) and read what the user would see. Start
both only inside a loopback-only network namespace (tests marked ``netns``).
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
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil

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
# Lab's user settings for the tests: every cell stays in the DOM (no windowing), and
# no "would you like news?" toast covers the notebook.
LAB_SETTINGS: Mapping[str, Mapping[str, Any]] = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}
STDERR_OUTPUT = '.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]'
ERROR_OUTPUT = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'
KERNEL_STATUS = ".jp-Notebook-ExecutionIndicator"


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
        JUPYTER_NO_CONFIG="1",  # ignore the user's and the system's jupyter_*_config files
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
    deadline = time.monotonic() + timeout
    info = runtime / f"jpserver-{proc.pid}.json"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        if info.is_file():
            with contextlib.suppress(ValueError):  # written but not complete yet
                url = str(json.loads(info.read_text())["url"])
                if _answers(url):
                    return url if url.endswith("/") else url + "/"
        time.sleep(0.1)
    raise RuntimeError(f"JupyterLab did not answer within {timeout} s:\n{log.read_text(errors='replace')}")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/api/status", timeout=2) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _stop_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the server's group, SIGKILL after ``timeout``; kernels run in sessions of
    their own, so any that outlived the server are killed by name."""
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
    """The ipykernel processes this test process started (through a JupyterLab)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any("ipykernel" in part for part in p.cmdline()):
                found.append(p)
    return found


# --- the browser ---------------------------------------------------------------


@contextlib.contextmanager
def browser(*, width: int = 1280, height: int = 1000, timeout: float = 30.0) -> Iterator[Any]:
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


# --- acting on the page -----------------------------------------------------------


def open_notebook(page: Any, base_url: str, path: str, *, timeout: float = 60.0) -> None:
    """Open ``path`` (relative to the server's root) in Lab and wait until its kernel is idle."""
    page.goto(f"{base_url}lab/tree/{path}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=timeout * 1000)
    wait_for_idle(page, timeout=timeout)


def menu(page: Any, top: str, item: str) -> None:
    """Click ``top`` in the menu bar, then the entry that starts with ``item``."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(rf"^{re.escape(top)}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(rf"^{re.escape(item)}")).first.click()


def run_all_cells(page: Any, *, timeout: float = 120.0) -> None:
    """Run > Run All Cells, then wait until every code cell has run and the kernel is idle."""
    menu(page, "Run", "Run All Cells")
    page.wait_for_function(
        """() => {
            const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')];
            return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
        }""",
        timeout=timeout * 1000,
    )
    wait_for_idle(page, timeout=timeout)


def wait_for_idle(page: Any, *, timeout: float = 60.0) -> None:
    """Wait until the notebook's kernel is connected and idle with no cell queued."""
    page.wait_for_function(
        f"""() => {{
            const status = document.querySelector('{KERNEL_STATUS}');
            if (!status || status.getAttribute('data-status') !== 'idle') return false;
            const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')];
            return !prompts.some(p => p.textContent.includes('*'));
        }}""",
        timeout=timeout * 1000,
    )


def kernel_status(page: Any) -> str | None:
    """What Lab's toolbar says of the kernel: "idle", "busy", "restarting", ... or None."""
    status = page.locator(KERNEL_STATUS)
    return None if status.count() == 0 else status.first.get_attribute("data-status")


def cell_outputs(page: Any) -> list[str]:
    """The text of each code cell's output area, in order (empty for a cell without output)."""
    texts: list[str] = page.eval_on_selector_all(
        ".jp-Notebook .jp-CodeCell",
        "cells => cells.map(c => { const o = c.querySelector('.jp-OutputArea'); return o ? o.innerText : ''; })",
    )
    return texts


def error_outputs(page: Any) -> list[str]:
    """The text of every error (traceback) and stderr box on the page."""
    found: list[str] = page.eval_on_selector_all(
        f"{STDERR_OUTPUT}, .jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error'], "
        ".jp-RenderedText[data-mime-type='application/vnd.jupyter.error']",
        "nodes => nodes.map(n => n.innerText)",
    )
    return found


def click_button(page: Any, text: str) -> None:
    """Click the (one) visible button whose label is exactly ``text``, e.g. a widget's."""
    page.get_by_role("button", name=text, exact=True).click()


def restart_kernel(page: Any, *, timeout: float = 60.0) -> None:
    """Kernel > Restart Kernel…, confirm the dialog, and wait until the new kernel is idle."""
    menu(page, "Kernel", "Restart Kernel…")
    dialog = page.locator(".jp-Dialog")
    dialog.locator(".jp-Dialog-button.jp-mod-accept").click()
    dialog.wait_for(state="detached")
    wait_for_idle(page, timeout=timeout)


def screenshot(page: Any, directory: Path, name: str) -> Path:
    """Save a full-page PNG of what the browser shows as ``directory/name`` and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    page.screenshot(path=str(path), full_page=True)
    return path

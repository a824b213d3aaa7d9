"""Suite-wide fixtures: every test must leave nothing behind."""

from __future__ import annotations

import inspect
import signal
from collections.abc import Iterator

import psutil
import pytest

import rlnb
from rlnb.testing import no_leaks

# scripts/test.sh runs the suite in a network namespace where only loopback exists.
LOOPBACK_ONLY = set(psutil.net_if_addrs()) <= {"lo"}


def pytest_configure(config: pytest.Config) -> None:
    # Many tests press Ctrl-C as the notebook's stop button does. A shell starts a
    # background job (`cmd &`) with SIGINT ignored, and Python then never installs
    # its handler: give the suite the handler every interactive Python has.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# The tiers, marked from what a test touches (so a new heavy test cannot land in the fast
# one by accident): "system" starts a kernel, a browser, vLLM, Ray or needs a GPU (marked
# netns, ray or gpu); "integration" starts other processes (CLI runs, scripts, lint and
# types, loader workers killed or signalled) or is marked slow; "unit" is everything
# else, run by `scripts/test.sh --fast`.
INTEGRATION_MODULES = {"test_cli.py", "test_lint.py", "test_soak.py", "test_scripts.py"}
STARTS_A_PROCESS = ("subprocess.", "sys.executable", "os.fork", "os.kill(", "pthread_kill")


def tier(item: pytest.Item) -> str:
    if {"netns", "ray", "gpu"} & set(item.keywords):
        return "system"
    if "slow" in item.keywords or item.path.name in INTEGRATION_MODULES:
        return "integration"
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        source = ""
    return "integration" if any(call in source for call in STARTS_A_PROCESS) else "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, tier(item)))
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

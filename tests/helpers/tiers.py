"""The test tiers, marked from what a test touches, so that a heavy test cannot land
in the fast tier by accident (tests/conftest.py marks every collected test):

- ``system``: a Jupyter kernel, a notebook, JupyterLab and a browser, vLLM, Ray or a
  GPU: a fixture in ``FIXTURES`` that says so, or the marker ``netns``, ``ray`` or ``gpu``;
- ``integration``: other processes (Python scripts, the CLI, loader workers, an
  offline wandb run), or marked ``slow``;
- ``unit``: the rest, which plain ``pytest`` and ``scripts/test.sh --fast`` run.

Plain ``pytest`` (no paths, no ``-m``) runs the unit tier (:func:`default_markexpr`);
``pytest tests`` runs every tier, and ``scripts/test.sh`` does, in two passes.

A test gets a process through a fixture, which marks it; a test that starts one in
its own body is caught by ``STARTS_A_PROCESS`` (a look at its source), the safety net.

:func:`heaviest_first` orders the modules for pytest-xdist: a module that holds a
system test goes out to a worker before those that hold only integration or unit
tests, so that no kernel or engine test starts while the other worker has run dry.
Before them all go the modules that run the shipped notebooks (``FIRST``): the
longest work (~4.5 minutes in one module, training models on a core), beside which
the other worker's kernel, browser and engine tests, which mostly wait, fill the
second core. Handed out in path order instead, both workers started on waiting
tests (the cores ~65 % busy for three minutes) and the notebooks came in the middle.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

# The fixtures of tests/conftest.py that start something: the tier of a test that uses
# one (directly or through another fixture), and the markers it gets with it ("netns":
# it listens on loopback; "ray": scripts/test.sh runs it in the Ray tests' own pass).
FIXTURES: dict[str, tuple[str, tuple[str, ...]]] = {
    "open_kernel": ("system", ("netns",)),
    "execute_notebook": ("system", ("netns",)),
    "open_lab": ("system", ("netns",)),
    "open_browser": ("system", ("netns",)),
    "vllm": ("system", ("netns",)),
    "ray_head_node": ("system", ("netns", "ray")),
    "start_python": ("integration", ()),
    "run_cli": ("integration", ()),
    "loader_workers": ("integration", ()),
    "wandb_offline": ("integration", ()),
}
SYSTEM_MARKERS = frozenset({"netns", "ray", "gpu"})
INTEGRATION_MARKERS = frozenset({"slow"})
# What a test's own source says when it starts a process without a fixture.
STARTS_A_PROCESS = ("subprocess.", "sys.executable", "os.fork", "os.kill(", "pthread_kill")


TIERS = ("system", "integration", "unit")  # heaviest first
# A module with a test that uses one of these fixtures goes out before every other.
FIRST = frozenset({"execute_notebook"})


class Item(Protocol):
    """What the tiers read of a collected test (a ``pytest.Item`` has all of it)."""

    @property
    def keywords(self) -> Iterable[str]: ...


T = TypeVar("T")


def implied_markers(item: Item) -> set[str]:
    """The markers that the fixtures ``item`` uses give it."""
    return {marker for name in _fixtures(item) if name in FIXTURES for marker in FIXTURES[name][1]}


def tier(item: Item) -> str:
    """``"system"``, ``"integration"`` or ``"unit"`` for ``item``; see the module docstring."""
    touched = {FIXTURES[name][0] for name in _fixtures(item) if name in FIXTURES}
    markers = set(item.keywords) | implied_markers(item)
    if "system" in touched or SYSTEM_MARKERS & markers:
        return "system"
    if "integration" in touched or INTEGRATION_MARKERS & markers or _starts_a_process(item):
        return "integration"
    return "unit"


def default_markexpr(markexpr: str, *, tests_named: bool) -> str:
    """The ``-m`` expression a run selects with, given the one it was given (``""``
    for none) and whether it named its tests (paths or node ids): a run with neither
    runs the unit tier, the loop to run after every change; a run that names its
    tests (``pytest tests``, a module) or its markers (``-m system``; scripts/test.sh
    passes ``-m "not ray"``, then ``-m ray``) runs what it names."""
    if markexpr or tests_named:
        return markexpr
    return "unit"


def goes_first(item: Item) -> bool:
    """Whether ``item``'s module goes out before every other (it uses a ``FIRST`` fixture)."""
    return not FIRST.isdisjoint(_fixtures(item))


def heaviest_first(
    items: Sequence[T], tiers: Sequence[str], modules: Sequence[str], first: Sequence[bool] | None = None
) -> list[T]:
    """``items`` (each with its tier and its module; ``first``: whether it goes first,
    see :func:`goes_first`) with whole modules moved: those with a test that goes first,
    then those with a system test, then those with an integration test, then the rest.
    Modules, and tests within a module, otherwise keep their order. With ``--dist
    loadfile`` a worker takes a module at a time in this order: the longest work goes
    out first, and the short unit modules fill the end."""
    rank: dict[str, int] = {}
    for tier_name, module in zip(tiers, modules, strict=True):
        rank[module] = min(rank.get(module, len(TIERS)), TIERS.index(tier_name))
    for module, ahead in zip(modules, first or [False] * len(modules), strict=True):
        if ahead:
            rank[module] = -1
    first_seen = {module: i for i, module in reversed(list(enumerate(modules)))}
    order = sorted(range(len(items)), key=lambda i: (rank[modules[i]], first_seen[modules[i]], i))
    return [items[i] for i in order]


def _fixtures(item: Item) -> list[str]:
    # pytest lists every fixture a test needs, those its fixtures need included
    return list(getattr(item, "fixturenames", ()))


def _starts_a_process(item: Item) -> bool:
    function = getattr(item, "function", None)
    return function is not None and _source_starts_a_process(function)


@functools.cache  # a parametrized test's items share one function: read its source once
def _source_starts_a_process(function: Callable[..., object]) -> bool:
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return any(call in source for call in STARTS_A_PROCESS)

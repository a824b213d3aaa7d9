"""The tiers come from what a test touches (tests/helpers/tiers.py): its fixtures first,
then its markers, then a look at its source for a process it starts itself."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.tiers import FIXTURES, default_markexpr, goes_first, heaviest_first, implied_markers, tier


@dataclass
class Item:
    """What the tiers read of a collected test."""

    fixturenames: list[str] = field(default_factory=list)
    keywords: set[str] = field(default_factory=set)
    function: Callable[..., Any] | None = None


def plain() -> None:
    assert sum([1, 2]) == 3


def starts_a_script() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.parametrize("name", sorted(n for n, (t, _) in FIXTURES.items() if t == "system"))
def test_a_fixture_that_starts_a_kernel_browser_engine_or_cluster_makes_a_system_test(name: str) -> None:
    item = Item(fixturenames=["tmp_path", name], function=plain)
    assert tier(item) == "system"
    assert "netns" in implied_markers(item)  # it listens on loopback: only inside scripts/test.sh's namespace


@pytest.mark.parametrize("name", sorted(n for n, (t, _) in FIXTURES.items() if t == "integration"))
def test_a_fixture_that_starts_a_process_makes_an_integration_test(name: str) -> None:
    assert tier(Item(fixturenames=[name], function=plain)) == "integration"


def test_the_ray_head_node_puts_a_test_in_the_ray_pass() -> None:
    assert implied_markers(Item(fixturenames=["ray_head_node"])) == {"netns", "ray"}


@pytest.mark.parametrize(
    ("keywords", "expected"),
    [({"netns"}, "system"), ({"ray"}, "system"), ({"gpu"}, "system"), ({"slow"}, "integration"), (set(), "unit")],
)
def test_markers_still_decide_without_a_fixture(keywords: set[str], expected: str) -> None:
    assert tier(Item(keywords=keywords, function=plain)) == expected


def test_a_fixture_outranks_the_markers() -> None:
    assert tier(Item(fixturenames=["open_kernel"], keywords={"slow"}, function=plain)) == "system"


def test_a_test_that_starts_a_process_itself_is_caught_by_its_source() -> None:
    assert tier(Item(function=starts_a_script)) == "integration"
    assert tier(Item(function=plain)) == "unit"


def test_every_collected_test_has_one_tier_and_the_markers_its_fixtures_imply(request: pytest.FixtureRequest) -> None:
    """The hook in tests/conftest.py marked this session's tests as the tiers say."""
    for item in request.session.items:
        tiers = [t for t in ("unit", "integration", "system") if item.get_closest_marker(t) is not None]
        assert tiers == [tier(item)], item.nodeid
        assert all(item.get_closest_marker(m) is not None for m in implied_markers(item)), item.nodeid


def test_modules_with_system_tests_go_out_first_and_keep_their_order_inside() -> None:
    # (test, tier, module) in collection order
    collected = [
        ("u1", "unit", "a.py"),
        ("s1", "unit", "b.py"),
        ("s2", "system", "b.py"),
        ("i1", "integration", "c.py"),
        ("u2", "unit", "d.py"),
        ("s3", "system", "e.py"),
        ("s4", "integration", "e.py"),
    ]
    names, tiers, modules = zip(*collected, strict=True)
    assert heaviest_first(names, tiers, modules) == ["s1", "s2", "s3", "s4", "i1", "u1", "u2"]
    # a module that runs the notebooks goes before every other
    first = [name == "s3" for name in names]
    assert heaviest_first(names, tiers, modules, first) == ["s3", "s4", "s1", "s2", "i1", "u1", "u2"]
    assert goes_first(Item(fixturenames=["tmp_path", "execute_notebook"]))
    assert not goes_first(Item(fixturenames=["tmp_path", "open_kernel"]))


def test_the_suite_hands_out_its_heaviest_modules_first(request: pytest.FixtureRequest) -> None:
    """conftest.py orders what pytest collected: no module of unit tests precedes one
    that holds a system test."""
    items = request.session.items
    ranks = [
        min(
            ("system", "integration", "unit").index(m.name)
            for m in i.iter_markers()
            if m.name in ("system", "integration", "unit")
        )
        for i in items
    ]
    modules = [i.nodeid.split("::", 1)[0] for i in items]
    module_rank: dict[str, int] = {}
    for rank, module in zip(ranks, modules, strict=True):
        module_rank[module] = min(module_rank.get(module, 2), rank)
    seen = list(dict.fromkeys(modules))
    assert [module_rank[m] for m in seen] == sorted(module_rank[m] for m in seen)


@pytest.mark.parametrize(
    ("markexpr", "named", "expected"),
    [("", False, "unit"), ("", True, ""), ("system", False, "system"), ("not ray", True, "not ray")],
)
def test_plain_pytest_runs_the_unit_tier_and_a_run_that_names_its_tests_or_markers_runs_those(
    markexpr: str, named: bool, expected: str
) -> None:
    assert default_markexpr(markexpr, tests_named=named) == expected


def test_plain_pytest_and_the_fast_script_collect_the_unit_tier_and_the_script_every_tier(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """What each way of running the suite collects, run as a user runs it from the
    repository's root: plain ``pytest``, ``scripts/test.sh --fast``, ``scripts/test.sh``
    (its two passes together) and ``pytest tests``."""
    root = Path(__file__).parents[1]
    # scripts/test.sh makes Ray's token for the second pass where there is none: one is there
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("unused")
    env = {**os.environ, "HOME": str(tmp_path), "RLNB_TEST_WORKERS": "0"}

    def collected(*command: str) -> set[str]:
        run = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=120)
        # a module that fails to import fails its own tests (1), not this one
        assert run.returncode in (0, 1), run.stdout[-2000:] + run.stderr[-2000:]
        return {line for line in run.stdout.splitlines() if "::" in line}

    python, collect = sys.executable, ("--collect-only", "-q", "--continue-on-collection-errors")
    plain = collected(python, "-m", "pytest", *collect)
    every = collected(python, "-m", "pytest", "tests", *collect)
    assert collected("scripts/test.sh", "--fast", *collect) == plain
    assert collected("scripts/test.sh", *collect) == every
    assert plain < every
    assert request.node.nodeid in every - plain  # it starts processes: the integration tier
    assert "tests/test_tiers.py::test_a_fixture_outranks_the_markers" in plain

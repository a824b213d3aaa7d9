"""The documentation stays tied to what it describes: the thresholds table of
docs/experiment.md to ``rlnb.session._diagnose``'s constants, and the site's nav
(mkdocs.yml) to every notebook and every guide in docs/. ``mkdocs build --strict``
(scripts/lint.sh) checks links and references; these check what it cannot."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from rlnb.session import _diagnose

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXPERIMENT = DOCS / "experiment.md"

# `NAME` = 0.05, `NAME` = 5 %, `NAME` = 1e-4, `NAME` = 1 s
MENTION = re.compile(r"`([A-Z][A-Z0-9_]+)` = ([0-9.]+(?:e-?[0-9]+)?)( ?%)?")


def thresholds_table() -> str:
    """The rows of the "Why is nothing learning?" table."""
    text = EXPERIMENT.read_text()
    start = text.index("| code | severity |")
    end = text.index("\n\n", start)
    return text[start:end]


def documented_thresholds(table: str) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for name, number, percent in MENTION.findall(table):
        value = float(number) / (100 if percent else 1)
        found.setdefault(name, []).append(value)
    return found


def diagnose_constants() -> dict[str, float]:
    """The module's numeric constants: its thresholds."""
    return {
        name: value
        for name, value in vars(_diagnose).items()
        if name.isupper() and isinstance(value, int | float) and not isinstance(value, bool)
    }


def test_every_threshold_of_diagnose_is_in_the_table_with_its_value() -> None:
    documented = documented_thresholds(thresholds_table())
    constants = diagnose_constants()
    assert constants, "rlnb.session._diagnose has no thresholds: has the table's source moved?"
    missing = sorted(set(constants) - set(documented))
    assert not missing, f"docs/experiment.md's diagnose table does not name {missing}: add each with its value"
    wrong = {
        name: (values, constants[name])
        for name, values in documented.items()
        if name in constants and not all(math.isclose(v, constants[name], rel_tol=1e-9) for v in values)
    }
    assert not wrong, f"docs/experiment.md gives other values than rlnb.session._diagnose (table, code): {wrong}"


def test_the_table_names_no_constant_that_diagnose_lacks() -> None:
    unknown = sorted(set(documented_thresholds(thresholds_table())) - set(diagnose_constants()))
    assert not unknown, f"docs/experiment.md's diagnose table names {unknown}, which rlnb.session._diagnose lacks"


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ("| x | `FAILED_SHARE` = 6 % |", "other values"),
        ("| x | `NO_SUCH_THRESHOLD` = 1 |", "lacks"),
    ],
)
def test_a_wrong_row_is_caught(table: str, problem: str) -> None:
    documented = documented_thresholds(table)
    constants = diagnose_constants()
    if problem == "lacks":
        assert set(documented) - set(constants) == {"NO_SUCH_THRESHOLD"}
    else:
        assert documented == {"FAILED_SHARE": [0.06]}
        assert not math.isclose(documented["FAILED_SHARE"][0], constants["FAILED_SHARE"])


def nav_pages() -> set[str]:
    """Every page mkdocs.yml's nav names (``- Title: path`` or ``- path``)."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:") :]
    return set(re.findall(r"^\s*-\s+(?:[^:\n]+:\s+)?(\S+\.(?:md|ipynb))\s*$", nav, flags=re.MULTILINE))


def test_every_notebook_is_a_page_of_the_site() -> None:
    notebooks = {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert len(notebooks) >= 10
    missing = sorted(notebooks - nav_pages())
    assert not missing, f"mkdocs.yml's nav lacks the notebooks {missing}"


def test_every_guide_is_a_page_of_the_site() -> None:
    guides = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if not p.relative_to(DOCS).parts[0].startswith("_")}
    missing = sorted(guides - nav_pages())
    assert not missing, f"mkdocs.yml's nav lacks {missing}: add each guide to the nav"
    for guide in ("architecture.md", "bad-input.md", "envs.md", "experiment.md", "processes.md", "vllm.md"):
        assert guide in guides


def test_the_readme_shows_python_early_and_every_notebook() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    first_python = next(i for i, line in enumerate(lines, 1) if line.startswith(("import ", "from ")))
    assert first_python <= 40, f"the README's first line of Python is line {first_python}: keep it within 40"
    readme = "\n".join(lines)
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f"`{notebook.stem}`" in readme, f"the README's notebook table lacks {notebook.stem}"


def test_the_architecture_lists_every_module_and_no_other() -> None:
    text = (DOCS / "architecture.md").read_text()
    listed = set(re.findall(r"^\| `(rlnb/[\w/]+\.py)` \|", text[text.index("## 7. Every module") :], re.MULTILINE))
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "rlnb").rglob("*.py") if "__pycache__" not in p.parts}
    assert not on_disk - listed, f"docs/architecture.md section 7 lacks {sorted(on_disk - listed)}: add a line each"
    assert not listed - on_disk, f"docs/architecture.md section 7 lists {sorted(listed - on_disk)}, which are gone"

"""``benchmarks/vs_trl.py race`` and ``study``: each variant is the same algorithm on
both sides, and the study's figures say median and range over seeds. The race
itself needs TRL, which is not a dependency: it is run by hand (docs/race.md)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def _fonts() -> None:
    """Matplotlib keeps the font files it first renders open for the process's life:
    open them before a test's leak check starts counting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    fig.text(0.5, 0.5, "0.5")
    fig.canvas.draw()
    plt.close(fig)


@pytest.fixture
def study(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("race_study")


@pytest.mark.parametrize("std", ["bessel", "population"])
def test_each_variant_is_the_algorithm_the_loss_check_compares(study: ModuleType, std: str) -> None:
    from rlnb.algorithms import preset

    variants = study.vs_trl.VARIANTS
    loss_check = importlib.import_module("vs_trl_loss")
    pairs = {v.name: v for v in loss_check.VARIANTS}
    grpo = preset("grpo").replace(std=std)
    algorithms = {name: preset(p).replace(std=std, **fields) for name, (_, (p, fields)) in variants.items()}
    assert algorithms["grpo"] == grpo
    assert algorithms["dapo_clip_higher"] == grpo.replace(clip_high=0.28)
    assert variants["dapo_clip_higher"][0] == {"epsilon_high": 0.28}
    # GSPO: TRL's fields and rlnb's algorithm are the pair the one-batch check found equal
    assert variants["gspo"][0] == pairs["gspo"].trl
    assert algorithms["gspo"].replace(std="bessel") == loss_check.algorithm_of(pairs["gspo"])


def test_spread_counts_a_seed_that_never_reached_as_the_largest(study: ModuleType) -> None:
    assert study._spread([1200, 900, 1500]) == {"per_seed": [1200, 900, 1500], "median": 1200, "min": 900, "max": 1500}
    assert study._spread([1200, None, 900]) == {"per_seed": [1200, None, 900], "median": 1200, "min": 900, "max": None}
    assert study._spread([None, None, 900])["median"] is None


@pytest.mark.usefixtures("_fonts")
def test_report_writes_the_table_from_the_finished_runs(study: ModuleType, tmp_path: Path) -> None:
    def curve(reached: list[float]) -> dict[str, object]:
        points = [[100 * i, a, 10.0 * i] for i, a in enumerate(reached)]
        return {"curve": points, "tokens": 1000, "seconds": 20.0, "steps": 200, "reward": [0.5] * 200}

    curves = ([0.2, 0.6, 0.9], [0.2, 0.5, 0.7], [0.1, 0.4, 0.75])  # TRL seed 0, rlnb seed 0, TRL seed 1
    for (group, seed), accuracy in zip(study.ORDER[:3], curves, strict=True):
        folder = study._dir(tmp_path, group, seed)
        folder.mkdir(parents=True)
        (folder / "curve.json").write_text(json.dumps(curve(accuracy)))
    (tmp_path / "recipe.json").write_text(json.dumps({"steps": 200}))

    assert study.report(tmp_path) == 0
    figures = json.loads((tmp_path / "study.json").read_text())["groups"]
    trl = figures["TRL grpo"]
    assert trl["seeds"] == [0, 1]
    assert trl["step_to_0.8"] == {"per_seed": [200, None], "median": None, "min": 200, "max": None}
    assert trl["step_to_0.5"]["median"] == 150
    row = "| TRL grpo | 0, 1 | 150 (100-200; 100 / 200) | 200 (200-200; 200 / 200) | never (200-never; 200 / never) |"
    assert row in (tmp_path / "study.md").read_text()
    assert (tmp_path / "study.png").stat().st_size > 0

"""rlnb's side of ``benchmarks/vs_trl.py loss`` (``benchmarks/vs_trl_loss.py``): the
batch is what the comparison needs, and rlnb's loss there is the formula's. TRL's
side needs TRL, which is not a dependency: it is run by hand (docs/algorithms.md)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("vs_trl_loss")


@pytest.fixture
def batch_dir(harness: ModuleType, tmp_path: Path) -> Path:
    torch.manual_seed(0)
    harness.make_batch(tmp_path)
    return tmp_path


def _load(folder: Path) -> tuple[dict, torch.Tensor]:
    from safetensors.torch import load_file

    return json.loads((folder / "batch.json").read_text()), load_file(folder / "batch.safetensors")["behav_logp"]


def test_every_variant_is_an_rlnb_algorithm(harness: ModuleType) -> None:
    from rlnb.algorithms import Algorithm

    names = [v.name for v in harness.VARIANTS]
    assert len(names) == len(set(names))
    for variant in harness.VARIANTS:
        assert isinstance(harness.algorithm_of(variant), Algorithm), variant.name
        # a known difference is said, in the table's notes
        assert variant.expect_equal or variant.note, variant.name


def test_the_batch_has_what_the_comparison_needs(batch_dir: Path) -> None:
    batch, behav = _load(batch_dir)
    rewards = torch.tensor(batch["rewards"]).view(-1, batch["group_size"])
    assert rewards.shape == (16, 8)
    assert rewards[0].eq(1).all() and rewards[1].eq(0).all()  # a flat group of each kind
    assert bool((rewards[2:].std(dim=1) > 0).all())  # the others carry signal
    lengths = set(batch["lengths"])
    assert min(lengths) == 1 and max(lengths) == batch["max_new"] and len(lengths) > 2  # mixed, padded
    eos = 13  # trl_baseline's <eos>
    assert any(ids[-1] != eos for ids in batch["completion_ids"])  # cut at the limit
    mask = torch.arange(behav.shape[1])[None, :] < torch.tensor(batch["lengths"])[:, None]
    assert bool((behav[~mask] == 0).all()) and bool((behav[mask] != 0).all())


def test_rlnb_side_is_dr_grpo_formula(harness: ModuleType, batch_dir: Path) -> None:
    """Dr. GRPO at a ratio other than 1: sum_i sum_t -min(r A, clip(r) A) / (N * max_new),
    A = R - mean_g, r = pi_new / pi_old, in float64 from the same log-probs."""
    batch, behav = _load(batch_dir)
    (variant,) = [v for v in harness.VARIANTS if v.name == "dr_grpo"]
    out = harness.rlnb_step(batch_dir, batch, behav, variant)
    ids, mask = harness.padded(batch["prompt_ids"], batch["completion_ids"])
    with torch.no_grad():
        old, _ = harness.token_logp(harness.load_model(batch_dir / "old"), batch["prompt_ids"], ids, mask)
        new, _ = harness.token_logp(harness.load_model(batch_dir / "new"), batch["prompt_ids"], ids, mask)
    r = torch.tensor(batch["rewards"], dtype=torch.float64).view(-1, 8)
    adv = (r - r.mean(dim=1, keepdim=True)).view(-1, 1)
    ratio = torch.exp(new.double() - old.double())
    assert float(((ratio < 0.8) | (ratio > 1.2))[mask].double().mean()) > 0.05  # the clip acts somewhere
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask
    expected = float(per_token.sum() / (len(r.view(-1)) * batch["max_new"]))
    assert out["loss"] == pytest.approx(expected, abs=1e-6)
    assert out["grad_norm"] > 0


def test_given_advantages_replace_rlnbs_and_flat_groups_drop(harness: ModuleType, batch_dir: Path) -> None:
    batch, behav = _load(batch_dir)
    (bnpo,) = [v for v in harness.VARIANTS if v.name == "bnpo"]
    own = harness.rlnb_step(batch_dir, batch, behav, bnpo)
    again = harness.rlnb_step(batch_dir, batch, behav, bnpo, given=own["tensors"]["advantages"])
    assert again["loss"] == own["loss"] and again["grad_norm"] == own["grad_norm"]
    (dapo,) = [v for v in harness.VARIANTS if v.name == "dapo"]
    dropped = harness.rlnb_step(batch_dir, batch, behav, dapo)
    assert dropped["rows"].tolist() == list(range(16, 128))  # groups 0 and 1 are flat


def test_rloo_sequence_loss_is_trls_formula(harness: ModuleType) -> None:
    """TRL's RLOOTrainer: -min(s A, clip(s) A) averaged over sequences, s = exp(sum_t (logp - old))."""
    from rlnb.algorithms import Algorithm
    from rlnb.algorithms.functional import LossInputs, policy_loss

    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.05, 0.0], [-0.2, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv = torch.tensor([1.0, -1.0])
    alg = Algorithm(advantage="rloo", loss=harness.rloo_sequence_loss)
    inputs = LossInputs(algorithm=alg, logp=logp, prox_logp=old, behav_logp=old, advantages=adv, mask=mask)
    s = torch.tensor([0.15, -0.3]).exp()
    expected = (-torch.minimum(s * adv, s.clamp(0.8, 1.2) * adv)).mean()
    assert float(policy_loss(inputs).loss.detach()) == pytest.approx(float(expected), abs=1e-6)

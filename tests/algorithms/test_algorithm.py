"""Algorithm's checks, the presets and what importing the package loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlnb._errors import ConfigError, UnknownNameError
from rlnb.algorithms import PRESETS, Algorithm, algorithms, has_signal, preset


def test_import_loads_no_torch_and_functional_loads_on_first_use() -> None:
    code = (
        "import sys, rlnb, rlnb.algorithms as a; light = 'torch' not in sys.modules; "
        "a.preset('dapo'); print(light, 'torch' in sys.modules, a.functional.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False", "rlnb.algorithms.functional"]


def test_the_default_is_rlnb_s_loss_as_it_was() -> None:
    default = Algorithm()
    assert default == preset("grpo")
    assert (default.advantage, default.std, default.loss, default.aggregation) == (
        "grpo",
        "population",
        "ppo_clip",
        "token_mean",
    )
    assert (default.clip_low, default.clip_high, default.correction, default.correction_high) == (
        0.2,
        0.2,
        "token_truncate",
        2.0,
    )
    assert (default.kl_estimator, default.kl_coef) == ("k3", 0.0)


def test_presets_are_listed_with_a_line_and_a_source() -> None:
    listed = algorithms()
    assert [name for name, _ in listed] == list(PRESETS)
    want = {"grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo"}
    assert want <= set(PRESETS)
    for name, entry in PRESETS.items():
        assert entry.name == name and entry.summary and entry.formula
        assert "arXiv:" in entry.source, name
        assert isinstance(preset(name), Algorithm)


def test_published_settings() -> None:
    dapo = preset("dapo")
    assert (dapo.clip_low, dapo.clip_high, dapo.aggregation) == (0.2, 0.28, "token_mean")
    assert dapo.dynamic_sampling and dapo.drop_flat_groups and dapo.mask_truncated
    gspo = preset("gspo")
    assert (gspo.loss, gspo.clip_low, gspo.clip_high) == ("gspo", 3e-4, 4e-4)
    assert preset("ppo").dual_clip == 3.0
    assert preset("dr_grpo").aggregation == "seq_mean_token_sum_norm"


def test_an_unknown_preset_names_the_nearest() -> None:
    with pytest.raises(UnknownNameError, match="did you mean 'gspo'"):
        preset("gpso")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"advantage": "grpoo"}, "Algorithm.advantage"),
        ({"loss": 3}, "Algorithm.loss"),
        ({"std": "sample"}, "Algorithm.std"),
        ({"clip_low": 0}, "Algorithm.clip_low"),
        ({"clip_low": 1.5}, "Algorithm.clip_low"),
        ({"clip_high": -0.1}, "Algorithm.clip_high"),
        ({"clip_high": "0.2"}, "Algorithm.clip_high"),
        ({"dual_clip": 1.0}, "Algorithm.dual_clip"),
        ({"dual_clip": 3.0, "loss": "cispo"}, "Algorithm.dual_clip"),
        ({"aggregation": "mean"}, "Algorithm.aggregation"),
        ({"correction": "token"}, "Algorithm.correction"),
        ({"correction_high": 0.9}, "Algorithm.correction_high"),
        ({"correction_low": 2.0}, "Algorithm.correction_low"),
        ({"kl_coef": -1}, "Algorithm.kl_coef"),
        ({"kl_estimator": "k4"}, "Algorithm.kl_estimator"),
        ({"kl_in": "advantage"}, "Algorithm.kl_in"),
        ({"entropy_coef": float("nan")}, "Algorithm.entropy_coef"),
        ({"mask_truncated": 1}, "Algorithm.mask_truncated"),
        ({"dynamic_sampling": True}, "Algorithm.dynamic_sampling"),
        ({"top_entropy_quantile": 0}, "Algorithm.top_entropy_quantile"),
        ({"sapo_tau_neg": 0}, "Algorithm.sapo_tau_neg"),
    ],
)
def test_a_bad_value_is_a_config_error_naming_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        Algorithm(**changes)  # type: ignore[arg-type]


def test_an_unknown_keyword_names_the_nearest_field() -> None:
    with pytest.raises(ConfigError, match="did you mean clip_high"):
        Algorithm(clip_hihg=0.28)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="did you mean clip_low"):
        preset("grpo").replace(clip_lo=0.1)


def test_has_signal() -> None:
    assert has_signal([0.0, 1.0]) and not has_signal([1.0, 1.0]) and not has_signal([3.0])

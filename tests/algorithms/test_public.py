"""What ``import rlnb`` offers of the algorithms: ``rlnb.algorithms()`` lists the
presets, ``rlnb.Algorithm`` makes one, and neither loads torch."""

from __future__ import annotations

import subprocess
import sys

import rlnb


def test_rlnb_algorithms_called_lists_every_preset_with_a_line() -> None:
    listed = rlnb.algorithms()
    assert [name for name, _ in listed] == list(rlnb.algorithms.PRESETS)
    assert all(isinstance(line, str) and line for _, line in listed)
    assert listed[0][0] == "grpo"  # the default first


def test_rlnb_algorithm_is_the_packages_and_a_config_takes_it() -> None:
    assert rlnb.Algorithm is rlnb.algorithms.Algorithm
    config = rlnb.LearnConfig(algorithm=rlnb.Algorithm(loss="cispo", clip_low=1.0, clip_high=4.0))
    assert config.resolved_algorithm.loss == "cispo"


def test_the_callable_package_loads_no_torch_and_still_finds_its_modules() -> None:
    code = (
        "import sys, rlnb; rlnb.algorithms(); assert 'torch' not in sys.modules; "
        "import rlnb.algorithms.functional as F; assert F.policy_loss"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

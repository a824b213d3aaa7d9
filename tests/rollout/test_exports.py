"""``rlnb.rollout`` exports its public names with a sorted ``__all__``; the engines and
their protocol are ``rlnb.engines``' names alone, and importing it loads no torch."""

from __future__ import annotations

import subprocess
import sys

import rlnb.engines
import rlnb.rollout


def test_all_is_sorted_and_complete() -> None:
    public = {name for name in dir(rlnb.rollout) if not name.startswith(("_", "@"))}
    assert rlnb.rollout.__all__ == sorted(rlnb.rollout.__all__)
    assert set(rlnb.rollout.__all__) == public
    for name in rlnb.rollout.__all__:
        assert getattr(rlnb.rollout, name).__name__ == name


def test_the_engine_names_are_rlnb_engines_alone() -> None:
    for name in rlnb.engines.__all__:
        assert not hasattr(rlnb.rollout, name), f"rlnb.rollout.{name}: import it from rlnb.engines"


def test_importing_the_rollout_package_loads_no_torch() -> None:
    code = "import sys, rlnb.rollout; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]

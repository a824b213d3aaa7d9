"""``rlnb.envs`` exports its public names with a sorted ``__all__``, and stays light:
no torch, so an environment module imports fast in a notebook."""

from __future__ import annotations

import subprocess
import sys

import rlnb.envs


def test_all_is_sorted_and_complete() -> None:
    public = {name for name in dir(rlnb.envs) if not name.startswith(("_", "@"))}
    assert rlnb.envs.__all__ == sorted(rlnb.envs.__all__)
    assert set(rlnb.envs.__all__) == public


def test_importing_the_environments_imports_no_heavy_library() -> None:
    code = "import sys, rlnb.envs; print(sorted(m for m in ('torch', 'ray', 'wandb', 'gymnasium') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

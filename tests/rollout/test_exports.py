"""``rlnb.rollout`` exports its public names with a sorted ``__all__``; TinyEngine
(which needs torch) is imported only when asked for."""

from __future__ import annotations

import subprocess
import sys

import rlnb.rollout


def test_all_is_sorted_and_complete() -> None:
    public = {name for name in dir(rlnb.rollout) if not name.startswith(("_", "@"))}
    assert rlnb.rollout.__all__ == sorted(rlnb.rollout.__all__)
    assert set(rlnb.rollout.__all__) == public
    for name in rlnb.rollout.__all__:
        assert getattr(rlnb.rollout, name).__name__ == name


def test_tiny_engine_is_exported_and_imports_torch_only_when_asked_for() -> None:
    code = (
        "import sys, rlnb.rollout; "
        "before = 'torch' in sys.modules; "
        "from rlnb.rollout import TinyEngine; "
        "from rlnb.engines._tiny import TinyEngine as Private; "
        "print(before, 'torch' in sys.modules, TinyEngine is Private)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True", "True"]

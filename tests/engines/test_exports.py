"""``rlnb.engines`` exports its public names with a sorted ``__all__``; the heavy
engines are imported only when asked for."""

from __future__ import annotations

import subprocess
import sys

import rlnb.engines


def test_all_is_sorted_and_complete() -> None:
    public = {name for name in dir(rlnb.engines) if not name.startswith(("_", "@"))}
    assert rlnb.engines.__all__ == sorted(rlnb.engines.__all__)
    assert set(rlnb.engines.__all__) == public
    for name in rlnb.engines.__all__:
        assert getattr(rlnb.engines, name).__name__ == name


def test_the_heavy_engines_are_imported_only_when_asked_for() -> None:
    code = (
        "import sys, rlnb.engines, rlnb.rollout; "
        "before = sorted(m for m in ('torch', 'ray', 'vllm') if m in sys.modules); "
        "from rlnb.engines import TinyEngine; "
        "print(before, 'torch' in sys.modules, 'ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "True", "False"]

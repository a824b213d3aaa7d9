from __future__ import annotations

import pkgutil
import subprocess
import sys

import rlnb

# Submodules become attributes of the package once anything imports them.
SUBMODULES = {m.name for m in pkgutil.iter_modules(rlnb.__path__)}


def test_all_is_sorted_and_complete() -> None:
    # "@py..." names come from pytest rewriting the package that provides its plugin; probe and algorithms
    # are exported on purpose (rlnb.algorithms() lists the presets)
    public = {name for name in dir(rlnb) if not name.startswith(("_", "@"))}
    assert rlnb.__all__ == sorted(rlnb.__all__)
    assert set(rlnb.__all__) == public - (SUBMODULES - {"probe", "algorithms"})


def test_import_rlnb_stays_light() -> None:
    code = (
        "import sys, rlnb; "
        "print(sorted(m for m in ('torch', 'ray', 'wandb', 'ipywidgets', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_runtime_layer_imports_no_heavy_library() -> None:
    code = (
        "import sys, rlnb.runtime, rlnb.probe, rlnb.testing; "
        "print(sorted(m for m in ('torch', 'ray', 'wandb', 'ipywidgets') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_documented_subpackages_are_reachable_from_a_fresh_import_and_stay_lazy() -> None:
    code = (
        "import sys, rlnb; light = 'torch' not in sys.modules; "
        "print(light, rlnb.learn.Callback.__name__, rlnb.models.tiny_llama.__name__, rlnb.testing.no_leaks.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "Callback", "tiny_llama", "no_leaks"]

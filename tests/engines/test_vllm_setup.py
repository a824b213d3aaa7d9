"""What ``VLLMEngine.start`` refuses before it imports vLLM or starts a process: a model
directory that is not one. The checks that need vLLM's import are in test_vllm.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

import rlnb
from rlnb.engines import VLLMEngine


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda d: d / "missing", "no such directory"),
        (lambda d: d, "has no config.json"),
        (lambda d: (d / "config.json").write_text("{oops") and d, r"cannot read its config\.json"),
        (lambda d: (d / "config.json").write_text("[1, 2]") and d, "its config.json holds list, not a JSON object"),
    ],
    ids=["missing", "no-config", "bad-json", "not-an-object"],
)
def test_a_bad_model_dir_is_a_config_error_before_any_process(
    tmp_path: Path, make: Callable[[Path], Path], match: str
) -> None:
    children = psutil.Process().children(recursive=True)
    path = make(tmp_path)
    with pytest.raises(rlnb.ConfigError, match=match) as caught:
        asyncio.run(
            VLLMEngine.start(rlnb.ModelConfig(path=str(path), max_len=64), rlnb.EngineConfig(max_batch=4), eos_id=1)
        )
    assert str(tmp_path) in str(caught.value)
    assert psutil.Process().children(recursive=True) == children

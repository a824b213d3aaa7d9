"""The endpoint serves whatever engine the session has: here a Hugging Face model on
the "hf" engine, before and after a step. The engine process and vLLM are served in
tests/learn/test_algorithm_engines.py, Ray's replicas in tests/engines/test_ray.py
(each after its own sessions' training: their engines take seconds to start)."""

from __future__ import annotations

from pathlib import Path

import pytest

import rlnb
import rlnb.models
from tests.helpers import small_config
from tests.serve.helpers import assert_serves

pytestmark = [pytest.mark.netns]


def test_a_hugging_face_model_is_served_at_the_sessions_version(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the 'hf' extra (transformers) is not installed")
    llama = rlnb.models.tiny_llama(tmp_path / "tiny-llama")
    model = rlnb.ModelConfig(path=str(llama), max_len=64)
    with rlnb.Session(small_config(model=model), name="serve-hf") as sess:
        assert_serves(sess, "12+34=")
        sess.step()
        assert_serves(sess, "12+34=")  # the new weights, version 1

"""``SamplingParams`` checks its fields with the shared config checks: a bad one is a
ConfigError naming it. (Each backend's tests exercise the Engine protocol.)"""

from __future__ import annotations

from typing import Any

import pytest

import rlnb
from rlnb.engines import SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("temperature", "1.0"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", 2.0),
        ("max_new_tokens", 0),
        ("max_new_tokens", None),
    ],
)
def test_an_invalid_field_raises_a_config_error_naming_it(field: str, value: Any) -> None:
    with pytest.raises(rlnb.ConfigError, match=rf"^SamplingParams\.{field}=") as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, ValueError)  # what it raised before the shared checks


def test_the_bounds_themselves_are_valid() -> None:
    SamplingParams(temperature=0, top_p=1, top_k=0, max_new_tokens=1)
    SamplingParams(temperature=2.5, top_p=0.01, top_k=50, max_new_tokens=10**9, ignore_eos=True)

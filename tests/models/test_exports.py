from __future__ import annotations

import pytest

import rlnb
import rlnb.models
from rlnb import ConfigError


def test_all_is_sorted_and_complete() -> None:
    public = {
        name for name in dir(rlnb.models) if not name.startswith(("_", "@"))
    }  # "@py...": pytest rewrote the plugin's package
    assert rlnb.models.__all__ == sorted(rlnb.models.__all__)
    assert set(rlnb.models.__all__) == public


def test_policy_config_was_merged_into_model_config() -> None:
    with pytest.raises(ConfigError, match=r"merged into rlnb\.ModelConfig.*TinyPolicy\(rlnb\.ModelConfig\("):
        rlnb.models.PolicyConfig  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(ConfigError, match="ModelConfig"):
        from rlnb.models import PolicyConfig  # type: ignore[attr-defined]  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'PolicyConfg'"):
        rlnb.models.PolicyConfg  # type: ignore[attr-defined]  # noqa: B018

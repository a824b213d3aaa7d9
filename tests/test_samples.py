"""Sample and Group: validation, immutability and min_version."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest

import rlnb


def test_sample_accepts_per_token_fields_of_matching_length_or_none() -> None:
    full = rlnb.Sample(prompt="p", token_ids=(1, 2, 3), logprobs=(-0.1, -0.2, -0.3), versions=(0, 0, 1))
    bare = rlnb.Sample(prompt="p", token_ids=(1, 2, 3))
    assert len(full.logprobs) == len(full.versions) == 3
    assert bare.logprobs == bare.versions == ()


@pytest.mark.parametrize("field", ["logprobs", "versions"])
@pytest.mark.parametrize("length", [1, 4])
def test_sample_rejects_a_per_token_field_of_another_length(field: str, length: int) -> None:
    with pytest.raises(ValueError, match=rf"Sample\.{field} has {length} entries but token_ids has 3"):
        rlnb.Sample(prompt="p", token_ids=(1, 2, 3), **{field: (0,) * length})


@pytest.mark.parametrize("reason", ["stop", "length", "aborted"])
def test_sample_accepts_known_finish_reasons(reason: str) -> None:
    assert rlnb.Sample(prompt="p", finish_reason=reason).finish_reason == reason


@pytest.mark.parametrize("reason", ["eos", "", "STOP"])
def test_sample_rejects_unknown_finish_reasons(reason: str) -> None:
    with pytest.raises(ValueError, match="finish_reason"):
        rlnb.Sample(prompt="p", finish_reason=reason)


def test_sample_min_version_is_its_oldest_token_version() -> None:
    assert rlnb.Sample(prompt="p", token_ids=(1, 2, 3), versions=(4, 2, 7)).min_version == 2
    assert rlnb.Sample(prompt="p", token_ids=(1, 2)).min_version is None


def test_sample_and_group_are_frozen() -> None:
    sample = rlnb.Sample(prompt="p")
    group = rlnb.Group(prompt="p", samples=(sample,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample.reward = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        group.samples = ()  # type: ignore[misc]


def test_group_stores_a_list_of_samples_as_a_tuple() -> None:
    samples = [rlnb.Sample(prompt="p"), rlnb.Sample(prompt="p", completion="b")]
    group = rlnb.Group(prompt="p", samples=samples)  # type: ignore[arg-type]
    samples.append(rlnb.Sample(prompt="p"))  # the caller's list must not reach into the group
    assert isinstance(group.samples, tuple)
    assert len(group) == 2
    assert group.prompt_id == -1


def test_group_rejects_empty_samples() -> None:
    with pytest.raises(ValueError, match="at least one Sample"):
        rlnb.Group(prompt="p", samples=())


@pytest.mark.parametrize(
    "samples",
    [
        "abc",
        rlnb.Sample(prompt="p"),
        (rlnb.Sample(prompt="p"), "not a sample"),
        (s for s in [rlnb.Sample(prompt="p")]),
    ],
    ids=["str", "bare-sample", "mixed", "generator"],
)
def test_group_rejects_samples_that_are_not_a_sequence_of_sample(samples: object) -> None:
    with pytest.raises(TypeError, match=r"Group\.samples"):
        rlnb.Group(prompt="p", samples=samples)  # type: ignore[arg-type]


def test_group_min_version_ignores_unversioned_samples() -> None:
    old = rlnb.Sample(prompt="p", token_ids=(1, 2), versions=(3, 5))
    new = rlnb.Sample(prompt="p", token_ids=(1,), versions=(6,))
    unversioned = rlnb.Sample(prompt="p", token_ids=(1,))
    assert rlnb.Group(prompt="p", samples=(new, unversioned, old)).min_version == 3
    assert rlnb.Group(prompt="p", samples=(unversioned,)).min_version is None


def test_a_group_keeps_its_prompts_token_ids_as_a_tuple_through_a_dict() -> None:
    ids = [1, 5, 7]
    group = rlnb.Group(prompt="1+", samples=(rlnb.Sample(prompt="1+", token_ids=(4,), reward=1.0),), prompt_ids=ids)  # type: ignore[arg-type]
    ids.append(9)  # the caller's list must not reach into the group
    assert group.prompt_ids == (1, 5, 7)
    assert rlnb.Group.from_dict(group.to_dict()) == group
    saved_before = {k: v for k, v in group.to_dict().items() if k != "prompt_ids"}  # as groups were saved before
    assert rlnb.Group.from_dict(saved_before).prompt_ids == ()
    with pytest.raises(TypeError, match=r"Group\.prompt_ids"):
        rlnb.Group(prompt="1+", samples=group.samples, prompt_ids="15")  # type: ignore[arg-type]


def test_a_conversation_sample_keeps_its_mask_and_turns_through_a_dict() -> None:
    sample = rlnb.Sample(
        "p", "ab=1;c", (5, 6, 2, 7, 7, 8, 2), (-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5), (0, 0, 0, 0, 0, 1, 1),
        mask=(1, 1, 1, 0, 0, 1, 1), turns=(0, 5), env_reward=0.5,
    )  # fmt: skip
    assert rlnb.Sample.from_dict(json.loads(json.dumps(sample.to_dict()))) == sample
    assert sample.is_conversation
    assert sample.segments() == [(True, (5, 6, 2)), (False, (7, 7)), (True, (8, 2))]


def test_a_single_completion_has_an_all_ones_mask_and_one_turn() -> None:
    sample = rlnb.Sample("p", "ab", (5, 6, 2))
    assert (sample.mask, sample.turns, sample.is_conversation) == ((1, 1, 1), (0,), False)
    old = {k: v for k, v in sample.to_dict().items() if k not in ("mask", "turns", "env_reward")}
    assert rlnb.Sample.from_dict(old) == sample  # saved before conversations existed


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"mask": (1, 0)}, "Sample.mask has 2 entries but token_ids has 3"),
        ({"mask": (1, 2, 1)}, "Sample.mask must hold only 0 and 1"),
        ({"turns": (1,)}, "Sample.turns=(1,) must start at 0"),
        ({"turns": (0, 2, 1)}, "must start at 0 and not fall"),
        ({"turns": (0, 4)}, "within the 3 tokens"),
    ],
)
def test_a_bad_mask_or_turns_is_refused_naming_the_field(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        rlnb.Sample("p", "ab", (5, 6, 2), **fields)

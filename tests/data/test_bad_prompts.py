"""A task whose ``make_prompt`` raises for some prompts (a bad row in a data set):
each is reported once, naming the prompt, or skipped and counted as the user
chooses; the stream goes on and no rollout capacity is lost."""

from __future__ import annotations

import random

import pytest

import rlnb
from rlnb.data import Task, register_task
from tests.helpers import assert_counts_add_up, cause_chain

# For seed 0 this task's make_prompt raises for training prompts 19, 25, 31 and 66
# (the prompts register_task tries are all fine).
BAD = [19, 25, 31]


def sometimes_raises(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.05:
        raise ValueError("a bad row")
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}+{b}=", str(a + b)


def exact(completion: str, answer: str) -> float:
    return float(completion.strip() == answer)


TASK = register_task(
    Task("bad-prompts", "0123456789+=", sometimes_raises, exact, max_new_tokens=4),
    replace=True,
)


def config(mode: str, num_workers: int, on_bad_prompt: str = "raise") -> rlnb.Config:
    # Capacity for exactly one step: a group's worth lost to a bad prompt would hang the next one.
    return rlnb.Config(
        task="bad-prompts",
        mode=mode,
        model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
        rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=4, max_inflight=8, max_new_tokens=4),
        data=rlnb.DataConfig(num_workers=num_workers, on_bad_prompt=on_bad_prompt),
        step_timeout=30,
    )


def prompt_errors(error: BaseException) -> list[rlnb.PromptError]:
    return [e for e in cause_chain(error) if isinstance(e, rlnb.PromptError)]


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_each_bad_prompt_is_raised_once_and_training_goes_on(mode: str, num_workers: int) -> None:
    with rlnb.Session(config(mode, num_workers), name="bad-prompts") as sess:
        reported: list[int] = []
        for _ in range(12):
            try:
                sess.step(timeout=30)
            except rlnb.RlnbError as exc:
                (bad,) = prompt_errors(exc)
                assert "make_prompt raised for prompt" in str(bad) and "ValueError('a bad row')" in str(bad)
                assert "test_bad_prompts.py" in str(bad)  # the user's line
                reported.append(bad.prompt_id)
        assert reported == BAD
        assert sess.version == 12 - len(BAD)
        stats = sess.statistics().rollout
        assert stats.bad_prompts == len(BAD) and stats.failed == 0
        assert_counts_add_up(stats)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_bad_prompts_can_be_skipped_and_counted(num_workers: int) -> None:
    with rlnb.Session(config("sync", num_workers, "skip"), name="bad-prompts") as sess:
        sess.train(10, progress=False)
        stats = sess.statistics().rollout
        assert stats.bad_prompts == len(BAD)
        assert stats.last_bad_prompt is not None and "prompt 31" in stats.last_bad_prompt
        assert stats.groups_finished == 40 and stats.in_flight == 0


def test_a_bad_prompt_in_background_training_stops_the_run_with_one_clear_error() -> None:
    with rlnb.Session(config("async", 0), name="bad-prompts") as sess:
        sess.training.start(steps=20)
        with pytest.raises(rlnb.RlnbError) as raised:
            sess.training.wait(timeout=60)
        assert [e.prompt_id for e in prompt_errors(raised.value)] == [19]
        # Background rollouts may have met the next bad prompt before the run stopped:
        # each is raised once, in order, at the next calls.
        later: list[int] = []
        for _ in range(3):
            try:
                sess.statistics()
            except rlnb.RlnbError as exc:
                later += [e.prompt_id for e in prompt_errors(exc)]
        assert later == BAD[1 : 1 + len(later)]
        assert_counts_add_up(sess.statistics().rollout)


def test_on_bad_prompt_must_be_raise_or_skip() -> None:
    with pytest.raises(rlnb.ConfigError, match=r"DataConfig.on_bad_prompt.*use \"raise\" or \"skip\""):
        rlnb.DataConfig(on_bad_prompt="ignore")

"""A task's numbers: numpy and torch scalars count as the numbers they hold, reward
weights stay within the bound that keeps a weighted sum finite, ``eval_size`` is a
count (an int) or a fraction (a float in (0, 1)), and a task that holds out nothing
refuses to be evaluated on with an rlnb error."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import rlnb
from rlnb.data import Task, register_task
from tests.helpers import small_config

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 20) for b in range(10, 14)]


def exact(completion: str, answer: str) -> float:
    return float(completion.strip() == answer)


def short(completion: str, answer: str) -> float:
    return float(len(completion) <= len(answer))


def records(**options: Any) -> Task:
    options.setdefault("eval_size", 4)
    return Task.from_records("numbers", ROWS, reward=options.pop("reward", [exact, short]), **options)


def test_numpy_and_torch_scalars_are_taken_as_the_numbers_they_hold() -> None:
    t = records(reward_weights=[np.float32(1.0), torch.tensor(0.5)], max_new_tokens=np.int64(4))
    assert t.reward_weights == [1.0, 0.5] and all(type(w) is float for w in t.reward_weights)
    assert t.max_new_tokens == 4 and type(t.max_new_tokens) is int
    assert t.rewards.weights == (1.0, 0.5)
    generated = Task("numbers-made", "0123456789+=", lambda rng: ("1+1=", "2"), exact, max_new_tokens=np.int64(3))  # type: ignore[arg-type]
    assert generated.max_new_tokens == 3 and type(generated.max_new_tokens) is int
    with pytest.raises(rlnb.ConfigError, match=r"Task\.reward_weights=\[True, 1\.0\] is invalid"):
        records(reward_weights=[True, 1.0])  # a bool stays refused


@pytest.mark.parametrize("weight", [1e300, -1e7])
def test_a_reward_weight_that_could_overflow_the_weighted_sum_is_refused(weight: float) -> None:
    with pytest.raises(rlnb.ConfigError) as info:
        records(reward_weights=[1.0, weight])
    assert str(info.value).startswith(f"Task.reward_weights=[1.0, {weight!r}] is invalid: {weight!r} is beyond ±1e+06")
    assert "reward_weights=[1.0, 0.5]" in str(info.value)


def test_eval_size_is_a_count_as_an_int_and_a_fraction_as_a_float() -> None:
    assert len(records(eval_size=np.int64(3)).records.held_out_rows) == 3  # type: ignore[union-attr]
    assert len(records(eval_size=np.float32(0.25)).records.held_out_rows) == 10  # type: ignore[union-attr]
    for size in (1.0, 0.0, 2.0):
        with pytest.raises(rlnb.ConfigError) as info:
            records(eval_size=size)
        assert str(info.value).startswith(f"Task.from_records(eval_size={size!r}) is invalid: a float is a fraction")
        assert "eval_size=0.1" in str(info.value) and "a number of records is an int" in str(info.value)


def test_evaluating_a_task_that_holds_out_nothing_is_an_rlnb_error_naming_eval_size() -> None:
    t = register_task(records(eval_size=0, reward=exact), replace=True)
    with pytest.raises(rlnb.ConfigError, match=r"holds out no records \(Task.from_records\(eval_size=0\)\)"):
        t.eval_set(10)
    with rlnb.Session(small_config(task=t.name), name="no-held-out") as sess:
        sess.step()  # it trains
        with pytest.raises(rlnb.ConfigError) as info:
            sess.evaluate()
    assert "make the task with eval_size > 0, e.g. eval_size=0.1" in str(info.value)

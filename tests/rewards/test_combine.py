"""Several reward functions as one (``Task(reward=[...], reward_weights=[...])``): the
weighted sum, None for "does not apply", the keywords a function takes, async
functions, and what a session records of each function."""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

import pytest

import rlnb
from rlnb.data import Task, register_task
from rlnb.rewards import BadValue, Rewards, exact_match
from tests.helpers import small_config


def right(completion: str, answer: Any) -> float:
    return 1.0


def half(completion: str, answer: Any) -> float:
    return 0.5


def skip(completion: str, answer: Any) -> None:
    return None


def test_the_reward_is_the_weighted_sum_of_the_functions_that_apply() -> None:
    rewards = Rewards.of([right, half, skip], [2.0, -1.0, 5.0])
    scored = rewards.score("c", "a")
    assert scored.total == 1.5 and dict(scored.parts) == {"right": 1.0, "half": 0.5, "skip": None}
    assert Rewards.of([skip], None).score("c", "a").total == 0.0  # none applied
    assert Rewards.of(right, None).names == ("right",)


def test_prompt_and_row_are_passed_to_the_functions_that_take_them() -> None:
    got: dict[str, Any] = {}

    def with_prompt(completion: str, answer: Any, prompt: str) -> float:
        got["prompt"] = prompt
        return 1.0

    def with_row(completion: str, answer: Any, *, row: dict[str, Any]) -> float:
        got["row"] = row
        return 1.0

    def with_anything(completion: str, answer: Any, **extra: Any) -> float:
        got["extra"] = extra
        return 1.0

    def with_env(completion: str, answer: Any, env_reward: float | None) -> float:
        got["env_reward"] = env_reward
        return 1.0

    rewards = Rewards.of([with_prompt, with_row, with_anything, with_env, right], None)
    rewards.score("c", "a", prompt="p", row={"k": 1})
    assert got == {
        "prompt": "p",
        "row": {"k": 1},
        "extra": {"prompt": "p", "row": {"k": 1}, "env_reward": None},
        "env_reward": None,  # a single completion: no environment spoke
    }
    rewards.score("c", "a", env_reward=0.5)  # a conversation's last turn, with its environment's reward
    assert got["env_reward"] == got["extra"]["env_reward"] == 0.5


def test_an_async_function_is_run_to_its_end_on_the_calling_thread() -> None:
    async def judge(completion: str, answer: Any) -> float:
        await asyncio.sleep(0)
        return 0.25

    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(Rewards.of([judge], None).score("c", "a").total))
    thread.start()
    thread.join()
    assert result == [0.25]


def test_names_are_unique_and_a_lambda_is_called_reward() -> None:
    rewards = Rewards.of([right, right, lambda c, a: 0.0, exact_match], None)
    assert rewards.names == ("right", "right_2", "reward", "exact_match")


@pytest.mark.parametrize("value", ["1.0", float("nan"), math.inf, [1.0], 1e39])
def test_a_value_that_is_not_a_finite_number_names_its_function(value: Any) -> None:
    def bad(completion: str, answer: Any) -> Any:
        return value

    with pytest.raises(BadValue) as caught:
        Rewards.of([right, bad], None).score("c", "a")
    assert caught.value.function == "bad"


def constant_one(completion: str, answer: str) -> float:
    return 1.0


def odd_only(completion: str, answer: str, *, row: dict[str, Any]) -> float | None:
    return 0.0 if row["n"] % 2 else None


def returns_text(completion: str, answer: str) -> str:
    return "high"


ROWS = [{"prompt": f"{n}=", "answer": str(n), "n": n} for n in range(20)]


def test_a_session_records_each_functions_mean_and_spread_and_sums_them() -> None:
    t = Task.from_records("two-rewards", ROWS, reward=[constant_one, odd_only], reward_weights=[0.5, 3.0], eval_size=0)
    register_task(t, replace=True)
    with rlnb.Session(small_config(task=t.name), name="two-rewards") as sess:
        metrics = sess.step()
        groups = sess.rollout(2)
    assert metrics["reward/constant_one"] == 1.0 and metrics["reward/constant_one/std"] == 0.0
    assert metrics["reward/odd_only"] == 0.0 and metrics["reward/odd_only/std"] == 0.0
    assert metrics["reward_mean"] == 0.5  # 0.5 * 1.0, and odd_only adds 3.0 * 0.0 where it applies
    assert sess.history[-1]["reward/constant_one"] == 1.0
    for group in groups:
        for sample in group.samples:
            assert sample.reward == 0.5 and sample.rewards["constant_one"] == 1.0
            assert set(sample.rewards) == {"constant_one", "odd_only"}
    kinds = {s.rewards["odd_only"] for g in groups for s in g.samples}
    assert kinds <= {0.0, None}


def test_a_function_that_returns_text_fails_the_rollout_naming_the_function() -> None:
    t = Task.from_records("text-reward", ROWS, reward=[constant_one, returns_text], eval_size=0)
    register_task(t, replace=True)
    with rlnb.Session(small_config(task=t.name), name="text-reward") as sess:
        with pytest.raises(rlnb.RolloutError, match=r"the reward function 'returns_text' returned 'high'.*or None"):
            sess.rollout(1)


def test_a_batched_function_is_called_once_per_group_with_its_lists() -> None:
    calls: list[tuple[int, bool]] = []

    @rlnb.rewards.batched
    def judge(completions: list[str], answers: list[str], *, rows: list[dict[str, Any]]) -> list[float]:
        calls.append((len(completions), len(set(answers)) == 1 and rows[0] is not None))
        return [0.25] * len(completions)

    t = Task.from_records("judged", ROWS, reward=[constant_one, judge], reward_weights=[1.0, 2.0], eval_size=0)
    register_task(t, replace=True)
    with rlnb.Session(small_config(task=t.name), name="judged") as sess:
        metrics = sess.step()  # four groups of four
        assert calls == [(4, True)] * 4
        assert metrics["reward/judge"] == 0.25 and metrics["reward_mean"] == 1.5
        (group,) = sess.rollout(1)
    assert all(s.rewards == {"constant_one": 1.0, "judge": 0.25} and s.reward == 1.5 for s in group.samples)


def test_a_batched_function_must_give_one_value_per_completion() -> None:
    @rlnb.rewards.batched
    def short(completions: list[str], answers: list[str]) -> list[float]:
        return [1.0]

    rewards = Rewards.of([right, short], None)
    first = [rewards.score("c", "a") for _ in range(3)]
    assert all(dict(s.parts) == {"right": 1.0} for s in first)  # the batched one waits for the group
    with pytest.raises(BadValue, match=r"\[1\.0\], not a list of 3 values") as caught:
        rewards.score_group([s.parts for s in first], ["c"] * 3, ["a"] * 3, ["p"] * 3, [None] * 3)
    assert caught.value.function == "short"
    t = Task.from_records("short-judge", ROWS, reward=short, eval_size=0)
    register_task(t, replace=True)
    with rlnb.Session(small_config(task=t.name), name="short-judge") as sess:
        with pytest.raises(rlnb.RolloutError, match=r"the reward function 'short' returned \[1\.0\], not a list of 4"):
            sess.rollout(1)


def f(completion: str, answer: Any) -> float:
    return 1.0


def f_2(completion: str, answer: Any) -> float:
    return 0.5


def test_repeated_names_are_made_unique_without_taking_another_functions_name() -> None:
    rewards = Rewards.of([f, f, f_2], None)
    assert len(set(rewards.names)) == 3 and rewards.names[0] == "f" and rewards.names[2] == "f_2"
    scored = rewards.score("c", "a")
    assert scored.total == 2.5 and sorted(scored.parts.values()) == [0.5, 1.0, 1.0]  # before: f_2 twice, 2.0


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_batched_function_may_return_a_1d_array_or_tensor(kind: str) -> None:
    import numpy as np
    import torch

    @rlnb.rewards.batched
    def judge(completions: list[str], answers: list[str]) -> Any:
        values = [0.25 * i for i in range(len(completions))]
        return np.array(values) if kind == "numpy" else torch.tensor(values)

    rewards = Rewards.of([judge], None)
    scored = rewards.score_group([{}] * 4, ["a", "b", "c", "d"], ["x"] * 4, ["p"] * 4, [None] * 4)
    assert [s.total for s in scored] == [0.0, 0.25, 0.5, 0.75]
    wrong = np.zeros((2, 2)) if kind == "numpy" else torch.zeros(3)
    judge2 = rlnb.rewards.batched(lambda completions, answers: wrong)
    with pytest.raises(BadValue, match="not a list of 4 values"):
        Rewards.of([judge2], None).score_group([{}] * 4, ["a"] * 4, ["x"] * 4, ["p"] * 4, [None] * 4)


def test_of_several_functions_the_one_that_raises_is_named() -> None:
    def broken(completion: str, answer: Any) -> float:
        raise KeyError("answer")

    register_task(Task.from_records("names-raiser", ROWS, reward=[right, broken], eval_size=0), replace=True)
    config = small_config(task="names-raiser", rollout=rlnb.RolloutConfig(max_retries=0))
    with rlnb.Session(config, name="names-raiser") as sess:
        with pytest.raises(rlnb.RolloutError, match=r"the reward function 'broken' raised KeyError"):
            sess.rollout(1)


# -- weights as the configs check them, and a weighted sum within float32's range -----------


def near_limit(completion: str, answer: Any) -> float:
    return 3e38  # within the bound a single reward is checked against (|r| <= 3.4e38)


def also_near_limit(completion: str, answer: Any) -> float:
    return 3e38


def test_weights_are_checked_as_the_configs_check_them_and_numpy_scalars_are_numbers() -> None:
    import numpy as np
    import torch

    rewards = Rewards.of([right, half], [np.float32(0.5), torch.tensor(2.0)], field="rescore")
    assert rewards.weights == (0.5, 2.0) and all(type(w) is float for w in rewards.weights)
    assert rewards.score("c", "a").total == 1.5
    # Before: accepted, and the weighted sum of rewards within the check was inf.
    with pytest.raises(rlnb.ConfigError) as info:
        Rewards.of([right, half], [1e300, 1.0], field="rescore")
    assert str(info.value).startswith("rescore.reward_weights=[1e+300, 1.0] is invalid: 1e+300 is beyond ±1e+06")
    assert "reward_weights=[1.0, 0.5]" in str(info.value)
    with pytest.raises(rlnb.ConfigError, match=r"rescore\.reward_weights=\[True, 1\.0\] is invalid"):
        Rewards.of([right, half], [True, 1.0], field="rescore")  # a bool stays refused
    with pytest.raises(rlnb.ConfigError, match=r"Task\.reward_weights=\[1\.0\] is invalid: give one number per"):
        Rewards.of([right, half], [1.0])


def test_a_weighted_sum_beyond_float32s_range_is_refused_naming_each_value_and_weight() -> None:
    with pytest.raises(BadValue) as caught:
        Rewards.of([near_limit, also_near_limit], None).score("c", "a")  # before: a total of 6e+38
    assert caught.value.function is None
    assert str(caught.value) == (
        "a weighted sum of 6e+38 (near_limit=3e+38 * 1 + also_near_limit=3e+38 * 1; "
        "scale the functions, or their reward_weights, down)"
    )
    with pytest.raises(BadValue, match=r"a weighted sum of -6e\+38 \(near_limit=3e\+38 \* -2;"):
        Rewards.of(near_limit, [-2.0]).score("c", "a")  # one function, weighted past the limit
    assert Rewards.of([near_limit, also_near_limit], [1.0, -1.0]).score("c", "a").total == 0.0
    assert Rewards.of(near_limit, [1.0]).score("c", "a").total == 3e38


def test_a_weighted_sum_with_batched_functions_is_checked_once_the_group_is_scored() -> None:
    @rlnb.rewards.batched
    def cancels(completions: list[str], answers: list[Any]) -> list[float]:
        return [-3e38] * len(completions)

    rewards = Rewards.of([near_limit, also_near_limit, cancels], None)
    provisional = rewards.score("c", "a")  # 6e+38 so far: not yet the sample's reward
    (whole,) = rewards.score_group([provisional.parts], ["c"], ["a"], ["p"], [None])
    assert whole.total == 3e38
    overflowing = Rewards.of([near_limit, also_near_limit, cancels], [1.0, 1.0, -1.0])
    with pytest.raises(BadValue, match=r"a weighted sum of 9e\+38 \(.*cancels=-3e\+38 \* -1;"):
        overflowing.score_group([overflowing.score("c", "a").parts], ["c"], ["a"], ["p"], [None])


def test_a_weighted_sum_beyond_float32s_range_fails_its_sample_in_the_rollout_naming_the_functions() -> None:
    t = Task.from_records("sum-overflows", ROWS, reward=[near_limit, also_near_limit], eval_size=0)
    register_task(t, replace=True)
    with rlnb.Session(small_config(task=t.name), name="sum-overflows") as sess:
        with pytest.raises(rlnb.RolloutError) as info:
            sess.rollout(1)
    message = str(info.value)
    assert "returned a weighted sum of 6e+38 (near_limit=3e+38 * 1 + also_near_limit=3e+38 * 1;" in message
    assert message.startswith("rollout failed: the reward function returned a weighted sum")
    assert "for prompt" in message and "float32's range, |r| <= 3.4e38" in message

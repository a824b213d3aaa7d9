"""TRL's reward functions as they are (``rlnb/rewards/_trl.py``): recognised by their
signature or wrapped with ``from_trl``, called once per group with TRL's keywords
(prompts, completions, completion_ids, the record's columns), None for "does not
apply", and errors that name the function."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

import rlnb
from rlnb.data import Task, register_task
from rlnb.envs import env_reward
from rlnb.rewards import (
    BadValue,
    Rewards,
    TrlReward,
    exact_match,
    from_trl,
    is_trl_reward,
    length_penalty,
    math_answer,
    regex_format,
)
from tests.helpers import small_config

# -- TRL's own functions, copied unchanged (TRL is not a dependency) ------------------------------


# trl/rewards/format_rewards.py (TRL 1.16, Apache-2.0), docstring left out.
def think_format_reward(completions: list[list[dict[str, str]]], **kwargs) -> list[float]:
    pattern = r"^<think>(?!.*<think>)(.*?)</think>.*$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content, re.DOTALL | re.MULTILINE) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


# trl/rewards/other_rewards.py (TRL 1.16): a callable class over completion_ids.
class _RepetitionPenalty:
    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int, max_penalty: float):
        self.ngram_size = ngram_size
        self.max_penalty = max_penalty

    def __call__(self, completion_ids: list[list[int]], **kwargs) -> list[float]:
        rewards = []
        for ids in completion_ids:
            if len(ids) < self.ngram_size:
                rewards.append(0.0)
                continue
            ngrams = list(zip(*[ids[i:] for i in range(self.ngram_size)], strict=False))
            scaling = 1 - len(set(ngrams)) / len(ngrams)
            rewards.append(scaling * self.max_penalty if scaling else 0.0)
        return rewards


# TRL's GRPOTrainer guide: a reward from a data set column, and the quick start's dummy one.
def reward_func(completions, ground_truth, **kwargs):
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth, strict=False)]


def reward_num_unique_chars(completions, **kwargs):
    return [len(set(c)) for c in completions]


@rlnb.rewards.isolated
def isolated_pid(completions, **kwargs):
    """A TRL function run in rlnb's worker process: its pid for each completion."""
    import os

    return [float(os.getpid())] * len(completions)


ROWS = [{"prompt": f"{n}=", "answer": str(n), "ground_truth": str(n), "task": "odd" if n % 2 else "even", "n": n}
        for n in range(20)]  # fmt: skip
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "system", "content": "add"}, {"role": "user", "content": f"{a}+{a}"}], "sum": str(2 * a)}
    for a in range(10, 30)
]


def records_task(name: str, reward: Any, rows: list[dict[str, Any]] = ROWS, **fields: Any) -> Task:
    return register_task(Task.from_records(name, rows, reward=reward, eval_size=0, **fields), replace=True)


# -- in a session ---------------------------------------------------------------------------------


def test_a_trl_function_trains_unchanged_called_once_per_group_with_trls_keywords() -> None:
    calls: list[dict[str, Any]] = []

    def trl_reward(prompts, completions, completion_ids, ground_truth, **kwargs):
        calls.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                      "ground_truth": ground_truth, **kwargs})  # fmt: skip
        return [float(c.strip() == gt) + 0.25 for c, gt in zip(completions, ground_truth, strict=True)]

    t = records_task("trl-session", [trl_reward, reward_func, reward_num_unique_chars])
    assert all(isinstance(f.fn, TrlReward) and f.is_batched for f in t.rewards.functions)
    with rlnb.Session(small_config(task=t.name), name="trl") as sess:
        metrics = sess.step()  # four groups of four: one call each
        assert len(calls) == 4 and all(len(c["completions"]) == 4 for c in calls)
        assert metrics["reward/trl_reward"] >= 0.25 and "reward/reward_num_unique_chars" in metrics
        (group,) = sess.rollout(1)
    call = calls[-1]
    n = int(group.prompt[:-1])
    assert call["prompts"] == [group.prompt] * 4
    assert call["completions"] == [s.completion for s in group.samples]
    assert call["completion_ids"] == [list(s.token_ids) for s in group.samples]  # the policy's own tokens
    assert all(isinstance(ids, list) and ids for ids in call["completion_ids"])
    # The record's columns, one value per completion; "prompt" is passed as prompts (as TRL does).
    assert call["ground_truth"] == [str(n)] * 4 and call["answer"] == [str(n)] * 4 and call["n"] == [n] * 4
    assert call["task"] == ["odd" if n % 2 else "even"] * 4 and "prompt" not in call
    assert call["trainer_state"] is None and call["log_extra"]("x", [1]) is None and call["log_metric"]("m", 1) is None
    for s in group.samples:
        assert set(s.rewards) == {"trl_reward", "reward_func", "reward_num_unique_chars"}
        unique = float(len(set(s.completion)))
        assert s.rewards["reward_num_unique_chars"] == unique
        assert s.reward == pytest.approx(s.rewards["trl_reward"] + s.rewards["reward_func"] + unique)  # type: ignore[operator]


def test_a_chat_task_gets_messages_and_trls_own_functions_run_unchanged() -> None:
    calls: list[dict[str, Any]] = []

    def spy(prompts, completions, **kwargs):
        calls.append({"prompts": prompts, "completions": completions, **kwargs})
        return [None] * len(completions)  # applies to none: the others' values make the reward

    penalty = _RepetitionPenalty(ngram_size=2, max_penalty=-1.0)
    t = records_task("trl-chats", [think_format_reward, penalty, spy], CHATS, prompt="messages", answer="sum")
    assert [f.name for f in t.rewards.functions] == ["think_format_reward", "repetition_penalty_reward", "spy"]
    with rlnb.Session(small_config(task=t.name), name="trl-chats") as sess:
        (group,) = sess.rollout(1)
    call = calls[-1]
    (row,) = [r for r in CHATS if r["messages"][1]["content"] == group.prompt.split("\n")[1]]
    assert call["prompts"] == [row["messages"]] * 4
    assert call["completions"] == [[{"role": "assistant", "content": s.completion}] for s in group.samples]
    assert call["sum"] == [row["sum"]] * 4 and call["messages"] == [row["messages"]] * 4
    for s in group.samples:
        assert s.rewards["think_format_reward"] == 0.0 and s.rewards["spy"] is None
        assert s.rewards["repetition_penalty_reward"] == penalty([list(s.token_ids)])[0]
        assert s.reward == pytest.approx(s.rewards["repetition_penalty_reward"])


def test_a_function_that_gives_the_wrong_number_of_values_fails_the_rollout_naming_it() -> None:
    def two_only(completions, **kwargs):
        return [1.0, 0.0]

    t = records_task("trl-short", two_only)
    with rlnb.Session(small_config(task=t.name), name="trl-short") as sess:
        with pytest.raises(
            rlnb.RolloutError, match=r"the reward function 'two_only' returned \[1\.0, 0\.0\], not a list of 4"
        ):
            sess.rollout(1)


def test_rescore_calls_a_trl_function_with_the_kept_samples_token_ids() -> None:
    seen: list[list[list[int]]] = []

    def by_tokens(completion_ids, **kwargs):
        seen.append(completion_ids)
        return [float(len(ids)) for ids in completion_ids]

    with rlnb.Session(small_config(), name="trl-rescore") as sess:  # a generated task: no records
        sess.step()
        batch = sess.batches[-1]
        out = sess.rescore(-1, reward=by_tokens)
    assert out["rewards"] == [[float(len(s.token_ids)) for s in g.samples] for g in batch.groups]
    assert seen == [[list(s.token_ids) for s in g.samples] for g in batch.groups]


def test_an_isolated_trl_function_runs_in_a_worker_process(loader_workers: set[int]) -> None:
    import os

    assert is_trl_reward(isolated_pid)
    t = records_task("trl-isolated", isolated_pid)
    with rlnb.Session(small_config(task=t.name), name="trl-isolated") as sess:
        (group,) = sess.rollout(1)
    (value,) = {s.reward for s in group.samples}
    assert value != float(os.getpid())


# -- the call, without a session ------------------------------------------------------------------


def group(rewards: Rewards, n: int = 3, **given: Any) -> list[Any]:
    """``rewards`` scored on a group of ``n`` completions of the record ``ROWS[3]``."""
    first = [rewards.score(f"c{i}", "3", prompt="3=", row=ROWS[3]) for i in range(n)]
    return rewards.score_group(
        [s.parts for s in first], [f"c{i}" for i in range(n)], ["3"] * n, ["3="] * n, [ROWS[3]] * n, **given
    )


def test_none_means_the_function_does_not_apply_to_that_sample() -> None:
    def math_only(prompts, completions, task, **kwargs):
        return [1.0 if t == "odd" and i else None for i, t in enumerate(task)]

    def constant(completion: str, answer: Any) -> float:
        return 0.5

    scored = group(Rewards.of([math_only, constant], [2.0, 1.0]))
    assert [dict(s.parts) for s in scored] == [
        {"math_only": None, "constant": 0.5},
        {"math_only": 1.0, "constant": 0.5},
        {"math_only": 1.0, "constant": 0.5},
    ]
    assert [s.total for s in scored] == [0.5, 2.5, 2.5]
    assert [s.total for s in group(Rewards.of(lambda **kwargs: [None] * 3, None))] == [0.0] * 3


@pytest.mark.parametrize(
    ("value", "shown"),
    [(["1.0", 0.0, 0.0], "'1.0'"), ([float("nan"), 0.0, 0.0], "nan"), ({"a": 1}, r"\{'a': 1\}, not a list of 3")],
)
def test_a_value_that_is_not_a_number_names_the_function(value: Any, shown: str) -> None:
    def judge(completions, **kwargs):
        return value

    with pytest.raises(BadValue, match=shown) as caught:
        group(Rewards.of(judge, None))
    assert caught.value.function == "judge"


def test_a_function_that_raises_is_named_and_a_session_says_which() -> None:
    def broken(completions, **kwargs):
        raise KeyError("solution")

    with pytest.raises(KeyError) as caught:
        group(Rewards.of([exact_match, broken], None))
    assert rlnb.rewards.raised_by(caught.value) == "broken"
    assert "(raised by the reward function 'broken')" in caught.value.__notes__
    t = records_task("trl-raises", broken)
    config = small_config(task=t.name, rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4, max_retries=0))
    with rlnb.Session(config, name="trl-raises") as sess:
        with pytest.raises(rlnb.RolloutError, match=r"the reward function 'broken' raised KeyError\('solution'\)"):
            sess.rollout(1)


def test_an_async_function_and_one_without_kwargs_are_called_as_trl_would() -> None:
    async def judged(completions, **kwargs):
        await asyncio.sleep(0)
        return [float(len(c)) for c in completions]

    got: list[dict[str, Any]] = []

    def named_only(completions, n, trainer_state):
        got.append({"completions": completions, "n": n, "trainer_state": trainer_state})
        return [0.0] * len(completions)

    scored = group(Rewards.of([judged, from_trl(named_only, name="named")], None), completion_ids=[[1], [2], [3]])
    assert [s.parts["judged"] for s in scored] == [2.0, 2.0, 2.0] and scored[0].parts["named"] == 0.0
    assert got == [{"completions": ["c0", "c1", "c2"], "n": [3] * 3, "trainer_state": None}]


def test_a_task_without_records_gives_its_answers_as_the_answer_column() -> None:
    got: list[Any] = []

    def answers(completions, answer, **kwargs):
        got.append(answer)
        return [0.0] * len(completions)

    rewards = Rewards.of(answers, None)
    rewards.score_group([{}] * 2, ["a", "b"], ["7", "7"], ["3+4="] * 2, [None, None])
    assert got == [["7", "7"]]


# -- which functions are TRL's --------------------------------------------------------------------


def test_trls_signature_is_recognised_and_rlnbs_own_functions_are_not_mistaken_for_it() -> None:
    @rlnb.rewards.batched
    def judge(completions: list[str], answers: list[str], **kwargs: Any) -> list[float]:
        return [0.0] * len(completions)

    def rlnb_style(completion: str, answer: Any, **kwargs: Any) -> float:
        return 0.0

    async def trl_async(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    trl = [think_format_reward, reward_func, reward_num_unique_chars, _RepetitionPenalty(2, -1.0), trl_async,
           lambda **kwargs: [], lambda *, completions, **kwargs: []]  # fmt: skip
    own = [exact_match, math_answer, regex_format(r"\d+"), length_penalty(10), env_reward, judge, rlnb_style,
           lambda completion, answer: 1.0, lambda c, a, **kw: 1.0, lambda *args, **kw: 1.0, print, "text"]  # fmt: skip
    assert [is_trl_reward(fn) for fn in trl] == [True] * len(trl)
    assert [is_trl_reward(fn) for fn in own] == [False] * len(own)
    rewards = Rewards.of([exact_match, judge, rlnb_style, think_format_reward], None)
    assert [type(f.fn) is TrlReward for f in rewards.functions] == [False, False, False, True]
    assert not is_trl_reward(rewards.functions[3].fn)  # wrapped once, never twice
    assert from_trl(rewards.functions[3].fn) is rewards.functions[3].fn
    assert rewards.names == ("exact_match", "judge", "rlnb_style", "think_format_reward")


def test_from_trl_names_the_function_and_refuses_what_cannot_be_called_with_keywords() -> None:
    assert from_trl(reward_func).__name__ == "reward_func"
    assert from_trl(lambda **kwargs: []).__name__ == "reward"
    assert Rewards.of(from_trl(reward_func, name="boxed"), None).names == ("boxed",)
    assert repr(from_trl(reward_func)).startswith("from_trl(")
    with pytest.raises(rlnb.ConfigError, match=r"from_trl\('text'\) is invalid"):
        from_trl("text")  # type: ignore[arg-type]
    with pytest.raises(rlnb.ConfigError, match="name=''"):
        from_trl(reward_func, name="")

    def positional(completions, /, **kwargs):
        return []

    with pytest.raises(rlnb.ConfigError, match=r"'completions' is positional-only"):
        from_trl(positional)
    with pytest.raises(rlnb.ConfigError, match=r"rlnb\.rewards\.from_trl\(fn\)"):
        Rewards.of(lambda completions: [], None)  # TRL-like without **kwargs: rlnb's shape, which does not fit


def test_evaluate_scores_with_a_trl_function_as_training_does() -> None:
    # A task whose only reward is a TRL (batched) function: evaluation scores each
    # held-out completion with it, as a group of one, not with 0.
    seen: list[list[str]] = []

    def right(completions, **kwargs):
        seen.append(list(completions))
        return [1.0] * len(completions)

    t = register_task(Task.from_records("trl-eval", ROWS, reward=right, eval_size=4), replace=True)
    with rlnb.Session(small_config(task=t.name), name="trl-eval") as sess:
        assert sess.evaluate(4) == 1.0
    assert len(seen) == 4 and all(len(c) == 1 for c in seen)


def test_set_reward_refuses_a_trl_function_naming_where_it_goes() -> None:
    with rlnb.Session(small_config(), name="trl-set") as sess:
        with pytest.raises(TypeError, match=r"TRL's signature .* rlnb.data.Task\(..., reward=fn\)"):
            sess.rollouts.set_reward(reward_num_unique_chars)
        sess.rollouts.set_reward(lambda completion, answer: 1.0)  # rlnb's own still goes

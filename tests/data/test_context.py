"""Prompts longer than the model's context: every record is measured when a session is
made (it checked 16 prompts, and a longer record failed a later step after three
retries), and an environment whose ``reset`` gives such a prompt fails its group with
an error naming it (every step raised a bare ``ZeroDivisionError`` and ``evaluate()``
returned 0.0)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import pytest

import rlnb
from rlnb.data import Task, register_task
from rlnb.envs import Turn
from tests.helpers import small_config

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 50) for b in range(10, 40)]
LONG = "1+" * 30 + "1="  # 63 tokens with BOS: the small config's context is 32


def exact(completion: str, answer: str) -> float:
    return float(completion.strip() == answer)


def test_every_record_is_measured_against_the_context_when_a_session_is_made() -> None:
    rows = [*ROWS, {"prompt": LONG, "answer": "31"}]  # the last of 1201: never among the 16 prompts it looked at
    register_task(Task.from_records("long-record", rows, reward=exact, eval_size=0), replace=True)
    with pytest.raises(rlnb.ConfigError) as caught:
        rlnb.Session(small_config(task="long-record"), name="long-record")
    message = str(caught.value)
    assert "ModelConfig.max_len=32 is invalid for task 'long-record': record 1200 of a list of 1201" in message
    assert "a prompt of 63 tokens" in message and "use max_len >= 66" in message and "drop that record" in message
    assert rlnb.sessions() == []
    # several: each named, the longest measured; held-out records too (evaluate() failed on each)
    rows = [{"prompt": LONG[:-4] + "=", "answer": "29"}, *ROWS, {"prompt": LONG, "answer": "31"}]
    register_task(Task.from_records("long-records", rows, reward=exact, eval_size=0.5), replace=True)
    with pytest.raises(rlnb.ConfigError, match=r"2 records of a list of 1202 have prompts too long for it \(records "
                       r"0, 1201\); the longest, record 1201's '1\+1\+.*', takes 63 tokens"):  # fmt: skip
        rlnb.Session(small_config(task="long-records"), name="long-record")


class LongPrompt:
    """An environment whose reset gives a prompt longer than the small config's context."""

    def reset(self, row: Mapping[str, Any]) -> str:
        return LONG

    def step(self, completion: str) -> Turn:
        return Turn("=", reward=1.0, done=True)


def _sum(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(10, 99)
    return f"{a}+1=", str(a + 1)


def test_an_environment_whose_prompt_leaves_no_room_fails_its_group_naming_it() -> None:
    task = Task(name="long-env", alphabet="0123456789+=", make_prompt=_sum, reward=None, env=LongPrompt,
                max_turns=2, max_new_tokens=4)  # fmt: skip
    register_task(task, replace=True)
    words = ["the environment LongPrompt's reset gave prompt", "a prompt of 63 tokens", "context is 32"]
    with rlnb.Session(small_config(task="long-env"), name="long-env") as sess:
        with pytest.raises(rlnb.RolloutError) as caught:  # was a bare ZeroDivisionError from the learner
            sess.step()
        for word in [*words, "make reset return a shorter prompt, or use a larger max_len"]:
            assert word in str(caught.value), caught.value
        with pytest.raises(rlnb.RolloutError, match="evaluation failed") as caught:  # it returned 0.0
            sess.evaluate(4)
        assert all(word in str(caught.value) for word in words), caught.value


def _sometimes_long(rng: random.Random) -> tuple[str, str]:
    """For seed 0, training prompts 52 and 67 are LONG (none of the 16 Session() measures)."""
    if rng.random() < 0.04:
        return LONG, "31"
    return _sum(rng)


register_task(
    Task(name="sometimes-long", alphabet="0123456789+=", make_prompt=_sometimes_long, reward=exact, max_new_tokens=4),
    replace=True,
)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_made_prompt_too_long_for_the_context_fails_its_step_at_once_naming_it(mode: str) -> None:
    with rlnb.Session(small_config(task="sometimes-long", mode=mode), name="sometimes-long") as sess:
        with pytest.raises(rlnb.RolloutError) as caught:
            for _ in range(20):  # 4 prompts a step: prompt 52 is in the 14th
                sess.step()
        message = str(caught.value)  # it was "generation for prompt 52 sample 0 failed 3 times", the reason chained
        assert message.startswith("a background rollout failed: " * (mode == "async") + "prompt 52 ('" + LONG[:20])
        for words in ("takes 63 tokens, and with up to 4 new tokens it needs 67 positions, more than the model's "
                      "context of 32 (ModelConfig.max_len)", "make the task's prompts shorter, or use "
                      "ModelConfig.max_len >= 67 or a smaller RolloutConfig.max_new_tokens",
                      'DataConfig(on_bad_prompt="skip") skips such prompts'):  # fmt: skip
            assert words in message, message
        stats = sess.statistics().rollout
        assert (stats.retries, stats.bad_prompts) == (0, 1)  # not retried as bad luck
        sess.step()  # the stream goes on
        with pytest.raises(rlnb.RolloutError, match=r"evaluation failed \(\d+ of 16 prompts\): prompt \d+ \('1\+1\+"
                           r".*takes 63 tokens.*context of 32 \(ModelConfig.max_len\): make the task's"):  # fmt: skip
            sess.evaluate(16)  # it named the engine's request, not the prompt


def test_made_prompts_too_long_for_the_context_can_be_skipped_and_counted() -> None:
    config = small_config(task="sometimes-long", data=rlnb.DataConfig(num_workers=0, on_bad_prompt="skip"))
    with rlnb.Session(config, name="sometimes-long") as sess:
        sess.train(20, progress=False)  # prompts 0-81: 52 and 67 skipped
        stats = sess.statistics().rollout
        assert (stats.bad_prompts, stats.failed, stats.retries, stats.groups_finished) == (2, 0, 0, 80)
        assert stats.last_bad_prompt is not None and stats.last_bad_prompt.startswith("prompt 67 ")

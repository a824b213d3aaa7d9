"""Tasks made from a data set (``Task.from_records``): the split, the epochs, the files
they are read from, what is checked before anything starts, and a session that
trains on one, evaluates on its held-out records and resumes mid-epoch."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest

import rlnb
from rlnb.data import Task, register_task
from rlnb.data._records import EVAL_ID_OFFSET
from tests.helpers import assert_same_metrics, small_config

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "level": a % 3} for a in range(10, 20) for b in range(10, 14)]


def exact(completion: str, answer: str) -> float:
    return float(completion.strip() == answer)


def task(rows: Any = ROWS, **options: Any) -> Task:
    options.setdefault("eval_size", 4)  # the default, 200, is more than these records
    return Task.from_records(options.pop("name", "sums"), rows, reward=options.pop("reward", exact), **options)


def stream(t: Task, seed: int, n: int) -> list[int]:
    """The row numbers of the first ``n`` training prompts of ``seed``'s stream."""
    return [ROWS.index({k: v for k, v in t.item(seed, i).row.items()}) for i in range(n)]  # type: ignore[union-attr]


def test_held_out_records_are_never_trained_on_and_each_epoch_is_a_new_order_of_the_rest() -> None:
    t = task(eval_size=8)
    held = [item.row for item in t.eval_set(100)]
    assert len(held) == 8 and all(item.prompt_id >= EVAL_ID_OFFSET for item in t.eval_set(100))
    train = len(ROWS) - 8
    first, second = stream(t, 0, train), stream(t, 0, 2 * train)[train:]
    assert sorted(first) == sorted(second) and len(set(first)) == train  # each epoch: every training record once
    assert first != second  # in another order
    assert not {ROWS.index(row) for row in held} & set(first)  # type: ignore[arg-type]
    assert stream(t, 0, train) == first and stream(t, 1, train) != first  # the session's seed picks the order
    assert [item.row for item in task(eval_size=8).eval_set(100)] == held  # the split is fixed by split_seed
    assert [item.row for item in task(eval_size=8, split_seed=1).eval_set(100)] != held


def test_eval_size_may_be_a_fraction_and_the_answer_and_record_reach_the_reward() -> None:
    t = task(eval_size=0.25)
    assert len(t.eval_set(1000)) == 10 and len(t.eval_set(3)) == 3
    item = t.item(0, 0)
    assert item.answer == str(eval(item.prompt[:-1]))  # the answer field
    assert item.row is not None and set(item.row) == {"prompt", "answer", "level"}


def test_the_alphabet_and_max_new_tokens_come_from_the_records() -> None:
    t = task()
    assert t.alphabet == "+0123456789=" and t.max_new_tokens == 3  # "32" and end-of-sequence
    assert task(alphabet="0123456789+= ").alphabet == "0123456789+= "


@pytest.mark.parametrize("kind", ["list", "jsonl", "json", "parquet", "dataset"])
def test_every_kind_of_records_gives_the_same_task(kind: str, tmp_path: Path) -> None:
    records: Any = ROWS
    if kind == "jsonl":
        records = tmp_path / "rows.jsonl"
        records.write_text("".join(json.dumps(row) + "\n" for row in ROWS) + "\n")
    elif kind == "json":
        records = tmp_path / "rows.json"
        records.write_text(json.dumps(ROWS))
    elif kind == "parquet":
        pytest.importorskip("pyarrow")
        import pyarrow
        import pyarrow.parquet

        records = str(tmp_path / "rows.parquet")
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(ROWS), records)
    elif kind == "dataset":
        datasets = pytest.importorskip("datasets")
        records = datasets.Dataset.from_list(ROWS)
    t, expected = task(records, eval_size=4), task(eval_size=4)
    assert [t.item(3, i) for i in range(50)] == [expected.item(3, i) for i in range(50)]
    assert t.eval_set(10) == expected.eval_set(10)


@pytest.mark.parametrize(
    ("records", "options", "words"),
    [
        ([], {}, ["records=a list of 0", "no records"]),
        (ROWS, {"eval_size": 200}, ["eval_size=200", "200 of the 40 records", "eval_size=4 or eval_size=0.1"]),
        (ROWS, {"prompt": "question"}, ["prompt='question'", "record 0 has no field 'question'", "'level'"]),
        ([*ROWS[:3], {"prompt": "1+1="}], {"eval_size": 1}, ["answer='answer'", "record 3 has no field 'answer'"]),
        ([*ROWS[:3], "1+1="], {"eval_size": 1}, ["record 3 is '1+1='", "not a dict"]),
        ([{"prompt": 7, "answer": "7"}, *ROWS[:3]], {"eval_size": 1}, ["record 0's 'prompt' is 7", "a string"]),
        (ROWS, {"eval_size": 40}, ["eval_size=40", "40 of the 40 records", "eval_size=0.1"]),
        (ROWS, {"eval_size": 1.5}, ["eval_size=1.5", "fraction between 0 and 1"]),
        (ROWS, {"eval_size": -1}, ["eval_size=-1"]),
        (ROWS, {"alphabet": "0123456789="}, ["alphabet='0123456789='", "record 0's 'prompt' holds '+'"]),
        (ROWS, {"reward": "exact"}, ["Task.reward='exact'", "reward(completion, answer)"]),
        (ROWS, {"reward": [exact, exact], "reward_weights": [1]}, ["Task.reward_weights=[1]", "one number per"]),
        (ROWS, {"reward": [exact, 3]}, ["Task.reward[1]=3"]),
        (ROWS, {"reward": []}, ["Task.reward=[]", "at least one"]),
        ("rows.csv", {}, ["records='rows.csv'", ".jsonl, .json, .parquet"]),
        ("missing.jsonl", {}, ["records='missing.jsonl'", "no such file"]),
        (42, {}, ["records=42", "a list of dicts"]),
    ],
)
def test_bad_records_and_options_are_config_errors_naming_the_argument(
    records: Any, options: dict[str, Any], words: list[str]
) -> None:
    with pytest.raises(rlnb.ConfigError) as caught:
        task(records, **options)
    for word in words:
        assert word in str(caught.value), f"{word!r} is not in: {caught.value}"


def test_a_file_with_a_line_that_is_not_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{oops\n")
    with pytest.raises(rlnb.ConfigError, match="line 2 is not JSON"):
        task(path, eval_size=0)


def test_a_session_trains_on_records_and_evaluates_on_the_held_out_ones_only() -> None:
    seen: collections.Counter[str] = collections.Counter()

    def counting(completion: str, answer: str, *, prompt: str) -> float:
        seen[prompt] += 1
        return exact(completion, answer)

    t = register_task(task(name="sums-session", reward=counting, eval_size=6), replace=True)
    held = {item.prompt for item in t.eval_set(100)}
    with rlnb.Session(small_config(task=t.name), name="records") as sess:
        sess.step()
        sess.step()
        trained = set(seen)
        assert trained and not trained & held
        seen.clear()
        sess.evaluate(100)
        assert set(seen) == held  # every held-out record once, and nothing else


def test_a_session_loaded_mid_epoch_goes_on_with_the_same_prompts(tmp_path: Path) -> None:
    t = register_task(task(ROWS[:14], name="sums-resume", eval_size=4), replace=True)  # 10 to train on
    config = small_config(task=t.name, rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=4))
    with rlnb.Session(config, name="straight") as sess:
        straight = [sess.step() for _ in range(6)]  # 24 prompts: epoch 2, part-way
    with rlnb.Session(config, name="first") as sess:
        first = [sess.step() for _ in range(3)]  # 12 prompts: the second epoch has begun
        saved = sess.save(tmp_path / "ckpt")
    with rlnb.Session.load(saved, name="second") as sess:
        second = [sess.step() for _ in range(3)]
    assert_same_metrics(first + second, straight)


CHATS = [
    {"messages": [{"role": "system", "content": "add"}, {"role": "user", "content": f"{a}+{a}"}], "sum": str(2 * a)}
    for a in range(10, 30)
]


def test_a_prompt_may_be_chat_messages() -> None:
    t = Task.from_records("chats", CHATS, prompt="messages", answer="sum", reward=exact, eval_size=2)
    item = t.item(0, 0)
    assert item.messages is not None and [m["role"] for m in item.messages] == ["system", "user"]
    assert item.prompt == "add\n" + item.messages[1]["content"]  # what the built-in tokenizer reads, and shows
    assert "\n" in t.alphabet and "a" in t.alphabet
    with pytest.raises(rlnb.ConfigError, match=r"record 0's 'messages' is \[\{'role': 'user'\}\].*chat messages"):
        Task.from_records("bad-chats", [{"messages": [{"role": "user"}], "sum": "1"}], prompt="messages",
                          answer="sum", reward=exact, eval_size=0)  # fmt: skip


def test_a_session_trains_on_chat_messages_with_the_built_in_policy() -> None:
    t = Task.from_records("chats-session", CHATS, prompt="messages", answer="sum", reward=exact, eval_size=2)
    register_task(t, replace=True)
    with rlnb.Session(small_config(task=t.name), name="chats") as sess:
        sess.step()
        (group,) = sess.rollout(1)
        assert group.prompt.startswith("add\n")
        assert len(group.prompt_ids) == 1 + len(group.prompt)  # BOS, then a character each, "\n" included

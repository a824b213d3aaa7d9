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


# -- the task's own records: copied, and read with errors that name the file and line ------------


def test_the_task_keeps_a_copy_of_the_records_so_editing_them_later_changes_nothing() -> None:
    rows: list[dict[str, Any]] = [{**row, "meta": {"tags": ["a"]}} for row in ROWS]
    t = task(rows, eval_size=4)
    before = [t.item(0, i) for i in range(40)], t.eval_set(4)
    rows[0]["prompt"] = "99+99="  # the caller's dicts, edited after the task was made
    for row in rows:
        row["meta"]["tags"].append("edited")
        del row["answer"]
    rows.append({"prompt": "1+1=", "answer": "2"})
    assert ([t.item(0, i) for i in range(40)], t.eval_set(4)) == before  # it used to train on the edits
    item = t.item(0, 0)  # a reward that changes its row or answer changes only its own copy
    assert item.row is not None
    item.row["meta"]["tags"].clear()
    assert t.item(0, 0).row == {**item.row, "meta": {"tags": ["a"]}}


def test_a_pandas_data_frame_gives_its_rows_and_a_polars_or_arrow_table_too() -> None:
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame(ROWS)
    t, expected = task(frame), task()
    assert [t.item(3, i) for i in range(50)] == [expected.item(3, i) for i in range(50)]  # not its column names
    assert "a pandas.DataFrame of 40 rows" in repr(t.records)
    pyarrow = pytest.importorskip("pyarrow")
    table = task(pyarrow.Table.from_pylist(ROWS))
    assert [table.item(3, i) for i in range(9)] == [expected.item(3, i) for i in range(9)]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_files_that_cannot_be_read_name_the_file_the_line_and_the_fix(tmp_path: Path) -> None:
    lines = b"".join(json.dumps(row).encode() + b"\n" for row in ROWS[:3])
    latin1 = _write(tmp_path / "latin1.jsonl", lines + '{"prompt": "1+1=", "answer": "2é"}\n'.encode("latin-1"))
    with pytest.raises(rlnb.ConfigError) as caught:  # was a UnicodeDecodeError with no file or line
        task(latin1, eval_size=0)
    for word in ["latin1.jsonl", "line 4 is not UTF-8", "b'\\xe9' at column 32", "iconv -f latin1 -t utf-8"]:
        assert word in str(caught.value), caught.value
    bad_json = _write(tmp_path / "rows.json", b'[\n{"prompt": "1+1=",\n "answer": "\xff"}]')
    with pytest.raises(rlnb.ConfigError, match=r"rows.json'\) is invalid: line 3 is not UTF-8"):
        task(bad_json, eval_size=0)
    bom = _write(tmp_path / "bom.jsonl", b"\xef\xbb\xbf" + lines)  # as some editors write: read as it is meant
    assert len(task(bom, eval_size=0).records.rows) == 3  # type: ignore[union-attr]
    pytest.importorskip("pyarrow")
    import pyarrow
    import pyarrow.parquet

    whole = tmp_path / "whole.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(ROWS), whole)
    half = _write(tmp_path / "half.parquet", whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(rlnb.ConfigError) as caught:  # was pyarrow's ArrowInvalid
        task(half)
    assert "half.parquet') is invalid: it is not a parquet file, or it is damaged" in str(caught.value)


def test_a_streaming_data_set_or_a_dict_of_splits_is_refused_with_the_fix() -> None:
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_list(ROWS)
    with pytest.raises(rlnb.ConfigError) as caught:  # was TypeError: object of type 'IterableDataset' has no len()
        task(dataset.to_iterable_dataset())
    assert "records=IterableDataset) is invalid: a streaming data set may never end" in str(caught.value)
    assert "records=list(ds.take(10_000))" in str(caught.value)
    with pytest.raises(rlnb.ConfigError, match=r"a DatasetDict of \['train'\]\) is invalid: .* records=ds\['train'\]"):
        task(datasets.DatasetDict({"train": dataset}))


def _unpicklable_value(completion: str) -> str:
    return completion


def test_a_value_that_cannot_be_copied_or_sent_to_a_worker_names_the_record_and_field() -> None:
    import threading

    rows = [dict(row) for row in ROWS]
    rows[7]["lock"] = threading.Lock()
    with pytest.raises(rlnb.ConfigError, match=r"record 7's 'lock' holds <unlocked _thread.lock .*cannot be copied"):
        task(rows)
    rows[7]["lock"] = lambda: None  # copied as it is, but a worker cannot import it
    t = task(rows)
    from rlnb.data import PromptLoader

    with pytest.raises(rlnb.ConfigError) as caught:  # it blamed the task's functions, which were fine
        PromptLoader(t, rlnb.DataConfig(num_workers=1, multiprocessing_context="forkserver"), seed=0)
    assert "record 7's 'lock' holds <function" in str(caught.value)
    assert "records of data" in str(caught.value) and "DataConfig(num_workers=0)" in str(caught.value)


def test_the_records_digest_is_the_same_in_another_process(start_python: Any) -> None:
    rows = [{**row, "tags": {"x", "y", "z"}, "when": __import__("datetime").date(2026, 1, 2)} for row in ROWS]
    here = task(rows).records.digest  # type: ignore[union-attr]
    script = (
        "import datetime, json, sys; from rlnb.data import Task;"
        "rows = [{**r, 'tags': {'x', 'y', 'z'}, 'when': datetime.date(2026, 1, 2)} for r in json.loads(sys.argv[1])];"
        "print(Task.from_records('sums', rows, reward=lambda c, a: 0.0, eval_size=4).records.digest)"
    )
    proc = start_python("-c", script, json.dumps(ROWS), env={**__import__("os").environ, "PYTHONHASHSEED": "7"})
    out, err = proc.communicate(timeout=60)
    assert out.strip() == here, err
    assert task(ROWS[::-1]).records.digest != task(ROWS).records.digest  # type: ignore[union-attr]


def test_the_command_line_says_in_one_line_what_is_wrong_with_a_data_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlnb.cli import main

    lines = "".join(json.dumps(row) + "\n" for row in ROWS)
    latin1 = _write(tmp_path / "latin1.jsonl", (lines + '{"prompt": "1+1=", "answer": "2é"}\n').encode("latin-1"))
    long = _write(tmp_path / "long.jsonl", (lines + json.dumps({"prompt": "1+" * 200 + "1=", "answer": "1"})).encode())
    flags = ["--eval-size", "0.1", "--steps", "1", "--run-dir", str(tmp_path / "run")]
    for data, words in [
        (latin1, ["--data: Task.from_records(records=", "line 41 is not UTF-8"]),  # was UnicodeDecodeError's traceback
        (long, ["record 40 of", "has a prompt of 403 tokens", "use max_len >= 406"]),
    ]:
        code = main(["train", "--data", str(data), *flags])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        assert all(word in err for word in words), err

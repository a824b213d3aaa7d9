"""Where a task's prompts come from: a generator function, or a data set of records.

A prompt loader's worker gets only this part of a task (:meth:`Task.prompt_source`),
never its reward functions: a data set made in a notebook cell, rewarded by
functions defined there, still has its prompts made in workers.

Records are split once, by ``split_seed``, into a held-out set (never trained on)
and a training set, which the stream walks in a new order each epoch: training
prompt ``index`` is position ``index % n`` of epoch ``index // n``'s shuffle of the
session's seed. A checkpoint's prompt-loader state is the next index, so a loaded
session continues mid-epoch exactly where the saved one would have.

The records are the task's own: :meth:`Records.load` copies what the caller gave, and
each prompt gets a copy of its record, so nothing the caller or a reward function
does to a record later changes what is trained on. A checkpoint records their count
and :attr:`Records.digest` (:meth:`Records.fingerprint`) and refuses to load where
they differ.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import hashlib
import io
import json
import math
import os
import pickle
import random
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from rlnb._errors import ConfigError
from rlnb._reprs import short_repr
from rlnb._samples import PromptItem, messages_text

__all__ = ["EVAL_ID_OFFSET", "Generated", "PromptSource", "Records"]

# Prompt ids of held-out sets live far from the training stream's.
EVAL_ID_OFFSET = 1 << 40
# File kinds Task.from_records reads.
SUFFIXES = (".jsonl", ".json", ".parquet")


class PromptSource(Protocol):
    """Makes training prompt ``index`` of the stream for ``seed``."""

    @property
    def name(self) -> str: ...

    def item(self, seed: int, index: int) -> PromptItem: ...


@dataclasses.dataclass(frozen=True)
class Generated:
    """A generator task's prompts: ``make_prompt(rng)`` with an rng seeded per prompt."""

    name: str
    make_prompt: Callable[[random.Random], tuple[str, Any]]

    def item(self, seed: int, index: int) -> PromptItem:
        prompt, answer = self.make_prompt(random.Random(f"{self.name}:{seed}:{index}"))
        return PromptItem(index, prompt, answer)


@dataclasses.dataclass(frozen=True, eq=False)
class Records:
    """A data set's records, split into training and held-out ones (see the module's doc).

    ``rows``: the records (dicts); ``train`` and ``held_out_rows``: indices into them;
    ``prompt`` and ``answer``: the field names that hold each record's prompt and answer.
    """

    name: str
    rows: tuple[Mapping[str, Any], ...]
    train: tuple[int, ...]
    held_out_rows: tuple[int, ...]
    prompt: str
    answer: str
    source: str  # where the records came from, for repr and logs
    _orders: dict[tuple[int, int], list[int]] = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def load(
        cls, name: str, records: Any, *, prompt: str, answer: str, eval_size: int | float, split_seed: int
    ) -> Records:
        """Read, copy and check ``records``; ConfigError naming the argument and the fix."""
        rows, source, fresh = _read(records)
        if not fresh:  # the caller's own objects: later edits of theirs must not reach the task
            rows = _snapshot(rows, source)
        if not rows:
            raise ConfigError(f"Task.from_records(records={source}) is invalid: it holds no records; give at least one")
        for field, argument in ((prompt, "prompt"), (answer, "answer")):
            if not isinstance(field, str) or not field:
                raise ConfigError(
                    f"Task.from_records({argument}={field!r}) is invalid: give the name of the records' field"
                )
        for index, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise ConfigError(
                    f"Task.from_records(records={source}) is invalid: record {index} is {short_repr(row)}, "
                    "not a dict; give records as dicts of fields, e.g. {'prompt': '12+7=', 'answer': '19'}"
                )
            for field, argument in ((prompt, "prompt"), (answer, "answer")):
                if field not in row:
                    raise ConfigError(
                        f"Task.from_records({argument}={field!r}) is invalid: record {index} has no field {field!r} "
                        f"(its fields: {sorted(row)}); name the field that holds each record's {argument}"
                    )
            text = row[prompt]
            if not (isinstance(text, str) or _is_chat(text)):
                raise ConfigError(
                    f"Task.from_records(prompt={prompt!r}) is invalid: record {index}'s {prompt!r} is "
                    f"{short_repr(text)}; a prompt must be a string, or a list of chat messages "
                    "{'role': ..., 'content': ...} with string values"
                )
        held = _held_out(len(rows), eval_size, f"{name}:split:{split_seed}")
        kept = set(held)
        train = tuple(i for i in range(len(rows)) if i not in kept)
        return cls(name, tuple(rows), train, held, prompt, answer, source)

    @functools.cached_property
    def digest(self) -> str:
        """The SHA-256 of the records' contents, each as canonical JSON, in order: the same
        records give the same digest in any process (see :func:`_canonical`)."""
        sha = hashlib.sha256()
        for row in self.rows:
            sha.update(json.dumps(_canonical(row), sort_keys=True, separators=(",", ":")).encode())
            sha.update(b"\n")
        return sha.hexdigest()

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint records of the data it trained on: the records' count and
        :attr:`digest`, the fields read, and the split (held-out count and indices' hash)."""
        split = hashlib.sha256(json.dumps(self.held_out_rows).encode()).hexdigest()
        return {
            "kind": "records",
            "records": len(self.rows),
            "sha256": self.digest,
            "prompt": self.prompt,
            "answer": self.answer,
            "held_out": len(self.held_out_rows),
            "split_sha256": split,
        }

    def check_context(self, prompt_tokens: Callable[[Any], int], *, max_len: int, new_tokens: int, task: str) -> None:
        """ConfigError naming the records whose prompt (``prompt_tokens(encodable)``, as the
        session's tokenizer writes it) leaves fewer than ``new_tokens`` of ``max_len``."""
        room = max_len - new_tokens
        long: list[tuple[int, int]] = []
        for index, row in enumerate(self.rows):
            if (n := prompt_tokens(_encodable(row[self.prompt]))) > room:
                long.append((index, n))
        if not long:
            return
        index, n = max(long, key=lambda found: found[1])
        prompt = short_repr(self.rows[index][self.prompt])
        if len(long) == 1:
            which, fix = f"record {index} of {self.source} has a prompt of {n} tokens ({prompt})", "that record"
        else:
            which = (
                f"{len(long)} records of {self.source} have prompts too long for it (records {_indices(long)}); "
                f"the longest, record {index}'s {prompt}, takes {n} tokens"
            )
            fix = "those records"
        raise ConfigError(
            f"ModelConfig.max_len={max_len} is invalid for task {task!r}: {which}, and with up to {new_tokens} new "
            f"tokens it needs {n + new_tokens} positions; use max_len >= {n + new_tokens} (a model with that "
            f"context), a smaller RolloutConfig.max_new_tokens, or drop {fix}"
        )

    def unpicklable(self) -> str | None:
        """The first record field that pickle cannot send to a loader worker, described; None if all can."""
        for index, row in enumerate(self.rows):
            for field, value in row.items():
                try:
                    pickle.dump(value, io.BytesIO())
                except Exception as exc:
                    return f"record {index}'s {field!r} holds {short_repr(value)}, which cannot be pickled ({exc})"
        return None

    def item(self, seed: int, index: int) -> PromptItem:
        epoch, position = divmod(index, len(self.train))
        return self._item(index, self.train[self._order(seed, epoch)[position]])

    def held_out(self, n: int) -> list[PromptItem]:
        """The first ``n`` held-out records, with ids far from the training stream's."""
        return [self._item(EVAL_ID_OFFSET + i, row) for i, row in enumerate(self.held_out_rows[:n])]

    def characters(self) -> set[str]:
        """Every character of the prompts (as the built-in tokenizer reads them) and of
        the answers that are strings."""
        found: set[str] = set()
        for row in self.rows:
            found.update(_text(row[self.prompt]))
            if isinstance(row[self.answer], str):
                found.update(row[self.answer])
        return found

    def check_alphabet(self, alphabet: str) -> None:
        """ConfigError naming the first record with a character outside ``alphabet``."""
        allowed = set(alphabet)
        for index, row in enumerate(self.rows):
            for field in (self.prompt, self.answer):
                value = _text(row[field]) if field == self.prompt else row[field]
                outside = "".join(sorted(set(value) - allowed)) if isinstance(value, str) else ""
                if outside:
                    raise ConfigError(
                        f"Task.from_records(alphabet={short_repr(alphabet)}) is invalid: record {index}'s "
                        f"{field!r} holds {outside!r}; add them to the alphabet, or leave alphabet=None to "
                        "take the records' own characters"
                    )

    def longest_answer(self) -> int:
        return max(len(str(row[self.answer])) for row in self.rows)

    def _item(self, prompt_id: int, row_index: int) -> PromptItem:
        # A copy: a reward or environment that changes its row (or answer) changes only this prompt's.
        row = copy.deepcopy(dict(self.rows[row_index]))
        prompt = _encodable(row[self.prompt])
        if isinstance(prompt, str):
            return PromptItem(prompt_id, prompt, row[self.answer], row=row)
        return PromptItem(prompt_id, messages_text(prompt), row[self.answer], row=row, messages=prompt)

    def _order(self, seed: int, epoch: int) -> list[int]:
        """Epoch ``epoch``'s shuffle of the training records for ``seed`` (the last two kept)."""
        key = (seed, epoch)
        order = self._orders.get(key)
        if order is None:
            order = list(range(len(self.train)))
            random.Random(f"{self.name}:{seed}:epoch:{epoch}").shuffle(order)
            while len(self._orders) >= 2:
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = order
        return order

    def __getstate__(self) -> dict[str, Any]:  # a worker makes its own shuffles
        state = dict(self.__dict__)
        state["_orders"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"Records({self.source}, {len(self.train)} to train on, {len(self.held_out_rows)} held out, "
            f"prompt={self.prompt!r}, answer={self.answer!r})"
        )


def _is_chat(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of chat messages ({"role", "content"} strings)."""
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    )


def _encodable(prompt: Any) -> str | tuple[dict[str, str], ...]:
    """A record's prompt as a tokenizer gets it (:attr:`PromptItem.encodable`): the text,
    or the chat messages' roles and contents."""
    if isinstance(prompt, str):
        return prompt
    return tuple({"role": m["role"], "content": m["content"]} for m in prompt)


def _indices(found: list[tuple[int, int]]) -> str:
    """The first record numbers of ``found`` ((index, tokens) pairs), for a message."""
    shown = ", ".join(str(index) for index, _ in found[:5])
    return shown + (", …" if len(found) > 5 else "")


def _text(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else messages_text(prompt)


def _read(records: Any) -> tuple[list[Any], str, bool]:
    """The records of a list, a data frame, a Hugging Face data set or a file, a word
    on where from, and whether they are fresh objects (read here, no one else's)."""
    if isinstance(records, str | os.PathLike):
        path = Path(records)
        if path.suffix not in SUFFIXES:
            raise ConfigError(
                f"Task.from_records(records={str(path)!r}) is invalid: read are {', '.join(SUFFIXES)} files; "
                "or pass a list of dicts or a datasets.Dataset"
            )
        if not path.is_file():
            raise ConfigError(f"Task.from_records(records={str(path)!r}) is invalid: no such file")
        return _read_file(path), repr(str(path)), True
    kinds = {f"{c.__module__.split('.')[0]}.{c.__name__}" for c in type(records).__mro__}
    if kinds & {"datasets.IterableDataset", "torch.IterableDataset"}:
        # A stream may never end, and may be read only once: which records, and how
        # many, is the caller's choice.
        raise ConfigError(
            f"Task.from_records(records={type(records).__name__}) is invalid: a streaming data set may never end; "
            "give a bounded part as a list, e.g. records=list(ds.take(10_000)), or a datasets.Dataset "
            "(load_dataset(..., streaming=False), or datasets.Dataset.from_generator(...))"
        )
    if hasattr(records, "to_list") and hasattr(records, "column_names"):  # datasets.Dataset
        return list(records.to_list()), f"a datasets.Dataset of {len(records)} rows", True
    if hasattr(records, "to_pylist") and hasattr(records, "column_names"):  # pyarrow.Table
        return list(records.to_pylist()), f"a pyarrow.Table of {len(records)} rows", True
    if hasattr(records, "to_dict") and hasattr(records, "columns") and hasattr(records, "iloc"):  # pandas.DataFrame
        # Iterating a data frame gives its column names: its rows are what it means.
        rows = list(records.to_dict("records"))
        return rows, f"a pandas.DataFrame of {len(rows)} rows", False  # object columns share their values
    if hasattr(records, "to_dicts") and hasattr(records, "columns"):  # polars.DataFrame
        rows = list(records.to_dicts())
        return rows, f"a polars.DataFrame of {len(rows)} rows", True
    if isinstance(records, Mapping):
        raise ConfigError(
            f"Task.from_records(records=a {type(records).__name__} of {short_repr(list(records))}) is invalid: a "
            "mapping is not records; pass one split of a data set, e.g. "
            "records=ds['train'], or a list of dicts (a dict of columns: datasets.Dataset.from_dict(columns))"
        )
    if isinstance(records, Iterable) and not isinstance(records, str | bytes):
        rows = list(records)
        return rows, f"a list of {len(rows)}", False
    raise ConfigError(
        f"Task.from_records(records={short_repr(records)}) is invalid: pass a list of dicts, a datasets.Dataset, "
        f"a pandas.DataFrame, or the path of a {', '.join(SUFFIXES)} file"
    )


def _snapshot(rows: list[Any], source: str) -> list[Any]:
    """A deep copy of each of ``rows``; ConfigError naming a record field that cannot be copied."""
    copied = []
    for index, row in enumerate(rows):
        try:
            copied.append(copy.deepcopy(row))
        except Exception as exc:  # deepcopy falls back on pickling: a lock, a generator, an open file
            fields = row.items() if isinstance(row, Mapping) else [("", row)]
            field, value = next(((f, v) for f, v in fields if not _copies(v)), ("", row))
            what = f"record {index}'s {field!r}" if field != "" else f"record {index}"
            raise ConfigError(
                f"Task.from_records(records={source}) is invalid: {what} holds {short_repr(value)}, which cannot "
                f"be copied ({exc}); the task keeps a copy of its records, so give data: strings, numbers, "
                "lists and dicts"
            ) from None
    return copied


def _copies(value: Any) -> bool:
    try:
        copy.deepcopy(value)
    except Exception:
        return False
    return True


def _canonical(value: Any) -> Any:
    """``value`` as JSON data, the same in every process for equal records: for a checkpoint's
    hash of the records. Bytes, dates, numpy and torch values are converted; any other
    object is its type and repr, or its type alone where the repr holds an address."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, Mapping):
        return {str(key): _canonical(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical(item) for item in value]
    if isinstance(value, bytes | bytearray):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, datetime.date | datetime.time):
        return {"time": value.isoformat()}
    if isinstance(value, set | frozenset):
        return sorted((_canonical(item) for item in value), key=repr)
    if callable(getattr(value, "tolist", None)):  # numpy arrays and scalars, torch tensors
        return _canonical(value.tolist())
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    text = repr(value)
    return {"object": kind} if " at 0x" in text else {"object": kind, "repr": text}


def _read_file(path: Path) -> list[Any]:
    """The records in ``path``; ConfigError naming the file (and line) for what cannot be read."""
    where = f"Task.from_records(records={str(path)!r})"
    if path.suffix == ".parquet":
        return _read_parquet(path, where)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where} is invalid: it cannot be read ({exc})") from None
    data = data.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark, as some editors write
    if path.suffix == ".json":
        try:
            rows = json.loads(_decoded(data, path))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where} is invalid: not JSON ({exc})") from None
        if not isinstance(rows, list):
            raise ConfigError(
                f"{where} is invalid: it holds a {type(rows).__name__}; "
                "a .json file must hold a list of records (or write one record per line, as .jsonl)"
            )
        return rows
    rows = []
    for number, line in enumerate(data.splitlines(), 1):
        text = _decoded(line, path, number)
        if not text.strip():
            continue
        try:
            rows.append(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where} is invalid: line {number} is not JSON ({exc})") from None
    return rows


def _decoded(data: bytes, path: Path, line: int | None = None) -> str:
    """``data`` (line ``line`` of ``path``, or the whole file) decoded as UTF-8, JSON's
    encoding; ConfigError naming the line, the column and the byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        start = data.rfind(b"\n", 0, exc.start) + 1 if line is None else 0
        line = data.count(b"\n", 0, exc.start) + 1 if line is None else line
        raise ConfigError(
            f"Task.from_records(records={str(path)!r}) is invalid: line {line} is not UTF-8 (byte "
            f"{data[exc.start : exc.start + 1]!r} at column {exc.start - start + 1}: {exc.reason}); a JSON file is "
            f"UTF-8: convert it, e.g. iconv -f latin1 -t utf-8 {path.name} > utf8-{path.name}"
        ) from None


def _read_parquet(path: Path, where: str) -> list[Any]:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ConfigError(
            f"{where} needs pyarrow to read parquet: install rlnb's 'data' extra (pip install 'rlnb[data]')"
        ) from None
    try:
        return list(pyarrow.parquet.read_table(path).to_pylist())
    except (pyarrow.ArrowException, OSError) as exc:
        raise ConfigError(
            f"{where} is invalid: it is not a parquet file, or it is damaged (a partial download or copy?): "
            f"{exc}; write it again, or give the records another way (.jsonl, a list of dicts)"
        ) from None


def _held_out(n: int, eval_size: int | float, seed: str) -> tuple[int, ...]:
    """The indices of the held-out records: ``eval_size`` of ``n`` (a number or a
    fraction), drawn with ``seed``, in increasing order."""
    if isinstance(eval_size, bool) or not isinstance(eval_size, int | float) or not math.isfinite(eval_size):
        raise ConfigError(
            f"Task.from_records(eval_size={eval_size!r}) is invalid: give a number of records, or a fraction "
            "below 1, e.g. eval_size=0.1"
        )
    if isinstance(eval_size, float) and 0 < eval_size < 1:
        count = max(1, round(n * eval_size))
    elif eval_size == int(eval_size) and eval_size >= 0:
        count = int(eval_size)
    else:
        raise ConfigError(
            f"Task.from_records(eval_size={eval_size!r}) is invalid: give a whole number of records (0 or more), "
            "or a fraction between 0 and 1, e.g. eval_size=0.1"
        )
    if count >= n:
        raise ConfigError(
            f"Task.from_records(eval_size={eval_size!r}) is invalid: it holds out {count} of the {n} records, "
            f"leaving none to train on; use fewer, e.g. eval_size={max(0, n // 10)} or eval_size=0.1"
        )
    return tuple(sorted(random.Random(seed).sample(range(n), count)))

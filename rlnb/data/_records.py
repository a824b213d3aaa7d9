"""Where a task's prompts come from: a generator function, or a data set of records.

A prompt loader's worker gets only this part of a task (:meth:`Task.prompt_source`),
never its reward functions: a data set made in a notebook cell, rewarded by
functions defined there, still has its prompts made in workers.

Records are split once, by ``split_seed``, into a held-out set (never trained on)
and a training set, which the stream walks in a new order each epoch: training
prompt ``index`` is position ``index % n`` of epoch ``index // n``'s shuffle of the
session's seed. A checkpoint's prompt-loader state is the next index, so a loaded
session continues mid-epoch exactly where the saved one would have.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
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
        """Read and check ``records``; ConfigError naming the argument and the fix."""
        rows, source = _read(records)
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
        row = self.rows[row_index]
        prompt = row[self.prompt]
        if isinstance(prompt, str):
            return PromptItem(prompt_id, prompt, row[self.answer], row=dict(row))
        messages = tuple({"role": m["role"], "content": m["content"]} for m in prompt)
        return PromptItem(prompt_id, messages_text(messages), row[self.answer], row=dict(row), messages=messages)

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


def _text(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else messages_text(prompt)


def _read(records: Any) -> tuple[list[Any], str]:
    """The records of a list, a Hugging Face data set or a file, and a word on where from."""
    if isinstance(records, str | os.PathLike):
        path = Path(records)
        if path.suffix not in SUFFIXES:
            raise ConfigError(
                f"Task.from_records(records={str(path)!r}) is invalid: read are {', '.join(SUFFIXES)} files; "
                "or pass a list of dicts or a datasets.Dataset"
            )
        if not path.is_file():
            raise ConfigError(f"Task.from_records(records={str(path)!r}) is invalid: no such file")
        return _read_file(path), repr(str(path))
    if hasattr(records, "to_list") and hasattr(records, "column_names"):  # datasets.Dataset
        return list(records.to_list()), f"a datasets.Dataset of {len(records)} rows"
    if isinstance(records, Iterable) and not isinstance(records, str | bytes | Mapping):
        rows = list(records)
        return rows, f"a list of {len(rows)}"
    raise ConfigError(
        f"Task.from_records(records={short_repr(records)}) is invalid: pass a list of dicts, a datasets.Dataset, "
        f"or the path of a {', '.join(SUFFIXES)} file"
    )


def _read_file(path: Path) -> list[Any]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet
        except ImportError:
            raise ConfigError(
                f"Task.from_records(records={str(path)!r}) needs pyarrow to read parquet: "
                "install rlnb's 'data' extra (pip install 'rlnb[data]')"
            ) from None
        return list(pyarrow.parquet.read_table(path).to_pylist())
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"Task.from_records(records={str(path)!r}) is invalid: not JSON ({exc})") from None
        if not isinstance(rows, list):
            raise ConfigError(
                f"Task.from_records(records={str(path)!r}) is invalid: it holds a {type(rows).__name__}; "
                "a .json file must hold a list of records (or write one record per line, as .jsonl)"
            )
        return rows
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"Task.from_records(records={str(path)!r}) is invalid: line {number} is not JSON ({exc})"
            ) from None
    return rows


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

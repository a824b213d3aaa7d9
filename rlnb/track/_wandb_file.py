"""Read a wandb offline run file (``run-<id>.wandb``) back: history, summary, exit code.

wandb 0.31 no longer ships a reader. The file is a 7-byte header (``":W&B"``, the
magic ``0xBEE1``, a version byte) followed by LevelDB-log framing: 32 KiB blocks of
chunks, each ``<crc32, length, type>`` (7 bytes, little-endian) and its data; a
record too long for one block is split into FIRST, MIDDLE and LAST chunks, and a
block's tail shorter than a chunk header is zero padding. The CRC covers the type
byte and the data. Each record is a ``wandb_internal_pb2.Record`` message.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlnb._errors import InvalidValueError

__all__ = ["WandbRunFile", "read_records", "read_run"]

_FILE_HEADER = struct.Struct("<4sHB")
_CHUNK_HEADER = struct.Struct("<IHB")
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: str | Path) -> Iterator[Any]:
    """Every record of the file at ``path``, in order; ``ValueError`` on a bad header
    or checksum (a file cut short just ends: a killed writer leaves a torn tail)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if len(data) < _FILE_HEADER.size:
        raise InvalidValueError(f"{path}: {len(data)} bytes, shorter than the 7-byte header")
    ident, magic, _version = _FILE_HEADER.unpack_from(data)
    if ident != b":W&B" or magic != 0xBEE1:
        raise InvalidValueError(f"{path}: not a wandb run file (header {data[:7]!r})")
    pos, pending = _FILE_HEADER.size, b""
    while pos + _CHUNK_HEADER.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER.size:  # block padding
            pos += left
            continue
        crc, length, kind = _CHUNK_HEADER.unpack_from(data, pos)
        if crc == 0 and length == 0 and kind == 0:  # zero fill up to the next block
            pos += left
            continue
        start = pos + _CHUNK_HEADER.size
        chunk = data[start : start + length]
        if len(chunk) < length:
            return  # torn tail
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise InvalidValueError(f"{path}: checksum mismatch in the chunk at byte {pos}")
        pos = start + length
        if kind == _FULL:
            whole = chunk
        elif kind == _FIRST:
            pending = chunk
            continue
        elif kind == _MIDDLE:
            pending += chunk
            continue
        elif kind == _LAST:
            whole, pending = pending + chunk, b""
        else:
            raise InvalidValueError(f"{path}: unknown chunk type {kind} at byte {pos}")
        record = wandb_internal_pb2.Record()
        record.ParseFromString(whole)
        yield record


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


@dataclasses.dataclass
class WandbRunFile:
    """What a run file says: ``history`` (one dict per logged step), the final
    ``summary``, the ``config``, the run id and the ``exit_code`` (None if the run
    never wrote its exit record)."""

    run_id: str | None
    config: dict[str, Any]
    history: list[dict[str, Any]]
    summary: dict[str, Any]
    exit_code: int | None
    records: int


def read_run(path: str | Path) -> WandbRunFile:
    """Replay the records of ``path`` into a :class:`WandbRunFile`."""
    run_id, config, history, summary, exit_code, count = None, {}, [], {}, None, 0
    for record in read_records(path):
        count += 1
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update({_key(u): json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            config.update({_key(u): json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            summary.update({_key(u): json.loads(u.value_json) for u in record.summary.update})
            for r in record.summary.remove:
                summary.pop(_key(r), None)
        elif kind == "exit":
            exit_code = record.exit.exit_code
    return WandbRunFile(run_id, config, history, summary, exit_code, count)

"""Read an offline W&B run back: its `run-*.wandb` transaction log.

The file is a LevelDB-style log (W&B's `:W&B` header, 32 KiB blocks of records
with a 7-byte header: CRC-32, length, type), each record a `wandb_internal.Record`
protobuf; `history` records hold what `run.log` logged, as JSON per key.
"""

import json
import struct
import time
from pathlib import Path
from typing import Any


_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: str | Path, *, timeout_s: float = 60.0) -> list[Any]:
    """Return every record of a finished run's `.wandb` file, in order.

    `run.finish()` can return before W&B's service process has written the file
    out (offline mode, seen with wandb 0.31), so this waits (up to `timeout_s`)
    until the last record is the run's `exit` record.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        records = _read(path)
        done = records and records[-1].WhichOneof("record_type") == "exit"
        if done or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def _read(path: str | Path) -> list[Any]:
    data = Path(path).read_bytes()
    pos, chunks, pending = 7, [], b""
    if len(data) < 7:
        return []
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # the block's trailer: padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # a zero-filled rest of the block
            pos += left
            continue
        if pos + 7 + length > len(data):  # still being written
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            chunks.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            chunks.append(pending + chunk)
    # Imported here: pytest imports this module (doctests) also without wandb.
    from wandb.proto import wandb_internal_pb2

    record = wandb_internal_pb2.Record  # pyright: ignore[reportAttributeAccessIssue]
    return [record.FromString(c) for c in chunks]


def history(path: str | Path) -> list[dict[str, Any]]:
    """Return the logged rows: `{key: value}` per `run.log`, with `_step`.

    Nested keys (W&B splits the JSON of a media object into them) are joined by
    "/" again: `{"img": {"_type": ...}}` comes back as `"img": {"_type": ...}`.
    """
    return _rows(read_records(path))


def history_so_far(
    path: str | Path, rows: int, *, timeout_s: float = 30.0
) -> list[dict[str, Any]]:
    """Return the rows in the file of a run that is still open, as `history` does.

    W&B's service writes the file every `x_transaction_log_flush_interval` seconds
    (set it low): this waits (up to `timeout_s`) until `rows` rows are there.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        found = _rows(_read(path))
        if len(found) >= rows or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _rows(records: list[Any]) -> list[dict[str, Any]]:
    rows = []
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict[str, Any] = {}
        for item in record.history.item:
            keys = list(item.nested_key) or [item.key]
            value = json.loads(item.value_json)
            target = row
            for key in keys[:-1]:
                target = target.setdefault(key, {})
            target[keys[-1]] = value
        rows.append(row)
    return rows

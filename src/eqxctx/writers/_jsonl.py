"""JsonlWriter: summaries as JSON lines, one object per step."""

import io
import os
from collections.abc import Mapping
from typing import Any, Literal, TypeAlias

import numpy as np
import orjson

from eqxctx._records import Audio, Histogram, Image

from ._base import AbstractWriter, HostSummaries, is_writing_process
from ._columns import RowBlock
from ._host import HostValue, HostValues, Part, Rows


#: What orjson writes for one value: a NumPy scalar or array (of a dtype orjson
#: serializes), or (a histogram) a dict of them. `object`: only passed to orjson.
JsonValue: TypeAlias = object

#: NumPy arrays and scalars written by orjson itself (float32 values with their
#: shortest decimal), one line each.
_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE


def json_array(arr: np.ndarray) -> JsonValue:
    """`arr` as orjson writes it: a NumPy scalar (rank 0) or a C-ordered array.

    Booleans become 0/1 (`uint8`); bfloat16 and 8-bit floats (`ml_dtypes`, NumPy
    kind "V") become float32, which holds them exactly.
    """
    arr = _column(arr)
    return arr[()] if arr.ndim == 0 else np.ascontiguousarray(arr)


def _column(column: np.ndarray) -> np.ndarray:
    """`arr` as orjson takes it: bool as uint8, `ml_dtypes` floats as float32."""
    kind = column.dtype.kind
    if kind == "b":
        return column.view(np.uint8)
    if kind not in "iuf":
        return column.astype(np.float32)
    # orjson writes native byte order only (a `>f4` array from a file, say).
    return (
        column
        if column.dtype.isnative
        else column.astype(column.dtype.newbyteorder("="))
    )


def nonempty_span(counts: np.ndarray) -> tuple[int, int]:
    """Return `(first, last + 1)` of the non-zero buckets of `counts` ((0, 0): none)."""
    (nonzero,) = np.nonzero(np.asarray(counts).reshape(-1))
    if not nonzero.size:
        return 0, 0
    return int(nonzero[0]), int(nonzero[-1]) + 1


def histogram_json(h: Histogram) -> dict[str, JsonValue]:
    """Return `{"edges": [...], "counts": [...]}` of the non-empty bucket span.

    The buckets from the first to the last non-empty one, with their `k + 1` edges
    (exact float64; an infinite edge is `null`); `{"edges": [], "counts": []}` if
    no value was counted. Stacked histograms (counts `[..., bins]`) give nested
    lists of counts over the span of all of them.
    """
    counts = np.asarray(h.counts)
    first, stop = nonempty_span(counts.sum(axis=tuple(range(counts.ndim - 1))))
    if first == stop:
        return {"edges": [], "counts": []}
    return {
        "edges": list(h.edges[first : stop + 1]),
        "counts": np.ascontiguousarray(counts[..., first:stop]),
    }


def record_value(value: HostValue) -> JsonValue:
    """Return what `JsonlWriter` writes for one fetched value."""
    if isinstance(value, Histogram):
        return histogram_json(value)
    if isinstance(value, Image):
        return json_array(np.asarray(value.images))
    if isinstance(value, Audio):
        return json_array(np.asarray(value.samples))
    return json_array(np.asarray(value))


def _put(record: dict[str, JsonValue], part: Part | Mapping[str, HostValue]) -> None:
    if isinstance(part, Rows) and all(c.ndim == 1 for c in part.columns):
        # Rows of scalars: the columns' NumPy scalars, in the paths' order.
        columns = [list(_column(c)) for c in part.columns]
        flat = (v for row in zip(*columns, strict=True) for v in row)
        record.update(zip(part.paths, flat, strict=True))
        return
    for path, value in part.items():
        record[path] = record_value(value)


def json_record(host: HostSummaries) -> dict[str, JsonValue]:
    """Return the object `JsonlWriter` writes for a step: `{"step": ..., path: ...}`."""
    record: dict[str, JsonValue] = {"step": host.step}
    values = host.values
    for part in values.parts if isinstance(values, HostValues) else [values]:
        _put(record, part)
    return record


def json_line(host: HostSummaries) -> bytes:
    """Return the line `JsonlWriter` writes for one step (with its newline).

    orjson's text of `json_record(host)`: no spaces; float32 values with their
    shortest decimal (float16 and bfloat16 ones with float32's), float64 ones with
    Python's `repr` digits; NaN and infinities as `null`. A row of a buffer read
    column-wise (`HostValues.row`) takes its values from the block's columns, read
    once for all its rows (the same record).
    """
    values = host.values
    row = values.row if type(values) is HostValues else None
    block, i = row if row is not None else (None, 0)
    if not isinstance(block, RowBlock):
        return orjson.dumps(json_record(host), option=_OPTIONS)
    formatted = block.cache.get(_block_values)
    if formatted is None:
        formatted = block.cache[_block_values] = _block_values(block)
    keys, rows = formatted
    record = dict(zip(keys, (host.step, *rows[i]), strict=True))
    return orjson.dumps(record, option=_OPTIONS)


def _iterations(made: list[tuple[int, Any]]) -> int | None:
    """The iterations of a block's `Rows` of scalars (columns `[n, iterations]`)."""
    sizes = {
        v.shape[1] if how == 0 and type(v) is np.ndarray and v.ndim == 2 else -1
        for how, v in made
    }
    size = sizes.pop() if len(sizes) == 1 else -1
    return None if size < 0 else size


def _block_values(block: RowBlock) -> tuple[list[str], list[tuple[JsonValue, ...]]]:
    """The keys of a block's records and each row's values, as `json_record`'s.

    A column of scalars `[n]` (a scan's `[n, iterations]`) becomes its NumPy
    scalars in one `list` call; other values are converted row by row.
    """
    keys = ["step"]
    columns: list[list[JsonValue]] = []  # per key after "step": each row's value
    n = block.n
    for (is_rows, paths), made in zip(block.parts, block.made, strict=True):
        keys.extend(paths)
        if not is_rows:
            for how, v in made:
                if how == 0 and type(v) is np.ndarray and v.ndim == 1:
                    columns.append(list(_column(v)))
                elif how == 1:
                    columns.append([record_value(v)] * n)
                else:
                    columns.append(
                        [record_value(block.value(how, v, i)) for i in range(n)]
                    )
            continue
        size = _iterations(made)
        if size is not None and len(paths) == len(made) * size:
            # Rows of scalars: each row's paths are iteration-major (`Rows`).
            flat = [list(_column(v).reshape(-1)) for _, v in made]
            columns.extend(
                flat[j][it::size] for it in range(size) for j in range(len(made))
            )
            continue
        records: list[dict[str, JsonValue]] = []
        for i in range(n):
            record: dict[str, JsonValue] = {}
            _put(record, Rows(paths, [block.value(how, v, i) for how, v in made]))
            records.append(record)
        columns.extend([r[p] for r in records] for p in paths)
    return keys, list(zip(*columns, strict=True)) if columns else [()] * n


class JsonlWriter(AbstractWriter):
    """Write summaries as JSON lines: one JSON object per `write(step, summaries)`.

    Each line is `{"step": step, path: value, ...}` with the "/"-joined paths of
    `OutputCollection.flatten("summaries")` (per-iteration children of a scan appear
    as `.../iter0/...`, `.../iter1/...`). A value is the leaf's `Summary.value()` (raw
    arrays as they are): a number for a shape-`()` value, nested lists of numbers
    (shape preserved) otherwise, written by orjson: float32 values with their
    shortest decimal (`0.1`, as NumPy's `str`), float16 and bfloat16 values as
    float32's shortest decimal of the same number (exact when read back), float64
    values exactly. Booleans become 0/1. NaN and infinities are written as `null`
    (JSON has no token for them; Python's `json`, pandas, orjson and any other JSON
    reader take the file; pandas reads `null` as NaN). Every leaf is written,
    including images and audio (as nested lists). A
    `MomentsSummary` is written as `path/count`, `path/mean`, `path/variance`,
    `path/min`, `path/max`, `path/nonfinite`; a `HistogramSummary` as one object
    `{"edges": [...], "counts": [...]}` holding the buckets from the first to the
    last non-empty one (`k` counts, `k + 1` edges; both lists empty when nothing was
    counted). Each line is written to the file (one system call, no buffer) as it
    is written, so the file can be read during training, and it is written whole or
    not at all: if the write fails (a full disk, a file-size limit), the part of the
    line already in the file is cut off again before the `OSError` is raised, so
    the file holds only complete steps, and the writer can go on once there is
    room.

    In a multi-process run, create the writer and call `write` on every process
    (after `jax.distributed.initialize`): only process 0 opens and writes the file.

    Read it back with `[json.loads(line) for line in open(path)]` or
    `pandas.read_json(path, lines=True, precise_float=True)`.

    Args:
        path: the file to write (`str` or `os.PathLike`); missing parent folders are
            created.
        mode: `"a"` appends to an existing file (the default), `"w"` truncates it,
            `"x"` refuses to open an existing file (`FileExistsError`).

    Raises:
        OSError: if the file cannot be opened (e.g. `PermissionError`).
        ValueError: for a `mode` other than `"a"`, `"w"`, `"x"`.

    Examples:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "summaries.jsonl"
        >>> with JsonlWriter(path) as writer:
        ...     writer.write(3, {"loss": 0.5, "layer": {"rms": np.array([1.0, 2.0])}})
        >>> print(path.read_text(), end="")
        {"step":3,"loss":0.5,"layer/rms":[1.0,2.0]}
    """

    def __init__(
        self, path: str | os.PathLike[str], *, mode: Literal["a", "w", "x"] = "a"
    ):
        if mode not in ("a", "w", "x"):
            raise ValueError(
                f"`JsonlWriter(mode=...)`: expected 'a', 'w' or 'x', got {mode!r}."
            )
        self.path = os.fspath(path)
        self._closed = False
        self._file: io.FileIO | None = None
        if is_writing_process():
            parent = os.path.dirname(self.path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            # Unbuffered: a line reaches the file in one system call, or is cut off
            # (`write_host`), never left half in a buffer.
            self._file = io.FileIO(self.path, mode)

    def check(self, host: HostSummaries) -> None:
        """Refuse a closed writer and a top-level summary named `"step"`.

        Raises:
            ValueError: after `close()`, or for a summary path `"step"`, which
                would clash with the step number.
        """
        where = "JsonlWriter.write"
        if self._closed:
            raise ValueError(f"`{where}`: the writer for {self.path!r} is closed.")
        if "step" in host.values:
            raise ValueError(
                f"`{where}`: a summary path is 'step', which would clash with the "
                "step number; nest it under a child (e.g. `{'train': summaries}`)."
            )

    def write_host(self, host: HostSummaries) -> None:
        """Append one line `{"step": step, path: value, ...}`, whole or not at all.

        Raises:
            OSError: if the file cannot take the line (e.g. `errno.ENOSPC`, a full
                disk, or `errno.EFBIG`, a file-size limit); what was written of the
                line is cut off first (a note says so if that fails too).
        """
        file = self._file
        if file is None:
            return
        data = memoryview(json_line(host))
        start = file.tell()
        try:
            while data:
                data = data[file.write(data) or 0 :]
        except BaseException as e:  # also an interrupt between two partial writes
            try:
                file.truncate(start)
                file.seek(start)
            except OSError as cut:
                e.add_note(
                    f"`JsonlWriter`: the part of step {host.step}'s line already "
                    f"written to {self.path!r} could not be cut off ({cut!r}): the "
                    "file may end with an incomplete line."
                )
            raise

    def flush(self) -> None:
        """Nothing to do: each line is written to the file as it is written."""

    def close(self) -> None:
        """Close the file; closing twice is allowed."""
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None

"""JsonlWriter: summaries as JSON lines, one object per step."""

import io
import json
import operator
import os
from collections.abc import Iterable, Sequence
from typing import Literal, TypeAlias, TypeGuard, cast

import numpy as np
import orjson

from eqxctx._records import Audio, Histogram, Image

from ._base import AbstractWriter, HostSummaries, is_writing_process
from ._host import HostValue, HostValues, Part, Rows


_POW10 = 10.0 ** np.arange(23)


#: What `json.dumps` writes for one value: a number, nested lists of numbers or
#: (a histogram) a dict of them. `object`: NumPy's `tolist` builds it, untyped, and
#: it is only passed to `json.dumps`.
JsonValue: TypeAlias = object


def shortest_float32(values: np.ndarray) -> list[float]:
    """Return each float32 value as the Python float of its shortest decimal.

    The shortest decimal that reads back as the same float32 (`0.1` for
    `np.float32(0.1)`, not `0.10000000149011612`), as `float(str(np.float32(v)))`
    gives, for a whole array at once: for values in `[1e-12, 2**24)` the number of
    digits is found by a vectorized binary search (the nearest decimal with `d`
    digits reads back for every `d` from the shortest on); zeros, powers of two,
    other magnitudes and non-finite values take `str` one by one.

    Args:
        values: an array of any shape; cast to float32 (float16 values are exact).

    Returns:
        The values in C order, as a flat list of Python floats.
    """
    x = np.asarray(values, dtype=np.float32).reshape(-1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        f = x.astype(np.float64)
        out = f.copy()
        a = np.abs(f)
        # Powers of two have an asymmetric rounding interval: left to `str`.
        fast = (a >= 1e-12) & (a < 2.0**24) & ((x.view(np.uint32) & 0x7FFFFF) != 0)
        idx = np.flatnonzero(fast)
        slow = np.flatnonzero(~fast & np.isfinite(f) & (a != 0))
        if idx.size:
            av = a[idx]
            target = av.astype(np.float32)
            # Step 0 keeps at most one digit; step 10 at least nine (always enough).
            k0 = -np.floor(np.log10(av)).astype(np.int64) - 1

            def nearest(step: np.ndarray) -> np.ndarray:
                # The nearest multiple of 10**-k; exact divisions and products of
                # exact numbers, so correctly rounded.
                k = k0 + step
                scale = _POW10[np.abs(k)]
                up = k >= 0
                m = np.rint(np.where(up, av * scale, av / scale))
                return np.where(up, m / scale, m * scale)

            lo = np.zeros(idx.size, np.int64)
            hi = np.full(idx.size, 10, np.int64)
            for _ in range(4):  # ceil(log2(11)) halvings of [0, 10]
                mid = (lo + hi) >> 1
                ok = nearest(mid).astype(np.float32) == target
                hi = np.where(ok, mid, hi)
                lo = np.where(ok, lo, mid + 1)
            best = nearest(lo)
            good = best.astype(np.float32) == target
            out[idx[good]] = np.copysign(best[good], f[idx[good]])
            slow = np.concatenate([slow, idx[~good]])
    for i in slow.tolist():
        out[i] = float(str(x[i]))
    return out.tolist()


def json_value(arr: np.ndarray) -> JsonValue:
    """Return `arr` as a Python number (rank 0) or nested lists of numbers.

    Booleans become 0/1. Floating values of at most 32 bits are written with the
    shortest decimal that reads back as the same float32 (`0.1`, not
    `0.10000000149011612`); float64 values are written exactly.
    """
    kind = arr.dtype.kind
    if kind == "b":
        return arr.astype(np.int64).tolist()
    if kind in "iu":
        return arr.tolist()
    if arr.dtype.itemsize <= 4:
        if arr.ndim == 0:
            return float(str(np.float32(arr)))
        short = shortest_float32(arr)
        return np.asarray(short, dtype=np.float64).reshape(arr.shape).tolist()
    return arr.astype(np.float64).tolist()


def nonempty_span(counts: np.ndarray) -> tuple[int, int]:
    """Return `(first, last + 1)` of the non-zero buckets of `counts` ((0, 0): none)."""
    (nonzero,) = np.nonzero(np.asarray(counts).reshape(-1))
    if not nonzero.size:
        return 0, 0
    return int(nonzero[0]), int(nonzero[-1]) + 1


def histogram_json(h: Histogram) -> dict[str, JsonValue]:
    """Return `{"edges": [...], "counts": [...]}` of the non-empty bucket span.

    The buckets from the first to the last non-empty one, with their `k + 1` edges
    (exact float64); `{"edges": [], "counts": []}` if no value was counted.
    Stacked histograms (counts `[..., bins]`) give nested lists of counts over
    the span of all of them.
    """
    counts = np.asarray(h.counts)
    first, stop = nonempty_span(counts.sum(axis=tuple(range(counts.ndim - 1))))
    if first == stop:
        return {"edges": [], "counts": []}
    return {
        "edges": list(h.edges[first : stop + 1]),
        "counts": counts[..., first:stop].tolist(),
    }


def record_value(value: HostValue) -> JsonValue:
    """Return what `JsonlWriter` writes for one fetched value."""
    if type(value) is np.ndarray:
        return json_value(value)
    if isinstance(value, Histogram):
        return histogram_json(value)
    if isinstance(value, Image):
        return json_value(value.images)
    if isinstance(value, Audio):
        return json_value(value.samples)
    return json_value(value)


def json_record(host: HostSummaries) -> dict[str, JsonValue]:
    """Return the object `JsonlWriter` writes for one step: `{"step": ..., path: ...}`.

    Scalar floats (per-iteration summaries give thousands) are converted together
    by `shortest_float32`.
    """
    record: dict[str, JsonValue] = {"step": host.step}
    _fill(record, host.values.items())
    return record


def _fill(record: dict[str, JsonValue], items: Iterable[tuple[str, HostValue]]) -> None:
    scalars: list[str] = []
    values: list[np.ndarray] = []
    for path, value in items:
        if _is_float32_scalar(value):
            record[path] = None  # keeps the order; filled below
            scalars.append(path)
            values.append(value)
        else:
            record[path] = record_value(value)
    if scalars:
        floats = np.fromiter(values, np.float32, len(values))
        record.update(zip(scalars, shortest_float32(floats), strict=True))


def json_line(host: HostSummaries) -> str:
    """Return `json.dumps(json_record(host))`, formatting per-iteration rows together.

    The rows of a scan's scalar summaries (`HostValues.parts`) are written from their
    stacked arrays: keys from a per-layout cache, values converted in one pass.
    """
    values = host.values
    if isinstance(values, HostValues) and values.layout is not None:
        plan = _line_plan(values)
        if plan is not None:
            return plan.line(host.step, values.parts)
    parts = values.parts if isinstance(values, HostValues) else [dict(values)]
    pieces = [f'"step": {host.step}']
    for part in parts:
        text = _rows_json(part) if isinstance(part, Rows) else _part_json(part)
        if text:
            pieces.append(text)
    return "{" + ", ".join(pieces) + "}"


class _LinePlan:
    """How to write the values of one layout (`HostValues.layout`) as a line.

    The `"path": ` keys in order, computed once; every float32 scalar of the line
    (a dict's 0-d values, the float32 columns of `Rows`) converted by one
    `float32_texts` call; the other values one by one (a dict's) or per column.
    """

    __slots__ = ("columns", "floats", "keys", "positions", "singles")

    def __init__(self, values: HostValues):
        self.keys: list[str] = []
        #: `(part index, float32 column indices of Rows, paths of a dict's float32
        #: scalars)`, one list empty, in the order they are gathered.
        self.floats: list[tuple[int, list[int], list[str]]] = []
        self.positions: list[int] = []  # of the gathered floats in the line
        self.singles: list[tuple[int, int, str]] = []  # (position, part, path)
        self.columns: list[tuple[list[int], int, int]] = []  # (positions, part, j)
        for k, part in enumerate(values.parts):
            start = len(self.keys)
            self.keys += [json.dumps(path) + ": " for path in _paths(part)]
            if isinstance(part, Rows):
                width = len(part.columns)
                rows = len(part.paths) // width if width else 0
                floats = [j for j, c in enumerate(part.columns) if _is_float32(c.dtype)]
                if floats:
                    self.floats.append((k, floats, []))
                    self.positions += [
                        start + i * width + j for i in range(rows) for j in floats
                    ]
                for j, c in enumerate(part.columns):
                    if not _is_float32(c.dtype):
                        where = [start + i * width + j for i in range(rows)]
                        self.columns.append((where, k, j))
                continue
            scalars: list[str] = []
            for i, (path, value) in enumerate(part.items()):
                if _is_float32_scalar(value):
                    scalars.append(path)
                    self.positions.append(start + i)
                else:
                    self.singles.append((start + i, k, path))
            if scalars:
                self.floats.append((k, [], scalars))

    def line(self, step: int, parts: list[Part]) -> str:
        """The line of one step whose values have this plan's layout."""
        floats = float32_texts(self._floats(parts)) if self.floats else []
        return self._line(step, parts, floats)

    def lines(self, steps: list[tuple[int, list[Part]]]) -> list[str]:
        """The lines of several steps of this plan's layout (`line` of each).

        Their float32 scalars are converted by one `float32_texts` call.
        """
        if not self.floats:
            return [self._line(step, parts, []) for step, parts in steps]
        chunks = [self._floats(parts) for _, parts in steps]
        texts = float32_texts(np.concatenate(chunks))
        n = len(self.positions)
        return [
            self._line(step, parts, texts[i * n : (i + 1) * n])
            for i, (step, parts) in enumerate(steps)
        ]

    def _floats(self, parts: list[Part]) -> np.ndarray:
        """The float32 scalars of one step, in the order of `positions`."""
        chunks: list[np.ndarray] = []
        for k, floats, scalars in self.floats:
            part = parts[k]
            if floats:
                columns = cast(Rows, part).columns
                chunks.append(
                    np.stack([columns[j] for j in floats], axis=1).reshape(-1)
                )
            else:
                values = cast(dict[str, HostValue], part)
                chunks.append(
                    np.fromiter((values[p] for p in scalars), np.float32, len(scalars))
                )
        return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)

    def _line(self, step: int, parts: list[Part], floats: list[str]) -> str:
        """The line of one step, its float32 scalars' texts given."""
        texts = [""] * len(self.keys)
        for p, text in zip(self.positions, floats, strict=True):
            texts[p] = text
        for p, k, path in self.singles:
            value = cast(dict[str, HostValue], parts[k])[path]
            texts[p] = json.dumps(record_value(value))
        for where, k, j in self.columns:
            column = cast(Rows, parts[k]).columns[j]
            for p, text in zip(where, _column_texts(column), strict=True):
                texts[p] = text
        body = ", ".join(map(operator.add, self.keys, texts))
        return f'{{"step": {step}, {body}}}' if body else f'{{"step": {step}}}'


def json_lines(hosts: Sequence[HostSummaries]) -> list[str]:
    """`json_line` of each of `hosts`, the steps of one layout formatted together.

    The float32 scalars of all the steps replayed from one layout (a buffer's,
    `write_buffer`) are converted by one `float32_texts` call.
    """
    lines: list[str | None] = [None] * len(hosts)
    groups: dict[int, tuple[_LinePlan, list[int]]] = {}
    for i, host in enumerate(hosts):
        values = host.values
        plan = (
            _line_plan(values)
            if isinstance(values, HostValues) and values.layout is not None
            else None
        )
        if plan is None:
            lines[i] = json_line(host)
        else:
            groups.setdefault(id(plan), (plan, []))[1].append(i)
    for plan, where in groups.values():
        steps = [
            (hosts[i].step, cast(HostValues, hosts[i].values).parts) for i in where
        ]
        for i, line in zip(where, plan.lines(steps), strict=True):
            lines[i] = line
    return cast(list[str], lines)


def _paths(part: Part) -> Iterable[str]:
    return part.paths if isinstance(part, Rows) else part


def _is_float32_scalar(value: HostValue) -> TypeGuard[np.ndarray]:
    """Whether `value` is a 0-d float of at most 32 bits (for `float32_texts`)."""
    return (
        type(value) is np.ndarray
        and value.ndim == 0
        and value.dtype.kind == "f"
        and value.dtype.itemsize <= 4
    )


#: `id(layout)` -> `(layout, its plan)` (None: written part by part); the layout is
#: held, so its id stays its own.
_PLANS: dict[int, tuple[object, _LinePlan | None]] = {}


def _line_plan(values: HostValues) -> _LinePlan | None:
    entry = _PLANS.get(id(values.layout))
    if entry is not None and entry[0] is values.layout:
        return entry[1]
    # Rows of scalars only (other rows are written as nested lists, part by part).
    plan = (
        None
        if any(
            isinstance(part, Rows) and any(c.ndim != 1 for c in part.columns)
            for part in values.parts
        )
        else _LinePlan(values)
    )
    if len(_PLANS) >= 64:
        _PLANS.clear()
    _PLANS[id(values.layout)] = (values.layout, plan)
    return plan


# `'"path": '` of each path of a layout's rows, by the identity of the paths tuple
# (one cached object per layout; hashing its thousands of items took ~45 µs a write).
# Each entry holds its tuple, so the id stays its own.
_KEYS: dict[int, tuple[tuple[str, ...], list[str]]] = {}


def _part_json(part: dict[str, HostValue]) -> str:
    """The `"path": value` pairs of `part`, joined with `", "` (as `json.dumps`).

    Scalar floats of at most 32 bits are written together (`float32_texts`).
    """
    keys: list[str] = []
    texts: list[str] = []
    where: list[int] = []
    scalars: list[np.ndarray] = []
    for path, value in part.items():
        keys.append(json.dumps(path) + ": ")
        if _is_float32_scalar(value):
            where.append(len(texts))
            scalars.append(value)
            texts.append("")
        else:
            texts.append(json.dumps(record_value(value)))
    if scalars:
        floats = np.fromiter(scalars, np.float32, len(scalars))
        for i, text in zip(where, float32_texts(floats), strict=True):
            texts[i] = text
    return ", ".join(map(operator.add, keys, texts))


def _rows_json(rows: Rows) -> str:
    """The `"path": value` pairs of `rows`, joined with `", "` (as `json.dumps`)."""
    columns = rows.columns
    if not columns or any(c.ndim != 1 for c in columns):
        record: dict[str, JsonValue] = {}
        _fill(record, rows.items())
        return json.dumps(record)[1:-1]
    paths = rows.paths
    entry = _KEYS.get(id(paths))
    if entry is not None and entry[0] is paths:
        keys = entry[1]
    else:
        keys = [json.dumps(path) + ": " for path in paths]
        if len(_KEYS) < 256:
            _KEYS[id(paths)] = (paths, keys)
    if all(_is_float32(c.dtype) for c in columns):
        # One matrix [iterations, columns] in row order: the paths' order.
        texts = float32_texts(np.stack(columns, axis=1).reshape(-1))
    else:
        # The float32 columns in one matrix (one `orjson` call), the others apart.
        floats = [j for j, c in enumerate(columns) if _is_float32(c.dtype)]
        per_column = [
            None if _is_float32(c.dtype) else _column_texts(c) for c in columns
        ]
        if floats:
            matrix = np.stack([columns[j] for j in floats], axis=1).reshape(-1)
            flat = float32_texts(matrix)
            for k, j in enumerate(floats):
                per_column[j] = flat[k :: len(floats)]
        texts = [t for row in zip(*per_column, strict=True) for t in row]
    return ", ".join(map(operator.add, keys, texts))


def _is_float32(dtype: np.dtype[np.generic]) -> bool:
    """Whether `json_value` writes values of `dtype` as float32 shortest decimals.

    Its rule: neither bool nor integer, at most 4 bytes (bfloat16 and the other
    `ml_dtypes` floats have NumPy kind "V").
    """
    return dtype.kind not in "biu" and dtype.itemsize <= 4


def _column_texts(column: np.ndarray) -> list[str]:
    """Each value of a 1-D column as `json.dumps` writes `json_value` of it."""
    kind = column.dtype.kind
    if kind == "b":
        return list(map(str, column.astype(np.int64).tolist()))
    if kind in "iu":
        return list(map(str, column.tolist()))
    if _is_float32(column.dtype):
        return float32_texts(column)
    return [json.dumps(v) for v in column.astype(np.float64).tolist()]


def float32_texts(values: np.ndarray) -> list[str]:
    """Return `json.dumps(v)` of the shortest decimal of each float32 value.

    The same text as `json.dumps(shortest_float32(values))`' items (`0.1`, `1e-05`,
    `NaN`), from one `orjson` call over the array: orjson writes each float32's
    shortest decimal, spelled as Python's `repr` for magnitudes in `[1e-4, 1e13)`.
    Other magnitudes, which orjson spells its own way (`1e-7`, `0.00001`, `1e+13`;
    `1e20` in older versions), are re-spelled one by one, and non-finite values
    (orjson's `null`) are written as `json` writes them: `NaN`, `Infinity`,
    `-Infinity`.

    Args:
        values: a 1-D array of floats of at most 32 bits (float16 and bfloat16
            values are exact in float32).
    """
    x = np.asarray(values, dtype=np.float32)
    texts = orjson.dumps(x, option=orjson.OPT_SERIALIZE_NUMPY).decode()[1:-1].split(",")
    if not texts[0]:
        return []
    a = np.abs(x)
    with np.errstate(invalid="ignore"):
        respell = ~np.isfinite(x) | ((a < 1.1e-4) & (a != 0)) | (a >= 9e12)
    for i in np.flatnonzero(respell).tolist():
        text = texts[i]
        texts[i] = json.dumps(float(str(x[i]))) if text == "null" else repr(float(text))
    return texts


class JsonlWriter(AbstractWriter):
    """Write summaries as JSON lines: one JSON object per `write(step, summaries)`.

    Each line is `{"step": step, path: value, ...}` with the "/"-joined paths of
    `OutputCollection.flatten("summaries")` (per-iteration children of a scan appear
    as `.../iter0/...`, `.../iter1/...`). A value is the leaf's `Summary.value()` (raw
    arrays as they are): a number for a shape-`()` value, nested lists of numbers
    (shape preserved) otherwise. Booleans become 0/1; NaN and infinities are written
    as `NaN` / `Infinity` / `-Infinity`, as Python's `json` module does (and reads
    back). Every leaf is written, including images and audio (as nested lists). A
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
    `pandas.read_json(path, lines=True)`.

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
        {"step": 3, "loss": 0.5, "layer/rms": [1.0, 2.0]}
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
        #: `id(host)` -> `(host, its line)`, from `prepare_hosts`.
        self._prepared: dict[int, tuple[HostSummaries, str]] = {}
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

    def prepare_hosts(self, hosts: Sequence[HostSummaries]) -> None:
        """Format the lines of `hosts` (a buffer's steps) together, for `write_host`.

        Their float32 scalars are converted in one pass (`json_lines`); each
        `write_host` of one of them writes its line. The lines are kept until the
        next `prepare_hosts`. Never raises: a step that cannot be formatted raises
        at its `write_host`.
        """
        self._prepared = {}
        if self._file is None:
            return
        try:
            lines = json_lines(hosts)
        except Exception:
            return
        self._prepared = {
            id(host): (host, line) for host, line in zip(hosts, lines, strict=True)
        }

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
        prepared = self._prepared.pop(id(host), None)
        line = (
            prepared[1]
            if prepared is not None and prepared[0] is host
            else json_line(host)
        )
        data = memoryview((line + "\n").encode())
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

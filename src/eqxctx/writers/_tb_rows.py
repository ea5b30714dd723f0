"""A buffer's rows as TensorBoard `Summary` messages, encoded column-wise.

`TensorBoardWriter` writes each row of a `SummaryBuffer` read column-wise
(`_columns.RowBlock`) from bytes made once for all of the block's rows: the
scalars of every row are converted to float32 at once and put between their tags'
encodings (protobuf's wire format), and the histograms of a `HistogramSummary`
column share their edges' arithmetic; other values (images, audio, raw arrays)
are encoded row by row, as `write` encodes them. Each row's bytes parse to the
`Summary` that `write` of that row alone makes.
"""

import functools
import struct
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import numpy as np

from eqxctx._records import Histogram

from ._columns import RecordRows, RowBlock
from ._host import HostValue, Rows


#: The serialized `Summary` of one step's values (a part, or one value), b"" for
#: none: serialized `Summary` messages joined parse as one with all their values.
Encode: TypeAlias = Callable[[dict[str, HostValue] | Rows], bytes]

DBL_MAX = float(np.finfo(np.float64).max)
_BYTES = [bytes((k,)) for k in range(0x80)]


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _BYTES[n]
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (a string, bytes or a message)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _histogram_entry(tag: str, histo: bytes) -> bytes:
    """`Summary(value=[Value(tag=tag, histo=...)])` from the serialized histogram."""
    return _field(1, _field(1, tag.encode()) + _field(5, histo))


@functools.lru_cache(maxsize=256)  # one per scalar run of each layout
def _scalar_template(tags: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A row of `Summary(value=[Value(tag=t, simple_value=...) for t in tags])`.

    Returns the row's bytes with 0 for every float (`uint8[length]`) and the
    positions of the floats' 4 little-endian bytes, in `tags`' order
    (`int[4 * len(tags)]`).
    """
    row = bytearray()
    positions: list[int] = []
    for tag in tags:
        entry = _field(1, _field(1, tag.encode()) + b"\x15\0\0\0\0")  # float field 2
        positions.extend(range(len(row) + len(entry) - 4, len(row) + len(entry)))
        row += entry
    return np.frombuffer(bytes(row), np.uint8), np.asarray(positions, np.intp)


def scalar_rows(tags: Sequence[str], floats: np.ndarray) -> list[bytes]:
    """Each row's `Summary` of the scalars `floats` (`float64[n, len(tags)]`).

    Each value is stored as a float32 as protobuf stores a Python float (C's
    conversion: overflow to ±infinity, NaN kept).
    """
    template, positions = _scalar_template(tuple(tags))
    n = floats.shape[0]
    with np.errstate(over="ignore"):
        singles = floats.astype("<f4")
    rows = np.tile(template, (n, 1))
    rows[:, positions] = singles.view(np.uint8).reshape(n, -1)
    data = rows.tobytes()
    size = template.size
    return [data[i * size : (i + 1) * size] for i in range(n)]


def center_sums(kept: np.ndarray, centers: np.ndarray) -> tuple[float, float, float]:
    """`(num, sum, sum_squares)` of counts estimated at their buckets' centers.

    `kept`: the counts of the non-empty span, `centers`: each bucket's center
    (float64 arrays of their own, as both writing paths make them).
    """
    return float(kept.sum()), float(kept @ centers), float(kept @ centers**2)


def histogram_bytes(
    doubles: tuple[float, float, float, float, float],
    limits: np.ndarray,
    buckets: np.ndarray,
) -> bytes:
    """A serialized `HistogramProto`, the bytes protobuf itself gives.

    `doubles`: `(min, max, num, sum, sum_squares)`, fields 1-5 (each left out
    where its bits are 0, as proto3 does); `limits`, `buckets`: the packed
    float64 fields 6 and 7 (left out where empty).
    """
    if 0.0 in doubles:  # (also -0.0, written: its bits are not 0)
        out = b"".join(
            _DOUBLE.pack(number << 3 | 1, x)
            for number, x in enumerate(doubles, start=1)
            if _DOUBLE.pack(0, x) != _DOUBLE.pack(0, 0.0)
        )
    else:
        out = _DOUBLES.pack(
            9,
            doubles[0],
            17,
            doubles[1],
            25,
            doubles[2],
            33,
            doubles[3],
            41,
            doubles[4],
        )
    for number, array in ((6, limits), (7, buckets)):
        if array.size:
            out += _field(number, array.astype("<f8").tobytes())
    return out


#: A 64-bit field (key, value); the five of `histogram_bytes`.
_DOUBLE = struct.Struct("<Bd")
_DOUBLES = struct.Struct("<" + "Bd" * 5)


def bucket_centers(span: np.ndarray) -> np.ndarray:
    """Each bucket's center; one open to ±DBL_MAX is represented by its finite edge."""
    left, right = span[:-1], span[1:]
    with np.errstate(over="ignore"):  # (left + right) where right is DBL_MAX
        middle = np.where(right >= DBL_MAX, left, (left + right) / 2)
    return np.where(left <= -DBL_MAX, right, middle)


def histogram_rows(tag: str, histograms: RecordRows, n: int) -> list[bytes]:
    """Each row's `Summary` of a column of `Histogram`s (b"" where none counted).

    Row `i` equals the row-by-row encoding of `histograms[i, ...]`: the same
    spans, edges and centers (elementwise, from all edges at once), and the same
    sums over fresh arrays of the span.
    """
    record: Histogram = histograms.record  # pyright: ignore[reportAssignmentType]
    counts = np.asarray(record.counts)
    bins = counts.shape[-1]
    # Integer counts: their sums are exact in any order.
    summed = counts.reshape(n, -1, bins).sum(axis=1)
    nonzero = summed != 0
    counted = nonzero.any(axis=1).tolist()
    firsts = nonzero.argmax(axis=1).tolist()
    stops = (bins - nonzero[:, ::-1].argmax(axis=1)).tolist()
    edges = np.clip(np.asarray(record.edges), -DBL_MAX, DBL_MAX)
    centers = bucket_centers(edges)
    out: list[bytes] = []
    for i in range(n):
        if not counted[i]:
            out.append(b"")
            continue
        first, stop = firsts[i], stops[i]
        kept = summed[i, first:stop].astype(np.float64)
        sums = center_sums(kept, centers[first:stop].copy())
        low, high = float(edges[first]), float(edges[stop])
        histo = histogram_bytes((low, high, *sums), edges[first + 1 : stop + 1], kept)
        out.append(_histogram_entry(tag, histo))
    return out


def _column(how: int, v: Any, n: int) -> np.ndarray | None:
    """The `[n, ...]` array of a block's `(how, v)`, or None (not an array)."""
    if type(v) is not np.ndarray:
        return None
    if how == 0:
        return v
    return np.broadcast_to(v, (n, *v.shape)) if how == 1 else None


def block_rows(
    block: RowBlock,
    tags: Callable[[tuple[str, ...]], list[str]],
    encode: Encode,
) -> list[bytes]:
    """Each row's serialized `Summary`, as `encode` gives it row by row.

    `tags`: the tags of a part's paths; `encode`: the writer's row-by-row
    encoding of a part (used for what is not read column-wise here).
    """
    n = block.n
    segments: list[Sequence[bytes]] = []  # per segment, each row's bytes
    run_tags: list[str] = []  # scalars not yet encoded: tags, float64 [n, k] blocks
    run: list[np.ndarray] = []

    def end_run() -> None:
        if run_tags:
            floats = run[0] if len(run) == 1 else np.concatenate(run, axis=1)
            segments.append(scalar_rows(run_tags, floats))
            run_tags.clear()
            run.clear()

    for (is_rows, paths), made in zip(block.parts, block.made, strict=True):
        part_tags = tags(paths)
        if is_rows:
            columns = [_column(how, v, n) for how, v in made]
            if columns and all(c is not None and c.ndim == 2 for c in columns):
                # Rows of scalars, iteration-major, converted as `write` converts
                # them (stacked first: one common dtype).
                stacked = np.stack(columns, axis=2).astype(np.float64)  # pyright: ignore[reportArgumentType, reportCallIssue]
                run_tags.extend(part_tags)
                run.append(stacked.reshape(n, -1))
                continue
            end_run()
            segments.append(
                [
                    encode(Rows(paths, [block.value(how, v, i) for how, v in made]))
                    for i in range(n)
                ]
            )
            continue
        for path, tag, (how, v) in zip(paths, part_tags, made, strict=True):
            column = _column(how, v, n)
            if column is not None and column.ndim == 1:  # scalars: float(value)
                run_tags.append(tag)
                run.append(column.astype(np.float64).reshape(n, 1))
                continue
            end_run()
            if (
                how == 0
                and type(v) is RecordRows
                and type(v.record) is Histogram
                and type(v.record.counts) is np.ndarray
            ):
                segments.append(histogram_rows(tag, v, n))
            elif how == 1:  # the same value every row: encoded once
                segments.append([encode({path: block.value(how, v, 0)})] * n)
            else:
                segments.append(
                    [encode({path: block.value(how, v, i)}) for i in range(n)]
                )
    end_run()
    if not segments:
        return [b""] * n
    if len(segments) == 1:
        return list(segments[0])
    return [b"".join(row) for row in zip(*segments, strict=True)]

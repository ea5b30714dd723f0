"""A buffer's rows as TensorBoard `Summary` messages, made column-wise.

`TensorBoardWriter` writes each row of a `SummaryBuffer` read column-wise
(`_columns.RowBlock`) from a `Summary` made for all of the block's rows at once,
through protobuf's own API: the scalars of every row are converted at once and
assigned to a copy of a message holding their tags, and the histograms of a
`HistogramSummary` column share their edges' arithmetic; other values (images,
audio, raw arrays) are added row by row, as `write` adds them. Each row's
`Summary` equals the one that `write` of that row alone makes.
"""

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np

from eqxctx._records import Histogram

from ._columns import RecordRows, RowBlock
from ._host import HostValue, Rows


#: A tensorboardX protobuf message or class (`Summary`, `Summary.Value`'s list).
#: `Any`: tensorboardX is optional, imported by the writer.
Proto: TypeAlias = Any
#: The writer's `_add_values`: add a part's `Summary.Value`s to a repeated field.
AddValues: TypeAlias = Callable[[Proto, Mapping[str, HostValue] | Rows], None]

DBL_MAX = float(np.finfo(np.float64).max)


@functools.lru_cache(maxsize=256)  # one per scalar run of each layout
def _scalar_template(summary: Proto, tags: tuple[str, ...]) -> Proto:
    """`summary(value=[Value(tag=t) for t in tags])`: the tags of a scalar run."""
    template = summary()
    add = template.value.add
    for tag in tags:
        add(tag=tag)
    return template


def add_scalar_rows(
    out: Sequence[Proto], summary: Proto, tags: Sequence[str], floats: np.ndarray
) -> None:
    """Add row `i` of the scalars `floats` (`float64[n, len(tags)]`) to `out[i]`.

    Each row's values are a copy of a message holding the tags (`MergeFrom`), with
    their `simple_value`s assigned: protobuf stores each Python float as a float32,
    as `write` stores `float(value)`.
    """
    template = _scalar_template(summary, tuple(tags))
    for message, row in zip(out, floats.tolist(), strict=True):
        start = len(message.value)
        message.MergeFrom(template)
        for value, f in zip(message.value[start:], row, strict=True):
            value.simple_value = f


def center_sums(kept: np.ndarray, centers: np.ndarray) -> tuple[float, float, float]:
    """`(num, sum, sum_squares)` of counts estimated at their buckets' centers.

    `kept`: the counts of the non-empty span, `centers`: each bucket's center
    (float64 arrays of their own, as both writing paths make them).
    """
    return float(kept.sum()), float(kept @ centers), float(kept @ centers**2)


def bucket_centers(span: np.ndarray) -> np.ndarray:
    """Each bucket's center; one open to ±DBL_MAX is represented by its finite edge."""
    left, right = span[:-1], span[1:]
    with np.errstate(over="ignore"):  # (left + right) where right is DBL_MAX
        middle = np.where(right >= DBL_MAX, left, (left + right) / 2)
    return np.where(left <= -DBL_MAX, right, middle)


def add_histogram_rows(
    out: Sequence[Proto], tag: str, histograms: RecordRows, n: int
) -> None:
    """Add row `i` of a column of `Histogram`s to `out[i]` (nothing where none counted).

    Row `i` equals `write`'s histogram of `histograms[i, ...]`: the same spans,
    edges and centers (elementwise, from all edges at once), and the same sums
    over fresh arrays of the span.
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
    limits = edges.tolist()
    for i in range(n):
        if not counted[i]:
            continue
        first, stop = firsts[i], stops[i]
        kept = summed[i, first:stop].astype(np.float64)
        histo = out[i].value.add(tag=tag).histo
        histo.num, histo.sum, histo.sum_squares = center_sums(
            kept, centers[first:stop].copy()
        )
        histo.min, histo.max = limits[first], limits[stop]
        histo.bucket_limit.extend(limits[first + 1 : stop + 1])
        histo.bucket.extend(kept.tolist())


def _column(how: int, v: Any, n: int) -> np.ndarray | None:
    """The `[n, ...]` array of a block's `(how, v)`, or None (not an array)."""
    if type(v) is not np.ndarray:
        return None
    if how == 0:
        return v
    return np.broadcast_to(v, (n, *v.shape)) if how == 1 else None


def block_rows(
    block: RowBlock,
    summary: Proto,
    tags: Callable[[tuple[str, ...]], list[str]],
    add_values: AddValues,
) -> list[Proto]:
    """Each row's `Summary` (of the class `summary`), as `write` makes it row by row.

    `tags`: the tags of a part's paths; `add_values`: the writer's row-by-row
    adding of a part's values (used for what is not read column-wise here).
    """
    n = block.n
    out = [summary() for _ in range(n)]
    run_tags: list[str] = []  # scalars not yet added: tags, float64 [n, k] blocks
    run: list[np.ndarray] = []

    def end_run() -> None:
        if run_tags:
            floats = run[0] if len(run) == 1 else np.concatenate(run, axis=1)
            add_scalar_rows(out, summary, run_tags, floats)
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
            for i, message in enumerate(out):
                values = [block.value(how, v, i) for how, v in made]
                add_values(message.value, Rows(paths, values))
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
                add_histogram_rows(out, tag, v, n)
            else:
                for i, message in enumerate(out):
                    add_values(message.value, {path: block.value(how, v, i)})
    end_run()
    return out

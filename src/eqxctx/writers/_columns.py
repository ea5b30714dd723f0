"""A fetched `SummaryBuffer`'s rows as `HostValues`, read column-wise (issue 39).

Every row of one structure shares its recipe (`_read.py`): it is replayed once over
the structure's `[n, ...]` columns (`replay_rows`), so that a kind whose
`host_value` is elementwise is validated and read once per buffer; what is left per
row is indexing the columns, and the writers' formatting. Rows are read one by one
(`prefetched_rows`) where a structure has no recipe yet or a row fails.
"""

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from eqxctx._records import is_record_type
from eqxctx._typing import TreeDef

from ._buffer import BufferRows
from ._fetch import Started
from ._host import HostValues, Part, Recipe, Refused, Rows, make_value
from ._read import Flat, Prefetched, known_recipe, recipe_key


def buffer_values(fetched: BufferRows, *, where: str) -> list[HostValues] | None:
    """Each row's `HostValues` (in the buffer's order), or None: read row by row.

    None where a structure has no recipe yet (its first read records it), is read
    in full every time (e.g. a `CallbackSummary`), or holds a row that fails a
    check (the row-by-row read raises, naming the path). Each row equals
    `host_values` of that row alone.
    """
    out: list[HostValues | None] = [None] * len(fetched.steps)
    for k, layout in enumerate(fetched.layouts):
        positions, columns = fetched.columns(k)
        if not positions:
            continue
        first = [
            c[0, ...] if a else c for c, a in zip(columns, layout.arrays, strict=True)
        ]
        tree = layout.treedef.unflatten(first)
        key = recipe_key(jax.tree_util.tree_structure(tree), first, tree)
        recipe = known_recipe(key)
        if recipe is None:
            return None
        rows = replay_rows(recipe, columns, layout.arrays, len(positions))
        if rows is None:
            return None
        for i, values in zip(positions, rows, strict=True):
            out[i] = values
    return [values for values in out if values is not None]


def prefetched_rows(fetched: BufferRows) -> list[tuple[int, Prefetched]]:
    """Each step of a fetched buffer as `(step, Prefetched)`, to read one by one.

    The steps of one structure share its flattening and recipe key, found once.
    """
    flats: dict[int, tuple[object, TreeDef, object]] = {}
    out: list[tuple[int, Prefetched]] = []
    for step, leaves, layout in fetched.rows:
        known = flats.get(id(layout))
        if known is None:
            tree = layout.treedef.unflatten(leaves)
            treedef = jax.tree_util.tree_structure(tree)
            key = recipe_key(treedef, leaves, tree)
            known = flats[id(layout)] = (tree, treedef, key)
        flat = Flat(known[0], leaves, known[1], known[2])
        out.append((step, Prefetched(flat, Started(leaves, [], None, None, False))))
    return out


def replay_rows(
    recipe: Recipe, columns: Sequence[Any], stacked: Sequence[bool], n: int
) -> list[HostValues] | None:
    """The `HostValues` of `n` rows of `recipe`'s structure, read column-wise.

    `columns[k]`: leaf `k` of every row, stacked `[n, ...]` where `stacked[k]`,
    else the one value all rows share (a static leaf). Each row equals
    `recipe.replay` of that row's leaves. A check or value whose function is
    `rowwise` (see `_rowwise`) runs once over the stacked leaves, the others
    once per row; where a stacked one raises, or gives other than a NumPy
    array of `n` rows and the recorded dtype, it runs once per row instead.

    Returns:
        One `HostValues` per row, or None where a row's check or value fails
        (read the rows one by one: the full read names the path).
    """
    rows: list[list[Any] | None] = [None] * n

    def row(i: int) -> list[Any]:  # row i's leaves, made once (a `_Remake` cache)
        leaves = rows[i]
        if leaves is None:
            leaves = rows[i] = [
                c[i, ...] if s else c for c, s in zip(columns, stacked, strict=True)
            ]
        return leaves

    # Per value: (0, column) read as `column[i, ...]`, (1, value) the same
    # for every row, or (2, values) one per row.
    made: list[list[tuple[int, Any]]] = []
    try:
        for fn, ks in recipe.checks:
            if _rowwise(fn) and _stacked_ok(fn, [columns[k] for k in ks]):
                continue
            for i in range(n):
                leaves = row(i)
                fn(*[leaves[k] for k in ks])
        for _, _, ops in recipe.parts:
            part: list[tuple[int, Any]] = []
            for op in ops:
                if type(op) is int:
                    part.append((0, columns[op]) if stacked[op] else (1, columns[op]))
                    continue
                column = _made_stacked(op, columns, n)  # pyright: ignore[reportArgumentType]
                if column is not None:
                    part.append((0, column))
                else:
                    part.append((2, [make_value(op, row(i)) for i in range(n)]))  # pyright: ignore[reportArgumentType]
            made.append(part)
    except (ValueError, Refused):
        return None
    shape = [(is_rows, paths) for is_rows, paths, _ in recipe.parts]
    block = RowBlock(shape, made, n)
    return [HostValues(None, recipe, (block, i)) for i in range(n)]


class RowBlock:
    """The values of `n` rows of one structure, column-wise (`replay_rows`).

    Row `i`'s `HostValues` hold, part by part, `value(how, v, i)` of each
    `(how, v)` in `made`: how 0, `v[i, ...]` (a column `[n, ...]`, or a record
    of such columns); how 1, `v` itself (a value every row shares); how 2,
    `v[i]` (a list, one value per row). A writer may format the rows together
    from the columns, with its results in `cache` (keyed by the writer's own
    formatting function): e.g. `JsonlWriter` reads each column's numbers once.

    Attributes:
        parts: `(rows, paths)` per part: whether it is `Rows`, and its paths.
        made: per part, `(how, v)` per value (per column of `Rows`).
        n: the number of rows.
        cache: what writers computed for the block.
    """

    __slots__ = ("_paths", "cache", "made", "n", "parts")

    def __init__(
        self,
        parts: list[tuple[bool, tuple[str, ...]]],
        made: list[list[tuple[int, Any]]],
        n: int,
    ):
        self.parts = parts
        self.made = made
        self.n = n
        self.cache: dict[object, Any] = {}
        self._paths: frozenset[str] | None = None

    def paths(self) -> frozenset[str]:
        """Every path of a row."""
        if self._paths is None:
            self._paths = frozenset(p for _, paths in self.parts for p in paths)
        return self._paths

    def row_parts(self, i: int) -> list[Part]:
        """The parts of row `i`'s `HostValues`."""
        parts: list[Part] = []
        for (is_rows, paths), made in zip(self.parts, self.made, strict=True):
            values = [self.value(how, v, i) for how, v in made]
            parts.append(
                Rows(paths, values)
                if is_rows
                else dict(zip(paths, values, strict=True))
            )
        return parts

    @staticmethod
    def value(how: int, v: Any, i: int) -> Any:
        """Row `i`'s value of `(how, v)` (see the class)."""
        return v[i, ...] if how == 0 else v if how == 1 else v[i]


def _rowwise(fn: Callable[..., Any]) -> bool:
    """Whether `fn` (a recipe's check or value) may run over stacked leaves.

    True where it (or the function of a `functools.partial`) has a true `rowwise`
    attribute: applied to leaves stacked `[n, ...]` it gives each row's value
    stacked the same way, and a check raises unless every row would pass (the
    read's `_Check` and `_Remake` of a kind with `Summary.rowwise_host_value`).
    """
    return bool(getattr(getattr(fn, "func", fn), "rowwise", False))


def _stacked_ok(fn: Callable[..., Any], columns: list[Any]) -> bool:
    """Whether the check `fn` passes over stacked leaves (False: check each row)."""
    try:
        fn(*columns)
    except Exception:  # e.g. shapes valid per row only: each row is checked
        return False
    return True


def _made_stacked(
    op: tuple[Callable[..., Any], tuple[int, ...], object],
    columns: Sequence[Any],
    n: int,
) -> "np.ndarray | RecordRows | None":
    """A rowwise value over stacked leaves (`[n, ...]`), or None: make it per row."""
    fn, ks, dtype = op
    if not _rowwise(fn):
        return None
    try:
        value = fn(*[columns[k] for k in ks])
    except Exception:  # made per row, whose error (if any) names the path
        return None
    if is_record_type(type(value)):  # rows of a record: its arrays' rows
        arrays = [getattr(value, f.name) for f in _array_fields(value)]
        if arrays and all(x.ndim >= 2 and x.shape[0] == n for x in arrays):
            return RecordRows(value)
        return None
    if (
        type(value) is not np.ndarray
        or value.shape[:1] != (n,)
        or (dtype is not None and value.dtype != dtype)
    ):
        return None
    return value


def _array_fields(record: object) -> list[dataclasses.Field[Any]]:
    """The fields of a host record that hold NumPy arrays."""
    return [
        f
        for f in dataclasses.fields(record)  # pyright: ignore[reportArgumentType]
        if type(getattr(record, f.name)) is np.ndarray
    ]


class RecordRows:
    """A host record of stacked arrays (validated stacked), read row by row.

    `self[i, ...]` is the record of row `i`: a copy whose arrays are their row `i`
    (at least 1-d), made without running the record's checks again, which the
    stacked record passed for every row (counts, dtypes, the last axis).
    """

    __slots__ = ("fields", "record")

    def __init__(self, record: object):
        self.record = record
        self.fields = [f.name for f in _array_fields(record)]

    def __getitem__(self, index: tuple[int, Any]) -> Any:
        row = copy.copy(self.record)
        for name in self.fields:
            object.__setattr__(row, name, getattr(self.record, name)[index])
        return row

"""HostValues: one step's `{path: value}` on the host, per-iteration rows kept whole.

And `Recipe`: how a write's `HostValues` are made from its fetched leaves, recorded
from the full read of the first write of a structure and replayed for the next ones
(writers read the same structure every step).
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

import jax
import numpy as np

from eqxctx._records import Audio, Histogram, Image


#: A value ready to write: a NumPy array, or a host record (`Histogram`, `Image`,
#: `Audio`) that a `Summary.host_value` returned.
HostValue: TypeAlias = np.ndarray | Histogram | Image | Audio


class Rows:
    """The raw per-iteration summaries of one scan or vmap entry, on the host.

    Stands for the entries `paths[j]: columns[j % U][j // U]` (U columns, the
    iteration axis first), in that order: iteration-major, as `flatten` lists them.
    """

    __slots__ = ("columns", "paths")

    def __init__(self, paths: tuple[str, ...], columns: list[np.ndarray]):
        self.paths = paths
        self.columns = columns

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield `(path, value)`: each row as a NumPy array (0-d for scalars)."""
        flat = (v for row in zip(*self.columns, strict=True) for v in row)
        for path, value in zip(self.paths, flat, strict=True):
            yield path, value if type(value) is np.ndarray else np.asarray(value)


#: A part of `HostValues`: a `{path: value}` dict, or `Rows`.
Part: TypeAlias = dict[str, HostValue] | Rows


@runtime_checkable
class Block(Protocol):
    """Rows read together (`_columns.RowBlock`), as `HostValues.row` uses them."""

    def row_parts(self, i: int) -> "list[Part]":
        """The parts of row `i`'s `HostValues`."""
        ...

    def paths(self) -> frozenset[str]:
        """Every path of a row."""
        ...


class HostValues(Mapping[str, HostValue]):
    """A read-only `{path: value}` mapping; per-iteration rows stay stacked until read.

    Writers receive it in `HostSummaries.values`: a scan's raw per-iteration
    summaries stay stacked NumPy arrays (`Rows` among the `parts`), which a writer
    may format together; the dict of every value is built only when one is read.
    """

    __slots__ = ("_dict", "_parts", "layout", "row")

    # `list[Part]`: beartype samples a list's items with `random`, which hypothesis
    # forbids inside strategies; host values are made by writers, never in one.
    def __init__(
        self,
        parts: list[Part] | None,
        layout: object = None,
        row: "tuple[Block, int] | None" = None,
    ):
        self._parts = parts  # (None: made from `row` when first read)
        self._dict: dict[str, HostValue] | None = None
        #: The `Recipe` these values were replayed from, or None: the same object
        #: for every write of one structure (same parts, paths and dtypes), so
        #: writers may key their own formatting caches by it.
        self.layout = layout
        #: `(block, i)`: these are row `i` of a buffer's rows read column-wise
        #: (`_columns.replay_rows`), which a writer may format together; or None.
        self.row = row

    @property
    def parts(self) -> list[Part]:
        """The parts, in order: dicts of single values and `Rows`."""
        parts = self._parts
        if parts is None:
            assert self.row is not None
            block, i = self.row
            parts = self._parts = block.row_parts(i)
        return parts

    def _full(self) -> dict[str, HostValue]:
        full = self._dict
        if full is None:
            full = {}
            for part in self.parts:
                full.update(part.items())
            self._dict = full
        return full

    def __getitem__(self, key: str) -> HostValue:
        return self._full()[key]

    def items(self) -> Iterator[tuple[str, HostValue]]:  # pyright: ignore[reportIncompatibleMethodOverride]
        """Yield `(path, value)` in order, part by part (no dict is built)."""
        if self._dict is not None:
            yield from self._dict.items()
            return
        for part in self.parts:
            yield from part.items()

    def __iter__(self) -> Iterator[str]:
        for part in self.parts:
            yield from (part.paths if isinstance(part, Rows) else part)

    def __len__(self) -> int:
        return sum(
            len(part.paths if isinstance(part, Rows) else part) for part in self.parts
        )

    def __contains__(self, key: object) -> bool:
        if self._dict is not None:
            return key in self._dict
        if self._parts is None and self.row is not None:
            return key in self.row[0].paths()
        for part in self.parts:
            if isinstance(part, Rows):
                # Row paths are `{prefix}{i}/...`: a name without "/" (a writer's
                # `"step" in values`) is never one, and is not searched for.
                if isinstance(key, str) and "/" in key and key in part.paths:
                    return True
            elif key in part:
                return True
        return False

    def __repr__(self) -> str:
        return f"HostValues({self._full()!r})"


class Notes:
    """What a full read records for a `Recipe`: the values it derived.

    Each derived value is kept (with its sources) so that its `id` stays unique.
    `opaque`: a value came from a function that must run at every read (a
    `Summary.value()`, e.g. a `CallbackSummary`'s function): no recipe.
    """

    __slots__ = ("checks", "derived", "opaque")

    def __init__(self) -> None:
        #: id(value) -> (fn, sources, value): `value` is `fn(*sources)`.
        self.derived: dict[int, tuple[Callable[..., Any], tuple[object, ...], Any]] = {}
        self.opaque = False
        #: `(fn, sources)`: `fn(*sources)` raises `ValueError` for invalid values.
        self.checks: list[tuple[Callable[..., Any], Sequence[object]]] = []

    def made(self, result: Any, fn: Callable[..., Any], *sources: object) -> None:
        """Record that `result` is `fn(*sources)` (sources: fetched leaves).

        A replay checks that the value it makes has `result`'s dtype (e.g.
        `numpy.asarray` of a Python int too large for int64 does not).
        """
        self.derived[id(result)] = (fn, sources, result)


#: How a recipe makes one value: a leaf position, or `(fn, leaf positions, dtype)`
#: (the dtype the value must have; None: any).
_Op: TypeAlias = int | tuple[Callable[..., Any], tuple[int, ...], object]


class Refused(Exception):
    """A replayed value differs from what the recipe recorded: read in full."""


class Recipe:
    """How one structure's `HostValues` are made from its fetched leaves.

    Built by `make_recipe` from a full read (which raises on anything invalid), and
    checked there to replay that read exactly. A replay re-checks what depends on
    the values (each summary's `validate()`) and returns None where a check fails,
    so that the full read runs and raises, naming the path.
    """

    __slots__ = ("checks", "parts")

    def __init__(
        self,
        parts: list[tuple[bool, tuple[str, ...], list[_Op]]],
        checks: list[tuple[Callable[..., Any], tuple[int, ...]]],
    ):
        self.parts = parts  # (rows?, paths, ops)
        self.checks = checks

    def replay(self, host: Sequence[Any]) -> HostValues | None:
        """The `HostValues` of `host` (the fetched leaves), or None (read in full)."""
        parts: list[Part] = []
        try:
            for fn, ks in self.checks:
                fn(*[host[k] for k in ks])
            for rows, paths, ops in self.parts:
                values = [
                    host[op] if type(op) is int else make_value(op, host)  # pyright: ignore[reportArgumentType]
                    for op in ops
                ]
                parts.append(
                    Rows(paths, values)
                    if rows
                    else dict(zip(paths, values, strict=True))
                )
        except (ValueError, Refused):  # read in full, which names the path
            return None
        return HostValues(parts, self)


def make_value(
    op: tuple[Callable[..., Any], tuple[int, ...], object], host: Any
) -> Any:
    fn, ks, dtype = op
    value = fn(*[host[k] for k in ks])
    if dtype is not None and value.dtype != dtype:
        raise Refused
    return value


def make_recipe(values: HostValues, host: list[Any], notes: Notes) -> Recipe | None:
    """The recipe that makes `values` from `host` (the fetched leaves), or None.

    None where a value's making is not known (e.g. a `CallbackSummary`'s result, a
    per-iteration view) or a leaf object appears twice: such structures are read in
    full every time.
    """
    positions = {id(x): k for k, x in enumerate(host)}
    if notes.opaque or len(positions) != len(host):
        return None

    def op_of(value: object) -> _Op | None:
        # Derived first: a summary's value that is one of its leaves is remade, so
        # that the replay validates the summary again.
        derived = notes.derived.get(id(value))
        if derived is not None:
            fn, sources, result = derived
            ks = tuple(positions.get(id(x), -1) for x in sources)
            return None if -1 in ks else (fn, ks, getattr(result, "dtype", None))
        return positions.get(id(value))

    parts: list[tuple[bool, tuple[str, ...], list[_Op]]] = []
    for part in values.parts:
        rows = isinstance(part, Rows)
        paths = part.paths if isinstance(part, Rows) else tuple(part)
        found = [
            op_of(v)
            for v in (part.columns if isinstance(part, Rows) else part.values())
        ]
        ops = [op for op in found if op is not None]
        if len(ops) != len(found):
            return None
        parts.append((rows, paths, ops))
    checks = [
        (fn, tuple(positions.get(id(x), -1) for x in sources))
        for fn, sources in notes.checks
    ]
    if any(-1 in ks for _, ks in checks):
        return None
    recipe = Recipe(parts, checks)
    replayed = recipe.replay(host)
    return recipe if replayed is not None and _same(replayed, values) else None


def _same(a: HostValues, b: HostValues) -> bool:
    """Whether two reads hold the same parts, paths and values (NaN equal to NaN)."""
    if len(a.parts) != len(b.parts):
        return False
    for x, y in zip(a.parts, b.parts, strict=True):
        if isinstance(x, Rows) != isinstance(y, Rows):
            return False
        if isinstance(x, Rows) and isinstance(y, Rows):
            pairs = list(zip(x.columns, y.columns, strict=False))
            if x.paths != y.paths or len(x.columns) != len(y.columns):
                return False
        elif isinstance(x, dict) and isinstance(y, dict):
            if list(x) != list(y):
                return False
            pairs = list(zip(x.values(), y.values(), strict=True))
        else:
            return False
        for u, v in pairs:
            if u is v:
                continue
            leaves_u, def_u = jax.tree_util.tree_flatten(u)
            leaves_v, def_v = jax.tree_util.tree_flatten(v)
            if def_u != def_v or not all(
                type(p) is np.ndarray
                and type(q) is np.ndarray
                and p.dtype == q.dtype
                and np.array_equal(p, q, equal_nan=p.dtype.kind in "fc")
                for p, q in zip(leaves_u, leaves_v, strict=True)
            ):
                return False
    return True

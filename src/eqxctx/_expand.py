"""Per-iteration entries expanded: flatten (for hosts), materialize, prune.

Each walk checks an entry's iteration axes (`iteration_axes`) before reading it and
expands it where it is observed; host reads fetch each stacked array once.
"""

from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import jax
import numpy as np

from ._iterations import (
    IterationSummaries,
    check_entry,
    entry_leaves,
    host_leaves,
    items_of,
    iteration_axes,
    iteration_views,
    unstack,
)
from ._mapping import EMPTY, FrozenMapping, Pairs
from ._summary import Summary
from ._typing import Leaf, PathPredicate, Tree, TreeDef


def _is_unit(x: object) -> bool:
    return isinstance(x, (Summary, IterationSummaries))


#: `put_rows(paths, columns)`: an entry of raw host arrays at once. `paths` holds
#: the `length * len(columns)` paths in iteration-major order (path `j` is row
#: `j // len(columns)` of column `j % len(columns)`); each column has the iteration
#: axis first. `paths` is one cached tuple per layout: the same object every step.
PutRows: TypeAlias = Callable[[tuple[str, ...], list[np.ndarray]], None]

#: `read_stacked(summary)`: the `(suffix, column)` entries that a `Summary` whose
#: fields are stacked host arrays (iteration axis first) stands for, each column one
#: value per iteration at `path + suffix`, or None where the summary must be read
#: iteration by iteration (an unknown kind, or a value its checks refuse).
ReadStacked: TypeAlias = Callable[[Leaf], list[tuple[str, np.ndarray]] | None]


def flatten_into(
    put: Callable[[str, Leaf], None],
    tree: Tree,
    prefix: str,
    sep: str,
    put_rows: PutRows | None = None,
    read_stacked: ReadStacked | None = None,
) -> None:
    """Call `put(path, leaf)` for every leaf of `tree`, per-iteration entries expanded.

    Paths are `sep`-joined; iteration i of an entry at `p` contributes `p{i}/...`.
    Mappings are visited in insertion order, an iteration's entries in sorted order
    (as `IterationSummaries.iteration` returns them). With `put_rows`, an entry whose
    leaves are all fetched to the host is handed over whole instead (writers format
    its values together) when its summaries are raw arrays or summaries that
    `read_stacked` reads from their stacked fields.
    """
    for key, value in items_of(tree):
        path = prefix + key
        if isinstance(value, IterationSummaries):
            _flatten_entry(put, value, path, sep, put_rows, read_stacked)
        elif isinstance(value, Mapping):
            flatten_into(put, value, path + sep, sep, put_rows, read_stacked)
        else:
            put(path, value)


_Unit = tuple[str, TreeDef | None, int, int]
# The units of a stacked tree depend only on its structure: cached by treedef, as
# writers flatten the same structure every step.
_UNITS: dict[tuple[TreeDef, str], list[_Unit]] = {}


# `-> list[Any]`: beartype samples a list's items with `random`, which hypothesis
# forbids inside strategies (collections are flattened in strategies).
def _units(entry: IterationSummaries, treedef: TreeDef, sep: str) -> list[Any]:
    """One unit per summary: `(relative path, treedef or None, first, stop)`.

    A raw leaf is one row (treedef None); a `Summary` or nested entry is rebuilt from
    its rows `first:stop` by its treedef.
    """
    key = (treedef, sep)
    cached = _UNITS.get(key)
    if cached is not None:
        return cached
    units: list[_Unit] = []
    start = 0
    flat = jax.tree_util.tree_flatten_with_path(entry.stacked, is_leaf=_is_unit)[0]
    for key_path, obj in flat:
        rel = sep.join(str(getattr(k, "key", k)) for k in key_path)
        if _is_unit(obj):
            sub, sub_treedef = jax.tree_util.tree_flatten(obj)
            units.append((rel, sub_treedef, start, start + len(sub)))
            start += len(sub)
        else:
            units.append((rel, None, start, start + 1))
            start += 1
    if len(_UNITS) < 1024:
        _UNITS[key] = units
    return units


# The paths of an entry's rows, by (treedef, sep, path, length): writers flatten the
# same layout every step, and a 1,024-layer scan has thousands of paths.
_ROW_PATHS: dict[tuple[TreeDef, str, str, int], tuple[str, ...]] = {}


def _row_paths(key: tuple[TreeDef, str, str, int], rels: list[str]) -> tuple[str, ...]:
    cached = _ROW_PATHS.get(key)
    if cached is None:
        _, sep, path, length = key
        cached = tuple(f"{path}{i}{sep}{rel}" for i in range(length) for rel in rels)
        if len(_ROW_PATHS) < 256:
            _ROW_PATHS[key] = cached
    return cached


# `list[Any]`: beartype samples a list's items with `random` (see `_units`).
def _columns(
    host: list[Any],
    axes: list[Any],
    units: list[Any],
    read_stacked: ReadStacked | None,
) -> tuple[list[Any], list[Any]] | None:
    """An entry's `(relative paths, columns)`, iteration axis first, or None.

    None where a unit is a summary that `read_stacked` does not read whole (or
    there is no `read_stacked`): the entry is then read iteration by iteration. The
    relative paths depend only on the entry's structure (`_row_paths` caches them).
    """
    columns = [
        np.moveaxis(x, a, 0) if a else x for x, a in zip(host, axes, strict=True)
    ]
    rels: list[str] = []
    out: list[np.ndarray] = []
    unit: _Unit
    for unit in units:
        rel, treedef, a, b = unit
        if treedef is None:
            rels.append(rel)
            out.append(columns[a])
            continue
        if read_stacked is None:
            return None
        entries = read_stacked(treedef.unflatten(columns[a:b]))
        if entries is None:
            return None
        for suffix, column in entries:
            rels.append(rel + suffix)
            out.append(column)
    return rels, out


def _flatten_entry(
    put: Callable[[str, Leaf], None],
    entry: IterationSummaries,
    path: str,
    sep: str,
    put_rows: PutRows | None = None,
    read_stacked: ReadStacked | None = None,
) -> None:
    leaves, stacked_treedef = entry_leaves(entry)
    host = host_leaves(leaves)
    axes = iteration_axes(entry, leaves, path)
    units = _units(entry, stacked_treedef, sep)
    if put_rows is not None and all(type(x) is np.ndarray for x in host):
        whole = _columns(host, axes, units, read_stacked)
        if whole is not None:
            rels, columns = whole
            key = (stacked_treedef, sep, path, entry.length)
            put_rows(_row_paths(key, rels), columns)
            return
    rows = [unstack(x, a) for x, a in zip(host, axes, strict=True)]
    if all(treedef is None for _, treedef, _, _ in units):
        # Only raw arrays (the common case): one row per unit, no rebuilding.
        rels = [rel for rel, _, _, _ in units]
        columns = [rows[a] for _, _, a, _ in units]
        for i in range(entry.length):
            at = f"{path}{i}{sep}"
            for rel, column in zip(rels, columns, strict=True):
                put(at + rel, column[i])
        return
    for i in range(entry.length):
        at = f"{path}{i}{sep}"
        for rel, treedef, a, b in units:
            if treedef is None:
                put(at + rel, rows[a][i])
                continue
            obj = treedef.unflatten([rows[j][i] for j in range(a, b)])
            if isinstance(obj, IterationSummaries):
                _flatten_entry(put, obj, at + rel, sep, put_rows, read_stacked)
            else:
                put(at + rel, obj)


def has_leaf(tree: Tree) -> bool:
    """Return whether `tree` has any leaf (per-iteration entries count their leaves)."""
    for value in tree.values():
        if isinstance(value, IterationSummaries):
            if value.length and value.ndims:
                return True
        elif isinstance(value, Mapping):
            if has_leaf(value):
                return True
        else:
            return True
    return False


# -- materialize ---------------------------------------------------------------------


def materialize_tree(
    tree: Tree, checked: bool | None = None, prefix: str = ""
) -> FrozenMapping:
    """Return `tree`, each entry expanded into `{prefix}`, `{prefix}{i}` children.

    `checked`: whether `tree`'s leaves are checked (default: `tree.checked` for a
    `FrozenMapping`, else False); an iteration's values are slices of its entry's.
    `prefix`: `tree`'s path, for errors (see `iteration_axes`).
    """
    if checked is None:
        checked = isinstance(tree, FrozenMapping) and tree.checked
    pairs: list[tuple[str, Leaf]] = []
    for key, value in items_of(tree):
        path = prefix + key
        if isinstance(value, IterationSummaries):
            pairs.append((key, EMPTY))
            for i, it in enumerate(iteration_views(value, path)):
                sub = materialize_tree(it, checked, f"{path}{i}/")
                pairs.append((f"{key}{i}", sub))
        elif isinstance(value, Mapping):
            pairs.append((key, materialize_tree(value, checked, path + "/")))
        else:
            pairs.append((key, value))
    return FrozenMapping(pairs, checked=checked)


# -- prune ---------------------------------------------------------------------------


class _NonUniform(Exception):
    """Iterations of an inner entry keep different entries (so it must be sliced)."""


def prune_kinds(
    kinds: Mapping[str, Tree], drop: PathPredicate
) -> dict[str, FrozenMapping]:
    """AXLearn's `prune_tree` over `{kind: tree}`, per-iteration entries seen expanded.

    `drop` is called bottom-up on every entry of the materialized trees, in the order
    of `materialize()`'s mappings, with paths like `"summaries/iter3/loss"`, and on
    the kind roots. An entry whose iterations all keep the same entries (and whose
    empty `{prefix}` child is kept) stays stacked, with those entries only; otherwise
    the kept iterations are sliced. Each path is asked once.
    """
    memo: dict[str, bool] = {}

    def asked(path: str) -> bool:
        known = memo.get(path)
        if known is None:
            known = memo[path] = bool(drop(path))
        return known

    out: dict[str, FrozenMapping] = {}
    for kind, tree in kinds.items():
        pruned = _prune(tree, asked, kind + "/", slots=False)
        if not asked(kind):
            out[kind] = pruned
    return out


def _prune(
    tree: Tree,
    drop: PathPredicate,
    prefix: str,
    *,
    slots: bool,
    checked: bool | None = None,
) -> FrozenMapping:
    # `checked`: as for `materialize_tree` (an iteration's values are slices of its
    # entry's, checked where the entry's level was).
    if checked is None:
        checked = isinstance(tree, FrozenMapping) and tree.checked
    pairs: list[tuple[str, Leaf]] = []
    for key, value in items_of(tree):
        path = prefix + key
        if isinstance(value, IterationSummaries):
            pairs.extend(
                _prune_entry(key, value, drop, prefix, slots=slots, checked=checked)
            )
        elif isinstance(value, Mapping):
            sub = _prune(value, drop, path + "/", slots=slots, checked=checked)
            if not drop(path):
                pairs.append((key, sub))
        elif not drop(path):
            pairs.append((key, value))
    return FrozenMapping(pairs, checked=checked)


def _prune_entry(
    key: str,
    entry: IterationSummaries,
    drop: PathPredicate,
    prefix: str,
    *,
    slots: bool,
    checked: bool = False,
) -> Pairs:
    """Prune one entry: stacked where every iteration keeps the same, else sliced.

    The iterations are pruned on a skeleton of the entry (its structure with the leaf
    indices as leaves), so deciding costs no slicing. With `slots=True` the entry is
    itself such a skeleton (inside an outer entry), and a non-uniform result raises
    `_NonUniform` for the outer entry to slice instead.
    """
    keep_empty = not drop(prefix + key)
    leaves, treedef = entry_leaves(entry)
    if not slots:  # (a skeleton's leaves are indices: checked with its outer entry)
        check_entry(entry, leaves, prefix + key)
    skeleton = treedef.unflatten(list(range(len(leaves))))
    kept: list[FrozenMapping | None] = []
    uniform = keep_empty and entry.length > 0
    try:
        for i in range(entry.length):
            at = f"{prefix}{key}{i}"
            sub = _prune(skeleton, drop, at + "/", slots=True)
            kept.append(None if drop(at) else sub)
    except _NonUniform:
        uniform = False
    first = (
        jax.tree_util.tree_flatten(kept[0]) if uniform and kept[0] is not None else None
    )
    if first is not None and all(
        k is not None and jax.tree_util.tree_flatten(k) == first for k in kept
    ):
        index: list[int] = first[0]
        stacked = jax.tree_util.tree_map(lambda j: leaves[j], kept[0])
        ndims = tuple(entry.ndims[j] for j in index)
        return [(key, IterationSummaries(entry.length, stacked, ndims, entry.reverse))]
    if slots:
        raise _NonUniform
    # Slice: prune the materialized entry (`drop` is memoized: nothing asked twice).
    pairs = [(key, EMPTY)]
    pairs += [
        (f"{key}{i}", it) for i, it in enumerate(iteration_views(entry, prefix + key))
    ]
    sliced = FrozenMapping(pairs, checked=checked)
    return _prune(sliced, drop, prefix, slots=False, checked=checked).items_list()

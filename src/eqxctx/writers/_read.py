"""The host read: flatten, validate and fetch summaries into `HostValues`.

The first read of a structure runs in full and records a `Recipe`; later reads of
that structure replay it (`_host.py`).
"""

import functools
from collections.abc import Hashable, Iterator, Mapping
from typing import NamedTuple, TypeAlias

import jax
import numpy as np

from eqxctx._checks import is_jax_array_type
from eqxctx._collection import OutputCollection
from eqxctx._expand import flatten_into
from eqxctx._leaves import check_summary_name
from eqxctx._mapping import FrozenMapping
from eqxctx._records import is_record_type
from eqxctx._summary import Summary
from eqxctx._summary_tree import summary_tree
from eqxctx._transfer import to_host
from eqxctx._typing import ArrayTree, Leaf, SummaryTree, TreeDef

from ._fetch import Started, device_get_leaves, finish, start
from ._host import HostValue, HostValues, Notes, Part, Recipe, Rows, make_recipe


#: What `write` accepts: an `OutputCollection` (its summaries are written) or a
#: nested mapping of summaries, e.g. `collection.summaries` or `{"train": ...}`.
Summaries: TypeAlias = OutputCollection | SummaryTree


def _collision(path: str, *, where: str) -> ValueError:
    return ValueError(
        f"`{where}`: two summaries have the path {path!r} (per-iteration children "
        "are written as 'name{i}/...', and a `CallbackSummary` returning a mapping "
        "as 'path/key'); rename one of them so that no value is lost."
    )


def _validate(path: str, leaf: Summary, where: str) -> None:
    """`leaf.validate()`, its error naming `path`."""
    try:
        # Through the class: `leaf.validate` builds an Equinox bound method per call.
        type(leaf).validate(leaf)
    except ValueError as e:
        raise ValueError(f"`{where}`: the summary at {path!r}: {e}") from e


def _host_value(path: str, leaf: Summary, where: str) -> ArrayTree:
    """`leaf.host_value()`; an error raised by it (a function's) names `path`."""
    try:
        return type(leaf).host_value(leaf)
    except Exception as e:
        raise ValueError(
            f"`{where}`: reading the {type(leaf).__name__} at {path!r} raised "
            f"{type(e).__name__}: {e}"
        ) from e


def _expand(
    path: str, value: ArrayTree, *, where: str
) -> Iterator[tuple[str, ArrayTree]]:
    """Yield `(path, value)`; a mapping is expanded, a `Summary` read (`host_value`).

    A `Summary` here may come from another's `host_value` (a `CallbackSummary` that
    returns an `ImageSummary`): it is validated and read in turn.
    """
    kind = _kind_of(type(value))
    if kind is Mapping:
        for key, sub in value.items():
            name = check_summary_name(key, f"{path}/", where=where)
            yield from _expand(f"{path}/{name}", sub, where=where)
    elif kind is Summary:
        _validate(path, value, where)
        yield from _expand(path, _host_value(path, value, where), where=where)
    else:
        yield path, value


@functools.cache
def _kind_of(cls: type) -> type | None:
    """`Mapping`, `Summary` or None (one ABC check per type)."""
    if issubclass(cls, Summary):
        return Summary
    return Mapping if issubclass(cls, Mapping) else None


@functools.cache
def _is_plain(cls: type) -> bool:
    """Whether values of `cls` are written as they are (one check per type)."""
    return issubclass(cls, (np.ndarray, np.generic, bool, int, float))


# `value: ArrayTree`: any value, checked here with a message naming the path.
def _numeric(path: str, value: ArrayTree, *, where: str) -> np.ndarray:
    arr = value if type(value) is np.ndarray else np.asarray(value)
    problem = _dtype_problem(arr.dtype)
    if problem is not None:
        raise TypeError(f"`{where}`: the summary at {path!r} {problem}")
    return arr


@functools.cache
def _dtype_problem(dtype: np.dtype[np.generic]) -> str | None:
    """Why writers refuse values of `dtype`, or None."""
    if not (dtype == np.bool_ or jax.numpy.issubdtype(dtype, np.number)):
        return f"has dtype {dtype}; writers accept bool, integer and floating values."
    if jax.numpy.issubdtype(dtype, np.complexfloating):
        return (
            f"is complex ({dtype}); write its real and imaginary parts (or its "
            "absolute value) instead."
        )
    return None


def fetch_summaries(
    summaries: object, *, where: str = "fetch_summaries"
) -> dict[str, HostValue]:
    """Flatten, validate and fetch summaries to the host: `{path: HostValue}`.

    Every process of a multi-process run must call this with the same summaries:
    arrays split over processes are all-gathered by `eqxctx.to_host` (a
    collective). Each `Summary` is `validate()`d, then becomes what writers write
    under its "/"-joined path: its `host_value()`, as NumPy arrays or a host record
    (`Histogram`, `Image`, `Audio`, with NumPy fields); a mapping value (a
    `MomentsSummary`, a `CallbackSummary` returning a dict) becomes `path/key`
    entries. A `CallbackSummary`'s function runs here, on NumPy copies of its
    arguments (as AXLearn's writer does).

    Args:
        summaries: an `OutputCollection` (its summaries) or a nested mapping of
            summary leaves and `OutputCollection`s.
        where: the caller, for error messages (e.g. `"JsonlWriter.write"`).

    Returns:
        `{path: value}` in the summaries' order.

    Raises:
        TypeError: for a leaf that is not a summary leaf or a non-numeric or complex
            value (naming the path).
        ValueError: for an invalid name, two values with the same path (e.g.
            `{"a/b": 1}` and `{"a": {"b": 2}}`), a summary that fails `validate()`,
            or an exception raised by a `CallbackSummary`'s function (its cause);
            the message names the path.
    """
    return dict(host_values(summaries, where=where))


def host_values(summaries: object, *, where: str) -> HostValues:
    """`fetch_summaries`, as the `HostValues` writers get (per-iteration rows whole).

    Raises as `fetch_summaries` does.
    """
    # One fetch of the summary trees first, so that per-iteration views index
    # NumPy arrays on the host.
    if type(summaries) is Prefetched:
        trees, leaves, treedef, key = summaries.flat
        started = summaries.started
    else:
        if jax.process_count() > 1:
            trees = summary_trees(summaries)
            return _read(to_host(trees), trees, where=where, notes=None)
        trees, leaves, treedef, key = _flatten(summaries)
        started = None
    recipe = _RECIPES.get(key, _UNSEEN) if key is not None else None
    host = finish(started) if started is not None else device_get_leaves(leaves, key)
    if type(recipe) is Recipe:
        values = recipe.replay(host)
        if values is not None:
            return values
    notes = Notes() if recipe is _UNSEEN else None
    if notes is not None:
        host = _distinct(host)
    values = _read(treedef.unflatten(host), trees, where=where, notes=notes)
    if notes is not None:
        if len(_RECIPES) >= MAX_RECIPES:
            _RECIPES.clear()
        _RECIPES[key] = make_recipe(values, host, notes)
    return values


def _distinct(host: list[Leaf]) -> list[Leaf]:
    """`host` where each NumPy array in a second place is a view of its own.

    A recipe finds each value's leaf by its identity: one array in two places (a
    NumPy array passed twice; on a TPU, a JAX array's cached NumPy copy) would
    leave no recipe (issue 39).
    """
    seen: set[int] = set()
    out = host
    for k, x in enumerate(host):
        if id(x) in seen and type(x) is np.ndarray:
            if out is host:
                out = list(host)
            out[k] = x.view()
        seen.add(id(x))
    return out


class Flat(NamedTuple):
    """One process's view of summaries to fetch: trees, leaves and recipe key."""

    trees: object
    leaves: list[Leaf]
    treedef: TreeDef
    key: object


def _flatten(summaries: object) -> Flat:
    trees = summary_trees(summaries)
    leaves, treedef = jax.tree_util.tree_flatten(trees)
    return Flat(trees, leaves, treedef, recipe_key(treedef, leaves, trees))


class Prefetched(NamedTuple):
    """Summaries whose copies to the host have started; `host_values` takes one."""

    flat: Flat
    started: Started


def prefetch(summaries: Summaries) -> Summaries | Prefetched:
    """Start copying `summaries` to the host; return what to fetch later.

    One process: a `Prefetched` whose copies run while the caller goes on. Several
    processes (the fetch is a collective) or summaries it cannot read: `summaries`
    itself. Never raises: the fetch raises what there is to raise.
    """
    if jax.process_count() > 1:
        return summaries
    try:
        flat = _flatten(summaries)
    except Exception:  # e.g. a mapping that cannot be read: the fetch says why
        return summaries
    return Prefetched(flat, start(flat.leaves, flat.key))


#: The most structures whose recipes are kept; past it the cache starts again.
MAX_RECIPES = 64
_UNSEEN = object()
#: `recipe_key` -> the structure's recipe, or None (read in full every time).
_RECIPES: dict[object, Recipe | None] = {}


def known_recipe(key: object) -> Recipe | None:
    """The recipe recorded for `key` (`recipe_key`), or None (none, or read in full)."""
    recipe = _RECIPES.get(key) if key is not None else None
    return recipe if type(recipe) is Recipe else None


def recipe_key(treedef: object, leaves: list[Leaf], trees: object) -> object:
    """What a read depends on but its values, or None if it cannot be a key.

    The treedef; each leaf's type, with shape and dtype for arrays and the sharding
    of JAX arrays; the insertion order of every mapping's keys (a treedef sorts them).
    """
    try:
        key = (
            treedef,
            tuple(
                (type(x), x.shape, x.dtype, x.sharding)
                if is_jax_array_type(type(x))
                else (type(x), x.shape, x.dtype)
                if isinstance(x, np.ndarray)
                else type(x)
                for x in leaves
            ),
            _orders(trees),
        )
        return _Key(key)
    except Exception:  # unhashable aux data; a tracer (the full read names it)
        return None


def _orders(tree: object) -> object:
    """The keys of every mapping of `tree`, in order, nested (None for a leaf)."""
    if isinstance(tree, Mapping):
        return tuple((k, _orders(v)) for k, v in tree.items())
    return None


class _Key:
    """A hashable key whose hash is computed once (it is looked up several times)."""

    __slots__ = ("hash", "key")

    def __init__(self, key: Hashable):
        self.key = key
        self.hash = hash(key)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return type(other) is _Key and self.hash == other.hash and self.key == other.key


def summary_trees(summaries: object) -> object:
    """`summaries` with each `OutputCollection` replaced by its summaries mapping."""
    if isinstance(summaries, OutputCollection):
        return summaries.summaries
    if isinstance(summaries, FrozenMapping):  # holds summary leaves only
        return summaries
    if isinstance(summaries, Mapping):
        return {k: summary_trees(v) for k, v in summaries.items()}
    return summaries


def _in_order(host: ArrayTree, like: ArrayTree) -> ArrayTree:
    """`host` with its mappings in the key order of `like` (unflattening sorts keys).

    A `FrozenMapping` stays one, checked where `like` was.
    """
    if isinstance(like, Mapping) and isinstance(host, Mapping):
        items = [(k, _in_order(host[k], v)) for k, v in like.items()]
        if isinstance(like, FrozenMapping):
            return FrozenMapping(items, checked=like.checked)
        return dict(items)
    return host


def _read(
    fetched: ArrayTree, trees: ArrayTree, *, where: str, notes: Notes | None
) -> HostValues:
    """The full read of fetched summaries (`host_values`), recorded in `notes`."""
    tree = summary_tree(_in_order(fetched, trees), where=where)
    parts: list[Part] = []
    out: dict[str, HostValue] = {}  # the part being filled
    seen: set[str] = set()  # every path so far
    checked: set[np.dtype[np.generic]] = set()  # dtypes accepted (one check each)

    def put(path: str, leaf: Leaf) -> None:
        if path in seen:
            raise _collision(path, where=where)
        cls = type(leaf)
        if cls is np.ndarray or _is_plain(cls):  # NumPy values, numbers, views
            arr = leaf if cls is np.ndarray else np.asarray(leaf)
            if notes is not None and arr is not leaf:
                notes.made(arr, np.asarray, leaf)
            if arr.dtype not in checked:
                _numeric(path, arr, where=where)
                checked.add(arr.dtype)
            seen.add(path)
            out[path] = arr
            return
        values: list[HostValue] = []
        for sub, value in _expand(path, leaf, where=where):
            if sub in seen:
                raise _collision(sub, where=where)
            if is_record_type(type(value)):
                for array in jax.tree_util.tree_leaves(value):
                    _numeric(sub, array, where=where)
            else:
                value = _numeric(sub, value, where=where)
            seen.add(sub)
            out[sub] = value
            values.append(value)
        if notes is not None:
            _note(notes, leaf, values)

    def put_rows(paths: tuple[str, ...], columns: list[np.ndarray]) -> None:
        nonlocal out
        if not paths:  # no iteration (or no summary): nothing to write
            return
        for j, column in enumerate(columns):
            if column.dtype not in checked:
                _numeric(paths[j], column, where=where)  # column j's first value
                checked.add(column.dtype)
        if not seen.isdisjoint(paths):
            raise _collision(next(p for p in paths if p in seen), where=where)
        seen.update(paths)
        if out:
            parts.append(out)
            out = {}
        parts.append(Rows(paths, columns))

    def read_stacked(leaf: Leaf) -> list[tuple[str, np.ndarray]] | None:
        return _read_stacked(leaf, notes)

    flatten_into(put, tree, "", "/", put_rows, read_stacked)
    if out or not parts:
        parts.append(out)
    return HostValues(parts)


def _read_stacked(
    leaf: Leaf, notes: Notes | None
) -> list[tuple[str, np.ndarray]] | None:
    """`(suffix, column)` of a summary with stacked fields, or None.

    Only kinds whose `host_value` is elementwise (`Summary.rowwise_host_value`) are
    read whole; None also where `validate()` or a dtype check refuses the stacked
    summary, so that the per-iteration read names the path it refuses.
    """
    if not isinstance(leaf, Summary) or not type(leaf).rowwise_host_value:
        return None
    try:
        type(leaf).validate(leaf)
        entries = list(_expand("", type(leaf).host_value(leaf), where="stacked"))
    except (ValueError, TypeError):
        return None
    for _, column in entries:
        if type(column) is not np.ndarray or _dtype_problem(column.dtype) is not None:
            return None
    if notes is not None:
        _note(notes, leaf, [column for _, column in entries])
    return entries


def _note(notes: Notes, leaf: Leaf, values: list[HostValue]) -> None:
    """Record how a summary's host values are made from its fetched leaves.

    A replay validates the summary again (where its kind checks anything) and
    remakes the values that are not its leaves (`_Remake`). A kind whose `host_value`
    is not `replayable_host_value` (a `CallbackSummary`) is read in full each time.
    """
    cls = type(leaf)
    if not isinstance(leaf, Summary) or not cls.replayable_host_value:
        notes.opaque = True
        return
    leaves, treedef = jax.tree_util.tree_flatten(leaf)
    if cls.validate is not Summary.validate:
        notes.checks.append((_Check(treedef, cls.rowwise_host_value), leaves))
    remake = _Remake(treedef, cls.rowwise_host_value)
    for j, value in enumerate(values):
        if not any(value is x for x in leaves):  # else replayed as that leaf
            notes.made(value, functools.partial(remake, j), *leaves)


class _Check:
    """`validate()` the summary of some leaves (a replay; raises `ValueError`).

    `rowwise`: the kind's `rowwise_host_value`; a recipe replayed over a buffer's
    rows validates such a kind once, stacked (`_columns.replay_rows`).
    """

    __slots__ = ("rowwise", "treedef")

    def __init__(self, treedef: TreeDef, rowwise: bool):
        self.treedef = treedef
        self.rowwise = rowwise

    def __call__(self, *leaves: object) -> None:
        summary = self.treedef.unflatten(leaves)
        type(summary).validate(summary)


class _Remake:
    """Value `j` of a summary's host values, from its fetched leaves (a replay).

    The last summary's values are kept, so that a summary of several values (a
    `MomentsSummary`'s six) is read once per replay. `rowwise`: the kind's
    `rowwise_host_value` (`_columns.replay_rows` then reads a buffer's rows at once).
    """

    __slots__ = ("last", "rowwise", "treedef")

    def __init__(self, treedef: TreeDef, rowwise: bool):
        self.treedef = treedef
        self.rowwise = rowwise
        self.last: tuple[tuple[object, ...], list[HostValue]] | None = None

    def __call__(self, j: int, *leaves: object) -> HostValue:
        last = self.last  # one read: another thread may replace it
        if last is None or not all(
            a is b for a, b in zip(last[0], leaves, strict=True)
        ):
            summary = self.treedef.unflatten(leaves)
            try:
                values = [
                    v if is_record_type(type(v)) else _numeric("", v, where="replay")
                    for _, v in _expand("", summary, where="replay")
                ]
            except Exception as e:  # the full read raises, naming the path
                raise ValueError(str(e)) from e
            last = self.last = (leaves, values)
        return last[1][j]

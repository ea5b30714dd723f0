"""The writer interface and the shared step: flatten, validate and fetch summaries."""

import abc
import dataclasses
import functools
import operator
from collections.abc import Hashable, Iterator, Mapping
from types import TracebackType
from typing import NamedTuple, SupportsIndex, TypeAlias, TypeVar

import jax
import numpy as np

from eqxctx._checks import is_jax_array_type
from eqxctx._collection import OutputCollection, summary_tree
from eqxctx._expand import flatten_into
from eqxctx._leaves import check_summary_name
from eqxctx._mapping import FrozenMapping
from eqxctx._records import is_record_type
from eqxctx._summary import Summary
from eqxctx._transfer import to_host
from eqxctx._typing import ArrayTree, Leaf, SummaryTree, TreeDef

from ._buffer import BufferRows, SummaryBuffer, buffer_rows, start_fetch
from ._fetch import Started, device_get_leaves, finish, start
from ._host import (
    HostValue,
    HostValues,
    Notes,
    Part,
    Recipe,
    Rows,
    make_recipe,
)


#: What `write` accepts: an `OutputCollection` (its summaries are written) or a
#: nested mapping of summaries, e.g. `collection.summaries` or `{"train": ...}`.
Summaries: TypeAlias = OutputCollection | SummaryTree

#: A step number: a Python or NumPy integer (anything with `__index__`).
Step: TypeAlias = SupportsIndex


def _collision(path: str, *, where: str) -> ValueError:
    return ValueError(
        f"`{where}`: two summaries have the path {path!r} (per-iteration children "
        "are written as 'name{i}/...', and a `CallbackSummary` returning a mapping "
        "as 'path/key'); rename one of them so that no value is lost."
    )


def flatten_summaries(summaries: object, *, where: str) -> dict[str, Leaf]:
    """Return `{path: leaf}` with "/"-joined paths; per-iteration children expanded.

    Each stacked array is fetched to the host once and indexed there.

    Raises:
        TypeError: if `summaries` is neither an `OutputCollection` nor a mapping (of
            summaries and `OutputCollection`s, whose summaries are written under
            their key), or a leaf is not a valid summary leaf (naming its path).
        ValueError: if a name is empty, not a string or contains "/", or if two
            entries get the same path (e.g. `{"a/b": 1}` and `{"a": {"b": 2}}`, or
            a per-iteration child `iter0` next to a scan's `iter`); the message
            names the path. No value is ever dropped silently.
    """
    tree = summary_tree(summaries, where=where)
    out: dict[str, Leaf] = {}

    def put(path: str, leaf: Leaf) -> None:
        if path in out:
            raise _collision(path, where=where)
        out[path] = leaf

    flatten_into(put, tree, "", "/")
    return out


#: The largest step: TensorBoard (and W&B) store steps as int64.
MAX_STEP = 2**63 - 1


def _validate(path: str, leaf: Summary, where: str) -> None:
    """`leaf.validate()`, its error naming `path`."""
    try:
        # Through the class: `leaf.validate` would build an Equinox bound method
        # (a Module) per call, ~30 µs.
        type(leaf).validate(leaf)
    except ValueError as e:
        raise ValueError(f"`{where}`: the summary at {path!r}: {e}") from e


def check_positive_int(value: object, *, where: str, name: str, meaning: str) -> int:
    """Return `value` (argument `name` of `where`) as an int >= 1, or raise.

    Raises:
        TypeError: if `value` is not an integer (a `bool` is not one).
        ValueError: if `value` is less than 1.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"`{where}`: {name} must be an int >= 1 ({meaning}), got "
            f"{type(value).__name__} {value!r}."
        )
    if value < 1:
        raise ValueError(
            f"`{where}`: {name} must be an int >= 1 ({meaning}), got {value}."
        )
    return int(value)


def check_step(step: object, *, where: str) -> int:
    """Return `step` as an `int`, or raise naming `where`.

    Raises:
        TypeError: if `step` is not an integer (a `bool` is not one).
        ValueError: if `step` is negative or above `2**63 - 1` (int64, as
            TensorBoard's event files store it).
    """
    if isinstance(step, bool):
        raise TypeError(f"`{where}`: step must be an int, got a bool ({step}).")
    try:
        value = operator.index(step)  # pyright: ignore[reportArgumentType]
    except TypeError:
        raise TypeError(
            f"`{where}`: step must be an int (e.g. the training step), got "
            f"{type(step).__name__} {step!r}."
        ) from None
    if value < 0:
        raise ValueError(f"`{where}`: step must be >= 0, got {value}.")
    if value > MAX_STEP:
        raise ValueError(
            f"`{where}`: step must be at most 2**63 - 1 (an int64), got {value}."
        )
    return value


def _expand(
    path: str, value: ArrayTree, *, where: str
) -> Iterator[tuple[str, ArrayTree]]:
    """Yield `(path, value)`; a mapping is expanded, a `Summary` read (`host_value`).

    A `Summary` here comes from another's `host_value` (a `CallbackSummary` that
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
    """`Mapping`, `Summary` or None (one check per type: an ABC's is ~1 µs)."""
    if issubclass(cls, Summary):
        return Summary
    return Mapping if issubclass(cls, Mapping) else None


# `value: ArrayTree`: any value, checked here with a message naming the path.
def _numeric(path: str, value: ArrayTree, *, where: str) -> np.ndarray:
    arr = value if type(value) is np.ndarray else np.asarray(value)
    problem = _dtype_problem(arr.dtype)
    if problem is not None:
        raise TypeError(f"`{where}`: the summary at {path!r} {problem}")
    return arr


@functools.cache
def _dtype_problem(dtype: np.dtype[np.generic]) -> str | None:
    """Why writers refuse values of `dtype`, or None (cached: one check per dtype)."""
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

    Every process of a multi-process run must call this with the same summaries: it
    fetches with `eqxctx.to_host`, which all-gathers arrays split over processes (a
    collective); with one process, with one `jax.device_get`. Each `Summary` is
    `validate()`d (also in a plain mapping). Then each leaf becomes what writers
    write, under its "/"-joined path: `ImageSummary`, `AudioSummary` and
    `HistogramSummary` stay whole (with NumPy fields); other summaries become their
    `value()` as NumPy arrays, a mapping value (a `MomentsSummary`, a
    `CallbackSummary` returning a dict) expanded into `path/key` entries. A
    `CallbackSummary`'s function runs here, on NumPy copies of its arguments (as
    AXLearn's writer does).

    Args:
        summaries: an `OutputCollection` (its summaries) or a nested mapping of
            summary leaves and `OutputCollection`s.
        where: the caller, for error messages (e.g. `"JsonlWriter.write"`).

    Returns:
        `{path: value}` in the summaries' order.

    Raises:
        TypeError: for a leaf that is not a summary leaf or a non-numeric or complex
            value (the message names the path).
        ValueError: for an invalid name, two values with the same path, or a
            summary that fails `validate()` (e.g. an empty image batch), or an
            exception raised by a `CallbackSummary`'s function (its cause); the
            message names the path.
    """
    return dict(host_values(summaries, where=where))


def host_values(summaries: object, *, where: str) -> HostValues:
    """`fetch_summaries`, as the `HostValues` writers get (per-iteration rows whole).

    Raises as `fetch_summaries` does.
    """
    # One fetch of the summary trees first (module outputs and state updates stay on
    # the device), so that per-iteration views index NumPy arrays on the host.
    if type(summaries) is Prefetched:
        trees, leaves, treedef, key = summaries.flat
        started = summaries.started
    else:
        if jax.process_count() > 1:
            # `to_host` reads replicated arrays from a local shard and all-gathers
            # arrays split over the processes.
            trees = summary_trees(summaries)
            return _read(to_host(trees), trees, where=where, notes=None)
        # One process: one batched transfer.
        trees, leaves, treedef, key = _flatten(summaries)
        started = None
    # The first read of a structure is made in full and recorded (`Recipe`); the
    # next reads of that structure replay it.
    recipe = _RECIPES.get(key, _UNSEEN) if key is not None else None
    host = finish(started) if started is not None else _device_get(leaves, key)
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

    A recipe records each value's leaf by its identity: one array in two places
    (a NumPy array passed twice; a JAX array fetched alone twice, whose cached
    NumPy copy `numpy.asarray` returns on a TPU) would leave no recipe, and every
    write of the structure would be read in full (issue 39).
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


class _Flat(NamedTuple):
    """One process's view of summaries to fetch: trees, leaves and recipe key."""

    trees: object
    leaves: list[Leaf]
    treedef: TreeDef
    key: object


def _flatten(summaries: object) -> _Flat:
    trees = summary_trees(summaries)
    leaves, treedef = jax.tree_util.tree_flatten(trees)
    return _Flat(trees, leaves, treedef, _recipe_key(treedef, leaves, trees))


class Prefetched(NamedTuple):
    """Summaries whose copies to the host have started (`prefetch`), to fetch later.

    `fetch_host` (and `host_values`) accept one in place of the summaries it
    stands for.
    """

    flat: _Flat
    started: Started


def prefetch(summaries: Summaries) -> Summaries | Prefetched:
    """Start copying `summaries` to the host; return what to `fetch` later.

    In one process, a `Prefetched` whose device-to-host copies run while the caller
    goes on (`AsyncWriter(defer_fetch=True)` fetches step n at the write of step
    n + 1: the copies are then done). With several processes (the fetch is a
    collective) or summaries it cannot read, `summaries` itself. Never raises: the
    fetch raises what there is to raise.
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
#: `_recipe_key` -> the structure's recipe, or None (read in full every time).
_RECIPES: dict[object, Recipe | None] = {}


def _recipe_key(treedef: object, leaves: list[Leaf], trees: object) -> object:
    """What a write's read depends on but its values: None if it cannot be a key.

    The treedef, each leaf's type, with shape and dtype for arrays and the sharding
    of JAX arrays (which also determines how they are fetched), and the order of
    every mapping's keys.
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
            # A treedef's mappings are sorted; the written order is the insertion
            # order of each mapping.
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


def _read(
    fetched: ArrayTree, trees: ArrayTree, *, where: str, notes: Notes | None
) -> HostValues:
    """The full read of fetched summaries (`host_values`), recorded in `notes`."""
    tree = summary_tree(_in_order(fetched, trees), where=where)
    parts: list[Part] = []
    out: dict[str, HostValue] = {}  # the part being filled
    seen: set[str] = set()  # every path so far
    checked: set[np.dtype[np.generic]] = (
        set()
    )  # dtypes already accepted (one check per dtype)

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
                # `paths[j]`: column j's value in the first iteration.
                _numeric(paths[j], column, where=where)
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


def _note(notes: Notes, leaf: Leaf, values: list[HostValue]) -> None:
    """Record how a summary's host values are made from its fetched leaves.

    A replay validates the summary again (where its kind checks anything) and
    remakes the values that are not its leaves themselves (`_Remake`). A kind
    that keeps `Summary`'s default `host_value` (`value()`, e.g. a
    `CallbackSummary`'s function) is read in full at every write instead.
    """
    cls = type(leaf)
    if not isinstance(leaf, Summary) or cls.host_value is Summary.host_value:
        notes.opaque = True
        return
    leaves, treedef = jax.tree_util.tree_flatten(leaf)
    if cls.validate is not Summary.validate:  # checked again at each replay
        notes.checks.append((functools.partial(_check, treedef), leaves))
    remake = _Remake(treedef)
    for j, value in enumerate(values):
        if not any(value is x for x in leaves):  # else replayed as that leaf
            notes.made(value, functools.partial(remake, j), *leaves)


def _check(treedef: TreeDef, *leaves: object) -> None:
    """`validate()` the summary of `leaves` (a replay; raises `ValueError`)."""
    summary = treedef.unflatten(leaves)
    type(summary).validate(summary)


class _Remake:
    """Value `j` of a summary's host values, from its fetched leaves (a replay).

    The last summary's values are kept, so that a summary of several values (a
    `MomentsSummary`'s six) is read once per replay.
    """

    __slots__ = ("last", "treedef")

    def __init__(self, treedef: TreeDef):
        self.treedef = treedef
        self.last: tuple[tuple[object, ...], list[HostValue]] | None = None

    def __call__(self, j: int, *leaves: object) -> HostValue:
        last = self.last  # one read: another thread may replace it
        if last is None or not all(
            a is b for a, b in zip(last[0], leaves, strict=True)
        ):
            summary = self.treedef.unflatten(leaves)
            try:  # `_expand` validates the summary and reads its `host_value`
                values = [v for _, v in _expand("", summary, where="replay")]
                values = [
                    v if is_record_type(type(v)) else _numeric("", v, where="replay")
                    for v in values
                ]
            except Exception as e:  # the full read raises, naming the path
                raise ValueError(str(e)) from e
            last = self.last = (leaves, values)
        return last[1][j]


def _read_stacked(
    leaf: Leaf, notes: Notes | None
) -> list[tuple[str, np.ndarray]] | None:
    """`(suffix, column)` of a summary with stacked fields, or None.

    Only kinds whose `host_value` is elementwise (`Summary.rowwise_host_value`)
    are read whole; None also where `validate()` or a dtype check refuses the
    stacked summary, so that the per-iteration read names the path it refuses.
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
            return None  # read per iteration, which names the path it refuses
    if notes is not None:
        _note(notes, leaf, [column for _, column in entries])
    return entries


def _device_get(tree: list[Leaf], signature: object = None) -> list[Leaf]:
    """`jax.device_get(tree)` (one process), at a fraction of its cost per array.

    `signature`: a hashable key for the shapes, dtypes and shardings of the arrays.

    `eqxctx.writers._fetch.device_get`: one transfer per width for the small arrays
    (~1.5 µs per array), the others started together (`copy_to_host_async`) and
    read with `numpy.asarray` (~7 µs per array; `jax.device_get` takes ~12 µs).
    """
    return device_get_leaves(tree, signature)


@functools.cache
def _is_plain(cls: type) -> bool:
    """Whether values of `cls` are written as they are (one check per type)."""
    return issubclass(cls, (np.ndarray, np.generic, bool, int, float))


def summary_trees(summaries: object) -> object:
    """`summaries` with each `OutputCollection` replaced by its summaries mapping."""
    if isinstance(summaries, OutputCollection | FrozenMapping):
        # A collection's level holds summary leaves only (no collection).
        return (
            summaries.summaries
            if isinstance(summaries, OutputCollection)
            else summaries
        )
    if isinstance(summaries, Mapping):
        return {k: summary_trees(v) for k, v in summaries.items()}
    return summaries


def _in_order(host: ArrayTree, like: ArrayTree) -> ArrayTree:
    """`host` with its mappings in the key order of `like` (`to_host` sorts keys).

    A `FrozenMapping` stays one, checked where `like` was (host copies of its leaves).
    """
    if isinstance(like, Mapping) and isinstance(host, Mapping):
        items = [(k, _in_order(host[k], v)) for k, v in like.items()]
        if isinstance(like, FrozenMapping):
            return FrozenMapping(items, checked=like.checked)
        return dict(items)
    return host


def _host_value(path: str, leaf: Summary, where: str) -> ArrayTree:
    """`leaf.host_value()`; an error raised by it (a function's) names `path`."""
    try:
        return type(leaf).host_value(leaf)
    except Exception as e:
        raise ValueError(
            f"`{where}`: reading the {type(leaf).__name__} at {path!r} raised "
            f"{type(e).__name__}: {e}"
        ) from e


@dataclasses.dataclass(frozen=True)
class HostSummaries:
    """One step's summaries on the host, ready to write (`AbstractWriter.fetch`).

    Attributes:
        step: the step, an int in `[0, 2**63)`.
        values: `{path: value}` as `fetch_summaries` returns it (a read-only
            mapping): NumPy arrays, and `ImageSummary` /
            `AudioSummary` / `HistogramSummary` objects with NumPy fields.
    """

    step: int
    values: Mapping[str, HostValue]


def is_writing_process() -> bool:
    """Return whether this process writes files: process 0 (`jax.process_index()`)."""
    return jax.process_index() == 0


_W = TypeVar("_W", bound="AbstractWriter")


class AbstractWriter(abc.ABC):
    """A summary writer: `write(step, summaries)`, `flush()`, `close()`.

    Writers are context managers (`with JsonlWriter(path) as w: ...` closes `w`) and
    work from any training loop: pass the summaries of an `OutputCollection` (from
    `eqxctx.functional`, a `MethodRunner` output or a `SummaryAccumulator`) after
    each step. They read each leaf's `Summary.value()` (raw arrays as they are) on
    the host.

    A write has two halves. `fetch` (on every process: it may be a collective)
    checks the step, validates the summaries, fetches them with `eqxctx.to_host` and
    runs the writer's own `check`; `write_host` (only on process 0) writes the files.
    `write` runs both; `AsyncWriter` runs `write_host` on a background thread. A new
    writer implements `write_host`, `flush` and `close` (and `check`, to refuse
    what it cannot write before anything is written).
    """

    def write(self, step: Step, summaries: Summaries) -> None:
        """Write the summaries of one step (files only on process 0).

        Every process of a multi-process run must call `write` with the same
        summaries (see `fetch`); only process 0 writes.

        Args:
            step: the step number, an int in `[0, 2**63)`.
            summaries: an `OutputCollection` (its `summaries` are written) or a nested
                mapping of summary leaves and `OutputCollection`s (`{"train": coll}`
                writes `train/...`).

        Raises:
            TypeError: for a non-integer step, a leaf that is not a summary leaf, or
                a non-numeric value (the message names its path).
            ValueError: for a step out of range, an invalid summary (naming its
                path), a value this writer cannot write (see `check`) or a write
                after `close()`.
            eqxctx.OutputConflictError: for two paths that this writer would write
                under one name (TensorBoard's tag sanitizing).
        """
        host = self.fetch(step, summaries)
        if is_writing_process():
            self.write_host(host)

    def write_buffer(self, buffer: SummaryBuffer) -> SummaryBuffer:
        """Write every step held in `buffer` (files only on process 0); empty it.

        Fetches the whole buffer with one transfer per width of raw bits, then
        writes its steps in the order they were added, each as `write(step,
        summaries)` would (the same lines, events and rows). Every step is checked
        before any is written. Each step is written once: passing the same buffer
        again (e.g. from a `finally` block after an interrupted call) writes only
        the steps not written yet. Every process must call it (see `write`).

        Args:
            buffer: a `SummaryBuffer` returned by a step (not a tracer).

        Returns:
            The buffer emptied (`SummaryBuffer.cleared`): carry it into the next
            step.

        Raises:
            TypeError: if `buffer` is not a concrete `SummaryBuffer`; and as `write`.
            ValueError: as `write`; and, after writing the steps it held, if steps
                were added to the full buffer (lost; write it every `buffer.size`
                steps).
        """
        where = f"{type(self).__name__}.write_buffer"
        fetched = buffer_rows(start_fetch(buffer, where=where))
        done, token = self._buffer_done, buffer.count
        skip = done[1] if done is not None and done[0] is token else 0
        hosts = buffer_hosts(self, fetched)
        if is_writing_process():
            for k in range(skip, len(hosts)):
                self.write_host(hosts[k])
                self._buffer_done = (token, k + 1)
        self._buffer_done = (token, len(hosts))
        check_lost(fetched, where=where)
        return buffer.cleared()

    #: `(buffer.count, steps written)` of the last buffer `write_buffer` wrote.
    _buffer_done: tuple[object, int] | None = None

    def fetch(self, step: Step, summaries: Summaries) -> HostSummaries:
        """Check, validate and fetch one step's summaries to the host; write nothing.

        Runs on every process (`eqxctx.to_host` all-gathers arrays split over
        processes). Raises as `write` does.
        """
        return fetch_host(self, step, summaries)

    def check(self, host: HostSummaries) -> None:  # noqa: B027 - optional hook
        """Raise if `host` cannot be written (e.g. the writer is closed).

        Called by `fetch` on every process, before anything is written.
        """

    @abc.abstractmethod
    def write_host(self, host: HostSummaries) -> None:
        """Write one fetched step (called on process 0 only)."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Write buffered data to disk."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and close; closing twice is allowed, writing after it is not."""

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the writer; an error of `close` never replaces the block's own.

        Leaving the block by an exception, an error of `close` (e.g. an
        `AsyncWriter`'s background error) is added to that exception as a note,
        and the block's exception propagates.
        """
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:
            exc.add_note(
                f"Closing {type(self).__name__} as the block was left then raised "
                f"{type(e).__name__}: {e}"
            )


def buffer_hosts(writer: AbstractWriter, fetched: BufferRows) -> list[HostSummaries]:
    """Each step of a fetched buffer, fetched by `writer` (`AbstractWriter.fetch`).

    With `AbstractWriter`'s own `fetch`, the steps of one structure share their
    flattening and the key of their recipe (`host_values`), found once.

    Raises as `AbstractWriter.write` does.
    """
    if type(writer).fetch is not AbstractWriter.fetch:
        return [
            writer.fetch(step, layout.treedef.unflatten(leaves))
            for step, leaves, layout in fetched.rows
        ]
    # Per structure, its summaries' tree (for the order of its mappings' keys) and
    # the key of its recipe, from its first row: the other rows are not rebuilt.
    flats: dict[int, tuple[object, TreeDef, object]] = {}
    hosts: list[HostSummaries] = []
    for step, leaves, layout in fetched.rows:
        known = flats.get(id(layout))
        if known is None:
            tree = layout.treedef.unflatten(leaves)
            treedef = jax.tree_util.tree_structure(tree)
            key = _recipe_key(treedef, leaves, tree)
            known = flats[id(layout)] = (tree, treedef, key)
        flat = _Flat(known[0], leaves, known[1], known[2])
        done = Started(leaves, [], None, None, False)
        hosts.append(fetch_host(writer, step, Prefetched(flat, done)))
    return hosts


def check_lost(fetched: BufferRows, *, where: str) -> None:
    """Raise if steps were added to the full buffer (after its steps are written).

    Raises:
        ValueError: naming the number of steps lost.
    """
    if fetched.lost:
        last = fetched.rows[-1][0]
        raise ValueError(
            f"`{where}`: {fetched.lost} step(s) were added to the full buffer of "
            f"{len(fetched.rows)} rows and lost (each overwrote the last row, which "
            f"holds step {last}). Write the buffer every `buffer.size` steps: `if "
            "(step + 1) % buffer.size == 0: buffer = writer.write_buffer(buffer)`."
        )


def fetch_host(
    writer: AbstractWriter, step: Step, summaries: Summaries | Prefetched
) -> HostSummaries:
    """`AbstractWriter.fetch` of `writer`, also of `Prefetched` summaries."""
    where = f"{type(writer).__name__}.write"
    checked = check_step(step, where=where)
    host = HostSummaries(checked, host_values(summaries, where=where))
    writer.check(host)
    return host

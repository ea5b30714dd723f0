"""FrozenMapping: the read-only mapping of every collection level.

A persistent mapping with O(1) amortized insertion: each version is a prefix of a
shared append-only log. Inserting into the newest version appends to the log in place;
inserting into an older version (a branch: two different entries added to the same
collection) copies that version's entries into a new log first. No version ever sees
an entry added after it, so every version is immutable to its readers.

An entry may also reserve a range of numbered names: an entry `key` with span `N`
stands for `key0` … `key{N-1}` as well (a scan's per-iteration children). Both
directions of the conflict check are arithmetic: `reserver(name)` splits the trailing
digits of `name`, and `numbered_below(prefix, n)` looks up the names already present
that are `prefix` followed by a number.
"""

# pyright: reportPrivateUsage=false

import itertools
import threading
import typing
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any, TypeAlias

import jax
from jax.core import Tracer

from . import _traces
from ._typing import Children, Names


#: A value of a level: a leaf, a nested `FrozenMapping` or a scan's per-iteration
#: entry (duck-typed here: this module imports none of their classes).
Entry: TypeAlias = Any


_DICT_KEY = jax.tree_util.DictKey


# Insertion checks "is this version the newest?" and appends under one lock, so that
# two threads extending the same version never both append to the shared log.
_LOCK = threading.Lock()
# Publishing a frozen log's derived index (see `_Log.build_index`); never held while
# acquiring `_LOCK`.
_INDEX_LOCK = threading.Lock()


def _numbered_splits(key: str) -> Iterator[tuple[str, int]]:
    """Yield each `(prefix, i)` with `key == f"{prefix}{i}"` and `str(i)` canonical."""
    end = len(key)
    start = end
    while start > 1 and key[start - 1].isdigit() and key[start - 1].isascii():
        start -= 1
    for k in range(start, end):
        if key[k] != "0" or k == end - 1:
            yield key[:k], int(key[k:])


_list_init = list.__init__


class _Log(list[Any]):
    """The entries of every version of one mapping, in insertion order.

    The log is the list of the entries' values itself (one object per level fewer
    than a log holding a list). A log is *open* (made by insertion: `keys` is
    `positions` itself, the key-to-position dict, whose order is the insertion
    order: one container fewer per log) or *frozen* (made by unflattening: `keys` is
    the treedef's sorted tuple, and `positions` and `spans` are derived the first time a
    read needs them, `traced` the first time a traced value is inserted, so a
    collection that JAX unflattens and nobody reads costs two objects per level).
    Inserting into a frozen log opens it first.
    """

    __slots__ = (
        "checked",
        "keys",
        "numbered",
        "numbered_upto",
        "positions",
        "spans",
        "trace",
        "traced",
    )

    keys: dict[str, int] | tuple[str, ...]  # `positions` itself when open
    # The key-to-position index (not `index`: that is `list.index`); None until a
    # read needs it (frozen logs only).
    positions: dict[str, int] | None
    # key -> (position, span) for the entries that reserve numbered names; None
    # while there are none (or, in a frozen log, before `positions` is built).
    spans: dict[str, tuple[int, int]] | None
    # prefix -> [(pos, i)] for the keys `prefix{i}`; built lazily (only merging a
    # scan's entry asks), up to `numbered_upto` keys.
    numbered: dict[str, list[tuple[int, int]]] | None
    numbered_upto: int
    # Whether a value is a tracer or a level (or scan entry) holding one: a log of
    # concrete values (a collection made outside `jax.jit`) is never extended in
    # place with one, so no collection that outlives a trace holds its tracers.
    # None: not known yet (frozen logs, and logs opened or copied from them, until
    # a traced value is inserted).
    traced: bool | None
    # The JAX trace (`_traces.current_trace()`) this log was made under, if it was
    # made holding tracers (or maybe holding them, copied from a frozen log); None
    # otherwise and for frozen logs. Tracers are appended in place only under it: a
    # log of an outer trace is not extended in place under a nested one (a closed-
    # over context extended inside `jax.checkpoint`, `vmap` or a `scan` body), so
    # the outer versions keep no tracer of the nested trace past its end.
    trace: object
    # Whether every leaf was checked where it entered (see `freeze`); logs built by
    # unflattening are not.
    checked: bool

    # Containers are typed `Any` here: beartype (the test suite's runtime checks)
    # samples their items with `random`, which hypothesis forbids inside strategies.
    def __init__(
        self,
        keys: Any,
        values: Any,
        index: Any,
        spans: Any = None,
        traced: bool | None = False,
        checked: bool = True,
    ) -> None:
        _list_init(self, values)  # (not `super()`: it builds an object per call)
        self.keys = keys
        self.positions = index
        self.spans = spans
        self.numbered = None
        self.numbered_upto = 0
        self.traced = traced
        self.trace = _traces.current_trace() if traced is not False else None
        self.checked = checked

    def add(self, key: str, value: Entry, span: int) -> None:
        """Append `key: value` to an open log (`keys` is `positions`)."""
        pos = len(self)
        self.append(value)
        self.positions[key] = pos  # pyright: ignore[reportOptionalSubscript]
        if span:
            self._add_span(key, pos, span)
        if not self.traced and _holds_tracer(value):
            self.traced = True
            self.trace = _traces.current_trace()  # (a log is added to as it is made)

    def _add_span(self, key: str, pos: int, span: int) -> None:
        if self.spans is None:
            self.spans = {}
        self.spans[key] = (pos, span)

    # Not type-checked at run time (beartype's checks in the test suite): checking
    # the result iterates it, while another thread may be appending to it.
    @typing.no_type_check
    def build_index(self) -> dict[str, int]:
        """Derive `positions` and `spans` of a frozen log (once).

        Readers call this without `_LOCK` (while another thread may open and extend
        the log under it): the result is built aside and kept only if no other
        thread has set `positions` meanwhile, so an index that already holds appended
        entries is never replaced by one that lacks them.
        """
        # A copy: a thread opening the log meanwhile makes `keys` the index.
        keys = list(self.keys)
        index = {k: i for i, k in enumerate(keys)}
        spans: dict[str, tuple[int, int]] | None = None
        for i, (key, value) in enumerate(zip(keys, self)):  # noqa: B905
            cls = type(value)
            if cls not in _no_span and (span := _span_of(value)):
                if spans is None:
                    spans = {}
                spans[key] = (i, span)
        with _INDEX_LOCK:
            if self.positions is None:
                self.spans = spans
                self.positions = index
            return self.positions

    def holds_tracer(self) -> bool:
        """Return `traced`, deriving it first if not known (once, as `positions`).

        Separate from `build_index`: it looks into every child level, which only
        an insertion needs (a read of a level reads no other level).
        """
        traced = self.traced
        return traced if traced is not None else _resolve_traced(self)

    def open(self) -> dict[str, int]:
        """Make a frozen log appendable; return its index."""
        index = self.positions if self.positions is not None else self.build_index()
        self.keys = index
        return index

    def numbers(self) -> dict[str, list[tuple[int, int]]]:
        """Return the index of numbered keys, brought up to date (amortized O(1))."""
        keys = self.keys
        numbered = self.numbered
        if numbered is None:
            numbered = self.numbered = {}
        start = self.numbered_upto
        for pos, key in enumerate(
            list(itertools.islice(keys, start, None)), start
        ):  # (a copy: `keys` may be a dict, extended meanwhile)
            if key[-1:].isdigit():
                for prefix, i in _numbered_splits(key):
                    numbered.setdefault(prefix, []).append((pos, i))
        self.numbered_upto = len(keys)
        return numbered


# Element types of sequences in these signatures are `Any`: beartype (the test
# suite's runtime checks) samples sequence items with `random`, which hypothesis
# forbids inside strategies, and collections are built inside `eqxctx.testing`'s.
Pairs: TypeAlias = Iterable[Any]  # of `(key, value)` tuples
Keys: TypeAlias = Names  # of `str`


_no_span: set[type] = set()


def _holds_tracer(value: object) -> bool:
    """Whether `value` is a tracer, or a level or PyTree (a `Summary`) holding one.

    A child's mapping is not itself a tracer: without looking into it, a collection
    made outside `jax.jit` would be extended in place with a traced child (and keep
    the trace's tracers alive). O(1) but for frozen levels, each derived once, and
    PyTree values (their leaves).
    """
    sub = _level_log(value)
    if sub is None:
        return _leaf_traced(value)
    traced = sub.traced
    return traced if traced is not None else _resolve_traced(sub)


def _level_log(value: object) -> "_Log | None":
    """The log of `value` if it is a level, or a scan's entry (its stacked level)."""
    cls = type(value)
    if cls is FrozenMapping:
        return value._log  # pyright: ignore[reportAttributeAccessIssue]
    if cls in _no_span or not _span_of(value):
        return None
    # A scan's per-iteration entry (duck-typed, as in `_span_of`).
    stacked = getattr(value, "stacked", None)
    return stacked._log if type(stacked) is FrozenMapping else None


def _resolve_traced(root: _Log) -> bool:
    """Derive `traced` of a log and of the levels below it whose flag is not known.

    A walk with its own stack (collections nest as deep as models do), visiting
    each such level once: a level whose flag is known is not entered. Called under
    `_LOCK` by insertion (an open log's values are appended under it).
    """
    stack: list[tuple[_Log, Iterator[Entry]]] = [(root, iter(root))]
    while stack:
        log, values = stack[-1]
        below: _Log | None = None
        traced = False
        for value in values:
            sub = _level_log(value)
            if sub is None:
                if _leaf_traced(value):
                    traced = True
                    break
            elif sub.traced is None:
                below = sub
                break
            elif sub.traced:
                traced = True
                break
        if below is not None:
            stack.append((below, iter(below)))
            continue
        stack.pop()
        # A traced level makes every level above it traced.
        done = [log, *(above for above, _ in stack)] if traced else [log]
        with _INDEX_LOCK:
            for level in done:
                if level.traced is None:
                    level.traced = traced
        if traced:
            break
    return bool(root.traced)


def _span_of(value: object) -> int:
    # Duck-typed so that this module does not depend on `IterationSummaries`.
    cls = type(value)
    if cls in _no_span:
        return 0
    span = getattr(cls, "reserved_span", None)
    if span is None:
        _no_span.add(cls)
        return 0
    return span.__get__(value)


class FrozenMapping(Mapping[str, Entry]):
    """A read-only `Mapping[str, ...]`, as held by every level of an `OutputCollection`.

    Reads (`m[key]`, `key in m`, `len(m)`, iteration in insertion order) are those of
    a `dict`; writes raise `TypeError`. A PyTree node like `dict` (children in sorted
    key order, `jax.tree_util.DictKey` paths), so `jax.tree_util` functions see the
    same leaves in the same order as for the equivalent `dict`.
    """

    # `_flat`: this version's children in key order, kept after the first flatten
    # (JAX flattens a jitted function's outputs up to three times); None until then,
    # and for logs made by unflattening, which are in key order already.
    __slots__ = ("_flat", "_log", "_n", "_sorted")

    def __init__(
        self, items: Mapping[str, Entry] | Pairs = (), *, checked: bool = False
    ):
        # `checked`: whether every leaf of `items` is known to be a valid collection
        # leaf (`freeze` checked them, or they come from a level that was); else
        # `freeze` checks them where the mapping enters a collection.
        index: dict[str, int] = {}
        log = _Log(index, [], index, checked=checked)
        pairs = items.items() if isinstance(items, Mapping) else items
        for key, value in pairs:
            if key in index:
                raise ValueError(f"`FrozenMapping`: key {key!r} given twice.")
            log.add(key, value, _span_of(value))
        self._log = log
        self._n = len(log.keys)
        self._sorted: Keys | None = None
        self._flat: Children | None = None

    # -- reading -----------------------------------------------------------------

    # The reads inline `_index` (they run several times per add).
    def __getitem__(self, key: str) -> Entry:
        log = self._log
        index = log.positions
        pos = (index if index is not None else log.build_index()).get(key)
        if pos is None or pos >= self._n:
            raise KeyError(key)
        return log[pos]

    def get(self, key: str, default: Entry = None) -> Entry:
        """Return the value of `key`, or `default` if absent."""
        log = self._log
        index = log.positions
        pos = (index if index is not None else log.build_index()).get(key)
        if pos is None or pos >= self._n:
            return default
        return log[pos]

    def __contains__(self, key: object) -> bool:
        log = self._log
        index = log.positions
        if index is None:
            index = log.build_index()
        pos = index.get(key) if type(key) is str or isinstance(key, str) else None
        return pos is not None and pos < self._n

    def __iter__(self) -> Iterator[str]:
        # Entries appended to the shared log later never show up, also while
        # iterating: a copy of this version's keys (an open log's keys are a dict,
        # which may be extended meanwhile).
        keys = self._log.keys
        if type(keys) is tuple:
            return itertools.islice(keys, self._n)
        return iter(list(itertools.islice(keys, self._n)))

    def __len__(self) -> int:
        return self._n

    def items_list(self) -> list[Any]:  # of `(key, entry)` pairs (see `Pairs`)
        """Return `list(self.items())`, faster."""
        log, n = self._log, self._n
        keys = list(itertools.islice(log.keys, n))
        return list(zip(keys, log[:n], strict=True))

    def sorted_keys(self) -> Keys:
        """Return the keys in sorted order (the PyTree order), cached."""
        keys = self._sorted
        if keys is None:
            keys = tuple(sorted(itertools.islice(self._log.keys, self._n)))
            self._sorted = keys
        return keys

    def __repr__(self) -> str:
        return "FrozenMapping(" + repr(dict(self.items_list())) + ")"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return dict(self.items_list()) == dict(other.items())

    __hash__ = None

    def __reduce__(self) -> tuple[object, ...]:
        return (FrozenMapping, (self.items_list(),))

    def __copy__(self) -> "FrozenMapping":
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> "FrozenMapping":
        import copy

        return FrozenMapping(
            [(k, copy.deepcopy(v, memo)) for k, v in self.items_list()],
            checked=self.checked,
        )

    @property
    def checked(self) -> bool:
        """Whether every leaf was checked where it entered (not after unflattening)."""
        return self._log.checked

    def mark_checked(self) -> None:
        """Record that every leaf of this version has been checked (`freeze` does)."""
        if len(self._log.keys) == self._n:
            self._log.checked = True

    # -- reserved numbered names -------------------------------------------------

    def reserver(self, name: str) -> str | None:
        """Return the key whose span reserves `name` (`iter` for `iter3`), if any."""
        if not name[-1:].isdigit():
            return None
        log = self._log
        if log.positions is None:
            log.build_index()
        spans = log.spans
        if not spans:
            return None
        for prefix, i in _numbered_splits(name):
            found = spans.get(prefix)
            if found is not None and found[0] < self._n and i < found[1]:
                return prefix
        return None

    def numbered_in(self, prefix: str, span: int) -> Iterator[str]:
        """Yield the keys `f"{prefix}{i}"` with `i < span` present here."""
        with _LOCK:
            found = list(self._log.numbers().get(prefix, ()))
        for pos, i in found:
            if pos < self._n and i < span:
                yield f"{prefix}{i}"

    def numbered_below(self, prefix: str, span: int) -> str | None:
        """Return a key `f"{prefix}{i}"` with `i < span` present here, if any."""
        return next(self.numbered_in(prefix, span), None)

    def spans(self) -> Iterator[tuple[str, int]]:
        """Yield `(key, span)` for every entry that reserves numbered names."""
        log = self._log
        if log.positions is None:
            log.build_index()
        for key, (pos, span) in (log.spans or {}).items():
            if pos < self._n:
                yield key, span

    # -- persistent insertion ------------------------------------------------------

    def inserted(self, key: str, value: Entry) -> "FrozenMapping":
        """Return a new version with `key: value` added; `self` is unchanged.

        O(1) amortized. Only the key is checked, not the value (an add through
        `Context` or `OutputCollection` checks both).

        Raises:
            TypeError: if `key` is not a non-empty `str`.
            ValueError: if `key` is already a key here (a mapping holds each key
                once).
        """
        _check_new_key(self, key, (), "inserted")
        return insert(self, key, value)

    def updated(self, pairs: Pairs) -> "FrozenMapping":
        """Return a new version with every `(key, value)` pair of `pairs` added.

        Raises:
            TypeError: if a key is not a non-empty `str`.
            ValueError: if a key is already a key here or comes twice in `pairs`.
        """
        pairs = list(pairs)
        seen: set[str] = set()
        for key, _ in pairs:
            _check_new_key(self, key, seen, "updated")
            seen.add(key)
        return insert_all(self, pairs)


def _check_new_key(
    m: FrozenMapping, key: object, seen: Collection[str], where: str
) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(
            f"`FrozenMapping.{where}`: keys are non-empty strings, got {key!r}."
        )
    if key in m or key in seen:
        raise ValueError(
            f"`FrozenMapping.{where}`: {key!r} is already a key; a mapping holds "
            "each key once (use a new name, or build a dict from it)."
        )


def insert(m: FrozenMapping, key: str, value: Entry) -> FrozenMapping:
    """`m.inserted(key, value)` for callers that have checked `key` (unchecked)."""
    with _LOCK:
        return _insert(m, key, value)


def insert_all(m: FrozenMapping, pairs: Pairs) -> FrozenMapping:
    """`m.updated(pairs)` for callers that have checked the keys (unchecked)."""
    with _LOCK:
        for key, value in pairs:
            m = _insert(m, key, value)
    return m


#: Types whose values are PyTree leaves, not tracers, levels nor scan entries (arrays,
#: numbers): such a value holds no tracer and reserves no names.
_plain_types: set[type] = set()
#: Tracer types (`jax.core.Tracer` subclasses).
_tracer_types: set[type] = set()


def _leaf_traced(value: object) -> bool:
    """Whether `value` (not a level) is a tracer or a PyTree holding one.

    PyTrees: a `Summary`, an empty scan's entry. Plain leaf types are remembered.
    """
    cls = type(value)
    if cls in _plain_types:
        return False
    if cls in _tracer_types:
        return True
    if issubclass(cls, Tracer):
        _tracer_types.add(cls)
        return True
    leaves = jax.tree_util.tree_leaves(value)
    if len(leaves) == 1 and leaves[0] is value:
        if not _span_of(value):  # (a type with a `reserved_span` is no plain leaf)
            _plain_types.add(cls)
        return False
    return any(isinstance(leaf, Tracer) for leaf in leaves)


def _traced_value(value: object) -> bool:
    """`_holds_tracer(value)`, by a type lookup for plain values and tracers."""
    cls = type(value)
    if cls in _plain_types:
        return False
    if cls in _tracer_types:
        return True
    if cls is FrozenMapping:  # a child's level
        sub = value._log  # pyright: ignore[reportAttributeAccessIssue]
        traced = sub.traced
        return traced if traced is not None else _resolve_traced(sub)
    return _holds_tracer(value)


def _insert(m: FrozenMapping, key: str, value: Entry) -> FrozenMapping:
    """`m.inserted(key, value)`; the caller holds `_LOCK`."""
    log, n = m._log, m._n
    keys = log.keys
    cls = type(value)
    traced = (
        False
        if cls in _plain_types
        else True
        if cls in _tracer_types
        else _traced_value(value)
    )
    if n == 0 and len(keys) != 0:
        # Adding to an empty version that is not a log's tip (the shared `EMPTY`):
        # start a log.
        span = 0 if type(value) in _no_span else _span_of(value)
        index = {key: 0}
        return _version(
            _Log(index, [value], index, {key: (0, span)} if span else None, traced),
            1,
        )
    if type(keys) is not dict:
        keys = log.open()
    # (`traced` first: the log's own flag may need a walk of its levels, which only
    # a traced value needs.)
    if len(keys) == n and (
        not traced
        or (
            log.trace is not None
            and (log.traced or log.holds_tracer())
            and log.trace == _traces.current_trace()
        )
    ):
        # The newest version: append in place (`keys` is the index). A tracer only
        # to a log of tracers made under the current trace (see `_Log.trace`).
        log.append(value)
        keys[key] = n
        if type(value) not in _no_span and (span := _span_of(value)):
            log._add_span(key, n, span)
        # (`log.traced` needs no update: a traced value is appended in place only
        # to a log that is traced already.)
        out = _new(FrozenMapping)
        out._log = log
        out._n = n + 1
        out._sorted = None
        out._flat = None
        return out
    if len(log.keys) != n:
        # `m` is extended a second time (a branch): it is being kept and reused.
        # From now on it reads a sealed copy of its own entries, so it keeps nothing
        # added after it alive, and is always copied.
        m._log = _copy(log, n, seal=True)
    # Under the lock: another thread may be appending to `log` (its spans).
    new = _copy(log, n, seal=False)
    new.add(key, value, _span_of(value))
    return _version(new, n + 1)


def inserted_child(levels: "Levels", key: str, children: "Levels") -> "Levels":
    """Return each of `levels` with `key` mapped to the matching one of `children`.

    Three `inserted` calls under one lock: every `ctx.call` runs this.
    """
    s, su, mo = levels
    cs, csu, cmo = children
    with _LOCK:
        return _insert(s, key, cs), _insert(su, key, csu), _insert(mo, key, cmo)


def _copy(log: _Log, n: int, *, seal: bool) -> _Log:
    """A new open log with the first `n` entries of `log` (sealed: never appended to).

    `log` is open (the caller opened it).
    """
    index = {k: i for i, k in enumerate(list(itertools.islice(log.keys, n)))}
    spans = log.spans
    if spans:
        spans = {k: v for k, v in spans.items() if v[0] < n} or None
    new = _Log(index, log[:n], index, spans, log.traced, log.checked)
    if seal:  # one entry past every version: insertion always takes the branch path
        # ("" is no valid name, and position n is past every version's end.)
        index[""] = n
        new.append(None)
    return new


def _version(log: _Log, n: int) -> FrozenMapping:
    """The version of `log` that holds its first `n` entries."""
    out = object.__new__(FrozenMapping)
    out._log = log
    out._n = n
    out._sorted = None
    out._flat = None
    return out


def _sealed_empty() -> FrozenMapping:
    # The shared empty mapping must never be extended in place (its log would keep
    # the first value ever added to it alive): a log one entry longer than the
    # version makes every insertion take the branch path, which starts a new log.
    index = {"": 0}
    return _version(_Log(index, [None], index), 0)


#: The empty mapping, shared (adding to it starts a new log every time).
EMPTY = _sealed_empty()
_EMPTY_LOG = EMPTY._log


# The checks of every add and child, over a collection's three levels at once (one
# call instead of several method calls per level).

#: A collection's three levels (summaries, state updates, module outputs).
Levels: TypeAlias = tuple[FrozenMapping, FrozenMapping, FrozenMapping]


def _reserved(name: str, levels: "Levels") -> str | None:
    for m in levels:
        log = m._log
        if log.positions is None:
            log.build_index()
        if log.spans:
            owner = m.reserver(name)
            if owner is not None:
                return owner
    return None


def key_in_any(name: str, levels: "Levels") -> bool:
    """Whether `name` is a key of one of `levels`, or reserved by a span of one."""
    for m in levels:
        log = m._log
        index = log.positions
        if index is None:
            index = log.build_index()
        pos = index.get(name)
        if pos is not None and pos < m._n:
            return True
    return name[-1:].isdigit() and _reserved(name, levels) is not None


def leaf_clashes(
    name: str, target: FrozenMapping, levels: "Levels", child_types: frozenset[type]
) -> bool:
    """Whether adding leaf `name` to `target` (one of `levels`) clashes.

    It does if `name` is a key of `target`, a child (of `child_types`) in one of
    `levels`, or reserved by a span of one; one pass over the levels (every add runs
    it).
    """
    for m in levels:
        log = m._log
        index = log.positions
        if index is None:
            index = log.build_index()
        pos = index.get(name)
        if (
            pos is not None
            and pos < m._n
            and (m is target or type(log[pos]) in child_types)
        ):
            return True
    return name[-1:].isdigit() and _reserved(name, levels) is not None


# Flattening and unflattening run at every transformation boundary, for every level
# of every collection: they avoid per-entry method calls.


#: sorted keys -> their `DictKey`s: the levels of a model's children repeat the same
#: few key sets, and a `DictKey` per entry and flatten costs more than the lookup.
_dict_keys: dict[Keys, tuple[Any, ...]] = {}


def _children(m: FrozenMapping, keys: Keys) -> Children:
    """The children of a version of an open log in key order, kept in `m._flat`."""
    children = m._flat
    if children is None:
        log = m._log
        index = log.positions
        if index is None:
            index = log.build_index()
        children = m._flat = tuple([log[index[k]] for k in keys])
    return children


# (Both inline their fast paths: a call per level and flatten would cost as much as
# the rest.)
def _flatten_with_keys(m: FrozenMapping) -> tuple[list[Any], Keys]:
    keys = m._sorted
    if keys is None:
        keys = m.sorted_keys()
    if not keys:
        return [], ()
    log = m._log
    if log.keys is keys:
        children = log
    elif m._n == 1:
        children = (log[0],)
    else:
        children = m._flat
        if children is None:
            children = _children(m, keys)
    dict_keys = _dict_keys.get(keys)
    if dict_keys is None:
        dict_keys = tuple(map(_DICT_KEY, keys))
        if len(_dict_keys) < 4096:  # bounded: generated names cannot grow it forever
            _dict_keys[keys] = dict_keys
    return list(zip(dict_keys, children)), keys  # noqa: B905


def _flatten(m: FrozenMapping) -> tuple[Children, Keys]:
    keys = m._sorted
    if keys is None:
        keys = m.sorted_keys()
    if not keys:
        return (), ()
    log = m._log
    if log.keys is keys:  # (a copy: `flatten_one_level` hands the children out)
        return tuple(log), keys
    if m._n == 1:
        return (log[0],), keys
    children = m._flat
    if children is None:
        children = _children(m, keys)
    return children, keys


def _unflatten(keys: Keys, children: Children) -> FrozenMapping:
    # No checks: JAX unflattens with arbitrary objects (tracers, sentinels, None).
    # The log is frozen: its index, spans and tracer flag are derived when a read
    # needs them, so this costs two objects (JAX unflattens at every boundary).
    if not keys:
        # A new object (sharing `EMPTY`'s sealed log): levels are found by identity
        # (`eqx.tree_at`), so the empty levels of one collection must differ.
        out = _new(FrozenMapping)
        out._log = _EMPTY_LOG
        out._n = 0
        out._sorted = ()
        out._flat = None
        return out
    log = _new_log(_Log)
    _extend(log, children)
    log.keys = keys
    log.positions = None
    log.spans = None
    log.numbered = None
    log.numbered_upto = 0
    log.traced = None
    log.trace = None  # (not known: a traced insertion copies it first)
    log.checked = False  # leaves of any kind; `freeze` checks them when they enter
    out = _new(FrozenMapping)
    out._log = log
    out._n = len(keys)
    out._sorted = keys
    out._flat = None
    return out


_new = object.__new__
_new_log = list.__new__
_extend = list.extend

jax.tree_util.register_pytree_with_keys(
    FrozenMapping, _flatten_with_keys, _unflatten, _flatten
)

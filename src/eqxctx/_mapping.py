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

import itertools
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeAlias

import jax
from jax.core import Tracer


# Insertion checks "is this version the newest?" and appends under one lock, so that
# two threads extending the same version never both append to the shared log.
_LOCK = threading.Lock()


def _numbered_splits(key: str) -> Iterator[tuple[str, int]]:
    """Yield each `(prefix, i)` with `key == f"{prefix}{i}"` and `str(i)` canonical."""
    end = len(key)
    start = end
    while start > 1 and key[start - 1].isdigit() and key[start - 1].isascii():
        start -= 1
    for k in range(start, end):
        if key[k] != "0" or k == end - 1:
            yield key[:k], int(key[k:])


class _Log:
    """The entries of every version of one mapping, in insertion order."""

    __slots__ = (
        "checked",
        "index",
        "keys",
        "numbered",
        "numbered_upto",
        "spans",
        "traced",
        "values",
    )

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.values: list[Any] = []
        self.index: dict[str, int] = {}
        self.spans: dict[str, tuple[int, int]] = {}  # key -> (position, span)
        # prefix -> [(pos, i)] for the keys `prefix{i}`; built lazily (only merging a
        # scan's entry asks), up to `numbered_upto` keys.
        self.numbered: dict[str, list[tuple[int, int]]] = {}
        self.numbered_upto = 0
        # Whether a value is a tracer: a log of concrete values (a collection made
        # outside `jax.jit`) is never extended in place with one, so no collection
        # that outlives a trace holds its tracers.
        self.traced = False
        # Whether every leaf was checked where it entered (see `freeze`); logs built
        # by unflattening are not.
        self.checked = True

    def append(self, key: str, value: Any, span: int) -> None:
        pos = len(self.keys)
        self.keys.append(key)
        self.values.append(value)
        self.index[key] = pos
        if span:
            self.spans[key] = (pos, span)
        if not self.traced and isinstance(value, Tracer):
            self.traced = True

    def numbers(self) -> dict[str, Any]:
        """Return the index of numbered keys, brought up to date (amortized O(1))."""
        keys = self.keys
        for pos in range(self.numbered_upto, len(keys)):
            key = keys[pos]
            if key[-1:].isdigit():
                for prefix, i in _numbered_splits(key):
                    self.numbered.setdefault(prefix, []).append((pos, i))
        self.numbered_upto = len(keys)
        return self.numbered


# Element types of sequences in these signatures are `Any`: beartype (the test
# suite's runtime checks) samples sequence items with `random`, which hypothesis
# forbids inside strategies, and collections are built inside `eqxctx.testing`'s.
Pairs: TypeAlias = Iterable[Any]  # of `(key, value)` tuples
Keys: TypeAlias = tuple[Any, ...]  # of `str`


_no_span: set[type] = set()


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


class FrozenMapping(Mapping[str, Any]):
    """A read-only `Mapping[str, ...]`, as held by every level of an `OutputCollection`.

    Reads (`m[key]`, `key in m`, `len(m)`, iteration in insertion order) are those of
    a `dict`; writes raise `TypeError`. A PyTree node like `dict` (children in sorted
    key order, `jax.tree_util.DictKey` paths), so `jax.tree_util` functions see the
    same leaves in the same order as for the equivalent `dict`.
    """

    __slots__ = ("_log", "_n", "_sorted")

    def __init__(self, items: Mapping[str, Any] | Pairs = ()):
        log = _Log()
        pairs = items.items() if isinstance(items, Mapping) else items
        for key, value in pairs:
            if key in log.index:
                raise ValueError(f"`FrozenMapping`: key {key!r} given twice.")
            log.append(key, value, _span_of(value))
        self._log = log
        self._n = len(log.keys)
        self._sorted: Keys | None = None

    # -- reading -----------------------------------------------------------------

    def __getitem__(self, key: str) -> Any:
        pos = self._log.index.get(key)
        if pos is None or pos >= self._n:
            raise KeyError(key)
        return self._log.values[pos]

    def get(self, key: str, default: Any = None) -> Any:
        """Return the value of `key`, or `default` if absent."""
        pos = self._log.index.get(key)
        if pos is None or pos >= self._n:
            return default
        return self._log.values[pos]

    def __contains__(self, key: object) -> bool:
        pos = self._log.index.get(key) if isinstance(key, str) else None
        return pos is not None and pos < self._n

    def __iter__(self) -> Iterator[str]:
        # `islice`: entries appended to the shared log later never show up, also
        # while iterating.
        return itertools.islice(self._log.keys, self._n)

    def __len__(self) -> int:
        return self._n

    def items_list(self) -> list[Any]:
        """Return `list(self.items())`, faster."""
        log = self._log
        return list(zip(log.keys[: self._n], log.values[: self._n], strict=True))

    def sorted_keys(self) -> Keys:
        """Return the keys in sorted order (the PyTree order), cached."""
        keys = self._sorted
        if keys is None:
            keys = tuple(sorted(self._log.keys[: self._n]))
            self._sorted = keys
        return keys

    def __repr__(self) -> str:
        return "FrozenMapping(" + repr(dict(self.items_list())) + ")"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return dict(self.items_list()) == dict(other.items())

    __hash__ = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenMapping, (self.items_list(),))

    def __copy__(self) -> "FrozenMapping":
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> "FrozenMapping":
        import copy

        return FrozenMapping(
            [(k, copy.deepcopy(v, memo)) for k, v in self.items_list()]
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
        spans = self._log.spans
        if not spans or not name[-1:].isdigit():
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
        for key, (pos, span) in self._log.spans.items():
            if pos < self._n:
                yield key, span

    # -- persistent insertion ------------------------------------------------------

    def inserted(self, key: str, value: Any) -> "FrozenMapping":
        """Return a new version with `key: value` added; `self` is unchanged.

        O(1) amortized. The caller has checked that `key` is not present.
        """
        log, n = self._log, self._n
        with _LOCK:
            if len(log.keys) == n and (log.traced or not isinstance(value, Tracer)):
                # The newest version: append in place.
                log.keys.append(key)
                log.values.append(value)
                log.index[key] = n
                if type(value) not in _no_span and (span := _span_of(value)):
                    log.spans[key] = (n, span)
                if isinstance(value, Tracer):
                    log.traced = True
                out = object.__new__(FrozenMapping)
                out._log = log
                out._n = n + 1
                out._sorted = None
                return out
            if len(log.keys) != n:
                # `self` is extended a second time (a branch): it is being kept and
                # reused. From now on it reads a sealed copy of its own entries, so
                # it keeps nothing added after it alive, and is always copied.
                self._log = _copy(log, n, seal=True)
        new = _copy(log, n, seal=False)
        new.append(key, value, _span_of(value))
        return _version(new, n + 1)

    def updated(self, pairs: Pairs) -> "FrozenMapping":
        """Return a new version with every pair added (keys checked by the caller)."""
        out = self
        for key, value in pairs:
            out = out.inserted(key, value)
        return out


def _copy(log: _Log, n: int, *, seal: bool) -> _Log:
    """A new log with the first `n` entries of `log` (sealed: never appended to)."""
    new = _Log()
    new.keys = log.keys[:n]
    new.values = log.values[:n]
    new.index = {k: i for i, k in enumerate(new.keys)}
    new.spans = {k: v for k, v in log.spans.items() if v[0] < n}
    new.traced = log.traced
    new.checked = log.checked
    if seal:  # one entry past every version: insertion always takes the branch path
        new.keys.append("")
        new.values.append(None)
    return new


def _version(log: _Log, n: int) -> FrozenMapping:
    """The version of `log` that holds its first `n` entries."""
    out = object.__new__(FrozenMapping)
    out._log = log  # pyright: ignore[reportPrivateUsage]
    out._n = n  # pyright: ignore[reportPrivateUsage]
    out._sorted = None  # pyright: ignore[reportPrivateUsage]
    return out


def _sealed_empty() -> FrozenMapping:
    # The shared empty mapping must never be extended in place (its log would keep
    # the first value ever added to it alive): a log one entry longer than the
    # version makes every insertion take the branch path, which starts a new log.
    log = _Log()
    log.keys.append("")
    log.values.append(None)
    return _version(log, 0)


#: The empty mapping, shared (adding to it starts a new log every time).
EMPTY = _sealed_empty()


# Flattening and unflattening run at every transformation boundary, for every level
# of every collection: they avoid per-entry method calls.


class _UnflattenedLog(_Log):
    """The log of a mapping made by unflattening, built when it is first read.

    JAX unflattens every level of every collection that leaves a transformation
    (after each call of a jitted function), and most of those levels are flattened
    again (`jax.block_until_ready`, the next call) or read a little, so only the
    children and the keys are stored: the lists, the key index, the spans and the
    tracer flag are derived from them the first time they are read, and `checked`
    starts False (`freeze` checks the leaves where they enter a collection). Once
    derived, an attribute is an ordinary slot. `children` stays the version's
    values in sorted key order, so flattening it again needs no lookups.
    """

    __slots__ = ("children", "sorted_keys")

    def __getattr__(self, name: str) -> Any:
        # Called only for a slot not yet set (`children`, `sorted_keys` always are).
        # Each is derived from the current lists (`inserted` may have appended to
        # them), once: under a lock, as another thread may be deriving it too.
        with _DERIVE_LOCK:
            try:
                return object.__getattribute__(self, name)
            except AttributeError:
                pass
            if name == "keys":
                value: Any = list(self.sorted_keys)
            elif name == "values":
                value = list(self.children)
            elif name == "index":
                value = {k: i for i, k in enumerate(self.keys)}
            elif name == "spans":
                value = {
                    k: (i, span)
                    for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True))
                    if (span := _span_of(v))
                }
            elif name == "traced":
                value = any(isinstance(v, Tracer) for v in self.values)
            elif name == "checked":
                value = False  # any leaves: `freeze` checks them where they enter
            elif name == "numbered":
                value = {}
            elif name == "numbered_upto":
                value = 0
            else:
                raise AttributeError(name)
            setattr(self, name, value)
            return value


_DERIVE_LOCK = threading.RLock()  # re-entrant: deriving `index` reads `keys`


def _flatten_with_keys(m: FrozenMapping) -> tuple[list[Any], Keys]:
    key_type = jax.tree_util.DictKey
    log = m._log  # pyright: ignore[reportPrivateUsage]
    if type(log) is _UnflattenedLog and m._n == len(log.sorted_keys):  # pyright: ignore[reportPrivateUsage]
        keys = log.sorted_keys
        return list(zip(map(key_type, keys), log.children, strict=True)), keys
    keys = m.sorted_keys()
    index, values = log.index, log.values
    return [(key_type(k), values[index[k]]) for k in keys], keys


def _flatten(m: FrozenMapping) -> tuple[Iterable[Any], Keys]:
    log = m._log  # pyright: ignore[reportPrivateUsage]
    # As unflattened (not extended since): the children, in sorted key order.
    if type(log) is _UnflattenedLog and m._n == len(log.sorted_keys):  # pyright: ignore[reportPrivateUsage]
        return log.children, log.sorted_keys
    keys = m.sorted_keys()
    index, values = log.index, log.values
    return [values[index[k]] for k in keys], keys


def _unflatten(keys: Keys, children: Iterable[Any]) -> FrozenMapping:
    # No checks: JAX unflattens with arbitrary objects (tracers, sentinels, None).
    # Called for every level of every collection leaving a transformation (each
    # jitted call's outputs): stores the two tuples, derives the rest when read.
    log = object.__new__(_UnflattenedLog)
    log.sorted_keys = keys
    log.children = tuple(children)  # JAX passes a tuple: the same object
    out = object.__new__(FrozenMapping)
    out._log = log  # pyright: ignore[reportPrivateUsage]
    out._n = len(keys)  # pyright: ignore[reportPrivateUsage]
    out._sorted = keys  # pyright: ignore[reportPrivateUsage]
    return out


jax.tree_util.register_pytree_with_keys(
    FrozenMapping, _flatten_with_keys, _unflatten, _flatten
)

"""FrozenMapping: the persistent, read-only mapping of every collection level.

A version is never written after it is made: its entries live in a hash array
mapped trie (`immutables.Map`), so an add makes a new version in O(log n) that
shares all but one path with the old one. The insertion order, which reads and
`repr` show, is a persistent chain: the keys a version was built with, then `(key,
rest)` cells of the keys added since, newest first.

A version made by unflattening keeps its sorted keys and children as JAX hands them
over, and builds its trie only when a read needs it.

An entry may reserve numbered names: an entry `key` with span `N` stands for `key0`
… `key{N-1}` too (a scan's per-iteration children). A version keeps its spans in a
second trie; `reserver(name)` splits the trailing digits of `name` and looks the
prefix up there.
"""

# pyright: reportPrivateUsage=false

import copy
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any, TypeAlias

import immutables
import jax

from ._typing import Children, Names


#: A value of a level: a leaf, a nested `FrozenMapping` or a scan's per-iteration
#: entry (duck-typed here: this module imports none of their classes).
Entry: TypeAlias = Any

# Element types of sequences in these signatures are `Any`: beartype (the test
# suite's runtime checks) samples sequence items with `random`, which hypothesis
# forbids inside strategies, and collections are built inside `eqxctx.testing`'s.
Pairs: TypeAlias = Iterable[Any]  # of `(key, value)` tuples
Keys: TypeAlias = Names  # of `str`

_DICT_KEY = jax.tree_util.DictKey
_MISSING: Any = object()
_Trie: TypeAlias = immutables.Map[str, Any]
_EMPTY_TRIE: _Trie = immutables.Map()


def _numbered_splits(key: str) -> Iterator[tuple[str, int]]:
    """Yield each `(prefix, i)` with `key == f"{prefix}{i}"` and `str(i)` canonical."""
    end = len(key)
    start = end
    while start > 1 and key[start - 1].isdigit() and key[start - 1].isascii():
        start -= 1
    for k in range(start, end):
        if key[k] != "0" or k == end - 1:
            yield key[:k], int(key[k:])


#: Types that reserve no names (looked up once per type).
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


class FrozenMapping(Mapping[str, Entry]):
    """A read-only `Mapping[str, ...]`, as held by every level of an `OutputCollection`.

    Reads (`m[key]`, `key in m`, `len(m)`, iteration in insertion order) are those of
    a `dict`; writes raise `TypeError`. A PyTree node like `dict` (children in sorted
    key order, `jax.tree_util.DictKey` paths), so `jax.tree_util` functions see the
    same leaves in the same order as for the equivalent `dict`.
    """

    # `_trie`: key -> entry (None until a read needs it, for an unflattened version,
    # whose entries are `_base` and `_values`). `_base`: the keys the version was
    # built with, in order; `_chain`: `(key, rest)` cells of the keys added since,
    # newest first. `_spans`: key -> span of the entries that reserve numbered names
    # (None until known, for an unflattened version). `_checked`: whether every leaf
    # is known to be a valid collection leaf (it only ever turns True). `_sorted`,
    # `_flat`: the sorted keys and the children in that order, kept once derived.
    # Every field but these derived ones is set once, when the version is made.
    __slots__ = (
        "_base",
        "_chain",
        "_checked",
        "_flat",
        "_n",
        "_sorted",
        "_spans",
        "_trie",
        "_values",
    )

    _trie: _Trie | None
    _base: Keys
    _values: Children | None
    _chain: tuple[Any, ...] | None
    _n: int
    _spans: _Trie | None
    _checked: bool
    _sorted: Keys | None
    _flat: Children | None

    def __init__(
        self, items: Mapping[str, Entry] | Pairs = (), *, checked: bool = False
    ):
        # `checked`: whether every leaf of `items` is known to be a valid collection
        # leaf (`freeze` checked them, or they come from a level that was); else
        # `freeze` checks them where the mapping enters a collection.
        pairs = list(items.items() if isinstance(items, Mapping) else items)
        trie = _EMPTY_TRIE.mutate()
        spans = _EMPTY_TRIE.mutate()
        for key, value in pairs:
            if key in trie:
                raise ValueError(f"`FrozenMapping`: key {key!r} given twice.")
            trie[key] = value
            if span := _span_of(value):
                spans[key] = span
        self._trie = trie.finish()
        self._base = tuple(key for key, _ in pairs)
        self._values = None
        self._chain = None
        self._n = len(pairs)
        self._spans = spans.finish()
        self._checked = checked
        self._sorted = None
        self._flat = None

    # -- derived state ------------------------------------------------------------

    def _entries(self) -> _Trie:
        """The key -> entry trie, built once for an unflattened version."""
        trie = self._trie
        if trie is None:
            values = self._values
            assert values is not None
            trie = self._trie = immutables.Map(zip(self._base, values, strict=True))
        return trie

    def _span_trie(self) -> _Trie:
        spans = self._spans
        if spans is None:
            values = self._values
            assert values is not None
            found = [
                (key, span)
                for key, value in zip(self._base, values, strict=True)
                if type(value) not in _no_span and (span := _span_of(value))
            ]
            spans = self._spans = immutables.Map(found) if found else _EMPTY_TRIE
        return spans

    # -- reading -----------------------------------------------------------------

    def __getitem__(self, key: str) -> Entry:
        return (self._trie or self._entries())[key]

    def get(self, key: str, default: Entry = None) -> Entry:
        """Return the value of `key`, or `default` if absent."""
        return (self._trie or self._entries()).get(key, default)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in (self._trie or self._entries())

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def _keys(self) -> Keys:
        """The keys in insertion order."""
        chain = self._chain
        if chain is None:
            return self._base
        added: list[str] = []
        while chain is not None:
            key, chain = chain
            added.append(key)
        added.reverse()
        return (*self._base, *added)

    def __len__(self) -> int:
        return self._n

    def items_list(self) -> list[Any]:  # of `(key, entry)` pairs (see `Pairs`)
        """Return `list(self.items())`, faster."""
        if self._chain is None and self._values is not None:
            return list(zip(self._base, self._values, strict=True))
        trie = self._trie or self._entries()
        return [(key, trie[key]) for key in self._keys()]

    def sorted_keys(self) -> Keys:
        """Return the keys in sorted order (the PyTree order), kept once derived."""
        keys = self._sorted
        if keys is None:
            keys = self._sorted = tuple(sorted(self._keys()))
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
        return FrozenMapping(
            [(k, copy.deepcopy(v, memo)) for k, v in self.items_list()],
            checked=self._checked,
        )

    @property
    def checked(self) -> bool:
        """Whether every leaf was checked where it entered (not after unflattening)."""
        return self._checked

    def mark_checked(self) -> None:
        """Record that every leaf of this version has been checked (`freeze` does).

        A derived fact about the version's (unchanging) entries, kept like a hash.
        """
        self._checked = True

    # -- reserved numbered names -------------------------------------------------

    def reserver(self, name: str) -> str | None:
        """Return the key whose span reserves `name` (`iter` for `iter3`), if any."""
        if not name[-1:].isdigit():
            return None
        spans = self._spans
        if spans is None:
            spans = self._span_trie()
        if not spans:
            return None
        for prefix, i in _numbered_splits(name):
            span = spans.get(prefix)
            if span is not None and i < span:
                return prefix
        return None

    def numbered_in(self, prefix: str, span: int) -> Iterator[str]:
        """Yield the keys `f"{prefix}{i}"` with `i < span` present here.

        O(min(span, len(self))): merging a scan's entry asks this once.
        """
        if span <= self._n:
            trie = self._trie or self._entries()
            for i in range(span):
                if (name := f"{prefix}{i}") in trie:
                    yield name
            return
        for key in self._keys():
            if key.startswith(prefix) and key[-1:].isdigit():
                for p, i in _numbered_splits(key):
                    if p == prefix and i < span:
                        yield key

    def numbered_below(self, prefix: str, span: int) -> str | None:
        """Return a key `f"{prefix}{i}"` with `i < span` present here, if any."""
        return next(self.numbered_in(prefix, span), None)

    def spans(self) -> Iterator[tuple[str, int]]:
        """Yield `(key, span)` for every entry that reserves numbered names."""
        spans = self._spans
        if spans is None:
            spans = self._span_trie()
        return iter(spans.items())

    # -- persistent insertion ------------------------------------------------------

    def inserted(self, key: str, value: Entry) -> "FrozenMapping":
        """Return a new version with `key: value` added; `self` is unchanged.

        O(log n). Only the key is checked, not the value (an add through `Context`
        or `OutputCollection` checks both): the new version is not `checked`, so a
        collection made from it checks its leaves.

        Raises:
            TypeError: if `key` is not a non-empty `str`.
            ValueError: if `key` is already a key here (a mapping holds each key
                once).
        """
        _check_new_key(self, key, (), "inserted")
        return insert(self, key, value, checked=False)

    def updated(self, pairs: Pairs) -> "FrozenMapping":
        """Return a new version with every `(key, value)` pair of `pairs` added.

        Like `inserted`, the new version is not `checked` (its values are not).

        Raises:
            TypeError: if a key is not a non-empty `str`.
            ValueError: if a key is already a key here or comes twice in `pairs`.
        """
        pairs = list(pairs)
        seen: set[str] = set()
        for key, _ in pairs:
            _check_new_key(self, key, seen, "updated")
            seen.add(key)
        out = self
        for key, value in pairs:
            out = insert(out, key, value, checked=False)
        return out


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


_new = object.__new__


def insert(
    m: FrozenMapping, key: str, value: Entry, *, checked: bool | None = None
) -> FrozenMapping:
    """`m.inserted(key, value)` for callers that have checked `key` (unchecked).

    `checked`: whether the new version is checked (default: as `m`, for callers
    that have checked `value` too).
    """
    out = _new(FrozenMapping)
    out._trie = (m._trie or m._entries()).set(key, value)
    out._base = m._base
    out._values = None
    out._chain = (key, m._chain)
    out._n = m._n + 1
    spans = m._spans
    if spans is None:
        spans = m._span_trie()
    if type(value) not in _no_span and (span := _span_of(value)):
        spans = spans.set(key, span)
    out._spans = spans
    out._checked = m._checked if checked is None else checked
    out._sorted = None
    out._flat = None
    return out


def insert_all(m: FrozenMapping, pairs: Pairs) -> FrozenMapping:
    """`m.updated(pairs)` for callers that have checked the keys (unchecked)."""
    for key, value in pairs:
        m = insert(m, key, value)
    return m


#: A collection's three levels (summaries, state updates, module outputs).
Levels: TypeAlias = tuple[FrozenMapping, FrozenMapping, FrozenMapping]


def inserted_child(levels: Levels, key: str, children: Levels) -> Levels:
    """Return each of `levels` with `key` mapped to the matching one of `children`."""
    s, su, mo = levels
    cs, csu, cmo = children
    return insert(s, key, cs), insert(su, key, csu), insert(mo, key, cmo)


#: The empty mapping, shared (every version is immutable, so sharing is safe).
EMPTY = FrozenMapping(checked=True)


# The checks of every add and child, over a collection's three levels at once.


def _reserved(name: str, levels: Levels) -> str | None:
    for m in levels:
        owner = m.reserver(name)
        if owner is not None:
            return owner
    return None


def key_in_any(name: str, levels: Levels) -> bool:
    """Whether `name` is a key of one of `levels`, or reserved by a span of one."""
    for m in levels:
        if name in (m._trie or m._entries()):
            return True
    return name[-1:].isdigit() and _reserved(name, levels) is not None


def leaf_clashes(
    name: str, target: FrozenMapping, levels: Levels, child_types: frozenset[type]
) -> bool:
    """Whether adding leaf `name` to `target` (one of `levels`) clashes.

    It does if `name` is a key of `target`, a child (of `child_types`) in one of
    `levels`, or reserved by a span of one.
    """
    for m in levels:
        value = (m._trie or m._entries()).get(name, _MISSING)
        if value is not _MISSING and (m is target or type(value) in child_types):
            return True
    return name[-1:].isdigit() and _reserved(name, levels) is not None


# Flattening and unflattening run at every transformation boundary, for every level
# of every collection.

#: sorted keys -> their `DictKey`s: the levels of a model's children repeat the same
#: few key sets, and a `DictKey` per entry and flatten costs more than the lookup.
_dict_keys: dict[Keys, tuple[Any, ...]] = {}


def _flatten(m: FrozenMapping) -> tuple[Children, Keys]:
    keys = m._sorted
    if keys is None:
        keys = m._sorted = tuple(sorted(m._keys()))
    if not keys:
        return (), ()
    children = m._flat
    if children is None:
        if m._chain is None and m._values is not None:
            children = m._values  # unflattened: already in key order
        else:
            trie = m._trie or m._entries()
            children = tuple([trie[k] for k in keys])
        m._flat = children
    return children, keys


def _flatten_with_keys(m: FrozenMapping) -> tuple[list[Any], Keys]:
    # (`_flatten` inlined: this runs once per level at every boundary.)
    keys = m._sorted
    if keys is None:
        keys = m._sorted = tuple(sorted(m._keys()))
    if not keys:
        return [], ()
    children = m._flat
    if children is None:
        if m._chain is None and m._values is not None:
            children = m._values
        else:
            trie = m._trie or m._entries()
            children = tuple([trie[k] for k in keys])
        m._flat = children
    dict_keys = _dict_keys.get(keys)
    if dict_keys is None:
        dict_keys = tuple(map(_DICT_KEY, keys))
        if len(_dict_keys) < 4096:  # bounded: generated names cannot grow it forever
            _dict_keys[keys] = dict_keys
    return list(zip(dict_keys, children, strict=True)), keys


def _unflatten(keys: Keys, children: Children) -> FrozenMapping:
    # No checks: JAX unflattens with arbitrary objects (tracers, sentinels, None).
    # The trie and spans are derived when a read needs them. Always a new object:
    # levels are found by identity (`eqx.tree_at`), so the empty levels of one
    # collection must differ.
    out = _new(FrozenMapping)
    out._trie = None if keys else _EMPTY_TRIE
    out._base = keys
    out._values = tuple(children)
    out._chain = None
    out._n = len(keys)
    out._spans = None if keys else _EMPTY_TRIE
    # Leaves of any kind: `freeze` checks them when they enter a collection.
    out._checked = not keys
    out._sorted = keys
    out._flat = None
    return out


jax.tree_util.register_pytree_with_keys(
    FrozenMapping, _flatten_with_keys, _unflatten, _flatten
)

"""Stateful tests: every version of a collection stays what it was.

A pool of `OutputCollection` versions, each paired with a reference model made of
plain dicts, is extended at random: leaves and children are added to any version in
the pool (old ones too, so that versions branch, and one version is extended many
times), versions are merged, pruned, copied and passed through
`jax.tree_util.tree_map`. After every step, every version in the pool must still
equal its reference model: its levels (keys in insertion order, `len`, lookups), its
flattened paths and values, its child and leaf names and its child views. Conflicts
are predicted from the reference and the docstrings of `add_*`, `add_child` and
`merge`. `FrozenMapping` is checked through the collections and directly
(`inserted` / `updated`).
"""

import copy
import dataclasses
import pickle
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
)

from eqxctx import (
    Context,
    IterationSummaries,
    OutputCollection,
    OutputConflictError,
    scan_in_context,
)
from eqxctx._mapping import FrozenMapping


KINDS = ("summaries", "state_updates", "module_outputs")

# -- the reference model ----------------------------------------------------------

#: A level: name -> leaf, nested level (a child) or `IterRef` (summaries only).
Level: TypeAlias = dict[str, Any]
#: A collection: kind -> level.
Node: TypeAlias = dict[str, Level]


@dataclasses.dataclass(frozen=True)
class IterRef:
    """A scan's per-iteration summaries: iteration i's level (keys sorted)."""

    iterations: tuple[Level, ...]

    @property
    def span(self) -> int:
        return len(self.iterations)


def empty_node() -> Node:
    return {kind: {} for kind in KINDS}


def ref_children(node: Node) -> set[str]:
    """The child names, reserved per-iteration names included (`child_names`)."""
    names: set[str] = set()
    for level in node.values():
        for key, value in level.items():
            if isinstance(value, dict):
                names.add(key)
            elif isinstance(value, IterRef):
                names.add(key)
                names.update(f"{key}{i}" for i in range(value.span))
    return names


def ref_leaves(node: Node, kinds: Iterable[str] = KINDS) -> set[str]:
    return {
        key
        for kind in kinds
        for key, value in node[kind].items()
        if not isinstance(value, (dict, IterRef))
    }


def ref_flatten(level: Level, prefix: str = "") -> dict[str, Any]:
    """`flatten`: insertion order, an iteration's entries in sorted order."""
    out: dict[str, Any] = {}
    for key, value in level.items():
        if isinstance(value, dict):
            out.update(ref_flatten(value, f"{prefix}{key}/"))
        elif isinstance(value, IterRef):
            for i, it in enumerate(value.iterations):
                out.update(ref_flatten(it, f"{prefix}{key}{i}/"))
        else:
            out[prefix + key] = value
    return out


def ref_child(node: Node, name: str) -> Node:
    """`coll.child(name)` of a child name (`ref_children`)."""
    for key, value in node["summaries"].items():
        digits = name[len(key) :]
        if (
            isinstance(value, IterRef)
            and name.startswith(key)
            and digits.isdigit()
            and str(int(digits)) == digits
            and int(digits) < value.span
        ):
            return {**empty_node(), "summaries": value.iterations[int(digits)]}
    return {
        kind: value if isinstance(value := node[kind].get(name), dict) else {}
        for kind in KINDS
    }


def add_clashes(node: Node, kind: str, name: str) -> bool:
    """`add_summary` & co.: "already a summary [of that kind] or a child here"."""
    return name in node[kind] or name in ref_children(node)


def add_child_clashes(node: Node, name: str) -> bool:
    """`add_child`: "already a child or a leaf of any kind"."""
    return name in ref_children(node) or name in ref_leaves(node)


def merge_clashes(a: Node, b: Node) -> bool:
    """`merge`: a child in both, a leaf in the same kind of both, or child vs leaf."""
    ca, cb = ref_children(a), ref_children(b)
    if ca & cb or ca & ref_leaves(b) or cb & ref_leaves(a):
        return True
    return any(ref_leaves(a, [k]) & ref_leaves(b, [k]) for k in KINDS)


def ref_merge(a: Node, b: Node) -> Node:
    return {kind: {**a[kind], **b[kind]} for kind in KINDS}


def structure(level: Level) -> Any:
    return {k: structure(v) if isinstance(v, dict) else None for k, v in level.items()}


def ref_prune(node: Node, drop: Callable[[str], bool]) -> Node:
    """AXLearn's `prune_tree`, per-iteration entries seen materialized.

    An entry stays stacked (and keeps reserving all its names) when its empty
    `{prefix}` child is kept and every iteration keeps the same entries (the
    architecture notes); otherwise the kept iterations become plain children.
    """

    def level(tree: Level, prefix: str) -> Level:
        out: Level = {}
        for key, value in tree.items():
            path = prefix + key
            if isinstance(value, IterRef):
                out.update(entry(key, value, prefix))
            elif isinstance(value, dict):
                sub = level(value, path + "/")
                if not drop(path):
                    out[key] = sub
            elif not drop(path):
                out[key] = value
        return out

    def entry(key: str, value: IterRef, prefix: str) -> Level:
        keep_empty = not drop(prefix + key)
        kept: list[Level | None] = []
        for i, it in enumerate(value.iterations):
            at = f"{prefix}{key}{i}"
            sub = level(it, at + "/")
            kept.append(None if drop(at) else sub)
        first = kept[0] if kept else None
        if (
            keep_empty
            and first is not None
            and all(k is not None and structure(k) == structure(first) for k in kept)
        ):
            return {key: IterRef(tuple(k for k in kept if k is not None))}
        out: Level = {key: {}} if keep_empty else {}
        for i, k in enumerate(kept):
            if k is not None:
                out[f"{key}{i}"] = k
        return out

    out = empty_node()
    for kind in KINDS:
        pruned = level(node[kind], kind + "/")
        if not drop(kind):
            out[kind] = pruned
    return out


def ref_materialize(level: Level) -> Level:
    """`materialize`: each entry becomes an empty `{prefix}` and `{prefix}{i}`."""
    out: Level = {}
    for key, value in level.items():
        if isinstance(value, IterRef):
            out[key] = {}
            for i, it in enumerate(value.iterations):
                out[f"{key}{i}"] = it
        elif isinstance(value, dict):
            out[key] = ref_materialize(value)
        else:
            out[key] = value
    return out


def sort_level(level: Level) -> Level:
    """A level after a PyTree round trip: keys sorted, as a `dict`'s."""
    return {
        k: sort_level(v) if isinstance(v, dict) else level[k]
        for k, v in sorted(level.items())
    }


# -- comparing a version with its reference ----------------------------------------


def same_leaf(got: object, want: object, path: str) -> None:
    assert type(got) is type(want), f"{path}: {type(got)} != {type(want)}"
    if isinstance(want, (np.ndarray, np.generic)):
        assert isinstance(got, (np.ndarray, np.generic))
        assert got.dtype == want.dtype, path
        assert got.shape == want.shape, path
        assert np.array_equal(got, want), f"{path}: {got} != {want}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def check_level(got: object, want: Level, path: str, probes: Iterable[str]) -> None:
    """A level's keys (in order), lookups and entries, recursively."""
    assert isinstance(got, FrozenMapping), f"{path}: {type(got)}"
    assert list(got) == list(want), f"{path}: {list(got)} != {list(want)}"
    assert len(got) == len(want), path
    assert got.sorted_keys() == tuple(sorted(want)), path
    assert [k for k, _ in got.items_list()] == list(want), path
    for key, value in want.items():
        assert key in got, f"{path}/{key}"
        entry = got[key]
        assert got.get(key) is entry
        at = f"{path}/{key}"
        if isinstance(value, dict):
            check_level(entry, value, at, probes)
        elif isinstance(value, IterRef):
            assert isinstance(entry, IterationSummaries), at
            assert entry.length == value.span, at
            for i, it in enumerate(IterationSummaries.iterations(entry)):
                check_level(it, value.iterations[i], f"{at}[{i}]", ())
        else:
            same_leaf(entry, value, at)
    for key in probes:
        if key not in want:
            assert key not in got, f"{path}/{key}"
            assert got.get(key) is None, f"{path}/{key}"
            with pytest.raises(KeyError):
                got[key]


def same_level(got: object, want: Level, path: str) -> None:
    """`check_level` without the lookups: one read of each level (cheap enough to
    run on every version after every step)."""
    assert isinstance(got, FrozenMapping), f"{path}: {type(got)}"
    pairs = got.items_list()
    assert [k for k, _ in pairs] == list(want), f"{path}: {pairs} != {want}"
    for (key, entry), value in zip(pairs, want.values(), strict=True):
        at = f"{path}/{key}"
        if isinstance(value, dict):
            same_level(entry, value, at)
        elif isinstance(value, IterRef):
            assert isinstance(entry, IterationSummaries), at
            assert entry.length == value.span, at
            its = IterationSummaries.iterations(entry)
            for i, (it, value_i) in enumerate(zip(its, value.iterations, strict=True)):
                same_level(it, value_i, f"{at}[{i}]")
        else:
            same_leaf(entry, value, at)


def check_collection(
    coll: OutputCollection, node: Node, probes: Iterable[str], *, children: bool
) -> None:
    """`coll` equals `node`: levels, `flatten`, names, `is_empty`, child views."""
    empty = True
    for kind in KINDS:
        check_level(getattr(coll, kind), node[kind], kind, probes)
        got, want = coll.flatten(kind), ref_flatten(node[kind])
        assert list(got) == list(want), f"{kind}: {list(got)} != {list(want)}"
        for path, value in want.items():
            same_leaf(got[path], value, f"{kind}/{path}")
        empty = empty and not want
    assert coll.child_names() == ref_children(node)
    assert coll.leaf_names() == ref_leaves(node)
    assert coll.is_empty() == empty
    if not children:
        return
    for name in sorted(ref_children(node)):
        view, expected = coll.child(name), ref_child(node, name)
        for kind in KINDS:
            check_level(getattr(view, kind), expected[kind], f"{name}:{kind}", ())
    for name in probes:
        if name not in ref_children(node):
            with pytest.raises(KeyError):
                coll.child(name)


# -- the machines ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Version:
    coll: OutputCollection
    node: Node


NAMES = ("a", "b", "c", "d")
# Names that per-iteration entries reserve: `it` with span 11 reserves `it0` ...
# `it10`; `it1` (span 2) reserves `it10` and `it11`; `it01` is no iteration name.
NUMBERED = ("it", "it0", "it1", "it2", "it10", "it11", "it01", "a")
PREFIXES = st.sampled_from(["it", "it1"])
LENGTHS = st.sampled_from([0, 1, 2, 3, 11])
# A Python float or int, or a small NumPy array of that shape and dtype.
SHAPES = st.sampled_from([float, int, (), (2,), (1, 3)])
DTYPES = st.sampled_from([np.float32, np.int32])
ADD = {
    "summaries": OutputCollection.add_summary,
    "state_updates": OutputCollection.add_state_update,
    "module_outputs": OutputCollection.add_module_output,
}
# The leaf names inside a scan's stacked summaries and outputs.
SCAN_NAMES = ("loss", "enc", "m", "e", "h")


VERSIONS = Bundle("versions")


class CollectionMachine(RuleBasedStateMachine):
    """Versions of collections without per-iteration summaries."""

    versions = VERSIONS
    probes: tuple[str, ...] = NAMES

    def __init__(self) -> None:
        super().__init__()
        self.pool: list[Version] = []
        self.fresh: list[Version] = []
        # Every array passed to the collections, with a copy made before passing it.
        self.inputs: list[tuple[Any, Any]] = []
        self.count = 0

    def keep(self, coll: OutputCollection, node: Node) -> Version:
        version = Version(coll, node)
        self.pool.append(version)
        self.fresh.append(version)
        return version

    def value(self, shape: object, dtype: Any) -> Any:
        """A new leaf, unlike every other (so that a wrong value shows)."""
        self.count += 1
        if shape is float:
            return self.count + 0.5
        if shape is int:
            return self.count
        assert isinstance(shape, tuple)
        array = np.full(shape, self.count, dtype)
        self.inputs.append((array, array.copy()))
        return array

    @initialize(target=versions)
    def start(self) -> Version:
        return self.keep(OutputCollection.empty(), empty_node())

    # Adds, to any version in the pool (old ones branch).

    def add(self, v: Version, kind: str, name: str, value: Any) -> Version | None:
        if add_clashes(v.node, kind, name):
            with pytest.raises(OutputConflictError):
                ADD[kind](v.coll, name, value)
            return None
        out = ADD[kind](v.coll, name, value)
        node = {**v.node, kind: {**v.node[kind], name: copy.deepcopy(value)}}
        return self.keep(out, node)

    def extend_twice_with(
        self, v: Version, kind: str, name: str, shape: object
    ) -> MultipleResults[Version]:
        """One version extended twice with the same name: two independent versions."""
        first = self.add(v, kind, name, self.value(shape, np.float32))
        second = self.add(v, kind, name, self.value(shape, np.int32))
        return multiple(*(x for x in (first, second) if x is not None))

    def add_child_to(
        self, v: Version, name: str, child: Version
    ) -> Version | MultipleResults[Version]:
        if add_child_clashes(v.node, name):
            with pytest.raises(OutputConflictError):
                v.coll.add_child(name, child.coll)
            return multiple()
        out = v.coll.add_child(name, child.coll)
        node = {kind: {**v.node[kind], name: child.node[kind]} for kind in KINDS}
        return self.keep(out, node)

    # The rules that draw names; `IterationMachine` draws other names.

    @rule(
        target=versions,
        v=versions,
        kind=st.sampled_from(KINDS),
        name=st.sampled_from(NAMES),
        shape=SHAPES,
        dtype=DTYPES,
    )
    def add_leaf(
        self, v: Version, kind: str, name: str, shape: object, dtype: Any
    ) -> Version | MultipleResults[Version]:
        out = self.add(v, kind, name, self.value(shape, dtype))
        return multiple() if out is None else out

    @rule(
        target=versions,
        v=versions,
        kind=st.sampled_from(KINDS),
        name=st.sampled_from(NAMES),
        shape=SHAPES,
    )
    def extend_twice(
        self, v: Version, kind: str, name: str, shape: object
    ) -> MultipleResults[Version]:
        return self.extend_twice_with(v, kind, name, shape)

    @rule(target=versions, v=versions, name=st.sampled_from(NAMES), child=versions)
    def add_child(
        self, v: Version, name: str, child: Version
    ) -> Version | MultipleResults[Version]:
        return self.add_child_to(v, name, child)

    # Rules on whole versions.

    @rule(target=versions, a=versions, b=versions)
    def merge(self, a: Version, b: Version) -> Version | MultipleResults[Version]:
        if merge_clashes(a.node, b.node):
            with pytest.raises(OutputConflictError):
                a.coll.merge(b.coll)
            return multiple()
        return self.keep(a.coll.merge(b.coll), ref_merge(a.node, b.node))

    @rule(target=versions, v=versions, data=st.data())
    def prune(self, v: Version, data: st.DataObject) -> Version:
        every: list[str] = []
        ref_prune(v.node, lambda p: every.append(p) or False)
        paths = data.draw(st.sets(st.sampled_from(sorted(set(every)))), label="paths")
        last = data.draw(
            st.sets(st.sampled_from(sorted({*self.probes, *SCAN_NAMES, *KINDS}))),
            label="last",
        )

        def drop(path: str) -> bool:
            return path in paths or path.rsplit("/", 1)[-1] in last

        return self.prune_with(v, drop)

    @rule(target=versions, v=versions, kind=st.sampled_from(KINDS), data=st.data())
    def drop_from_one_kind(self, v: Version, kind: str, data: st.DataObject) -> Version:
        """A child left in two kinds only: still a child name (`merge`, `add_*`)."""
        names = sorted(ref_children(v.node)) or ["a"]
        name = data.draw(st.sampled_from(names), label="name")
        return self.prune_with(v, lambda path: path == f"{kind}/{name}")

    def prune_with(self, v: Version, drop: Callable[[str], bool]) -> Version:
        every: list[str] = []
        ref_prune(v.node, lambda p: every.append(p) or False)
        asked: list[str] = []
        out = v.coll.prune(lambda p: asked.append(p) or drop(p))
        # "Called bottom-up on every mapping entry ... and on the kind roots."
        assert set(asked) == set(every)
        position = {p: i for i, p in enumerate(asked)}
        for p in asked:
            if "/" in p:
                assert position[p] < position[p.rsplit("/", 1)[0]], p
        return self.keep(out, ref_prune(v.node, drop))

    @rule(target=versions, v=versions)
    def tree_map(self, v: Version) -> Version:
        """Unflattened levels (frozen logs, keys sorted) extend like any other."""
        out = jax.tree_util.tree_map(lambda x: x, v.coll)
        return self.keep(out, {kind: sort_level(v.node[kind]) for kind in KINDS})

    @rule(target=versions, v=versions)
    def materialized(self, v: Version) -> Version:
        node = {**v.node, "summaries": ref_materialize(v.node["summaries"])}
        return self.keep(v.coll.materialize(), node)

    @rule(target=versions, v=versions)
    def rebuilt(self, v: Version) -> Version:
        """The constructor, from plain dicts of a version's top levels."""
        given = [dict(getattr(v.coll, kind)) for kind in KINDS]
        before = [list(d.items()) for d in given]
        out = OutputCollection(*given)
        for d, items in zip(given, before, strict=True):  # unchanged
            assert len(d) == len(items)
            assert all(d[k] is x for k, x in items)
        return self.keep(out, v.node)

    @rule(target=versions, v=versions, how=st.sampled_from(["deepcopy", "pickle"]))
    def copied(self, v: Version, how: str) -> Version:
        if how == "deepcopy":
            out = copy.deepcopy(v.coll)
        else:
            out = pickle.loads(pickle.dumps(v.coll))
        return self.keep(out, v.node)

    @invariant()
    def every_version_is_unchanged(self) -> None:
        # The new versions in full (child views too), every version's levels and
        # views: a version must not change when another one is made from it.
        for v in self.fresh:
            check_collection(v.coll, v.node, self.probes, children=True)
        self.fresh.clear()
        for v in self.pool:
            for kind in KINDS:
                same_level(getattr(v.coll, kind), v.node[kind], kind)
        for passed, before in self.inputs:
            assert passed.dtype == before.dtype
            assert np.array_equal(passed, before)


def scan_collection(
    prefix: str, length: int, seed: int, nested: bool
) -> tuple[OutputCollection, Node]:
    """A scan's collection, as `scan_in_context` lays it out, and its reference."""
    loss = np.arange(length, dtype=np.float32) + seed
    m = np.arange(2 * length, dtype=np.int32).reshape(length, 2) * seed
    h = np.full((length, 3), seed, np.float32)
    stacked: dict[str, Any] = {"loss": loss}
    if nested:
        stacked["enc"] = {"m": m, "e": {}}
    before = copy.deepcopy(stacked)
    coll = OutputCollection(
        {prefix: IterationSummaries(length, stacked)}, {prefix: {}}, {prefix: {"h": h}}
    )
    # Nothing the caller passed is changed, nor aliased but the leaves.
    assert structure(stacked) == structure(before)
    assert np.array_equal(stacked["loss"], before["loss"])

    def iteration(i: int) -> Level:
        it: Level = {}
        if nested:
            it["enc"] = {"e": {}, "m": m[i].copy()}
        it["loss"] = loss[i].copy()
        return it

    node: Node = {
        "summaries": {prefix: IterRef(tuple(iteration(i) for i in range(length)))},
        "state_updates": {prefix: {}},
        "module_outputs": {prefix: {"h": h.copy()}},
    }
    return coll, node


class IterationMachine(CollectionMachine):
    """Versions holding scans' per-iteration summaries (names `it0`, ... reserved)."""

    probes = NUMBERED

    @initialize(target=VERSIONS, prefix=PREFIXES, length=LENGTHS, nested=st.booleans())
    def start_with_a_scan(self, prefix: str, length: int, nested: bool) -> Version:
        self.count += 1
        return self.keep(*scan_collection(prefix, length, self.count, nested))

    @rule(
        target=VERSIONS,
        v=VERSIONS,
        prefix=PREFIXES,
        length=LENGTHS,
        nested=st.booleans(),
    )
    def merge_scan(
        self, v: Version, prefix: str, length: int, nested: bool
    ) -> MultipleResults[Version]:
        """`ctx.merge(scan's collection)`, the way a scan's names enter a context."""
        return multiple(*self.merge_scan_into(v, prefix, length, nested))

    def merge_scan_into(
        self, v: Version, prefix: str, length: int, nested: bool
    ) -> list[Version]:
        self.count += 1
        coll, node = scan_collection(prefix, length, self.count, nested)
        scan = self.keep(coll, node)
        if merge_clashes(v.node, node):
            with pytest.raises(OutputConflictError):
                v.coll.merge(coll)
            return [scan]
        return [scan, self.keep(v.coll.merge(coll), ref_merge(v.node, node))]

    @rule(
        target=VERSIONS,
        v=VERSIONS,
        kind=st.sampled_from(KINDS),
        name=st.sampled_from(NUMBERED),
        prefix=PREFIXES,
        length=LENGTHS,
    )
    def add_then_merge_scan(
        self, v: Version, kind: str, name: str, prefix: str, length: int
    ) -> MultipleResults[Version]:
        """A numbered name added to a version, then a scan merged into that version:
        the name, appended to the log the two share, is no clash for the older one."""
        # The newest version of its `kind`'s log (adding to it appends in place).
        tip = self.add(v, kind, f"tip_{self.count}", self.value(float, None))
        assert tip is not None
        added = self.add(tip, kind, name, self.value(float, None))
        merged = self.merge_scan_into(tip, prefix, length, nested=False)
        return multiple(tip, *([] if added is None else [added]), *merged)

    @rule(
        target=VERSIONS,
        v=VERSIONS,
        kind=st.sampled_from(KINDS),
        name=st.sampled_from(NUMBERED),
        shape=SHAPES,
        dtype=DTYPES,
    )
    def add_leaf(
        self, v: Version, kind: str, name: str, shape: object, dtype: Any
    ) -> Version | MultipleResults[Version]:
        out = self.add(v, kind, name, self.value(shape, dtype))
        return multiple() if out is None else out

    @rule(
        target=VERSIONS,
        v=VERSIONS,
        kind=st.sampled_from(KINDS),
        name=st.sampled_from(NUMBERED),
        shape=SHAPES,
    )
    def extend_twice(
        self, v: Version, kind: str, name: str, shape: object
    ) -> MultipleResults[Version]:
        return self.extend_twice_with(v, kind, name, shape)

    @rule(target=VERSIONS, v=VERSIONS, name=st.sampled_from(NUMBERED), child=VERSIONS)
    def add_child(
        self, v: Version, name: str, child: Version
    ) -> Version | MultipleResults[Version]:
        return self.add_child_to(v, name, child)


TestCollectionVersions = CollectionMachine.TestCase
TestIterationVersions = IterationMachine.TestCase
TestIterationVersions.settings = settings(stateful_step_count=25)


# -- FrozenMapping directly ----------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Mapped:
    level: FrozenMapping
    ref: dict[str, Any]


KEYS = ("a", "b", "c", "d", "e")


def check_mapping(got: FrozenMapping, want: dict[str, Any]) -> None:
    assert list(got) == list(want)
    assert len(got) == len(want)
    assert got == want
    assert dict(got.items()) == want
    assert got.items_list() == list(want.items())
    assert got.sorted_keys() == tuple(sorted(want))
    # A PyTree node like `dict`: sorted keys, `DictKey` paths.
    leaves = jax.tree_util.tree_flatten_with_path(got)[0]
    assert [(p[0].key, x) for p, x in leaves] == sorted(want.items())
    for key in KEYS:
        assert (key in got) == (key in want)
        assert got.get(key) == want.get(key)
        if key in want:
            assert got[key] == want[key]
        else:
            with pytest.raises(KeyError):
                got[key]


class MappingMachine(RuleBasedStateMachine):
    """Versions of one `FrozenMapping`, extended with `inserted` and `updated`."""

    levels = Bundle("levels")

    def __init__(self) -> None:
        super().__init__()
        self.pool: list[Mapped] = []
        self.fresh: list[Mapped] = []
        self.count = 0

    def keep(self, level: FrozenMapping, ref: dict[str, Any]) -> Mapped:
        mapped = Mapped(level, ref)
        self.pool.append(mapped)
        self.fresh.append(mapped)
        return mapped

    @initialize(target=levels, keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def start(self, keys: list[str]) -> Mapped:
        items = [(k, float(i)) for i, k in enumerate(keys)]
        if len(set(keys)) < len(keys):
            with pytest.raises(ValueError, match="given twice"):
                FrozenMapping(items)
            return self.keep(FrozenMapping(), {})
        return self.keep(FrozenMapping(items), dict(items))

    @rule(target=levels, m=levels, key=st.sampled_from(KEYS))
    def inserted(self, m: Mapped, key: str) -> Mapped | MultipleResults[Mapped]:
        self.count += 1
        if key in m.ref:
            with pytest.raises(ValueError, match="already a key"):
                m.level.inserted(key, self.count)
            return multiple()
        return self.keep(m.level.inserted(key, self.count), {**m.ref, key: self.count})

    @rule(target=levels, m=levels, keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def updated(self, m: Mapped, keys: list[str]) -> Mapped | MultipleResults[Mapped]:
        pairs = [(k, self.count + i) for i, k in enumerate(keys)]
        self.count += len(keys)
        given = list(pairs)
        if len(set(keys)) < len(keys) or set(keys) & m.ref.keys():
            with pytest.raises(ValueError, match="already a key"):
                m.level.updated(pairs)
            return multiple()
        out = m.level.updated(pairs)
        assert pairs == given
        return self.keep(out, {**m.ref, **dict(pairs)})

    @rule(target=levels, m=levels)
    def tree_map(self, m: Mapped) -> Mapped:
        out = jax.tree_util.tree_map(lambda x: x, m.level)
        return self.keep(out, dict(sorted(m.ref.items())))

    @rule(target=levels, m=levels, how=st.sampled_from(["deepcopy", "pickle"]))
    def copied(self, m: Mapped, how: str) -> Mapped:
        if how == "deepcopy":
            return self.keep(copy.deepcopy(m.level), m.ref)
        return self.keep(pickle.loads(pickle.dumps(m.level)), m.ref)

    @invariant()
    def every_version_is_unchanged(self) -> None:
        for m in self.fresh:
            check_mapping(m.level, m.ref)
        self.fresh.clear()
        for m in self.pool:
            assert m.level.items_list() == list(m.ref.items())
            assert len(m.level) == len(m.ref)


TestMappingVersions = MappingMachine.TestCase


def test_reference_model_predicts_the_documented_conflicts() -> None:
    """The reference itself, on the docstrings' examples (so it can fail too)."""
    coll, node = scan_collection("iter", 3, 1, nested=False)
    assert ref_children(node) == {"iter", "iter0", "iter1", "iter2"}
    assert add_clashes(node, "summaries", "iter0")
    assert not add_clashes(node, "summaries", "iter3")
    leaf = {**empty_node(), "state_updates": {"x": 1.0}}
    assert not add_clashes(leaf, "summaries", "x")  # other kind: allowed
    assert add_child_clashes(leaf, "x")  # a leaf of any kind
    assert merge_clashes(leaf, {**empty_node(), "summaries": {"x": {}}})
    assert not merge_clashes(leaf, {**empty_node(), "summaries": {"x": 2.0}})
    check_collection(coll, node, NUMBERED, children=True)


@pytest.mark.parametrize("drop_loss", [False, True])
def test_prune_keeps_an_entry_without_summaries_stacked(drop_loss: bool) -> None:
    """`prune`: per-iteration summaries "stay stacked where every iteration keeps
    the same entries (a `drop` that does not depend on the iteration index)"; here
    every iteration keeps none (a scan whose body adds no summaries gives such an
    entry, `IterationSummaries(N, {})`, and so does a drop of all of them)."""
    stacked = {"loss": np.arange(4.0)} if drop_loss else {}
    coll = OutputCollection({"it": IterationSummaries(4, stacked)}, {"it": {}}, {})
    pruned = coll.prune(lambda path: drop_loss and path.endswith("/loss"))
    assert pruned.child_names() == {"it", "it0", "it1", "it2", "it3"}
    assert pruned.flatten("summaries") == {}
    # Was sliced into N + 1 empty mappings, `it` and `it0`..`it3` (found by this
    # file's machines): an empty kept level was taken for "nothing kept".
    assert list(pruned.summaries) == ["it"]
    assert isinstance(pruned.summaries["it"], IterationSummaries)


def test_scan_collection_has_the_layout_of_scan_in_context() -> None:
    """The machines' scans (`scan_collection`) are laid out as real ones."""

    def body(c: None, x: jax.Array, ctx: Context) -> tuple[None, None, Context]:
        ctx = ctx.add_summary("loss", x).add_module_output("h", jnp.stack([x] * 3))
        return c, None, ctx

    xs = jnp.arange(2.0, dtype=jnp.float32)
    _, _, real = scan_in_context(body, context=Context.root(), carry=None, xs=xs)
    ours, node = scan_collection("iter", 2, 0, nested=False)
    for kind in KINDS:
        got, want = getattr(real, kind), getattr(ours, kind)
        assert list(got) == list(want) == ["iter"]
        assert type(got["iter"]) is type(want["iter"])
    assert real.child_names() == ours.child_names() == ref_children(node)
    assert real.flatten("summaries").keys() == ours.flatten("summaries").keys()
    assert (
        real.flatten("module_outputs").keys() == ours.flatten("module_outputs").keys()
    )

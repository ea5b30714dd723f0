"""OutputCollection: the summaries, state updates and module outputs of a call tree.

Follows AXLearn's `OutputCollection` (`axlearn/common/module.py`), as an immutable
PyTree: every method returns a new collection. Each level of each kind is a
`FrozenMapping`, so adding an output, a child or a merged collection costs O(1)
amortized, whatever the collection already holds; no check enumerates the names a
scan's per-iteration summaries reserve.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, NoReturn

import jax
import numpy as np

from ._errors import PREFIX_HINT, OutputConflictError
from ._expand import flatten_into, has_leaf, materialize_tree, prune_kinds
from ._frozen import TreeEquality
from ._iterations import IterationSummaries, freeze, iteration_view
from ._leaves import (
    ADDERS,
    ARRAY,
    KINDS,
    SUMMARY,
    Kind,
    all_plain_arrays,
    check_leaf,
    check_summary_name,
    validate_child_name,
    validate_leaf_name,
)
from ._mapping import (
    EMPTY,
    FrozenMapping,
    Levels,
    insert,
    insert_all,
    inserted_child,
    key_in_any,
    leaf_clashes,
)
from ._typing import Children, Leaf, PathPredicate, SummaryTree, Tree, TreeDef


__all__ = [
    "ADDERS",
    "KINDS",
    "Kind",
    "OutputCollection",
    "add_leaf",
    "validate_child_name",
]

_MISSING: Any = object()


# Both are final: a type lookup is a faster check than `isinstance` of an ABC.
_CHILD_TYPES = frozenset({FrozenMapping, IterationSummaries})


def _is_child(value: object) -> bool:
    return type(value) in _CHILD_TYPES


class OutputCollection(TreeEquality):
    """Summaries, state updates and module outputs, as three nested mappings.

    A child (from `add_child`, `Context.call` or a scan) is a nested mapping present
    in all three kinds; leaves are arrays, Python numbers or `Summary` objects. Every
    method returns a new collection and leaves `self` and its arguments unchanged; the
    mappings are read-only (`coll.summaries["x"] = 1` raises `TypeError`).

    A PyTree whose children are the three mappings (`.summaries`, `.state_updates`,
    `.module_outputs`), each a PyTree node like `dict` (sorted keys), so it passes
    through `jax.jit`, `jax.lax.scan`, `jax.vmap` and `eqx.filter_*`.

    Scans and vmaps keep per-iteration summaries stacked in an `IterationSummaries`
    entry; `flatten`, `child` and `materialize` expand it into `{prefix}{i}` children.

    Args:
        summaries: nested mapping of summaries (metrics for TensorBoard).
        state_updates: nested mapping of state updates (e.g. batch-norm statistics).
        module_outputs: nested mapping of module outputs (intermediate activations).

    Raises:
        TypeError: if a level is not a mapping, a key not a `str`, or a leaf not a
            valid leaf (the message names the path).
        OutputConflictError: if an entry is also a per-iteration child of a scan's
            entry at the same level.

    Attributes:
        summaries: read-only nested mapping of summaries.
        state_updates: read-only nested mapping of state updates.
        module_outputs: read-only nested mapping of module outputs.
    """

    __slots__ = ("module_outputs", "state_updates", "summaries")
    summaries: FrozenMapping
    state_updates: FrozenMapping
    module_outputs: FrozenMapping

    def __init__(
        self,
        summaries: Tree,
        state_updates: Tree,
        module_outputs: Tree,
    ):
        _init(
            self,
            freeze(summaries, "summaries"),
            freeze(state_updates, "state_updates"),
            freeze(module_outputs, "module_outputs"),
        )

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field '{name}'")

    def __repr__(self) -> str:
        return (
            f"OutputCollection(summaries={dict(self.summaries.items_list())!r}, "
            f"state_updates={dict(self.state_updates.items_list())!r}, "
            f"module_outputs={dict(self.module_outputs.items_list())!r})"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (
            OutputCollection,
            (self.summaries, self.state_updates, self.module_outputs),
        )

    def __copy__(self) -> "OutputCollection":
        return self

    @classmethod
    def empty(cls) -> "OutputCollection":
        """Return a collection with no entries."""
        return _EMPTY

    # -- names -------------------------------------------------------------------

    def child_names(self) -> set[str]:
        """Return the child names at this level, including per-iteration ones."""
        names: set[str] = set()
        for tree in _trees(self):
            names.update(k for k, v in tree.items_list() if _is_child(v))
            for key, span in tree.spans():
                names.update(f"{key}{i}" for i in range(span))
        return names

    def leaf_names(self) -> set[str]:
        """Return the leaf names at this level, of all three kinds."""
        return {k for t in _trees(self) for k, v in t.items_list() if not _is_child(v)}

    # -- adding ------------------------------------------------------------------

    def add_summary(self, name: str, value: Leaf) -> "OutputCollection":
        """Return a new collection with summary `name` added; `self` is unchanged.

        Args:
            name: a non-empty string without '/'.
            value: an array (any shape, dtype), a Python number or a `Summary`.

        Raises:
            ValueError: for an invalid name or an invalid `Summary` (its `validate`).
            TypeError: if `value` is not a valid leaf.
            OutputConflictError: if `name` is already a summary or a child here.
        """
        return add_leaf(self, "summaries", name, value)

    def add_state_update(self, name: str, value: Leaf) -> "OutputCollection":
        """Return a new collection with state update `name` added (as `add_summary`)."""
        return add_leaf(self, "state_updates", name, value)

    def add_module_output(self, name: str, value: Leaf) -> "OutputCollection":
        """Return a new collection with module output `name` added (see add_summary)."""
        return add_leaf(self, "module_outputs", name, value)

    def add_child(self, name: str, child: "OutputCollection") -> "OutputCollection":
        """Return a new collection with `child` nested under `name` in all three kinds.

        The child is recorded even when it is empty, so adding it twice always raises.

        Raises:
            ValueError: if `name` does not match `^[a-z][a-z0-9_]*$`.
            TypeError: if `child` is not an `OutputCollection`.
            OutputConflictError: if `name` is already a child or a leaf of any kind.
        """
        validate_child_name(name, where="add_child")
        check_is_collection(child, f"add_child({name!r}, child)", "child")
        _check_levels(child, name)
        if name_in_use(self, name):
            raise OutputConflictError(
                f"`add_child`: {name!r} is already present in this collection "
                f"(path {name}). Give the child another name; to add the outputs "
                "of several calls, use `scan_in_context`/`vmap_in_context`."
            )
        return with_child(self, name, child)

    def merge(self, other: "OutputCollection") -> "OutputCollection":
        """Return the union of `self` and `other` (one level deep); both unchanged.

        Costs O(size of `other`'s top level), whatever `self` holds.

        Raises:
            OutputConflictError: if a child name is in both, a leaf name is in the same
                kind of both, or a child name of one equals a leaf name of the other
                (a scan's per-iteration children count as children). The message
                names the path.
            TypeError: if `other` is not an `OutputCollection`.
        """
        check_is_collection(other, "OutputCollection.merge(other)", "other")
        _check_levels(other, "")
        _check_merge(self, other)
        return _make(
            *(
                insert_all(mine, theirs.items_list())
                for mine, theirs in zip(_trees(self), _trees(other), strict=True)
            )
        )

    # -- reading -----------------------------------------------------------------

    def child(self, name: str) -> "OutputCollection":
        """Return the collection of child `name`, including per-iteration children.

        `coll.child("iter3")` returns iteration 3's view of a scan's summaries (NumPy
        values for a concrete collection).

        Raises:
            KeyError: if there is no such child; the message lists the children.
            ValueError: if a per-iteration child's stacked arrays no longer have
                the scan's iterations (they were sliced or indexed), naming the path.
        """
        owner = self.summaries.reserver(name)
        if owner is not None:
            entry = self.summaries[owner]
            if isinstance(entry, IterationSummaries):
                i = int(name[len(owner) :])
                return _make(iteration_view(entry, i, owner), EMPTY, EMPTY)
        trees = _trees(self)
        if not any(_is_child(t.get(name)) for t in trees):
            raise KeyError(
                f"`child`: no child {name!r}; children: {sorted(self.child_names())}"
            )
        return _make(
            *(
                v if isinstance(v := t.get(name), FrozenMapping) else EMPTY
                for t in trees
            )
        )

    def materialize(self) -> "OutputCollection":
        """Return a collection with every `IterationSummaries` expanded into children.

        The result has AXLearn's layout (`summaries["iter3"]["loss"]`). On a concrete
        collection each stacked array is fetched once and sliced in NumPy; inside
        `jax.jit` this slices every summary of every iteration, so prefer `flatten`
        and `child` there.

        Raises:
            ValueError: if a scan's stacked arrays no longer have its iterations
                on their iteration axis (sliced or indexed), naming the path.
        """
        return _make(
            materialize_tree(self.summaries), self.state_updates, self.module_outputs
        )

    def flatten(self, kind: Kind, sep: str = "/") -> dict[str, Leaf]:
        """Return `{path: leaf}` for one kind, with `sep`-joined paths.

        Per-iteration summaries appear as `iter{i}/name` paths with their own values
        (NumPy values for a concrete collection: each stacked array is fetched to the
        host once). Empty mappings do not appear. `Summary` leaves are returned as they
        are.

        Raises:
            ValueError: if `kind` is not one of the three kinds, if `sep` is not a
                non-empty `str`, or if two entries would get the same path (a name
                contains `sep`; names never contain the default `'/'`), or if a
                scan's stacked arrays no longer have its iterations on their
                iteration axis (sliced or indexed), naming the path.
        """
        if kind not in KINDS:
            raise ValueError(f"`flatten`: kind must be one of {KINDS}, got {kind!r}.")
        if type(sep) is not str or not sep:
            raise ValueError(f"`flatten`: sep must be a non-empty str, got {sep!r}.")
        out: dict[str, Leaf] = {}
        if sep == "/":  # no name contains '/': no two paths are spelled alike
            flatten_into(out.__setitem__, getattr(self, kind), "", sep)
            return out

        def put(path: str, leaf: Leaf) -> None:
            if path in out:
                raise ValueError(
                    f"`flatten`: two entries of {kind!r} are both spelled {path!r} "
                    f"with sep={sep!r} (a name contains {sep!r}). Use a separator "
                    "that no name contains, such as the default '/'."
                )
            out[path] = leaf

        flatten_into(put, getattr(self, kind), "", sep)
        return out

    def prune(self, drop: PathPredicate) -> "OutputCollection":
        """Return a collection without the entries for which `drop(path)` is True.

        Follows AXLearn's `prune_tree` over `{"summaries": ..., "state_updates": ...,
        "module_outputs": ...}`: `drop` is called bottom-up on every mapping entry with
        "/"-joined paths such as `"summaries/iter/loss"`, and on the kind roots
        (`"summaries"`), whose dropping empties that kind. Per-iteration summaries are
        seen as materialized, with paths like `"summaries/iter3/loss"` (the calls are
        those of `materialize().prune(drop)`), but stay stacked where every iteration
        keeps the same entries (a `drop` that does not depend on the iteration index),
        also for nested scans, so pruning inside a scan body slices nothing.

        Raises:
            ValueError: if a scan's stacked arrays no longer have its iterations
                on their iteration axis (sliced or indexed), naming the path.
        """
        kinds = prune_kinds(dict(zip(KINDS, _trees(self), strict=True)), drop)
        return _make(*(kinds.get(kind, EMPTY) for kind in KINDS))

    def merge_iterations(self) -> "OutputCollection":
        """Return a collection with every per-iteration summaries entry accumulated.

        Each scan's or vmap's per-iteration summaries (`{prefix}0` … `{prefix}{N-1}`)
        become the merged child `{prefix}` that `merge_summaries=True` would have
        given: accumulated in the scan's execution order (index order; from the
        last index to the first for `reverse=True`) with `Summary.accumulate` (`+`
        for raw arrays), on the device, in one compiled program; nested scans are merged
        from the inside out. So one scan gives both the per-layer view (`self`) and
        the whole-stack view (the result). `self` is unchanged.

        Raises:
            ValueError: if a scan's stacked arrays no longer have its iterations
                on their iteration axis (sliced or indexed), naming the path.
        """
        # `_repeat` sits above the collection (it builds collections).
        from ._repeat import merge_iteration_summaries

        summaries = merge_iteration_summaries(self.summaries)
        if summaries is self.summaries:
            return self
        return _make(
            freeze(summaries, "summaries"), self.state_updates, self.module_outputs
        )

    def is_empty(self) -> bool:
        """Return whether no kind has any leaf (empty children do not count)."""
        return not any(has_leaf(t) for t in _trees(self))


# The slots' own setters: faster than `object.__setattr__`, and the class's
# `__setattr__` (which refuses every assignment) is not involved.
_set_summaries = OutputCollection.__dict__["summaries"].__set__
_set_state_updates = OutputCollection.__dict__["state_updates"].__set__
_set_module_outputs = OutputCollection.__dict__["module_outputs"].__set__


def _init(
    self: OutputCollection,
    summaries: FrozenMapping,
    state_updates: FrozenMapping,
    module_outputs: FrozenMapping,
) -> None:
    _set_summaries(self, summaries)
    _set_state_updates(self, state_updates)
    _set_module_outputs(self, module_outputs)


def _make(
    summaries: FrozenMapping,
    state_updates: FrozenMapping,
    module_outputs: FrozenMapping,
) -> OutputCollection:
    """Build a collection from checked mappings (no walk, no checks)."""
    out = _new(OutputCollection)
    _set_summaries(out, summaries)
    _set_state_updates(out, state_updates)
    _set_module_outputs(out, module_outputs)
    return out


_new = object.__new__


def check_is_collection(value: object, where: str, name: str) -> None:
    """Raise `TypeError` unless `value` is an `OutputCollection` (untyped callers)."""
    if not isinstance(value, OutputCollection):
        raise TypeError(
            f"`{where}`: {name} must be an `OutputCollection`, got "
            f"{type(value).__name__}; build one with "
            "`OutputCollection.empty().add_summary(...)`, or pass `ctx.collection` "
            "or the collection a combinator returned."
        )


def _check_levels(coll: OutputCollection, path: str) -> None:
    """Check the leaves of a collection made by unflattening, once (else O(1))."""
    for kind, tree in zip(KINDS, _trees(coll), strict=True):
        if not tree.checked:
            freeze(tree, f"{kind}/{path}" if path else kind)


def check_collection(coll: OutputCollection) -> OutputCollection:
    """Return `coll` after checking its leaves if they were not (see `freeze`)."""
    _check_levels(coll, "")
    return coll


def _trees(
    coll: OutputCollection,
) -> tuple[FrozenMapping, FrozenMapping, FrozenMapping]:
    return coll.summaries, coll.state_updates, coll.module_outputs


_EMPTY = _make(EMPTY, EMPTY, EMPTY)

_KEYS = tuple(jax.tree_util.GetAttrKey(kind) for kind in KINDS)


# The levels are PyTree nodes themselves (not converted to dicts), so that
# `eqx.tree_at` can replace a level: it finds nodes by identity.


def _flatten_with_keys(coll: OutputCollection) -> tuple[list[Any], None]:
    s, su, mo = _KEYS
    return [
        (s, coll.summaries),
        (su, coll.state_updates),
        (mo, coll.module_outputs),
    ], None


def _flatten(coll: OutputCollection) -> tuple[Levels, None]:
    return (coll.summaries, coll.state_updates, coll.module_outputs), None


def _unflatten(_: None, children: Children) -> OutputCollection:
    # After every jitted call, for every collection returned: no helper calls.
    out = object.__new__(OutputCollection)
    summaries, state_updates, module_outputs = children
    _set_summaries(out, summaries)
    _set_state_updates(out, state_updates)
    _set_module_outputs(out, module_outputs)
    return out


jax.tree_util.register_pytree_with_keys(
    OutputCollection, _flatten_with_keys, _unflatten, _flatten
)


# -- checks (each O(1) in what the collection holds) ---------------------------------


def name_in_use(coll: OutputCollection, name: str) -> bool:
    """Return whether `name` is a leaf, a child or a reserved child name here."""
    return key_in_any(name, (coll.summaries, coll.state_updates, coll.module_outputs))


def with_child(
    coll: OutputCollection, name: str, child: OutputCollection
) -> OutputCollection:
    """Return `coll` with `child` under `name` (the caller checked `name`)."""
    s, su, mo = inserted_child(
        (coll.summaries, coll.state_updates, coll.module_outputs),
        name,
        (child.summaries, child.state_updates, child.module_outputs),
    )
    out = _new(OutputCollection)
    _set_summaries(out, s)
    _set_state_updates(out, su)
    _set_module_outputs(out, mo)
    return out


def add_leaf(
    coll: OutputCollection, kind: Kind, name: str, value: Leaf
) -> OutputCollection:
    """Return `coll` with leaf `name` added to `kind` (see `add_summary`).

    Checks the name, the leaf (once, here) and conflicts in O(1).
    """
    if type(name) is not str or not name or "/" in name:
        validate_leaf_name(name, where=ADDERS[kind])
    leaf = check_leaf(value, f"{kind}/{name}")
    if leaf == SUMMARY:
        try:
            type(value).validate(value)  # not `value.validate`: see accumulate_leaf
        except ValueError as e:
            msg = f"`{ADDERS[kind]}`: the summary at {kind}/{name}: {e}"
            raise ValueError(msg) from e
    elif leaf == ARRAY and isinstance(value, np.ndarray):
        value = value.copy()  # the caller's: refilling it must not change `coll`
    s, su, mo = coll.summaries, coll.state_updates, coll.module_outputs
    target = s if kind == "summaries" else su if kind == "state_updates" else mo
    if leaf_clashes(name, target, (s, su, mo), _CHILD_TYPES):
        _raise_leaf_clash(kind, name, target)
    new = insert(target, name, value)
    out = _new(OutputCollection)
    if kind == "summaries":
        _set_summaries(out, new)
        _set_state_updates(out, su)
    elif kind == "state_updates":
        _set_summaries(out, s)
        _set_state_updates(out, new)
    else:
        _set_summaries(out, s)
        _set_state_updates(out, su)
        _set_module_outputs(out, new)
        return out
    _set_module_outputs(out, mo)
    return out


def _raise_leaf_clash(kind: Kind, name: str, target: FrozenMapping) -> NoReturn:
    """Raise the `OutputConflictError` of a leaf `name` that `leaf_clashes`."""
    existing = target.get(name, _MISSING)
    if existing is not _MISSING and type(existing) not in _CHILD_TYPES:
        raise OutputConflictError(
            f"`{ADDERS[kind]}`: {kind} already has an entry {name!r} (path "
            f"{kind}/{name}). Each name can be added once per context; use another "
            "name or a child context (`ctx.call`)."
        )
    raise OutputConflictError(
        f"`{ADDERS[kind]}`: {name!r} is already a child at this level (path "
        f"{kind}/{name}); leaf names and child names must differ."
    )


def _check_merge(mine: OutputCollection, other: OutputCollection) -> None:
    """Raise `OutputConflictError` for the first (sorted) name `merge` cannot take."""
    my_trees, their_trees = _trees(mine), _trees(other)

    def kind_of(trees: Levels, name: str) -> str | None:
        """'child' or 'leaf' for a name present at this level, else None."""
        found = None
        for tree in trees:
            value = tree.get(name, _MISSING)
            if value is not _MISSING:
                if _is_child(value):
                    return "child"
                found = "leaf"
        if found is None and any(t.reserver(name) is not None for t in trees):
            return "child"
        return found

    their_children: set[str] = set()
    their_leaves: list[tuple[str, str]] = []
    for kind, tree in zip(KINDS, their_trees, strict=True):
        for key, value in tree.items_list():
            if _is_child(value):
                their_children.add(key)
            else:
                their_leaves.append((kind, key))
    # Names `mine` has that `other`'s per-iteration entries reserve.
    reserved_clash: dict[str, str] = {}
    for tree in their_trees:
        for key, span in tree.spans():
            for my_tree in my_trees:
                for pos_name in my_tree.numbered_in(key, span):
                    reserved_clash[pos_name] = kind_of(my_trees, pos_name) or "leaf"

    both = {n for n in their_children if kind_of(my_trees, n) == "child"}
    both |= {n for n, k in reserved_clash.items() if k == "child"}
    if both:
        name = min(both)
        raise OutputConflictError(
            f"`merge`: both collections have a child {name!r} (path {name}). "
            + PREFIX_HINT
        )
    for kind, key in sorted(their_leaves):
        tree = my_trees[KINDS.index(kind)]
        value = tree.get(key, _MISSING)
        if value is not _MISSING and not _is_child(value):
            raise OutputConflictError(
                f"`merge`: both collections have {kind} entry {key!r} "
                f"(path {kind}/{key})."
            )
    mixed = {n for n in their_children if kind_of(my_trees, n) == "leaf"}
    mixed |= {n for n, k in reserved_clash.items() if k == "leaf"}
    mixed |= {n for _, n in their_leaves if kind_of(my_trees, n) == "child"}
    if mixed:
        name = min(mixed)
        raise OutputConflictError(
            f"`merge`: {name!r} is a child in one collection and a leaf in the "
            f"other (path {name}). " + PREFIX_HINT
        )


def summary_tree(summaries: object, *, where: str) -> FrozenMapping:
    """Return the summaries to write or accumulate, as one checked mapping.

    Accepts an `OutputCollection` (its summaries) or a nested mapping of summaries
    and `OutputCollection`s (each contributes its summaries under its key, so
    `{"train": coll, "eval": coll2}` gives `train/...` and `eval/...`).

    Raises:
        TypeError: for anything else, or a leaf that is not a summary leaf (naming
            its path).
        ValueError: if a name is empty, not a string or contains "/" (naming where).
        OutputConflictError: if an entry is also a reserved per-iteration child.
    """
    return summary_tree_flat(summaries, where=where)[0]


def summary_tree_flat(
    summaries: object, *, where: str
) -> tuple[FrozenMapping, list[Leaf], TreeDef]:
    """`summary_tree`, with the tree's leaves and structure (flattened once)."""
    # Whether `tree.checked` can be trusted: a collection's levels, or a mapping
    # just frozen here. A `FrozenMapping` passed as it is is checked by its leaves
    # (its `inserted` and `updated` add values unchecked: their callers check them)
    # and, if it holds plain mappings (made by unflattening, as
    # `jax.tree_util.tree_map` does), rebuilt.
    trusted = True
    if isinstance(summaries, OutputCollection):
        tree = summaries.summaries
    elif isinstance(summaries, FrozenMapping) and not any(
        isinstance(value, OutputCollection) for _, value in summaries.items_list()
    ):
        tree, trusted = summaries, False
    elif isinstance(summaries, Mapping):
        tree = freeze(_summaries_of(summaries), "", where)
    else:
        raise TypeError(
            f"`{where}`: summaries must be an `OutputCollection` or a nested mapping "
            f"of summaries, got {type(summaries).__name__}."
        )
    # The names depend only on the structure: checked once per treedef (writers and
    # accumulators see the same structure every step).
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    known, hashable = _known_structure(treedef)
    if not (trusted and tree.checked):
        # A known structure passed every check but the leaves'; arrays of numeric
        # dtypes are valid leaves wherever they are. Else each leaf is checked by
        # its path.
        if known and all_plain_arrays(leaves):
            tree.mark_checked()
        elif trusted:  # a collection's summaries: its own paths
            freeze(tree, "summaries")
        else:
            # Rebuilt: its plain mappings frozen, its collections' summaries taken
            # (another structure, flattened again).
            tree = freeze(_summaries_of(tree), "", where)
            leaves, treedef = jax.tree_util.tree_flatten(tree)
            known, hashable = _known_structure(treedef)
    if not known:
        check_summary_names(tree, "", where=where)
        if hashable and len(_NAMES_CHECKED) < 1024:
            _NAMES_CHECKED.add(treedef)
    return tree, leaves, treedef


_NAMES_CHECKED: set[TreeDef] = set()


def _known_structure(treedef: TreeDef) -> tuple[bool, bool]:
    """Whether `treedef` passed every check before, and whether it is hashable."""
    try:
        return treedef in _NAMES_CHECKED, True
    except TypeError:  # a node with unhashable aux data: check every time
        return False, False


def _summaries_of(tree: Tree) -> Tree:
    return {
        key: value.summaries
        if isinstance(value, OutputCollection)
        else _summaries_of(value)
        if isinstance(value, Mapping) and not isinstance(value, FrozenMapping)
        else value
        for key, value in tree.items()
    }


def check_summary_names(tree: SummaryTree, prefix: str, *, where: str) -> None:
    """Check every name once (a per-iteration entry's names once, not per iteration)."""
    for key, value in tree.items():
        path = prefix + check_summary_name(key, prefix, where=where)
        if isinstance(value, IterationSummaries):
            check_summary_names(value.stacked, f"{path}{{i}}/", where=where)
        elif isinstance(value, Mapping):
            check_summary_names(value, f"{path}/", where=where)

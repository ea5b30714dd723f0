"""OutputCollection: the summaries, state updates and module outputs of a call tree.

Follows AXLearn's `OutputCollection` (`axlearn/common/module.py`), as an immutable
PyTree whose levels are persistent `FrozenMapping`s: adding an output, a child or a
merged collection costs O(1) amortized, whatever the collection holds.
"""

import dataclasses
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
    check_leaf,
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
from ._typing import Children, Leaf, PathPredicate, Tree


_MISSING: Any = object()


# Both are final: a type lookup is a faster check than `isinstance` of an ABC.
_CHILD_TYPES = frozenset({FrozenMapping, IterationSummaries})


def _is_child(value: object) -> bool:
    return type(value) in _CHILD_TYPES


class OutputCollection(TreeEquality):
    """Summaries, state updates and module outputs, as three nested mappings.

    A child (from `add_child`, `Context.call` or a scan) is a nested mapping present
    in all three kinds; leaves are arrays, Python numbers or `Summary` objects. Every
    method returns a new collection and leaves `self` and its arguments unchanged;
    the mappings are read-only. A PyTree of the three mappings, each flattened like
    a `dict` (sorted keys). Scans and vmaps keep per-iteration summaries stacked in
    an `IterationSummaries` entry; `flatten`, `child` and `materialize` expand it
    into `{prefix}{i}` children.

    Raises:
        TypeError: if a level is not a mapping, a key not a `str`, or a leaf not a
            valid leaf (the message names the path).
        OutputConflictError: if an entry is also a per-iteration child of a scan's
            entry at the same level.

    Attributes:
        summaries: nested mapping of summaries (metrics for TensorBoard).
        state_updates: nested mapping of state updates (e.g. batch-norm statistics).
        module_outputs: nested mapping of module outputs (intermediate activations).
    """

    __slots__ = ("module_outputs", "state_updates", "summaries")
    summaries: FrozenMapping
    state_updates: FrozenMapping
    module_outputs: FrozenMapping

    def __init__(self, summaries: Tree, state_updates: Tree, module_outputs: Tree):
        _set_summaries(self, freeze(summaries, "summaries"))
        _set_state_updates(self, freeze(state_updates, "state_updates"))
        _set_module_outputs(self, freeze(module_outputs, "module_outputs"))

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field '{name}'")

    def __repr__(self) -> str:
        return (
            f"OutputCollection(summaries={dict(self.summaries.items_list())!r}, "
            f"state_updates={dict(self.state_updates.items_list())!r}, "
            f"module_outputs={dict(self.module_outputs.items_list())!r})"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return OutputCollection, _trees(self)

    def __copy__(self) -> "OutputCollection":
        return self

    @classmethod
    def empty(cls) -> "OutputCollection":
        """Return a collection with no entries."""
        return _EMPTY

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
        check_collection(child, name)
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
            OutputConflictError: if a child name is in both, a leaf name in the same
                kind of both, or a child name of one is a leaf name of the other
                (a scan's per-iteration children count), naming the path.
            TypeError: if `other` is not an `OutputCollection`.
        """
        check_is_collection(other, "OutputCollection.merge(other)", "other")
        check_collection(other)
        _check_merge(self, other)
        return _make(
            *(
                insert_all(mine, theirs.items_list())
                for mine, theirs in zip(_trees(self), _trees(other), strict=True)
            )
        )

    def child(self, name: str) -> "OutputCollection":
        """Return the collection of child `name`, including per-iteration children.

        `coll.child("iter3")` is iteration 3's view of a scan's summaries (NumPy
        values for a concrete collection).

        Raises:
            KeyError: if there is no such child; the message lists the children.
            ValueError: if a scan's stacked arrays lost their iteration axis
                (sliced or indexed), naming the path.
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

        The result has AXLearn's layout (`summaries["iter3"]["loss"]`). A concrete
        collection's stacked arrays are fetched once and sliced in NumPy; under a
        trace this slices every iteration, so prefer `flatten` and `child` there.

        Raises:
            ValueError: if a scan's stacked arrays lost their iteration axis
                (sliced or indexed), naming the path.
        """
        return _make(
            materialize_tree(self.summaries), self.state_updates, self.module_outputs
        )

    def flatten(self, kind: Kind, sep: str = "/") -> dict[str, Leaf]:
        """Return `{path: leaf}` for one kind, with `sep`-joined paths.

        Per-iteration summaries appear as `iter{i}/name` paths with their own values
        (NumPy for a concrete collection, each stacked array fetched once). Empty
        mappings do not appear; `Summary` leaves are returned as they are.

        Raises:
            ValueError: if `kind` is not one of the three kinds, `sep` not a
                non-empty `str`, two entries get the same path (a name contains
                `sep`; no name contains `'/'`), or a scan's stacked arrays lost
                their iteration axis, naming the path.
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

        AXLearn's `prune_tree` over `{"summaries": ..., "state_updates": ...,
        "module_outputs": ...}`: `drop` is called bottom-up on every entry with
        "/"-joined paths (`"summaries/iter/loss"`) and on the kind roots
        (`"summaries"`). Per-iteration summaries are seen as materialized
        (`"summaries/iter3/loss"`, as `materialize().prune(drop)`), but stay stacked
        where every iteration keeps the same entries.

        Raises:
            ValueError: if a scan's stacked arrays lost their iteration axis
                (sliced or indexed), naming the path.
        """
        kinds = prune_kinds(dict(zip(KINDS, _trees(self), strict=True)), drop)
        return _make(*(kinds.get(kind, EMPTY) for kind in KINDS))

    def merge_iterations(self) -> "OutputCollection":
        """Return a collection with every per-iteration summaries entry accumulated.

        Each scan's or vmap's per-iteration summaries (`{prefix}0` … `{prefix}{N-1}`)
        become the child `{prefix}` that `merge_summaries=True` would have given
        (accumulated in execution order with `Summary.accumulate`, `+` for raw
        arrays; nested scans from the inside out). `self` is unchanged.

        Raises:
            ValueError: if a scan's stacked arrays lost their iteration axis
                (sliced or indexed), naming the path.
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


def _make(s: FrozenMapping, su: FrozenMapping, mo: FrozenMapping) -> OutputCollection:
    """Build a collection from checked mappings (no walk, no checks)."""
    out = object.__new__(OutputCollection)
    _set_summaries(out, s)
    _set_state_updates(out, su)
    _set_module_outputs(out, mo)
    return out


def check_is_collection(value: object, where: str, name: str) -> None:
    """Raise `TypeError` unless `value` is an `OutputCollection` (untyped callers)."""
    if not isinstance(value, OutputCollection):
        raise TypeError(
            f"`{where}`: {name} must be an `OutputCollection`, got "
            f"{type(value).__name__}; build one with "
            "`OutputCollection.empty().add_summary(...)`, or pass `ctx.collection` "
            "or the collection a combinator returned."
        )


def check_collection(coll: OutputCollection, path: str = "") -> OutputCollection:
    """Return `coll` after checking the leaves of levels made by unflattening, once."""
    for kind, tree in zip(KINDS, _trees(coll), strict=True):
        if not tree.checked:
            freeze(tree, f"{kind}/{path}" if path else kind)
    return coll


def _trees(coll: OutputCollection) -> Levels:
    return coll.summaries, coll.state_updates, coll.module_outputs


_EMPTY = _make(EMPTY, EMPTY, EMPTY)

_KEYS = tuple(jax.tree_util.GetAttrKey(kind) for kind in KINDS)


# The levels are PyTree nodes themselves (not converted to dicts), so that
# `eqx.tree_at` can replace a level: it finds nodes by identity.


def _flatten_with_keys(coll: OutputCollection) -> tuple[list[Any], None]:
    levels = (coll.summaries, coll.state_updates, coll.module_outputs)
    return list(zip(_KEYS, levels, strict=True)), None


def _flatten(coll: OutputCollection) -> tuple[Levels, None]:
    return (coll.summaries, coll.state_updates, coll.module_outputs), None


def _unflatten(_: None, children: Children) -> OutputCollection:
    # `_make`'s body, inline: JAX unflattens every returned collection per call.
    out = object.__new__(OutputCollection)
    _set_summaries(out, children[0])
    _set_state_updates(out, children[1])
    _set_module_outputs(out, children[2])
    return out


jax.tree_util.register_pytree_with_keys(
    OutputCollection, _flatten_with_keys, _unflatten, _flatten
)


def name_in_use(coll: OutputCollection, name: str) -> bool:
    """Return whether `name` is a leaf, a child or a reserved child name here."""
    return key_in_any(name, _trees(coll))


def with_child(
    coll: OutputCollection, name: str, child: OutputCollection
) -> OutputCollection:
    """Return `coll` with `child` under `name` (the caller checked `name`)."""
    return _make(*inserted_child(_trees(coll), name, _trees(child)))


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
    if kind == "summaries":
        return _make(new, su, mo)
    if kind == "state_updates":
        return _make(s, new, mo)
    return _make(s, su, new)


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

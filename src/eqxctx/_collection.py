"""OutputCollection: the summaries, state updates and module outputs of a call tree.

Follows AXLearn's `OutputCollection` (`axlearn/common/module.py`), as an immutable
`eqx.Module` PyTree: every method returns a new collection.
"""

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, Literal, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._errors import PREFIX_HINT, OutputConflictError
from ._summary import Summary, is_array_leaf


Kind: TypeAlias = Literal["summaries", "state_updates", "module_outputs"]
KINDS: Final[tuple[Kind, Kind, Kind]] = ("summaries", "state_updates", "module_outputs")
ADDERS: Final[dict[str, str]] = {
    "summaries": "add_summary",
    "state_updates": "add_state_update",
    "module_outputs": "add_module_output",
}
_CHILD_NAME = re.compile(r"[a-z][a-z0-9_]*")  # used with fullmatch


def validate_child_name(name: object, *, where: str) -> str:
    """Return `name` if it is a valid child name, else raise `ValueError`."""
    if not isinstance(name, str) or not _CHILD_NAME.fullmatch(name):
        raise ValueError(
            f"`{where}`: invalid child name {name!r}. Child names must match "
            f"'^[a-z][a-z0-9_]*$' (lower case letters, digits and '_', starting with "
            "a letter), e.g. 'encoder' or 'layer_3'."
        )
    return name


def _validate_leaf_name(name: object, *, where: str) -> str:
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(
            f"`{where}`: invalid name {name!r}. Summary, state update and module "
            "output names are non-empty strings without '/'; use `ctx.call` or "
            "`add_child` to nest outputs."
        )
    return name


class IterationSummaries(eqx.Module):
    """The summaries of `length` iterations of a scan or a vmap, kept stacked.

    Stored in `OutputCollection.summaries` under the key `prefix`, it stands for the
    children `{prefix}0` … `{prefix}{length-1}` (and for an empty `{prefix}` child),
    without slicing every summary of every iteration inside the compiled program.
    `OutputCollection.flatten`, `child`, `materialize` and the writers expand it.

    The iteration axis is the leading axis of each leaf when the entry is made. If the
    entry then passes out of an outer `jax.vmap` or `jax.lax.scan` (a function that
    scans, vmapped over a batch), the outer axes come first; `ndims` records each
    leaf's rank at creation, so `iteration(i)` slices the axis just after the added
    ones and iteration i keeps the outer axes (`iter0/x` has shape `[batch]`).
    This needs the outer axes in front, as `jax.vmap`'s default `out_axes=0` and
    `jax.lax.scan`'s stacking put them: with `out_axes=1` (or axes moved by hand) the
    views slice the wrong axis; move the outer axes to the front first
    (`jnp.moveaxis`).

    Raises:
        ValueError: if a leaf of `stacked` has no leading axis of size `length`.

    Attributes:
        length: the number of iterations N, static.
        stacked: a nested summary mapping whose leaves have the iteration axis N
            (traced).
        ndims: the rank of each leaf of `stacked` (in `jax.tree_util.tree_leaves`
            order) when the entry was made, static. Computed when not given.
    """

    length: int = eqx.field(static=True)
    stacked: dict[str, Any]
    ndims: tuple[int, ...] = eqx.field(static=True)

    def __init__(
        self,
        length: int,
        stacked: dict[str, Any],
        # `Any`, not `tuple[int, ...] | None`: beartype checks a variadic tuple by
        # sampling it with `random`, which hypothesis forbids inside strategies.
        ndims: Any = None,
    ):
        leaves = jax.tree_util.tree_leaves(stacked)
        if ndims is None:
            for x in leaves:
                if np.ndim(x) == 0 or np.shape(x)[0] != length:
                    raise ValueError(
                        f"`IterationSummaries({length}, stacked)`: every leaf needs a "
                        f"leading axis of {length} (the iterations), got shape "
                        f"{np.shape(x)}."
                    )
            ndims = tuple(np.ndim(x) for x in leaves)
        self.length = length
        self.stacked = stacked
        self.ndims = tuple(ndims)

    def iteration(self, i: int) -> dict[str, Any]:
        """Return iteration `i`'s summaries (a nested mapping); `self` is unchanged.

        Raises:
            IndexError: if `i` is not in `[0, length)`.
            ValueError: if a leaf has lost its iteration axis (e.g. it was indexed).
        """
        if not 0 <= i < self.length:
            raise IndexError(f"iteration {i} out of range for {self.length} iterations")
        leaves, treedef = jax.tree_util.tree_flatten(self.stacked)
        if len(leaves) != len(self.ndims):
            raise ValueError(
                "`IterationSummaries`: the stacked summaries do not have the leaves "
                "they were made with; build a new entry instead of editing one."
            )
        out: list[Any] = []
        for x, ndim in zip(leaves, self.ndims, strict=True):
            outer = np.ndim(x) - ndim  # axes added by an outer vmap or scan
            if outer < 0:
                raise ValueError(
                    f"`IterationSummaries`: a leaf of shape {np.shape(x)} has fewer "
                    f"axes than when it was made (rank {ndim}, iteration axis first): "
                    "it was indexed or mapped over (e.g. `jax.vmap` with `in_axes` on "
                    "a non-leading axis). Read the per-iteration views before mapping "
                    "over a collection, or map over its leading (outer) axes only."
                )
            out.append(x[(slice(None),) * outer + (i,)])
        # A nested `IterationSummaries` (a scan inside a scan) is a PyTree with static
        # ranks; slicing its leaves on the outer iteration axis keeps it intact.
        return treedef.unflatten(out)


def _copy_tree(tree: Any, path: str) -> dict[str, Any]:
    """Copy the mappings of `tree` (not its leaves) and check every leaf's type."""
    if not isinstance(tree, Mapping):
        raise TypeError(f"`OutputCollection`: {path!r} must be a mapping, got {tree!r}")
    reserved = {
        f"{key}{i}"
        for key, value in tree.items()
        if isinstance(value, IterationSummaries)
        for i in range(value.length)
    }
    clash = reserved & set(tree)
    if clash:
        name = sorted(clash)[0]
        raise OutputConflictError(
            f"`OutputCollection`: {path}/{name} is both an entry and a per-iteration "
            f"child of a scan's per-iteration summaries at {path}. " + PREFIX_HINT
        )
    out: dict[str, Any] = {}
    for key, value in tree.items():
        sub = f"{path}/{key}"
        if not isinstance(key, str):
            raise TypeError(
                f"`OutputCollection`: key {key!r} at {path!r} is not a str."
            )
        if isinstance(value, Mapping):
            out[key] = _copy_tree(value, sub)
        elif isinstance(value, IterationSummaries):
            out[key] = IterationSummaries(
                value.length, _copy_tree(value.stacked, sub), value.ndims
            )
        else:
            check_leaf(value, sub)
            out[key] = value
    return out


def _is_numeric(dtype: Any) -> bool:
    """Return whether `dtype` is a number, a bool or a typed PRNG key (bfloat16 too)."""
    kinds = (jnp.number, jnp.bool_, jax.dtypes.prng_key)
    try:
        return any(bool(jnp.issubdtype(dtype, kind)) for kind in kinds)
    except TypeError:
        return False


def check_leaf(value: object, path: str) -> None:
    """Raise `TypeError` naming `path` unless `value` is a valid collection leaf."""
    if isinstance(value, Summary):
        return
    if is_array_leaf(value):
        dtype = getattr(value, "dtype", None)
        if dtype is None or _is_numeric(dtype):
            return
        raise TypeError(
            f"`OutputCollection`: the array at {path!r} has dtype {dtype}; leaves must "
            "be numeric (bool, int, float, complex). Log text with a "
            "`CallbackSummary`."
        )
    raise TypeError(
        f"`OutputCollection`: the value at {path!r} has type {type(value).__name__}; "
        "leaves must be JAX or NumPy arrays, Python bool/int/float, or `Summary` "
        "objects. Add one output per leaf, or use `ctx.call` to nest them."
    )


def _converter(path: str) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    return lambda tree: _copy_tree(tree, path)


def _reserved(key: str, value: Any) -> Iterator[str]:
    """Yield the child names that the entry `key: value` stands for."""
    yield key
    if isinstance(value, IterationSummaries):
        for i in range(value.length):
            yield f"{key}{i}"


def _is_child(value: Any) -> bool:
    return isinstance(value, (dict, IterationSummaries))


class OutputCollection(eqx.Module):
    """Summaries, state updates and module outputs, as three nested mappings.

    A child (from `add_child`, `Context.call` or a scan) is a nested mapping present
    in all three kinds; leaves are arrays, Python numbers or `Summary` objects. Every
    method returns a new collection and leaves `self` and its arguments unchanged.

    Scans and vmaps keep per-iteration summaries stacked in an `IterationSummaries`
    entry; `flatten`, `child` and `materialize` expand it into `{prefix}{i}` children.

    Attributes:
        summaries: nested mapping of summaries (metrics for TensorBoard).
        state_updates: nested mapping of state updates (e.g. batch-norm statistics).
        module_outputs: nested mapping of module outputs (intermediate activations).
    """

    summaries: dict[str, Any] = eqx.field(converter=_converter("summaries"))
    state_updates: dict[str, Any] = eqx.field(converter=_converter("state_updates"))
    module_outputs: dict[str, Any] = eqx.field(converter=_converter("module_outputs"))

    @classmethod
    def empty(cls) -> "OutputCollection":
        """Return a collection with no entries."""
        return cls({}, {}, {})

    # -- names -------------------------------------------------------------------

    def child_names(self) -> set[str]:
        """Return the child names at this level, including per-iteration ones."""
        names: set[str] = set()
        for kind in KINDS:
            for key, value in getattr(self, kind).items():
                if _is_child(value):
                    names.update(_reserved(key, value))
        return names

    def _leaf_names(self, kind: Kind) -> set[str]:
        return {k for k, v in getattr(self, kind).items() if not _is_child(v)}

    def leaf_names(self) -> set[str]:
        """Return the leaf names at this level, of all three kinds."""
        return set().union(*(self._leaf_names(kind) for kind in KINDS))

    def _add_leaf(self, kind: Kind, name: str, value: Any) -> "OutputCollection":
        return add_leaf(self, kind, name, value)

    # -- adding ------------------------------------------------------------------

    def add_summary(self, name: str, value: Any) -> "OutputCollection":
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

    def add_state_update(self, name: str, value: Any) -> "OutputCollection":
        """Return a new collection with state update `name` added (as `add_summary`)."""
        return add_leaf(self, "state_updates", name, value)

    def add_module_output(self, name: str, value: Any) -> "OutputCollection":
        """Return a new collection with module output `name` added (see add_summary)."""
        return add_leaf(self, "module_outputs", name, value)

    def add_child(self, name: str, child: "OutputCollection") -> "OutputCollection":
        """Return a new collection with `child` nested under `name` in all three kinds.

        The child is recorded even when it is empty, so adding it twice always raises.

        Raises:
            ValueError: if `name` does not match `^[a-z][a-z0-9_]*$`.
            OutputConflictError: if `name` is already a child or a leaf of any kind.
        """
        validate_child_name(name, where="add_child")
        if name in self.child_names() or name in self.leaf_names():
            raise OutputConflictError(
                f"`add_child`: {name!r} is already present in this collection "
                f"(path {name}). Give the child another name; to add the outputs "
                "of several calls, use `scan_in_context`/`vmap_in_context`."
            )
        return OutputCollection(
            **{
                kind: {**getattr(self, kind), name: getattr(child, kind)}
                for kind in KINDS
            }
        )

    def merge(self, other: "OutputCollection") -> "OutputCollection":
        """Return the union of `self` and `other` (one level deep); both unchanged.

        Raises:
            OutputConflictError: if a child name is in both, a leaf name is in the same
                kind of both, or a child name of one equals a leaf name of the other.
                The message names the path.
        """
        mine, theirs = self.child_names(), other.child_names()
        clash = mine & theirs
        if clash:
            name = sorted(clash)[0]
            raise OutputConflictError(
                f"`merge`: both collections have a child {name!r} (path {name}). "
                + PREFIX_HINT
            )
        for kind in KINDS:
            clash = self._leaf_names(kind) & other._leaf_names(kind)
            if clash:
                name = sorted(clash)[0]
                raise OutputConflictError(
                    f"`merge`: both collections have {kind} entry {name!r} "
                    f"(path {kind}/{name})."
                )
        clash = (mine & other.leaf_names()) | (theirs & self.leaf_names())
        if clash:
            name = sorted(clash)[0]
            raise OutputConflictError(
                f"`merge`: {name!r} is a child in one collection and a leaf in the "
                f"other (path {name}). " + PREFIX_HINT
            )
        return OutputCollection(
            **{kind: {**getattr(self, kind), **getattr(other, kind)} for kind in KINDS}
        )

    # -- reading -----------------------------------------------------------------

    def child(self, name: str) -> "OutputCollection":
        """Return the collection of child `name`, including per-iteration children.

        `coll.child("iter3")` returns iteration 3's view of a scan's summaries.

        Raises:
            KeyError: if there is no such child; the message lists the children.
        """
        for key, value in self.summaries.items():
            if isinstance(value, IterationSummaries) and name != key:
                for i in range(value.length):
                    if name == f"{key}{i}":
                        return OutputCollection(value.iteration(i), {}, {})
        if name not in self.child_names():
            raise KeyError(
                f"`child`: no child {name!r}; children: {sorted(self.child_names())}"
            )

        def get(kind: Kind) -> dict[str, Any]:
            value = getattr(self, kind).get(name, {})
            return value if isinstance(value, dict) else {}

        return OutputCollection(*(get(kind) for kind in KINDS))

    def materialize(self) -> "OutputCollection":
        """Return a collection with every `IterationSummaries` expanded into children.

        The result has AXLearn's layout (`summaries["iter3"]["loss"]`). Inside `jax.jit`
        this slices every summary of every iteration; prefer `flatten` and `child`.
        """
        return OutputCollection(
            _materialize(self.summaries), self.state_updates, self.module_outputs
        )

    def flatten(self, kind: Kind, sep: str = "/") -> dict[str, Any]:
        """Return `{path: leaf}` for one kind, with `sep`-joined paths.

        Per-iteration summaries appear as `iter{i}/name` paths with their own values.
        Empty mappings do not appear. `Summary` leaves are returned as they are.

        Raises:
            ValueError: if `kind` is not one of the three kinds.
        """
        if kind not in KINDS:
            raise ValueError(f"`flatten`: kind must be one of {KINDS}, got {kind!r}.")
        tree = getattr(self, kind)
        return dict(_flatten(tree, "", sep))

    def prune(self, drop: Callable[[str], bool]) -> "OutputCollection":
        """Return a collection without the entries for which `drop(path)` is True.

        Follows AXLearn's `prune_tree` over `{"summaries": ..., "state_updates": ...,
        "module_outputs": ...}`: `drop` is called bottom-up on every mapping entry with
        "/"-joined paths such as `"summaries/iter/loss"`, and on the kind roots
        (`"summaries"`), whose dropping empties that kind. Per-iteration summaries are
        seen as materialized, with paths like `"summaries/iter3/loss"` (the calls are
        those of `materialize().prune(drop)`), but stay stacked where every iteration
        keeps the same entries (a `drop` that does not depend on the iteration index),
        so pruning inside a scan body does not slice an inner scan's summaries.
        """
        tree = {
            "summaries": _skeleton(self.summaries),
            "state_updates": self.state_updates,
            "module_outputs": self.module_outputs,
        }
        pruned = _prune(tree, drop, "")
        summaries = pruned.get("summaries")
        if summaries is not None:
            pruned["summaries"] = _restore(summaries, self.summaries)
        return OutputCollection(*(pruned.get(kind, {}) for kind in KINDS))

    def is_empty(self) -> bool:
        """Return whether no kind has any leaf (empty children do not count)."""
        return not any(self.flatten(kind) for kind in KINDS)


def add_leaf(
    coll: OutputCollection, kind: Kind, name: str, value: Any
) -> OutputCollection:
    """Return `coll` with leaf `name` added to `kind` (see `add_summary`).

    A module-level function, not a method: every method access on an `eqx.Module`
    builds a bound-method object, which made adding outputs the largest trace-time
    cost of a scan body.
    """
    where = ADDERS[kind]
    _validate_leaf_name(name, where=where)
    check_leaf(value, f"{kind}/{name}")
    if isinstance(value, Summary):
        value.validate()
    fields = {k: getattr(coll, k) for k in KINDS}
    if name in fields[kind] and not _is_child(fields[kind][name]):
        raise OutputConflictError(
            f"`{where}`: {kind} already has an entry {name!r} (path "
            f"{kind}/{name}). Each name can be added once per context; use another "
            "name or a child context (`ctx.call`)."
        )
    is_child = any(_is_child(tree.get(name)) for tree in fields.values()) or any(
        name in _reserved(key, value)
        for key, value in fields["summaries"].items()
        if isinstance(value, IterationSummaries)
    )
    if is_child:
        raise OutputConflictError(
            f"`{where}`: {name!r} is already a child at this level (path "
            f"{kind}/{name}); leaf names and child names must differ."
        )
    fields[kind] = {**fields[kind], name: value}
    return OutputCollection(**fields)


def _materialize(tree: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, IterationSummaries):
            out[key] = {}
            for i in range(value.length):
                out[f"{key}{i}"] = _materialize(value.iteration(i))
        elif isinstance(value, dict):
            out[key] = _materialize(value)
        else:
            out[key] = value
    return out


def _flatten(tree: dict[str, Any], prefix: str, sep: str) -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, IterationSummaries):
            for i in range(value.length):
                yield from _flatten(value.iteration(i), f"{path}{i}{sep}", sep)
        elif isinstance(value, dict):
            yield from _flatten(value, f"{path}{sep}", sep)
        else:
            yield path, value


class _Slot(tuple[str, ...]):
    """A stand-in for a leaf of an `IterationSummaries` entry: its path in `stacked`."""


def _skeleton(tree: dict[str, Any]) -> dict[str, Any]:
    """`_materialize(tree)`'s mappings, with `_Slot`s for per-iteration leaves.

    `prune` calls `drop` on this tree (the same paths, in the same order as on the
    materialized tree) without slicing anything. An entry whose `stacked` holds
    another `IterationSummaries` is materialized for real.
    """
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, IterationSummaries):
            if _has_iterations(value.stacked):
                out.update(_materialize({key: value}))
                continue
            out[key] = {}
            slots = _slots(value.stacked, ())
            for i in range(value.length):
                out[f"{key}{i}"] = slots
        elif isinstance(value, dict):
            out[key] = _skeleton(value)
        else:
            out[key] = value
    return out


def _has_iterations(tree: dict[str, Any]) -> bool:
    return any(
        isinstance(v, IterationSummaries)
        or (isinstance(v, dict) and _has_iterations(v))
        for v in tree.values()
    )


def _slots(tree: dict[str, Any], prefix: tuple[str, ...]) -> dict[str, Any]:
    # Sorted, as `IterationSummaries.iteration` returns them (JAX sorts dict keys).
    return {
        k: _slots(tree[k], (*prefix, k))
        if isinstance(tree[k], dict)
        else _Slot((*prefix, k))
        for k in sorted(tree)
    }


def _restore(pruned: dict[str, Any], original: dict[str, Any]) -> dict[str, Any]:
    """Replace the `_Slot`s of a pruned `_skeleton` with the summaries they stand for.

    An `IterationSummaries` entry whose iterations all kept the same slots (and whose
    empty `{prefix}` child was kept) stays one (stacked) entry; otherwise the kept
    iterations are sliced.
    """
    out: dict[str, Any] = {}
    for key, value in original.items():
        if isinstance(value, IterationSummaries) and not _has_iterations(value.stacked):
            kept = [pruned.get(f"{key}{i}") for i in range(value.length)]
            first = kept[0] if kept else None
            # Stacked, the entry also reserves `key` (its empty child): only if kept.
            if first is not None and key in pruned and all(k == first for k in kept):
                out[key] = _stacked_subset(value, first)
                continue
            if key in pruned:
                out[key] = {}
            for i, slots in enumerate(kept):
                if slots is not None:
                    out[f"{key}{i}"] = _fill(slots, value.iteration(i))
        elif isinstance(value, IterationSummaries):  # materialized in `_skeleton`
            for k in [key, *(f"{key}{i}" for i in range(value.length))]:
                if k in pruned:
                    out[k] = pruned[k]
        elif key in pruned:
            if isinstance(value, dict):
                out[key] = _restore(pruned[key], value)
            else:
                out[key] = pruned[key]
    return out


def _fill(slots: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    return {
        k: _fill(v, values[k]) if isinstance(v, dict) else values[k]
        for k, v in slots.items()
    }


def _stacked_subset(
    entry: "IterationSummaries", slots: dict[str, Any]
) -> "IterationSummaries":
    """The entry with only the summaries in `slots`, still stacked."""
    stacked = _fill(slots, entry.stacked)
    with_path = jax.tree_util.tree_flatten_with_path(entry.stacked)[0]
    ndim = {path: n for (path, _), n in zip(with_path, entry.ndims, strict=True)}
    kept = jax.tree_util.tree_flatten_with_path(stacked)[0]
    return IterationSummaries(
        entry.length, stacked, tuple(ndim[path] for path, _ in kept)
    )


def _prune(tree: dict[str, Any], drop: Callable[[str], bool], prefix: str) -> Any:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else key
        if isinstance(value, dict):
            value = _prune(value, drop, path)
        if not drop(path):
            out[key] = value
    return out

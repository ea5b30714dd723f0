"""IterationSummaries: its per-iteration views, and `freeze` (where leaves enter).

A scan or vmap keeps its per-iteration summaries stacked in one `IterationSummaries`
entry, which stands for the children `{prefix}0` … `{prefix}{N-1}` (and an empty
`{prefix}` child). Host-side views fetch each stacked array once and index it in
NumPy; inside a trace they slice with `jax.numpy`. The walks over whole trees
(flatten, materialize, prune) are in `_expand.py`.

Sequences in signatures have `Any`-typed items (`Leaf`, `Pairs`): beartype, the test
suite's runtime checker, samples sequence items with `random`, which hypothesis
forbids inside strategies, and these walks run inside `eqxctx.testing`'s.
"""

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.core import Tracer

from ._errors import PREFIX_HINT, OutputConflictError
from ._leaves import check_leaf, check_summary_name, owner
from ._mapping import Entry, FrozenMapping, Pairs
from ._typing import Leaf, Tree, TreeDef


class IterationSummaries(eqx.Module):
    """The summaries of `length` iterations of a scan or a vmap, kept stacked.

    Stored in `OutputCollection.summaries` under the key `prefix`, it stands for the
    children `{prefix}0` … `{prefix}{length-1}` (and for an empty `{prefix}` child),
    without slicing every summary of every iteration inside the compiled program.
    `OutputCollection.flatten`, `child`, `materialize` and the writers expand it; on
    concrete arrays they fetch each stacked array to the host once and return NumPy
    values per iteration.

    The iteration axis is the leading axis of each leaf when the entry is made. If the
    entry then passes out of an outer `jax.vmap` or `jax.lax.scan` (a function that
    scans, vmapped over a batch), the outer axes come first; `ndims` records each
    leaf's rank at creation, so `iteration(i)` slices the axis just after the added
    ones and iteration i keeps the outer axes (`iter0/x` has shape `[batch]`).
    This needs the outer axes in front, as `jax.vmap`'s default `out_axes=0` and
    `jax.lax.scan`'s stacking put them: with `out_axes=1` (or axes moved by hand) the
    views slice the wrong axis; move the outer axes to the front first
    (`jnp.moveaxis`).

    Iteration i is always index i (the `xs` index of a scan, also under
    `reverse=True`); `reverse` records only the order in which the iterations ran,
    which `OutputCollection.merge_iterations` accumulates in (as
    `merge_summaries=True` does).

    `length` is static, so slicing the stacked arrays (`jax.tree.map(lambda x:
    x[:6], coll)`) does not change it: every view then raises a `ValueError` naming
    the entry's path. To keep some iterations, make a new entry of the sliced
    arrays with their number as `length` (and this entry's `ndims` and `reverse`).

    Raises:
        ValueError: if a leaf of `stacked` has no leading axis of size `length`, or
            `length` is negative.
        TypeError: if `length` is not an int, `reverse` not a bool, or a leaf is not
            a valid summary leaf (naming its path).

    Attributes:
        length: the number of iterations N, static.
        stacked: a read-only nested summary mapping whose leaves have the iteration
            axis N (traced).
        ndims: the rank of each leaf of `stacked` (in `jax.tree_util.tree_leaves`
            order) when the entry was made, static. Computed when not given.
        reverse: whether the iterations ran from the last index to the first (a
            `scan_in_context(..., reverse=True)`), static; False by default.
    """

    length: int = eqx.field(static=True)
    stacked: FrozenMapping
    ndims: tuple[int, ...] = eqx.field(static=True)
    reverse: bool = eqx.field(static=True)

    def __init__(
        self,
        length: object,  # an int, checked here with a message naming the argument
        stacked: Tree,
        # `Any`, not `tuple[int, ...] | None`: beartype checks a variadic tuple by
        # sampling it with `random`, which hypothesis forbids inside strategies.
        ndims: Any = None,
        reverse: object = False,  # a bool, checked here with a message
    ):
        if not isinstance(reverse, bool):
            raise TypeError(
                "`IterationSummaries(length, stacked, reverse=...)`: reverse must be "
                f"a bool (the scan's direction), got {type(reverse).__name__}."
            )
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
            raise TypeError(
                "`IterationSummaries(length, stacked)`: length must be an int (the "
                f"number of iterations), got {type(length).__name__} {length!r}."
            )
        if length < 0:
            raise ValueError(
                "`IterationSummaries(length, stacked)`: length must be >= 0 (the "
                f"number of iterations), got {length}."
            )
        length = int(length)
        frozen = freeze(stacked, "IterationSummaries.stacked")
        if ndims is None:
            for x in jax.tree_util.tree_leaves(frozen):
                if np.ndim(x) == 0 or np.shape(x)[0] != length:
                    raise ValueError(
                        f"`IterationSummaries({length}, stacked)`: every leaf needs a "
                        f"leading axis of {length} (the iterations), got shape "
                        f"{np.shape(x)}."
                    )
            ndims = tuple(np.ndim(x) for x in jax.tree_util.tree_leaves(frozen))
        self.length = length
        self.stacked = frozen
        self.ndims = tuple(ndims)
        self.reverse = reverse

    @property
    def reserved_span(self) -> int:
        """The number of per-iteration child names this entry reserves (`length`)."""
        return self.length

    def iteration(self, i: int) -> FrozenMapping:
        """Return iteration `i`'s summaries (a nested mapping); `self` is unchanged.

        Raises:
            IndexError: if `i` is not in `[0, length)`.
            ValueError: if a leaf has lost its iteration axis, or that axis no longer
                has `length` entries (its arrays were indexed or sliced, e.g. by
                `jax.tree.map(lambda x: x[:6], coll)`).
        """
        return iteration_view(self, i, "")

    def iterations(self) -> list[Leaf]:
        """Return every iteration's summaries, fetching each stacked array once.

        Raises:
            ValueError: as `iteration`.
        """
        return iteration_views(self, "")


def iteration_view(entry: IterationSummaries, i: int, path: str) -> FrozenMapping:
    """`entry.iteration(i)`, with errors naming the entry's `path`."""
    if not 0 <= i < entry.length:
        raise IndexError(f"iteration {i} out of range for {entry.length} iterations")
    return iteration_views(entry, path)[i]


def iteration_views(entry: IterationSummaries, path: str) -> list[Leaf]:
    """`entry.iterations()`, with errors naming the entry's `path`."""
    leaves, treedef = entry_leaves(entry)
    axes = iteration_axes(entry, leaves, path)
    rows = [unstack(x, axis) for x, axis in zip(host_leaves(leaves), axes, strict=True)]
    return [treedef.unflatten([r[i] for r in rows]) for i in range(entry.length)]


def entry_leaves(entry: IterationSummaries) -> tuple[list[Leaf], TreeDef]:
    """Return the leaves and treedef of `entry.stacked`, checking their number."""
    leaves, treedef = jax.tree_util.tree_flatten(entry.stacked)
    if len(leaves) != len(entry.ndims):
        raise ValueError(
            "`IterationSummaries`: the stacked summaries do not have the leaves "
            "they were made with; build a new entry instead of editing one."
        )
    return leaves, treedef


def iteration_axes(
    entry: IterationSummaries, leaves: list[Leaf], path: str
) -> list[int]:
    """Return each leaf's iteration axis: after the axes an outer transform added.

    The one check that every walk over an entry makes before it reads the leaves:
    each leaf still has its iteration axis, with `entry.length` entries. Shapes
    only (static inside a trace, no transfer), once per entry, not per iteration.
    `path` is the entry's path for the message (`""` where it is not known).

    Raises:
        ValueError: if a leaf has fewer axes than when the entry was made, or its
            iteration axis does not have `entry.length` entries (naming the path).
    """
    axes: list[int] = []
    length = entry.length
    for j, (x, ndim) in enumerate(zip(leaves, entry.ndims, strict=True)):
        shape = np.shape(x)
        outer = len(shape) - ndim
        if outer < 0:
            raise ValueError(
                f"{_where(entry, path)}: {_leaf_name(entry, j)} has shape {shape}, "
                f"fewer axes than when it was made (rank {ndim}, iteration axis "
                "first): it was indexed or mapped over (e.g. `jax.vmap` with "
                "`in_axes` on a non-leading axis). Read the per-iteration views "
                "before mapping over a collection, or map over its leading (outer) "
                "axes only."
            )
        if outer >= len(shape) or shape[outer] != length:
            size = shape[outer] if outer < len(shape) else None
            raise ValueError(
                _SLICED.format(
                    where=_where(entry, path),
                    leaf=_leaf_name(entry, j),
                    size=size,
                    axis=outer,
                    shape=shape,
                    length=length,
                )
            )
        axes.append(outer)
    return axes


_SLICED = (
    "{where}: {leaf} of shape {shape} has size {size} on its iteration axis (axis "
    "{axis}), but the entry reserves {length} iterations: its stacked arrays were "
    "sliced or indexed (e.g. `jax.tree.map(lambda x: x[:6], coll)`), which leaves "
    "the static `length` as it was. To keep some iterations, slice the iteration "
    "axis of the entry's `stacked` summaries and make a new entry, "
    "`IterationSummaries(new_length, sliced, entry.ndims, entry.reverse)`, or "
    "rebuild the collection with a scan of that length; to keep a few, read them "
    "with `coll.child(...)` before slicing."
)


def _where(entry: IterationSummaries, path: str) -> str:
    if not path:
        return "`IterationSummaries`"
    last = f"{path}{entry.length - 1}"
    span = f"'{path}0' … '{last}'" if entry.length > 1 else f"'{last}'"
    children = f"children {span}" if entry.length else "no iteration"
    return f"`IterationSummaries` at {path!r} ({children})"


def _leaf_name(entry: IterationSummaries, j: int) -> str:
    """Name leaf `j` of `entry.stacked` by its path (only for an error message)."""
    flat = jax.tree_util.tree_flatten_with_path(entry.stacked)[0]
    keys = flat[j][0] if j < len(flat) else ()
    parts = [str(getattr(k, "key", getattr(k, "name", k))) for k in keys]
    return f"the leaf {'/'.join(parts)!r}" if parts else f"leaf {j}"


def check_iterations(tree: Tree, prefix: str) -> None:
    """Check every entry in `tree` and in its entries (`iteration_axes`), shapes only.

    For a caller that keeps entries stacked without reading them (the first
    `SummaryAccumulator.update`, `merge_iterations`): a nested entry's path is
    spelled `{path}{{i}}/{key}`.
    """
    for key, value in items_of(tree):
        path = prefix + key
        if isinstance(value, IterationSummaries):
            check_entry(value, entry_leaves(value)[0], path)
        elif isinstance(value, Mapping):
            check_iterations(value, path + "/")


def check_entry(entry: IterationSummaries, leaves: list[Leaf], path: str) -> None:
    """`iteration_axes` of `entry` (its `leaves`) and of the entries inside it."""
    iteration_axes(entry, leaves, path)
    check_iterations(entry.stacked, f"{path}{{i}}/")


def _fetchable(x: object) -> bool:
    return (
        isinstance(x, jax.Array)
        and not isinstance(x, Tracer)
        and x.is_fully_addressable
    )


def host_leaves(leaves: list[Leaf]) -> list[Leaf]:
    """Return `leaves` with concrete, addressable JAX arrays fetched to NumPy at once.

    Tracers and arrays this process cannot read whole stay as they are (they are
    sliced on the device).
    """
    which = [j for j, x in enumerate(leaves) if _fetchable(x)]
    if not which:
        return leaves
    out = list(leaves)
    try:
        fetched = jax.device_get([leaves[j] for j in which])
    except Exception:
        fetched = []
        for j in which:
            try:
                fetched.append(np.asarray(leaves[j]))
            except Exception:
                fetched.append(leaves[j])
    for j, value in zip(which, fetched, strict=True):
        out[j] = value
    return out


def unstack(x: Leaf, axis: int) -> list[Leaf]:
    """Return the slices of `x` along `axis`: NumPy views, device slices, or structs.

    An abstract leaf (`jax.ShapeDtypeStruct`, as `jax.eval_shape` returns) gives one
    abstract slice, the same for every index.
    """
    if isinstance(x, np.ndarray):
        if x.flags.writeable:  # a collection's own array: its views are read-only
            x = x.view()
            x.flags.writeable = False
        return list(np.moveaxis(x, axis, 0) if axis else x)
    if isinstance(x, jax.ShapeDtypeStruct):
        return [_slice_struct(x, axis)] * x.shape[axis]
    index = (slice(None),) * axis
    return [x[(*index, i)] for i in range(np.shape(x)[axis])]


def _is_single_device_class(sharding: object) -> bool:
    return isinstance(sharding, jax.sharding.SingleDeviceSharding)


#: Whether a sharding places an array on one device. JAX 0.12 deprecates the class
#: in favour of this function, which 0.10 lacks (pyproject allows 0.8): chosen once.
_is_single_device: Callable[[object], bool] = (
    getattr(jax.sharding, "is_single_device_sharding", None) or _is_single_device_class
)


def _slice_struct(x: jax.ShapeDtypeStruct, axis: int) -> jax.ShapeDtypeStruct:
    """Return the abstract value of one slice of `x` along `axis` (`x[..., i]`).

    The shape loses `axis`; dtype and weak type stay. A `NamedSharding` loses the
    axis's entry when it is not sharded, which is what indexing a traced array with
    such a sharding gives; a sliced sharded axis has no `NamedSharding` (JAX refuses
    the index under Explicit axes), so the slice gets none. A single-device sharding
    stays; any other sharding is dropped.
    """
    shape = x.shape[:axis] + x.shape[axis + 1 :]
    sharding = x.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        parts = tuple(sharding.spec)
        if axis < len(parts) and parts[axis] is not None:
            sharding = None
        elif axis < len(parts):
            spec = sharding.spec.update(partitions=parts[:axis] + parts[axis + 1 :])
            sharding = jax.sharding.NamedSharding(
                sharding.mesh, spec, memory_kind=sharding.memory_kind
            )
    elif not _is_single_device(sharding):
        sharding = None
    # `manual_axis_type` exists from JAX 0.9 (pyproject allows 0.8).
    manual: Any = getattr(x, "manual_axis_type", None)
    extra: dict[str, Any] = {} if manual is None else {"manual_axis_type": manual}
    return jax.ShapeDtypeStruct(
        shape, x.dtype, sharding=sharding, weak_type=x.weak_type, **extra
    )


# -- conversion (where leaves enter) -------------------------------------------------


def items_of(tree: Tree) -> Pairs:
    if isinstance(tree, FrozenMapping):
        return tree.items_list()
    return list(tree.items())


def freeze(tree: object, path: str, where: str | None = None) -> FrozenMapping:
    """Return `tree` as a `FrozenMapping`, checking every key and leaf once.

    A `FrozenMapping` is returned as it is, after checking its leaves if they were not
    checked where they entered (`checked`). The stacked values of an
    `IterationSummaries` entry are checked like leaves. Nothing of `tree` is aliased
    into the result except its immutable leaves and entries (a NumPy array is
    copied, except for a `where` caller, which reads it at once).

    `path` and `where` are as for `check_leaf`: `tree`'s path in a collection (e.g.
    `"summaries"`), errors naming `OutputCollection`; or, with `where`, summaries
    passed to `where`, at `path` in what was passed (`""` for all of it).

    Raises:
        TypeError: if `tree` is not a mapping, a key is not a `str` (without `where`),
            or a leaf is not a valid collection leaf (the message names the path).
        ValueError: with `where`, for a key that is not a `str` (an invalid summary
            name, as `check_summary_name` words it).
        OutputConflictError: if an entry is also a per-iteration child of a scan's
            `IterationSummaries` entry in the same mapping.
    """
    if isinstance(tree, FrozenMapping):
        if not tree.checked:  # made by unflattening: any leaves, checked once here
            _check_frozen(tree, path, where)
        return tree
    if not isinstance(tree, Mapping):
        raise TypeError(f"`{owner(where)}`: {path!r} must be a mapping, got {tree!r}")
    prefix = f"{path}/" if path else ""
    pairs: list[tuple[str, Entry]] = []
    for key, value in list(tree.items()):
        if not isinstance(key, str):
            if where is not None:  # a summary name, refused as the caller's others
                check_summary_name(key, prefix, where=where)
            raise TypeError(
                f"`OutputCollection`: key {key!r} at {path!r} is not a str."
            )
        sub = prefix + key
        if isinstance(value, Mapping):
            value = freeze(value, sub, where)
        else:
            _check_value(value, sub, where)
            if where is None and isinstance(value, np.ndarray):
                value = value.copy()  # the caller's: refilling it changes nothing
        pairs.append((key, value))
    out = FrozenMapping(pairs, checked=True)
    _check_reserved(out, path, where)
    return out


def _check_frozen(tree: FrozenMapping, path: str, where: str | None) -> None:
    prefix = f"{path}/" if path else ""
    for key, value in tree.items_list():
        sub = f"{prefix}{key}"  # (its keys are not checked: any key formats)
        if isinstance(value, FrozenMapping):
            freeze(value, sub, where)
        else:
            _check_value(value, sub, where)
    _check_reserved(tree, path, where)
    tree.mark_checked()


def _check_value(value: object, path: str, where: str | None) -> None:
    """Check a level's entry that is not a mapping: a leaf, or a scan's entry."""
    if isinstance(value, IterationSummaries):
        # One made by unflattening is not checked yet.
        freeze(value.stacked, path, where)
    else:
        check_leaf(value, path, where)


def _check_reserved(out: FrozenMapping, path: str, where: str | None) -> None:
    for key, span in out.spans():
        clash = out.numbered_below(key, span)
        if clash is None:
            continue
        if where is None:
            raise OutputConflictError(
                f"`OutputCollection`: {path}/{clash} is both an entry and a "
                f"per-iteration child of a scan's per-iteration summaries at {path}. "
                + PREFIX_HINT
            )
        prefix = f"{path}/" if path else ""
        raise OutputConflictError(
            f"`{where}`: the entry at {prefix + clash!r} is also a per-iteration "
            f"child of the scan's per-iteration summaries at {prefix + key!r}. "
            + PREFIX_HINT
        )

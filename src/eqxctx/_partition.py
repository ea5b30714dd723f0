"""Partition specs: resolution, the rank rule and divisibility checks.

Follows AXLearn's `DataPartitionType`, `data_partition_type_to_spec` and the rank rule
of `reshard_fn` (`axlearn/common/utils.py`), on top of `jax.sharding.PartitionSpec` and
`jax.sharding.NamedSharding`.
"""

import enum
import functools
from collections.abc import Hashable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._typing import ArrayLeaf, KeyPath, Params, PartitionTree, SpecEntry


#: Mesh axes over which `DataPartition.BATCH` splits the batch (AXLearn's
#: `batch_axis_names`).
DATA_AXES: tuple[str, ...] = ("data", "fsdp")


class DataPartition(enum.Enum):
    """How a batch's leading (batch) axis is split over a mesh.

    Follows AXLearn's `DataPartitionType`. Each leaf of rank >= 2 gets the spec below;
    rank-1 leaves take only its first entry and rank-0 leaves are replicated (AXLearn's
    `reshard_fn` rule).

    Attributes:
        FULL: the batch axis is split over all mesh axes,
            `PartitionSpec(mesh.axis_names)`.
        BATCH: the batch axis is split over the data-like axes of the mesh (`"data"`,
            `"fsdp"`), and replicated over the others (e.g. `"model"`).
        REPLICATED: every device holds the whole batch, `PartitionSpec()`.
    """

    FULL = "full"
    BATCH = "batch"
    REPLICATED = "replicated"


def spec_str(spec: PartitionSpec) -> str:
    """`P('data', None)`, the same on every JAX version (for error messages)."""
    return "P(" + ", ".join(repr(entry) for entry in spec) + ")"


def is_explicit(mesh: Mesh) -> bool:
    """Return whether any axis of `mesh` has `AxisType.Explicit`."""
    return any(t == AxisType.Explicit for t in mesh.axis_types)


def data_partition_spec(partition: DataPartition, mesh: Mesh) -> PartitionSpec:
    """Return the `PartitionSpec` of a `DataPartition` on `mesh`.

    Follows AXLearn's `data_partition_type_to_spec`.

    Raises:
        ValueError: for `BATCH` on a mesh without a `"data"` or `"fsdp"` axis.
    """
    names = tuple(str(n) for n in mesh.axis_names)
    if partition is DataPartition.FULL:
        return PartitionSpec(names)
    if partition is DataPartition.REPLICATED:
        return PartitionSpec()
    data = tuple(n for n in names if n in DATA_AXES)
    if not data:
        raise ValueError(
            f"`DataPartition.BATCH` splits the batch over the mesh axes {DATA_AXES}, "
            f"but the mesh has axes {names}. Name a mesh axis 'data' (e.g. "
            "`jax.make_mesh((n,), ('data',))`), or pass `DataPartition.FULL` or an "
            "explicit `PartitionSpec`."
        )
    return PartitionSpec(data)


def leaf_spec(
    spec: PartitionSpec, ndim: int, *, explicit: bool, path: str = "a leaf"
) -> PartitionSpec:
    """Return the spec used for a leaf of rank `ndim` (AXLearn's `reshard_fn` rule).

    Rank-0 leaves are replicated; rank-1 leaves take only the first entry of `spec`;
    others take `spec` as it is. The result is then put in the form JAX gives the
    outputs of a jitted function (see `normalize_spec`).

    Raises:
        ValueError: if `spec` has more non-None entries than the leaf has dimensions
            (naming `path`).
    """
    if ndim == 0:
        return PartitionSpec()
    if ndim == 1 and len(spec) > 1:
        spec = PartitionSpec(spec[0])
    return normalize_spec(spec, ndim, explicit=explicit, path=path)


def fit_rank(spec: PartitionSpec, ndim: int, *, path: str) -> PartitionSpec:
    """Return `spec` without the trailing None entries beyond the rank `ndim`.

    `P("data", None, None)` on a rank-2 leaf means `P("data", None)`, on meshes of
    both axis types (JAX drops trailing Nones on Auto meshes but rejects them on
    Explicit ones).

    Raises:
        ValueError: if a non-None entry is beyond the rank (naming `path`).
    """
    if len(spec) <= ndim:
        return spec
    entries = list(spec)
    while len(entries) > ndim and entries[-1] is None:
        entries.pop()
    if len(entries) > ndim:
        raise ValueError(
            f"Leaf {path!r} has rank {ndim} but its partition spec "
            f"{spec_str(spec)} has {len(spec)} entries, with non-None entries beyond "
            "its rank; pass a spec with at most one entry per dimension (trailing "
            "None entries are dropped)."
        )
    return PartitionSpec(*entries)


def normalize_spec(
    spec: PartitionSpec, ndim: int, *, explicit: bool, path: str = "a leaf"
) -> PartitionSpec:
    """Return `spec` in the form JAX gives jit outputs on this kind of mesh.

    `P("data")` and `P("data", None)` mean the same but differ as shardings (and so
    as jit cache keys). On Explicit meshes JAX pads specs with None to the rank; on
    Auto meshes it drops trailing Nones. Using the same form for inputs keeps a
    runner's key and chained batches on one compiled program. Trailing Nones beyond
    the rank are dropped on both (see `fit_rank`).

    Raises:
        ValueError: if `spec` has more non-None entries than `ndim` (naming `path`).
    """
    entries = list(fit_rank(spec, ndim, path=path) if len(spec) > ndim else spec)
    if explicit:
        entries += [None] * (ndim - len(entries))
    else:
        while entries and entries[-1] is None:
            entries.pop()
    return PartitionSpec(*entries)


def _is_partition_leaf(x: object) -> bool:
    return x is None or isinstance(x, (PartitionSpec, DataPartition))


def path_str(path: KeyPath) -> str:
    """Return a key path as "a/b/0" (attribute names, dict keys, sequence indices)."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _tree_noun(what: str) -> str:
    if what.startswith("param"):
        return "the model's parameters (its array leaves)"
    if what.startswith("output"):
        return "the method's output"
    return "the batch"


def resolve_specs(
    partition: PartitionTree, tree: PyTree, mesh: Mesh, *, what: str
) -> list[PartitionSpec]:
    """Return one `PartitionSpec` per leaf of `tree` (before the rank rule).

    A None in `partition` means replicated; a None in `tree` is an empty subtree (no
    leaf, no spec), as in `jax.jit` and `eqx.filter_jit`.

    Args:
        partition: a `DataPartition`, a `PartitionSpec`, or a prefix tree of them
            (None means replicated).
        tree: the PyTree whose leaves get specs.
        mesh: the mesh that `DataPartition`s are resolved on.
        what: the argument name, for error messages.

    Raises:
        ValueError: if `partition` is not a prefix of `tree`'s structure, if a spec
            names an axis that `mesh` does not have (naming the leaf), or for
            `DataPartition.BATCH` on a mesh without data-like axes.
        TypeError: for a leaf of `partition` that is not a `DataPartition`,
            `PartitionSpec` or None.
    """
    prefix_leaves, prefix_def = jax.tree_util.tree_flatten(
        partition, is_leaf=_is_partition_leaf
    )
    try:
        subtrees = prefix_def.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        noun = _tree_noun(what)
        raise ValueError(
            f"`MethodRunner({what}=...)`: the partition tree does not match the "
            f"structure of {noun}: {str(e).rstrip('.')}. Pass one "
            f"`DataPartition`/`PartitionSpec` for all of {noun}, or a tree of them "
            "that is a prefix of its structure "
            f"(partition: {prefix_def}; {noun}: {jax.tree.structure(tree)})."
        ) from None
    specs: list[PartitionSpec] = []
    for p, sub in zip(prefix_leaves, subtrees, strict=True):
        if p is None:
            spec = PartitionSpec()
        elif isinstance(p, DataPartition):
            spec = data_partition_spec(p, mesh)
        elif isinstance(p, PartitionSpec):
            spec = p
        else:
            raise TypeError(
                f"`MethodRunner({what}=...)`: expected `DataPartition`, "
                f"`PartitionSpec` or None leaves, got {type(p).__name__}."
            )
        specs.extend([spec] * len(jax.tree_util.tree_leaves(sub)))
    axes = set(mesh.axis_names)
    for i, spec in enumerate(specs):
        unknown = unknown_axes(spec, axes)
        if unknown:
            path = path_str(jax.tree_util.tree_flatten_with_path(tree)[0][i][0])
            raise_unknown_axes(spec, unknown, mesh, what=what, path=path)
    return specs


def unknown_axes(spec: PartitionSpec, axes: "set[Hashable]") -> list[str]:
    """Return the axis names in `spec` that are not in `axes`."""
    out: list[str] = []
    for entry in spec:
        if entry is None:
            continue
        for name in entry if isinstance(entry, tuple) else (entry,):
            if isinstance(name, str) and name not in axes:
                out.append(name)
    return out


def raise_unknown_axes(
    spec: PartitionSpec, unknown: list[str], mesh: Mesh, *, what: str, path: str
) -> None:
    """Raise the `ValueError` for a spec that names axes the mesh does not have."""
    raise ValueError(
        f"`MethodRunner({what}=...)`: the spec {spec_str(spec)} of leaf {path!r} "
        f"names mesh axes {unknown} that the mesh does not have (mesh axes: "
        f"{tuple(str(n) for n in mesh.axis_names)}). Use the mesh's axis names."
    )


@functools.lru_cache(maxsize=4096)
def named_sharding(mesh: Mesh, spec: PartitionSpec) -> NamedSharding:
    """Return `NamedSharding(mesh, spec)`, cached so that equal inputs share it."""
    return NamedSharding(mesh, spec)


def mesh_axes_size(mesh: Mesh, entry: SpecEntry) -> tuple[tuple[str, ...], int]:
    """Return the axis names of one spec entry and the number of shards they make."""
    if entry is None:
        return (), 1
    names = tuple(entry) if isinstance(entry, tuple) else (entry,)
    size = 1
    for n in names:
        size *= int(mesh.shape[n])
    return tuple(str(n) for n in names), size


_DIVISIBLE_ADVICE = {
    "batch": (
        "Leaf",
        "Use a batch size divisible by {size}, or another partition for this leaf.",
    ),
    "output": (
        "Output leaf",
        "Return a dimension divisible by {size}, or pass another `output_partition` "
        "for this leaf (e.g. `DataPartition.REPLICATED`).",
    ),
    "parameter": (
        "Parameter",
        "Use a `param_partition` that splits this dimension over mesh axes whose "
        "total size divides it, or replicate it (`PartitionSpec()`).",
    ),
}


def check_divisible(
    shape: Sequence[int],
    spec: PartitionSpec,
    mesh: Mesh,
    *,
    path: str,
    what: str = "batch",
) -> None:
    """Raise `ValueError` if a dimension of `shape` does not divide over its axes.

    Args:
        shape: the leaf's (global) shape.
        spec: its partition spec; trailing None entries beyond the rank are ignored.
        mesh: the mesh.
        path: the leaf's path, for the message.
        what: `"batch"`, `"output"` or `"parameter"`: the kind of leaf, for the
            message.

    Raises:
        ValueError: naming `path`, `shape` and the mesh axes; also if `spec` has
            non-None entries beyond the rank of `shape`.
    """
    label, advice = _DIVISIBLE_ADVICE[what]
    if len(spec) > len(shape):
        try:
            spec = fit_rank(spec, len(shape), path=path)
        except ValueError:
            raise ValueError(
                f"{label} {path!r} of shape {tuple(shape)} has rank {len(shape)} but "
                f"its partition spec {spec_str(spec)} has {len(spec)} entries; pass a "
                "spec with at most one entry per dimension."
            ) from None
    for dim, entry in enumerate(spec):
        names, size = mesh_axes_size(mesh, entry)
        if shape[dim] % size:
            raise ValueError(
                f"{label} {path!r} of shape {tuple(shape)}: dimension {dim} (size "
                f"{shape[dim]}) is split over mesh axes {names} of total size {size} "
                f"(mesh {dict(mesh.shape)}), which does not divide it. "
                + advice.format(size=size)
            )


def leaf_shardings(
    specs: Sequence[PartitionSpec],
    with_path: Sequence[tuple[KeyPath, ArrayLeaf]],
    mesh: Mesh,
    *,
    kind: str,
    rank_rule: bool = True,
    check: bool = True,
) -> list[NamedSharding]:
    """Return the sharding of each leaf from its spec: the one spec-to-sharding rule.

    Used for batches (placed and traced), outputs, parameters and `lower`'s
    `ShapeDtypeStruct`s alike.

    Args:
        specs: one spec per leaf (from `resolve_specs` / `resolve_param_specs`).
        with_path: `(key_path, leaf)` per leaf; leaves are anything with a shape
            (arrays, tracers, `jax.ShapeDtypeStruct`s, Python scalars).
        mesh: the mesh.
        kind: `"batch"`, `"output"` or `"parameter"`, for messages.
        rank_rule: apply AXLearn's rank rule (`leaf_spec`; batches and outputs)
            rather than only fitting the spec to the rank (parameters).
        check: check that each dimension divides over its mesh axes (off for
            process-local batches, whose global shape `to_global` checks).

    Raises:
        ValueError: for a spec with non-None entries beyond a leaf's rank, or a
            dimension that does not divide (naming the leaf, its shape and the axes).
    """
    explicit = is_explicit(mesh)
    out: list[NamedSharding] = []
    for (path, x), spec in zip(with_path, specs, strict=True):
        shape = np.shape(x)
        name = path_str(path)
        if rank_rule:
            spec = leaf_spec(spec, len(shape), explicit=explicit, path=name)
        else:
            spec = normalize_spec(spec, len(shape), explicit=explicit, path=name)
        if check:
            check_divisible(shape, spec, mesh, path=name, what=kind)
        out.append(named_sharding(mesh, spec))
    return out


def batch_shards(sharding: NamedSharding) -> int:
    """Return how many shards the leading (batch) axis is split into (1: none)."""
    spec = sharding.spec
    if not len(spec):
        return 1
    mesh = sharding.mesh
    assert isinstance(mesh, Mesh)
    return mesh_axes_size(mesh, spec[0])[1]


def _is_spec(x: object) -> bool:
    return isinstance(x, PartitionSpec)


def is_callable_partition(param_partition: object) -> bool:
    """Return whether `param_partition` is the callable form `(path, leaf) -> spec`.

    A callable PyTree with `PartitionSpec` leaves (e.g. `jax.tree.map(lambda _: P(),
    model)` for an `eqx.Module` with `__call__`) is the tree form, not the callable.
    """
    if not callable(param_partition) or isinstance(param_partition, PartitionSpec):
        return False
    leaves = jax.tree_util.tree_leaves(param_partition, is_leaf=_is_spec)
    return not any(isinstance(x, PartitionSpec) for x in leaves)


def resolve_param_specs(
    param_partition: PartitionTree, params: Params, mesh: Mesh
) -> tuple[PartitionSpec, ...]:
    """Return one `PartitionSpec` per array leaf of `params` (before the rank rule).

    Args:
        param_partition: None (every parameter replicated), a prefix tree of
            `PartitionSpec` (see `resolve_specs`), or a callable `(path: str, leaf) ->
            PartitionSpec` (see `is_callable_partition`).
        params: the model's array part.
        mesh: the mesh whose axis names the specs may use.

    Raises:
        TypeError: if the callable returns something other than a `PartitionSpec`.
        ValueError: if a spec names a mesh axis that `mesh` does not have, or the
            tree does not match `params` (see `resolve_specs`).
    """
    with_path = jax.tree_util.tree_flatten_with_path(params)[0]
    if param_partition is None:
        replicated = PartitionSpec()
        return tuple(replicated for _ in with_path)
    if is_callable_partition(param_partition):
        specs: list[PartitionSpec] = []
        axes = set(mesh.axis_names)
        for path, leaf in with_path:
            spec = param_partition(path_str(path), leaf)
            if not isinstance(spec, PartitionSpec):
                raise TypeError(
                    "`MethodRunner.create(param_partition=fn)`: fn must return a "
                    f"`PartitionSpec`, got {type(spec).__name__} for parameter "
                    f"{path_str(path)!r}."
                )
            unknown = unknown_axes(spec, axes)
            if unknown:
                raise_unknown_axes(
                    spec, unknown, mesh, what="param_partition", path=path_str(path)
                )
            specs.append(spec)
        return tuple(specs)
    return tuple(resolve_specs(param_partition, params, mesh, what="param_partition"))

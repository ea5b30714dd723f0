"""Partition specs, host-local -> global arrays, resharding and host transfer.

Follows AXLearn's `DataPartitionType`, `data_partition_type_to_spec`,
`host_to_global_device_array` and `reshard_fn` (`axlearn/common/utils.py`), on top of
`jax.make_array_from_process_local_data` and `jax.sharding.NamedSharding`.
"""

import enum
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec


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


def leaf_spec(spec: PartitionSpec, ndim: int, *, explicit: bool) -> PartitionSpec:
    """Return the spec used for a leaf of rank `ndim` (AXLearn's `reshard_fn` rule).

    Rank-0 leaves are replicated; rank-1 leaves take only the first entry of `spec`;
    others take `spec` as it is. The result is then put in the form JAX gives the
    outputs of a jitted function (see `normalize_spec`).
    """
    if ndim == 0:
        return PartitionSpec()
    if ndim == 1 and len(spec) > 1:
        spec = PartitionSpec(spec[0])
    return normalize_spec(spec, ndim, explicit=explicit)


def normalize_spec(spec: PartitionSpec, ndim: int, *, explicit: bool) -> PartitionSpec:
    """Return `spec` in the form JAX gives jit outputs on this kind of mesh.

    `P("data")` and `P("data", None)` mean the same but differ as shardings (and so
    as jit cache keys). On Explicit meshes JAX pads specs with None to the rank; on
    Auto meshes it drops trailing Nones. Using the same form for inputs keeps a
    runner's key and chained batches on one compiled program.
    """
    entries = list(spec)
    if explicit:
        entries += [None] * (ndim - len(entries))
    else:
        while entries and entries[-1] is None:
            entries.pop()
    return PartitionSpec(*entries)


def _is_partition_leaf(x: object) -> bool:
    return x is None or isinstance(x, (PartitionSpec, DataPartition))


def resolve_specs(
    partition: Any, tree: Any, mesh: Mesh, *, what: str
) -> list[PartitionSpec]:
    """Return one `PartitionSpec` per leaf of `tree` (before the rank rule).

    Args:
        partition: a `DataPartition`, a `PartitionSpec`, or a prefix tree of them
            (None means replicated).
        tree: the PyTree whose leaves get specs.
        mesh: the mesh that `DataPartition`s are resolved on.
        what: the argument name, for error messages.

    Raises:
        ValueError: if `partition` is not a prefix of `tree`'s structure, or for
            `DataPartition.BATCH` on a mesh without data-like axes.
    """
    try:
        full = jax.tree.broadcast(partition, tree, is_leaf=_is_partition_leaf)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"`MethodRunner({what}=...)`: the partition tree does not match the "
            f"structure of the batch: {e}. Pass one `DataPartition`/`PartitionSpec` "
            "for the whole batch, or a tree of them that is a prefix of the batch "
            f"(partition: {jax.tree.structure(partition, is_leaf=_is_partition_leaf)}"
            f"; batch: {jax.tree.structure(tree)})."
        ) from None
    specs: list[PartitionSpec] = []
    for p in jax.tree.leaves(full, is_leaf=_is_partition_leaf):
        if p is None:
            specs.append(PartitionSpec())
        elif isinstance(p, DataPartition):
            specs.append(data_partition_spec(p, mesh))
        elif isinstance(p, PartitionSpec):
            specs.append(p)
        else:
            raise TypeError(
                f"`MethodRunner({what}=...)`: expected `DataPartition`, "
                f"`PartitionSpec` or None leaves, got {type(p).__name__}."
            )
    return specs


@functools.lru_cache(maxsize=4096)
def named_sharding(mesh: Mesh, spec: PartitionSpec) -> NamedSharding:
    """Return `NamedSharding(mesh, spec)`, cached so that equal inputs share it."""
    return NamedSharding(mesh, spec)


def mesh_axes_size(mesh: Mesh, entry: Any) -> tuple[tuple[str, ...], int]:
    """Return the axis names of one spec entry and the number of shards they make."""
    if entry is None:
        return (), 1
    names = tuple(entry) if isinstance(entry, tuple) else (entry,)
    size = 1
    for n in names:
        size *= int(mesh.shape[n])
    return tuple(str(n) for n in names), size


def check_divisible(
    shape: Sequence[int], spec: PartitionSpec, mesh: Mesh, *, path: str
) -> None:
    """Raise `ValueError` if a dimension of `shape` does not divide over its axes.

    Raises:
        ValueError: naming `path`, `shape` and the mesh axes; also if `spec` has more
            entries than `shape` has dimensions.
    """
    if len(spec) > len(shape):
        raise ValueError(
            f"Leaf {path!r} of shape {tuple(shape)} has rank {len(shape)} but its "
            f"partition spec {spec} has {len(spec)} entries; pass a spec with at most "
            "one entry per dimension."
        )
    for dim, entry in enumerate(spec):
        names, size = mesh_axes_size(mesh, entry)
        if shape[dim] % size:
            raise ValueError(
                f"Leaf {path!r} of shape {tuple(shape)}: dimension {dim} (size "
                f"{shape[dim]}) is split over mesh axes {names} of total size {size} "
                f"(mesh {dict(mesh.shape)}), which does not divide it. Use a batch "
                f"size divisible by {size}, or another partition for this leaf."
            )


def to_global(x: Any, sharding: NamedSharding, *, path: str) -> jax.Array:
    """Return `x` as a global array with `sharding`.

    Host-local leaves (NumPy arrays, Python scalars, arrays addressable by this process
    alone in a multi-process run) go through `jax.make_array_from_process_local_data`:
    in a multi-process run each process passes its own slice of the batch. Global
    arrays with another sharding are resharded with `jax.device_put`.

    Raises:
        ValueError: if a dimension does not divide over the mesh axes of its spec.
    """
    mesh = sharding.mesh
    assert isinstance(mesh, Mesh)
    spec = sharding.spec
    if isinstance(x, jax.Array) and (
        jax.process_count() == 1 or not x.is_fully_addressable
    ):
        check_divisible(x.shape, spec, mesh, path=path)
        return jax.device_put(x, sharding)
    local = np.asarray(x)
    global_shape = _global_shape(local.shape, sharding, path=path)
    check_divisible(global_shape, spec, mesh, path=path)
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


def _global_shape(
    local: tuple[int, ...], sharding: NamedSharding, *, path: str
) -> tuple[int, ...]:
    """Return the global shape of process-local data (this process's slice).

    Raises:
        ValueError: if a sharded dimension does not divide over this process's devices.
    """
    if jax.process_count() == 1:
        return local
    mesh = sharding.mesh
    assert isinstance(mesh, Mesh)
    shape = list(local)
    for dim, entry in enumerate(sharding.spec):
        if dim < len(shape) and entry is not None:
            names, total = mesh_axes_size(mesh, entry)
            mine = _local_slices(mesh, names)
            if local[dim] % mine:
                raise ValueError(
                    f"Host-local leaf {path!r} of shape {local}: dimension {dim} "
                    f"(size {local[dim]}) is split over mesh axes {names}, of which "
                    f"this process holds {mine} slices; it does not divide. Feed "
                    f"each process a batch divisible by {mine}."
                )
            shape[dim] = local[dim] * total // mine
    return tuple(shape)


@functools.lru_cache(maxsize=256)
def _local_slices(mesh: Mesh, names: tuple[str, ...]) -> int:
    """Return how many of the slices over mesh axes `names` this process holds."""
    me = jax.process_index()
    is_local = np.vectorize(lambda d: d.process_index == me, otypes=[bool])(
        mesh.devices
    )
    count = 1
    for name in names:
        axis = list(mesh.axis_names).index(name)
        others = tuple(i for i in range(is_local.ndim) if i != axis)
        count *= int(np.any(is_local, axis=others).sum())
    return count


def constrain(x: Any, sharding: NamedSharding, *, explicit: bool) -> Any:
    """Constrain a traced array to `sharding`.

    On meshes with Explicit axes `jax.lax.with_sharding_constraint` only asserts, so
    this uses `jax.sharding.reshard`, which moves the data.
    """
    if not isinstance(x, jax.Array):
        return x
    if explicit:
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def to_host(tree: Any, *, gather: bool = True) -> Any:
    """Fetch the arrays of `tree` to the host as NumPy arrays.

    Never reads data that this process cannot address: replicated arrays are read from
    one local shard; arrays split over several processes are all-gathered across
    processes (`jax.experimental.multihost_utils.process_allgather`), or, with
    `gather=False`, reduced to this process's addressable part (its slice of the
    batch, `multihost_utils.global_array_to_host_local_array`). In a single-process
    run both give the whole array. Other leaves are returned as they are.

    Args:
        tree: a PyTree (for example a `MethodRunner.Output`).
        gather: whether sharded arrays are gathered from all processes (a collective:
            every process must call `to_host` on the same arrays).

    Returns:
        A PyTree of the same structure with NumPy arrays for JAX arrays.

    Examples:
        >>> to_host({"x": jax.numpy.arange(3)})
        {'x': array([0, 1, 2], dtype=int32)}
    """

    def fetch(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        if x.is_fully_addressable:
            return np.asarray(x)
        if gather:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        sharding = x.sharding
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            local = multihost_utils.global_array_to_host_local_array(
                x, sharding.mesh, sharding.spec
            )
            return np.asarray(local)
        raise ValueError(
            "`to_host(gather=False)`: cannot take the process-local part of an array "
            f"with sharding {sharding}; pass `gather=True`."
        )

    return jax.tree.map(fetch, tree)

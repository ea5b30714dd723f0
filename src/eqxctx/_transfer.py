"""Moving arrays: host-local -> global arrays, constraints in a trace, global -> host.

Follows AXLearn's `host_to_global_device_array` (`axlearn/common/utils.py`), on top of
`jax.make_array_from_process_local_data`, `jax.sharding.reshard` and
`jax.experimental.multihost_utils`.
"""

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.core import Tracer
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._partition import (
    check_divisible,
    is_explicit,
    leaf_shardings,
    mesh_axes_size,
    named_sharding,
    normalize_spec,
    path_str,
    resolve_specs,
)
from ._typing import ArrayLeaf, KeyPath, Leaf, PartitionTree, Tree


REPLICATED = PartitionSpec()


def passes(x: ArrayLeaf, sharding: NamedSharding) -> bool:
    """Return whether `x` is a global array already placed as `sharding` says.

    A `NamedSharding` equivalent to `sharding` for `x`'s rank passes too
    (`Sharding.is_equivalent_to`): `P("data")` and `P("data", None)` lay a rank-2
    array out the same way, so it is never copied. An array on one device (a
    `SingleDeviceSharding`, committed or not) does not pass even on a one-device
    mesh, where it is equivalent: `jax.jit` traces it as another signature than the
    mesh's arrays (the step's outputs), so it is `jax.device_put`, which shares its
    buffer.
    """
    if not isinstance(x, jax.Array) or isinstance(x, Tracer):
        return False
    s = x.sharding
    return s == sharding or (
        isinstance(s, NamedSharding) and s.is_equivalent_to(sharding, x.ndim)
    )


def _is_exactly(x: ArrayLeaf, sharding: NamedSharding) -> bool:
    """Return whether `x` is a committed global array with the sharding `sharding`."""
    return isinstance(x, jax.Array) and x.committed and x.sharding == sharding


def place(
    leaves: Sequence[ArrayLeaf],
    shardings: Sequence[NamedSharding],
    *,
    paths: Callable[[], list[str]],
    process_local: bool,
    exact: bool = False,
) -> list[jax.Array]:
    """Return each leaf as a global array with its sharding: the one placement rule.

    Used for batches (`MethodRunner.__call__`, `CompiledRunner`) and parameters
    (`MethodRunner.create`). A leaf that `passes` is returned as it is (the same
    buffers); tracers are returned as they are (the step constrains them). Other
    leaves are placed: with `process_local`, by `to_global` (each process passes its
    own slice, `jax.make_array_from_process_local_data`); without (parameters, the
    same global value on every process), by `jax.device_put`.

    Args:
        leaves: the leaves (arrays, NumPy arrays, Python scalars, tracers).
        shardings: one sharding per leaf.
        paths: returns the leaves' paths (`"a/b/0"`), called only for a leaf that
            has to be placed (computing paths costs Python work per leaf).
        process_local: whether host-local leaves are process-local slices.
        exact: a leaf passes only with a sharding equal to its one (committed),
            not merely equivalent; others are `jax.device_put` (which shares the
            buffers of an equivalent one). For what a step returns and is given
            back (the runner's key) and what it is given on every call (its
            parameters): an uncommitted array, or one on a device or another
            spelling of the sharding, is another `jax.jit` cache entry than the
            step's output (a one-device mesh traced its step twice).

    Raises:
        TypeError, ValueError: see `to_global`, naming the leaf.
    """
    out: list[jax.Array] = []
    for i, (x, s) in enumerate(zip(leaves, shardings, strict=True)):
        if isinstance(x, Tracer) or (_is_exactly(x, s) if exact else passes(x, s)):
            out.append(x)
        elif not process_local:
            out.append(jax.device_put(x, s))
        else:
            try:
                out.append(to_global(x, s, path=None))
            except (TypeError, ValueError):
                # Again with the leaf's name (paths cost Python work per leaf).
                to_global(x, s, path=paths()[i])
                raise
    return out


def constrain_leaves(
    leaves: Sequence[jax.Array], shardings: Sequence[NamedSharding], *, explicit: bool
) -> list[jax.Array]:
    """Constrain each traced array to its sharding (see `constrain`)."""
    return [
        constrain(x, s, explicit=explicit)
        for x, s in zip(leaves, shardings, strict=True)
    ]


def to_global(x: ArrayLeaf, sharding: NamedSharding, *, path: str | None) -> jax.Array:
    """Return `x` as a global array with `sharding`.

    Host-local leaves (NumPy arrays, Python scalars, arrays addressable by this process
    alone in a multi-process run) go through `jax.make_array_from_process_local_data`:
    in a multi-process run each process passes its own slice of the batch. Global
    arrays with another sharding are resharded with `jax.device_put`.

    Args:
        x: the leaf.
        sharding: its sharding.
        path: the leaf's path, for messages; None for the fast path of a
            single-process NumPy array, which leaves the checks to JAX (it raises
            for a dimension that does not divide or a non-numeric dtype; the caller
            calls again with the path for the message).

    Raises:
        ValueError: if a dimension does not divide over the mesh axes of its spec.
        TypeError: if `x` is a `jax.ShapeDtypeStruct` (use `MethodRunner.lower`) or
            not an array (e.g. a container that is not a registered PyTree).
    """
    if (
        path is None
        and type(x) is np.ndarray
        and x.dtype.kind not in "OUSMmV"
        and jax.process_count() == 1
    ):
        # One process: the local data is the global array. `jax.device_put` places
        # it as `make_array_from_process_local_data` would, ~6 µs faster.
        return jax.device_put(x, sharding)
    path = "a leaf" if path is None else path
    if isinstance(x, jax.ShapeDtypeStruct):
        raise TypeError(
            f"`MethodRunner`: batch leaf {path!r} is a `jax.ShapeDtypeStruct`; a call "
            "needs arrays. To compile ahead of time for a batch signature, use "
            "`runner.lower(batch_spec).compile()`."
        )
    mesh = sharding.mesh
    assert isinstance(mesh, Mesh)
    spec = sharding.spec
    if isinstance(x, jax.Array) and (
        jax.process_count() == 1 or not x.is_fully_addressable
    ):
        check_divisible(x.shape, spec, mesh, path=path)
        return jax.device_put(x, sharding)
    local = np.asarray(x)
    if local.dtype.kind in "OUSMm":  # objects, strings, bytes, datetimes
        raise TypeError(
            f"`MethodRunner`: batch leaf {path!r} is a {type(x).__name__}, not an "
            "array. Pass arrays (NumPy or JAX), or register its type as a PyTree "
            "(`jax.tree_util.register_pytree_node`) so that its arrays are leaves."
        )
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


def constrain(x: Leaf, sharding: NamedSharding, *, explicit: bool) -> Leaf:
    """Constrain a traced array to `sharding`.

    On meshes with Explicit axes `jax.lax.with_sharding_constraint` only asserts, so
    this uses `jax.sharding.reshard`, which moves the data.
    """
    if not isinstance(x, jax.Array):
        return x
    if explicit:
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def constrain_tree(
    tree: PyTree, partition: PartitionTree, mesh: Mesh, *, what: str, kind: str
) -> PyTree:
    """Constrain every array of `tree` by `partition` (with the rank rule).

    Runs at trace time. Checks that each leaf's dimensions divide over their mesh
    axes (`kind` is "batch" or "output", for the message): on Auto meshes JAX would
    silently replicate a leaf that does not divide, on Explicit meshes its error
    names no leaf.
    """
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    specs = resolve_specs(partition, tree, mesh, what=what)
    arrays = [i for i, (_, x) in enumerate(with_path) if isinstance(x, jax.Array)]
    shardings = leaf_shardings(
        [specs[i] for i in arrays], [with_path[i] for i in arrays], mesh, kind=kind
    )
    leaves = [x for _, x in with_path]
    placed = constrain_leaves(
        [leaves[i] for i in arrays], shardings, explicit=is_explicit(mesh)
    )
    for i, x in zip(arrays, placed, strict=True):
        leaves[i] = x
    return treedef.unflatten(leaves)


def replicate_tree(tree: Tree, mesh: Mesh) -> Tree:
    """Constrain every array of `tree` to be replicated over `mesh` (traced)."""
    explicit = is_explicit(mesh)
    return jax.tree.map(
        lambda x: constrain(x, replicated(mesh, x), explicit=explicit), tree
    )


def replicated(mesh: Mesh, x: ArrayLeaf) -> NamedSharding:
    """The replicated sharding of `x` on `mesh`, in JAX's form for its rank."""
    return named_sharding(
        mesh, normalize_spec(REPLICATED, np.ndim(x), explicit=is_explicit(mesh))
    )


def _is_key_array(x: jax.Array) -> bool:
    return bool(jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key))


def to_host(tree: PyTree, *, gather: bool = True) -> PyTree:
    """Fetch the arrays of `tree` to the host as NumPy arrays.

    Never reads data that this process cannot address: replicated arrays are read from
    one local shard; arrays split over several processes are all-gathered across
    processes (`jax.experimental.multihost_utils.process_allgather`), or, with
    `gather=False`, reduced to this process's addressable part (its slice of the
    batch, `multihost_utils.global_array_to_host_local_array`). In a single-process
    run both give the whole array. Other leaves are returned as they are.

    Typed PRNG keys (`jax.random.key`) have no NumPy dtype: they are returned as
    their raw key data, `jax.random.key_data(key)` as a NumPy `uint32` array of shape
    `[*key.shape, 2]` for the default implementation (`jax.random.wrap_key_data`
    turns it back into a key).

    Args:
        tree: a PyTree (for example a `MethodRunner.Output`).
        gather: whether sharded arrays are gathered from all processes (a collective:
            every process must call `to_host` on the same arrays).

    Returns:
        A PyTree of the same structure with NumPy arrays for JAX arrays.

    Raises:
        ValueError: with `gather=False`, for an array split over processes whose
            sharding is not a `NamedSharding` (the message names its path).

    Examples:
        >>> to_host({"x": jax.numpy.arange(3)})
        {'x': array([0, 1, 2], dtype=int32)}
        >>> to_host(jax.random.key(0))
        array([0, 0], dtype=uint32)
    """

    def fetch(path: KeyPath, x: Leaf) -> Leaf:
        if not isinstance(x, jax.Array):
            return x
        if _is_key_array(x):
            x = jax.random.key_data(x)
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
            f"`to_host(gather=False)`: cannot take the process-local part of the array "
            f"at {path_str(path)!r} with sharding {sharding}; pass `gather=True`."
        )

    return jax.tree_util.tree_map_with_path(fetch, tree)

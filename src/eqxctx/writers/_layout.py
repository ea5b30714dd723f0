"""One structure of a `SummaryBuffer`'s summaries: its leaves and packed arrays."""

from collections.abc import Mapping
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from eqxctx._collection import OutputCollection
from eqxctx._mapping import FrozenMapping
from eqxctx._typing import ArrayTree, DType, Leaf, TreeDef


#: The dtypes whose leaves share one packed array per structure: XLA concatenates
#: them exactly on every backend. bfloat16 and 8-bit floats (on a TPU, XLA flushed
#: bfloat16 subnormals and canonicalized NaN payloads in a concatenation; see
#: `_fetch._BITS`), sub-byte integers and extended dtypes (keys) keep one array
#: per leaf, `[N, *shape]`.
_PACKED = frozenset(
    np.dtype(t)
    for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64,
        np.uint8, np.uint16, np.uint32, np.uint64,
        np.float16, np.float32, np.float64, np.complex64, np.complex128,
    )
)  # fmt: skip


class Pack(NamedTuple):
    """One array of a structure's rows: the array leaves it holds.

    Attributes:
        dtype: the array's dtype (that of its leaves).
        packed: True: a `[N, K]` array of the leaves raveled side by side; False:
            one leaf stacked as it is, `[N, *shape]`.
        members: `(j, start, stop, shape)` per leaf: its index among the
            structure's array leaves, its columns `start:stop` (of a packed
            array), its shape.
    """

    dtype: DType
    packed: bool
    members: tuple[tuple[int, int, int, tuple[int, ...]], ...]

    @property
    def width(self) -> int:
        """K: the number of columns of a packed array."""
        return self.members[-1][2] if self.members else 0


def packs(specs: list[tuple[tuple[int, ...], DType]]) -> tuple[Pack, ...]:
    """The arrays holding the array leaves of `specs` (`(shape, dtype)` each).

    One per dtype of `_PACKED` and one per other leaf, in the order of their
    first leaf.
    """
    groups: dict[object, list[int]] = {}
    for j, (_, dtype) in enumerate(specs):
        groups.setdefault(dtype if dtype in _PACKED else ("alone", j), []).append(j)
    packs: list[Pack] = []
    for key, members in groups.items():
        dtype = specs[members[0]][1]
        start, items = 0, []
        for j in members:
            shape = specs[j][0]
            stop = start + int(np.prod(shape, dtype=np.int64))
            items.append((j, start, stop, shape))
            start = stop
        packs.append(Pack(dtype, not isinstance(key, tuple), tuple(items)))
    return tuple(packs)


class Layout(NamedTuple):
    """One structure of summaries: the treedef and, per leaf, what it is.

    `leaves[j]` is `(shape, dtype)` for an array or a Python number (stacked as a
    row) or `(type, value)` for another (hashable) leaf, which is static. `packs`
    says which of the structure's arrays holds each array leaf.
    """

    treedef: TreeDef
    leaves: tuple[tuple[Any, Any], ...]
    arrays: tuple[bool, ...]
    packs: tuple[Pack, ...]

    def row_leaves(self, rows: list[Any]) -> list[Any]:
        """The leaves of one row, in `treedef`'s order: its arrays, the static ones."""
        it = iter(rows)
        return [
            next(it) if is_array else value
            for (_, value), is_array in zip(self.leaves, self.arrays, strict=True)
        ]

    def rebuild(self, rows: list[Any]) -> ArrayTree:
        """The summaries of one row: the row's arrays and the static numbers."""
        return self.treedef.unflatten(self.row_leaves(rows))

    def unpack(self, arrays: "list[Any] | tuple[Any, ...]", size: int) -> list[Any]:
        """Each array leaf stacked `[size, *shape]`, from the structure's arrays.

        Works on NumPy arrays (views: column slices of a packed array, reshaped)
        and on JAX arrays (slices).
        """
        out: list[Any] = [None] * sum(self.arrays)
        for pack, x in zip(self.packs, arrays, strict=True):
            if not pack.packed:
                out[pack.members[0][0]] = x
                continue
            for j, start, stop, shape in pack.members:
                out[j] = x[:, start:stop].reshape(size, *shape)
        return out


def is_stacked(x: object) -> bool:
    """Whether `x` is stacked: an array, an abstract one (`like=`), a Python number.

    (Python numbers are arrays in a jitted function's outputs and `jax.eval_shape`'s.)
    """
    return eqx.is_array(x) or isinstance(x, (jax.ShapeDtypeStruct, bool, int, float))


def like_trees(summaries: object) -> object:
    """The summaries' tree, as `summary_tree` lays it out, without checking it.

    For `SummaryBuffer.create(like=...)`, whose leaves may be abstract
    (`jax.eval_shape`'s): mappings become `FrozenMapping`s and each
    `OutputCollection` its summaries.
    """
    if isinstance(summaries, OutputCollection):
        return summaries.summaries
    if isinstance(summaries, FrozenMapping) and not any(
        isinstance(v, OutputCollection) for _, v in summaries.items_list()
    ):
        return summaries
    if isinstance(summaries, Mapping):
        return FrozenMapping([(k, like_trees(v)) for k, v in summaries.items()])
    return summaries


def layout_of(tree: object, where: str) -> tuple[Layout, list[Leaf]]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    specs: list[tuple[Any, Any]] = []
    arrays: list[bool] = []
    for x in leaves:
        if is_stacked(x):
            dtype = x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype
            specs.append((tuple(np.shape(x)), np.dtype(dtype)))
            arrays.append(True)
        else:
            try:
                hash(x)
            except TypeError:
                raise TypeError(
                    f"`{where}`: a summary leaf of type {type(x).__name__} is neither "
                    "an array nor a hashable number; make it an array."
                ) from None
            specs.append((type(x), x))
            arrays.append(False)
    packed = packs([spec for spec, a in zip(specs, arrays, strict=True) if a])
    return Layout(treedef, tuple(specs), tuple(arrays), packed), leaves


def shapes(layout: Layout, size: int) -> list[tuple[int, ...]]:
    """The shape of each of the structure's arrays in a buffer of `size` rows."""
    return [
        (size, pack.width) if pack.packed else (size, *pack.members[0][3])
        for pack in layout.packs
    ]


def zeros(layout: Layout, size: int) -> tuple[Array, ...]:
    return tuple(
        jnp.zeros(shape, pack.dtype)
        for shape, pack in zip(shapes(layout, size), layout.packs, strict=True)
    )


def packed_row(pack: Pack, arrays: list[Any]) -> Array:
    """One row of `pack`'s array: its leaves (of one step) raveled side by side."""
    if not pack.packed:
        return jnp.asarray(arrays[pack.members[0][0]], pack.dtype)
    parts = [jnp.ravel(jnp.asarray(arrays[j], pack.dtype)) for j, *_ in pack.members]
    return parts[0] if len(parts) == 1 else jnp.concatenate(replicated(parts))


def replicated(arrays: list[Array]) -> list[Array]:
    """`arrays`, replicated on the mesh one of them is typed on, if any.

    Under Explicit mesh axes an array's type holds its mesh and sharding, and
    `concatenate` / `dynamic_update_slice` need operands typed alike: summaries
    of a batch sharded over the mesh next to replicated ones, or the buffer's
    zeros (made on one device), would raise JAX's `ShardingTypeError`. A buffer's
    rows are small: they are replicated. (Under Auto axes, types hold no mesh.)
    """
    meshes = [jax.typeof(x).sharding.mesh for x in arrays]
    mesh = next((m for m in meshes if not m.empty), None)
    if mesh is None:
        return arrays
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return [
        x
        if m == mesh and all(p is None for p in jax.typeof(x).sharding.spec)
        else jax.sharding.reshard(x, whole)
        for x, m in zip(arrays, meshes, strict=True)
    ]


def step_dtype() -> DType:
    """int32, or int64 where 64-bit types are on (`jax_enable_x64`)."""
    return jnp.zeros((), int).dtype

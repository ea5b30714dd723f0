"""How a runner places and pads batches: `BatchPlan`, padding, the rows mask.

A `BatchPlan` is what `Step.call` knows about batches of one structure and leaf
ranks: each leaf's sharding (the input partition and AXLearn's rank rule), what the
fast path compares, the batch axis' shard count (padded sizes are multiples of it) and
the mask's sharding. Padding (`pad_batches`, `batch_sizes`) appends zero rows on the
host; `unpad` cuts the outputs back.
"""

import functools
import math
import operator
from collections.abc import Callable, Hashable
from typing import NamedTuple, TypeAlias

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._partition import batch_shards, is_explicit, named_sharding, path_str
from ._transfer import REPLICATED, constrain, replicated
from ._typing import ArrayLeaf, Batch, KeyPath, TreeDef


# What `MethodRunner.__call__` compares of each batch leaf with the last batch's: the
# type (a `jax.Array` subclass, not a PyTree with a `.sharding`), the sharding, and the
# rank where the rank rule makes it matter. Read in C by `map`.
_SIGNATURE = operator.attrgetter("__class__", "sharding")
_SIGNATURE_WITH_RANK = operator.attrgetter("__class__", "sharding", "ndim")
# With padding or a mask the batch size matters too.
_SIGNATURE_WITH_SHAPE = operator.attrgetter("__class__", "sharding", "shape")

#: What `signature` reads of a leaf: `(type, sharding[, ndim | shape])`.
Signature: TypeAlias = tuple[object, ...]

#: The rows mask passed as `mask_kwarg`: `bool[padded_batch]` (NumPy inside a trace).
Mask: TypeAlias = jax.Array | np.ndarray

#: A key of a plain-dict batch (any hashable JAX sorts).
DictKeyName: TypeAlias = Hashable


class BatchPlan:
    """How batches of one structure and leaf ranks are placed (`Step.plans`).

    Attributes:
        treedef: the batch's structure.
        ranks: each leaf's rank.
        shardings: each leaf's sharding (the input partition, the rank rule).
        dict_keys: for a plain dict whose values are all leaves, its keys in leaf
            order (such a batch is checked without flattening it); else None.
        dict_values: with non-empty `dict_keys`, `operator.itemgetter(*dict_keys)`:
            the values of such a dict in leaf order (a tuple, or the one value).
        signature: what `Step.call` compares of each leaf (`_SIGNATURE...`).
        multiple: the padded batch size is a multiple of this (the number of shards
            of the batch axis).
        mask_sharding: the sharding of the mask (`mask_kwarg`).
        expected: `signature` of each leaf of the last batch placed by this plan.
        mask: the mask that goes with a batch matching `expected`.
        lowered_rows: the batch size of a lowered plan (`CompiledRunner`).
    """

    __slots__ = (
        "dict_keys",
        "dict_values",
        "expected",
        "lowered_rows",
        "mask",
        "mask_sharding",
        "multiple",
        "ranks",
        "shardings",
        "signature",
        "treedef",
    )

    def __init__(
        self,
        treedef: TreeDef,
        ranks: tuple[int, ...],
        shardings: list[NamedSharding],
        dict_keys: tuple[DictKeyName, ...] | None,
        signature: Callable[[ArrayLeaf], Signature],
        multiple: int,
        mask_sharding: NamedSharding,
    ):
        self.treedef = treedef
        self.ranks = ranks
        self.shardings = shardings
        self.dict_keys = dict_keys
        # None for an empty dict too (`itemgetter()` needs a key): it is flattened.
        self.dict_values: Callable[[Batch], object] | None = (
            operator.itemgetter(*dict_keys) if dict_keys else None
        )
        self.signature = signature
        self.multiple = multiple
        self.mask_sharding = mask_sharding
        self.expected: list[Signature] | None = None
        self.mask: Mask | None = None
        self.lowered_rows: int | None = None


def flat_dict_keys(
    batch: PyTree, with_path: list[tuple[KeyPath, ArrayLeaf]]
) -> tuple[DictKeyName, ...] | None:
    """The keys of a plain dict whose values are all leaves, in leaf order; else None.

    Such a batch (AXLearn's usual input) is checked without flattening it: same keys,
    same shardings (`MethodRunner.__call__`).
    """
    if type(batch) is not dict or len(with_path) != len(batch):
        return None
    keys: list[DictKeyName] = []
    for path, _ in with_path:
        if len(path) != 1 or not isinstance(path[0], jax.tree_util.DictKey):
            return None
        keys.append(path[0].key)
    return tuple(keys)


def make_plan(
    leaves: list[ArrayLeaf],
    treedef: TreeDef,
    specs: list[PartitionSpec],
    shardings: list[NamedSharding],
    with_path: list[tuple[KeyPath, ArrayLeaf]],
    *,
    mesh: Mesh,
    by_shape: bool,
) -> BatchPlan:
    """Return the `BatchPlan` of leaves placed with `shardings`.

    Args:
        leaves: the batch's leaves (arrays, NumPy arrays, `ShapeDtypeStruct`s).
        treedef: their structure.
        specs: each leaf's spec before the rank rule.
        shardings: each leaf's sharding.
        with_path: `(key_path, leaf)` per leaf.
        mesh: the mesh.
        by_shape: compare shapes too on the fast path (padding or a mask).
    """
    ranks = tuple(map(np.ndim, leaves))
    if by_shape:
        signature = _SIGNATURE_WITH_SHAPE
    elif any(r < len(s) for r, s in zip(ranks, specs, strict=True)):
        # The rank rule maps a leaf of rank r < len(spec) to a shorter spec, whose
        # sharding an array of another rank can have too.
        signature = _SIGNATURE_WITH_RANK
    else:
        signature = _SIGNATURE
    multiple = 1
    mask_sharding = named_sharding(mesh, REPLICATED)
    first = True
    for r, s in zip(ranks, shardings, strict=True):
        if r:
            multiple = math.lcm(multiple, batch_shards(s))
            if first:
                spec = PartitionSpec(s.spec[0]) if len(s.spec) else REPLICATED
                mask_sharding = named_sharding(mesh, spec)
                first = False
    return BatchPlan(
        treedef,
        ranks,
        shardings,
        flat_dict_keys(treedef.unflatten(leaves), with_path),
        signature,
        multiple,
        mask_sharding,
    )


def padded_size(rows: int, plan: BatchPlan, batch_sizes: tuple[int, ...] | None) -> int:
    """Return the batch size that `rows` rows are padded to.

    Raises:
        ValueError: if `rows` is larger than every size of `batch_sizes` (or the
            lowered size), or a listed size does not divide over the devices.
    """
    sizes = batch_sizes
    if plan.lowered_rows is not None:
        sizes = (plan.lowered_rows,)
    elif sizes is None:
        return -(-rows // plan.multiple) * plan.multiple
    for size in sizes:
        if size >= rows:
            if size % plan.multiple:
                raise ValueError(
                    f"`MethodRunner(batch_sizes={sizes})`: the size {size} does "
                    f"not divide over the {plan.multiple} devices the batch is "
                    f"split over; list multiples of {plan.multiple}."
                )
            return size
    what = (
        "the batch size it was lowered for"
        if plan.lowered_rows is not None
        else f"the largest of `batch_sizes={sizes}`"
    )
    raise ValueError(
        f"`MethodRunner(pad_batches=True)`: a batch of {rows} rows is larger "
        f"than {what} ({sizes[-1]}); split it, or list a larger size."
    )


def unpad(tree: PyTree, padding: "Padding", mesh: Mesh) -> PyTree:
    """Cut every array leaf whose leading size is the padded one to the real rows.

    The cut arrays are replicated (a sharded array must divide over its devices).
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    where = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array) and x.ndim and x.shape[0] == padding.size
    ]
    if not where:
        return tree
    cut = _cut([leaves[i] for i in where], padding.rows, mesh)
    for i, x in zip(where, cut, strict=True):
        leaves[i] = x
    return treedef.unflatten(leaves)


class Padding(NamedTuple):
    """How a batch was padded: `rows` real rows, padded to `size`."""

    rows: int
    size: int


@functools.partial(jax.jit, static_argnums=(1, 2))
def _cut(leaves: list[jax.Array], rows: int, mesh: Mesh) -> list[jax.Array]:
    explicit = is_explicit(mesh)
    return [constrain(x, replicated(mesh, x), explicit=explicit)[:rows] for x in leaves]


def batch_rows(
    leaves: list[ArrayLeaf],
    treedef: TreeDef,
    ranks: tuple[int, ...],
    mask_kwarg: str | None,
) -> int | None:
    """Return the common leading size of the leaves of rank >= 1 (None: no such leaf).

    Raises:
        ValueError: if they differ (naming the leaves and their sizes), or if there
            is no such leaf and the runner passes a mask (`mask_kwarg`).
    """
    sizes = [np.shape(x)[0] for x, r in zip(leaves, ranks, strict=True) if r]
    if not sizes:
        if mask_kwarg is not None:  # the method would miss its mask argument
            raise ValueError(
                f"`MethodRunner(mask_kwarg={mask_kwarg!r})`: the batch has no leaf "
                "of rank >= 1, so no rows for the mask to cover. Give the batch's "
                "leaves their batch axis first, or make the runner without "
                "`mask_kwarg`."
            )
        return None
    if any(n != sizes[0] for n in sizes):
        with_path = jax.tree_util.tree_flatten_with_path(treedef.unflatten(leaves))[0]
        named = ", ".join(
            f"{path_str(p)!r}: {np.shape(x)[0]}" for p, x in with_path if np.ndim(x)
        )
        raise ValueError(
            "`MethodRunner(pad_batches=..., mask_kwarg=...)`: the batch's leaves "
            f"have different leading (batch) sizes ({named}); padding and the mask "
            "need one batch size. Give every leaf of rank >= 1 the batch axis first."
        )
    return int(sizes[0])


def pad_rows(x: ArrayLeaf, size: int) -> ArrayLeaf:
    """Return `x` with zero rows appended up to `size` rows (on the host if it can).

    A typed PRNG key array (per-example keys, `jax.random.key`) has no NumPy form:
    its key data (`jax.random.key_data`) is padded with zeros and wrapped again
    with its implementation, so the padded rows are the key of all-zero data.
    """
    if isinstance(x, jax.Array) and jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = pad_rows(jax.random.key_data(x), size)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    if isinstance(x, Tracer):
        widths = [(0, size - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
        return jax.numpy.pad(x, widths)
    local = np.asarray(x)
    zeros = np.zeros((size - local.shape[0], *local.shape[1:]), local.dtype)
    return np.concatenate([local, zeros])

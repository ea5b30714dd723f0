"""One process: fetch a write's arrays with one device-to-host transfer per width.

A write of a training step's summaries reads a few dozen small arrays. Reading them
one by one costs ~7 µs of Python per array (start each transfer with
`copy_to_host_async`, then `numpy.asarray`; `jax.device_get` costs ~12 µs); a
cached `jax.jit` that ravels and concatenates the small arrays costs one dispatch
(~10 µs) plus ~1.5 µs per array, and one transfer per output, split back into the
per-leaf arrays as NumPy views (measured on CPU, jax 0.10: 16 arrays, 112 vs 37 µs).
Integer and floating arrays travel as raw bits of their width (float32 and int32 in
one `uint32` array; `jax.lax.bitcast_convert_type`), so a step's summaries are
usually one transfer: on a TPU each device-to-host copy waits ~0.6 ms. The values
are the same bits (a concatenation and a bitcast copy them).
"""

from collections.abc import Callable, Hashable
from typing import NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from eqxctx._checks import is_jax_array_type
from eqxctx._typing import ArrayTree, DType


#: Arrays larger than this (elements) are fetched alone: batching them would copy
#: them once more on the device, for a per-array cost that no longer matters.
MAX_BATCHED_SIZE = 1 << 14

#: The most signatures kept (each batched one holds a compiled function); past it
#: the cache starts again.
MAX_PLANS = 64


class _Plan(NamedTuple):
    """How to fetch the arrays of one signature.

    Attributes:
        batched: the array positions (in the list of arrays) passed to `fn`.
        fn: the jitted function: the batched arrays -> one flat array per width
            (raw bits) or dtype.
        splits: per output of `fn`, `(position, start, stop, shape, dtype)` of each
            array (a view of the output's bits as `dtype`).
        alone: the array positions fetched one by one.
    """

    batched: tuple[int, ...]
    fn: Callable[[list[jax.Array]], list[jax.Array]]
    splits: tuple[tuple[tuple[int, int, int, tuple[int, ...], DType], ...], ...]
    alone: tuple[int, ...]


#: The shape, dtype and sharding of each array of a write.
_Signature: TypeAlias = tuple[tuple[tuple[int, ...], DType, jax.sharding.Sharding], ...]

#: signature (or the caller's key that determines it) -> the plan, or None once seen
#: (a plan is made at the second sighting, so a signature written once compiles
#: nothing).
_plans: dict[_Signature | Hashable, _Plan | None] = {}


def _batchable(
    x: jax.Array, sharding: jax.sharding.Sharding, bits: dict[DType, DType]
) -> bool:
    # Only dtypes that travel as raw bits, and bool: XLA may canonicalize the NaNs
    # of a float8 concatenation, and aborts on one of sub-byte integers (int2).
    return (
        x.size <= MAX_BATCHED_SIZE
        and x.sharding == sharding
        and (x.dtype in bits or x.dtype == np.bool_)
    )


#: Integer and floating dtypes sent as raw bits, by width: their arrays share one
#: transfer per width (float32 and int32 values in one `uint32` array), each read
#: back as a NumPy view of its own dtype. Bool arrays share one transfer as they
#: are; other dtypes (complex, 8-bit floats, sub-byte integers, keys) are fetched
#: array by array, and so is bfloat16: on a TPU, XLA flushed bfloat16 subnormals
#: and canonicalized NaN payloads in the concatenation, bitcast or not.
_BITS: dict[DType, DType] = {
    np.dtype(t): np.dtype(f"uint{8 * np.dtype(t).itemsize}")
    for t in (
        np.int8, np.int16, np.int32, np.int64,
        np.uint8, np.uint16, np.uint32, np.uint64,
        np.float16, np.float32, np.float64,
    )
}  # fmt: skip

#: `_BITS` where the arrays are on a TPU, which emulates float64: its bitcast to
#: uint64 gave other values, so float64 arrays are fetched array by array there.
_TPU_BITS = {k: v for k, v in _BITS.items() if k != np.float64}


def raw_bits(platform: str) -> dict[DType, DType]:
    """The dtypes sent as raw bits from arrays on `platform` ("cpu", "tpu", ...)."""
    return _TPU_BITS if platform == "tpu" else _BITS


def _make_plan(arrays: list[jax.Array]) -> _Plan | None:
    """The plan for `arrays`, or None where batching saves nothing (< 2 arrays)."""
    first = arrays[0].sharding
    # One sharding, replicated (one device, or every device holding the whole
    # array): the batched output is read from one device, as each array would be.
    if not first.is_fully_replicated:
        return None
    bits = raw_bits(next(iter(first.device_set)).platform)
    groups: dict[DType, list[int]] = {}
    for i, x in enumerate(arrays):
        if _batchable(x, first, bits):
            groups.setdefault(bits.get(x.dtype, x.dtype), []).append(i)
    batched = tuple(i for group in groups.values() for i in group)
    if len(batched) < 2:
        return None
    order = {i: k for k, i in enumerate(batched)}
    slots = [([order[i] for i in group], dtype) for dtype, group in groups.items()]

    def raw(x: jax.Array, dtype: DType) -> jax.Array:
        x = jnp.ravel(x)
        return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)

    def concatenate(xs: list[jax.Array]) -> list[jax.Array]:
        return [
            jnp.concatenate([raw(xs[k], dtype) for k in slot]) for slot, dtype in slots
        ]

    splits = []
    for group in groups.values():
        start, items = 0, []
        for i in group:
            shape = tuple(arrays[i].shape)
            stop = start + int(np.prod(shape, dtype=np.int64))
            items.append((i, start, stop, shape, np.dtype(arrays[i].dtype)))
            start = stop
        splits.append(tuple(items))
    alone = tuple(i for i in range(len(arrays)) if i not in order)
    return _Plan(batched, jax.jit(concatenate), tuple(splits), alone)


def _plan(arrays: list[jax.Array], signature: Hashable | None) -> _Plan | None:
    if signature is None:
        signature = tuple((x.shape, x.dtype, x.sharding) for x in arrays)
    if signature in _plans:
        plan = _plans[signature]
        if plan is None:  # the second sighting (or not batchable: made again, cheap)
            plan = _plans[signature] = _make_plan(arrays)
        return plan
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[signature] = None
    return None


def device_get(tree: ArrayTree) -> ArrayTree:
    """`jax.device_get(tree)` for one process: NumPy arrays, other leaves as they are.

    Small arrays with one replicated sharding are fetched in one transfer per width
    (from the second write of the same signature: shapes, dtypes, shardings); the
    others (large ones, typed PRNG keys, other shardings) each start their transfer
    (`copy_to_host_async`) and are read with `numpy.asarray`. Anything unusual is
    left to `jax.device_get` (and its errors, e.g. for a deleted array).
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef.unflatten(device_get_leaves(leaves))


def device_get_leaves(
    leaves: list[object], signature: Hashable | None = None
) -> list[object]:
    """`device_get` of a list of leaves (a new list).

    `signature`, where given, stands for the shapes, dtypes and shardings of the JAX
    arrays among `leaves` (equal signatures: equal ones), saving their look-up.
    """
    return finish(start(leaves, signature))


class Started(NamedTuple):
    """A fetch whose device-to-host copies have started (`start`; read by `finish`).

    Attributes:
        leaves: the leaves being fetched.
        where: the positions of their JAX arrays.
        plan: the batched plan, or None (each array copied alone).
        outs: the plan's outputs (their copies started), or None.
        failed: whether starting raised (`finish` then leaves it to
            `jax.device_get`, which raises JAX's own error).
    """

    leaves: list[object]
    where: list[int]
    plan: _Plan | None
    outs: list[jax.Array] | None
    failed: bool


def start(leaves: list[object], signature: Hashable | None = None) -> Started:
    """Start the device-to-host copies of `leaves` (see `device_get_leaves`).

    Never raises: an error is raised by `finish`.
    """
    where = [i for i, x in enumerate(leaves) if is_jax_array_type(type(x))]
    arrays: list[jax.Array] = [leaves[i] for i in where]  # pyright: ignore[reportAssignmentType]
    try:
        plan = _plan(arrays, signature) if len(arrays) > 1 else None
        outs = None
        if plan is None:
            for x in arrays:
                x.copy_to_host_async()
        else:
            outs = plan.fn([arrays[k] for k in plan.batched])
            for x in outs:  # the copies overlap (on an accelerator, each waits)
                x.copy_to_host_async()
            for k in plan.alone:
                arrays[k].copy_to_host_async()
    except Exception:  # anything unusual (e.g. a key array): JAX's own errors
        return Started(leaves, where, None, None, True)
    return Started(leaves, where, plan, outs, False)


def finish(started: Started) -> list[object]:
    """The fetched leaves of a `start`ed fetch (a new list).

    Raises:
        Exception: what `jax.device_get` raises for the leaves (e.g. a deleted
            array), where anything failed.
    """
    leaves, where, plan, outs, failed = started
    if not where:
        return list(leaves)
    arrays: list[jax.Array] = [leaves[i] for i in where]  # pyright: ignore[reportAssignmentType]
    try:
        if failed:
            raise RuntimeError  # read again by `jax.device_get`, below
        if plan is None or outs is None:
            host = [np.asarray(x) for x in arrays]
        else:
            host: list[np.ndarray | None] = [None] * len(arrays)
            for out, items in zip(outs, plan.splits, strict=True):
                flat = np.asarray(out)
                for k, begin, stop, shape, dtype in items:
                    part = flat[begin:stop]
                    if part.dtype != dtype:
                        part = part.view(dtype)
                    host[k] = part.reshape(shape)
            for k in plan.alone:
                host[k] = np.asarray(arrays[k])
    except Exception:  # anything unusual (e.g. a key array): JAX's own errors
        return jax.device_get(list(leaves))
    out = list(leaves)
    for i, value in zip(where, host, strict=True):
        out[i] = value
    return out

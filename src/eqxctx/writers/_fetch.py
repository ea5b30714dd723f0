"""One process: fetch a write's arrays with one device-to-host transfer per width.

A write reads a few dozen small arrays. A cached `jax.jit` ravels and concatenates
them, integer and floating arrays as raw bits of their width (float32 and int32 in
one `uint32` array; `jax.lax.bitcast_convert_type`), so a step's summaries are
usually one transfer, split back into per-leaf NumPy views with the same bits.
`benchmarks/README.md` has the costs against `jax.device_get`.
"""

from collections.abc import Callable, Hashable
from typing import NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from eqxctx._checks import is_jax_array_type
from eqxctx._typing import DType


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
        alone: the array positions fetched one by one (with `owned`, copied by
            `fn` too: its outputs after the batched ones, in this order).
        owned: whether `fn` copies every array (`start_owned`).
        zeros: the number of `fn`'s last outputs that are zeros (`start_owned`),
            not copies.
    """

    batched: tuple[int, ...]
    fn: Callable[[list[jax.Array]], list[jax.Array]]
    splits: tuple[tuple[tuple[int, int, int, tuple[int, ...], DType], ...], ...]
    alone: tuple[int, ...]
    owned: bool = False
    zeros: int = 0


#: The shape, dtype and sharding of each array of a write.
_Signature: TypeAlias = tuple[tuple[tuple[int, ...], DType, jax.sharding.Sharding], ...]

#: signature (or the caller's key that determines it) -> the plan, or None once seen
#: (a plan is made at the second sighting, so a signature written once compiles
#: nothing).
_plans: dict[_Signature | Hashable, _Plan | None] = {}


def _batchable(
    x: jax.Array,
    sharding: jax.sharding.Sharding,
    bits: dict[DType, DType],
    max_size: int,
) -> bool:
    # Only dtypes that travel as raw bits, and bool: XLA may canonicalize the NaNs
    # of a float8 concatenation, and aborts on one of sub-byte integers (int2).
    return (
        x.size <= max_size
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


def _make_plan(
    arrays: list[jax.Array],
    *,
    max_size: int | None = None,
    owned: bool = False,
    zeros: tuple[int, ...] = (),
) -> _Plan | None:
    """The plan for `arrays`, or None where batching saves nothing (< 2 arrays).

    `max_size`: the largest array batched (default `MAX_BATCHED_SIZE`). With
    `owned`, a plan is always made, with no size limit, and its function copies
    the arrays it does not batch, then returns `zeros_like` of each array of
    `zeros` (positions in `arrays`).
    """
    if max_size is None:
        max_size = MAX_BATCHED_SIZE
    first = arrays[0].sharding
    groups: dict[DType, list[int]] = {}
    # One sharding, replicated (one device, or every device holding the whole
    # array): the batched output is read from one device, as each array would be.
    if first.is_fully_replicated:
        bits = raw_bits(next(iter(first.device_set)).platform)
        for i, x in enumerate(arrays):
            if _batchable(x, first, bits, max_size):
                groups.setdefault(bits.get(x.dtype, x.dtype), []).append(i)
    elif not owned:
        return None
    batched = tuple(i for group in groups.values() for i in group)
    if len(batched) < 2 and not owned:
        return None
    order = {i: k for k, i in enumerate(batched)}
    slots = [([order[i] for i in group], dtype) for dtype, group in groups.items()]

    def raw(x: jax.Array, dtype: DType) -> jax.Array:
        x = jnp.ravel(x)
        return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)

    alone = tuple(i for i in range(len(arrays)) if i not in order)
    copied = [len(batched) + j for j in range(len(alone))] if owned else []
    inputs = batched + alone if owned else batched
    position = {i: j for j, i in enumerate(inputs)}
    zeroed = [position[i] for i in zeros]

    def concatenate(xs: list[jax.Array]) -> list[jax.Array]:
        return (
            [
                jnp.concatenate([raw(xs[k], dtype) for k in slot])
                for slot, dtype in slots
            ]
            + [jnp.copy(xs[k]) for k in copied]
            + [jnp.zeros_like(xs[k]) for k in zeroed]
        )

    splits = []
    for group in groups.values():
        start, items = 0, []
        for i in group:
            shape = tuple(arrays[i].shape)
            stop = start + int(np.prod(shape, dtype=np.int64))
            items.append((i, start, stop, shape, np.dtype(arrays[i].dtype)))
            start = stop
        splits.append(tuple(items))
    fn = jax.jit(concatenate)
    return _Plan(inputs, fn, tuple(splits), alone, owned, len(zeroed))


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


def device_get_leaves(
    leaves: list[object], signature: Hashable | None = None
) -> list[object]:
    """`jax.device_get(leaves)` for one process, as a new list.

    Small arrays with one replicated sharding are fetched in one transfer per width
    (from the second fetch of the same signature: shapes, dtypes, shardings); the
    others (large ones, typed PRNG keys, other shardings) each start their transfer
    (`copy_to_host_async`) and are read with `numpy.asarray`. Anything unusual is
    left to `jax.device_get` (and its errors, e.g. for a deleted array).
    `signature`, where given, stands for the shapes, dtypes and shardings of the JAX
    arrays among `leaves`, saving their look-up.
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


#: signature -> the plan of `start_owned` (made at the first sighting).
_owned_plans: dict[Hashable, _Plan | None] = {}


def start_owned(
    arrays: list[jax.Array], signature: Hashable, *, zeros: tuple[int, ...] = ()
) -> tuple[Started, list[jax.Array]]:
    """Start copying `arrays` to the host through copies that the fetch owns.

    One jitted call copies the arrays on the device (one flat array per width of
    raw bits, as `start`, whatever their size; the others copied alone) and starts
    the copies of its outputs to the host. `finish` reads those outputs with one
    `jax.device_get`, so the caller may donate or delete `arrays` as soon as this
    returns (a buffer carried through a donating step). `signature`: a hashable
    key for the shapes, dtypes and shardings of `arrays`. The same call makes
    `jnp.zeros_like(arrays[k])` for each `k` of `zeros` (the count of an emptied
    buffer: no device computation of its own).

    Returns:
        The started fetch, and the zeros.

    Never raises: an error is raised by `finish` (where starting failed, the
    arrays are read by `jax.device_get` here, before they can be donated).
    """
    leaves: list[object] = list(arrays)
    try:
        key = (signature, zeros)
        if key not in _owned_plans:
            if len(_owned_plans) >= MAX_PLANS:
                _owned_plans.clear()
            _owned_plans[key] = _make_plan(
                arrays, max_size=2**62, owned=True, zeros=zeros
            )
        plan = _owned_plans[key]
        if plan is None:
            raise RuntimeError  # (not made: read below)
        outs = plan.fn([arrays[k] for k in plan.batched])
        made = outs[len(outs) - plan.zeros :]
        outs = outs[: len(outs) - plan.zeros]
    except Exception:  # anything unusual: read now, JAX's own errors at `finish`
        try:
            made = [jnp.zeros_like(arrays[k]) for k in zeros]
        except Exception:  # (the caller makes its own)
            made = []
        try:
            return Started(jax.device_get(leaves), [], None, None, False), made
        except Exception:
            return Started(leaves, list(range(len(leaves))), None, None, True), made
    try:
        for x in outs:
            x.copy_to_host_async()
    except Exception:  # e.g. refused by a transfer guard: `finish`'s explicit
        pass  # `jax.device_get` of the copies reads them all the same
    return Started(leaves, list(range(len(leaves))), plan, outs, False), made


def _split(plan: _Plan, flats: list[np.ndarray], n: int) -> list[np.ndarray | None]:
    """The arrays of a plan's fetched outputs (NumPy views of their bits)."""
    host: list[np.ndarray | None] = [None] * n
    for flat, items in zip(flats, plan.splits, strict=False):
        for k, begin, stop, shape, dtype in items:
            part = flat[begin:stop]
            if part.dtype != dtype:
                part = part.view(dtype)
            host[k] = part.reshape(shape)
    if plan.owned:
        for k, copy in zip(plan.alone, flats[len(plan.splits) :], strict=True):
            host[k] = np.asarray(copy)
    return host


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
        elif plan.owned:
            host = _split(plan, jax.device_get(outs), len(arrays))
        else:
            host = _split(plan, [np.asarray(x) for x in outs], len(arrays))
            for k in plan.alone:
                host[k] = np.asarray(arrays[k])
    except Exception:  # anything unusual (e.g. a key array): JAX's own errors
        return jax.device_get(list(leaves))
    out = list(leaves)
    for i, value in zip(where, host, strict=True):
        out[i] = value
    return out

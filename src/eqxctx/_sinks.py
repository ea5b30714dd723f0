"""Values carried out of a program as cotangents of "sink" arrays, exactly.

Gradient probes (`ctx.add_gradient_summary`) and `eqxctx.capture` carry the values
they record out of scans as the cotangents of zero sink arrays, and cotangents are
floating point. A float value travels as it is; a bool as float32 0/1. An integer
(a `MomentsSummary`'s or `HistogramSummary`'s count words, a user's int summary)
would lose its low bits in float32 above 2**24, so it travels as its 16-bit pieces,
each exact in float32, along a trailing axis of the sink (`[..., bits // 16]`), and
is put back together bit for bit.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from ._typing import DType


def _pieces(dtype: DType) -> int:
    """How many 16-bit pieces an integer of `dtype` travels as (0: not split)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return max(1, dtype.itemsize // 2)
    return 0


def sink_layout(
    shape: tuple[int, ...], dtype: DType
) -> tuple[tuple[int, ...], jnp.dtype]:
    """The shape and dtype of the sink that carries values of `shape` and `dtype`.

    Raises:
        TypeError: for a dtype that is neither floating, integer nor bool.
    """
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return shape, dtype
    if jnp.issubdtype(dtype, jnp.bool_):
        return shape, jnp.dtype(jnp.float32)
    if jnp.issubdtype(dtype, jnp.integer):
        return (*shape, _pieces(dtype)), jnp.dtype(jnp.float32)
    raise TypeError(f"cannot record values of dtype {dtype}")


def _unsigned(dtype: jnp.dtype) -> jnp.dtype:
    return jnp.dtype(f"uint{8 * dtype.itemsize}")


def to_sink(value: ArrayLike, sink_dtype: DType) -> Array:
    """`value` in its sink's layout (see `sink_layout`)."""
    value = jnp.asarray(value)
    n = _pieces(value.dtype)
    if not n:
        return value.astype(sink_dtype)
    bits = jax.lax.bitcast_convert_type(value, _unsigned(value.dtype))
    if bits.dtype.itemsize < 2:
        bits = bits.astype(jnp.uint16)
    return jnp.stack(
        [((bits >> (16 * k)) & 0xFFFF).astype(sink_dtype) for k in range(n)], -1
    )


def from_sink(value: Array, dtype: DType) -> Array:
    """The values of `dtype` that `to_sink` laid out as `value` (bit for bit)."""
    dtype = jnp.dtype(dtype)
    n = _pieces(dtype)
    if not n:
        return value if value.dtype == dtype else value.astype(dtype)
    unsigned = _unsigned(dtype)
    wide = jnp.uint16 if unsigned.itemsize < 2 else unsigned
    bits = jnp.zeros(value.shape[:-1], wide)
    for k in range(n):
        bits = bits | (value[..., k].astype(wide) << (16 * k))
    return jax.lax.bitcast_convert_type(bits.astype(unsigned), dtype)

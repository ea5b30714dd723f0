"""Exact counts without x64: a count as two uint32 words, `high * 2**32 + low`.

`MomentsSummary` and `HistogramSummary` count values on the device, where JAX
without `jax_enable_x64` has no 64-bit integer, and an int32 count wraps at 2**31
(65 steps of a 33M-element activation). Two words hold any count below 2**64, add
exactly with a carry, and are read on the host as one int64 (exact below 2**63).
Values with more elements than one int32 sum can count are counted in chunks of
at most `MAX_CHUNK` elements, whose counts are added as words.
"""

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jaxtyping import Array, ArrayLike, Bool, Float, Shaped, UInt32

from ._typing import DType


#: The most elements counted by one int32 sum (2**30: every partial count, and the
#: TPU histogram's differences of them, stay below 2**31).
MAX_CHUNK = 2**30

_WORD = 2**32

#: A count as `(high, low)` uint32 words of one shape.
Words = tuple[UInt32[Array, "*shape"], UInt32[Array, "*shape"]]
#: Words given: JAX arrays, or NumPy ones (of a summary read on the host).
WordsLike = tuple[UInt32[ArrayLike, "*shape"], UInt32[ArrayLike, "*shape"]]


def static_words(n: int) -> Words:
    """The words of a count known when tracing (`0 <= n < 2**64`)."""
    return jnp.uint32(n // _WORD), jnp.uint32(n % _WORD)


def zero_words(like: UInt32[ArrayLike, "*shape"]) -> Words:
    """Count 0 in `like`'s shape."""
    return jnp.zeros_like(like), jnp.zeros_like(like)


def add_words(a: WordsLike, b: WordsLike) -> Words:
    """The words of the sum of two counts (exact below 2**64)."""
    a_high, a_low, b_high, b_low = (jnp.asarray(w, jnp.uint32) for w in (*a, *b))
    low = a_low + b_low  # uint32 wraps modulo 2**32: a carry when it got smaller
    carry = (low < a_low).astype(jnp.uint32)
    return a_high + b_high + carry, low


def words_to_float(words: WordsLike, dtype: DType) -> Float[Array, "*shape"]:
    """The count as a float of `dtype` (rounded above its mantissa: 2**24 for float32).

    The high word times 2**32 is exact (a power of two); one rounding in the sum.
    """
    high, low = (jnp.asarray(w, jnp.uint32).astype(dtype) for w in words)
    return high * float(_WORD) + low


def chunked_count(
    x: Shaped[Array, " n"], count: Callable[[Shaped[Array, " c"]], Array]
) -> Words:
    """The words of `count(x)` (an int32 count per element of its result), exactly.

    `count` is applied to chunks of at most `MAX_CHUNK` consecutive elements of the
    flat `x`, and the chunks' counts are added as words: exact for any size.
    """
    size = x.shape[0]
    step = MAX_CHUNK
    total: Words | None = None
    for start in range(0, max(size, 1), step):
        part = count(x[start : start + step]).astype(jnp.uint32)
        words = (jnp.zeros_like(part), part)
        total = words if total is None else add_words(total, words)
    assert total is not None
    return total


def count_true(mask: Bool[Array, "..."]) -> Words:
    """The words of the number of True elements of `mask` (any shape and size)."""
    return chunked_count(mask.ravel(), lambda m: jnp.sum(m, dtype=jnp.int32))


def host_count(high: ArrayLike, low: ArrayLike, where: str) -> np.ndarray:
    """The count of words `high`, `low` on the host, as NumPy int64 (exact below 2**63).

    Raises:
        TypeError: if the words are traced (read the count on the host, or use
            `value()`, a float, under a trace).
    """
    if isinstance(high, Tracer) or isinstance(low, Tracer):
        raise TypeError(
            f"`{where}` is the exact count, read on the host (NumPy int64); it "
            "cannot be read under a trace. Use `value()` there (a float), or the "
            "uint32 words `high * 2**32 + low` of the fields."
        )
    high64 = np.asarray(high).astype(np.int64)
    return np.asarray((high64 << 32) | np.asarray(low).astype(np.int64))

"""`MomentsSummary`: count, mean, variance, min, max, non-finite count, on device."""

from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Shaped, UInt32

from ._counting import (
    add_words,
    count_true,
    host_count,
    static_words,
    words_to_float,
    zero_words,
)
from ._statistics import compare_dtype, real_array, where_mask
from ._summary import Summary, check_same_kind, extreme
from ._typing import ArrayValue


class MomentsSummary(Summary):
    """Count, mean, variance, min, max and non-finite count of values, on the device.

    `MomentsSummary(x)` reduces all elements of `x` (any shape) when it is made;
    writers write `path/count`, `path/mean`, `path/variance` (`numpy.var`,
    `ddof=0`), `path/min`, `path/max` and `path/nonfinite` (NaN and ±inf elements).

    Accumulating combines two summaries as if their values had been concatenated
    (the parallel-variance formula). NaN and ±inf propagate as in NumPy over all
    the values; finite values whose sum overflows still have a finite mean. With no
    element, mean and variance are 0 and min/max the dtype's identities.

    Counts are two uint32 words on the device (`high * 2**32 + low`, no x64), read
    on the host as exact NumPy int64 by `count`, `nonfinite` and the writers;
    `value()` gives them as floats of the mean's dtype, for use under a trace.

    Attributes:
        count_high: `uint32[*batch]`, the high word of the number of elements
            (traced).
        count_low: `uint32[*batch]`, its low word (traced).
        mean: `float[*batch]`, their mean, in float32 (float64 for float64 values).
        m2: `float[*batch]`, the sum of squared deviations from the mean.
        min_: `[*batch]`, the minimum, in the values' dtype (bool as int32).
        max_: `[*batch]`, the maximum, in the values' dtype (bool as int32).
        nonfinite_high: `uint32[*batch]`, the high word of the number of NaN and
            ±inf elements (traced).
        nonfinite_low: `uint32[*batch]`, its low word (traced).
        count: `int64[*batch]`, the exact number of elements, a NumPy array read on
            the host (a property; `TypeError` under a trace).
        nonfinite: `int64[*batch]`, the exact number of NaN and ±inf elements, as
            `count`.

    Construct as `MomentsSummary(value, where=None)`: `value` of any shape and a
    real dtype (`*batch` appears when a scan or vmap stacks summaries); `where`, a
    bool array broadcasting to `value`'s shape (NumPy's `where=`), keeps only the
    elements where it is True (`where=mask[:, None]` for a padded
    `[batch, features]` value); the others count nowhere, not even in `nonfinite`.

    Raises:
        TypeError: for complex or non-numeric values (strings, objects), or a
            `where` that is not bool.
        ValueError: for a `where` that does not broadcast to `value`'s shape.

    References:
        Chan, Golub and LeVeque, "Updating formulae and a pairwise algorithm for
        computing sample variances" (1979); `numpy.mean`, `numpy.var`.

    Examples:
        >>> m = MomentsSummary(jnp.array([1.0, 2.0])) + MomentsSummary(jnp.array([6.0]))
        >>> {k: round(float(v), 5) for k, v in m.value().items()}
        {'count': 3.0, 'mean': 3.0, 'variance': 4.66667, 'min': 1.0, 'max': 6.0, \
'nonfinite': 0.0}
        >>> int(m.count)
        3
    """

    count_high: UInt32[Array, "*batch"]
    count_low: UInt32[Array, "*batch"]
    mean: Float[Array, "*batch"]
    m2: Float[Array, "*batch"]
    min_: Shaped[Array, "*batch"]
    max_: Shaped[Array, "*batch"]
    nonfinite_high: UInt32[Array, "*batch"]
    nonfinite_low: UInt32[Array, "*batch"]

    def __init__(self, value: ArrayLike, where: ArrayLike | None = None):
        x = real_array(value, "MomentsSummary")
        keep = None if where is None else where_mask(where, x, "MomentsSummary").ravel()
        if x.dtype == jnp.bool_:
            x = x.astype(jnp.int32)
        dtype = compare_dtype(x.dtype)
        xf = x.ravel().astype(dtype)
        if jnp.issubdtype(x.dtype, jnp.floating):
            top, bottom = jnp.inf, -jnp.inf
        else:
            top, bottom = jnp.iinfo(x.dtype).max, jnp.iinfo(x.dtype).min
        where_kept = None if keep is None else keep.reshape(x.shape)
        self.min_ = jnp.min(x, initial=top, where=where_kept).astype(x.dtype)
        self.max_ = jnp.max(x, initial=bottom, where=where_kept).astype(x.dtype)
        nonfinite = ~jnp.isfinite(xf)
        if keep is None:
            words = static_words(xf.size)
            n = jnp.asarray(max(xf.size, 1), dtype)
            kept = xf
        else:
            words = count_true(keep)
            n = jnp.maximum(words_to_float(words, dtype), 1)
            kept = jnp.where(keep, xf, 0)
            nonfinite = nonfinite & keep
        self.count_high = words[0]
        self.count_low = words[1]
        nonfinite_words = count_true(nonfinite)
        self.nonfinite_high = nonfinite_words[0]
        self.nonfinite_low = nonfinite_words[1]
        total = jnp.sum(kept)
        # Finite values whose sum overflows: the sum of the values divided first
        # (one fused reduction with the sum; used only then, so no precision lost).
        overflow = jnp.isinf(total) & jnp.isfinite(self.min_) & jnp.isfinite(self.max_)
        self.mean = jnp.where(overflow, jnp.sum(kept * (1 / n)), total / n)
        deviation = jnp.square(xf - self.mean)
        self.m2 = jnp.sum(deviation if keep is None else jnp.where(keep, deviation, 0))

    @property
    def count(self) -> np.ndarray:
        """The exact number of elements: NumPy `int64[*batch]`, on the host.

        Raises:
            TypeError: under a trace (use `value()` there).
        """
        return host_count(*self._count, "MomentsSummary.count")

    @property
    def nonfinite(self) -> np.ndarray:
        """The exact number of NaN and ±inf elements: NumPy `int64[*batch]`.

        Raises:
            TypeError: under a trace (use `value()` there).
        """
        return host_count(*self._nonfinite, "MomentsSummary.nonfinite")

    @property
    def _count(self) -> tuple[Any, Any]:  # NumPy words on the host
        return self.count_high, self.count_low

    @property
    def _nonfinite(self) -> tuple[Any, Any]:  # NumPy words on the host
        return self.nonfinite_high, self.nonfinite_low

    def value(self) -> dict[str, ArrayValue]:
        """Return `{"count", "mean", "variance", "min", "max", "nonfinite"}`.

        The counts are floats of the mean's dtype here (float32: exact up to 2**24);
        the writers read them exactly on the host (`count`, `nonfinite`).
        """
        dtype = self.m2.dtype
        count = words_to_float(self._count, dtype)
        return {
            "count": count,
            "mean": self.mean,
            "variance": self.m2 / jnp.maximum(count, 1),
            "min": self.min_,
            "max": self.max_,
            "nonfinite": words_to_float(self._nonfinite, dtype),
        }

    rowwise_host_value: ClassVar[bool] = True

    def host_value(self) -> dict[str, np.ndarray]:
        """Return `value()`'s mapping with the exact counts (NumPy int64), on the host.

        The variance is `m2 / max(count, 1)`, with the count in `m2`'s dtype.
        """
        count = self.count
        m2 = np.asarray(self.m2)
        return {
            "count": count,
            "mean": np.asarray(self.mean),
            "variance": np.asarray(m2 / np.maximum(count, 1).astype(m2.dtype)),
            "min": np.asarray(self.min_),
            "max": np.asarray(self.max_),
            "nonfinite": self.nonfinite,
        }

    def accumulate(self, other: Any) -> "MomentsSummary":
        """Return the moments of both sets of values together; both are unchanged.

        Raises:
            ValueError: if `other` is not a `MomentsSummary` or its fields have
                other shapes.
        """
        check_same_kind(self, other, "MomentsSummary.accumulate")
        assert isinstance(other, MomentsSummary)
        with jax.numpy_dtype_promotion("standard"):
            dtype = jnp.result_type(self.mean, other.mean)
            count = add_words(self._count, other._count)
            na = words_to_float(self._count, dtype)
            nb = words_to_float(other._count, dtype)
            total = jnp.maximum(na + nb, 1)
            wa, wb = na / total, nb / total  # in [0, 1]: nothing below overflows
            ma, mb = self.mean.astype(dtype), other.mean.astype(dtype)
            delta = mb - ma
            # `ma + delta * wb` (exact for equal means); where `delta` is not
            # finite (an infinite mean, or finite means of opposite signs whose
            # difference overflows) the weighted sum: ±inf, or NaN for inf - inf.
            mean = jnp.where(jnp.isfinite(delta), ma + delta * wb, ma * wa + mb * wb)
            # `delta * (delta * w)`, not `delta**2 * w`: with an empty side (w = 0)
            # a large `delta` must not overflow to inf and give `inf * 0 = NaN`.
            m2 = self.m2 + other.m2 + delta * (delta * (na * wb))
            new = (
                *count,
                mean,
                m2.astype(dtype),
                jnp.minimum(self.min_, other.min_),
                jnp.maximum(self.max_, other.max_),
                *add_words(self._nonfinite, other._nonfinite),
            )
        return eqx.tree_at(_fields, self, new)

    def identity(self) -> "MomentsSummary":
        """Return the moments of no values: count 0, min +inf (dtype max), max -inf.

        Accumulating it with any moments gives those moments.
        """
        with jax.numpy_dtype_promotion("standard"):
            new = (
                *zero_words(self.count_low),
                jnp.zeros_like(self.mean),
                jnp.zeros_like(self.m2),
                jnp.full_like(self.min_, extreme(self.min_, True)),
                jnp.full_like(self.max_, extreme(self.max_, False)),
                *zero_words(self.nonfinite_low),
            )
        return eqx.tree_at(_fields, self, new)

    def __add__(self, other: Any) -> "MomentsSummary":
        return type(self).accumulate(self, other)


def _fields(m: MomentsSummary) -> tuple[Any, ...]:
    """The array fields (`eqx.tree_at`'s `where`: it passes placeholders)."""
    return (
        m.count_high,
        m.count_low,
        m.mean,
        m.m2,
        m.min_,
        m.max_,
        m.nonfinite_high,
        m.nonfinite_low,
    )

"""On-device statistics summaries: `HistogramSummary` and `MomentsSummary`.

Both reduce their values on the device when they are made, so a writer fetches O(bins)
(or six) numbers per summary, not the values; both accumulate exactly across scan
iterations, vmap lanes and steps (histograms by adding counts, moments with the
parallel-variance formula).
"""

import functools
import math
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike, Float, Int, Shaped

from ._summary import (
    Summary,
    _extreme,  # pyright: ignore[reportPrivateUsage]
    check_same_kind,
    private_asarray,
)
from ._typing import ArrayValue, DType


#: The number of buckets of `HistogramSummary(value, range=...)` without `bins=`.
DEFAULT_BINS = 30


@functools.cache
def tensorflow_edges() -> tuple[float, ...]:
    """Return TensorFlow's default histogram bucket edges (1,551 edges, 1,550 buckets).

    TF's `histogram.cc` (`InitDefaultBucketsInner`), which tensorboardX's
    `bins="tensorflow"` also uses: limits growing by 10% from 1e-12 to 1e20 on each
    side of 0. TF's outermost limits are `±DBL_MAX`; here they are `±inf`, so every
    non-NaN value lands in a bucket.
    """
    positive: list[float] = []
    v = 1.0e-12
    while v < 1.0e20:
        positive.append(v)
        v *= 1.1
    negative = [-p for p in reversed(positive)]
    return (-math.inf, *negative, 0.0, *positive, math.inf)


def _compare_dtype(dtype: DType) -> np.dtype[Any]:
    """The dtype in which values are compared with the edges (float32 at least)."""
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits > 32:
        return jnp.dtype(dtype)
    return jnp.dtype(jnp.float32)


def _where(where: ArrayLike, x: Array, owner: str) -> Array:
    """`where` as a bool array of `x`'s shape (NumPy's `where=` broadcasting)."""
    keep = private_asarray(where)
    if keep.dtype != jnp.bool_:
        raise TypeError(
            f"`{owner}(value, where=...)`: `where` must be a bool array, got dtype "
            f"{keep.dtype}; compare to make one (e.g. `where=mask > 0`)."
        )
    try:
        return jnp.broadcast_to(keep, x.shape)
    except ValueError:
        raise ValueError(
            f"`{owner}(value, where=...)`: `where` of shape {keep.shape} does not "
            f"broadcast to the value's shape {x.shape} (NumPy's rules: trailing axes "
            "first; a row mask of a [batch, features] value is `mask[:, None]`)."
        ) from None


def _check_real(x: Array, where: str) -> None:
    if not (jnp.issubdtype(x.dtype, jnp.number) or x.dtype == jnp.bool_) or (
        jnp.issubdtype(x.dtype, jnp.complexfloating)
    ):
        raise TypeError(
            f"`{where}`: expected real (bool, integer or floating) values, got dtype "
            f"{x.dtype}. For complex values, summarize `jnp.abs(x)` or the real and "
            "imaginary parts."
        )


def _make_edges(
    bins: int | None,
    range: tuple[float | int, float | int] | None,
    edges: Sequence[float | int] | np.ndarray | None,
) -> tuple[float, ...]:
    where = "HistogramSummary"
    if edges is not None:
        if bins is not None or range is not None:
            raise ValueError(
                f"`{where}(edges=...)`: pass either `edges` or `bins`/`range`, not "
                "both."
            )
        out = tuple(float(e) for e in np.asarray(edges, dtype=np.float64).ravel())
    elif range is not None:
        lo, hi = (float(r) for r in range)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(
                f"`{where}(range=...)`: expected finite (low, high) with low < high, "
                f"got {range!r}."
            )
        count = DEFAULT_BINS if bins is None else bins
        integer = isinstance(count, (int, np.integer))  # pyright: ignore[reportUnnecessaryIsInstance] (untyped callers)
        if isinstance(count, bool) or not integer or count < 1:
            raise ValueError(
                f"`{where}(bins=...)`: expected a positive int, got {bins!r}."
            )
        out = tuple(float(e) for e in np.linspace(lo, hi, int(count) + 1))
    elif bins is not None:
        raise ValueError(
            f"`{where}(bins={bins!r})`: fixed edges need a range too; pass "
            "`range=(low, high)` (or explicit `edges=`), so that histograms of "
            "different steps have the same buckets and accumulate."
        )
    else:
        return tensorflow_edges()
    if len(out) < 2 or any(math.isnan(e) for e in out):
        raise ValueError(
            f"`{where}(edges=...)`: expected at least 2 edges and no NaN, got {out!r}."
        )
    rounded = np.asarray(out, dtype=np.float64).astype(np.float32)
    if np.any(rounded[1:] <= rounded[:-1]):
        raise ValueError(
            f"`{where}(edges=...)`: edges must be strictly increasing, also when "
            f"rounded to float32 (values are compared in float32), got {out!r}."
        )
    # -0.0 -> 0.0: the edges are static, and tuples holding 0.0 and -0.0 compare (and
    # hash) equal, so JAX's caches and the writers' would mix the two spellings.
    return tuple(e + 0.0 for e in out)


def _count_at_most(
    edges: Float[Array, " e"], x: Float[Array, " n"]
) -> Int[Array, " n"]:
    """`jnp.searchsorted(edges, x, side="right")`: how many edges are <= each x.

    A branchless binary search unrolled in Python (log2(len(edges)) elementwise steps
    that XLA fuses into one loop): 3-10x faster on the CPU than `searchsorted`'s
    `lax` loop for 30-250 edges. NaN counts as above every edge, as in NumPy.
    """
    n = edges.shape[0]
    pos = jnp.zeros(x.shape, jnp.int32)
    k = 1 << n.bit_length()
    while k:
        candidate = pos + k
        below = jnp.take(edges, jnp.minimum(candidate, n) - 1, mode="clip") <= x
        pos = jnp.where((candidate <= n) & below, candidate, pos)
        k >>= 1
    return jnp.where(jnp.isnan(x), n, pos)


#: The most edges for which the TPU counts by comparing every value with every edge
#: (a fused reduction); above, it sorts the values.
MAX_DENSE_EDGES = 64


def _counts_scatter(x: Array, edge_array: Array) -> Int[Array, " bins"]:
    """Bucket counts by a search per value and a scatter-add (CPU and GPU)."""
    num = edge_array.shape[0] - 1
    # Bucket i is [e_i, e_i+1); the last one is closed (numpy.histogram's rule).
    index = _count_at_most(edge_array, x)
    index = jnp.where(x == edge_array[-1], num, index)
    # 0: below the first edge; num + 1: above the last, or NaN. Neither is counted.
    ones = jnp.ones(x.shape, jnp.int32)
    return jnp.zeros(num + 2, jnp.int32).at[index].add(ones)[1 : num + 1]


def _counts_from_below(x: Array, edge_array: Array) -> Int[Array, " bins"]:
    """Bucket counts from how many values lie below each edge (TPU: no scatter).

    `below[j]` counts the values `< e_j` (NaN never is), the last entry those
    `<= e_last` (the closed last bucket); the counts are its differences. Few
    edges: every value compared with every edge, one fused reduction; more: the
    values sorted once (NaN last) and each edge searched for.
    """
    if edge_array.shape[0] <= MAX_DENSE_EDGES:
        below = jnp.sum(x[None, :] < edge_array[:-1, None], axis=1, dtype=jnp.int32)
        last = jnp.sum(x <= edge_array[-1], dtype=jnp.int32)
    else:
        # `sort` and `searchsorted` order floats totally (-0.0 before 0.0, NaN by
        # sign): compare as `<` does instead, zeros as +0.0 and NaN as +inf (then
        # taken out of the closed last bucket when it ends at +inf).
        nan = jnp.isnan(x)
        x = jnp.where(nan, jnp.inf, jnp.where(x == 0, 0, x))
        edges = jnp.where(edge_array == 0, 0, edge_array)
        ordered = jnp.sort(x)
        below = jnp.searchsorted(ordered, edges[:-1], side="left")
        last = jnp.searchsorted(ordered, edges[-1], side="right")
        last = last - jnp.where(edges[-1] == jnp.inf, jnp.sum(nan, dtype=last.dtype), 0)
    ends = jnp.concatenate([below.astype(jnp.int32), last.astype(jnp.int32)[None]])
    return jnp.diff(ends)


def _counts_impl(values: Array, edges: tuple[float, ...]) -> Int[Array, " bins"]:
    dtype = _compare_dtype(values.dtype)
    # float32 rounding of ±DBL_MAX-sized edges gives ±inf; no overflow warning.
    with np.errstate(over="ignore"):
        edge_array = jnp.asarray(np.asarray(edges, dtype=np.float64).astype(dtype))
    x = values.ravel().astype(dtype)
    # A scatter-add is slow on TPUs (1M values: 9.6 ms for 30 buckets, 72 ms for
    # 1,550, against 0.5 and 2.5 ms without one on a v5e).
    counts = jax.lax.platform_dependent(
        x, edge_array, tpu=_counts_from_below, default=_counts_scatter
    )
    assert isinstance(counts, jax.Array)
    return counts


def _counts(values: Array, edges: tuple[float, ...]) -> Int[Array, " bins"]:
    """`numpy.histogram(values, bins=edges)[0]` on the device, as int32, replicated."""
    mesh = jax.typeof(values).sharding.mesh
    explicit = tuple(getattr(mesh, "explicit_axes", ()))
    if not explicit:
        return _counts_impl(values, edges)
    # Values sharded over Explicit mesh axes (sharding in types): the bucket search
    # has no unambiguous output sharding there, so let the compiler place it.
    with jax.sharding.use_abstract_mesh(mesh):
        counts = jax.sharding.auto_axes(
            lambda v: _counts_impl(v, edges), axes=explicit, out_sharding=P()
        )(values)
    assert isinstance(counts, jax.Array)
    return counts


class HistogramSummary(Summary):
    """Bucket counts of values, computed on the device with fixed edges.

    `HistogramSummary(value)` counts all elements of `value` in TensorFlow's default
    buckets (`tf.summary.histogram` v1 and tensorboardX's `bins="tensorflow"`:
    1,550 buckets whose edges grow by 10% from 1e-12 to 1e20 on each side of 0,
    open-ended at ±inf), so any two histograms accumulate. For a known range pass
    `range=(low, high)` (and `bins=`, default 30, evenly spaced) or explicit
    `edges=`. Only the counts are kept: a writer fetches `len(edges) - 1` integers,
    whatever the size of `value`.

    Bucket `i` holds the values in `[edges[i], edges[i + 1])`; the last bucket also
    holds `edges[-1]` (`numpy.histogram`'s rule). Values outside the edges and NaN are
    not counted (add a `MomentsSummary` to count non-finite values). Values are
    compared with the edges in float32 (float64 for float64 values), with the edges
    rounded to it: the counts equal `numpy.histogram(value.astype(np.float32),
    bins=np.float32(edges))[0]`, except for subnormal values (below 1.2e-38 in
    magnitude in float32), which XLA on the CPU flushes to zero before comparing:
    a value of -1e-40 is counted in the bucket holding 0.

    Accumulating (merged scan or vmap summaries, `SummaryAccumulator`) adds the
    counts. Counts are int32: at most 2**31 - 1 per bucket.

    Attributes:
        counts: `int32[..., bins]`, the count of each bucket (traced); a leading
            axis appears when histograms are stacked by a scan or vmap.
        edges: the `bins + 1` bucket edges, strictly increasing (static, a tuple
            of floats; an edge -0.0 is kept as 0.0, the same boundary).

    Construct as `HistogramSummary(value, *, bins=None, range=None, edges=None,
    where=None)`: `value` is an array of any shape and a real dtype; `where`, a bool
    array that broadcasts to `value`'s shape (NumPy's `where=`), counts only the
    elements where it is True (the real rows of a padded batch: `where=mask[:, None]`
    for a `[batch, features]` value).

    Raises:
        ValueError: for `bins` without `range`, `edges` together with `bins` or
            `range`, a non-finite or empty range, fewer than 2 edges, edges that
            are not strictly increasing (also in float32), or a `where` that does not
            broadcast to `value`'s shape.
        TypeError: for complex or non-numeric values, or a `where` that is not bool.

    Examples:
        >>> h = HistogramSummary(jnp.array([0.1, 0.5, 0.5, 2.0]), bins=2, range=(0, 1))
        >>> h.counts.tolist(), h.edges
        ([1, 2], (0.0, 0.5, 1.0))
    """

    counts: Int[Array, "*batch bins"]
    edges: tuple[float, ...] = eqx.field(static=True)

    def __init__(
        self,
        value: ArrayLike,
        *,
        bins: int | None = None,
        range: tuple[float | int, float | int] | None = None,  # numpy's name
        edges: Sequence[float | int] | np.ndarray | None = None,
        where: ArrayLike | None = None,
    ):
        values = private_asarray(value)
        _check_real(values, "HistogramSummary")
        self.edges = _make_edges(bins, range, edges)
        if where is not None:  # NaN is in no bucket
            keep = _where(where, values, "HistogramSummary")
            values = values.astype(_compare_dtype(values.dtype))
            values = jnp.where(keep, values, jnp.nan)
        self.counts = _counts(values, self.edges)

    def __check_init__(self) -> None:
        if jnp.shape(self.counts)[-1:] != (len(self.edges) - 1,):
            raise ValueError(
                f"`HistogramSummary`: counts of shape {jnp.shape(self.counts)} do not "
                f"match {len(self.edges)} edges."
            )

    @property
    def bins(self) -> int:
        """The number of buckets, `len(edges) - 1`."""
        return len(self.edges) - 1

    def value(self) -> ArrayValue:
        """Return the counts (the edges are the static field `edges`)."""
        return self.counts

    def accumulate(self, other: Any) -> "HistogramSummary":
        """Return the histogram with both counts added; both are unchanged.

        Raises:
            ValueError: if `other` is not a `HistogramSummary`, or its edges or the
                shape of its counts differ.
        """
        if not isinstance(other, HistogramSummary):
            check_same_kind(self, other, "HistogramSummary.accumulate")
            raise AssertionError  # pragma: no cover - check_same_kind raised
        if other.edges != self.edges:
            raise ValueError(
                "`HistogramSummary.accumulate`: the edges differ "
                f"({_describe(self.edges)} vs {_describe(other.edges)}); make both "
                "with the same `bins`/`range` or `edges` to add their counts."
            )
        if jnp.shape(other.counts) != jnp.shape(self.counts):
            raise ValueError(
                "`HistogramSummary.accumulate`: counts of shapes "
                f"{jnp.shape(self.counts)} and {jnp.shape(other.counts)}."
            )
        return eqx.tree_at(lambda h: h.counts, self, self.counts + other.counts)

    def identity(self) -> "HistogramSummary":
        """Return the same edges with zero counts: adding it changes no count."""
        return eqx.tree_at(lambda h: h.counts, self, jnp.zeros_like(self.counts))


def _describe(edges: tuple[float, ...]) -> str:
    return f"{len(edges) - 1} buckets from {edges[0]} to {edges[-1]}"


class MomentsSummary(Summary):
    """Count, mean, variance, min, max and non-finite count of values, on the device.

    The "cheap statistics" of activations, gradients or weights: `MomentsSummary(x)`
    reduces all elements of `x` (any shape) to six numbers when it is made. Writers
    write them as `path/count`, `path/mean`, `path/variance` (the population
    variance, `numpy.var` with `ddof=0`), `path/min`, `path/max` and `path/nonfinite`
    (the number of NaN and ±inf elements).

    Accumulating (merged scan or vmap summaries, `SummaryAccumulator`) combines two
    summaries exactly as if their values had been concatenated, with the
    parallel-variance formula (no catastrophic cancellation). A NaN value makes the
    mean, variance, min and max NaN (and ±inf makes the mean and variance non-finite)
    as in NumPy; `nonfinite` counts them. With no element, the mean and variance are 0
    and min/max are the dtype's identities (`+inf`/`-inf`, or the integer limits).

    Attributes:
        count: `int32[*batch]`, the number of elements (traced).
        mean: `float[*batch]`, their mean, in float32 (float64 for float64 values).
        m2: `float[*batch]`, the sum of squared deviations from the mean.
        min_: `[*batch]`, the minimum, in the values' dtype (bool as int32).
        max_: `[*batch]`, the maximum, in the values' dtype (bool as int32).
        nonfinite: `int32[*batch]`, the number of NaN and ±inf elements.

    Construct as `MomentsSummary(value, where=None)` with `value` an array of any
    shape and a real dtype; a leading `*batch` axis appears when summaries are
    stacked by a scan or vmap. `where`, a bool array that broadcasts to `value`'s
    shape (NumPy's `where=`), keeps only the elements where it is True (the real rows
    of a padded batch: `where=mask[:, None]` for a `[batch, features]` value); the
    others count nowhere, not even in `nonfinite`.

    Raises:
        TypeError: for complex or non-numeric values, or a `where` that is not bool.
        ValueError: for a `where` that does not broadcast to `value`'s shape.

    References:
        Chan, Golub and LeVeque, "Updating formulae and a pairwise algorithm for
        computing sample variances" (1979); `numpy.mean`, `numpy.var`.

    Examples:
        >>> m = MomentsSummary(jnp.array([1.0, 2.0])) + MomentsSummary(jnp.array([6.0]))
        >>> {k: float(v) for k, v in m.value().items()}
        {'count': 3.0, 'mean': 3.0, 'variance': 4.666666507720947, 'min': 1.0, \
'max': 6.0, 'nonfinite': 0.0}
    """

    count: Int[Array, "*batch"]
    mean: Float[Array, "*batch"]
    m2: Float[Array, "*batch"]
    min_: Shaped[Array, "*batch"]
    max_: Shaped[Array, "*batch"]
    nonfinite: Int[Array, "*batch"]

    def __init__(self, value: ArrayLike, where: ArrayLike | None = None):
        x = private_asarray(value)
        _check_real(x, "MomentsSummary")
        keep = None if where is None else _where(where, x, "MomentsSummary")
        if x.dtype == jnp.bool_:
            x = x.astype(jnp.int32)
        dtype = _compare_dtype(x.dtype)
        xf = x.ravel().astype(dtype)
        if jnp.issubdtype(x.dtype, jnp.floating):
            top, bottom = jnp.inf, -jnp.inf
        else:
            top, bottom = jnp.iinfo(x.dtype).max, jnp.iinfo(x.dtype).min
        if keep is not None:
            k = keep.ravel()
            self.count = jnp.sum(k, dtype=jnp.int32)
            total = jnp.sum(jnp.where(k, xf, 0))
            self.mean = total / jnp.maximum(self.count, 1).astype(dtype)
            self.m2 = jnp.sum(jnp.where(k, jnp.square(xf - self.mean), 0))
            self.min_ = jnp.min(x, initial=top, where=keep).astype(x.dtype)
            self.max_ = jnp.max(x, initial=bottom, where=keep).astype(x.dtype)
            self.nonfinite = jnp.sum(~jnp.isfinite(xf) & k, dtype=jnp.int32)
            return
        n = xf.size
        self.count = jnp.asarray(n, jnp.int32)
        if n == 0:
            self.mean = jnp.zeros((), dtype)
            self.m2 = jnp.zeros((), dtype)
        else:
            self.mean = jnp.sum(xf) / jnp.asarray(n, dtype)
            self.m2 = jnp.sum(jnp.square(xf - self.mean))
        self.min_ = jnp.min(x, initial=top).astype(x.dtype)
        self.max_ = jnp.max(x, initial=bottom).astype(x.dtype)
        self.nonfinite = jnp.sum(~jnp.isfinite(xf), dtype=jnp.int32)

    def value(self) -> dict[str, ArrayValue]:
        """Return `{"count", "mean", "variance", "min", "max", "nonfinite"}`."""
        safe = jnp.maximum(self.count, 1).astype(self.m2.dtype)
        return {
            "count": self.count,
            "mean": self.mean,
            "variance": self.m2 / safe,
            "min": self.min_,
            "max": self.max_,
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
            count = self.count + other.count
            na = self.count.astype(dtype)
            nb = other.count.astype(dtype)
            total = jnp.maximum(count, 1).astype(dtype)
            delta = other.mean.astype(dtype) - self.mean.astype(dtype)
            mean = self.mean.astype(dtype) + delta * (nb / total)
            # `delta * (delta * w)`, not `delta**2 * w`: with an empty side (w = 0)
            # a large `delta` must not overflow to inf and give `inf * 0 = NaN`.
            m2 = self.m2 + other.m2 + delta * (delta * (na * nb / total))
            new = (
                count,
                mean,
                m2.astype(dtype),
                jnp.minimum(self.min_, other.min_),
                jnp.maximum(self.max_, other.max_),
                self.nonfinite + other.nonfinite,
            )
        return eqx.tree_at(
            lambda m: (m.count, m.mean, m.m2, m.min_, m.max_, m.nonfinite), self, new
        )

    def identity(self) -> "MomentsSummary":
        """Return the moments of no values: count 0, min +inf (dtype max), max -inf.

        Accumulating it with any moments gives those moments.
        """
        with jax.numpy_dtype_promotion("standard"):
            new = (
                jnp.zeros_like(self.count),
                jnp.zeros_like(self.mean),
                jnp.zeros_like(self.m2),
                jnp.full_like(self.min_, _extreme(self.min_, True)),
                jnp.full_like(self.max_, _extreme(self.max_, False)),
                jnp.zeros_like(self.nonfinite),
            )
        return eqx.tree_at(
            lambda m: (m.count, m.mean, m.m2, m.min_, m.max_, m.nonfinite), self, new
        )

    def __add__(self, other: Any) -> "MomentsSummary":
        return type(self).accumulate(self, other)

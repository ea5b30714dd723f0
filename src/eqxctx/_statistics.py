"""`HistogramSummary`: bucket counts on the device, and the statistics kinds' checks.

The statistics kinds (this one and `MomentsSummary`) reduce their values where they
are made, so a writer fetches their counts, not the values.
"""

import functools
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike, Int, UInt32

from ._counting import add_words, chunked_count, host_count, words_to_float, zero_words
from ._records import Histogram
from ._summary import Summary, check_same_kind, private_asarray
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


def compare_dtype(dtype: DType) -> np.dtype[Any]:
    """The dtype in which values are compared with the edges (float32 at least)."""
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits > 32:
        return jnp.dtype(dtype)
    return jnp.dtype(jnp.float32)


def where_mask(where: ArrayLike, x: Array, owner: str) -> Array:
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


def real_array(value: ArrayLike, where: str) -> Array:
    """`value` as a JAX array (a private copy of a NumPy one), or this kind's error.

    Raises:
        TypeError: for values that are not real numbers (strings, objects,
            complex numbers): JAX's own error would not name the kind.
    """
    try:
        x = private_asarray(value)
    except TypeError as e:
        dtype = getattr(value, "dtype", None)
        got = type(value).__name__ + ("" if dtype is None else f" of dtype {dtype}")
        raise TypeError(
            f"`{where}`: expected real (bool, integer or floating) values, got {got}."
        ) from e
    _check_real(x, where)
    return x


def _check_real(x: Array, where: str) -> None:
    if not (jnp.issubdtype(x.dtype, jnp.number) or x.dtype == jnp.bool_) or (
        jnp.issubdtype(x.dtype, jnp.complexfloating)
    ):
        raise TypeError(
            f"`{where}`: expected real (bool, integer or floating) values, got dtype "
            f"{x.dtype}. For complex values, summarize `jnp.abs(x)` or the real and "
            "imaginary parts."
        )


_FLOAT32 = np.dtype(np.float32)


def _make_edges(
    bins: int | None,
    range: tuple[float | int, float | int] | None,
    edges: Sequence[float | int] | np.ndarray | None,
    compare: np.dtype[Any] = _FLOAT32,
) -> tuple[float, ...]:
    """The edges, checked strictly increasing also in `compare` (`compare_dtype`)."""
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
    with np.errstate(over="ignore"):  # ±DBL_MAX-sized edges round to ±inf
        rounded = np.asarray(out, dtype=np.float64).astype(compare)
    if np.any(rounded[1:] <= rounded[:-1]):
        raise ValueError(
            f"`{where}(edges=...)`: edges must be strictly increasing, also when "
            f"rounded to {compare} (these values are compared in {compare}), got "
            f"{out!r}."
        )
    # -0.0 -> 0.0: the edges are static, and tuples holding 0.0 and -0.0 compare (and
    # hash) equal, so JAX's caches and the writers' would mix the two spellings.
    return tuple(e + 0.0 for e in out)


#: The most edges for which the TPU counts by comparing every value with every edge
#: (a fused reduction); above, it sorts the values.
MAX_DENSE_EDGES = 64


def _counts_scatter(x: Array, edge_array: Array) -> Int[Array, " bins"]:
    """Bucket counts by a search per value and a scatter-add (CPU and GPU)."""
    num = edge_array.shape[0] - 1
    # Bucket i is [e_i, e_i+1); the last one is closed (numpy.histogram's rule).
    # How many edges are <= each value (NaN above all, -0.0 equal to 0.0). Few
    # edges: every value compared with every edge (one fused reduction).
    method = "compare_all" if edge_array.shape[0] <= MAX_DENSE_EDGES else "scan"
    index = jnp.searchsorted(edge_array, x, side="right", method=method)
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
    dtype = compare_dtype(values.dtype)
    # float32 rounding of ±DBL_MAX-sized edges gives ±inf; no overflow warning.
    with np.errstate(over="ignore"):
        edge_array = jnp.asarray(np.asarray(edges, dtype=np.float64).astype(dtype))
    x = values.ravel().astype(dtype)
    # A scatter-add is slow on TPUs (see benchmarks/README.md).
    counts = jax.lax.platform_dependent(
        x, edge_array, tpu=_counts_from_below, default=_counts_scatter
    )
    assert isinstance(counts, jax.Array)
    return counts


def _counts(values: Array, edges: tuple[float, ...]) -> Int[Array, " bins"]:
    """`numpy.histogram(values, bins=edges)[0]` on the device, as int32, replicated.

    `values` has at most `MAX_CHUNK` elements (int32 counts do not wrap).
    """
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
    buckets (as tensorboardX's `bins="tensorflow"`: 1,550 buckets with edges growing
    by 10% from 1e-12 to 1e20 on each side of 0, open at ±inf), so any two
    histograms accumulate; for a known range pass `range=(low, high)` (and `bins=`,
    default 30, evenly spaced) or explicit `edges=`. Only the counts are kept.

    Bucket `i` holds `[edges[i], edges[i + 1])`, the last one also `edges[-1]`
    (`numpy.histogram`'s rule); values outside the edges and NaN are not counted.
    Values and edges are compared in float32 (float64 for float64 values): the
    counts equal `numpy.histogram(value.astype(np.float32), bins=np.float32(edges))`,
    except that XLA on the CPU flushes subnormal values to zero first.

    Accumulating adds the counts, kept on the device as two uint32 words per bucket
    (`high * 2**32 + low`, no x64); `counts` reads them on the host as exact NumPy
    int64, as the writers do; `value()` gives float32 counts, for use under a trace.

    Attributes:
        counts_high: `uint32[*batch, bins]`, the high words of the bucket counts
            (traced); a leading axis appears when histograms are stacked by a scan
            or vmap.
        counts_low: `uint32[*batch, bins]`, their low words (traced).
        edges: the `bins + 1` bucket edges, strictly increasing (static, a tuple
            of floats; an edge -0.0 is kept as 0.0, the same boundary).
        counts: `int64[*batch, bins]`, the exact count of each bucket, a NumPy
            array read on the host (a property; `TypeError` under a trace).

    Construct as `HistogramSummary(value, *, bins=None, range=None, edges=None,
    where=None)`: `value` of any shape and a real dtype; `where`, a bool array
    broadcasting to `value`'s shape (NumPy's `where=`), counts only the elements
    where it is True (`where=mask[:, None]` for a padded `[batch, features]` value).

    Raises:
        ValueError: for `bins` without `range`, `edges` together with `bins` or
            `range`, a non-finite or empty range, fewer than 2 edges, edges that
            are not strictly increasing (also rounded to the dtype in which the
            values are compared: float32, or float64 for float64 values), or a
            `where` that does not broadcast to `value`'s shape.
        TypeError: for complex or non-numeric values (strings, objects), or a
            `where` that is not bool.

    Examples:
        >>> h = HistogramSummary(jnp.array([0.1, 0.5, 0.5, 2.0]), bins=2, range=(0, 1))
        >>> h.counts.tolist(), h.edges
        ([1, 2], (0.0, 0.5, 1.0))
    """

    counts_high: UInt32[Array, "*batch bins"]
    counts_low: UInt32[Array, "*batch bins"]
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
        values = real_array(value, "HistogramSummary")
        self.edges = _make_edges(bins, range, edges, compare_dtype(values.dtype))
        if where is not None:  # NaN is in no bucket
            keep = where_mask(where, values, "HistogramSummary")
            values = values.astype(compare_dtype(values.dtype))
            values = jnp.where(keep, values, jnp.nan)
        edges = self.edges
        high, low = chunked_count(values.ravel(), lambda chunk: _counts(chunk, edges))
        self.counts_high = high
        self.counts_low = low

    def __check_init__(self) -> None:
        shapes = {jnp.shape(self.counts_high), jnp.shape(self.counts_low)}
        if len(shapes) != 1 or jnp.shape(self.counts_low)[-1:] != (self.bins,):
            raise ValueError(
                f"`HistogramSummary`: counts of shapes {sorted(shapes)} do not "
                f"match {len(self.edges)} edges."
            )

    @property
    def counts(self) -> np.ndarray:
        """The exact count of each bucket: NumPy `int64[*batch, bins]`, on the host.

        Raises:
            TypeError: under a trace (use `value()` there).
        """
        return host_count(*self._words, "HistogramSummary.counts")

    @property
    def _words(self) -> tuple[Any, Any]:  # NumPy words on the host
        return self.counts_high, self.counts_low

    @property
    def bins(self) -> int:
        """The number of buckets, `len(edges) - 1`."""
        return len(self.edges) - 1

    def value(self) -> ArrayValue:
        """Return the counts as float32 (exact up to 2**24; the edges are `edges`).

        The writers read the exact counts (`counts`) on the host instead.
        """
        return words_to_float(self._words, jnp.float32)

    #: Stacked histograms give a `Histogram` of stacked counts (a buffer's rows
    #: are read at once).
    rowwise_host_value: ClassVar[bool] = True

    def host_value(self) -> Histogram:
        """Return the exact counts (`counts`) and `edges` as a `Histogram` record."""
        return Histogram(self.counts, self.edges)

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
        if jnp.shape(other.counts_low) != jnp.shape(self.counts_low):
            raise ValueError(
                "`HistogramSummary.accumulate`: counts of shapes "
                f"{jnp.shape(self.counts_low)} and {jnp.shape(other.counts_low)}."
            )
        return eqx.tree_at(_words, self, add_words(self._words, other._words))

    def identity(self) -> "HistogramSummary":
        """Return the same edges with zero counts: adding it changes no count."""
        return eqx.tree_at(_words, self, zero_words(self.counts_low))


def _words(h: HistogramSummary) -> tuple[Any, Any]:
    """The count words (`eqx.tree_at`'s `where`: it passes placeholders)."""
    return h.counts_high, h.counts_low


def _describe(edges: tuple[float, ...]) -> str:
    return f"{len(edges) - 1} buckets from {edges[0]} to {edges[-1]}"

"""The `Summary` interface and its numeric kinds: weighted mean, min, max, sum.

Follows AXLearn's `axlearn/common/summary.py` (`Summary`) and
`axlearn/common/metrics.py` (`WeightedScalar`, `MinSummary`, `MaxSummary`).
"""

import abc
import dataclasses
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jaxtyping import Array, ArrayLike, PyTree

from ._typing import ArrayTree, ArrayValue, Leaf


def private_asarray(x: ArrayLike) -> Array:
    """`jnp.asarray(x)`, of a private copy of a NumPy array.

    On the CPU, JAX may read a NumPy argument after the call returns, so a buffer
    refilled for the next batch would change a summary made from it.
    """
    return jnp.asarray(x.copy() if isinstance(x, np.ndarray) else x)


def as_array(x: ArrayLike) -> Array:
    """A summary field's value as a JAX array; typed PRNG keys are refused."""
    array = private_asarray(x)
    dtype = array.dtype  # a NumPy dtype, or JAX's extended dtype of a typed key
    # (NumPy dtypes, bfloat16 too, are never keys: one `isinstance` for them.)
    plain = isinstance(dtype, np.dtype)  # pyright: ignore[reportUnnecessaryIsInstance]
    if not plain and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"A summary's value is a typed PRNG key ({dtype}); summaries log numbers. "
            "Summarize `jax.random.key_data(key)`, or add the key as a module output."
        )
    return array


def _shapes(summary: "Summary") -> str:
    """Describe the shapes of `summary`'s arrays, e.g. `mean () and weight (3,)`."""
    parts = [
        f"{jax.tree_util.keystr(path, simple=True, separator='.')} {np.shape(leaf)}"
        for path, leaf in jax.tree_util.tree_leaves_with_path(summary)
    ]
    return " and ".join(parts) or "no arrays"


def _kind(x: object) -> str:
    if isinstance(x, Summary):
        name = type(x).__name__
        return f"{'an' if name[0] in 'AEIOU' else 'a'} {name}"
    return f"{type(x).__name__} {x!r}"[:80]


def check_same_kind(summary: "Summary", other: object, where: str) -> None:
    """Raise `ValueError` unless `other` is `summary`'s kind with the same shapes.

    AXLearn's rule (`axlearn/common/metrics.py`): two summaries accumulate only if
    they are of one kind and their arrays have the same shapes (no broadcasting).
    Static fields (an `AudioSummary`'s sample rate, a `HistogramSummary`'s edges, a
    `CallbackSummary`'s function) must be equal too.
    """
    if type(other) is not type(summary):
        raise ValueError(
            f"`{where}`: cannot accumulate {_kind(summary)} with {_kind(other)}; "
            "accumulate summaries of one kind (log the same kind at a path every "
            "time)."
        )
    assert isinstance(other, Summary)
    mine, treedef = jax.tree_util.tree_flatten(summary)
    others, other_def = jax.tree_util.tree_flatten(other)
    if treedef == other_def and all(
        np.shape(a) == np.shape(b) for a, b in zip(mine, others, strict=True)
    ):
        return
    static, other_static = _static_fields(summary), _static_fields(other)
    if static != other_static:
        raise ValueError(
            f"`{where}`: cannot accumulate {_kind(summary)} with {static} with one "
            f"with {other_static}; summaries accumulate only with the same settings."
        )
    raise ValueError(
        f"`{where}`: cannot accumulate {_kind(summary)} of shapes "
        f"{_shapes(summary)} with one of shapes {_shapes(other)}; summaries "
        "accumulate only with the same shapes (no broadcasting)."
    )


def _static_fields(summary: "Summary") -> str:
    fields = [f for f in dataclasses.fields(summary) if f.metadata.get("static")]
    return ", ".join(f"{f.name}={getattr(summary, f.name)!r}" for f in fields)[:200]


class Summary(eqx.Module):
    """A summary value that knows how to validate, report and accumulate itself.

    Summaries are `eqx.Module` PyTrees whose array fields are traced like any leaf.
    Concrete kinds are final. A new kind subclasses `Summary` and implements
    `value()` and `accumulate()` (and `identity()` where one exists, `validate()`
    where shapes can be wrong); `reduce_stacked` and `host_value` have defaults
    derived from those. Everything in eqxctx calls only these methods.

    Raw arrays and Python numbers are summary leaves too, accumulated with `+` as
    in AXLearn: a mean should be a `WeightedSummary`, a count of booleans a
    `SumSummary` of integers (`+` of JAX booleans is a logical or). A sum keeps its
    dtype and rounds to it at every addition (a bfloat16 sum stops growing by 1 at
    256, float32 at 2**24; int32 wraps past 2**31 - 1): summarize in float32 what
    is accumulated many times.
    """

    @abc.abstractmethod
    def value(self) -> PyTree[Array]:
        """Return the value that writers log (e.g. the mean of a `WeightedSummary`)."""

    def validate(self) -> None:
        """Check the summary's shapes at trace time.

        Raises:
            ValueError: if a shape or a field is invalid for this kind.
        """

    @abc.abstractmethod
    def accumulate(self, other: Any) -> "Summary":
        """Return the accumulation of `self` and `other`; both are unchanged.

        Every built-in kind requires `other` to be of the same kind with arrays of
        the same shapes (AXLearn's rule); a NaN in either gives NaN.

        Raises:
            ValueError: if `other` is another kind (or not a `Summary`), or its
                arrays have other shapes (the message names both).
        """

    def identity(self) -> "Summary | None":
        """Return this kind's identity with `self`'s shapes and dtypes, or None.

        `s.identity().accumulate(s)` equals `s` (up to rounding for a weighted
        mean; a mean of zero total weight becomes 0). Branches that do not add a
        summary and loops that run zero times report it. The default, None, means
        the kind has none (media kinds keep their first value).
        """
        return None

    def reduce_stacked(self) -> "Summary":
        """Return the accumulation of N >= 2 summaries stacked along a leading axis.

        Every array field has a leading axis of length N (as scans and vmaps stack
        them). The result equals `s[0].accumulate(s[1]).accumulate(s[2])...` (up to
        rounding). The default folds `accumulate` in a `jax.lax.scan`.
        """
        first = jax.tree_util.tree_map(lambda a: a[0], self)
        rest = jax.tree_util.tree_map(lambda a: a[1:], self)

        def step(acc: Summary, new: Summary) -> tuple[Summary, None]:
            return type(acc).accumulate(acc, new), None

        return jax.lax.scan(step, first, rest)[0]

    #: Whether `host_value()` of summaries stacked along leading axes gives each
    #: value stacked the same way (a host record: its arrays), and `validate()` of
    #: stacked summaries passes only if each one's would: writers then read a
    #: scan's rows, and a `SummaryBuffer`'s steps, at once.
    rowwise_host_value: ClassVar[bool] = False
    #: Whether writers may remake `host_value()` from fetched fields by a recipe
    #: made once per structure (False: every read calls it afresh, e.g. a callback).
    replayable_host_value: ClassVar[bool] = True

    def host_value(self) -> ArrayTree:
        """Return what writers write, read on the host (the arrays are NumPy there).

        A NumPy array or number, a host record (`Histogram`, `Image`, `Audio` of
        `eqxctx.writers`), or a mapping of them (written under `path/key`). The
        default is `value()`. Writers call `validate()` first, and may call this
        again on the same fields: it must depend only on them.
        """
        return type(self).value(self)


#: `WeightedSummary.accumulate` scales weights above it (or below its inverse) by a
#: power of two.
_BIG = 2.0**64


def weight_total_dtype(dtype: Any) -> Any:
    """The dtype in which weights of `dtype` are added: at least 32 bits.

    Bool weights count (`True + True` is 2, not a logical or), and integer or
    float weights narrower than 32 bits are widened (uint8 wraps at 255, float16
    overflows at 65504).
    """
    dtype = np.dtype(dtype)
    if dtype == np.bool_ or (jnp.issubdtype(dtype, jnp.integer) and dtype.itemsize < 4):
        return np.dtype(np.int32)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return np.dtype(np.float32)
    return dtype


class WeightedSummary(Summary):
    """A weighted mean, e.g. a loss averaged over a number of examples.

    AXLearn's `WeightedScalar`. Accumulating gives the weighted mean of the means,
    with the weights added; at zero total weight the mean is 0 (no NaN in the value
    or its gradient). A NaN mean (even at zero weight) or weight gives a NaN mean, so
    compute an empty batch's mean as 0 (`total / jnp.maximum(count, 1)`), not 0/0.
    `validate()` refuses concrete negative weights.

    The mean is computed in at least float32. The weights add in their own dtype
    (at least 32 bits): float32 totals are exact up to 2**24 and then round (a
    weight below `total * 2**-24` no longer changes the total), int32 totals wrap
    past 2**31 - 1. Accumulate a batch's example count, not one weight per example.

    Attributes:
        mean: the mean, any shape, floating dtype (traced).
        weight: the weight, shape `()` or `mean`'s shape, any real dtype, not
            negative (traced).

    Examples:
        >>> s = WeightedSummary(2.0, 1.0) + WeightedSummary(5.0, 2.0)
        >>> float(s.value())
        4.0
    """

    mean: Array = eqx.field(converter=as_array)
    weight: Array = eqx.field(converter=as_array)

    def value(self) -> ArrayValue:
        """Return the mean."""
        return self.mean

    def validate(self) -> None:
        """Check that `weight` is a scalar or has `mean`'s shape, and not negative.

        Raises:
            ValueError: if `weight`'s shape is neither `()` nor `mean.shape`, or a
                concrete (not traced) weight is negative. Traced weights are not
                checked.
        """
        weight, mean = self.weight, self.mean  # Equinox's attribute reads: ~1 µs
        if weight.shape not in ((), mean.shape):
            raise ValueError(
                f"`WeightedSummary(mean, weight)`: weight has shape {weight.shape}"
                f", expected () or the mean's shape {mean.shape}."
            )
        if not isinstance(weight, Tracer) and bool((weight < 0).any()):
            raise ValueError(
                "`WeightedSummary(mean, weight)`: weights must not be negative, got "
                f"{np.asarray(weight)!r}; a weight counts examples (use 0 to add "
                "nothing)."
            )

    def accumulate(self, other: Any) -> "WeightedSummary":
        """Return the weighted mean of both means, with the weights added.

        The mean is `(m1 * w1 + m2 * w2) / (w1 + w2)` in at least float32, with the
        weights scaled by the larger one (no overflow), 0 at zero total weight, NaN
        for a NaN mean or weight. Weights add in at least 32 bits
        (`weight_total_dtype`). Mixed dtypes promote as under JAX's standard
        promotion, also under `jax_numpy_dtype_promotion="strict"`.

        Raises:
            ValueError: if `other` is not a `WeightedSummary`, or its mean or weight
                has another shape.
        """
        check_same_kind(self, other, "WeightedSummary.accumulate")
        with jax.numpy_dtype_promotion("standard"):
            dtype = jnp.result_type(self.mean, other.mean)
            if not jnp.issubdtype(dtype, jnp.floating):
                dtype = jnp.float32
            # At least float32: a float16 mean's weights (token counts) pass 65504.
            compute = jnp.promote_types(dtype, jnp.float32)
            w1 = self.weight.astype(compute)
            w2 = other.weight.astype(compute)
            m1 = self.mean.astype(compute)
            m2 = other.mean.astype(compute)
            scale = jnp.maximum(w1, w2)  # NaN if a weight is NaN
            positive = scale > 0
            # Scaled by the larger weight, first brought into [2**-64, 2**64] by an
            # exact power of two: a TPU divides by a reciprocal, flushed to zero
            # when subnormal.
            factor = jnp.where(
                scale > _BIG, 1 / _BIG, jnp.where(scale < 1 / _BIG, _BIG, 1.0)
            ).astype(compute)
            safe_scale = jnp.where(positive, scale * factor, jnp.ones_like(scale))
            a, b = (w1 * factor) / safe_scale, (w2 * factor) / safe_scale
            numerator = m1 * a + m2 * b  # NaN for a NaN mean or weight (0 * NaN)
            # Double `where`s: no NaN in the value or its gradient at zero weight.
            denominator = jnp.where(positive, a + b, jnp.ones_like(scale))
            broken = jnp.isnan(numerator) | jnp.isnan(scale)
            mean = jnp.where(positive, numerator / denominator, 0)
            mean = jnp.where(broken, jnp.nan, mean).astype(dtype)
            total = weight_total_dtype(jnp.result_type(self.weight, other.weight))
            weight = self.weight.astype(total) + other.weight.astype(total)
        return WeightedSummary(mean, weight)

    def __add__(self, other: Any) -> "WeightedSummary":
        return type(self).accumulate(self, other)

    rowwise_host_value: ClassVar[bool] = True

    def reduce_stacked(self) -> "WeightedSummary":
        """`accumulate`'s rule over the leading axis at once (see `Summary`)."""
        with jax.numpy_dtype_promotion("standard"):
            dtype = jnp.result_type(self.mean)
            if not jnp.issubdtype(dtype, jnp.floating):
                dtype = jnp.float32
            compute = jnp.promote_types(dtype, jnp.float32)  # as `accumulate`
            m = jnp.asarray(self.mean, compute)
            w = jnp.asarray(self.weight)
            w = jnp.broadcast_to(
                w.reshape(w.shape + (1,) * (m.ndim - w.ndim)).astype(compute), m.shape
            )
            scale = jnp.max(w, axis=0)  # NaN if a weight is NaN
            positive = scale > 0
            # `w / scale` as two multiplications by `rsqrt(scale)`: XLA rewrites a
            # division by a broadcast into a multiplication by its reciprocal, which
            # flushes to zero above 2**126 in float32 (the mean's ratio cancels the
            # rounding of `rsqrt`).
            r = jax.lax.rsqrt(jnp.where(positive, scale, jnp.ones_like(scale)))
            a = (w * r[None]) * r[None]
            numerator = jnp.sum(m * a, axis=0)  # NaN for a NaN mean or weight
            # Double `where`s: no NaN in the value or its gradient at zero weight.
            denominator = jnp.where(positive, jnp.sum(a, axis=0), jnp.ones_like(scale))
            broken = jnp.isnan(numerator) | jnp.isnan(scale)
            mean = jnp.where(positive, numerator / denominator, 0)
            mean = jnp.where(broken, jnp.nan, mean).astype(dtype)
            weights = jnp.asarray(self.weight)
            weight = jnp.sum(weights, axis=0, dtype=weight_total_dtype(weights.dtype))
        return WeightedSummary(mean, weight)

    def identity(self) -> "WeightedSummary":
        """Return weight 0 (mean 0): it adds nothing to a weighted mean."""
        return WeightedSummary(jnp.zeros_like(self.mean), jnp.zeros_like(self.weight))


class _Elementwise(Summary):
    """A kind of one array, `value_`, accumulated elementwise (min, max, sum)."""

    value_: eqx.AbstractVar[Array]
    rowwise_host_value: ClassVar[bool] = True

    def value(self) -> ArrayValue:
        """Return the value (the minimum, maximum or sum)."""
        return self.value_


class MinSummary(_Elementwise):
    """An elementwise minimum (AXLearn's `MinSummary`).

    Attributes:
        value_: the value, any shape and dtype (traced). Construct as
            `MinSummary(value)`.
    """

    value_: Array = eqx.field(converter=as_array)

    def accumulate(self, other: Any) -> "MinSummary":
        """Return the elementwise minimum of both.

        Raises:
            ValueError: if `other` is not a `MinSummary` or has another shape.
        """
        check_same_kind(self, other, "MinSummary.accumulate")
        return MinSummary(jnp.minimum(self.value_, other.value_))

    def reduce_stacked(self) -> "MinSummary":
        """Return the elementwise minimum over the leading axis (one reduction)."""
        return MinSummary(jnp.min(self.value_, axis=0))

    def identity(self) -> "MinSummary":
        """Return the dtype's maximum (+inf for floats, True for booleans)."""
        return MinSummary(jnp.full_like(self.value_, extreme(self.value_, True)))


class MaxSummary(_Elementwise):
    """An elementwise maximum (AXLearn's `MaxSummary`).

    Attributes:
        value_: the value, any shape and dtype (traced). Construct as
            `MaxSummary(value)`.
    """

    value_: Array = eqx.field(converter=as_array)

    def accumulate(self, other: Any) -> "MaxSummary":
        """Return the elementwise maximum of both.

        Raises:
            ValueError: if `other` is not a `MaxSummary` or has another shape.
        """
        check_same_kind(self, other, "MaxSummary.accumulate")
        return MaxSummary(jnp.maximum(self.value_, other.value_))

    def reduce_stacked(self) -> "MaxSummary":
        """Return the elementwise maximum over the leading axis (one reduction)."""
        return MaxSummary(jnp.max(self.value_, axis=0))

    def identity(self) -> "MaxSummary":
        """Return the dtype's minimum (-inf for floats, False for booleans)."""
        return MaxSummary(jnp.full_like(self.value_, extreme(self.value_, False)))


class SumSummary(_Elementwise):
    """An elementwise sum.

    The sum keeps the value's dtype and rounds to it at every addition (see
    `Summary`).

    Attributes:
        value_: the value, any shape and dtype (traced). Construct as
            `SumSummary(value)`.
    """

    value_: Array = eqx.field(converter=as_array)

    def accumulate(self, other: Any) -> "SumSummary":
        """Return the elementwise sum of both.

        Raises:
            ValueError: if `other` is not a `SumSummary` or has another shape.
        """
        check_same_kind(self, other, "SumSummary.accumulate")
        return SumSummary(self.value_ + other.value_)

    def reduce_stacked(self) -> "SumSummary":
        """Return the elementwise sum over the leading axis (one reduction)."""
        return SumSummary(jnp.sum(self.value_, axis=0, dtype=self.value_.dtype))

    def identity(self) -> "SumSummary":
        """Return 0."""
        return SumSummary(jnp.zeros_like(self.value_))


def extreme(x: Array, largest: bool) -> bool | int | float:
    """Return the largest (or smallest) value of `x`'s dtype (±inf for floats)."""
    dtype = x.dtype
    if dtype == jnp.bool_:
        return largest
    if jnp.issubdtype(dtype, jnp.inexact):
        return np.inf if largest else -np.inf
    info = jnp.iinfo(dtype)
    return info.max if largest else info.min


def accumulate_leaf(a: Leaf, b: Leaf) -> Leaf:
    """Accumulate two leaves: `Summary.accumulate`, else `+` (AXLearn's rule)."""
    if isinstance(a, Summary):
        # Through the class: `a.accumulate` would build an Equinox `BoundMethod`.
        return type(a).accumulate(a, b)
    return a + b


def is_array_leaf(x: object) -> bool:
    """Return whether `x` is an array-like leaf accepted in a collection."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float))

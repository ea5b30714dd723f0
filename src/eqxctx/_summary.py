"""Summary types: values added with `add_summary` that know how to accumulate.

Follows AXLearn's `axlearn/common/summary.py` (`Summary`, `ImageSummary`,
`AudioSummary`, `CallbackSummary`) and `axlearn/common/metrics.py` (`WeightedScalar`,
`MinSummary`, `MaxSummary`).
"""

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jaxtyping import Array, ArrayLike, PyTree

from ._records import Audio, Image
from ._typing import ArrayTree, ArrayValue, Leaf


_S = TypeVar("_S", bound="_KeepFirst")


def private_asarray(x: ArrayLike) -> Array:
    """`jnp.asarray(x)`, of a private copy of a NumPy array.

    On the CPU, JAX may read a NumPy argument after the call returns, so a buffer
    refilled for the next batch would change a summary made from it.
    """
    return jnp.asarray(x.copy() if isinstance(x, np.ndarray) else x)


def _as_array(x: ArrayLike) -> Array:
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


def _as_int(x: object) -> object:
    """A NumPy integer as an `int` (a static field); anything else as it is."""
    return int(x) if isinstance(x, np.integer) else x


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

    Summaries are `eqx.Module` PyTrees: their array fields are traced through `jax.jit`,
    `jax.lax.scan` and `jax.vmap` like any other leaf. Concrete kinds are final; write a
    new subclass of `Summary` for a new kind: implement `value()` and `accumulate()`
    (and `identity()` where one exists, `validate()` where shapes can be wrong). The
    other methods (`reduce_stacked`, `host_value`) have defaults derived from those,
    and everything in eqxctx (merged scans and vmaps, branches, `SummaryAccumulator`,
    the writers, `eqxctx.testing`) calls only these methods, never a concrete kind.

    Raw arrays (and Python numbers) are also valid summary leaves; when eqxctx
    accumulates them (e.g. `scan_in_context(..., merge_summaries=True)`) it adds them
    with `+`, as AXLearn does. A mean should therefore be a `WeightedSummary`, and a
    count of booleans a `SumSummary` of integers (`+` of JAX booleans is a logical
    or). The sum keeps the array's dtype and rounds to it at every addition: a
    bfloat16 sum stops growing by 1 at 256 (1,000 merged bfloat16 ones read 256), a
    float16 one at 2,048, a float32 one at 2**24, and int32 wraps past 2**31 - 1.
    Summarize in float32 (`x.astype(jnp.float32)`) what is accumulated many times.
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

        The identity leaves any accumulation unchanged: `s.identity().accumulate(s)`
        equals `s` (up to rounding for a weighted mean,
        and a mean of zero total weight, which becomes 0). Branches that do not add a
        summary (`cond_in_context`) and loops that run zero times
        (`while_in_context`) report it. The default is None: the kind has no
        identity (media kinds keep their first value, so nothing can stand in for a
        missing one). Override it in a new kind that has one.
        """
        return None

    def reduce_stacked(self) -> "Summary":
        """Return the accumulation of N >= 2 summaries stacked along a leading axis.

        `self` holds the summaries as `scan_in_context` / `vmap_in_context` stack
        them: every array field has a leading axis of length N. The result equals
        `s[0].accumulate(s[1]).accumulate(s[2])...` in index order (up to rounding).
        The default folds with `accumulate` in a `jax.lax.scan`; a kind may override
        it with one vectorised reduction (the built-in elementwise ones do).
        """
        first = jax.tree_util.tree_map(lambda a: a[0], self)
        rest = jax.tree_util.tree_map(lambda a: a[1:], self)

        def step(acc: Summary, new: Summary) -> tuple[Summary, None]:
            return type(acc).accumulate(acc, new), None

        return jax.lax.scan(step, first, rest)[0]

    #: Whether `host_value()` of summaries stacked along leading axes gives each
    #: value stacked the same way (elementwise kinds); writers then read a scan's
    #: per-iteration summaries at once instead of one iteration at a time.
    rowwise_host_value: ClassVar[bool] = False

    def host_value(self) -> ArrayTree:
        """Return what writers write, read on the host (the arrays are NumPy there).

        A NumPy array or number (a scalar; an array as a JSON list, or a
        TensorBoard / W&B histogram of its values), a host record (`Histogram`,
        `Image`, `Audio` of `eqxctx.writers`), or a mapping of them, written under
        `path/key`. The default is `value()`. Writers call `validate()` first. An
        override must depend only on the fields: writers may call it again to
        replay a read of the same structure.
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

    AXLearn's `WeightedScalar`. Accumulating two weighted summaries gives the weighted
    mean of their means, with the weights added. At zero total weight the mean is 0,
    and neither the value nor its gradient is NaN. A NaN anywhere (a mean, also one
    with zero weight, or a weight) gives a NaN mean, so writers never log a
    plausible number for a broken batch: compute an empty batch's mean as 0 (e.g.
    `total / jnp.maximum(count, 1)`), not 0/0. Weights must not be negative:
    `validate()` (run by `add_summary` and the writers) refuses concrete negative
    weights.

    The mean is computed in at least float32 and is right (to float32 rounding)
    for any weights. The weights add in their own dtype (at least 32 bits), which
    limits how far the total counts: float32 weights add exactly up to 2**24
    (16,777,216), and then round at each addition, so a weight below
    `total * 2**-24` no longer changes the total (2e7 unit weights added one at a
    time read 16,777,216; each such addition still moves the mean by its own
    fraction `w / (total + w)`, so later means weigh more than they should); int32
    weights add exactly up to 2**31 - 1 and then wrap. Accumulate larger weights
    (a batch's example count, not one per example) to stay far below those limits.

    Attributes:
        mean: the mean, any shape, floating dtype (traced).
        weight: the weight, shape `()` or `mean`'s shape, any real dtype, not
            negative (traced).

    Examples:
        >>> s = WeightedSummary(2.0, 1.0) + WeightedSummary(5.0, 2.0)
        >>> float(s.value())
        4.0
    """

    mean: Array = eqx.field(converter=_as_array)
    weight: Array = eqx.field(converter=_as_array)

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

        The mean is `(m1 * w1 + m2 * w2) / (w1 + w2)`, computed in at least float32
        with the weights scaled by the larger one, so weights near the dtype's
        maximum (or above float16's) do not overflow, and through a power of two
        that keeps every reciprocal a normal number (a TPU flushes subnormal ones
        to zero); at zero total weight it is 0. The weights are
        added in at least 32 bits (bool weights count, small integer and float16
        weights do not wrap or overflow at 255 or 65504). A NaN
        mean (even one with zero weight) or a NaN weight gives a NaN mean. Mixed
        dtypes (a bfloat16 mean with a float32 one, integer weights with float ones)
        are promoted as under JAX's standard promotion, also when
        `jax_numpy_dtype_promotion="strict"` is set.

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
            # Scaled by the larger weight: no overflow of `m * w` or `w1 + w2`. Both
            # weights and the scale are first multiplied by a power of two (exact)
            # that brings the scale into [2**-64, 2**64], so that its reciprocal is
            # a normal number: a TPU divides by multiplying with the reciprocal,
            # flushed to zero when subnormal (a weight above 2**126 gave 0 / 0).
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

    def host_value(self) -> ArrayValue:
        """Return the mean (as `value()`)."""
        return self.mean

    def reduce_stacked(self) -> "WeightedSummary":
        """`accumulate`'s rule over the leading axis at once (see `Summary`).

        The weights are scaled by the largest (no overflow of `m * w` or of the
        total); a NaN mean (even at zero weight) or weight gives NaN, 0 at zero
        total weight.
        """
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

    def host_value(self) -> ArrayValue:
        """Return the value (as `value()`)."""
        return self.value_


class MinSummary(_Elementwise):
    """An elementwise minimum (AXLearn's `MinSummary`).

    Attributes:
        value_: the value, any shape and dtype (traced). Construct as
            `MinSummary(value)`.
    """

    value_: Array = eqx.field(converter=_as_array)

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
        return MinSummary(jnp.full_like(self.value_, _extreme(self.value_, True)))


class MaxSummary(_Elementwise):
    """An elementwise maximum (AXLearn's `MaxSummary`).

    Attributes:
        value_: the value, any shape and dtype (traced). Construct as
            `MaxSummary(value)`.
    """

    value_: Array = eqx.field(converter=_as_array)

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
        return MaxSummary(jnp.full_like(self.value_, _extreme(self.value_, False)))


class SumSummary(_Elementwise):
    """An elementwise sum.

    The sum keeps the value's dtype and rounds to it at every addition, as a raw
    array's does (see `Summary`): a bfloat16 sum stops growing by 1 at 256, a
    float32 one at 2**24, and int32 wraps past 2**31 - 1.

    Attributes:
        value_: the value, any shape and dtype (traced). Construct as
            `SumSummary(value)`.
    """

    value_: Array = eqx.field(converter=_as_array)

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


def _extreme(x: Array, largest: bool) -> bool | int | float:
    """Return the largest (or smallest) value of `x`'s dtype (±inf for floats)."""
    dtype = x.dtype
    if dtype == jnp.bool_:
        return largest
    if jnp.issubdtype(dtype, jnp.inexact):
        return np.inf if largest else -np.inf
    info = jnp.iinfo(dtype)
    return info.max if largest else info.min


class _KeepFirst(Summary):
    """Accumulation keeps the first value (media summaries are not averaged)."""

    def accumulate(self: _S, other: Any) -> _S:
        """Return `self`: the first value is kept.

        Raises:
            ValueError: if `other` is another kind, or its arrays have other shapes
                (or other static fields), as for every kind.
        """
        check_same_kind(self, other, f"{type(self).__name__}.accumulate")
        return self

    def reduce_stacked(self: _S) -> _S:
        """Return the first of the stacked summaries (as `accumulate` keeps it)."""
        return jax.tree_util.tree_map(lambda a: a[0], self)


class ImageSummary(_KeepFirst):
    """A batch of images (AXLearn's `ImageSummary`).

    Accumulated (merged scan or vmap summaries, `SummaryAccumulator`), the first
    value is kept and later ones are dropped (media are not averaged): under
    `merge_summaries` that is the first iteration in execution order (the last index
    with `reverse=True`). For every iteration's value, keep per-iteration summaries.

    Attributes:
        value_: shape `[batch, height, width]` (grayscale) or
            `[batch, height, width, channels]` with channels 1, 3 (RGB) or 4 (RGBA);
            floating values in `[0, 1]` or `uint8` (traced). Construct as
            `ImageSummary(value)`.
    """

    value_: Array = eqx.field(converter=_as_array)

    def value(self) -> ArrayValue:
        """Return the images."""
        return self.value_

    def host_value(self) -> Image:
        """Return the images as an `Image` record."""
        return Image(np.asarray(self.value_))

    def validate(self) -> None:
        """Check the rank and the channel count.

        Raises:
            ValueError: for a rank other than 3 or 4, a channel count not in 1/3/4,
                or an empty batch or image (a zero in the shape).
        """
        shape = self.value_.shape
        if len(shape) not in (3, 4):
            raise ValueError(
                f"`ImageSummary`: expected shape [batch, height, width] or "
                f"[batch, height, width, channels], got {shape} (rank {len(shape)}). "
                "Add a leading batch axis with `x[None]` for a single image."
            )
        if len(shape) == 4 and shape[-1] not in (1, 3, 4):
            raise ValueError(
                f"`ImageSummary`: expected 1, 3 or 4 channels, got shape {shape} "
                f"with {shape[-1]} channels."
            )
        if 0 in shape:
            raise ValueError(
                f"`ImageSummary`: got shape {shape}, with no image or no pixel; "
                "summarize at least one image of at least one pixel."
            )


#: The largest bytes per second of a WAV file (a uint32 in its header).
_MAX_WAV_BYTE_RATE = 2**32 - 1


class AudioSummary(_KeepFirst):
    """A waveform (AXLearn's `AudioSummary`).

    Accumulated (merged scan or vmap summaries, `SummaryAccumulator`), the first
    value is kept and later ones are dropped (media are not averaged): under
    `merge_summaries` that is the first iteration in execution order (the last index
    with `reverse=True`). For every iteration's value, keep per-iteration summaries.

    Attributes:
        value_: shape `[time]` or `[time, channels]`, floating values in `[-1, 1]`
            or `int16` PCM samples, written as they are (traced). Construct as
            `AudioSummary(value, sample_rate=16000)`.
        sample_rate: samples per second (Hz), a positive int, static. The writers
            encode 16-bit WAV, whose header (as written by Python's `wave`, used by
            tensorboardX's audio summary too) stores `sample_rate` and the bytes
            per second `sample_rate * channels * 2` as uint32s: `validate` accepts
            `sample_rate <= (2**32 - 1) // (2 * channels)`.

    Raises:
        TypeError: if `sample_rate` is not an int (on construction).
    """

    value_: Array = eqx.field(converter=_as_array)
    # `Any`, checked in `__check_init__` with a message naming the argument.
    sample_rate: Any = eqx.field(static=True, default=16000, converter=_as_int)

    def __check_init__(self) -> None:
        rate = self.sample_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)):
            raise TypeError(
                "`AudioSummary(value, sample_rate=...)`: sample_rate must be an int "
                f"(samples per second), got {type(rate).__name__} {rate!r}."
            )

    def value(self) -> ArrayValue:
        """Return the waveform."""
        return self.value_

    def host_value(self) -> Audio:
        """Return the waveform and its sample rate as an `Audio` record."""
        return Audio(np.asarray(self.value_), self.sample_rate)

    def validate(self) -> None:
        """Check the dtype, the rank and the sample rate.

        Raises:
            ValueError: for a dtype other than floating or `int16`, a rank other than
                1 or 2, no channel (`[time, 0]`), a non-positive sample rate, or one
                too high for a 16-bit WAV header
                (`sample_rate * channels * 2 > 2**32 - 1`).
        """
        dtype = self.value_.dtype
        if dtype != np.int16 and not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"`AudioSummary`: expected floating values in [-1, 1] or int16 PCM "
                f"samples, got dtype {dtype}; scale other integer samples to [-1, 1] "
                "(for 16-bit PCM held as int32, `x.astype(jnp.int16)`)."
            )
        shape = self.value_.shape
        if len(shape) not in (1, 2):
            raise ValueError(
                f"`AudioSummary`: expected shape [time] or [time, channels], got "
                f"{shape} (rank {len(shape)})."
            )
        if len(shape) == 2 and shape[1] == 0:
            raise ValueError(
                f"`AudioSummary`: got shape {shape}, with no channel; pass "
                "[time] or [time, channels] with at least one channel."
            )
        rate = self.sample_rate
        if rate <= 0:
            raise ValueError(
                f"`AudioSummary`: sample_rate must be positive, got {rate}."
            )
        channels = shape[1] if len(shape) == 2 else 1
        if rate * channels * 2 > _MAX_WAV_BYTE_RATE:
            raise ValueError(
                f"`AudioSummary`: sample_rate {rate} with {channels} channel(s) is too "
                "high for a WAV file, whose header stores the bytes per second "
                "(sample_rate * channels * 2 for 16-bit samples) as a uint32; pass "
                f"sample_rate <= {_MAX_WAV_BYTE_RATE // (2 * channels)}."
            )


class CallbackSummary(_KeepFirst):
    """A summary whose value is computed on the host by `fn(*args, **kwargs)`.

    AXLearn's `CallbackSummary`: `args` and `kwargs` are traced PyTrees; `fn` is static
    and runs when the value is read (by a writer), outside `jax.jit`.
    Accumulated, the first value is kept (see `ImageSummary`). A writer fetches
    `args` and `kwargs` to the host first: `fn` receives NumPy arrays there, as in
    AXLearn.

    Raises:
        TypeError: if `fn` is not callable.

    Attributes:
        fn: the callable, static (hashed by identity: pass the same function object
            to avoid recompilation).
        args: positional arguments, a PyTree (traced).
        kwargs: keyword arguments, a PyTree (traced).
    """

    fn: Callable[..., ArrayTree] = eqx.field(static=True)
    args: tuple[ArrayTree, ...]
    kwargs: dict[str, ArrayTree]

    # `fn: object`: checked here, with a message naming the argument.
    def __init__(self, fn: object, *args: ArrayTree, **kwargs: ArrayTree):
        if not callable(fn):
            raise TypeError(
                "`CallbackSummary(fn, *args, **kwargs)`: fn must be callable (it "
                f"computes the value on the host), got {type(fn).__name__} {fn!r}."
            )
        self.fn = fn
        self.args = args
        self.kwargs = kwargs

    def value(self) -> ArrayTree:
        """Return `fn(*args, **kwargs)`."""
        return self.fn(*self.args, **self.kwargs)


def is_summary(x: object) -> bool:
    """Return whether `x` is a `Summary` (an `is_leaf` for `jax.tree_util`)."""
    return isinstance(x, Summary)


def accumulate_leaf(a: Leaf, b: Leaf) -> Leaf:
    """Accumulate two leaves: `Summary.accumulate`, else `+` (AXLearn's rule)."""
    if isinstance(a, Summary):
        # Through the class: `a.accumulate` builds an Equinox `BoundMethod` (a
        # Module) on every access.
        return type(a).accumulate(a, b)
    return a + b


def leaf_value(x: Leaf) -> ArrayTree:
    """Return what a writer logs for a summary leaf: `value()` or the raw value."""
    if isinstance(x, Summary):
        return type(x).value(x)
    return x


def is_array_leaf(x: object) -> bool:
    """Return whether `x` is an array-like leaf accepted in a collection."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float))

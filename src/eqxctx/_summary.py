"""Summary types: values added with `add_summary` that know how to accumulate.

Follows AXLearn's `axlearn/common/summary.py` (`Summary`, `ImageSummary`,
`AudioSummary`, `CallbackSummary`) and `axlearn/common/metrics.py` (`WeightedScalar`,
`MinSummary`, `MaxSummary`).
"""

import abc
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, PyTree

from ._typing import ArrayValue


_S = TypeVar("_S", bound="_KeepFirst")


def _as_array(x: ArrayLike) -> Array:
    return jnp.asarray(x)


class Summary(eqx.Module):
    """A summary value that knows how to validate, report and accumulate itself.

    Summaries are `eqx.Module` PyTrees: their array fields are traced through `jax.jit`,
    `jax.lax.scan` and `jax.vmap` like any other leaf. Concrete kinds are final; write a
    new subclass of `Summary` for a new kind.

    Raw arrays (and Python numbers) are also valid summary leaves; when eqxctx
    accumulates them (e.g. `scan_in_context(..., merge_summaries=True)`) it adds them
    with `+`, as AXLearn does. A mean should therefore be a `WeightedSummary`, and a
    count of booleans a `SumSummary` of integers (`+` of JAX booleans is a logical
    or).
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
        """Return the accumulation of `self` and `other`; both are unchanged."""

    def identity(self) -> "Summary | None":
        """Return this kind's identity with `self`'s shapes and dtypes, or None.

        The identity leaves any accumulation unchanged: `s.identity().accumulate(s)`
        equals `s` (up to rounding for a weighted mean). Branches that do not add a
        summary (`cond_in_context`) and loops that run zero times
        (`while_in_context`) report it. The default is None: the kind has no
        identity (media kinds keep their first value, so nothing can stand in for a
        missing one). Override it in a new kind that has one.
        """
        return None


class WeightedSummary(Summary):
    """A weighted mean, e.g. a loss averaged over a number of examples.

    AXLearn's `WeightedScalar`. Accumulating two weighted summaries gives the weighted
    mean of their means, with the weights added. At zero total weight the mean is 0,
    and neither the value nor its gradient is NaN.

    Attributes:
        mean: the mean, any shape, floating dtype (traced).
        weight: the weight, shape `()` or `mean`'s shape, any real dtype (traced).

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
        """Check that `weight` is a scalar or has `mean`'s shape.

        Raises:
            ValueError: if `weight`'s shape is neither `()` nor `mean.shape`.
        """
        if self.weight.shape not in ((), self.mean.shape):
            raise ValueError(
                f"`WeightedSummary(mean, weight)`: weight has shape {self.weight.shape}"
                f", expected () or the mean's shape {self.mean.shape}."
            )

    def accumulate(self, other: "WeightedSummary") -> "WeightedSummary":
        """Return the weighted mean of both means, with the weights added.

        Mixed dtypes (a bfloat16 mean with a float32 one, integer weights with float
        ones) are promoted as under JAX's standard promotion, also when
        `jax_numpy_dtype_promotion="strict"` is set. A side with zero weight adds
        nothing, even if its mean is NaN (the 0/0 mean of an empty batch).
        """
        with jax.numpy_dtype_promotion("standard"):
            dtype = jnp.result_type(self.mean, other.mean)
            if not jnp.issubdtype(dtype, jnp.floating):
                dtype = jnp.float32
            w1 = self.weight.astype(dtype)
            w2 = other.weight.astype(dtype)
            total = w1 + w2
            # Double `where`s: no NaN in the value or its gradient at zero weight.
            m1 = jnp.where(w1 > 0, self.mean.astype(dtype), 0)
            m2 = jnp.where(w2 > 0, other.mean.astype(dtype), 0)
            numerator = m1 * w1 + m2 * w2
            positive = total > 0
            safe_total = jnp.where(positive, total, jnp.ones_like(total))
            mean = jnp.where(positive, numerator / safe_total, 0).astype(dtype)
            weight = self.weight + other.weight
        return WeightedSummary(mean, weight)

    def __add__(self, other: "WeightedSummary") -> "WeightedSummary":
        return self.accumulate(other)

    def identity(self) -> "WeightedSummary":
        """Return weight 0 (mean 0): it adds nothing to a weighted mean."""
        return WeightedSummary(jnp.zeros_like(self.mean), jnp.zeros_like(self.weight))


class MinSummary(Summary):
    """An elementwise minimum (AXLearn's `MinSummary`).

    Attributes:
        value_: the value, any shape and dtype (traced). Construct as
            `MinSummary(value)`.
    """

    value_: Array = eqx.field(converter=_as_array)

    def value(self) -> ArrayValue:
        """Return the minimum."""
        return self.value_

    def accumulate(self, other: "MinSummary") -> "MinSummary":
        """Return the elementwise minimum of both."""
        return MinSummary(jnp.minimum(self.value_, other.value_))

    def identity(self) -> "MinSummary":
        """Return the dtype's maximum (+inf for floats, True for booleans)."""
        return MinSummary(jnp.full_like(self.value_, _extreme(self.value_, True)))


class MaxSummary(Summary):
    """An elementwise maximum (AXLearn's `MaxSummary`).

    Attributes:
        value_: the value, any shape and dtype (traced). Construct as
            `MaxSummary(value)`.
    """

    value_: Array = eqx.field(converter=_as_array)

    def value(self) -> ArrayValue:
        """Return the maximum."""
        return self.value_

    def accumulate(self, other: "MaxSummary") -> "MaxSummary":
        """Return the elementwise maximum of both."""
        return MaxSummary(jnp.maximum(self.value_, other.value_))

    def identity(self) -> "MaxSummary":
        """Return the dtype's minimum (-inf for floats, False for booleans)."""
        return MaxSummary(jnp.full_like(self.value_, _extreme(self.value_, False)))


class SumSummary(Summary):
    """An elementwise sum.

    Attributes:
        value_: the value, any shape and dtype (traced). Construct as
            `SumSummary(value)`.
    """

    value_: Array = eqx.field(converter=_as_array)

    def value(self) -> ArrayValue:
        """Return the sum."""
        return self.value_

    def accumulate(self, other: "SumSummary") -> "SumSummary":
        """Return the elementwise sum of both."""
        return SumSummary(self.value_ + other.value_)

    def identity(self) -> "SumSummary":
        """Return 0."""
        return SumSummary(jnp.zeros_like(self.value_))


def _extreme(x: Array, largest: bool) -> Any:
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

    def accumulate(self: _S, other: _S) -> _S:
        """Return `self`: the first value is kept."""
        del other
        return self


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


class AudioSummary(_KeepFirst):
    """A waveform (AXLearn's `AudioSummary`).

    Accumulated (merged scan or vmap summaries, `SummaryAccumulator`), the first
    value is kept and later ones are dropped (media are not averaged): under
    `merge_summaries` that is the first iteration in execution order (the last index
    with `reverse=True`). For every iteration's value, keep per-iteration summaries.

    Attributes:
        value_: shape `[time]` or `[time, channels]`, floating values in `[-1, 1]`
            (traced). Construct as `AudioSummary(value, sample_rate=16000)`.
        sample_rate: samples per second (Hz), static.
    """

    value_: Array = eqx.field(converter=_as_array)
    sample_rate: int = eqx.field(static=True, default=16000)

    def value(self) -> ArrayValue:
        """Return the waveform."""
        return self.value_

    def validate(self) -> None:
        """Check the rank and the sample rate.

        Raises:
            ValueError: for a rank other than 1 or 2, no channel (`[time, 0]`) or a
                non-positive sample rate.
        """
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
        if self.sample_rate <= 0:
            raise ValueError(
                f"`AudioSummary`: sample_rate must be positive, got {self.sample_rate}."
            )


class CallbackSummary(_KeepFirst):
    """A summary whose value is computed on the host by `fn(*args, **kwargs)`.

    AXLearn's `CallbackSummary`: `args` and `kwargs` are traced PyTrees; `fn` is static
    and runs when the value is read (by a writer), outside `jax.jit`.
    Accumulated, the first value is kept (see `ImageSummary`). A writer fetches
    `args` and `kwargs` to the host first: `fn` receives NumPy arrays there, as in
    AXLearn.

    Attributes:
        fn: the callable, static (hashed by identity: pass the same function object
            to avoid recompilation).
        args: positional arguments, a PyTree (traced).
        kwargs: keyword arguments, a PyTree (traced).
    """

    fn: Callable[..., Any] = eqx.field(static=True)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any):
        self.fn = fn
        self.args = args
        self.kwargs = kwargs

    def value(self) -> Any:
        """Return `fn(*args, **kwargs)`."""
        return self.fn(*self.args, **self.kwargs)


def is_summary(x: object) -> bool:
    """Return whether `x` is a `Summary` (an `is_leaf` for `jax.tree_util`)."""
    return isinstance(x, Summary)


def accumulate_leaf(a: Any, b: Any) -> Any:
    """Accumulate two leaves: `Summary.accumulate`, else `+` (AXLearn's rule)."""
    if isinstance(a, Summary):
        return a.accumulate(b)
    return a + b


def leaf_value(x: Any) -> Any:
    """Return what a writer logs for a summary leaf: `value()` or the raw value."""
    if isinstance(x, Summary):
        return x.value()
    return x


def is_array_leaf(x: object) -> bool:
    """Return whether `x` is an array-like leaf accepted in a collection."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float))

"""Media summaries, which keep their first value: images, audio, host callbacks.

Follows AXLearn's `axlearn/common/summary.py` (`ImageSummary`, `AudioSummary`,
`CallbackSummary`).
"""

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._records import Audio, Image
from ._summary import Summary, as_array, check_same_kind
from ._typing import ArrayTree, ArrayValue


_S = TypeVar("_S", bound="_KeepFirst")


class _KeepFirst(Summary):
    """Accumulated, the first value in execution order is kept."""

    def accumulate(self: _S, other: Any) -> _S:
        """Return `self`: the first value is kept.

        Raises:
            ValueError: if `other` is another kind, or its arrays have other shapes
                (or other static fields).
        """
        check_same_kind(self, other, f"{type(self).__name__}.accumulate")
        return self

    def reduce_stacked(self: _S) -> _S:
        """Return the first of the stacked summaries (as `accumulate` keeps it)."""
        return jax.tree_util.tree_map(lambda a: a[0], self)


class ImageSummary(_KeepFirst):
    """A batch of images (AXLearn's `ImageSummary`).

    Accumulated (merged scans and vmaps, `SummaryAccumulator`), the first value in
    execution order is kept: media are not averaged.

    Attributes:
        value_: shape `[batch, height, width]` (grayscale) or
            `[batch, height, width, channels]` with channels 1, 3 (RGB) or 4 (RGBA);
            floating values in `[0, 1]` or `uint8` (traced). Construct as
            `ImageSummary(value)`.
    """

    value_: Array = eqx.field(converter=as_array)

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


def _as_int(x: object) -> object:
    """A NumPy integer as an `int` (a static field); anything else as it is."""
    return int(x) if isinstance(x, np.integer) else x


class AudioSummary(_KeepFirst):
    """A waveform (AXLearn's `AudioSummary`).

    Accumulated, the first value in execution order is kept (as `ImageSummary`).

    Attributes:
        value_: shape `[time]` or `[time, channels]`, floating values in `[-1, 1]`
            or `int16` PCM samples, written as they are (traced). Construct as
            `AudioSummary(value, sample_rate=16000)`.
        sample_rate: samples per second (Hz), a positive int, static. The writers
            encode 16-bit WAV, whose header (Python's `wave`, as tensorboardX)
            stores `sample_rate * channels * 2` bytes per second as a uint32:
            `validate` accepts `sample_rate <= (2**32 - 1) // (2 * channels)`.

    Raises:
        TypeError: if `sample_rate` is not an int (on construction).
    """

    value_: Array = eqx.field(converter=as_array)
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
    """A summary whose value is `fn(*args, **kwargs)`, computed on the host.

    AXLearn's `CallbackSummary`: `fn` runs when a writer reads the value, outside
    `jax.jit`, on `args` and `kwargs` fetched to the host (NumPy arrays).
    Accumulated, the first value is kept.

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
    replayable_host_value: ClassVar[bool] = False  # `fn` runs at every read

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

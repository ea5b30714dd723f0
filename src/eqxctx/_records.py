"""Host records: what a `Summary` gives the writers besides numbers (`host_value`).

A closed set, so that writers dispatch on these three types and never on a kind:
each writer's format decides how to write a histogram, images or audio.
"""

import dataclasses
import functools

import jax
import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Histogram:
    """Bucket counts to write as a histogram (`HistogramSummary.host_value`).

    Attributes:
        counts: NumPy integer array `[*batch, bins]`, the count of each bucket.
        edges: the `bins + 1` bucket edges, strictly increasing (a tuple of floats);
            bucket `i` is `[edges[i], edges[i + 1])`, the last one closed.
    """

    counts: np.ndarray
    edges: tuple[float, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Image:
    """A batch of images to write (`ImageSummary.host_value`).

    Attributes:
        images: NumPy array `[batch, height, width]` or `[batch, height, width,
            channels]` (channels 1, 3 or 4), floats in `[0, 1]` or `uint8`.
    """

    images: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class Audio:
    """A waveform to write (`AudioSummary.host_value`).

    Attributes:
        samples: NumPy array `[time]` or `[time, channels]`, floats in `[-1, 1]` or
            `int16` PCM samples.
        sample_rate: samples per second (Hz), a positive int.
    """

    samples: np.ndarray
    sample_rate: int


# PyTrees (the arrays are leaves), so that reads can be compared leaf by leaf.
jax.tree_util.register_dataclass(
    Histogram, data_fields=["counts"], meta_fields=["edges"]
)
jax.tree_util.register_dataclass(Image, data_fields=["images"], meta_fields=[])
jax.tree_util.register_dataclass(
    Audio, data_fields=["samples"], meta_fields=["sample_rate"]
)

#: The record types, for `isinstance` checks (`Histogram`, `Image`, `Audio`).
RECORDS = (Histogram, Image, Audio)


@functools.cache
def is_record_type(cls: type) -> bool:
    """Whether values of `cls` are host records (one check per type)."""
    return issubclass(cls, RECORDS)

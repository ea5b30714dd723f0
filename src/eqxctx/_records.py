"""Host records: what a `Summary` gives the writers besides numbers (`host_value`).

A closed set, so that writers dispatch on these three types and never on a kind:
each writer's format decides how to write a histogram, images or audio.
"""

import dataclasses
import functools
import itertools

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

    def __post_init__(self) -> None:
        """Check the record where it is made (a user kind's `host_value` makes one).

        Raises:
            TypeError: for counts that are not integers.
            ValueError: for fewer than 2 edges, edges not strictly increasing,
                negative counts, or counts whose last axis is not `len(edges) - 1`.
        """
        edges = tuple(float(e) for e in np.asarray(self.edges).reshape(-1))
        object.__setattr__(self, "edges", edges)
        if len(edges) < 2 or not all(a < b for a, b in itertools.pairwise(edges)):
            raise ValueError(
                "`Histogram`: edges must be at least 2 strictly increasing numbers "
                f"(the buckets' bounds), got {edges}."
            )
        counts = self.counts
        if type(counts) is not np.ndarray:
            return  # (a PyTree rebuilt by JAX, with other leaves)
        if counts.dtype.kind not in "iu":
            raise TypeError(
                f"`Histogram`: counts must be integers, got {counts.dtype} (round "
                "or cast them: a bucket holds a whole number of values)."
            )
        if counts.ndim < 1 or counts.shape[-1] != len(edges) - 1:
            raise ValueError(
                f"`Histogram`: counts of shape {counts.shape} for {len(edges)} edges; "
                f"the last axis must have one count per bucket ({len(edges) - 1})."
            )
        if counts.size and counts.min() < 0:
            raise ValueError("`Histogram`: counts must be non-negative.")


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

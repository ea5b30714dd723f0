"""The data: scikit-learn's handwritten digits, split and batched as NumPy arrays."""

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np


#: The number of digits in `sklearn.datasets.load_digits`.
NUM_DIGITS = 1797
TEST_FRACTION = 0.2

#: A batch: `{"image": float32[batch, 64], "label": int32[batch],
#: "weight": float32[batch]}`; padding examples have weight 0.
Batch = dict[str, np.ndarray]


class Split(NamedTuple):
    """One part of the data set.

    Attributes:
        images: `float32[n, 64]`, the 8x8 images flattened, scaled to [0, 1].
        labels: `int32[n]`, the digits 0-9.
    """

    images: np.ndarray
    labels: np.ndarray


def split_sizes(test_fraction: float = TEST_FRACTION) -> tuple[int, int]:
    """Return the `(train, test)` sizes of `load_digits_split` without loading it."""
    num_test = round(NUM_DIGITS * test_fraction)
    return NUM_DIGITS - num_test, num_test


def load_digits_split(
    *, seed: int, test_fraction: float = TEST_FRACTION
) -> tuple[Split, Split]:
    """Return `(train, test)`: the 1,797 digits of `sklearn.datasets.load_digits`.

    The split is a permutation drawn with `numpy.random.default_rng(seed)`: the same
    seed gives the same split on every machine. Nothing is downloaded (the data ship
    inside scikit-learn).
    """
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(labels))
    num_test = round(len(labels) * test_fraction)
    images = (images / 16.0).astype(np.float32)
    labels = labels.astype(np.int32)
    test, train = order[:num_test], order[num_test:]
    return Split(images[train], labels[train]), Split(images[test], labels[test])


def train_batches(split: Split, *, batch_size: int, seed: int) -> Iterator[Batch]:
    """Yield training batches forever: each epoch is a new permutation (seeded).

    Every batch has exactly `batch_size` examples (an epoch's remainder is dropped),
    so the training step compiles once.

    Raises:
        ValueError: if `batch_size` is larger than the split (no batch would fill).
    """
    if batch_size > len(split.labels):
        raise ValueError(
            f"`train_batches`: batch_size {batch_size} is larger than the "
            f"{len(split.labels)} examples of the split."
        )
    rng = np.random.default_rng(seed)
    weight = np.ones(batch_size, dtype=np.float32)
    while True:
        order = rng.permutation(len(split.labels))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[start : start + batch_size]
            yield {
                "image": split.images[idx],
                "label": split.labels[idx],
                "weight": weight,
            }


def eval_batches(split: Split, *, batch_size: int) -> Iterator[Batch]:
    """Yield the split in order, in batches of `batch_size`; the last one is padded.

    Padding examples repeat the first example with weight 0, so every batch has one
    shape (one compilation) and the weighted metrics ignore them.
    """
    n = len(split.labels)
    for start in range(0, n, batch_size):
        idx = np.arange(start, start + batch_size)
        real = idx < n
        idx = np.where(real, idx, 0)
        yield {
            "image": split.images[idx],
            "label": split.labels[idx],
            "weight": real.astype(np.float32),
        }

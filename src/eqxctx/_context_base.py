"""A `Context`'s fields and what reads them (`_context.py` adds the rest)."""

import dataclasses
from typing import NoReturn

import numpy as np
from jaxtyping import Array, ArrayLike, Bool

from ._collection import OutputCollection
from ._frame import DERIVED, Frame, key_of, path_of
from ._frozen import TreeEquality
from ._rows import row_where
from ._typing import MaybeKey


class ContextBase(TreeEquality):
    """The slots and read-only properties of `Context` (documented there)."""

    # The collection, and a `Frame` with everything else: adding an output makes a
    # context with a new collection and the same frame.
    __slots__ = ("_frame", "collection")
    _frame: Frame
    collection: OutputCollection

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field '{name}'")

    def __repr__(self) -> str:
        mask = self._frame.row_mask
        return (
            f"{type(self).__name__}(path={self.path!r}, prng_key={self.prng_key!r}, "
            f"is_training={self.is_training!r}, collection={self.collection!r}, "
            f"summary_level={self.summary_level!r}"
            + ("" if mask is None else f", row_mask={mask.array!r}")
            + ")"
        )

    def __reduce__(self) -> tuple[object, ...]:
        mask = self._frame.row_mask
        mask = None if mask is None else mask.array
        args = (self.path, self.prng_key, self.is_training, self.collection)
        return type(self), (*args, self.summary_level, mask)

    @property
    def path(self) -> tuple[str, ...]:
        """The names from the root to this context (a child's, built on each read)."""
        frame = self._frame
        path = frame.path
        return path_of(frame) if path is None else path

    @property
    def prng_key(self) -> MaybeKey:
        """The key: a child's is `jax.random.fold_in(parent_key, seed(name))`.

        Folded in on each read (D `fold_in`s for D levels) from the nearest
        ancestor whose key is known: the root, an iteration, a context unflattened
        by a transformation. None in a keyless context.
        """
        frame = self._frame
        key = frame.key
        return key_of(frame) if key is DERIVED else key

    @property
    def is_training(self) -> bool:
        """Whether the model runs in training mode (static)."""
        return self._frame.is_training

    @property
    def summary_level(self) -> int | None:
        """The summary level (static): see `Context.root`."""
        return self._frame.summary_level

    @property
    def row_mask(self) -> Bool[Array, " batch"] | np.ndarray | None:
        """The padded step's real rows: `bool[batch]` (traced), or None.

        Under a `MethodRunner` step with `pad_batches=True` (or a `mask_kwarg`),
        True for real rows and False for padding; None elsewhere. Inherited by
        every child and iteration (inside `vmap_in_context`, still the whole
        batch's). Count only real rows: `MomentsSummary(x,
        where=ctx.row_where(x))`. Reading it tells the runner that the method
        handles padding; a padded step that never reads it warns once.
        """
        mask = self._frame.row_mask
        if mask is None:
            return None
        mask.reads.read = True
        return mask.array

    def row_where(self, x: ArrayLike) -> Bool[Array, "batch ..."] | np.ndarray | None:
        """Return `where=` for a summary of `x`'s rows: the row mask, or None.

        `Context.row_mask` reshaped to `bool[batch, 1, ..., 1]` with `x`'s rank, so
        that it broadcasts as NumPy's `where=` does; None outside a padded step.

        Args:
            x: an array whose leading axis is the batch (only its shape is read).

        Returns:
            `bool[batch, 1, ..., 1]`, or None.

        Raises:
            ValueError: under a padded step, if `x` is a scalar or its leading size
                is not the batch's (naming the context path).
        """
        mask = self.row_mask
        if mask is None:
            return None
        return row_where(mask, x, "/".join(self.path))

    @property
    def name(self) -> str:
        """The last entry of `path`."""
        return self.path[-1]


# The slots' own setters: faster than `object.__setattr__`, and the class's
# `__setattr__` (which refuses every assignment) is not involved.
set_frame = ContextBase.__dict__["_frame"].__set__
set_collection = ContextBase.__dict__["collection"].__set__

"""The row mask of a padded runner step, as every context carries it (`ctx.row_mask`).

A `MethodRunner` with `pad_batches=True` (or a `mask_kwarg`) pads a batch's rows;
its root context holds the step's `bool[batch]` mask of the real rows, and every
child, iteration (scan, vmap, branch, loop) and context rebuilt by a transformation
inherits it, as `is_training`. `RowMask` is that value: the array and a `MaskReads`
shared by every context of one root, so that the runner can tell a padded step whose
summaries never read the mask (it warns once: the padded rows would count).
"""

from typing import Any

import jax
import numpy as np
from jaxtyping import Array, ArrayLike, Bool


class MaskReads:
    """Whether model code has read a root's row mask (`Context.row_mask`).

    One per root context, shared by its children and by the contexts that JAX
    transformations rebuild (it is the static part of `RowMask`'s PyTree node, so it
    compares by identity). The only state a context shares: set when the mask is
    read, read by the runner after the method has been traced.
    """

    __slots__ = ("read",)

    def __init__(self) -> None:
        self.read = False


class RowMask:
    """A step's row mask (`bool[batch]`, True for real rows) and its `MaskReads`.

    A PyTree node: the array is its child (traced), the `MaskReads` its static part.
    """

    __slots__ = ("array", "reads")

    def __init__(self, array: Any, reads: MaskReads):
        self.array = array
        self.reads = reads


jax.tree_util.register_pytree_node(
    RowMask,
    lambda m: ((m.array,), m.reads),
    lambda reads, children: RowMask(children[0], reads),
)


def check_row_mask(mask: object, where: str) -> RowMask | None:
    """Return `mask` as a new root's `RowMask`, or None for None.

    Raises:
        TypeError: if `mask` is not a bool array of rank 1 (naming `where`).
    """
    if mask is None:
        return None
    dtype = getattr(mask, "dtype", None)
    shape = getattr(mask, "shape", None)
    if dtype is None or shape is None:
        given = type(mask).__name__
    elif np.dtype(dtype) != np.bool_ or len(shape) != 1:
        given = f"an array of dtype {dtype} and shape {tuple(shape)}"
    else:
        return RowMask(mask, MaskReads())
    raise TypeError(
        f"`{where}(row_mask=...)`: expected None or a `bool[batch]` array (True "
        f"for the batch's real rows), got {given}."
    )


def row_where(
    mask: Bool[Array, " batch"] | np.ndarray, x: ArrayLike, path: str
) -> Bool[Array, "batch ..."] | np.ndarray:
    """Return `mask` shaped `[batch, 1, ..., 1]` with `x`'s rank (see `row_where`).

    Raises:
        ValueError: if `x` is a scalar or its leading size is not the mask's.
    """
    shape = np.shape(x)
    rows = int(np.shape(mask)[0])
    if not shape or shape[0] != rows:
        raise ValueError(
            f"`Context.row_where(x)` in context {path!r}: x of shape {shape} has no "
            f"leading (batch) axis of the step's {rows} rows. Pass a value whose "
            "first axis is the batch's (inside a `vmap_in_context` over the rows, "
            "mask outside the vmap)."
        )
    return mask.reshape((rows,) + (1,) * (len(shape) - 1))

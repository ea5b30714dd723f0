"""The contexts eqxctx hands to bodies, and what combinators read of a context.

A body is a function that a combinator, `value_and_grad` or the runner calls with a
context: an iteration of a scan, vmap, branch or loop, or the root of a
differentiated function.
"""

from typing import Any

from ._collection import OutputCollection
from ._context import Context, frame_of, make_context
from ._frame import UNSET, Frame, keyed_frame
from ._typing import MaybeKey, PRNGKey


def check_context(value: object, where: str) -> None:
    """Raise `TypeError` naming `where` unless `value` is a `Context`."""
    if not isinstance(value, Context):
        given = f"{type(value).__name__} {value!r}"[:100]
        raise TypeError(
            f"`{where}(context=...)`: context must be a `Context` (the calling "
            f"context, e.g. `Context.root()` or the `ctx` your method was handed), got "
            f"{given}."
        )


def iteration_context(
    parent: Context,
    name: str,
    prng_key: PRNGKey | None,
    *,
    shape_only: bool,
    gradients: Any = UNSET,
) -> Context:
    """The context of iteration `name` of a scan or vmap (`gradients`: the parent's)."""
    frame = frame_of(parent)
    at = keyed_frame(
        frame,
        (*parent.path, name),
        prng_key,
        frame.is_training,
        shape_only or frame.shape_only,
        frame.gradients if gradients is UNSET else gradients,
    )
    return make_context(at, OutputCollection.empty())


def gradient_root(
    prng_key: MaybeKey,
    is_training: bool,
    *,
    shape_only: bool,
    gradients: Any,
    summary_level: int | None = None,
) -> Context:
    """A root context (named "root") carrying a `_gradients.GradientState`."""
    frame = Frame(
        ("root",), prng_key, is_training, shape_only, summary_level, gradients
    )
    return make_context(frame, OutputCollection.empty())


def gradient_state(ctx: Context) -> Any:
    """The context's `_gradients.GradientState`, or None (no `value_and_grad`)."""
    return frame_of(ctx).gradients


def row_mask_read(ctx: Context) -> bool:
    """Whether model code read `ctx`'s row mask (in any context of its root)."""
    mask = frame_of(ctx).row_mask
    return mask is not None and mask.reads.read


def is_shape_only(ctx: Context) -> bool:
    """Whether `ctx` is used inside one of eqxctx's shape-only passes."""
    return frame_of(ctx).shape_only

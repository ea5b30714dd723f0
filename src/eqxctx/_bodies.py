"""The contexts eqxctx hands to bodies, and what combinators read of a context.

A body is a function that a combinator, `value_and_grad` or the runner calls with a
context: an iteration of a scan, vmap, branch or loop, or the root of a
differentiated function.
"""

from typing import Any

from ._collection import OutputCollection
from ._context import Context, frame_of, make_context
from ._frame import UNSET, Frame, keyed_frame
from ._ledger import Ledger, lost_error, unreturned
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
        Ledger(),
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
        ("root",),
        prng_key,
        is_training,
        shape_only,
        summary_level,
        gradients,
        ledger=Ledger(),
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


def owned(ctx: Context) -> Context:
    """`ctx` with a fresh ledger, for the call that owns it (see `_ledger`)."""
    f = frame_of(ctx)
    frame = Frame(
        f.path,
        f.key,
        f.is_training,
        f.shape_only,
        f.summary_level,
        f.gradients,
        f.up,
        f.name,
        row_mask=f.row_mask,
        ledger=Ledger(),
    )
    return make_context(frame, ctx.collection)


def check_lost(returned: Context, given: Context, what: str) -> None:
    """Raise `LostOutputError` if the body handed `given` lost an output.

    `returned` is the context the body returned; `what` names the body.
    """
    collection = returned.collection
    if lost := unreturned(
        frame_of(given).ledger, frame_of(returned).ledger, collection
    ):
        raise lost_error(lost, what, "/".join(returned.path))


def note_result(context: Context, collection: OutputCollection) -> None:
    """Record a combinator's `collection`: it must be merged into `context`'s line."""
    ledger = frame_of(context).ledger
    if ledger is not None:
        ledger.record("result", collection, collection)

"""functional: run a context-taking function from a fresh root context."""

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np
from jaxtyping import PyTree

from ._bodies import check_lost, owned
from ._checks import (
    check_is_training,
    check_path,
    check_prng_key,
    check_summary_level,
    note_missing_key,
)
from ._collection import KINDS, OutputCollection
from ._context import Context, check_returns_context
from ._typing import PRNGKey


R = TypeVar("R")


def functional(
    fn: Callable[..., tuple[R, Context]],
    *,
    prng_key: PRNGKey | None,
    is_training: bool | np.bool_,
    args: Sequence[PyTree] = (),
    kwargs: Mapping[str, PyTree] | None = None,
    drop_output_collections: Sequence[str] = ("module_outputs",),
    summary_level: int | None = None,
) -> tuple[R, OutputCollection]:
    """Run `fn(*args, ctx, **kwargs)` in a new root context; return its outputs.

    Follows AXLearn's `functional` (`axlearn/common/module.py`): the root context gets
    `prng_key` and `is_training`, and the returned collection has the kinds named in
    `drop_output_collections` emptied. Nothing is global: concurrent calls (threads)
    are independent.

    Args:
        fn: called as `fn(*args, ctx, **kwargs) -> (outputs, ctx)`.
        prng_key: the root key (raw `uint32[2]` or typed), or None.
        is_training: training mode of the root context (static).
        args: positional arguments before the context.
        kwargs: keyword arguments (not mutated).
        drop_output_collections: kinds to empty in the returned collection, among
            `"summaries"`, `"state_updates"`, `"module_outputs"`.
        summary_level: the root context's summary level (static): summaries and
            module outputs added with `level > summary_level` are dropped (see
            `Context.add_summary`); None (the default) keeps everything.

    Returns:
        `(outputs, collection)`.

    Raises:
        ValueError: for an unknown kind in `drop_output_collections`, or if `fn`
            returns a context other than the one it was handed (naming both paths).
        TypeError: if `args` is not a tuple or list (`args=(x,)` for one
            argument), `fn` does not return `(outputs, Context)`, `is_training` is not
            a bool, `summary_level` is neither None nor an int, or `prng_key` is
            neither None, a raw `uint32[2]` key nor a typed key.
        LostOutputError: if an output added in `fn` is missing from the context it
            returns (naming its path and the add's line; see `Context.discard`).

    Examples:
        >>> def f(x, ctx):
        ...     return x + 1, ctx.add_summary("x", x)
        >>> out, coll = functional(f, prng_key=None, is_training=False, args=(1,))
        >>> out, coll.flatten("summaries")
        (2, {'x': 1})
    """
    if isinstance(drop_output_collections, str):
        raise ValueError(
            "`functional(drop_output_collections=...)`: expected a sequence of kinds, "
            f"got the string {drop_output_collections!r}; write "
            f"({drop_output_collections!r},)."
        )
    drop = tuple(drop_output_collections)
    for kind in drop:
        if kind not in KINDS:
            raise ValueError(
                f"`functional(drop_output_collections=...)`: unknown kind {kind!r}; "
                f"expected some of {KINDS}."
            )
    if not isinstance(args, (tuple, list)):  # an array would be unpacked by rows
        raise TypeError(
            "`functional(args=...)`: expected a tuple of positional arguments, got "
            f"{type(args).__name__}; write `args=(x,)` for one argument."
        )
    prng_key = check_prng_key(prng_key, "functional")
    is_training = check_is_training(is_training, "functional")
    level = check_summary_level(summary_level, "functional")
    ctx = owned(
        Context.root(prng_key=prng_key, is_training=is_training, summary_level=level)
    )
    try:
        result = fn(*args, ctx, **(kwargs or {}))
    except TypeError as e:
        note_missing_key(e, ctx, "`functional(fn)`")
        raise
    outputs, out_ctx = check_returns_context(result, "`functional(fn)`: fn")
    check_path(out_ctx, ctx, "`functional(fn)`: fn")
    check_lost(out_ctx, ctx, "`functional(fn)`: fn")
    coll = out_ctx.collection
    fields = {kind: {} if kind in drop else getattr(coll, kind) for kind in KINDS}
    return outputs, OutputCollection(**fields)

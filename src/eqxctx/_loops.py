"""Loops with contexts: while_in_context and fori_in_context.

`jax.lax.while_loop` / `fori_loop` whose bodies add summaries, accumulated in the loop
carry (identities before the first iteration); `fori_in_context` with static bounds is
`scan_in_context`.
"""

import operator
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.core import Tracer
from jaxtyping import Array, ArrayLike

from ._checks import check_context, check_drop
from ._collection import OutputCollection, validate_child_name
from ._combinators import scan_in_context
from ._context import Context, fold_in_name, is_shape_only, iteration_context
from ._control import check_result
from ._reconcile import identity_of
from ._repeat import accumulate_trees, accumulator_shape, cast_like
from ._summary import Summary
from ._typing import ArrayTree, Carry, Leaf, PRNGKeys, SummaryTree


def _no_stacked_outputs(coll: OutputCollection, prefix: str, where: str) -> None:
    for kind in ("state_updates", "module_outputs"):
        flat = coll.flatten(kind)
        if flat:
            path = f"{kind}/{prefix}/{min(flat)}"
            raise ValueError(
                f"{where}: the body adds {path}, but a while loop's number of "
                "iterations is unknown, so its module outputs and state updates "
                "cannot be stacked. Add it as a summary (accumulated over the "
                "iterations), or loop with `fori_in_context` over Python-int bounds "
                "(a scan) or `scan_in_context`."
            )


def _identity_tree(summaries: SummaryTree) -> SummaryTree:
    """Identities for an accumulator: `Summary.identity`, zeros for arrays and media."""

    def zeros_or_identity(s: Leaf) -> Leaf:
        if isinstance(s, Summary):
            ident = identity_of(s)
            if ident is not None:
                return ident
            return jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), s)
        return jnp.zeros(s.shape, s.dtype)

    return jax.tree_util.tree_map(
        zeros_or_identity, summaries, is_leaf=lambda x: isinstance(x, Summary)
    )


def while_in_context(
    cond_fn: Callable[[Carry], ArrayLike],
    body_fn: Callable[[Carry, Context], tuple[Carry, Context]],
    init_val: Carry,
    *,
    context: Context,
    child_name: str = "while",
) -> tuple[Carry, OutputCollection]:
    """Run `body_fn` while `cond_fn` holds, with `jax.lax.while_loop`.

    Iteration i (from 0) calls `body_fn(val, ctx_i) -> (val, ctx_i)` in a fresh
    context (path `(*context.path, child_name)`, key `fold_in(child_key, i)` with
    `child_key = fold_in(context.prng_key, seed(child_name))`). Its summaries are
    accumulated across iterations inside the loop, as with
    `scan_in_context(..., merge_summaries=True)` (`Summary.accumulate`, `+` for raw
    arrays), into child `child_name` of the returned collection; the structure is
    the body's. With zero iterations each summary is its kind's identity (0 for raw
    arrays; zeros for media kinds, which have none).

    Args:
        cond_fn: `cond_fn(val) -> bool scalar` (traced).
        body_fn: the body, `body_fn(val, ctx) -> (val, ctx)`; traced twice (one
            abstract pass gives the accumulator's structure).
        init_val: the initial value, any PyTree (traced).
        context: the calling context.
        child_name: the child's name, matching `^[a-z][a-z0-9_]*$`.

    Returns:
        `(val, collection)`: the final value and the construct's collection.

    Raises:
        ValueError: at trace time: an invalid `child_name`; a body that adds module
            outputs or state updates (the message names the path); a body returning
            a context with another path.
        TypeError: if `body_fn` does not return `(val, ctx)`.

    References:
        `jax.lax.while_loop`.

    Examples:
        >>> from eqxctx import SumSummary
        >>> def body(x, ctx):
        ...     return x * 2, ctx.add_summary("n", SumSummary(1))
        >>> x, coll = while_in_context(
        ...     lambda x: x < 10, body, 1, context=Context.root()
        ... )
        >>> int(x), int(coll.flatten("summaries")["while/n"].value())
        (16, 4)
    """
    check_context(context, "while_in_context")
    name = validate_child_name(child_name, where="while_in_context(child_name=...)")
    where = "`while_in_context`"
    child_key: PRNGKeys | None = fold_in_name(context.prng_key, name)

    def one(val: Carry, i: Array, shape_only: bool) -> tuple[Carry, OutputCollection]:
        key = None if child_key is None else jax.random.fold_in(child_key, i)
        ctx = iteration_context(context, name, key, shape_only=shape_only)
        result = body_fn(val, ctx)
        val, ctx = check_result(result, ctx, f"{where}: body_fn")
        return val, ctx.collection

    i0 = jnp.zeros((), jnp.uint32)
    if is_shape_only(context):
        val, coll = one(init_val, i0, True)
        _no_stacked_outputs(coll, name, where)
        like = accumulator_shape(coll.summaries)
        acc = cast_like(coll.summaries, like)
        return cast_like_tree(val, init_val), _result(name, acc)

    shapes = jax.eval_shape(lambda v, i: one(v, i, True), init_val, i0)
    _no_stacked_outputs(shapes[1], name, where)
    like = accumulator_shape(shapes[1].summaries)
    acc0 = cast_like(_identity_tree(like), like)

    def cond(state: tuple[Carry, SummaryTree, Array, Array]) -> ArrayLike:
        return cond_fn(state[0])

    def body(
        state: tuple[Carry, SummaryTree, Array, Array],
    ) -> tuple[Carry, SummaryTree, Array, Array]:
        val, acc, first, i = state
        new_val, coll = one(val, i, False)
        new = cast_like(coll.summaries, like)
        summed = cast_like(accumulate_trees(acc, new), like)
        acc = jax.tree_util.tree_map(lambda a, b: jnp.where(first, a, b), new, summed)
        return cast_like_tree(new_val, val), acc, jnp.array(False), i + 1

    with jax.named_scope(name):
        val, acc, _, _ = jax.lax.while_loop(
            cond, body, (init_val, acc0, jnp.array(True), i0)
        )
    return val, _result(name, acc)


def cast_like_tree(tree: ArrayTree, like: ArrayTree) -> ArrayTree:
    """Return `tree` with each leaf cast to the dtype of `like`'s (weak types too)."""
    return jax.tree_util.tree_map(
        lambda x, s: jnp.asarray(x, jnp.result_type(s)), tree, like
    )


def _result(name: str, summaries: SummaryTree) -> OutputCollection:
    return OutputCollection.empty().add_child(name, OutputCollection(summaries, {}, {}))


def _static_int(x: object) -> int | None:
    if isinstance(x, (bool, Tracer)):
        return None
    try:
        return operator.index(x)  # pyright: ignore[reportArgumentType]
    except TypeError:
        return None


def fori_in_context(
    lower: ArrayLike,
    upper: ArrayLike,
    body_fn: Callable[[Array, Carry, Context], tuple[Carry, Context]],
    init_val: Carry,
    *,
    context: Context,
    child_name: str = "iter",
    merge_summaries: bool = False,
    drop_output: Callable[[str], bool] | None = None,
    unroll: int | bool = 1,
    remat_kwargs: Mapping[str, object] | None = None,
) -> tuple[Carry, OutputCollection]:
    """Run `body_fn(i, val, ctx)` for `i` in `[lower, upper)`, collecting outputs.

    With Python-int bounds this is `scan_in_context` over `jnp.arange(lower, upper)`
    (the same program): iteration k (`i = lower + k`) has child `{child_name}{k}`
    for its summaries (or, with `merge_summaries=True`, they are accumulated into
    child `child_name`), and module outputs and state updates are stacked in child
    `child_name`; the options are `scan_in_context`'s. With traced bounds it is
    `while_in_context` (summaries always accumulated, no module outputs or state
    updates; `drop_output` prunes each iteration's collection; `unroll` and
    `remat_kwargs` must keep their defaults).

    Args:
        lower: the first `i`, a Python int or a traced integer scalar.
        upper: the end (exclusive), likewise.
        body_fn: the body, `body_fn(i, val, ctx) -> (val, ctx)`; `i` is an int32
            scalar (static bounds) or has the bounds' dtype (traced bounds).
            Concrete integers (Python ints, NumPy or concrete JAX integer scalars)
            count as static bounds.
        init_val: the initial value, any PyTree (traced).
        context: the calling context.
        child_name: the child (prefix) name, matching `^[a-z][a-z0-9_]*$`.
        merge_summaries: static bounds: accumulate summaries instead of children.
        drop_output: prunes each iteration's collection (see `scan_in_context`).
        unroll: static bounds: passed to `jax.lax.scan`.
        remat_kwargs: static bounds: passed to `jax.checkpoint` (see
            `scan_in_context`).

    Returns:
        `(val, collection)`: the final value and the construct's collection.

    Raises:
        ValueError: as `scan_in_context` (static bounds) or `while_in_context`
            (traced bounds); traced bounds with `unroll` or `remat_kwargs` set.
        TypeError: if `body_fn` does not return `(val, ctx)`.

    References:
        `jax.lax.fori_loop`.
    """
    check_context(context, "fori_in_context")
    check_drop(drop_output, "fori_in_context")
    lo, hi = _static_int(lower), _static_int(upper)
    if lo is not None and hi is not None:

        def scan_body(
            val: Carry, i: Array, ctx: Context
        ) -> tuple[Carry, None, Context]:
            result = body_fn(i, val, ctx)
            new, ctx = check_result(result, ctx, "`fori_in_context`: body_fn")
            return new, None, ctx

        val, _, coll = scan_in_context(
            scan_body,
            context=context,
            carry=init_val,
            xs=jnp.arange(lo, max(hi, lo), dtype=jnp.int32),
            drop_output=drop_output,
            child_name_prefix=child_name,
            unroll=unroll,
            remat_kwargs=remat_kwargs,
            merge_summaries=merge_summaries,
        )
        return val, coll
    if unroll != 1 or remat_kwargs is not None:
        raise ValueError(
            "`fori_in_context`: `unroll` and `remat_kwargs` need Python-int bounds "
            "(a scan); with traced bounds the loop is a `jax.lax.while_loop`."
        )
    with jax.numpy_dtype_promotion("standard"):
        dtype = jnp.result_type(lower, upper)
    lo_a, hi_a = jnp.asarray(lower, dtype), jnp.asarray(upper, dtype)

    def body(
        state: tuple[Array, Carry], ctx: Context
    ) -> tuple[tuple[Array, Carry], Context]:
        i, val = state
        result = body_fn(i, val, ctx)
        new, ctx_out = check_result(result, ctx, "`fori_in_context`: body_fn")
        if drop_output is not None:
            ctx_out = ctx_out.replace_collection(ctx_out.collection.prune(drop_output))
        return (i + jnp.ones((), dtype), new), ctx_out

    (_, val), coll = while_in_context(
        lambda s: s[0] < hi_a,
        body,
        (lo_a, init_val),
        context=context,
        child_name=child_name,
    )
    return val, coll

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

from ._bodies import check_context, is_shape_only, iteration_context, note_result
from ._carry import LoopState, Names, check_carry, promote_weak
from ._checks import check_drop, note_missing_key
from ._collection import OutputCollection, validate_child_name
from ._combinators import scan_in_context
from ._context import Context
from ._control import check_result
from ._frame import fold_in_name
from ._gradients import PendingGradient, is_pending
from ._reconcile import identity_of
from ._repeat import accumulator_shape, cast_like
from ._summary import Summary
from ._typing import Carry, Leaf, PRNGKeys, SummaryTree


def _no_stacked_outputs(coll: OutputCollection, path: str, where: str) -> None:
    for kind in ("state_updates", "module_outputs"):
        flat = coll.flatten(kind)
        if flat:
            noun = "module output" if kind == "module_outputs" else "state update"
            at = f"{path}/{min(flat)}"
            raise ValueError(
                f"{where}: the body adds the {noun} {at!r}, but a while "
                "loop's number of iterations is unknown, so its module outputs and "
                "state updates cannot be stacked. Drop them with `drop_output=` "
                "(e.g. `drop_output=lambda path: path.startswith(('module_outputs', "
                "'state_updates'))`), add it as a summary (accumulated over the "
                "iterations), or loop with `fori_in_context` over Python-int bounds "
                "(a scan) or `scan_in_context`."
            )


def _no_probes(coll: OutputCollection, where: str, why: str) -> None:
    """Raise for a gradient probe in a while body: JAX has no reverse mode for it."""
    for leaf in jax.tree_util.tree_leaves(coll, is_leaf=is_pending):
        if isinstance(leaf, PendingGradient):
            path, _, name = leaf.key
            raise ValueError(
                f"{where}: the body adds a gradient probe "
                "(add_gradient_summary/add_gradient_output) at "
                f"{'/'.join((*path, name))!r}, but {why}. Move the probe out of the "
                "loop, or loop with `fori_in_context` over Python-int bounds (a "
                "scan; e.g. a static maximum, masking the extra iterations) or "
                "`scan_in_context`."
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
    drop_output: Callable[[str], bool] | None = None,
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

    A while body keeps summaries only: the number of iterations is unknown, so
    module outputs and state updates cannot be stacked. A body that adds them (a
    layer written for `scan_in_context`, say) runs with `drop_output` pruning them
    from each iteration's collection, e.g.
    `drop_output=lambda path: not path.startswith("summaries")`.

    Args:
        cond_fn: `cond_fn(val) -> bool scalar` (traced).
        body_fn: the body, `body_fn(val, ctx) -> (val, ctx)`; traced twice (one
            abstract pass gives the accumulator's structure).
        init_val: the initial value, any PyTree (traced).
        context: the calling context.
        child_name: the child's name, matching `^[a-z][a-z0-9_]*$`.
        drop_output: `drop_output(path) -> bool` prunes each iteration's collection
            before its summaries are accumulated, as in `scan_in_context`: paths
            are relative to the iteration (`"module_outputs/h"`,
            `"summaries/attn/mean"`) and dropped outputs are never computed into
            the loop. None keeps everything.

    Returns:
        `(val, collection)`: the final value and the construct's collection.

    The body must return a carry of `init_val`'s structure, shapes and dtypes, as
    in `jax.lax.while_loop` (nothing is cast); a weakly typed leaf of `init_val` (a
    Python scalar) is first promoted to the body's dtype, as JAX does.

    Raises:
        ValueError: at trace time: an invalid `child_name`; a body that adds module
            outputs or state updates that `drop_output` keeps, or a gradient probe
            (JAX cannot differentiate a while loop in reverse mode; the messages
            name the path); a body returning a context with another path.
        TypeError: if `drop_output` is neither None nor callable, if `body_fn` does
            not return `(val, ctx)`, or returns a carry of another structure, shape
            or dtype (the message names the carry's path).

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
    check_drop(drop_output, "while_in_context")
    name = validate_child_name(child_name, where="while_in_context(child_name=...)")
    val, coll = _while(
        cond_fn,
        body_fn,
        init_val,
        context,
        name,
        drop_output,
        where="`while_in_context`",
        view=lambda val: val,
        why="JAX cannot differentiate a `jax.lax.while_loop` in reverse mode",
    )
    note_result(context, coll)
    return val, coll


def _while(
    cond_fn: Callable[[Carry], ArrayLike],
    body_fn: Callable[[Carry, Context], tuple[Carry, Context]],
    init_val: Carry,
    context: Context,
    name: str,
    drop_output: Callable[[str], bool] | None,
    *,
    where: str,
    view: Callable[[Carry], object],
    why: str,
) -> tuple[Carry, OutputCollection]:
    """`while_in_context` (`view` picks the user's carry out of the loop state)."""
    child_key: PRNGKeys | None = fold_in_name(context.prng_key, name)
    path = "/".join((*context.path, name))

    def one(val: Carry, i: Array, shape_only: bool) -> tuple[Carry, OutputCollection]:
        key = None if child_key is None else jax.random.fold_in(child_key, i)
        ctx = iteration_context(context, name, key, shape_only=shape_only)
        try:
            result = body_fn(val, ctx)
        except TypeError as e:
            note_missing_key(e, ctx, f"{where}: body_fn")
            raise
        val, ctx = check_result(result, ctx, f"{where}: body_fn")
        if drop_output is None:
            return val, ctx.collection
        return val, ctx.collection.prune(drop_output)

    i0 = jnp.zeros((), jnp.uint32)
    shape_only = is_shape_only(context)

    def abstract(init: Carry) -> tuple[Carry, OutputCollection]:
        if shape_only:  # inside an outer abstract pass: trace directly
            return one(init, i0, True)
        return jax.eval_shape(lambda v, i: one(v, i, True), init, i0)

    given = init_val
    out, coll = abstract(init_val)
    init_val, promoted = promote_weak(init_val, out)
    if promoted:  # as `jax.lax.while_loop`: trace again from the promoted carry
        out, coll = abstract(init_val)
    names = Names(
        f"{where} at {path!r}", "`init_val{}`", "body_fn", "jax.lax.while_loop"
    )
    check_carry(view(init_val), view(out), view(given), names)
    _no_probes(coll, where, why)
    _no_stacked_outputs(coll, path, where)
    like = accumulator_shape(coll.summaries)
    if shape_only:
        return out, _result(name, cast_like(coll.summaries, like))
    acc0 = cast_like(_identity_tree(like), like)

    def body(state: LoopState) -> LoopState:
        i = state.iteration
        assert i is not None
        val, coll = one(state.carry, i, False)
        return LoopState(val, *state.accumulate(coll.summaries, like), i + 1)

    with jax.named_scope(name):
        final = jax.lax.while_loop(
            lambda state: cond_fn(state.carry),
            body,
            LoopState(init_val, acc0, jnp.array(True), i0),
        )
    assert final.summaries is not None
    return final.carry, _result(name, final.summaries)


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

    With static bounds this is `scan_in_context` over `jnp.arange(lower, upper)`
    (the same program): iteration k (`i = lower + k`) has child `{child_name}{k}`
    for its summaries (or, with `merge_summaries=True`, they are accumulated into
    child `child_name`), and module outputs and state updates are stacked in child
    `child_name`; the options are `scan_in_context`'s. With traced bounds it is
    `while_in_context` (summaries always accumulated, no module outputs or state
    updates; `drop_output` prunes each iteration's collection; `unroll` and
    `remat_kwargs` must keep their defaults). So the collections differ where the
    loop runs no iteration: static bounds give no summaries (as a scan of length
    0), traced bounds give each summary's identity (`SumSummary(0)`, ...), as
    `while_in_context` does; pass traced bounds to get the same structure whatever
    the bounds.

    Args:
        lower: the first `i`: static (a Python int, NumPy integer or concrete JAX
            integer scalar, as `jax.lax.fori_loop` decides) or a traced integer
            scalar. Inside `eqxctx.value_and_grad`'s function a bound computed there
            is traced in its abstract first pass, even when it runs eagerly.
        upper: the end (exclusive), likewise.
        body_fn: the body, `body_fn(i, val, ctx) -> (val, ctx)`; `i` is an int32
            scalar (static bounds) or has the bounds' dtype (traced bounds).
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
            (traced bounds: a gradient probe in the body too); traced bounds with
            `unroll` or `remat_kwargs` set.
        TypeError: if `lower` or `upper` is not an integer (a Python int or an
            integer array, as `jax.lax.fori_loop` requires), or if `body_fn` does
            not return `(val, ctx)`, or returns a carry of another structure, shape
            or dtype (as `scan_in_context` / `while_in_context`).

    References:
        `jax.lax.fori_loop`.
    """
    check_context(context, "fori_in_context")
    check_drop(drop_output, "fori_in_context")
    for bound, value in (("lower", lower), ("upper", upper)):
        dtype = getattr(value, "dtype", None)
        if isinstance(value, bool) or not (
            isinstance(value, int)
            or (dtype is not None and jnp.issubdtype(dtype, jnp.integer))
        ):
            given = f"dtype {dtype}" if dtype is not None else type(value).__name__
            raise TypeError(
                f"`fori_in_context`: {bound} must be an integer (a Python int or an "
                f"integer array), got {given} {value!r}, as `jax.lax.fori_loop` "
                "requires. For a float range use `while_in_context`."
            )
    lo, hi = _static_int(lower), _static_int(upper)
    if lo is not None and hi is not None:

        def scan_body(
            val: Carry, i: Array, ctx: Context
        ) -> tuple[Carry, None, Context]:
            try:
                result = body_fn(i, val, ctx)
            except TypeError as e:
                note_missing_key(e, ctx, "`fori_in_context`: body_fn")
                raise
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
            "`fori_in_context`: `unroll` and `remat_kwargs` need static bounds "
            "(Python ints: a scan); with traced bounds the loop is a "
            "`jax.lax.while_loop`."
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
        return (i + jnp.ones((), dtype), new), ctx_out

    name = validate_child_name(child_name, where="fori_in_context(child_name=...)")
    (_, val), coll = _while(
        lambda s: s[0] < hi_a,
        body,
        (lo_a, init_val),
        context,
        name,
        drop_output,
        where="`fori_in_context`",
        view=lambda state: state[1],
        why=(
            "its bounds are traced (under `jax.jit`, or computed inside the "
            "function that `eqxctx.value_and_grad` differentiates, whose first pass "
            "traces it abstractly), so the loop is a `jax.lax.while_loop`, which JAX "
            "cannot differentiate in reverse mode"
        ),
    )
    note_result(context, coll)
    return val, coll

"""scan_in_context and vmap_in_context: `jax.lax.scan` / `jax.vmap` with contexts.

Follows AXLearn's `scan_in_context` (`axlearn/common/module.py`) with the differences
listed in `docs/differences.md`.
"""

from collections.abc import Callable, Mapping
from typing import Any, SupportsIndex

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from ._bodies import (
    check_context,
    check_lost,
    gradient_state,
    is_shape_only,
    iteration_context,
    note_result,
)
from ._carry import LoopState, Names, check_carry, promote_weak
from ._checks import check_drop, check_in_axes, check_path, note_missing_key
from ._collection import OutputCollection, validate_child_name
from ._context import Context
from ._frame import fold_in_name
from ._gradients import enter_iterations
from ._lengths import check_per_iteration, scan_length, vmap_length
from ._mapping import EMPTY
from ._propagate import (
    assemble,
    propagate_repeated_output_collections as propagate,
)
from ._repeat import accumulator_shape, fold_stacked
from ._typing import Carry, InAxes, PRNGKeys, SummaryTree, X, Y


class _Inputs(eqx.Module):
    """What `jax.lax.scan` slices for each iteration (all stacked `[N, ...]`).

    Attributes:
        x: the user's `xs`.
        key: `per_iteration["prng_key"]`, or None.
        sinks: the gradient sinks of the probes inside (under `value_and_grad`).
    """

    x: PyTree
    key: PyTree
    sinks: PyTree


def _check_remat(remat_kwargs: Mapping[str, object] | None) -> dict[str, Any] | None:
    if remat_kwargs is None:
        return None
    kwargs = {"prevent_cse": False, **remat_kwargs}  # a copy: never mutate the caller's
    if kwargs["prevent_cse"]:
        raise ValueError(
            "`scan_in_context(remat_kwargs=...)`: prevent_cse=True is not supported: "
            "inside `jax.lax.scan` it only adds cost (see the `jax.checkpoint` docs). "
            "Leave it unset or pass prevent_cse=False."
        )
    return kwargs


def _run_body(
    fn: Callable[..., object], args: tuple[PyTree, ...], what: str, arity: int
) -> tuple[PyTree, ...]:
    given: Context = args[-1]
    try:
        result = fn(*args)
    except TypeError as e:
        note_missing_key(e, given, f"{what}: fn")
        raise
    if (
        not isinstance(result, tuple)
        or len(result) != arity
        or not isinstance(result[-1], Context)
    ):
        shape = "(carry, y, ctx)" if arity == 3 else "(y, ctx)"
        raise TypeError(
            f"{what}: fn must return `{shape}` with the context last, got "
            f"{type(result).__name__}. Return the context you were given, after adding "
            "outputs to it."
        )
    check_path(result[-1], given, f"{what}: fn")
    check_lost(result[-1], given, f"{what}: fn")
    return result


def scan_in_context(
    fn: Callable[[Carry, X, Context], tuple[Carry, Y, Context]],
    *,
    context: Context,
    carry: Carry,
    xs: X,
    length: SupportsIndex | None = None,
    reverse: bool = False,
    per_iteration: Mapping[str, object] | None = None,
    split_prng_key: bool = True,
    drop_output: Callable[[str], bool] | None = None,
    child_name_prefix: str = "iter",
    unroll: int | bool = 1,
    remat_kwargs: Mapping[str, object] | None = None,
    merge_summaries: bool = False,
) -> tuple[Carry, Y, OutputCollection]:
    """Run `fn` over the leading axis of `xs` with `jax.lax.scan`, collecting outputs.

    Iteration i calls `fn(carry, xs[i], ctx_i) -> (carry, y_i, ctx_i)` in a fresh
    context `ctx_i` (path `(*context.path, child_name_prefix)`, `context`'s training
    flag, an empty collection). The returned collection is the scan's own; merge it
    into the caller's context with `ctx.merge(collection)`:

    - child `{prefix}` holds module outputs and state updates stacked `[N, ...]`;
    - child `{prefix}{i}` holds iteration i's summaries (i is the `xs` index, also
      under `reverse=True`). They are kept stacked in one `IterationSummaries` entry,
      so the compiled program returns one array per summary name, not N;
      `collection.flatten("summaries")`, `collection.child("iter3")` and the writers
      give per-iteration views;
    - with `merge_summaries=True`, summaries are instead accumulated across
      iterations into child `{prefix}` (`Summary.accumulate`, `+` for raw arrays, so a
      mean should be a `WeightedSummary`), in execution order, inside the loop: the
      memory does not grow with N. N == 0 gives no summaries, N == 1 no accumulation.

    Keys: with `child_key = fold_in(context.prng_key, seed(child_name_prefix))`
    (AXLearn's child seed), iteration i gets `fold_in(child_key, i)`, or
    `child_key` itself when `split_prng_key=False`, or `per_iteration["prng_key"][i]`.
    A key-less context gives key-less iterations.

    Args:
        fn: the body, `fn(carry, x_i, ctx_i) -> (carry, y_i, ctx_i)`; traced once,
            or twice with `merge_summaries=True` (a `jax.eval_shape` pass gives the
            accumulator's structure), and once more when it changes the dtype of a
            weakly typed carry, so keep Python side effects out of it.
        context: the calling context (its key, path and training flag are used; its
            collection is not).
        carry: the initial carry, any PyTree (traced). As in `jax.lax.scan`, a
            weakly typed leaf (a Python scalar such as `0.0`) that the body returns
            in another dtype is converted to `jnp.result_type(leaf, returned)`
            (`carry=0.0` with a bfloat16 body gives a bfloat16 carry); other leaves
            must keep their dtypes.
        xs: a PyTree whose leaves have a leading axis N, or None with `length`.
        length: N, static (an int or any integer, e.g. `np.int64`); optional when
            `xs` has leaves (then it must agree).
        reverse: run from the last index to the first, as `jax.lax.scan`.
        per_iteration: context overrides with leading axis N; only `"prng_key"`
            (raw `uint32[N, 2]` or typed `key[N]`).
        split_prng_key: give iterations distinct keys (True) or `child_key` (False).
        drop_output: `drop_output(path) -> bool` prunes each iteration's collection
            before stacking (paths such as `"summaries"`, `"summaries/loss"`,
            `"module_outputs/h"`; see `OutputCollection.prune`).
        child_name_prefix: the children's prefix, matching `^[a-z][a-z0-9_]*$`.
        unroll: passed to `jax.lax.scan` (int, or bool for full/no unrolling).
        remat_kwargs: if not None, the body is wrapped in
            `jax.checkpoint(body, **remat_kwargs)` with `prevent_cse=False` unless
            given; the mapping is not mutated.
        merge_summaries: accumulate summaries instead of per-iteration children.

    Returns:
        `(carry, ys, collection)`: the final carry, the `y_i` stacked `[N, ...]`, and
        the scan's collection laid out as above.

    Raises:
        ValueError: before tracing `fn`: leading axes of `xs` / `per_iteration` leaves
            (or `length`) that disagree (the message names the leaves and shapes), no
            `xs` leaves and no `length`, an invalid prefix, unknown `per_iteration`
            keys, `remat_kwargs` with `prevent_cse=True`.
        TypeError: before tracing `fn`, if `per_iteration["prng_key"]` is not a
            batch of keys (uint32[N, 2] or key[N]); at trace time, if `fn` does not
            return `(carry, y, ctx)`, or returns a carry of another structure, shape
            or dtype (beyond the weak type rule above; the message names the carry
            leaf).
        OutputConflictError: from `ctx.merge(collection)`, if the prefix's children
            collide with names already in the caller's collection.

    References:
        AXLearn's `scan_in_context`; `jax.lax.scan` and `jax.checkpoint`.

    Examples:
        >>> def body(c, x, ctx):
        ...     return c + x, c, ctx.add_summary("x", x)
        >>> ctx = Context.root()
        >>> c, ys, coll = scan_in_context(body, context=ctx, carry=0.0, xs=jnp.ones(3))
        >>> float(c), sorted(coll.flatten("summaries"))
        (3.0, ['iter0/x', 'iter1/x', 'iter2/x'])
    """
    check_context(context, "scan_in_context")
    check_drop(drop_output, "scan_in_context")
    prefix = validate_child_name(
        child_name_prefix, where="scan_in_context(child_name_prefix=...)"
    )
    overrides = check_per_iteration(per_iteration)
    n = scan_length(xs, overrides, length)
    remat = _check_remat(remat_kwargs)
    child_key: PRNGKeys | None = fold_in_name(context.prng_key, prefix)
    given_keys: PRNGKeys | None = overrides.get("prng_key")
    # Iteration i's key is `fold_in(child_key, i)` with i from a carried counter, not
    # from an `arange(N)` input: no buffer grows with N, and XLA removes the counter
    # when the body never reads its key.
    count = given_keys is None and child_key is not None and split_prng_key
    # Gradient sinks of the probes inside (under `value_and_grad`), sliced like xs.
    grads = enter_iterations(
        gradient_state(context),
        context.path,
        prefix,
        length=n,
        merged=merge_summaries,
        reverse=reverse,
    )
    stacked_inputs = _Inputs(xs, given_keys, None if grads is None else grads.sinks)

    def one_iteration(
        c: PyTree, inputs: _Inputs, index: Array | None, shape_only: bool = False
    ) -> tuple[PyTree, PyTree, OutputCollection]:
        key = child_key if inputs.key is None else inputs.key
        if index is not None and child_key is not None:
            key = jax.random.fold_in(child_key, index)
        ctx_i = iteration_context(
            context,
            prefix,
            key,
            shape_only=shape_only,
            gradients=None if grads is None else grads.state(inputs.sinks),
        )
        c, y, ctx_i = _run_body(fn, (c, inputs.x, ctx_i), "`scan_in_context`", 3)
        coll = ctx_i.collection
        if drop_output is not None:
            coll = coll.prune(drop_output)
        return c, y, coll

    # Inside an outer scan's shape-only pass nothing here is computed: summaries are
    # stacked and reduced after the loop (same structure, no extra shape pass), so
    # nested merged scans trace each body at most twice in total per level.
    shape_only = is_shape_only(context)
    merge = merge_summaries and n >= 2 and not shape_only
    given_carry = carry  # as given: `check_carry` names its weak types
    names = Names("`scan_in_context`", "carry{}", "the body", "jax.lax.scan")
    like: SummaryTree | None = None
    acc: SummaryTree | None = None
    first: Array | None = None
    if merge:
        # The accumulator is carried, so its structure is needed before the scan:
        # one abstract evaluation of the body (no FLOPs, nothing in the program),
        # during which nested scans take the shape-only path.
        inputs0 = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)),
            stacked_inputs,
        )
        index0 = jax.ShapeDtypeStruct((), jnp.uint32) if count else None

        def shapes_of(c: PyTree) -> tuple[PyTree, PyTree, OutputCollection]:
            return jax.eval_shape(
                lambda c, inputs, i: one_iteration(c, inputs, i, shape_only=True),
                c,
                inputs0,
                index0,
            )

        shapes = shapes_of(carry)
        # A weakly typed carry that the body changes is converted first, as
        # `jax.lax.scan` would (then `jax.lax.scan` traces the body once), and the
        # body evaluated again: the accumulator takes the dtypes of the iterations
        # that run.
        carry, changed = promote_weak(carry, shapes[0])
        if changed:
            shapes = shapes_of(carry)
        like = accumulator_shape(shapes[2].summaries)
        acc = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), like)
        first = jnp.array(True)
    index = jnp.array(max(n - 1, 0) if reverse else 0, jnp.uint32) if count else None
    step = jnp.array(1, jnp.uint32)

    def body(state: LoopState, inputs: _Inputs) -> tuple[LoopState, PyTree]:
        index = state.iteration
        c, y, coll = one_iteration(state.carry, inputs, index)
        check_carry(state.carry, c, given_carry, names)
        acc, first = state.summaries, state.first
        if like is not None:
            acc, first = state.accumulate(coll.summaries, like)
            coll = OutputCollection({}, coll.state_updates, coll.module_outputs)
        if index is not None:
            index = index - step if reverse else index + step
        return LoopState(c, acc, first, index), (y, coll)

    if remat is not None:
        body = jax.checkpoint(body, **remat)
    with jax.named_scope(prefix):
        final, (ys, stacked) = jax.lax.scan(
            body,
            LoopState(carry, acc, first, index),
            stacked_inputs,
            length=n,
            reverse=reverse,
            unroll=unroll,
        )
    merged = final.summaries
    if merge_summaries and not merge:  # nothing to accumulate, or a shape-only pass
        merged = fold_stacked(stacked.summaries, n, reverse=reverse) if n else EMPTY
    coll = assemble(
        stacked, prefix=prefix, length=n, merged_summaries=merged, reverse=reverse
    )
    note_result(context, coll)
    return final.carry, ys, coll


def vmap_in_context(
    fn: Callable[[X, Context], tuple[Y, Context]],
    *,
    context: Context,
    xs: X,
    in_axes: InAxes = 0,
    split_prng_key: bool = True,
    drop_output: Callable[[str], bool] | None = None,
    child_name_prefix: str = "iter",
    merge_summaries: bool = False,
    axis_name: str | None = None,
) -> tuple[Y, OutputCollection]:
    """Run `fn` over a mapped axis of `xs` with `jax.vmap`, collecting outputs.

    The contract of `scan_in_context` over `jax.vmap`, for ensembles and Repeat-style
    code: example i calls `fn(x_i, ctx_i) -> (y_i, ctx_i)` with key
    `fold_in(child_key, i)` (or `child_key` when `split_prng_key=False`); module
    outputs and state updates are stacked `[N, ...]` in child `{prefix}`; summaries
    form per-example children `{prefix}{i}` (kept stacked), or with
    `merge_summaries=True` are accumulated over the examples in index order into
    child `{prefix}`.

    Args:
        fn: the body, `fn(x_i, ctx_i) -> (y_i, ctx_i)`.
        context: the calling context (key, path and training flag are used).
        xs: a PyTree of arrays (traced).
        in_axes: a prefix tree of `xs` of ints or None, as `jax.vmap`'s `in_axes`.
        split_prng_key: give examples distinct keys (True) or `child_key` (False).
        drop_output: prunes each example's collection (see `scan_in_context`).
        child_name_prefix: the children's prefix, matching `^[a-z][a-z0-9_]*$`.
        merge_summaries: accumulate summaries instead of per-example children.
        axis_name: passed to `jax.vmap`, so that collectives over the mapped axis
            (`jax.lax.pmean(x, axis_name)`, `psum`, ...) work in the body.

    Returns:
        `(ys, collection)`: the `y_i` stacked along a new leading axis N and the
        collection laid out as described.

    Raises:
        ValueError: before tracing `fn`: an invalid prefix, `in_axes` that is not a
            prefix of `xs` or out of range, mapped axes of different sizes (named),
            or no mapped axis.
        TypeError: at trace time, if `fn` does not return `(y, ctx)`.

    References:
        `jax.vmap`; AXLearn's `propagate_repeated_output_collections`.

    Examples:
        >>> def f(x, ctx):
        ...     return 2 * x, ctx.add_summary("x", x)
        >>> ys, coll = vmap_in_context(f, context=Context.root(), xs=jnp.arange(2.0))
        >>> sorted(coll.flatten("summaries"))
        ['iter0/x', 'iter1/x']
    """
    check_context(context, "vmap_in_context")
    check_drop(drop_output, "vmap_in_context")
    in_axes = check_in_axes(in_axes, "vmap_in_context")
    prefix = validate_child_name(
        child_name_prefix, where="vmap_in_context(child_name_prefix=...)"
    )
    n = vmap_length(xs, in_axes)
    child_key: PRNGKeys | None = fold_in_name(context.prng_key, prefix)
    split = child_key is not None and split_prng_key
    grads = enter_iterations(
        gradient_state(context),
        context.path,
        prefix,
        length=n,
        merged=merge_summaries,
        reverse=False,
    )

    def body(x: PyTree, i: Array, s: PyTree) -> tuple[PyTree, OutputCollection]:
        key = (
            jax.random.fold_in(child_key, i)
            if split and child_key is not None
            else child_key
        )
        ctx_i = iteration_context(
            context,
            prefix,
            key,
            shape_only=False,
            gradients=grads.state(s) if grads is not None else None,
        )
        y, ctx_i = _run_body(fn, (x, ctx_i), "`vmap_in_context`", 2)
        coll = ctx_i.collection
        if drop_output is not None:
            coll = coll.prune(drop_output)
        return y, coll

    index = jnp.arange(n, dtype=jnp.uint32)
    with jax.named_scope(prefix):
        ys, stacked = jax.vmap(
            body, in_axes=(in_axes, 0, 0), axis_size=n, axis_name=axis_name
        )(xs, index, grads.sinks if grads is not None else None)
    coll = propagate(
        stacked, child_name_prefix=prefix, merge_summaries=merge_summaries, length=n
    )
    note_result(context, coll)
    return ys, coll

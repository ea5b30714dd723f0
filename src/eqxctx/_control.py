"""Branches with contexts: cond_in_context and switch_in_context.

`jax.lax.cond` / `switch` whose branches add outputs, reconciled by each summary's
identity (`_reconcile.py`). The loops are in `_loops.py`.
"""

from collections.abc import Callable, Sequence

import jax
from jaxtyping import ArrayLike, PyTree

from ._bodies import (
    check_context,
    check_lost,
    gradient_state,
    is_shape_only,
    iteration_context,
    note_result,
)
from ._checks import check_path, note_missing_key
from ._collection import OutputCollection, validate_child_name
from ._context import Context, check_returns_context
from ._frame import fold_in_name
from ._reconcile import fill_collection, union_collections
from ._typing import ArrayTree, R


def check_result(result: object, ctx: Context, what: str) -> tuple[ArrayTree, Context]:
    """Return `(out, ctx')`, checking it is a pair whose context has `ctx`'s path."""
    out, got = check_returns_context(result, what)
    check_path(got, ctx, what)
    check_lost(got, ctx, what)
    return out, got


def _branch_context(context: Context, name: str, shape_only: bool) -> Context:
    key = fold_in_name(context.prng_key, name)
    return iteration_context(context, name, key, shape_only=shape_only)


def _run_branches(
    dispatch: Callable[
        [list[Callable[..., ArrayTree]]], tuple[ArrayTree, OutputCollection]
    ],
    branches: Sequence[Callable[..., ArrayTree]],
    operands: tuple[ArrayTree, ...],
    names: tuple[str, ...],
    context: Context,
    child_name: str,
    where: str,
) -> tuple[ArrayTree, OutputCollection]:
    def run(
        j: int, ops: tuple[ArrayTree, ...], shape_only: bool
    ) -> tuple[ArrayTree, ArrayTree]:
        ctx = _branch_context(context, child_name, shape_only)
        try:
            result = branches[j](*ops, ctx)
        except TypeError as e:
            note_missing_key(e, ctx, f"{where}: {names[j]}")
            raise
        out, ctx = check_result(result, ctx, f"{where}: {names[j]}")
        return out, ctx.collection

    path = "/".join((*context.path, child_name))
    if is_shape_only(context):
        # Inside an outer shape-only pass nothing is computed: trace every branch once
        # and lay out branch 0's outputs (the structure is what matters).
        state = gradient_state(context)
        probing = state is not None and state.mode == "shapes"
        results = [
            run(j, _own(operands) if probing else operands, True)
            for j in range(len(branches))
        ]
        spec = union_collections([c for _, c in results], names, path, where)
        out, coll = results[0][0], fill_collection(spec, results[0][1])
        if probing:
            out = _tied([o for o, _ in results])
    else:
        # The union's structure is needed before `jax.lax.switch`: one abstract
        # evaluation of each branch (no FLOPs, nothing in the program).
        shapes = [
            jax.eval_shape(lambda *ops, j=j: run(j, ops, True), *operands)
            for j in range(len(branches))
        ]
        spec = union_collections([c for _, c in shapes], names, path, where)

        def wrapped(j: int) -> Callable[..., tuple[ArrayTree, OutputCollection]]:
            def branch(*ops: ArrayTree) -> tuple[ArrayTree, OutputCollection]:
                out, coll = run(j, ops, False)
                return out, fill_collection(spec, coll)

            return branch

        try:
            with jax.named_scope(child_name):
                out, coll = dispatch([wrapped(j) for j in range(len(branches))])
        except TypeError as e:
            # JAX's own rules decide (weak types, ...); its message names eqxctx's
            # wrapper for every branch, so name the user's and what each returns.
            described = "; ".join(
                f"{names[j]} ({_name(branches[j])}) returns {_types(o)}"
                for j, (o, _) in enumerate(shapes)
            )
            e.add_note(f"{where} at {path!r}: {described}.")
            raise
    result = OutputCollection.empty().add_child(child_name, coll)
    note_result(context, result)
    return out, result


def _own(operands: tuple[ArrayTree, ...]) -> tuple[ArrayTree, ...]:
    """The operands as this branch's own values (for `value_and_grad`'s shape pass).

    The shape pass traces the branches in line; through an
    `jax.lax.optimization_barrier` each branch reads its own copy, so that its
    check of unused probes sees whether a probe's input reaches the loss in that
    branch, not in another one.
    """
    leaves, treedef = jax.tree_util.tree_flatten(operands)
    at = [i for i, a in enumerate(leaves) if isinstance(a, jax.Array)]
    if not at:
        return operands
    copies = jax.lax.optimization_barrier([leaves[i] for i in at])
    for i, a in zip(at, copies, strict=True):
        leaves[i] = a
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _tied(outs: list[ArrayTree]) -> ArrayTree:
    """Branch 0's outputs, made to depend on every branch's outputs.

    For `value_and_grad`'s shape pass, which traces the branches in line and keeps
    branch 0's outputs: its check of unused gradient probes (a liveness walk of the
    jaxpr) must see that any branch's outputs may reach the loss.
    `jax.lax.optimization_barrier` ties them (shapes and weak types unchanged;
    nothing of a shape pass is compiled).
    """
    leaves, treedef = jax.tree_util.tree_flatten(outs[0])
    at = [i for i, a in enumerate(leaves) if isinstance(a, jax.Array)]
    rest = [
        a
        for o in outs[1:]
        for a in jax.tree_util.tree_leaves(o)
        if isinstance(a, jax.Array)
    ]
    if not at or not rest:
        return outs[0]
    tied, _ = jax.lax.optimization_barrier(([leaves[i] for i in at], rest))
    for i, a in zip(at, tied, strict=True):
        leaves[i] = a
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _name(fn: Callable[..., object]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _types(tree: ArrayTree) -> str:
    """A branch's output as `jax.eval_shape` gives it, e.g. `(f32[3], i32[] weak)`."""

    def short(x: jax.ShapeDtypeStruct) -> str:
        weak = " weak" if getattr(x, "weak_type", False) else ""
        return f"{x.dtype.name}{list(x.shape)}{weak}"

    return str(jax.tree_util.tree_map(short, tree))


def cond_in_context(
    pred: ArrayLike,
    true_fn: Callable[..., tuple[R, Context]],
    false_fn: Callable[..., tuple[R, Context]],
    *operands: PyTree,
    context: Context,
    child_name: str = "cond",
) -> tuple[R, OutputCollection]:
    """Run `true_fn` or `false_fn` with `jax.lax.cond`, collecting their outputs.

    The branch taken runs as `fn(*operands, ctx) -> (out, ctx)` in a child context
    `child_name` (path `(*context.path, child_name)`, key
    `fold_in(context.prng_key, seed(child_name))`, AXLearn's child seed). The returned
    collection holds child `child_name`; merge it with `ctx.merge(collection)`.

    The branches may add different outputs. The child holds their union: an entry in
    both branches with the same kind, shape and dtype comes from the branch taken; a
    summary added in one branch only is filled, when the other is taken, with its
    kind's identity (`Summary.identity`: `WeightedSummary` weight 0, `MinSummary` the
    dtype's maximum, `MaxSummary` its minimum, `SumSummary` 0), so averaging over
    steps stays exact. Per-iteration summaries (a branch that scans) count as
    summaries. Under `jax.vmap` with a batched `pred`, both branches run and each
    example selects its own, as with `jax.lax.cond`.

    Args:
        pred: a scalar boolean (or integer: nonzero is true), concrete or traced.
        true_fn: the branch for a true `pred`.
        false_fn: the branch for a false `pred`.
        *operands: the branches' inputs (traced), as in `jax.lax.cond`.
        context: the calling context (its key, path and training flag are used).
        child_name: the child's name, matching `^[a-z][a-z0-9_]*$`.

    Returns:
        `(out, collection)`: the branch's output and the construct's collection.

    Raises:
        ValueError: at trace time: an invalid `child_name`; a raw-array or media
            summary, module output or state update that one branch adds and the
            other does not, or an entry whose kind, shape or dtype differs between
            the branches (the message names the path and the branches, and the fix);
            a branch returning a context with another path.
        TypeError: if a branch does not return `(out, ctx)`, or the branches' `out`
            differ in structure or types (`jax.lax.cond`'s error, with a note giving
            the construct's path and each branch's function and output types).

    References:
        `jax.lax.cond`.

    Examples:
        >>> from eqxctx import WeightedSummary
        >>> def big(x, ctx):
        ...     return x, ctx.add_summary("big", WeightedSummary(x, 1.0))
        >>> def small(x, ctx):
        ...     return -x, ctx
        >>> out, coll = cond_in_context(False, big, small, 2.0, context=Context.root())
        >>> float(out), float(coll.flatten("summaries")["cond/big"].weight)
        (-2.0, 0.0)
    """
    check_context(context, "cond_in_context")
    name = validate_child_name(child_name, where="cond_in_context(child_name=...)")
    return _run_branches(
        lambda fns: jax.lax.cond(pred, fns[1], fns[0], *operands),
        [false_fn, true_fn],
        operands,
        ("false_fn", "true_fn"),
        context,
        name,
        "`cond_in_context`",
    )


def switch_in_context(
    index: ArrayLike,
    branches: Sequence[Callable[..., tuple[R, Context]]],
    *operands: PyTree,
    context: Context,
    child_name: str = "switch",
) -> tuple[R, OutputCollection]:
    """Run `branches[index]` with `jax.lax.switch`, collecting the outputs.

    As `cond_in_context` (child context, union of the branches' outputs, identities
    for summaries a branch does not add), over any number of branches.

    Args:
        index: a scalar integer, concrete or traced; clamped to
            `[0, len(branches) - 1]` as in `jax.lax.switch`.
        branches: the branches, each `fn(*operands, ctx) -> (out, ctx)`.
        *operands: the branches' inputs (traced).
        context: the calling context.
        child_name: the child's name, matching `^[a-z][a-z0-9_]*$`.

    Returns:
        `(out, collection)`: the branch's output and the construct's collection.

    Raises:
        ValueError: as `cond_in_context` (messages name branches as `branches[j]`),
            or for an empty `branches`.
        TypeError: as `cond_in_context`.

    References:
        `jax.lax.switch`.
    """
    check_context(context, "switch_in_context")
    name = validate_child_name(child_name, where="switch_in_context(child_name=...)")
    fns = list(branches)
    if not fns:
        raise ValueError("`switch_in_context`: `branches` must not be empty.")
    return _run_branches(
        lambda wrapped: jax.lax.switch(index, wrapped, *operands),
        fns,
        operands,
        tuple(f"branches[{j}]" for j in range(len(fns))),
        context,
        name,
        "`switch_in_context`",
    )

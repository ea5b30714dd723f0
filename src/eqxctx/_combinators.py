"""scan_in_context and vmap_in_context: `jax.lax.scan` / `jax.vmap` with contexts.

Follows AXLearn's `scan_in_context` (`axlearn/common/module.py`) with the differences
listed in `docs/differences.md`.
"""

import operator
from collections.abc import Callable, Mapping
from typing import Any, SupportsIndex

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, PyTree

from ._checks import check_drop, check_in_axes, note_missing_key
from ._collection import OutputCollection, validate_child_name
from ._context import (
    Context,
    check_context,
    check_lost,
    check_path,
    fold_in_name,
    gradient_state,
    is_shape_only,
    iteration_context,
    note_result,
)
from ._gradients import enter_iterations
from ._mapping import EMPTY
from ._propagate import (
    assemble,
    propagate_repeated_output_collections as propagate,
)
from ._repeat import accumulate_trees, accumulator_shape, cast_like, fold_stacked
from ._summary import is_array_leaf
from ._typing import Carry, InAxes, Leaf, PRNGKeys, SummaryTree, Tree, X, Y


_PER_ITERATION_KEYS = ("prng_key",)


def _fold_in(key: PRNGKeys, index: ArrayLike) -> PRNGKeys:
    """Return iteration `index`'s key, `jax.random.fold_in(key, index)`."""
    return jax.random.fold_in(key, index)


def _leaves_with_names(tree: PyTree, root: str) -> list[tuple[str, Leaf]]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return [(f"{root}{jax.tree_util.keystr(path)}", leaf) for path, leaf in leaves]


def _check_array_leaf(name: str, leaf: Leaf, where: str) -> None:
    """Raise for a leaf that is not an array (e.g. a function field of a module)."""
    if not is_array_leaf(leaf):
        args = "`xs` and `per_iteration` may" if "scan" in where else "`xs` may"
        raise TypeError(
            f"{where}: {name} is a {type(leaf).__name__}, not an array; {args} "
            "hold arrays only (as in `jax.lax.scan` and "
            "`jax.vmap`). For a stacked Equinox module (e.g. built with "
            "`eqx.filter_vmap`), pass its arrays, `params, static = "
            "eqx.partition(xs, eqx.is_array)`, and rebuild each one in the body "
            "with `eqx.combine(params_i, static)`."
        )


def _scan_length(xs: PyTree, per_iteration: Tree, length: object) -> int:
    """Return N, checking every leading axis before anything is traced."""
    where = "`scan_in_context`"
    if length is not None:
        try:
            if isinstance(length, bool):
                raise TypeError
            length = operator.index(length)  # pyright: ignore[reportArgumentType]
        except TypeError:
            raise ValueError(
                f"{where}: length must be a non-negative int, got {length!r}."
            ) from None
        if length < 0:
            raise ValueError(
                f"{where}: length must be a non-negative int, got {length!r}."
            )
    leaves = _leaves_with_names(xs, "xs") + _leaves_with_names(
        dict(per_iteration), "per_iteration"
    )
    sizes: list[tuple[str, tuple[int, ...]]] = []
    for name, leaf in leaves:
        _check_array_leaf(name, leaf, where)
        shape = tuple(jnp.shape(leaf))
        if not shape:
            raise ValueError(
                f"{where}: {name} has shape (); every leaf of `xs` and "
                "`per_iteration` needs a leading axis N (the iterations)."
            )
        sizes.append((name, shape))
    distinct = {shape[0] for _, shape in sizes}
    if length is not None:
        distinct.add(length)
    if len(distinct) > 1:
        listing = ", ".join(f"{name} {shape}" for name, shape in sizes)
        extra = f" and length={length}" if length is not None else ""
        raise ValueError(
            f"{where}: the leading axes of `xs` and `per_iteration` must all equal N, "
            f"but they disagree: {listing}{extra}. Give every leaf the same leading "
            "axis (one entry per iteration)."
        )
    if not distinct:
        raise ValueError(
            f"{where}: cannot tell the number of iterations: `xs` has no array leaf "
            "and `length` is None. Pass `length=N` (with `xs=None`) or non-empty `xs`."
        )
    return distinct.pop()


def _check_per_iteration(per_iteration: object) -> dict[str, PRNGKeys]:
    if per_iteration is None:
        return {}
    if not isinstance(per_iteration, Mapping):
        raise ValueError(
            "`scan_in_context(per_iteration=...)`: expected a mapping such as "
            f"{{'prng_key': keys}}, got {type(per_iteration).__name__}."
        )
    unknown = sorted(set(per_iteration) - set(_PER_ITERATION_KEYS))
    if unknown:
        raise ValueError(
            f"`scan_in_context(per_iteration=...)`: unknown keys {unknown}; only "
            f"{list(_PER_ITERATION_KEYS)} can be overridden per iteration."
        )
    keys = per_iteration.get("prng_key")
    if keys is not None:
        dtype = getattr(keys, "dtype", None)
        shape = getattr(keys, "shape", None)
        if (
            dtype is None
            or shape is None
            or not (
                (jnp.issubdtype(dtype, jax.dtypes.prng_key) and len(shape) == 1)
                or (dtype == np.uint32 and len(shape) == 2 and shape[1] == 2)
            )
        ):
            given = (
                f"an array of dtype {dtype} and shape {tuple(shape)}"
                if dtype is not None and shape is not None
                else type(keys).__name__
            )
            raise TypeError(
                "`scan_in_context(per_iteration=...)`: 'prng_key' must hold one key "
                "per iteration: raw keys uint32[N, 2] (`jax.random.split(key, N)` of "
                "a `jax.random.PRNGKey`) or typed keys key[N] (of a "
                f"`jax.random.key`), got {given}."
            )
    return dict(per_iteration)


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
    (AXLearn's child seed), iteration i gets `_fold_in(child_key, i)`, or
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
    overrides = _check_per_iteration(per_iteration)
    n = _scan_length(xs, overrides, length)
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
    sinks = grads.sinks if grads is not None else None

    def one_iteration(
        c: PyTree, x: PyTree, k: PyTree, s: PyTree, shape_only: bool = False
    ) -> tuple[PyTree, PyTree, OutputCollection]:
        if given_keys is not None:
            key = k
        elif count and child_key is not None:
            key = _fold_in(child_key, k)
        else:
            key = child_key
        ctx_i = iteration_context(
            context,
            prefix,
            key,
            shape_only=shape_only,
            gradients=grads.state(s) if grads is not None else None,
        )
        c, y, ctx_i = _run_body(fn, (c, x, ctx_i), "`scan_in_context`", 3)
        coll = ctx_i.collection
        if drop_output is not None:
            coll = coll.prune(drop_output)
        return c, y, coll

    # Inside an outer scan's shape-only pass nothing here is computed: summaries are
    # stacked and reduced after the loop (same structure, no extra shape pass), so
    # nested merged scans trace each body at most twice in total per level.
    shape_only = is_shape_only(context)
    merge = merge_summaries and n >= 2 and not shape_only
    init_carry = carry  # as given: `_check_carry` names its weak types
    acc: SummaryTree | None = None
    first: Array | None = None
    like: SummaryTree | None = None
    if merge:
        # The accumulator is carried, so its structure is needed before the scan:
        # one abstract evaluation of the body (no FLOPs, nothing in the program),
        # during which nested scans take the shape-only path.
        x0, k0, s0 = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)),
            (xs, given_keys, sinks),
        )
        if count:
            k0 = jax.ShapeDtypeStruct((), jnp.uint32)

        def shapes_of(c: PyTree) -> tuple[PyTree, PyTree, OutputCollection]:
            return jax.eval_shape(
                lambda c, x, k, s: one_iteration(c, x, k, s, shape_only=True),
                c,
                x0,
                k0,
                s0,
            )

        shapes = shapes_of(carry)
        # A weakly typed carry that the body changes is converted first, as
        # `jax.lax.scan` would (then `jax.lax.scan` traces the body once), and the
        # body evaluated again: the accumulator takes the dtypes of the iterations
        # that run.
        carry, changed = _promote_weak(carry, shapes[0])
        if changed:
            shapes = shapes_of(carry)
        like = accumulator_shape(shapes[2].summaries)
        acc = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), like)
        first = jnp.array(True)
    index = jnp.array(max(n - 1, 0) if reverse else 0, jnp.uint32) if count else None
    step = jnp.array(1, jnp.uint32)

    def body(
        state: PyTree, inputs: tuple[PyTree, PyTree, PyTree]
    ) -> tuple[PyTree, PyTree]:
        c_in, acc, first, index = state
        x, k, s = inputs
        c, y, coll = one_iteration(c_in, x, index if count else k, s)
        _check_carry(c_in, c, init_carry)
        if merge and like is not None:
            new = cast_like(coll.summaries, like)
            summed = cast_like(accumulate_trees(acc, new), like)
            acc = jax.tree_util.tree_map(
                lambda a, b: jnp.where(first, a, b), new, summed
            )
            first = jnp.array(False)
            coll = OutputCollection({}, coll.state_updates, coll.module_outputs)
        if count:
            index = index - step if reverse else index + step
        return (c, acc, first, index), (y, coll)

    if remat is not None:
        body = jax.checkpoint(body, **remat)
    with jax.named_scope(prefix):
        (carry_out, merged, _, _), (ys, stacked) = jax.lax.scan(
            body,
            (carry, acc, first, index),
            (xs, given_keys, sinks),
            length=n,
            reverse=reverse,
            unroll=unroll,
        )
    if merge_summaries and not merge:  # nothing to accumulate, or a shape-only pass
        merged = fold_stacked(stacked.summaries, n, reverse=reverse) if n else EMPTY
    coll = assemble(
        stacked, prefix=prefix, length=n, merged_summaries=merged, reverse=reverse
    )
    note_result(context, coll)
    return carry_out, ys, coll


def _is_weak(x: object) -> bool:
    """Return whether `x` is weakly typed (a Python scalar, or an array from one)."""
    try:
        return bool(getattr(jax.typeof(x), "weak_type", False))
    except TypeError:  # not an array; `jax.lax.scan` rejects it itself
        return False


def _type_str(x: Any) -> str:
    return f"{jnp.result_type(x)}{list(jnp.shape(x))}"


def _promote_weak(carry: PyTree, out: PyTree) -> tuple[PyTree, bool]:
    """Apply `jax.lax.scan`'s rule for a weakly typed initial carry.

    A weakly typed leaf whose dtype differs from the body's result `out` (abstract) is
    converted to `jnp.result_type(leaf, out)`, as `jax.lax.scan` does before tracing
    its body a second time. Returns the carry and whether any leaf changed; a carry
    of another structure or shape is returned as it is (`_check_carry` reports it).
    """
    leaves, treedef = jax.tree_util.tree_flatten(carry)
    outs = jax.tree_util.tree_leaves(out)
    if jax.tree_util.tree_structure(out) != treedef:
        return carry, False
    changed = False
    promoted: list[Leaf] = []
    for x, o in zip(leaves, outs, strict=True):
        if (
            _is_weak(x)
            and jnp.shape(x) == o.shape
            and jnp.result_type(x) != jnp.result_type(o)
        ):
            x = jax.lax.convert_element_type(x, jnp.result_type(x, o))
            changed = True
        promoted.append(x)
    return treedef.unflatten(promoted), changed


def _check_carry(before: PyTree, after: PyTree, init: PyTree) -> None:
    """Raise for a body whose carry changes structure, shape or dtype (at trace time).

    `jax.lax.scan` raises too, but names eqxctx's internal loop state (`state[0]`).
    Its rule for weak types is kept: on the first trace a weakly typed leaf of the
    initial carry `init` may come back in another dtype (with the same shape);
    `jax.lax.scan` then converts it to `jnp.result_type(init, returned)` and traces
    the body again, where the dtypes must match.
    """
    where = "`scan_in_context`"
    got, want = (
        jax.tree_util.tree_structure(after),
        jax.tree_util.tree_structure(before),
    )
    if got != want:
        raise TypeError(
            f"{where}: the body returned a carry with structure {got}, but the carry "
            f"went in as {want}; `fn` must return a carry of the same structure, "
            "shapes and dtypes (as in `jax.lax.scan`)."
        )
    leaves = jax.tree_util.tree_leaves_with_path(before)
    inits = jax.tree_util.tree_leaves(init)
    weak = [_is_weak(x) for x in inits]
    # The second trace: a weakly typed initial leaf came in converted.
    promoted = [w and not _is_weak(a) for w, (_, a) in zip(weak, leaves, strict=True)]
    first_trace = not any(promoted)
    outs = jax.tree_util.tree_leaves(after)
    for j, ((path, a), b) in enumerate(zip(leaves, outs, strict=True)):
        same_shape = jnp.shape(a) == jnp.shape(b)
        if same_shape and jnp.result_type(a) == jnp.result_type(b):
            continue
        if first_trace and weak[j] and same_shape:
            continue  # `jax.lax.scan` converts it and traces the body again
        name = f"carry{jax.tree_util.keystr(path)}"
        if not weak[j]:
            raise TypeError(
                f"{where}: {name} went in as {_type_str(a)} but the body returned "
                f"{_type_str(b)}; `fn` must return a carry of the same shapes and "
                "dtypes (as in `jax.lax.scan`). Cast it, e.g. "
                "`new.astype(old.dtype)`, or start from a carry of the right dtype."
            )
        went_in = (
            f"went in as a weakly typed {_type_str(inits[j])} (e.g. a Python scalar)"
        )
        if promoted[j]:
            went_in += (
                f", which `jax.lax.scan` converted to {_type_str(a)} (the result type "
                "of it and the dtype the body first returned) before tracing the body "
                "again,"
            )
        raise TypeError(
            f"{where}: {name} {went_in} but the body returned {_type_str(b)}; `fn` "
            "must return a carry of the same shapes"
            + (" and dtypes" if same_shape else "")
            + " (as in `jax.lax.scan`, where a weakly typed carry may change its "
            "dtype once, never its shape). Start from a carry of the dtype and shape "
            "the body returns, e.g. `jnp.zeros(shape, dtype)`."
        )


def _vmap_length(xs: PyTree, in_axes: InAxes) -> int:
    where = "`vmap_in_context`"
    # Each leaf of `xs` with the axis of the `in_axes` leaf above it. `None` in
    # `in_axes` is a leaf (unmapped); `None` in `xs` is an empty subtree, as in
    # `jax.vmap`.
    mapped: list[tuple[str, Leaf, int | None]] = []

    def collect(path: tuple[Any, ...], ax: int | None, sub: PyTree) -> None:
        for sub_path, leaf in jax.tree_util.tree_leaves_with_path(sub):
            mapped.append((f"xs{jax.tree_util.keystr((*path, *sub_path))}", leaf, ax))

    try:
        jax.tree_util.tree_map_with_path(
            collect, in_axes, xs, is_leaf=lambda a: a is None
        )
    except ValueError as e:
        raise ValueError(
            f"{where}: `in_axes` must be a prefix of the structure of `xs` (as in "
            f"`jax.vmap`): {e}"
        ) from None
    sizes: list[tuple[str, int, tuple[int, ...], int]] = []
    for name, leaf, ax in mapped:
        if ax is None:
            continue
        _check_array_leaf(name, leaf, where)
        shape = tuple(jnp.shape(leaf))
        if not -len(shape) <= ax < len(shape):
            raise ValueError(
                f"{where}: in_axes {ax} is out of range for {name} with shape {shape}."
            )
        sizes.append((name, shape[ax], shape, ax))
    distinct = {size for _, size, _, _ in sizes}
    if len(distinct) > 1:
        listing = ", ".join(
            f"{name} {shape} mapped over axis {ax} (size {size})"
            for name, size, shape, ax in sizes
        )
        raise ValueError(
            f"{where}: the mapped axes of `xs` must all have the same size, but they "
            f"disagree: {listing}."
        )
    if not distinct:
        raise ValueError(
            f"{where}: no leaf of `xs` is mapped (all `in_axes` are None or `xs` has "
            "no array leaf); there must be at least one mapped axis."
        )
    return distinct.pop()


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
    n = _vmap_length(xs, in_axes)
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
    sinks = grads.sinks if grads is not None else None

    def body(x: PyTree, i: Array, s: PyTree) -> tuple[PyTree, OutputCollection]:
        key = _fold_in(child_key, i) if split and child_key is not None else child_key
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
        )(xs, index, sinks)
    coll = propagate(
        stacked, child_name_prefix=prefix, merge_summaries=merge_summaries, length=n
    )
    note_result(context, coll)
    return ys, coll

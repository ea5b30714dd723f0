"""The step shared by `scan_in_context` and `vmap_in_context`: lay out repeated outputs.

Follows AXLearn's `propagate_repeated_output_collections` (`axlearn/common/module.py`),
except that per-iteration summaries stay stacked in one `IterationSummaries` entry
instead of being sliced into `N` children inside the compiled program.
"""

from typing import Any

import jax
import jax.numpy as jnp

from ._collection import IterationSummaries, OutputCollection, validate_child_name
from ._summary import accumulate_leaf, is_summary


def accumulate_trees(a: Any, b: Any) -> Any:
    """Accumulate two summary trees of equal structure, leaf by leaf.

    `Summary` leaves use `Summary.accumulate`; arrays and numbers are added with `+`
    (AXLearn's rule). `IterationSummaries` entries are accumulated iteration-wise.
    """
    return jax.tree_util.tree_map(accumulate_leaf, a, b, is_leaf=is_summary)


def cast_like(tree: Any, like: Any) -> Any:
    """Return `tree`'s leaves cast to the dtypes of `like`'s, in `like`'s structure.

    The structure is `like`'s so that a carried accumulator keeps its exact PyTree
    type across traces of a body (a `CallbackSummary` built from a lambda inside the
    body has a new function object, its static field, at every trace).
    """
    like_leaves, treedef = jax.tree_util.tree_flatten(like)
    leaves = jax.tree_util.tree_leaves(tree)
    return treedef.unflatten(
        [
            jnp.asarray(x).astype(s.dtype)
            for x, s in zip(leaves, like_leaves, strict=True)
        ]
    )


def accumulator_shape(first: Any) -> Any:
    """Return the shapes and dtypes of `accumulate_trees(first, first)`.

    An accumulator carried through a loop must keep its dtypes; accumulating can change
    them (a `WeightedSummary` of integers accumulates to a float mean), so loops keep
    the accumulator in the dtypes of one accumulation step.
    """
    return jax.eval_shape(accumulate_trees, first, first)


def fold_stacked(stacked: Any, length: int) -> Any:
    """Accumulate a stacked summary tree over its leading axis, in index order.

    Args:
        stacked: a summary tree whose array leaves have a leading axis of `length`.
        length: the number of entries N (static).

    Returns:
        The accumulation of entries `0, 1, …, N-1` (`{}` for N == 0; entry 0 itself for
        N == 1, with no accumulation).
    """
    if length == 0:
        return {}
    first = jax.tree_util.tree_map(lambda x: x[0], stacked)
    if length == 1:
        return first
    like = accumulator_shape(first)
    rest = jax.tree_util.tree_map(lambda x: x[1:], stacked)

    def step(acc: Any, new: Any) -> tuple[Any, None]:
        # `new` is cast too (as in `scan_in_context`): under strict dtype promotion an
        # integer mean must not meet the accumulator's float mean.
        return cast_like(accumulate_trees(acc, cast_like(new, like)), like), None

    out, _ = jax.lax.scan(step, cast_like(first, like), rest, length=length - 1)
    return out


def _leading_length(repeated: OutputCollection) -> int | None:
    """Return the common leading axis of all leaves, or None if there is no leaf.

    Raises:
        ValueError: if two leaves disagree, naming both paths.
    """
    found: tuple[str, int] | None = None
    for kind in ("summaries", "state_updates", "module_outputs"):
        tree = getattr(repeated, kind)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            where = f"{kind}{jax.tree_util.keystr(path)}"
            shape = jnp.shape(leaf)
            if not shape:
                raise ValueError(
                    "`propagate_repeated_output_collections`: every leaf needs a "
                    f"leading axis N, but {where} has shape ()."
                )
            if found is None:
                found = (where, shape[0])
            elif found[1] != shape[0]:
                raise ValueError(
                    "`propagate_repeated_output_collections`: leaves disagree on the "
                    f"leading axis N: {found[0]} has {found[1]}, {where} has "
                    f"shape {shape}."
                )
    return None if found is None else found[1]


def assemble(
    repeated: OutputCollection,
    *,
    prefix: str,
    length: int,
    merged_summaries: Any | None,
) -> OutputCollection:
    """Lay out stacked per-iteration outputs under `prefix` (no checks).

    With `merged_summaries` None, the stacked summaries of `repeated` become one
    `IterationSummaries(length, ...)` entry; otherwise `merged_summaries` (an already
    accumulated tree) becomes child `prefix`'s summaries.
    """
    if merged_summaries is None:
        summaries: Any = IterationSummaries(length, repeated.summaries)
    else:
        summaries = merged_summaries
    return OutputCollection(
        {prefix: summaries},
        {prefix: repeated.state_updates},
        {prefix: repeated.module_outputs},
    )


def propagate_repeated_output_collections(
    repeated: OutputCollection,
    *,
    child_name_prefix: str,
    merge_summaries: bool,
    length: int | None = None,
) -> OutputCollection:
    """Lay out the stacked outputs of N repeated calls as children of a collection.

    The shared step of `scan_in_context` and `vmap_in_context`, after AXLearn's
    `propagate_repeated_output_collections` (`axlearn/common/module.py`). It is pure:
    it returns a new collection (merge it with `ctx.merge(...)`); `repeated` is
    unchanged.

    - Module outputs and state updates go, stacked `[N, ...]`, to child
      `child_name_prefix`.
    - With `merge_summaries=False`, iteration i's summaries form child
      `{child_name_prefix}{i}`. They stay stacked in one `IterationSummaries` entry
      (no per-iteration slicing in the compiled program); `flatten`, `child` and
      `materialize` expand it.
    - With `merge_summaries=True`, summaries are accumulated over the N iterations in
      index order (`Summary.accumulate`, `+` for raw arrays) into child
      `child_name_prefix`; N == 0 gives that child no summaries, N == 1 no
      accumulation.

    Args:
        repeated: the per-iteration collection stacked along a new leading axis N
            (what a body returns through `jax.lax.scan` or `jax.vmap`).
        child_name_prefix: the children's prefix, matching `^[a-z][a-z0-9_]*$`.
        merge_summaries: accumulate summaries instead of per-iteration children.
        length: N, static; inferred from the leaves when None.

    Returns:
        A new collection holding only the children described above.

    Raises:
        ValueError: for an invalid prefix, leaves without a common leading axis (the
            message names them), a `length` that disagrees with them, or a
            collection with no leaf and no `length`.

    Examples:
        >>> rep = OutputCollection({"loss": jnp.array([1.0, 2.0])}, {}, {})
        >>> coll = propagate_repeated_output_collections(
        ...     rep, child_name_prefix="iter", merge_summaries=False
        ... )
        >>> {k: float(v) for k, v in coll.flatten("summaries").items()}
        {'iter0/loss': 1.0, 'iter1/loss': 2.0}
    """
    validate_child_name(
        child_name_prefix,
        where="propagate_repeated_output_collections(child_name_prefix=...)",
    )
    found = _leading_length(repeated)
    if length is None:
        if found is None:
            raise ValueError(
                "`propagate_repeated_output_collections`: the collection has no leaf "
                "to infer the number of iterations from; pass `length=`."
            )
        length = found
    elif found is not None and found != length:
        raise ValueError(
            f"`propagate_repeated_output_collections`: length={length} but the "
            f"leaves have a leading axis of {found}."
        )
    merged = fold_stacked(repeated.summaries, length) if merge_summaries else None
    return assemble(
        repeated, prefix=child_name_prefix, length=length, merged_summaries=merged
    )

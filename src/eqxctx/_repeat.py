"""Stacked summaries: accumulate, fold over an iteration axis, merge iterations.

What `scan_in_context`, `vmap_in_context` and `_propagate.py` (which lays out
repeated outputs as children) share; per-iteration summaries stay stacked in one
`IterationSummaries` entry instead of being sliced into `N` children.
"""

from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from ._expand import materialize_tree
from ._iterations import IterationSummaries, check_entry, iteration_axes
from ._mapping import EMPTY
from ._summary import Summary, accumulate_leaf
from ._typing import Leaf, SummaryTree


def _is_unit(x: object) -> bool:
    return isinstance(x, (Summary, IterationSummaries))


def accumulate_trees(a: SummaryTree, b: SummaryTree) -> SummaryTree:
    """Accumulate two summary trees of equal structure, leaf by leaf.

    `Summary` leaves use `Summary.accumulate`; arrays and numbers are added with `+`
    (AXLearn's rule). `IterationSummaries` entries are accumulated iteration by
    iteration, vectorized (`jax.vmap` over the iteration axis and any outer axes).
    """
    return jax.tree_util.tree_map(_accumulate_unit, a, b, is_leaf=_is_unit)


def _accumulate_unit(a: Leaf, b: Leaf) -> Leaf:
    if isinstance(a, IterationSummaries):
        return _accumulate_entries(a, b)
    return accumulate_leaf(a, b)


def _outer_axes(entry: IterationSummaries) -> int:
    """Return the number of axes in front of the iteration axis (the same for all).

    Raises:
        ValueError: as `iteration_axes` (the callers checked the paths they know),
            or if the leaves have different numbers of outer axes.
    """
    leaves = jax.tree_util.tree_leaves(entry.stacked)
    outer = set(iteration_axes(entry, leaves, ""))
    if len(outer) > 1:
        raise ValueError(
            "`IterationSummaries`: its leaves do not share their outer axes (ranks "
            f"{[np.ndim(x) for x in leaves]}, made with {list(entry.ndims)}); build "
            "entries with `scan_in_context` / `vmap_in_context`."
        )
    return outer.pop() if outer else 0


def _accumulate_entries(a: IterationSummaries, b: Leaf) -> IterationSummaries:
    if (
        not isinstance(b, IterationSummaries)
        or b.length != a.length
        or b.reverse != a.reverse
    ):
        order = ", run in reverse" if a.reverse else ""
        raise ValueError(
            f"cannot accumulate per-iteration summaries of {a.length} iterations"
            f"{order} with {b!r}; keep the same scan in every step."
        )
    if not a.ndims:
        return a
    fn: Callable[[SummaryTree, SummaryTree], SummaryTree] = accumulate_trees
    for _ in range(_outer_axes(a) + 1):
        fn = jax.vmap(fn)
    return IterationSummaries(a.length, fn(a.stacked, b.stacked), a.ndims, a.reverse)


def cast_like(tree: SummaryTree, like: SummaryTree) -> SummaryTree:
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


def accumulator_shape(first: SummaryTree) -> SummaryTree:
    """Return the shapes and dtypes of `accumulate_trees(first, first)`.

    An accumulator carried through a loop must keep its dtypes; accumulating can change
    them (a `WeightedSummary` of integers accumulates to a float mean), so loops keep
    the accumulator in the dtypes of one accumulation step.
    """
    return jax.eval_shape(accumulate_trees, first, first)


def _reduce_raw(x: ArrayLike) -> Array:
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        return jnp.any(x, axis=0)  # `+` of booleans is a logical or
    return jnp.sum(x, axis=0, dtype=x.dtype)


def _reduce_unit(x: Leaf) -> Leaf:
    """Accumulate one stacked unit over its leading axis with one reduction per leaf."""
    if isinstance(x, IterationSummaries):
        # Per-iteration summaries of each mapped example: reduce the mapped (outer)
        # axis, keep the iterations.
        reduced = jax.tree_util.tree_map(_reduce_unit, x.stacked, is_leaf=_is_unit)
        return IterationSummaries(x.length, reduced, x.ndims, x.reverse)
    if isinstance(x, Summary):
        # Through the class: `x.reduce_stacked` builds an Equinox bound method.
        return type(x).reduce_stacked(x)
    return _reduce_raw(x)


def fold_stacked(
    stacked: SummaryTree, length: int, *, reverse: bool = False
) -> SummaryTree:
    """Accumulate a stacked summary tree over its leading axis.

    Raw arrays are summed (`any` for booleans) and each `Summary` reduced by its
    `reduce_stacked`: equal to accumulating entries `0, 1, …, N-1` in index order
    up to floating-point rounding. With `reverse=True` the
    order is `N-1, …, 0` (a reversed scan's execution order: media kinds keep entry
    N-1).

    Args:
        stacked: a summary tree whose array leaves have a leading axis of `length`.
        length: the number of entries N (static).
        reverse: accumulate from the last entry to the first (static).

    Returns:
        The accumulation (`{}` for N == 0; entry 0 itself for N == 1, with no
        accumulation), in the dtypes of one accumulation step.
    """
    if length == 0:
        return EMPTY
    if reverse and length > 1:
        stacked = jax.tree_util.tree_map(lambda x: jnp.flip(x, 0), stacked)
    if length == 1:
        return jax.tree_util.tree_map(lambda x: x[0], stacked)
    like = accumulator_shape(
        jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x)),
            stacked,
        )
    )
    reduced = jax.tree_util.tree_map(_reduce_unit, stacked, is_leaf=_is_unit)
    return cast_like(reduced, like)


def _merge_entries(tree: SummaryTree) -> SummaryTree:
    """`tree` with every `IterationSummaries` replaced by its accumulation."""
    out: dict[str, Leaf] = {}
    for key, value in tree.items():
        if isinstance(value, IterationSummaries):
            outer = _outer_axes(value)  # of the entry as made, before inner merges
            inner = _merge_entries(value.stacked)

            def fold(
                t: SummaryTree, n: int = value.length, r: bool = value.reverse
            ) -> SummaryTree:
                return fold_stacked(t, n, reverse=r)

            for _ in range(outer):
                fold = jax.vmap(fold)
            out[key] = fold(inner) if value.length else EMPTY
        elif isinstance(value, Mapping):
            out[key] = _merge_entries(value)
        else:
            out[key] = value
    return out


#: A list of `IterationSummaries`. `list[Any]`: beartype samples a list's items with
#: `random`, which hypothesis forbids inside strategies.
Entries: TypeAlias = list[Any]


def _fold_all(entries: Entries) -> list[SummaryTree]:
    return [_merge_entries({"_": e})["_"] for e in entries]


# One program for all the folds of a collection (jitted once per layout).
_fold_all_jit = jax.jit(_fold_all)


def _collect(tree: SummaryTree, found: Entries, prefix: str) -> None:
    """Append the entries of `tree` to `found`, checked (`check_entry`) by path."""
    for key, value in tree.items():
        if isinstance(value, IterationSummaries):
            check_entry(value, jax.tree_util.tree_leaves(value.stacked), prefix + key)
            found.append(value)
        elif isinstance(value, Mapping):
            _collect(value, found, f"{prefix}{key}/")


def _replace(tree: SummaryTree, merged: Iterator[SummaryTree]) -> SummaryTree:
    out: dict[str, Leaf] = {}
    for key, value in tree.items():
        if isinstance(value, IterationSummaries):
            out[key] = next(merged)
        elif isinstance(value, Mapping):
            out[key] = _replace(value, merged)
        else:
            out[key] = value
    return out


def merge_iteration_summaries(summaries: SummaryTree) -> SummaryTree:
    """Return `summaries` with every per-iteration entry accumulated (in one program).

    Each `IterationSummaries` under `prefix` becomes the mapping under `prefix` that
    `merge_summaries=True` gives: its iterations accumulated in execution order
    (index order, or from the last index to the first for a reversed scan; one
    reduction per leaf, see `fold_stacked`), inner entries first. Only the entries go
    through `jax.jit` (one call for all), so leaves outside them are unchanged (Python
    numbers stay Python numbers); so is `summaries`. Returns `summaries` itself when
    it holds no entry.

    Raises:
        ValueError: if an entry's stacked arrays no longer have its iterations on
            their iteration axis (sliced or indexed), naming the path.
    """
    entries: Entries = []
    _collect(summaries, entries, "")
    if not entries:
        return summaries
    try:
        merged = _fold_all_jit(entries)
    except TypeError:  # `jax.jit` refuses `ShapeDtypeStruct`s (nothing is traced)
        leaves = jax.tree_util.tree_leaves(entries)
        if not any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            raise
        # The `jax.eval_shape` image of a collection: abstract results. Its leaves
        # were checked in the trace where they entered, and `ShapeDtypeStruct`s are
        # no collection leaves, so the result is made of mappings marked checked.
        # Checked here, not first: that costs ~10% of a concrete call.
        merged = jax.eval_shape(_fold_all, entries)
        return materialize_tree(_replace(summaries, iter(merged)), checked=True)
    return _replace(summaries, iter(merged))

"""How many iterations a scan or vmap runs, checked before anything is traced.

`xs`, `length`, `per_iteration` and `in_axes` are checked here, with errors naming
the leaf and its shape.
"""

import operator
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ._summary import is_array_leaf
from ._typing import InAxes, Leaf, PRNGKeys, Tree


_PER_ITERATION_KEYS = ("prng_key",)


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


def scan_length(xs: PyTree, per_iteration: Tree, length: object) -> int:
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


def check_per_iteration(per_iteration: object) -> dict[str, PRNGKeys]:
    """Return `scan_in_context`'s `per_iteration` as a dict, checked (keys only)."""
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


def vmap_length(xs: PyTree, in_axes: InAxes) -> int:
    """Return the size N of `xs`'s mapped axes, checking them against `in_axes`."""
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

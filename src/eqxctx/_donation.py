"""The check before a donating step (`MethodRunner(donate_batch=True)`)."""

from typing import NoReturn

import jax
from jax.core import Tracer
from jaxtyping import PyTree

from ._partition import path_str
from ._typing import Batch


def check_donated(
    batch: Batch,
    param_leaves: tuple[jax.Array, ...],
    kwargs: dict[str, PyTree],
    *,
    where: str,
) -> None:
    """Refuse a placed batch array that the call reads twice, or that is deleted.

    XLA may write an output into a donated buffer while the same array is read
    again (as another batch leaf, a parameter or a keyword argument): JAX fails, or
    the process crashes. Passing a deleted array (donated by an earlier call) to a
    donating step on several devices crashed XLA's CPU runtime.

    Raises:
        ValueError: naming the batch leaf and the other argument, or the deleted
            batch leaf.
    """
    leaves = [
        x
        for x in jax.tree.leaves(batch)
        if isinstance(x, jax.Array) and not isinstance(x, Tracer)
    ]
    for i, x in enumerate(leaves):
        if x.is_deleted():
            raise ValueError(
                f"`{where}(donate_batch=True)`: the batch leaf {_paths(batch)[i]!r} "
                "is a deleted array (an earlier call donated it, or it was "
                "deleted). Pass the data again (a NumPy array, or a new device "
                "array), or keep the batch: create the runner with "
                "donate_batch=False."
            )
    seen: dict[int, int] = {}  # id -> its first index in `leaves`
    for i, x in enumerate(leaves):
        if id(x) in seen:
            what = f"the batch leaf {_paths(batch)[i]!r}"
            _refuse_aliased(where, _paths(batch)[seen[id(x)]], what)
        seen[id(x)] = i
    if not seen:
        return
    if not seen.keys().isdisjoint(map(id, param_leaves)):
        i = next(i for i, x in enumerate(param_leaves) if id(x) in seen)
        leaf = _paths(batch)[seen[id(param_leaves[i])]]
        _refuse_aliased(where, leaf, f"the model's parameter leaf {i}")
    for name, tree in kwargs.items():
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if id(x) in seen:
                what = f"keyword argument {name}{jax.tree_util.keystr(p)}"
                _refuse_aliased(where, _paths(batch)[seen[id(x)]], what)


def _paths(batch: Batch) -> list[str]:
    """The paths of the placed (non-traced) arrays of `batch`, as `leaves` above."""
    return [
        path_str(p)
        for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]
        if isinstance(x, jax.Array) and not isinstance(x, Tracer)
    ]


def _refuse_aliased(where: str, leaf: str, what: str) -> NoReturn:
    raise ValueError(
        f"`{where}(donate_batch=True)`: the batch leaf {leaf!r} is also passed as "
        f"{what} (the same array): a donated buffer may be overwritten while the "
        "call reads it. Pass a copy (`jnp.copy(x)`) as one of them, or create the "
        "runner with donate_batch=False."
    )

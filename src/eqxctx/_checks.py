"""Argument checks shared by contexts, combinators, branches, loops and the runner.

Each raises `TypeError`/`ValueError` at the call, naming the call and the argument,
saying what was expected and what came instead (see the house style's Errors rule).
Checks of names and leaves live where those enter (`_leaves.py`).
"""

import functools
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from ._leaves import ContextLike, validate_child_name
from ._typing import MaybeKey


T = TypeVar("T")


def _given(value: object) -> str:
    return f"{type(value).__name__} {value!r}"[:100]


def check_is_training(value: object, where: str) -> bool:
    """Return `value` as a `bool`, or raise `TypeError` unless it is a (NumPy) bool."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(
        f"`{where}`: is_training must be a bool, got {type(value).__name__} "
        f"{value!r}. Pass True or False."
    )


def check_prng_key(key: object, where: str) -> MaybeKey:
    """Return `key` if it is None, a raw `uint32[2]` key or a typed key, else raise.

    Raises:
        TypeError: for anything else (a Python int, a string, a float array), saying
            what was given and how to make a key.
    """
    if key is None:
        return None
    dtype = getattr(key, "dtype", None)
    shape = getattr(key, "shape", None)
    if dtype is not None and shape is not None:
        if jnp.issubdtype(dtype, jax.dtypes.prng_key) and tuple(shape) == ():
            return key
        if dtype == np.uint32 and tuple(shape) == (2,):
            return key
    given = (
        f"an array of dtype {dtype} and shape {tuple(shape)}"
        if dtype is not None and shape is not None
        else f"{type(key).__name__} {key!r}"
    )
    raise TypeError(
        f"`{where}`: prng_key must be a raw key (uint32[2], `jax.random.PRNGKey(0)`), "
        f"a typed key (`jax.random.key(0)`) or None, got {given}."
    )


def check_summary_level(level: object, where: str) -> int | None:
    """Return `level` (None or an int), or raise `TypeError` naming `where`."""
    if level is None:
        return None
    if isinstance(level, (int, np.integer)) and not isinstance(level, bool):
        return int(level)
    raise TypeError(
        f"`{where}(summary_level=...)`: expected None (keep every summary) or an "
        f"int, got {type(level).__name__} {level!r}."
    )


def check_context_path(path: object) -> tuple[str, ...]:
    """Return `path` as a tuple of valid names, or raise naming `Context(path=...)`."""
    if isinstance(path, str) or not isinstance(path, (tuple, list)) or not path:
        raise TypeError(
            "`Context(path=...)`: expected a non-empty tuple of names from the root, "
            f"e.g. ('root',) or ('root', 'encoder'), got {type(path).__name__} "
            f"{path!r}. `Context.root(...)` makes a root context."
        )
    for name in path:
        validate_child_name(name, where="Context(path=...)")
    return tuple(path)


def check_path(returned: ContextLike, given: ContextLike, what: str) -> None:
    """Raise `ValueError` unless `returned` has the path of the context `given`.

    A function handed a context must return that context (with outputs added), not
    its parent's or a child's: the outputs would land at the wrong path.
    """
    if returned.path is not given.path and returned.path != given.path:
        raise ValueError(
            f"{what} returned the context at {'/'.join(returned.path)!r}, but was "
            f"handed the context at {'/'.join(given.path)!r}. Return the context you "
            "were given (after adding outputs to it); merge a child's outputs with "
            "`ctx.call` or `ctx.merge`."
        )


def check_drop(value: object, where: str, arg: str = "drop_output") -> None:
    """Raise `TypeError` unless `value` is None or a callable `drop(path) -> bool`."""
    if value is not None and not callable(value):
        hint = (
            f" To drop everything under {value!r}, pass "
            f"`lambda path: path.startswith({value!r})`."
            if isinstance(value, str)
            else ""
        )
        raise TypeError(
            f"`{where}({arg}=...)`: {arg} must be None or a callable "
            f"`drop(path) -> bool`, got {_given(value)}.{hint}"
        )


def check_in_axes(in_axes: T, where: str) -> T:
    """Return `in_axes` with NumPy integers as ints, or raise `TypeError`.

    As `jax.vmap`'s `in_axes`: a prefix tree of `xs` (tuples, lists, dicts) whose
    leaves are ints (an axis, negative counts from the end) or None (not mapped).
    `jax.vmap` refuses NumPy integers, so they are converted.
    """
    leaves = jax.tree_util.tree_leaves(in_axes, is_leaf=lambda a: a is None)
    for leaf in leaves:
        if leaf is None:
            continue
        if isinstance(leaf, bool) or not isinstance(leaf, (int, np.integer)):
            raise TypeError(
                f"`{where}(in_axes=...)`: in_axes must be an int, None, or a prefix "
                f"tree of `xs` with int or None leaves (as in `jax.vmap`), got "
                f"{_given(leaf)}"
                + ("" if leaf is in_axes else f" in {in_axes!r}")
                + "."
            )
    if not any(isinstance(leaf, np.integer) for leaf in leaves):
        return in_axes
    return jax.tree_util.tree_map(
        lambda a: int(a) if isinstance(a, np.integer) else a,
        in_axes,
        is_leaf=lambda a: a is None,
    )


def check_positive_int_or_none(value: object, where: str, arg: str) -> None:
    """Raise `TypeError` unless `value` is None or an int (not a bool)."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, np.integer))
    ):
        raise TypeError(
            f"`{where}({arg}=...)`: {arg} must be a positive int or None, got "
            f"{_given(value)}."
        )


def check_positive_int(value: object, *, where: str, name: str, meaning: str) -> int:
    """Return `value` (argument `name` of `where`) as an int >= 1, or raise.

    Raises:
        TypeError: if `value` is not an integer (a `bool` is not one).
        ValueError: if `value` is less than 1.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"`{where}`: {name} must be an int >= 1 ({meaning}), got "
            f"{type(value).__name__} {value!r}."
        )
    if value < 1:
        raise ValueError(
            f"`{where}`: {name} must be an int >= 1 ({meaning}), got {value}."
        )
    return int(value)


def check_callable(value: object, where: str, arg: str, expected: str) -> None:
    """Raise `TypeError` unless `value` is callable."""
    if not callable(value):
        raise TypeError(
            f"`{where}({arg}=...)`: {arg} must be {expected}, got {_given(value)}."
        )


_KEY_HINT = (
    "It has no PRNG key (prng_key=None), but the function drew random numbers. "
    "Give the root a key: `Context.root(prng_key=jax.random.key(0))`, "
    "`functional(..., prng_key=jax.random.key(0))`, "
    "`value_and_grad(fn)(..., prng_key=jax.random.key(0), is_training=...)` or "
    "`MethodRunner.create(..., prng_key=...)`; every child derives its own."
)


# `ctx: Any`: a `Context` (`_context` imports this module).
def note_missing_key(error: TypeError, ctx: Any, where: str) -> None:
    """Add a note to JAX's error for drawing from a `None` key, naming `ctx`'s path.

    `ctx` is the `Context` (without a key) handed to the function that raised
    `error`. JAX's own message (`unexpected PRNG key type <class 'NoneType'>`)
    names neither the context nor the fix. Only the innermost context adds the
    note; the exception keeps its type and traceback. Call it in an `except
    TypeError` block, then re-raise.
    """
    if (
        "PRNG key" in str(error)
        and not getattr(error, "_eqxctx_noted", False)
        and ctx.prng_key is None
    ):
        error.add_note(f"{where}: the context at {'/'.join(ctx.path)!r}: {_KEY_HINT}")
        error._eqxctx_noted = True  # pyright: ignore[reportAttributeAccessIssue]


@functools.cache
def is_jax_array_type(cls: type) -> bool:
    """Whether values of `cls` are `jax.Array`s, tracers included (once per type).

    `isinstance(x, jax.Array)` is an ABC check; callers on hot paths ask this with
    `type(x)` instead.
    """
    return issubclass(cls, jax.Array)

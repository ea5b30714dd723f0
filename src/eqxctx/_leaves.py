"""Names, levels and leaves of output collections: what may enter, checked there."""

import contextlib
import re
from typing import Final, Literal, Protocol, TypeAlias, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from ._summary import Summary, is_array_leaf
from ._typing import DType, Leaf


#: One of the three kinds of outputs of a collection.
Kind: TypeAlias = Literal["summaries", "state_updates", "module_outputs"]
KINDS: Final[tuple[Kind, Kind, Kind]] = ("summaries", "state_updates", "module_outputs")
ADDERS: Final[dict[str, str]] = {
    "summaries": "add_summary",
    "state_updates": "add_state_update",
    "module_outputs": "add_module_output",
}
_CHILD_NAME = re.compile(r"[a-z][a-z0-9_]*")  # used with fullmatch


def validate_child_name(name: object, *, where: str) -> str:
    """Return `name` if it is a valid child name, else raise `ValueError`."""
    if not isinstance(name, str) or not _CHILD_NAME.fullmatch(name):
        raise ValueError(
            f"`{where}`: invalid child name {name!r}. Child names must match "
            f"'^[a-z][a-z0-9_]*$' (lower case letters, digits and '_', starting with "
            "a letter), e.g. 'encoder' or 'layer_3'."
        )
    return name


def validate_leaf_name(name: object, *, where: str) -> str:
    """Return `name` if it is a valid leaf name (non-empty, no '/'), else raise."""
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(
            f"`{where}`: invalid name {name!r}. Summary, state update and module "
            "output names are non-empty strings without '/'; use `ctx.call` or "
            "`add_child` to nest outputs."
        )
    return name


@runtime_checkable
class ContextLike(Protocol):
    """What checks and probes read of a `Context` (which imports them)."""

    @property
    def path(self) -> tuple[str, ...]:
        """The names from the root to the context."""
        ...

    @property
    def summary_level(self) -> int | None:
        """Entries above this level are dropped; None keeps every level."""
        ...


def drops(ctx: ContextLike, name: object, level: object, where: str) -> bool:
    """Whether an entry of `level` is dropped in `ctx` (checks the level and name).

    Raises:
        TypeError: if `level` is not an int, naming `where`.
        ValueError: for an invalid `name` of a dropped entry.
    """
    if isinstance(level, bool) or not isinstance(level, (int, np.integer)):
        raise TypeError(
            f"`{where}(level=...)`: expected an int (a static level, 0 by default), "
            f"got {type(level).__name__} {level!r}."
        )
    cap = ctx.summary_level
    if cap is None or level <= cap:
        return False
    validate_leaf_name(name, where=where)
    return True


def check_summary_name(key: object, prefix: str, *, where: str) -> str:
    """Return `key` if it is a valid summary path component, else raise `ValueError`."""
    if not isinstance(key, str) or not key or "/" in key:
        at = f"under {prefix.rstrip('/')!r}" if prefix else "at the top level"
        raise ValueError(
            f"`{where}`: invalid summary name {key!r} {at}. Names are non-empty "
            "strings without '/'; nest mappings instead (`{'a': {'b': x}}` is "
            "written as 'a/b')."
        )
    return key


_NUMERIC_KINDS = (jnp.number, jnp.bool_, jax.dtypes.prng_key)
_numeric_cache: dict[DType, bool] = {}


def _is_numeric(dtype: DType) -> bool:
    """Return whether `dtype` is a number, a bool or a typed PRNG key (bfloat16 too)."""
    known = _numeric_cache.get(dtype)
    if known is not None:
        return known
    try:
        ok = any(bool(jnp.issubdtype(dtype, kind)) for kind in _NUMERIC_KINDS)
    except TypeError:
        ok = False
    with contextlib.suppress(TypeError):  # an unhashable dtype-like object
        _numeric_cache[dtype] = ok
    return ok


# Where summaries are checked: `summaries/...` and a scan's stacked summaries.
_SUMMARY_PATHS = ("summaries", "IterationSummaries")


_key_cache: dict[DType, bool] = {}


def _is_key(dtype: DType) -> bool:
    """Whether `dtype` is a typed PRNG key's (cached per dtype)."""
    known = _key_cache.get(dtype)
    if known is None:
        known = bool(jnp.issubdtype(dtype, jax.dtypes.prng_key))
        with contextlib.suppress(TypeError):  # an unhashable dtype-like object
            _key_cache[dtype] = known
    return known


# What a leaf's type makes it (whether a value is an array, a number or a `Summary`
# depends on its type only): looked up once per type.
SUMMARY, ARRAY, NUMBER, INVALID = 0, 1, 2, 3
_leaf_types: dict[type, int] = {}


def leaf_type(value: object) -> int:
    """Return `SUMMARY`, `ARRAY` (has a dtype), `NUMBER` or `INVALID` for `value`."""
    cls = type(value)
    found = _leaf_types.get(cls)
    if found is None:
        if isinstance(value, Summary):
            found = SUMMARY
        elif isinstance(value, (bool, int, float)):
            found = NUMBER
        elif is_array_leaf(value):
            found = ARRAY
        else:
            found = INVALID
        _leaf_types[cls] = found
    return found


_PLAIN, _KEY, _NOT_NUMERIC = 0, 1, 2
#: id(dtype) -> (dtype, its kind): the dtype is kept so that its id stays its own.
_dtype_kinds: dict[int, tuple[object, int]] = {}


def _dtype_kind(dtype: DType) -> int:
    """`_PLAIN` (a numeric non-key dtype), `_KEY` (typed PRNG key) or `_NOT_NUMERIC`."""
    if not _is_numeric(dtype):
        kind = _NOT_NUMERIC
    else:
        kind = _KEY if _is_key(dtype) else _PLAIN
    # NumPy's dtypes only (bfloat16 too): they are few and made once, while JAX's
    # extended dtypes (typed keys) may be made anew on every access.
    if isinstance(dtype, np.dtype) and len(_dtype_kinds) < 1024:
        _dtype_kinds[id(dtype)] = (dtype, kind)
    return kind


def all_plain_arrays(values: list[Leaf]) -> bool:
    """Whether every value is an array of a numeric dtype that is not a PRNG key's.

    A quick test over leaves, with the caches `check_leaf` uses (by type, and by the
    dtype's identity); False leaves the decision to `check_leaf`, by path.
    """
    for value in values:
        kind = _leaf_types.get(type(value))
        if kind is None:
            kind = leaf_type(value)
        dtype = getattr(value, "dtype", None)
        if kind != ARRAY or dtype is None:
            return False
        found = _dtype_kinds.get(id(dtype))
        if (_dtype_kind(dtype) if found is None else found[1]) != _PLAIN:
            return False
    return True


def check_leaf(value: object, path: str, where: str | None = None) -> int:
    """Return `value`'s `leaf_type`; raise `TypeError` naming `path` if it is invalid.

    Valid leaves are JAX and NumPy arrays of numeric dtypes (bool, integer,
    floating, complex, typed PRNG keys), Python `bool`/`int`/`float`, and `Summary`
    objects; typed PRNG keys are refused as summaries (writers log numbers). Called
    once per leaf, where it enters a collection.

    `where` is None for a collection's leaf: `path` is its path in the collection,
    a summary's starting with `summaries` or `IterationSummaries`, and the error
    names `OutputCollection`. Else it is the function whose caller passed summaries
    (e.g. `"JsonlWriter.write"`): the leaf is a summary, `path` its path in what was
    passed, and the error names `where`.
    """
    cls = type(value)
    kind = _leaf_types.get(cls)
    if kind is None:
        kind = leaf_type(value)
    if kind in (SUMMARY, NUMBER):
        return kind
    if kind == ARRAY:
        dtype = getattr(value, "dtype", None)
        if dtype is None:
            return kind
        # One lookup per leaf, by the dtype's identity (dtypes are few and kept
        # alive by the cache; hashing a NumPy dtype costs more than the lookup).
        found = _dtype_kinds.get(id(dtype))
        known = _dtype_kind(dtype) if found is None else found[1]
        if known == _PLAIN:
            return kind
        if known == _KEY:
            if where is not None or path.startswith(_SUMMARY_PATHS):
                raise TypeError(
                    f"`{owner(where)}`: the summary at {path!r} is a typed PRNG key "
                    f"({dtype}); writers log numbers. Add it as a module output, or "
                    "summarize `jax.random.key_data(key)`."
                )
            return kind
        raise TypeError(
            f"`{owner(where)}`: the array at {path!r} has dtype {dtype}; leaves must "
            "be numeric (bool, int, float, complex). Log text with a "
            "`CallbackSummary`."
        )
    hint = " Add one output per leaf, or use `ctx.call` to nest them."
    raise TypeError(
        f"`{owner(where)}`: the value at {path!r} has type {type(value).__name__}; "
        "leaves must be JAX or NumPy arrays, Python bool/int/float, or `Summary` "
        f"objects.{hint if where is None else ''}"  # summaries passed are not added
    )


def owner(where: str | None) -> str:
    """Who a leaf's or a key's error names (see `check_leaf`)."""
    return "OutputCollection" if where is None else where

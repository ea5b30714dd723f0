"""`assert_collections_equal` (`eqxctx.testing`): compare collections by path."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._collection import KINDS, OutputCollection
from ._summary import Summary
from ._typing import ArrayTree, Leaf


def _as_numpy(leaf: Leaf) -> list[tuple[np.ndarray, np.dtype[Any]]]:
    """Each array of `leaf` as given (a typed key as its key data), with JAX's dtype.

    The dtype is the one `jnp.asarray` would give (a Python `1.0` and
    `jnp.float32(1)` agree), found without converting: the values compared are the
    ones given, so an int64 or float64 value that JAX's default dtype would change
    (`2**32 + 1`, `1e300`) is not compared after the change.
    """
    out: list[tuple[np.ndarray, np.dtype[Any]]] = []
    for x in jax.tree_util.tree_leaves(leaf):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        dtype = np.dtype(jax.dtypes.canonicalize_dtype(jnp.result_type(x)))
        out.append((np.asarray(x), dtype))
    return out


def assert_collections_equal(
    actual: OutputCollection,
    expected: OutputCollection,
    *,
    rtol: float = 1e-6,
    atol: float = 1e-6,
    value_fn: Callable[[Leaf], ArrayTree] = lambda x: x,
) -> None:
    """Assert that two collections have the same flattened paths, types and values.

    Compares `flatten(kind)` of every kind (so per-iteration summaries compare by
    their `iter{i}/...` paths), the `Summary` kind of each leaf and its static fields
    (an `AudioSummary`'s sample rate, a `HistogramSummary`'s edges, a
    `CallbackSummary`'s function), the shape and dtype of every array leaf (the
    dtype `jnp.asarray` would give, so `1.0` and `jnp.float32(1)` agree; typed keys
    by their key data), and its values as given (not converted to JAX's default
    dtypes) with `numpy.testing.assert_allclose`.

    Raises:
        AssertionError: naming the first path that differs.
    """
    for kind in KINDS:
        got, want = actual.flatten(kind), expected.flatten(kind)
        if set(got) != set(want):
            raise AssertionError(
                f"{kind}: paths differ: only in actual {sorted(set(got) - set(want))}, "
                f"only in expected {sorted(set(want) - set(got))}"
            )
        for path in sorted(want):
            a, b = value_fn(got[path]), value_fn(want[path])
            is_summary = isinstance(a, Summary) or isinstance(b, Summary)
            if is_summary and type(a) is not type(b):
                raise AssertionError(
                    f"{kind}/{path}: {type(a).__name__} != {type(b).__name__}"
                )
            if is_summary and (
                jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b)
            ):
                # Static fields: an `AudioSummary`'s sample rate, a
                # `HistogramSummary`'s edges, a `CallbackSummary`'s function.
                raise AssertionError(
                    f"{kind}/{path}: the {type(a).__name__}s differ in their static "
                    f"fields: {jax.tree_util.tree_structure(a)} != "
                    f"{jax.tree_util.tree_structure(b)}"
                )
            la, lb = _as_numpy(a), _as_numpy(b)
            if len(la) != len(lb):
                raise AssertionError(f"{kind}/{path}: different number of arrays")
            for (x, x_dtype), (y, y_dtype) in zip(la, lb, strict=True):
                if x.shape != y.shape or x_dtype != y_dtype:
                    raise AssertionError(
                        f"{kind}/{path}: {x_dtype}{list(x.shape)} != "
                        f"{y_dtype}{list(y.shape)}"
                    )
                np.testing.assert_allclose(
                    x, y, rtol=rtol, atol=atol, err_msg=f"at {kind}/{path}"
                )

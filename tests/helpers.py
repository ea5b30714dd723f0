"""Shared test helpers."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


def tree_allclose(a: Any, b: Any, *, rtol: float = 1e-6, atol: float = 1e-6) -> bool:
    """Return whether two PyTrees have equal structure and allclose leaves."""
    return bool(eqx.tree_equal(a, b, typematch=False, rtol=rtol, atol=atol))


def to_numpy_dict(flat: dict[str, Any]) -> dict[str, np.ndarray]:
    """Turn flattened leaves into stacked NumPy arrays (a Summary: its fields)."""
    out: dict[str, np.ndarray] = {}
    for path, leaf in flat.items():
        leaves = jax.tree_util.tree_leaves(leaf)
        out[path] = np.stack([np.asarray(jnp.asarray(x)) for x in leaves])
    return out

"""Hypothesis strategies and assertion helpers for tests of code that uses eqxctx.

Requires `hypothesis` (the `test` extra): `pip install "eqxctx[test]"`. Use the
strategies with `hypothesis.given`, e.g. `@given(output_collections())`, and compare
collections with `assert_collections_equal(actual, expected)`.
"""

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


try:
    from hypothesis import strategies as st
    from hypothesis.extra import numpy as hnp
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "`eqxctx.testing` needs hypothesis: install it with `pip install "
        "'eqxctx[test]'` (or `pip install hypothesis`)."
    ) from e

from ._collection import ADDERS, KINDS, IterationSummaries, OutputCollection
from ._errors import OutputConflictError
from ._summary import (
    MaxSummary,
    MinSummary,
    Summary,
    SumSummary,
    WeightedSummary,
)


__all__ = [
    "array_leaves",
    "assert_collections_equal",
    "child_names",
    "leaf_names",
    "output_collections",
    "summary_leaves",
]


def child_names() -> st.SearchStrategy[str]:
    """Return a strategy of valid child names (`^[a-z][a-z0-9_]*$`, short)."""
    return st.from_regex(r"\A[a-z][a-z0-9_]{0,5}\Z")


def leaf_names() -> st.SearchStrategy[str]:
    """Return a strategy of valid leaf names (non-empty, no '/', printable ASCII)."""
    alphabet = st.characters(
        min_codepoint=33, max_codepoint=126, exclude_characters="/"
    )
    return st.text(alphabet, min_size=1, max_size=6)


def array_leaves(max_side: int = 3, max_rank: int = 2) -> st.SearchStrategy[np.ndarray]:
    """Return a strategy of small float32 NumPy arrays with finite values.

    Args:
        max_side: the largest size of one axis.
        max_rank: the largest rank.
    """
    shapes = hnp.array_shapes(min_dims=0, max_dims=max_rank, max_side=max_side)
    floats = st.floats(-100, 100, width=32)
    return hnp.arrays(np.float32, shapes, elements=floats)


def summary_leaves() -> st.SearchStrategy[Any]:
    """Return a strategy of scalar summary leaves: raw arrays and `Summary` kinds."""
    scalar = st.floats(-100, 100, width=32).map(np.float32)
    weight = st.floats(0, 10, width=32).map(np.float32)
    summaries: st.SearchStrategy[Summary] = st.one_of(
        st.builds(WeightedSummary, scalar, weight),
        st.builds(MinSummary, scalar),
        st.builds(MaxSummary, scalar),
        st.builds(SumSummary, scalar),
    )
    return st.one_of(scalar, summaries)


@st.composite
def _collection(
    draw: Callable[[st.SearchStrategy[Any]], Any], depth: int, max_entries: int
) -> OutputCollection:
    coll = OutputCollection.empty()
    n = draw(st.integers(0, max_entries))
    for _ in range(n):
        extra = ("child", "iterations") if depth > 0 else ()
        choice = draw(st.sampled_from(KINDS + extra))
        if choice == "iterations":
            # A scan's per-iteration summaries: one stacked `IterationSummaries`.
            prefix = draw(child_names())
            length = draw(st.integers(0, 3))
            names = draw(st.lists(leaf_names(), max_size=3, unique=True))
            stacked = {
                leaf: draw(
                    hnp.arrays(
                        np.float32, (length,), elements=st.floats(-100, 100, width=32)
                    )
                )
                for leaf in names
            }
            entry = OutputCollection(
                {prefix: IterationSummaries(length, stacked)},
                {prefix: {}},
                {prefix: {}},
            )
            with contextlib.suppress(OutputConflictError):
                coll = coll.merge(entry)
            continue
        if choice == "child":
            name = draw(child_names())
            used = coll.child_names() | coll.leaf_names()
            if name in used:
                continue
            child = draw(_collection(depth - 1, max_entries))
            coll = coll.add_child(name, child)
            continue
        name = draw(leaf_names())
        if name in coll.child_names() or name in coll.flatten(choice):
            continue
        value = draw(summary_leaves() if choice == "summaries" else array_leaves())
        coll = getattr(coll, ADDERS[choice])(name, value)
    return coll


def output_collections(
    max_depth: int = 2, max_entries: int = 4
) -> st.SearchStrategy[OutputCollection]:
    """Return a strategy of valid `OutputCollection`s built through the public API.

    Besides leaves and children, collections may hold a scan's per-iteration
    summaries (an `IterationSummaries` entry with 0 to 3 iterations).

    Args:
        max_depth: the deepest nesting of children.
        max_entries: the most entries (leaves or children) drawn per level.
    """
    return _collection(max_depth, max_entries)


def _as_numpy(leaf: Any) -> list[np.ndarray]:
    # Through `jnp.asarray`: a Python number, a NumPy array and a JAX array of the same
    # values compare equal when JAX would give them the same dtype.
    return [np.asarray(jnp.asarray(x)) for x in jax.tree_util.tree_leaves(leaf)]


def assert_collections_equal(
    actual: OutputCollection,
    expected: OutputCollection,
    *,
    rtol: float = 1e-6,
    atol: float = 1e-6,
    value_fn: Callable[[Any], Any] = lambda x: x,
) -> None:
    """Assert that two collections have the same flattened paths, types and values.

    Compares `flatten(kind)` of every kind (so per-iteration summaries compare by
    their `iter{i}/...` paths), the `Summary` kind of each leaf, the shape and dtype
    of every array leaf (after `jnp.asarray`, so `1.0` and `jnp.float32(1)` agree),
    and its
    values with `numpy.testing.assert_allclose`.

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
            la, lb = _as_numpy(a), _as_numpy(b)
            if len(la) != len(lb):
                raise AssertionError(f"{kind}/{path}: different number of arrays")
            for x, y in zip(la, lb, strict=True):
                if x.shape != y.shape or x.dtype != y.dtype:
                    raise AssertionError(
                        f"{kind}/{path}: {x.dtype}{list(x.shape)} != "
                        f"{y.dtype}{list(y.shape)}"
                    )
                np.testing.assert_allclose(
                    x, y, rtol=rtol, atol=atol, err_msg=f"at {kind}/{path}"
                )

"""The `eqxctx.testing` strategies feed every public operation that accepts them.

`flatten`, `prune`, `merge` of disjoint draws, the writers (JSONL, TensorBoard, both
through `MultiWriter`), `SummaryAccumulator` and `jax.jit` identity (issue 10).
"""

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from eqxctx import (
    AudioSummary,
    Context,
    IterationSummaries,
    OutputCollection,
    SummaryAccumulator,
    functional,
)
from eqxctx.testing import (
    DEFAULT_SUMMARY_KINDS,
    assert_collections_equal,
    child_names,
    contexts,
    leaf_names,
    output_collections,
    summary_leaves,
)
from eqxctx.writers import JsonlWriter, MultiWriter, TensorBoardWriter


def _entries(coll: OutputCollection) -> dict[str, Any]:
    return {
        f"{kind}/{path}": leaf
        for kind in ("summaries", "state_updates", "module_outputs")
        for path, leaf in coll.flatten(kind).items()
    }


@given(output_collections(), st.data())
def test_collections_pass_every_public_operation(
    coll: OutputCollection, data: st.DataObject
) -> None:
    # flatten, and jit identity.
    flat = _entries(coll)
    assert_collections_equal(jax.jit(lambda c: c)(coll), coll)
    # prune: dropping nothing keeps every entry; dropping a drawn path removes it.
    assert_collections_equal(coll.prune(lambda path: False), coll)
    if flat:
        path = data.draw(st.sampled_from(sorted(flat)))
        pruned = coll.prune(lambda p: p == path)
        assert set(_entries(pruned)) == set(flat) - {path}
    # SummaryAccumulator: accumulating a collection with itself keeps its paths.
    acc = SummaryAccumulator().update(coll).update(coll)
    assert set(acc.flatten()) == set(coll.flatten("summaries"))


@given(output_collections(), output_collections(), child_names(), child_names())
def test_disjoint_draws_merge(
    a: OutputCollection, b: OutputCollection, name_a: str, name_b: str
) -> None:
    if name_a == name_b:
        name_b += "_b"
    left = OutputCollection.empty().add_child(name_a, a)
    right = OutputCollection.empty().add_child(name_b, b)
    merged = left.merge(right)
    assert _entries(merged).keys() == _entries(left).keys() | _entries(right).keys()
    assert_collections_equal(merged.child(name_a), a)
    assert_collections_equal(merged.child(name_b), b)
    # Both orders give the same collection.
    assert_collections_equal(right.merge(left), merged)


@given(output_collections())
def test_every_writer_accepts_the_default_collections(
    tmp_path_factory: pytest.TempPathFactory, coll: OutputCollection
) -> None:
    pytest.importorskip("tensorboardX")
    logdir = tmp_path_factory.mktemp("tb")
    jsonl = JsonlWriter(logdir / "summaries.jsonl")
    with MultiWriter(jsonl, TensorBoardWriter(logdir)) as writer:
        writer.write(0, coll)
        writer.write(1, {"train": coll})
    lines = (logdir / "summaries.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]


@given(contexts())
def test_contexts_pass_through_jit_and_functional(ctx: Context) -> None:
    out = jax.jit(lambda c: c)(ctx)
    assert out.path == ctx.path
    assert out.is_training == ctx.is_training
    assert_collections_equal(out.collection, ctx.collection)
    if ctx.prng_key is None:
        assert out.prng_key is None
    else:
        np.testing.assert_array_equal(
            jax.random.key_data(out.prng_key), jax.random.key_data(ctx.prng_key)
        )
        # A child of a drawn context draws randomness.
        jax.random.normal(ctx.child("layer").prng_key)
    # The context's collection merges into a fresh root's, under a child.
    _, coll = functional(
        lambda c: (
            None,
            c.merge(OutputCollection.empty().add_child("x", ctx.collection)),
        ),
        prng_key=None,
        is_training=ctx.is_training,
        drop_output_collections=(),
    )
    assert_collections_equal(coll.child("x"), ctx.collection)


@given(
    output_collections(
        max_depth=1,
        max_width=3,
        kinds=("summaries",),
        leaf_names=st.sampled_from(["a", "b"]),
        shapes=st.just((2,)),
        dtypes=(np.int32,),
        summary_kinds=("raw", AudioSummary),
        iterations=False,
    )
)
def test_output_collections_controls(coll: OutputCollection) -> None:
    assert not coll.flatten("module_outputs")
    assert not coll.flatten("state_updates")
    for path, leaf in coll.flatten("summaries").items():
        assert path.rsplit("/", 1)[-1] in ("a", "b")
        assert path.count("/") <= 1
        if isinstance(leaf, AudioSummary):
            continue
        assert np.shape(leaf) == (2,)
        assert np.asarray(leaf).dtype == np.int32


def _iteration_entries(tree: Any) -> list[IterationSummaries]:
    found: list[IterationSummaries] = []
    for value in tree.values():
        if isinstance(value, IterationSummaries):
            found.append(value)
            found += _iteration_entries(value.stacked)
        elif hasattr(value, "values"):
            found += _iteration_entries(value)
    return found


def test_output_collections_include_scan_layouts() -> None:
    # Over many draws: stacked per-iteration entries, nested ones, and ones under an
    # outer vmap (an axis in front of the iteration axis).
    seen = {"entry": False, "nested": False, "outer": False}

    @given(output_collections(max_depth=1, max_width=4))
    def look(coll: OutputCollection) -> None:
        for entry in _iteration_entries(coll.summaries):
            seen["entry"] = True
            leaves = jax.tree_util.tree_leaves(entry.stacked)
            if any(isinstance(v, IterationSummaries) for v in entry.stacked.values()):
                seen["nested"] = True
            if any(np.ndim(x) > n for x, n in zip(leaves, entry.ndims, strict=True)):
                seen["outer"] = True

    look()
    assert seen == {"entry": True, "nested": True, "outer": True}


def test_scan_layouts_with_the_nested_prefix_as_a_name() -> None:
    # A summary named like the nested scan's child (`iter`): drawing must not raise
    # (it did, in the body's merge of the nested scan, before its names were
    # filtered), and the entry keeps its nested per-iteration summaries.
    seen = {"nested": False}

    @settings(max_examples=100)
    @given(output_collections(max_depth=1, max_width=4, leaf_names=st.just("iter")))
    def look(coll: OutputCollection) -> None:
        for entry in _iteration_entries(coll.summaries):
            nested = [
                v for v in entry.stacked.values() if isinstance(v, IterationSummaries)
            ]
            seen["nested"] = seen["nested"] or bool(nested)

    look()
    assert seen["nested"]


def test_default_leaf_names_are_writer_safe() -> None:
    @given(leaf_names())
    def check(name: str) -> None:
        assert name != "step"
        assert all(c.isalnum() or c in "_.-" for c in name)

    check()

    @given(leaf_names(any_printable=True))
    def printable(name: str) -> None:
        assert "/" not in name
        assert name

    printable()


def test_unknown_controls_are_errors() -> None:
    with pytest.raises(ValueError, match=r"`output_collections\(kinds=\.\.\.\)`"):
        output_collections(kinds=("summary",))
    with pytest.raises(ValueError, match=r"`summary_leaves\(summary_kinds=\.\.\.\)`"):
        summary_leaves(summary_kinds=(int,))
    with pytest.raises(ValueError, match=r"`contexts\(keys=\.\.\.\)`"):
        contexts(keys=("raw", "bad"))
    assert len(DEFAULT_SUMMARY_KINDS) == 10


def test_assert_collections_equal_sees_static_fields_and_values_as_given() -> None:
    from eqxctx import AudioSummary, CallbackSummary, HistogramSummary

    empty = OutputCollection.empty()
    x = jnp.array([0.1, 0.6])
    differing = [
        (  # the same counts, other edges
            empty.add_summary("h", HistogramSummary(x, bins=2, range=(0, 1))),
            empty.add_summary("h", HistogramSummary(x * 10, bins=2, range=(0, 10))),
        ),
        (
            empty.add_summary("a", AudioSummary(x, sample_rate=8000)),
            empty.add_summary("a", AudioSummary(x, sample_rate=44100)),
        ),
        (
            empty.add_summary("c", CallbackSummary(np.sum, x)),
            empty.add_summary("c", CallbackSummary(np.max, x)),
        ),
        (  # equal after JAX's int32 (2**32 + 1 -> 1)
            empty.add_summary("i", np.array(2**32 + 1, np.int64)),
            empty.add_summary("i", np.array(1, np.int64)),
        ),
        (  # equal after JAX's float32 (both inf)
            empty.add_summary("f", np.array(1e300)),
            empty.add_summary("f", np.array(1e305)),
        ),
        (
            empty.add_module_output("k", jax.random.key(0)),
            empty.add_module_output("k", jax.random.key(1)),
        ),
    ]
    for actual, expected in differing:
        with pytest.raises(AssertionError):
            assert_collections_equal(actual, expected)
        assert_collections_equal(actual, actual)
    # JAX's default dtypes still decide what agrees.
    assert_collections_equal(
        empty.add_summary("x", 1.0), empty.add_summary("x", jnp.float32(1.0))
    )
    assert_collections_equal(
        empty.add_summary("x", np.float64(0.5)),
        empty.add_summary("x", jnp.float32(0.5)),
    )


# From test_regressions.py: found by trying eqxctx as a new user would.
def test_assert_collections_equal_checks_shape_and_dtype() -> None:
    one = OutputCollection({"x": jnp.ones(3)}, {}, {})
    with pytest.raises(AssertionError, match=r"x: float32\[3\] != float32\[\]"):
        assert_collections_equal(one, OutputCollection({"x": 1.0}, {}, {}))
    with pytest.raises(AssertionError, match="int32"):
        assert_collections_equal(
            OutputCollection({"x": jnp.int32(1)}, {}, {}),
            OutputCollection({"x": True}, {}, {}),
        )
    assert_collections_equal(
        OutputCollection({"x": 1.0}, {}, {}),
        OutputCollection({"x": jnp.float32(1)}, {}, {}),
    )

"""Per-iteration views of an abstract collection (`jax.eval_shape`) against a trace.

Inside a trace `flatten`, `child`, `materialize` and `merge_iterations` index traced
arrays; `jax.eval_shape` of that is the reference for the views of the abstract
collection `jax.eval_shape` returns.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from eqxctx import (
    Context,
    ImageSummary,
    IterationSummaries,
    MethodRunner,
    OutputCollection,
    SummaryAccumulator,
    WeightedSummary,
    scan_in_context,
)
from eqxctx.writers import fetch_summaries


def _body(c: Any, x: Any, ctx: Context) -> tuple[Any, None, Context]:
    ctx = ctx.add_summary("loss", x[0])
    ctx = ctx.add_summary("row", x)
    ctx = ctx.add_summary("mean", WeightedSummary(jnp.mean(x), 2.0))
    ctx = ctx.add_summary("img", ImageSummary(jnp.broadcast_to(x[0], (1, 2, 2))))
    ctx = ctx.add_summary("small", jnp.astype(x[0], jnp.bfloat16))
    return c, None, ctx


def _step(xs: jax.Array) -> OutputCollection:
    def outer(c: Any, x: Any, ctx: Context) -> tuple[Any, None, Context]:
        _, _, inner = scan_in_context(
            _body, context=ctx, carry=0.0, xs=x, child_name_prefix="layer"
        )
        return c, None, ctx.merge(inner).add_summary("x", x[0, 0])

    return scan_in_context(outer, context=Context.root(), carry=0.0, xs=xs)[2]


VIEWS: dict[str, Callable[[OutputCollection], Any]] = {
    "flatten": lambda coll: coll.flatten("summaries"),
    "child": lambda coll: coll.child("iter1").flatten("summaries"),
    "nested child": lambda coll: coll.child("iter1").child("layer0").summaries,
    "materialize": lambda coll: coll.materialize().summaries,
    "merge_iterations": lambda coll: coll.merge_iterations().flatten("summaries"),
    "iterations": lambda coll: IterationSummaries.iterations(coll.summaries["iter"]),
}


def _structs(tree: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, [(x.shape, x.dtype, x.weak_type, x.sharding) for x in leaves]


@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("vmapped", [False, True])
def test_views_of_an_abstract_collection_are_abstract(view: str, vmapped: bool) -> None:
    """They raised `'ShapeDtypeStruct' object is not subscriptable`."""
    step = jax.vmap(_step) if vmapped else _step
    xs = jnp.ones((5, 3, 2, 4) if vmapped else (3, 2, 4))
    abstract = jax.eval_shape(step, xs)
    got = VIEWS[view](abstract)
    want = jax.eval_shape(lambda xs: VIEWS[view](step(xs)), xs)
    assert _structs(got) == _structs(want)
    assert all(
        isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(got)
    )
    if view == "flatten":
        outer = (5,) if vmapped else ()
        assert got["iter2/layer1/row"].shape == (*outer, 4)
        assert got["iter2/x"].shape == outer
        assert got["iter0/layer0/small"].dtype == jnp.bfloat16
        assert len(got) == 3 * (2 * 5 + 1)  # 5 summaries per layer, and x


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (simulated) devices")
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_abstract_views_keep_the_sharding_of_a_slice(axis_type: AxisType) -> None:
    mesh = jax.make_mesh((2,), ("data",), axis_types=(axis_type,))

    def step(xs: jax.Array) -> OutputCollection:
        return scan_in_context(
            lambda c, x, ctx: (c, None, ctx.add_summary("x", x)),
            context=Context.root(),
            carry=0.0,
            xs=xs,
        )[2]

    xs = jax.ShapeDtypeStruct(
        (3, 4), jnp.float32, sharding=NamedSharding(mesh, P(None, "data"))
    )
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(step, xs)
        want = jax.eval_shape(lambda xs: step(xs).flatten("summaries"), xs)
    got = abstract.flatten("summaries")
    assert _structs(got) == _structs(want)
    if axis_type == AxisType.Explicit:
        assert got["iter1/x"].sharding.spec == P("data")
    # A sliced sharded axis has no `NamedSharding`; a single device's stays.
    sharded = NamedSharding(mesh, P("data"))
    entry = _abstract_entry(jax.ShapeDtypeStruct((2, 4), jnp.float32, sharding=sharded))
    assert entry.iteration(1)["x"] == jax.ShapeDtypeStruct((4,), jnp.float32)
    make = getattr(jax.sharding, "make_single_device_sharding", None)  # JAX >= 0.10
    if make is None:
        make = jax.sharding.SingleDeviceSharding
    one = make(jax.devices()[0])
    entry = _abstract_entry(jax.ShapeDtypeStruct((2, 4), jnp.int8, sharding=one))
    assert entry.iteration(0)["x"] == jax.ShapeDtypeStruct((4,), jnp.int8, sharding=one)


def _abstract_entry(x: jax.ShapeDtypeStruct) -> IterationSummaries:
    """An entry holding `x`, as unflattening (e.g. by `jax.eval_shape`) makes it."""
    concrete = IterationSummaries(x.shape[0], {"x": np.zeros(x.shape, x.dtype)})
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(concrete), [x])


class _Model(eqx.Module):
    w: jax.Array

    def __call__(self, batch: Any, ctx: Context) -> tuple[Any, Context]:
        def body(c: Any, x: Any, cc: Context) -> tuple[Any, None, Context]:
            return c, None, cc.add_summary("s", jnp.sum(x))

        _, _, coll = scan_in_context(body, context=ctx, carry=0.0, xs=batch["x"].T)
        return {"y": batch["x"] @ self.w}, ctx.merge(coll)


def test_eval_shape_of_a_runner_gives_abstract_iterations() -> None:
    mesh = jax.make_mesh((1,), ("data",))
    runner = MethodRunner.create(
        _Model(jnp.ones((3, 2))), "__call__", mesh=mesh, prng_key=jax.random.PRNGKey(0)
    )
    batch = {"x": np.ones((4, 3), np.float32)}
    # Only the outputs: a runner holding `ShapeDtypeStruct`s fails the test suite's
    # runtime type checks of `MethodRunner.__init__`.
    abstract = jax.eval_shape(lambda b: runner(b)[1], batch)
    _, out = runner(batch)
    got = IterationSummaries.iterations(abstract.summaries["iter"])
    want = IterationSummaries.iterations(out.summaries["iter"])
    assert len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        assert g["s"].shape == np.shape(w["s"])
        assert g["s"].dtype == w["s"].dtype


# -- a stacked leaf whose iteration axis no longer has `length` entries ---------------


def _scan12(xs: jax.Array | None = None) -> OutputCollection:
    def body(c: Any, x: Any, ctx: Context) -> tuple[Any, None, Context]:
        ctx = ctx.add_summary("x", x)
        return c, None, ctx.add_summary("w", WeightedSummary(x, 1.0))

    xs = jnp.arange(12.0) if xs is None else xs
    return scan_in_context(body, context=Context.root(), carry=0.0, xs=xs)[2]


#: The error for `_first6`'s leaves (the first one refused is either).
SIX = r"'(w/mean|x)' of shape \(6,\) has size 6 on its iteration axis .*12 iterations"


def _first6(coll: OutputCollection) -> OutputCollection:
    # Keeping the first 6 layers' summaries by slicing every leaf: the static
    # `length` stays 12.
    return jax.tree.map(lambda x: x[:6], coll)


SLICED_VIEWS: dict[str, Callable[[OutputCollection], Any]] = {
    "flatten": lambda coll: coll.flatten("summaries"),
    "flatten sep": lambda coll: coll.flatten("summaries", sep="."),
    "child in range": lambda coll: coll.child("iter3").summaries,
    "child past the rows": lambda coll: coll.child("iter9").summaries,
    "materialize": lambda coll: coll.materialize().summaries,
    "prune stacked": lambda coll: coll.prune(lambda p: p.endswith("/w")),
    "prune sliced": lambda coll: coll.prune(lambda p: p == "summaries/iter3"),
    "merge_iterations": lambda coll: coll.merge_iterations(),
    "iteration": lambda coll: IterationSummaries.iteration(coll.summaries["iter"], 3),
    "iterations": lambda coll: IterationSummaries.iterations(coll.summaries["iter"]),
    "SummaryAccumulator.update": lambda coll: SummaryAccumulator().update(coll),
    "SummaryAccumulator.update twice": (
        lambda coll: SummaryAccumulator().update(_scan12()).update(coll)
    ),
    "fetch_summaries": lambda coll: fetch_summaries(coll),
}


@pytest.mark.parametrize("view", sorted(SLICED_VIEWS))
def test_a_sliced_iteration_axis_is_a_clear_error(view: str) -> None:
    """The views raised IndexError, or read 6 iterations as if they were 12."""
    sliced = _first6(_scan12())
    # The methods of an entry do not know its path.
    at = (
        ""
        if view.startswith("iteration")
        else (
            r" at '(summaries/)?iter' \(children '(summaries/)?iter0' … "
            r"'(summaries/)?iter11'\)"
        )
    )
    match = (
        rf"`IterationSummaries`{at}: the leaf '(w/mean|x)' of shape \(6,\) has size "
        r"6 on its iteration axis \(axis 0\), but the entry reserves 12 "
        r"iterations.*IterationSummaries\(new_length.*a scan of that length"
    )
    with pytest.raises(ValueError, match=match):
        SLICED_VIEWS[view](sliced)


def test_a_sliced_iteration_axis_is_a_clear_error_in_writers(tmp_path: Any) -> None:
    from eqxctx.writers import JsonlWriter

    good = _scan12()
    with JsonlWriter(str(tmp_path / "log.jsonl")) as w:
        w.write(0, good)  # a structure read in full, then replayed
        with pytest.raises(ValueError, match=SIX):
            w.write(1, _first6(good))


def test_a_sliced_iteration_axis_is_a_clear_error_inside_jit() -> None:
    coll = _scan12()
    with pytest.raises(ValueError, match=SIX):
        jax.jit(lambda c: _first6(c).flatten("summaries"))(coll)
    with pytest.raises(ValueError, match=SIX):
        jax.jit(lambda c: _first6(c).merge_iterations().summaries)(coll)
    with pytest.raises(ValueError, match=SIX):
        jax.eval_shape(lambda c: _first6(c).child("iter2").summaries, coll)


def test_a_sliced_inner_scan_names_the_inner_entry() -> None:
    coll = _step(jnp.ones((3, 2, 4)))  # 3 outer iterations of 2 inner layers
    assert coll.flatten("summaries")["iter2/layer1/loss"].shape == ()
    # The inner iteration axis only (the outer scan's own leaves have one axis).
    inner = jax.tree.map(lambda x: x[:, :1] if x.ndim > 1 else x, coll)
    # (`child("iter1")` holds the inner entry at `layer`.)
    match = r"at '(iter.*/)?layer' .*has size 1 on .*reserves 2 iterations"
    for view in ("flatten", "materialize", "merge_iterations", "nested child"):
        with pytest.raises(ValueError, match=match):
            VIEWS[view](inner)
    with pytest.raises(ValueError, match=match):
        SummaryAccumulator().update(inner)


def test_sliced_outer_axes_and_rebuilt_entries_still_work() -> None:
    # A vmapped scan: slicing the batch (outer) axis keeps every iteration.
    coll = jax.vmap(_scan12)(jnp.arange(48.0).reshape(4, 12))
    half = jax.tree.map(lambda x: x[:2], coll)
    flat = half.flatten("summaries")
    assert flat["iter11/x"].shape == (2,)
    np.testing.assert_array_equal(flat["iter11/x"], [11.0, 23.0])
    assert half.child("iter5").summaries["x"].shape == (2,)
    assert half.merge_iterations().flatten("summaries")["iter/x"].shape == (2,)
    # ... and slicing its iteration axis is refused.
    match = r"of shape \(4, 6\) has size 6 on its iteration axis \(axis 1\)"
    with pytest.raises(ValueError, match=match):
        jax.tree.map(lambda x: x[:, :6], coll).flatten("summaries")
    # The fix the message gives: a new entry of the kept iterations.
    entry = _scan12().summaries["iter"]
    first6 = IterationSummaries(
        6, jax.tree.map(lambda x: x[:6], entry.stacked), entry.ndims, entry.reverse
    )
    rebuilt = OutputCollection({"iter": first6}, {}, {})
    assert sorted(rebuilt.flatten("summaries")) == sorted(
        f"iter{i}/{name}" for i in range(6) for name in ("w", "x")
    )
    acc = SummaryAccumulator().update(rebuilt).update(rebuilt)
    assert float(acc.flatten()["iter5/x"]) == 10.0


def test_a_length_0_scan_still_has_views() -> None:
    coll = _scan12(jnp.zeros((0,)))
    assert coll.flatten("summaries") == {}
    assert coll.materialize().summaries["iter"] == {}
    assert coll.merge_iterations().flatten("summaries") == {}
    assert SummaryAccumulator().update(coll).update(coll).flatten() == {}
    with pytest.raises(
        ValueError, match=r"'(w/mean|x)' of shape \(1,\) has size 1 .*0 iterations"
    ):
        jax.tree.map(lambda x: jnp.zeros((1, *x.shape[1:]), x.dtype), coll).flatten(
            "summaries"
        )


# From test_regressions.py: found by trying eqxctx as a new user would.
def test_mapping_over_a_non_leading_axis_says_why() -> None:
    def f(c: None, x: jax.Array, ctx: Context) -> tuple[None, None, Context]:
        return c, None, ctx.add_summary("v", x)

    _, _, coll = scan_in_context(
        f, context=Context.root(), carry=None, xs=jnp.arange(12.0).reshape(4, 3)
    )
    with pytest.raises(ValueError, match="fewer axes than when it was made"):
        jax.vmap(lambda c: c.flatten("summaries")["iter1/v"], in_axes=(0,))(coll)


# From test_host_cost.py (issue 36: tests mirror modules).
def test_per_iteration_views_inside_jit_slice_on_device() -> None:
    def f(xs: jax.Array) -> Any:
        coll = OutputCollection({"iter": IterationSummaries(3, {"x": xs})}, {}, {})
        return coll.flatten("summaries")

    out = jax.jit(f)(jnp.arange(3.0))
    assert {k: float(v) for k, v in out.items()} == {
        "iter0/x": 0.0,
        "iter1/x": 1.0,
        "iter2/x": 2.0,
    }

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
    WeightedSummary,
    scan_in_context,
)


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

"""Summary levels: `add_summary(..., level=)` and the static `summary_level`."""

import contextlib
import io
import pickle
import re
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqxctx
from eqxctx import (
    Context,
    MethodRunner,
    cond_in_context,
    fori_in_context,
    functional,
    scan_in_context,
    switch_in_context,
    vmap_in_context,
    while_in_context,
)
from helpers import optimized_hlo


def _add(x: Any, ctx: Context) -> Context:
    """Add a level-0 and a level-1 summary and module output of `x`."""
    ctx = ctx.add_summary("cheap", jnp.sum(x))
    ctx = ctx.add_summary("full", jnp.max(x), level=1)
    ctx = ctx.add_module_output("act", x)
    return ctx.add_module_output("act_full", 2 * x, level=1)


def _keys(flat: dict[str, Any]) -> set[str]:
    return set(flat)


@pytest.mark.parametrize(
    ("summary_level", "expected"),
    [
        (None, {"cheap", "full", "deep"}),
        (5, {"cheap", "full", "deep"}),
        (1, {"cheap", "full"}),
        (0, {"cheap"}),
        (-1, set()),
    ],
)
def test_levels_keep_entries_at_or_below_summary_level(
    summary_level: int | None, expected: set[str]
) -> None:
    ctx = Context.root(summary_level=summary_level)
    ctx = ctx.add_summary("cheap", 1.0)  # level 0 (the default)
    ctx = ctx.add_summary("full", 2.0, level=1)
    ctx = ctx.add_summary("deep", 3.0, level=5)
    assert _keys(ctx.collection.flatten("summaries")) == expected
    assert ctx.summary_level == summary_level


def test_module_outputs_have_levels_and_state_updates_do_not() -> None:
    ctx = Context.root(summary_level=0)
    ctx = _add(jnp.ones(3), ctx).add_state_update("mean", 1.0)
    assert _keys(ctx.collection.flatten("module_outputs")) == {"act"}
    assert _keys(ctx.collection.flatten("state_updates")) == {"mean"}
    with pytest.raises(TypeError):
        ctx.add_state_update("x", 1.0, level=1)  # pyright: ignore[reportCallIssue]


def test_dropped_entry_returns_the_same_context() -> None:
    ctx = Context.root(summary_level=0).add_summary("a", 1.0)
    assert ctx.add_summary("b", 2.0, level=1) is ctx
    assert ctx.add_module_output("b", 2.0, level=1) is ctx
    # A dropped entry reserves nothing: the name can still be added at a kept level.
    assert _keys(ctx.add_summary("b", 2.0).collection.flatten("summaries")) == {
        "a",
        "b",
    }


def test_children_and_overridden_children_inherit_the_level() -> None:
    root = Context.root(prng_key=jax.random.PRNGKey(0), summary_level=0)
    assert root.child("a").child("b").summary_level == 0
    assert root.child("a", prng_key=jax.random.PRNGKey(1)).summary_level == 0
    assert root.child("a", is_training=True).summary_level == 0

    def layer(x: Any, ctx: Context) -> tuple[Any, Context]:
        assert ctx.summary_level == 0
        return x, _add(x, ctx)

    _, ctx = root.call("layer", layer, jnp.ones(2))
    assert _keys(ctx.collection.flatten("summaries")) == {"layer/cheap"}
    assert _keys(ctx.collection.flatten("module_outputs")) == {"layer/act"}


def _scan_body(carry: Any, x: Any, ctx: Context) -> tuple[Any, Any, Context]:
    assert ctx.summary_level == 0
    return carry + x, x, _add(x, ctx)


@pytest.mark.parametrize("merge_summaries", [False, True])
def test_scan_iterations_inherit_the_level(merge_summaries: bool) -> None:
    ctx = Context.root(prng_key=jax.random.PRNGKey(0), summary_level=0)
    _, _, coll = scan_in_context(
        _scan_body,
        context=ctx,
        carry=jnp.float32(0),
        xs=jnp.arange(3.0),
        merge_summaries=merge_summaries,
    )
    summaries = _keys(coll.flatten("summaries"))
    if merge_summaries:
        assert summaries == {"iter/cheap"}
    else:
        assert summaries == {f"iter{i}/cheap" for i in range(3)}
    assert _keys(coll.flatten("module_outputs")) == {"iter/act"}


def test_vmap_examples_inherit_the_level() -> None:
    ctx = Context.root(prng_key=jax.random.PRNGKey(0), summary_level=0)

    def body(x: Any, ctx: Context) -> tuple[Any, Context]:
        assert ctx.summary_level == 0
        return x, _add(x, ctx)

    _, coll = vmap_in_context(
        body, context=ctx, xs=jnp.arange(2.0), merge_summaries=True
    )
    assert _keys(coll.flatten("summaries")) == {"iter/cheap"}


def test_branches_and_loops_inherit_the_level() -> None:
    ctx = Context.root(prng_key=jax.random.PRNGKey(0), summary_level=0)

    def branch(x: Any, ctx: Context) -> tuple[Any, Context]:
        assert ctx.summary_level == 0
        ctx = ctx.add_summary("cheap", jnp.sum(x))
        return x, ctx.add_summary("full", jnp.max(x), level=1)

    def while_body(x: Any, ctx: Context) -> tuple[Any, Context]:
        return branch(x + 1, ctx)

    def fori_body(i: Any, x: Any, ctx: Context) -> tuple[Any, Context]:
        return branch(x + i.astype(x.dtype), ctx)

    x = jnp.float32(1)
    results = {
        "cond": cond_in_context(True, branch, branch, x, context=ctx)[1],
        "switch": switch_in_context(1, [branch, branch], x, context=ctx)[1],
        "while": while_in_context(lambda v: v < 3, while_body, x, context=ctx)[1],
        "iter": fori_in_context(0, 2, fori_body, x, context=ctx, merge_summaries=True)[
            1
        ],
    }
    # Traced bounds: `fori_in_context` is a `while_in_context`.
    results["fori_traced"] = jax.jit(
        lambda n: fori_in_context(0, n, fori_body, x, context=ctx, child_name="f")[1]
    )(jnp.int32(2))
    expected = {
        "cond": {"cond/cheap"},
        "switch": {"switch/cheap"},
        "while": {"while/cheap"},
        "iter": {"iter/cheap"},
        "fori_traced": {"f/cheap"},
    }
    assert {k: _keys(c.flatten("summaries")) for k, c in results.items()} == expected


def test_level_is_static_pytree_aux_data() -> None:
    key = jax.random.PRNGKey(0)
    a = Context.root(prng_key=key, summary_level=1).add_summary("x", 1.0)
    b = Context.root(prng_key=key).add_summary("x", 1.0)
    assert len(jax.tree.leaves(a)) == len(jax.tree.leaves(b))  # the level is no leaf
    assert jax.tree.structure(a) != jax.tree.structure(b)
    assert a != b
    assert a == Context.root(prng_key=key, summary_level=1).add_summary("x", 1.0)
    # Unflattened (a transformation boundary) and through jit: the level survives.
    leaves, treedef = jax.tree.flatten(a)
    assert jax.tree.unflatten(treedef, leaves).summary_level == 1

    @jax.jit
    def f(ctx: Context) -> Context:
        assert ctx.summary_level == 1
        return ctx.add_summary("y", 2.0, level=2)

    out = f(a)
    assert out.summary_level == 1
    assert _keys(out.collection.flatten("summaries")) == {"x"}
    # Pickling and repr.
    back = pickle.loads(pickle.dumps(a))
    assert back.summary_level == 1
    assert back == a
    assert "summary_level=1" in repr(a)
    assert "summary_level=None" in repr(b)
    # The public constructor.
    built = Context(("root",), None, False, eqxctx.OutputCollection.empty(), 3)
    assert built.summary_level == 3


def test_functional_summary_level() -> None:
    def fn(x: Any, ctx: Context) -> tuple[Any, Context]:
        return x, _add(x, ctx)

    kwargs: dict[str, Any] = {
        "prng_key": None,
        "is_training": False,
        "args": (jnp.ones(2),),
        "drop_output_collections": (),
    }
    _, full = functional(fn, **kwargs)
    _, cheap = functional(fn, summary_level=0, **kwargs)
    assert _keys(full.flatten("summaries")) == {"cheap", "full"}
    assert _keys(cheap.flatten("summaries")) == {"cheap"}
    assert _keys(cheap.flatten("module_outputs")) == {"act"}


def test_bad_levels_raise() -> None:
    # With beartype's hook on (the test suite), its `TypeCheckError` (a TypeError)
    # may come first; without it, eqxctx's own message.
    with pytest.raises(TypeError, match="summary_level"):
        Context.root(summary_level="high")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="summary_level"):
        Context.root(summary_level=True)
    with pytest.raises(TypeError, match="summary_level"):
        functional(
            lambda ctx: (None, ctx),
            prng_key=None,
            is_training=False,
            summary_level=1.5,  # pyright: ignore[reportArgumentType]
        )
    ctx = Context.root(summary_level=0)
    with pytest.raises(TypeError, match="level"):
        ctx.add_summary("x", 1.0, level="1")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="level"):
        Context.root().add_module_output("x", 1.0, level=1.0)  # pyright: ignore[reportArgumentType]
    # A dropped entry still has its name checked.
    with pytest.raises(ValueError, match="invalid name"):
        ctx.add_summary("a/b", 1.0, level=1)


def _expensive_step(summary: bool, level: int | None) -> Any:
    """A step whose level-1 summary is an expensive SVD, compiled with `level`."""

    def model(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        y = jnp.tanh(x @ x.T)
        ctx = ctx.add_summary("loss", jnp.mean(y))
        if summary:
            s = jnp.linalg.svd(y, compute_uv=False)
            ctx = ctx.add_summary("spectrum", eqxctx.HistogramSummary(s), level=1)
            ctx = ctx.add_module_output("grams", y @ y, level=1)
        return y, ctx

    def step(x: jax.Array) -> Any:
        return functional(
            model,
            prng_key=None,
            is_training=False,
            args=(x,),
            summary_level=level,
            drop_output_collections=(),
        )

    return step


def test_hlo_of_a_dropped_expensive_summary_equals_the_step_without_it() -> None:
    x = jnp.ones((16, 16), jnp.float32)
    dropped = optimized_hlo(_expensive_step(summary=True, level=0), x)
    without = optimized_hlo(_expensive_step(summary=False, level=None), x)
    kept = optimized_hlo(_expensive_step(summary=True, level=None), x)
    assert dropped == without
    assert kept != without  # the summary is expensive when kept
    (_, coll) = jax.jit(_expensive_step(summary=True, level=0))(x)
    assert _keys(coll.flatten("summaries")) == {"loss"}
    assert not coll.flatten("module_outputs")


class _Net(eqx.Module):
    w: jax.Array

    def __call__(self, batch: Any, ctx: Context) -> tuple[Any, Context]:
        y = batch @ self.w
        ctx = ctx.add_summary("loss", eqxctx.WeightedSummary(jnp.mean(y), 1.0))
        ctx = ctx.add_summary("y", eqxctx.MomentsSummary(y), level=1)
        return y, ctx


def _call(model: _Net, batch: Any, ctx: Context) -> tuple[Any, Context]:
    return model(batch, ctx)


def test_runner_summary_level_cheap_and_full_runners() -> None:
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    model = _Net(jnp.arange(12.0).reshape(4, 3) / 10)
    common: dict[str, Any] = {
        "mesh": mesh,
        "prng_key": jax.random.key(0),
        "input_partition": P("data"),
        "output_partition": P("data"),
    }
    cheap = MethodRunner.create(model, _call, summary_level=0, **common)
    full = MethodRunner.create(model, _call, **common)
    assert cheap.settings.summary_level == 0
    assert cheap.settings != full.settings
    batch = np.ones((2 * jax.device_count(), 4), np.float32)
    cheap, out_cheap = cheap(batch)
    full, out_full = full(batch)
    for _ in range(2):
        cheap, out_cheap = cheap(batch)
        full, out_full = full(batch)
    assert set(out_cheap.summaries) == {"loss"}
    assert set(out_full.summaries) == {"loss", "y"}
    np.testing.assert_allclose(
        np.asarray(out_cheap.summaries["loss"].mean),
        np.asarray(out_full.summaries["loss"].mean),
    )
    # The "cheap step every step, full step every N steps" pattern compiles twice.
    assert cheap.trace_count == 1
    assert full.trace_count == 1
    with pytest.raises(TypeError, match="summary_level"):
        MethodRunner.create(model, _call, summary_level="all", **common)  # pyright: ignore[reportArgumentType]


def test_docs_levels_example_prints_what_it_shows() -> None:
    page = (Path(__file__).parent.parent / "docs/api/summaries.md").read_text()
    section = page.split("## Levels")[1]
    code, printed = re.findall(r"```(?:python)?\n(.*?)```", section, flags=re.S)[:2]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "summaries.md", "exec"), {})
    assert out.getvalue() == printed


def test_levels_are_checked_the_same_with_and_without_a_summary_level() -> None:
    import inspect

    # As called without this suite's runtime type checks (which refuse some first).
    add_summary = inspect.unwrap(Context.add_summary)
    add_output = inspect.unwrap(Context.add_module_output)
    for summary_level in (None, 0, np.int64(1)):
        ctx = inspect.unwrap(Context.root)(Context, summary_level=summary_level)
        assert ctx.summary_level == (
            None if summary_level is None else int(summary_level)
        )
        for level in (None, False, 0.0, "0"):
            for add in (add_summary, add_output):
                with pytest.raises(
                    TypeError, match=r"\(level=\.\.\.\)`: expected an int"
                ):
                    add(ctx, "x", 1.0, level=level)
        kept = add_summary(ctx, "x", 1.0, level=np.int64(0))
        assert kept.collection.flatten("summaries") == {"x": 1.0}
        dropped = add_summary(ctx, "y", 1.0, level=np.int64(2))
        assert ("y" in dropped.collection.flatten("summaries")) == (
            summary_level is None
        )

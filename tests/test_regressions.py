"""Regression tests for problems found by trying eqxctx as a new user would."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxctx import (
    Context,
    OutputCollection,
    WeightedSummary,
    functional,
    scan_in_context,
    vmap_in_context,
)
from eqxctx.testing import assert_collections_equal


def body(c: jax.Array, x: jax.Array, ctx: Context) -> tuple[jax.Array, None, Context]:
    ctx = ctx.add_summary("x", x)
    ctx = ctx.add_summary("w", WeightedSummary(x, 1.0))
    return c + x, None, ctx


def scan_row(row: jax.Array) -> OutputCollection:
    _, _, coll = scan_in_context(
        body, context=Context.root(), carry=jnp.float32(0), xs=row
    )
    return coll


def test_per_iteration_summaries_under_vmap() -> None:
    xs = jnp.arange(6.0).reshape(2, 3)  # batch 2, N = 3 iterations
    coll = jax.vmap(scan_row)(xs)
    flat = coll.flatten("summaries")
    assert sorted(flat) == [f"iter{i}/{n}" for i in range(3) for n in ("w", "x")]
    for i in range(3):
        np.testing.assert_array_equal(flat[f"iter{i}/x"], xs[:, i])
        np.testing.assert_array_equal(flat[f"iter{i}/w"].value(), xs[:, i])
        child = coll.child(f"iter{i}").flatten("summaries")
        np.testing.assert_array_equal(child["x"], xs[:, i])
    mat = coll.materialize()
    np.testing.assert_array_equal(mat.summaries["iter2"]["x"], xs[:, 2])
    # Slicing the outer axis off gives back one row's collection.
    for b in range(2):
        row = jax.tree_util.tree_map(lambda a, b=b: a[b], coll)
        assert_collections_equal(row, scan_row(xs[b]))


def test_per_iteration_summaries_under_outer_scan() -> None:
    xs = jnp.arange(12.0).reshape(4, 3)

    def outer(c: None, row: jax.Array) -> tuple[None, OutputCollection]:
        return c, scan_row(row)

    _, coll = jax.lax.scan(outer, None, xs)
    flat = coll.flatten("summaries")
    for i in range(3):
        np.testing.assert_array_equal(flat[f"iter{i}/x"], xs[:, i])


def test_vmap_in_context_under_vmap() -> None:
    xs = jnp.arange(6.0).reshape(3, 2)  # outer 3, examples 2

    def f(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return 2 * x, ctx.add_summary("x", x)

    def run(row: jax.Array) -> OutputCollection:
        return vmap_in_context(f, context=Context.root(), xs=row)[1]

    flat = jax.vmap(run)(xs).flatten("summaries")
    for i in range(2):
        np.testing.assert_array_equal(flat[f"iter{i}/x"], xs[:, i])


def test_nested_scans_under_vmap() -> None:
    xs = jnp.arange(2 * 3 * 4.0).reshape(2, 3, 4)  # batch, outer N, inner N

    def outer(c: jax.Array, row: jax.Array, ctx: Context) -> Any:
        _, _, coll = scan_in_context(body, context=ctx, carry=c, xs=row)
        return c, None, ctx.merge(coll)

    def run(x: jax.Array) -> OutputCollection:
        return scan_in_context(
            outer, context=Context.root(), carry=jnp.float32(0), xs=x
        )[2]

    flat = jax.vmap(run)(xs).flatten("summaries")
    assert len(flat) == 3 * 4 * 2
    np.testing.assert_array_equal(flat["iter1/iter2/x"], xs[:, 1, 2])


def test_merged_int_weighted_summary_under_strict_promotion() -> None:
    xs = jnp.arange(4, dtype=jnp.int32)

    def f(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return x, ctx.add_summary("w", WeightedSummary(x, 1.0))

    _, coll = vmap_in_context(f, context=Context.root(), xs=xs, merge_summaries=True)
    np.testing.assert_allclose(coll.flatten("summaries")["iter/w"].value(), 1.5)

    def g(c: None, x: jax.Array, ctx: Context) -> tuple[None, None, Context]:
        return c, None, ctx.add_summary("w", WeightedSummary(x, 1.0))

    _, _, coll = scan_in_context(
        g, context=Context.root(), carry=None, xs=xs, merge_summaries=True
    )
    np.testing.assert_allclose(coll.flatten("summaries")["iter/w"].value(), 1.5)


def test_weighted_summary_mixed_dtypes_under_strict_promotion() -> None:
    a = WeightedSummary(jnp.bfloat16(1.0), jnp.int32(1))
    b = WeightedSummary(jnp.float32(3.0), jnp.float32(3.0))
    s = a + b
    assert s.mean.dtype == jnp.float32
    np.testing.assert_allclose(s.value(), 2.5)
    np.testing.assert_allclose(s.weight, 4.0)


def test_weighted_summary_zero_weight_nan_mean_is_nan() -> None:
    # Issue 10 (summary laws): a NaN anywhere gives NaN, also a NaN mean with zero
    # weight (the 0/0 mean of an empty batch): a broken batch is never hidden.
    empty = WeightedSummary(jnp.float32(jnp.nan), jnp.float32(0))
    s = empty + WeightedSummary(jnp.float32(5), jnp.float32(1))
    assert np.isnan(s.value())
    # A finite mean with zero weight adds nothing, and its gradient is finite.
    s = WeightedSummary(jnp.float32(7), jnp.float32(0)) + WeightedSummary(5.0, 1.0)
    np.testing.assert_allclose(s.value(), 5.0)
    g = jax.grad(
        lambda m: (WeightedSummary(m, jnp.float32(0)) + WeightedSummary(m, 1.0)).value()
    )(jnp.float32(2.0))
    np.testing.assert_allclose(g, 1.0)


def test_call_forwards_kwargs_named_name_and_fn() -> None:
    def f(x: float, ctx: Context, *, name: str, fn: str) -> tuple[float, Context]:
        return x, ctx.add_summary(name, x).add_summary(fn, 2 * x)

    _, ctx = Context.root().call("blk", f, 1.0, name="b", fn="c")
    assert ctx.collection.flatten("summaries") == {"blk/b": 1.0, "blk/c": 2.0}


@pytest.mark.parametrize("name", ["abc\n", "it\n"])
def test_child_name_with_trailing_newline_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="invalid child name"):
        Context.root().child(name)
    with pytest.raises(ValueError, match="invalid child name"):
        scan_in_context(
            body,
            context=Context.root(),
            carry=jnp.float32(0),
            xs=jnp.ones(2),
            child_name_prefix=name,
        )


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


@pytest.mark.parametrize("value", [np.str_("x"), np.array(["x"]), np.array([None])])
def test_non_numeric_arrays_are_refused(value: Any) -> None:
    with pytest.raises(TypeError, match="summaries/a"):
        OutputCollection.empty().add_summary("a", value)


def test_typed_key_leaves_are_accepted() -> None:
    coll = OutputCollection.empty().add_state_update("key", jax.random.key(0))
    assert "key" in coll.flatten("state_updates")


def test_functional_drop_string_is_a_clear_error() -> None:
    with pytest.raises(
        ValueError, match=r"expected a sequence of kinds.*\('summaries',\)"
    ):
        functional(
            lambda c: (None, c),
            prng_key=None,
            is_training=False,
            drop_output_collections="summaries",
        )


def test_scan_length_accepts_numpy_integers() -> None:
    def count(c: jax.Array, x: None, ctx: Context) -> tuple[jax.Array, None, Context]:
        return c + 1, None, ctx

    c, _, _ = scan_in_context(
        count, context=Context.root(), carry=jnp.int32(0), xs=None, length=np.int64(3)
    )
    assert int(c) == 3
    with pytest.raises(ValueError, match="length must be a non-negative int"):
        scan_in_context(
            count, context=Context.root(), carry=jnp.int32(0), xs=None, length=True
        )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.int8, jnp.bool_])
def test_numeric_dtypes_are_accepted(dtype: Any) -> None:
    coll = OutputCollection.empty().add_summary("a", jnp.ones(2, dtype))
    assert coll.flatten("summaries")["a"].dtype == dtype


def test_reserved_iteration_names_are_checked_on_construction() -> None:
    from eqxctx import IterationSummaries, OutputConflictError
    from eqxctx.writers import JsonlWriter

    bad = {"iter": IterationSummaries(2, {"x": np.zeros(2)}), "iter0": {"y": 3.0}}
    with pytest.raises(OutputConflictError, match="summaries/iter0"):
        OutputCollection(bad, {}, {})
    with JsonlWriter("/dev/null") as w, pytest.raises(ValueError, match="iter0"):
        w.write(0, bad)


def test_mapping_over_a_non_leading_axis_says_why() -> None:
    def f(c: None, x: jax.Array, ctx: Context) -> tuple[None, None, Context]:
        return c, None, ctx.add_summary("v", x)

    _, _, coll = scan_in_context(
        f, context=Context.root(), carry=None, xs=jnp.arange(12.0).reshape(4, 3)
    )
    with pytest.raises(ValueError, match="fewer axes than when it was made"):
        jax.vmap(lambda c: c.flatten("summaries")["iter1/v"], in_axes=(0,))(coll)


def test_runner_without_key_is_a_clear_error() -> None:
    from eqxctx import MethodRunner

    mesh = jax.make_mesh((1,), ("data",))
    with pytest.raises(TypeError, match=r"prng_key=None"):
        MethodRunner.create(
            {"w": jnp.ones(2)}, lambda m, b, c: (b, c), mesh=mesh, prng_key=None
        )


# -- found by trying to break frozen logs (collections made by unflattening) --------


def _read_level(level: Any, barrier: Any) -> None:
    barrier.wait()
    level.get("k00000")


def _extend_level(level: Any, barrier: Any, out: dict[str, Any]) -> None:
    barrier.wait()
    out["new"] = level.inserted("new", -1)


def test_reading_and_extending_a_frozen_level_from_two_threads() -> None:
    # A reader deriving the index of an unflattened level must not replace the index
    # that an insertion in another thread has just extended (the new key was lost).
    import sys
    import threading

    from eqxctx._mapping import FrozenMapping

    keys = [f"k{i:05d}" for i in range(20_000)]
    tree = FrozenMapping([(k, i) for i, k in enumerate(keys)])
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(20):
            level = jax.tree_util.tree_map(lambda x: x, tree)  # a frozen log
            barrier = threading.Barrier(2)
            out: dict[str, FrozenMapping] = {}
            threads = [
                threading.Thread(target=_read_level, args=(level, barrier)),
                threading.Thread(target=_extend_level, args=(level, barrier, out)),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert "new" in out["new"]
            assert out["new"]["new"] == -1
            assert "new" not in level
            assert len(out["new"]) == len(keys) + 1
    finally:
        sys.setswitchinterval(interval)


def test_str_subclass_keys_are_found_in_a_level() -> None:
    coll = OutputCollection.empty().add_summary("a", 1.0)
    for level in (coll.summaries, jax.jit(lambda c: c)(coll).summaries):
        assert np.str_("a") in level  # as in a dict: `np.str_` is a `str`
        assert np.str_("b") not in level
        assert level[np.str_("a")] == 1.0


def test_a_traced_child_does_not_extend_a_concrete_collection_in_place() -> None:
    # A context made outside `jax.jit`, extended inside it with a child that holds
    # tracers: the outer log must not keep the child (it would leak the tracers).
    outer = Context.root().add_summary("lr", 0.1)

    def layer(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return x, ctx.add_summary("x", x)

    def step(x: jax.Array) -> jax.Array:
        y, ctx = outer.call("layer", layer, x)
        assert ctx.collection.flatten("summaries").keys() == {"lr", "layer/x"}
        return y

    with jax.checking_leaks():
        assert jax.jit(step)(jnp.float32(2.0)) == 2.0
    assert list(outer.collection.summaries) == ["lr"]


def test_a_traced_scan_entry_does_not_extend_a_concrete_collection_in_place() -> None:
    from eqxctx import IterationSummaries

    outer = OutputCollection.empty().add_summary("lr", 0.1)

    def step(xs: jax.Array) -> jax.Array:
        scanned = OutputCollection({"iter": IterationSummaries(3, {"x": xs})}, {}, {})
        merged = outer.merge(scanned)
        assert sorted(merged.summaries) == ["iter", "lr"]
        return xs

    with jax.checking_leaks():
        jax.jit(step)(jnp.arange(3.0))
    assert list(outer.summaries) == ["lr"]
    assert outer.summaries == {"lr": 0.1}


@pytest.mark.parametrize("kind", ["summaries", "state_updates", "module_outputs"])
def test_tree_at_replaces_an_empty_level(kind: str) -> None:
    # Unflattening gave every empty level the one shared empty mapping, so that
    # `eqx.tree_at` (which finds nodes by identity) could not tell them apart.
    import equinox as eqx

    from eqxctx._mapping import FrozenMapping

    made = OutputCollection.empty().add_summary("a", 1.0)
    for coll in (made, jax.jit(lambda c: c)(made)):
        new = eqx.tree_at(
            lambda c: getattr(c, kind), coll, FrozenMapping({"x": jnp.ones(1)})
        )
        assert list(getattr(new, kind)) == ["x"]
        others = {"summaries": ["a"], "state_updates": [], "module_outputs": []}
        others[kind] = ["x"]
        assert {k: list(getattr(new, k)) for k in others} == others


def test_a_traced_unflattened_child_does_not_extend_a_concrete_collection() -> None:
    # The child's levels are frozen (made by `tree_map` inside the trace), its tracer
    # three levels down.
    outer = OutputCollection.empty().add_summary("lr", 0.1)

    def step(x: jax.Array) -> jax.Array:
        inner = OutputCollection.empty().add_summary("x", x)
        for name in ("a", "b"):
            inner = OutputCollection.empty().add_child(name, inner)
        inner = jax.tree_util.tree_map(lambda v: v * 2, inner)
        merged = outer.add_child("c", inner)
        assert merged.flatten("summaries").keys() == {"lr", "c/b/a/x"}
        return x

    with jax.checking_leaks():
        jax.jit(step)(jnp.float32(1.0))
    assert outer.summaries == {"lr": 0.1}


def test_adding_to_a_deep_unflattened_collection() -> None:
    # Whether a level holds tracers is derived without recursion (400 levels): a
    # tracer added at the root of a deep collection made outside the trace.
    coll = OutputCollection.empty().add_summary("v", 1.0)
    for _ in range(400):
        coll = OutputCollection.empty().add_summary("v", 1.0).add_child("c", coll)
    frozen = jax.tree_util.tree_map(lambda v: v, coll)

    def step(x: jax.Array) -> jax.Array:
        return frozen.add_summary("new", x).summaries["new"]

    with jax.checking_leaks():
        assert jax.jit(step)(jnp.float32(2.0)) == 2.0
    assert "new" not in frozen.summaries
    assert len(jax.tree_util.tree_leaves(frozen.add_summary("new", 2.0))) == 402


@pytest.mark.parametrize("read", ["prng_key", "path"])
def test_versions_of_one_context_derive_keys_and_paths_from_two_threads(
    read: str,
) -> None:
    # Every version of a context shares its frame. Thread B is paused inside the walk
    # up to the nearest known ancestor (`_walk_up` for a path, `_derive_key` for a
    # key), between its two reads of a frame; thread A
    # then derives the key and path of its own version (which drops the parent link
    # of the shared frame). B must still find them.
    import inspect
    import sys
    import threading

    import eqxctx._context as context_module

    # (`inspect.unwrap`: the test suite's runtime type checks wrap it.)
    walk = inspect.unwrap(
        context_module._walk_up  # pyright: ignore[reportPrivateUsage]
        if read == "path"
        else context_module._derive_key  # pyright: ignore[reportPrivateUsage]
    )
    lines, first = inspect.getsourcelines(walk)
    # Pause between the loop's first two statements (its two reads of the frame).
    loop = next(i for i, line in enumerate(lines) if line.strip().startswith("while"))
    body = [
        i
        for i in range(loop + 1, len(lines))
        if lines[i].strip() and not lines[i].strip().startswith("#")
    ]
    after_up = first + body[1]
    child = Context.root(prng_key=jax.random.PRNGKey(0)).child("a")
    mine, theirs = child.add_summary("x", 1.0), child.add_summary("y", 2.0)
    paused, resume = threading.Event(), threading.Event()

    def tracer(frame: Any, event: str, arg: object) -> Any:
        del event, arg
        if frame.f_code is not walk.__code__:
            return None

        def local(frame: Any, event: str, arg: object) -> Any:
            del arg
            if event == "line" and frame.f_lineno == after_up and not paused.is_set():
                paused.set()
                resume.wait(10)
            return local

        return local

    got: list[object] = []

    def other() -> None:
        sys.settrace(tracer)
        try:
            got.append(getattr(theirs, read))
        except BaseException as e:  # reported below
            got.append(e)
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=other)
    thread.start()
    assert paused.wait(10)
    want = (mine.path, mine.prng_key)
    resume.set()
    thread.join(10)
    expected = want[0] if read == "path" else want[1]
    assert not isinstance(got[0], BaseException), got[0]
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(expected))


@pytest.mark.parametrize("kind", ["weighted", "max"])
def test_a_traced_summary_does_not_extend_a_concrete_collection_in_place(
    kind: str,
) -> None:
    # A `Summary` is a PyTree: a tracer inside one is a tracer in the collection.
    from jax.core import Tracer

    from eqxctx import MaxSummary

    outer = Context.root().add_summary("pre", 1.0)

    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        value = WeightedSummary(x, 1.0) if kind == "weighted" else MaxSummary(x)
        inner = outer.add_summary("in", value)
        assert sorted(inner.collection.summaries) == ["in", "pre"]
        return x

    with jax.checking_leaks():
        f(jnp.float32(3.0))
    leaves = jax.tree_util.tree_leaves(outer.collection)
    assert not any(isinstance(leaf, Tracer) for leaf in leaves)
    assert list(outer.collection.summaries) == ["pre"]


def test_an_empty_traced_scan_does_not_extend_a_concrete_collection_in_place() -> None:
    def body(
        c: jax.Array, x: jax.Array, ctx: Context
    ) -> tuple[jax.Array, None, Context]:
        return c, None, ctx.add_summary("s", x)

    outer = Context.root().add_summary("pre", 1.0)

    @jax.jit
    def f(xs: jax.Array) -> jax.Array:
        _, _, coll = scan_in_context(body, context=outer, carry=jnp.float32(0), xs=xs)
        outer.merge(coll)
        return xs

    with jax.checking_leaks():
        f(jnp.zeros((0,), jnp.float32))
    assert list(outer.collection.summaries) == ["pre"]


def _block(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    y = jnp.tanh(x)
    return y, ctx.add_summary("rms", jnp.sqrt(jnp.mean(y**2)))


def _nested_checkpoint(x: jax.Array) -> jax.Array:
    # A context holding a tracer of the outer trace, extended inside `jax.checkpoint`
    # (rematerializing one block): the outer log must not keep the inner tracers.
    def model(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        ctx = ctx.add_summary("in_mean", jnp.mean(x))
        return jax.checkpoint(lambda x: ctx.call("blk", _block, x))(x)

    out, coll = functional(model, prng_key=None, is_training=True, args=(x,))
    assert coll.flatten("summaries").keys() == {"in_mean", "blk/rms"}
    return out.sum()


def _nested_vmap(x: jax.Array) -> jax.Array:
    ctx = Context.root().add_summary("x", x)
    ys = jax.vmap(lambda v: ctx.add_summary("y", v).collection.summaries["y"])(
        jnp.arange(3.0)
    )
    ctx = ctx.add_summary("z", x)
    assert list(ctx.collection.summaries) == ["x", "z"]
    return ys.sum() + x


def _nested_scan(x: jax.Array) -> jax.Array:
    ctx = Context.root().add_summary("x", x)

    def body(c: float, v: jax.Array) -> tuple[float, jax.Array]:
        return c, ctx.add_summary("y", v).collection.summaries["y"]

    _, ys = jax.lax.scan(body, 0.0, jnp.arange(3.0))
    return ys.sum() + x


def _nested_jit(x: jax.Array) -> jax.Array:  # under `jax.grad`: a JVP trace outside
    ctx = Context.root().add_summary("x", x)
    return jax.jit(lambda z: ctx.add_summary("y", z).collection.summaries["y"] * 2)(x)


@pytest.mark.parametrize(
    ("fn", "transform", "want"),
    [
        (_nested_checkpoint, lambda f: jax.jit(jax.grad(f)), 1 - np.tanh(1) ** 2),
        (_nested_vmap, jax.jit, 4.0),
        (_nested_scan, jax.jit, 4.0),
        (_nested_jit, jax.grad, 2.0),
    ],
    ids=["checkpoint", "vmap", "scan", "jit_under_grad"],
)
def test_a_nested_trace_does_not_extend_an_outer_traced_collection_in_place(
    fn: Callable[[jax.Array], jax.Array],
    transform: Callable[[Callable[..., Any]], Callable[..., Any]],
    want: float,
) -> None:
    # A level whose log holds tracers of one trace was appended to in place with
    # tracers of a trace nested in it; the outer version kept the inner tracers
    # alive past their trace (`jax.checking_leaks` raised). Found by a review helper.
    x = jnp.ones(3) if fn is _nested_checkpoint else jnp.float32(1.0)
    with jax.checking_leaks():
        got = transform(fn)(x)
    # (A TPU's tanh agrees with the CPU's to about 1e-5.)
    rtol = 1e-6 if jax.default_backend() == "cpu" else 1e-4
    np.testing.assert_allclose(np.asarray(got), want, rtol=rtol)

"""Host-side cost, by exact counts: leaf checks, Python calls, traces, HLO, fetches."""

import copy
import gc
import pickle
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from jax.core import Tracer

import eqxctx
import eqxctx._batches as batches_module
import eqxctx._collection as collection_module
import eqxctx._iterations as iterations_module
import eqxctx.writers._base as writers_base
from eqxctx import (
    Context,
    ImageSummary,
    IterationSummaries,
    OutputCollection,
    OutputConflictError,
    Summary,
    SummaryAccumulator,
    WeightedSummary,
    cond_in_context,
    functional,
    scan_in_context,
    vmap_in_context,
)
from eqxctx._mapping import (
    FrozenMapping,
    _flatten as mapping_flatten,  # pyright: ignore[reportPrivateUsage]
)
from eqxctx.testing import assert_collections_equal, output_collections
from eqxctx.writers import JsonlWriter, fetch_summaries


_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+ = ", re.MULTILINE)


_SRC = str(Path(eqxctx.__file__).parent)


def count_calls(fn: Callable[[], Any]) -> int:
    """The number of calls of eqxctx's own Python functions while running `fn`.

    Exact and stable: other code (JAX's caches, the test suite's runtime type
    checks) is not counted.
    """
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        del arg
        if event == "call" and frame.f_code.co_filename.startswith(_SRC):
            calls += 1

    _run_profiled(fn, profile)
    return calls


def _run_profiled(fn: Callable[[], Any], profile: Callable[..., None]) -> None:
    """Run `fn` under `profile`, with garbage collection off."""
    # Garbage collection (and JAX's callbacks on it) depends on what ran before.
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()


def hlo_size(fn: Callable[..., Any], *args: Any) -> tuple[int, int]:
    """(optimized HLO instructions, output leaves) of `jax.jit(fn)(*args)`."""
    compiled = jax.jit(fn).lower(*args).compile()
    outputs = len(jax.tree_util.tree_leaves(jax.eval_shape(fn, *args)))
    return len(_INSTRUCTION.findall(compiled.as_text() or "")), outputs


# -- adds are O(1), each leaf checked once --------------------------------------------


@pytest.mark.parametrize("k", [1, 10, 200])
def test_k_adds_check_k_leaves(k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[str] = []
    real = collection_module.check_leaf

    def counting(value: object, path: str) -> None:
        checked.append(path)
        real(value, path)

    monkeypatch.setattr(collection_module, "check_leaf", counting)
    ctx = Context.root()
    for i in range(k):
        ctx = ctx.add_summary(f"s{i}", jnp.float32(i))
    coll = ctx.collection
    # Merging, nesting and reading re-check nothing.
    parent = Context.root().call("a", lambda c: (None, c.merge(coll)))[1]
    parent.collection.merge(OutputCollection.empty().add_child("b", coll))
    assert checked == [f"summaries/s{i}" for i in range(k)]


def _grown(n: int) -> Context:
    ctx = Context.root(prng_key=jax.random.PRNGKey(0))
    for i in range(n):
        ctx = ctx.add_summary(f"s{i}", 1.0).add_module_output(f"m{i}", 2.0)
        ctx = ctx.call(f"c{i}", lambda c: (None, c.add_summary("x", 1.0)))[1]
    return ctx


def test_call_and_add_cost_do_not_grow_with_earlier_outputs() -> None:
    def step(ctx: Context) -> Callable[[], Any]:
        def run() -> Any:
            _, out = ctx.call(
                "new",
                lambda c: (None, c.add_summary("y", 1.0).add_module_output("z", 1)),
            )
            return out.add_summary("after", 2.0).merge(
                OutputCollection.empty().add_summary("merged", 3.0)
            )

        return run

    step(_grown(5))()  # warm caches (seeds, regexes)
    # Fresh contexts: extending a version that was already extended copies its
    # level once (a branch), which is not what this measures.
    assert count_calls(step(_grown(5))) == count_calls(step(_grown(500)))


def test_adds_after_a_long_scan_cost_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scan's `{prefix}{i}` names are a range: checked arithmetically."""

    def after(n: int) -> Context:
        entry = OutputCollection(
            {"iter": IterationSummaries(n, {"x": jnp.zeros(n)})}, {"iter": {}}, {}
        )
        return Context.root().merge(entry)

    def step(ctx: Context) -> Callable[[], Any]:
        def run() -> Any:
            out = ctx.add_summary("loss", 1.0)
            out = out.call("enc", lambda c: (None, c))[1]
            return out.merge(OutputCollection.empty().add_summary("iter9x", 1.0))

        return run

    step(after(16))()
    assert count_calls(step(after(16))) == count_calls(step(after(65_536)))
    long = after(65_536)
    # The range is still reserved, checked at the call that collides.
    with pytest.raises(OutputConflictError, match="iter65535"):
        long.add_summary("iter65535", 1.0)
    with pytest.raises(OutputConflictError, match="iter4000"):
        long.call("iter4000", lambda c: (None, c))
    long.add_summary("iter65536", 1.0)  # past the range: free
    with pytest.raises(OutputConflictError, match="child_name_prefix"):
        long.merge(
            OutputCollection.empty().add_child("iter77", OutputCollection.empty())
        )


def test_merging_a_scan_finds_the_clashing_numbered_names() -> None:
    ctx = Context.root().call("iter7", lambda c: (None, c))[1]
    ctx = ctx.add_summary("iter12", 1.0)
    entry = OutputCollection(
        {"iter": IterationSummaries(10, {"x": jnp.zeros(10)})}, {}, {}
    )
    with pytest.raises(OutputConflictError, match=r"child 'iter7'"):
        ctx.merge(entry)
    only_leaf = Context.root().add_summary("iter3", 1.0)
    with pytest.raises(OutputConflictError, match=r"'iter3' is a child in one"):
        only_leaf.merge(entry)
    # Names past the range, or with a leading zero, are not iteration names.
    Context.root().add_summary("iter10", 1.0).add_summary("iter01", 2.0).merge(entry)


# -- immutability ----------------------------------------------------------------------


def test_mappings_are_read_only() -> None:
    child = OutputCollection.empty().add_summary("acc", 1.0)
    coll = OutputCollection.empty().add_summary("loss", 1.0).add_child("enc", child)
    with pytest.raises(TypeError):
        coll.summaries["x"] = 1  # pyright: ignore[reportIndexIssue]
    with pytest.raises(TypeError):
        coll.summaries["enc"]["acc"] = 2
    with pytest.raises(TypeError):
        del coll.module_outputs["enc"]  # pyright: ignore[reportIndexIssue]
    with pytest.raises(AttributeError):
        coll.summaries.update({"x": 1})  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(AttributeError):
        coll.summaries = {}  # pyright: ignore[reportAttributeAccessIssue]
    entry = IterationSummaries(2, {"x": jnp.zeros(2)})
    with pytest.raises(TypeError):
        entry.stacked["y"] = 1  # pyright: ignore[reportIndexIssue]
    # Flattening one level hands out no container a level keeps (a level made by
    # unflattening, here the output of `jax.jit`, and one made by adds).
    # (`flatten_one_level` is public from JAX 0.9; before, the registered function.)
    one_level = getattr(jax.tree_util, "flatten_one_level", mapping_flatten)
    for level in (jax.jit(lambda c: c)(coll).summaries, coll.summaries):
        children, _ = one_level(level)
        if isinstance(children, list):
            children.clear()
        assert level["loss"] == 1.0
        assert len(level) == 2


@given(output_collections(), output_collections())
def test_no_result_shares_a_mutable_container_with_an_input(
    a: OutputCollection, b: OutputCollection
) -> None:
    raw: dict[str, Any] = {"x": 1.0, "nested": {"y": 2.0}}
    coll = OutputCollection(raw, {}, {})
    raw["x"], raw["nested"]["y"], raw["z"] = 5.0, 6.0, 7.0
    assert coll.flatten("summaries") == {"x": 1.0, "nested/y": 2.0}
    before = [a.flatten(k) for k in ("summaries", "state_updates", "module_outputs")]
    try:
        merged = a.merge(b)
    except OutputConflictError:
        merged = a.add_child("zz_other", b) if "zz_other" not in a.child_names() else a
    derived = [
        merged,
        a.add_summary("zz_new", 1.0)
        if "zz_new" not in a.child_names() | a.leaf_names()
        else a,
        a.prune(lambda p: p.endswith("0")),
        a.materialize(),
    ]
    for d in derived:
        assert_collections_equal(merged if d is merged else d, d)
    after = [a.flatten(k) for k in ("summaries", "state_updates", "module_outputs")]
    assert [set(f) for f in before] == [set(f) for f in after]
    # Only read-only mappings come out; nothing a caller holds is a dict of ours.
    for d in derived:
        for tree in (d.summaries, d.state_updates, d.module_outputs):
            assert not isinstance(tree, dict)


def test_copy_and_pickle_round_trip() -> None:
    coll = (
        OutputCollection.empty()
        .add_summary("w", WeightedSummary(1.0, 2.0))
        .add_child("enc", OutputCollection.empty().add_module_output("h", np.ones(2)))
    )
    for other in (
        copy.copy(coll),
        copy.deepcopy(coll),
        pickle.loads(pickle.dumps(coll)),
    ):
        assert_collections_equal(other, coll)
    ctx = Context.root(prng_key=jax.random.PRNGKey(3)).child("a")
    again = pickle.loads(pickle.dumps(ctx))
    np.testing.assert_array_equal(again.prng_key, ctx.prng_key)
    assert again.path == ctx.path


def test_branching_versions_stay_independent() -> None:
    base = OutputCollection.empty().add_summary("a", 1.0)
    left = base.add_summary("b", 2.0)
    right = base.add_summary("c", 3.0)  # a branch of `base`: copies, then adds
    assert left.flatten("summaries") == {"a": 1.0, "b": 2.0}
    assert right.flatten("summaries") == {"a": 1.0, "c": 3.0}
    assert base.flatten("summaries") == {"a": 1.0}
    assert left.add_summary("c", 4.0).flatten("summaries")["c"] == 4.0


# -- lazy keys -------------------------------------------------------------------------


def test_unread_child_keys_cost_nothing() -> None:
    def f(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        for i in range(20):
            x, ctx = ctx.call(f"c{i}", lambda x, c: (x + 1, c), x)
        return x, ctx

    jaxpr = jax.make_jaxpr(
        lambda x, k: functional(f, prng_key=k, is_training=False, args=(x,))
    )(jnp.ones(()), jax.random.PRNGKey(0))
    assert "random" not in str(jaxpr)
    assert "threefry" not in str(jaxpr)


def test_lazy_keys_equal_eager_derivation() -> None:
    root = Context.root(prng_key=jax.random.PRNGKey(7))
    deep = root.child("a").child("b").child("c")
    want = jax.random.PRNGKey(7)
    for name in ("a", "b", "c"):
        want = jax.random.fold_in(want, eqxctx._context.child_seed(name))  # pyright: ignore[reportPrivateUsage]
    np.testing.assert_array_equal(deep.prng_key, want)
    # Flattened as a PyTree, the key is the derived one.
    leaves = jax.tree_util.tree_leaves(deep)
    np.testing.assert_array_equal(leaves[0], want)


# -- nested combinators --------------------------------------------------------------


def nested_merged(depth: int) -> tuple[Callable[[jax.Array], Any], list[int]]:
    traces = [0]

    def level(d: int) -> Callable[[jax.Array, jax.Array, Context], Any]:
        def body(c: jax.Array, x: jax.Array, ctx: Context) -> Any:
            if d == depth:
                traces[0] += 1
                return c + x, None, ctx.add_summary("x", WeightedSummary(x, 1.0))
            c, _, coll = scan_in_context(
                level(d + 1),
                context=ctx,
                carry=c,
                xs=jnp.ones(2),
                merge_summaries=True,
                child_name_prefix="inner",
            )
            return c, None, ctx.merge(coll)

        return body

    def run(x: jax.Array) -> Any:
        return scan_in_context(
            level(1),
            context=Context.root(),
            carry=x,
            xs=jnp.ones(2),
            merge_summaries=True,
        )

    return run, traces


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
def test_nested_merged_scans_trace_each_body_a_bounded_number_of_times(
    depth: int,
) -> None:
    run, traces = nested_merged(depth)
    carry, _, coll = jax.jit(run)(jnp.zeros(()))
    assert traces[0] == depth + 1 <= 2 * depth
    assert float(carry) == 2.0**depth
    # Every level merged: one weighted mean of all 2**depth innermost values.
    (path,) = coll.flatten("summaries")
    assert path == "iter/" + "inner/" * (depth - 1) + "x"
    assert float(coll.flatten("summaries")[path].weight) == 2.0**depth


def nested_drop(n: int) -> Callable[[jax.Array], Any]:
    drop = lambda path: path.endswith("/h")

    def inner(c: jax.Array, x: jax.Array, ctx: Context) -> Any:
        ctx = ctx.add_summary("s", jnp.sum(c) * x).add_module_output("h", c)
        return c * x, None, ctx

    def middle(c: jax.Array, x: jax.Array, ctx: Context) -> Any:
        c, _, coll = scan_in_context(
            inner, context=ctx, carry=c, xs=x * jnp.ones(n), drop_output=drop
        )
        return c, None, ctx.merge(coll).add_summary("m", jnp.mean(c))

    def outer(c: jax.Array, x: jax.Array, ctx: Context) -> Any:
        c, _, coll = scan_in_context(
            middle, context=ctx, carry=c, xs=x * jnp.ones(n), drop_output=drop
        )
        return c, None, ctx.merge(coll)

    def run(c: jax.Array) -> Any:
        c, _, coll = scan_in_context(
            outer, context=Context.root(), carry=c, xs=jnp.ones(n), drop_output=drop
        )
        return c, coll

    return run


def nested_hand(n: int) -> Callable[[jax.Array], Any]:
    """`nested_drop` written with `jax.lax.scan`, returning the same stacked values."""

    def inner(c: jax.Array, x: jax.Array) -> Any:
        return c * x, jnp.sum(c) * x

    def middle(c: jax.Array, x: jax.Array) -> Any:
        c, s = jax.lax.scan(inner, c, x * jnp.ones(n))
        return c, (s, jnp.mean(c))

    def outer(c: jax.Array, x: jax.Array) -> Any:
        return jax.lax.scan(middle, c, x * jnp.ones(n))

    return lambda c: jax.lax.scan(outer, c, jnp.ones(n))


def test_nested_drop_output_slices_nothing_in_the_program() -> None:
    x = jnp.ones(3)
    # The same program as the hand-written scans (whose size XLA varies a little
    # with the trip count), at 2 and 8 iterations per level: nothing is sliced.
    for n in (2, 8):
        assert hlo_size(nested_drop(n), x) == hlo_size(nested_hand(n), x)
    assert hlo_size(nested_drop(2), x)[1] == hlo_size(nested_drop(8), x)[1] == 3
    _, coll = jax.jit(nested_drop(2))(x)
    flat = coll.flatten("summaries")
    assert len(flat) == 2 * 2 * 2 + 2 * 2  # s per inner iteration, m per middle one
    assert float(flat["iter1/iter0/iter1/s"]) == 3.0
    assert coll.flatten("module_outputs") == {}


def test_vmap_merge_is_one_reduction_per_leaf() -> None:
    def body(x: jax.Array, ctx: Context) -> Any:
        ctx = ctx.add_summary("w", WeightedSummary(jnp.mean(x), jnp.float32(x.size)))
        ctx = ctx.add_summary("mx", eqxctx.MaxSummary(jnp.max(x)))
        return x, ctx.add_summary("sum", jnp.sum(x))

    def ours(xs: jax.Array) -> Any:
        return vmap_in_context(
            body, context=Context.root(), xs=xs, merge_summaries=True
        )[1]

    def hand(xs: jax.Array) -> Any:
        # The same reductions, written by hand: a weighted mean by
        # `WeightedSummary.accumulate`'s rule (the weights scaled by the largest, NaN
        # anywhere gives NaN, 0 at zero total weight).
        means = jnp.mean(xs, axis=1)
        weights = jnp.full(xs.shape[:1], jnp.float32(xs.shape[1]))
        scale = jnp.max(weights)
        r = jax.lax.rsqrt(jnp.where(scale > 0, scale, 1))
        a = weights * r * r
        num = jnp.sum(means * a)
        den = jnp.where(scale > 0, jnp.sum(a), 1)
        mean = jnp.where(scale > 0, num / den, 0)
        mean = jnp.where(jnp.isnan(num) | jnp.isnan(scale), jnp.nan, mean)
        return {
            "w": (mean, jnp.sum(weights)),
            "mx": jnp.max(jnp.max(xs, axis=1)),
            "sum": jnp.sum(jnp.sum(xs, axis=1)),
        }

    xs = jnp.arange(32.0).reshape(8, 4)
    assert hlo_size(ours, xs)[0] <= hlo_size(hand, xs)[0]
    merged = ours(xs).flatten("summaries")
    np.testing.assert_allclose(merged["iter/w"].value(), np.mean(np.asarray(xs)))
    assert float(merged["iter/mx"].value()) == 31.0
    assert float(merged["iter/sum"]) == float(np.sum(np.asarray(xs)))


# -- host views ------------------------------------------------------------------------


@pytest.fixture
def device_gets(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = jax.device_get

    def counting(x: Any) -> Any:
        calls.append(len(jax.tree_util.tree_leaves(x)))
        return real(x)

    monkeypatch.setattr(jax, "device_get", counting)
    # The writers' own batched fetch (one process), which replaces `jax.device_get`.
    real_writers = writers_base._device_get  # pyright: ignore[reportPrivateUsage]

    def counting_writers(x: Any, *args: Any) -> Any:
        calls.append(len(jax.tree_util.tree_leaves(x)))
        return real_writers(x, *args)

    monkeypatch.setattr(writers_base, "_device_get", counting_writers)
    return calls


def scanned(n: int, s: int) -> OutputCollection:
    def body(c: float, x: jax.Array, ctx: Context) -> Any:
        for j in range(s):
            ctx = ctx.add_summary(f"s{j}", x * (j + 1))
        ctx = ctx.add_summary("w", WeightedSummary(x, 2.0))
        return c, None, ctx

    return jax.jit(
        lambda xs: scan_in_context(body, context=Context.root(), carry=0.0, xs=xs)[2]
    )(jnp.arange(float(n)))


def test_host_views_fetch_each_stacked_array_once(
    device_gets: list[int], tmp_path: Path
) -> None:
    coll = scanned(64, 3)
    flat = coll.flatten("summaries")
    assert device_gets == [5]  # 3 raw arrays + the weighted summary's 2, at once
    assert len(flat) == 64 * 4
    for i in (0, 17, 63):
        assert isinstance(flat[f"iter{i}/s2"], np.generic | np.ndarray)
        assert float(flat[f"iter{i}/s2"]) == 3.0 * i
        assert float(flat[f"iter{i}/w"].value()) == i
    device_gets.clear()
    assert float(coll.child("iter9").flatten("summaries")["s0"]) == 9.0
    assert float(coll.materialize().summaries["iter5"]["s1"]) == 10.0
    assert device_gets == [5, 5]
    device_gets.clear()
    with JsonlWriter(tmp_path / "s.jsonl") as writer:
        writer.write(0, coll)
    assert device_gets[0] == 5


def test_summary_accumulator_keeps_iterations_stacked() -> None:
    a, b = scanned(32, 2), scanned(32, 2)
    acc = SummaryAccumulator().update(a).update(b)
    assert acc.accumulated is not None
    entry = acc.accumulated["iter"]
    assert isinstance(entry, IterationSummaries)
    flat = acc.flatten()
    want_a = a.flatten("summaries")
    for i in (0, 5, 31):
        assert float(flat[f"iter{i}/s1"]) == float(want_a[f"iter{i}/s1"]) * 2
        assert float(flat[f"iter{i}/w"].weight) == 4.0
        assert float(flat[f"iter{i}/w"].value()) == i
    # A per-iteration weight of shape () with a mean of shape (3,) accumulates too.
    stacked = {"w": WeightedSummary(jnp.ones((4, 3)), jnp.arange(4.0))}
    coll = OutputCollection({"iter": IterationSummaries(4, stacked)}, {}, {})
    out = SummaryAccumulator().update(coll).update(coll).flatten()
    np.testing.assert_array_equal(out["iter3/w"].weight, 6.0)
    np.testing.assert_array_equal(out["iter3/w"].value(), np.ones(3))


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


def test_trace_of_many_children_is_linear_in_python_calls() -> None:
    """Python calls per child are constant: K children cost K times one child."""

    def make(k: int) -> Callable[[], Any]:
        def f(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
            for i in range(k):
                x, ctx = ctx.call(
                    f"c{i}",
                    lambda x, c: (
                        x,
                        c.add_summary("s", 1.0).add_module_output("h", 2.0),
                    ),
                    x,
                )
            return x, ctx

        return lambda: functional(f, prng_key=None, is_training=False, args=(1.0,))

    make(5)()
    c10, c20, c40 = (count_calls(make(k)) for k in (10, 20, 40))
    assert c40 - c20 == 2 * (c20 - c10)


def test_the_shared_empty_mapping_keeps_nothing_alive() -> None:
    import gc
    import weakref

    big = jnp.zeros(1000, jnp.float32)  # (a NumPy array would be copied where added)
    ref = weakref.ref(big)
    coll = OutputCollection.empty().add_summary("x", big)
    ctx = Context.root().add_module_output("y", big).call("c", lambda c: (None, c))[1]
    assert coll.flatten("summaries")["x"] is big
    del big, coll, ctx
    gc.collect()
    assert ref() is None  # no shared log holds on to the first value added to it
    first = OutputCollection.empty().add_summary("a", 1.0)
    second = OutputCollection.empty().add_summary("b", 2.0)
    assert first.flatten("summaries") == {"a": 1.0}
    assert second.flatten("summaries") == {"b": 2.0}
    assert OutputCollection.empty().flatten("summaries") == {}


# -- regressions from a tester round ---------------------------------------------------


def test_iterating_a_mapping_never_sees_later_entries() -> None:
    ctx = (
        Context.root().add_summary("loss", jnp.ones(3)).add_summary("acc", jnp.ones(3))
    )
    for k, v in ctx.collection.summaries.items():
        ctx = ctx.add_summary(k + "_mean", jnp.mean(v))
    assert list(ctx.collection.summaries) == ["loss", "acc", "loss_mean", "acc_mean"]
    ctx = Context.root().add_summary("loss", 1.0)
    for k in ctx.collection.summaries:  # terminates: sees only "loss"
        ctx = ctx.add_summary(k + "_x", 2.0)
    assert list(ctx.collection.summaries) == ["loss", "loss_x"]


def test_accumulating_host_values_is_exact() -> None:
    acc = SummaryAccumulator()
    for _ in range(2):
        acc = acc.update({"n": np.int64(2**40), "x": np.float64(0.1), "p": True})
    flat = acc.flatten()
    assert flat["n"] == 2**41
    assert flat["n"].dtype == np.int64  # pyright: ignore[reportAttributeAccessIssue]
    assert flat["x"] == np.float64(0.1) + np.float64(0.1)
    assert flat["p"] == 2
    assert SummaryAccumulator().update({"n": 2**31}).update({"n": 1}).flatten()[
        "n"
    ] == (2**31 + 1)


def test_accumulating_copies_the_callers_numpy_arrays() -> None:
    # A host buffer refilled for every batch: each update counts what it held then.
    buf = np.zeros(2, np.float32)
    image = np.zeros((1, 2, 2, 1), np.uint8)
    acc = SummaryAccumulator()
    kept = []
    for values in ([1.0, 2.0], [10.0, 20.0], [100.0, 200.0]):
        buf[:] = values
        image[:] = int(values[0]) % 256
        summaries = {"x": buf, "w": WeightedSummary(buf, 2.0), "i": ImageSummary(image)}
        acc = acc.update(summaries)
        kept.append(acc)
    np.testing.assert_array_equal(acc.flatten()["x"], [111.0, 222.0])
    weighted = acc.flatten()["w"]
    assert isinstance(weighted, WeightedSummary)
    np.testing.assert_allclose(weighted.value(), [37.0, 74.0])
    # The first image is kept (media summaries are not averaged), as it was.
    first = acc.flatten()["i"]
    assert isinstance(first, ImageSummary)
    assert int(np.asarray(first.value()).max()) == 1
    buf[:] = -1.0
    np.testing.assert_array_equal(kept[0].flatten()["x"], [1.0, 2.0])
    # JAX arrays are immutable: kept as they are, not copied.
    y = jnp.arange(2.0)
    assert SummaryAccumulator().update({"y": y}).flatten()["y"] is y


def test_a_kept_version_keeps_no_later_values_alive() -> None:
    import gc
    import weakref

    base = Context.root().add_summary("lr", 0.1).add_module_output("cfg", 1.0)
    refs = []
    for step in range(3):
        big = np.full(1000, float(step), np.float32)
        refs.append(weakref.ref(big))
        _, ctx = base.call(
            "model", lambda c, big=big: (None, c.add_module_output("h", big))
        )
        del ctx, big
        gc.collect()
    # Versions share no mutable state: `base` keeps no later value alive.
    assert [r() is None for r in refs] == [True, True, True]


def test_collections_made_outside_jit_keep_no_tracers() -> None:
    g = Context.root().add_summary("cfg", 1.0)

    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        return g.add_summary("x", x * 2).collection.summaries["x"]

    with jax.checking_leaks():
        np.testing.assert_array_equal(f(jnp.ones(3)), 2 * np.ones(3))
    assert g.collection.flatten("summaries") == {"cfg": 1.0}


def test_tree_at_replaces_levels() -> None:
    import equinox as eqx

    c = OutputCollection.empty().add_summary("a", 1.0)
    c = c.add_child("k", OutputCollection.empty().add_summary("v", 2.0))
    new = eqx.tree_at(lambda c: c.summaries["k"], c, {"v": 5.0})
    assert float(new.flatten("summaries")["k/v"]) == 5.0
    assert c.flatten("summaries")["k/v"] == 2.0


def test_leaves_from_tree_map_are_checked_where_they_enter() -> None:
    bad = jax.tree_util.tree_map(
        lambda x: "text", OutputCollection.empty().add_summary("a", 1.0)
    )
    for attempt in (
        lambda: OutputCollection(bad.summaries, {}, {}),
        lambda: OutputCollection.empty().add_child("k", bad),
        lambda: Context.root().merge(bad),
        lambda: Context.root().call("k", lambda c: (0, c.replace_collection(bad))),
    ):
        with pytest.raises(TypeError, match=r"summaries/.*a"):
            attempt()


def test_a_derived_key_is_remembered_outside_traces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folds: list[int] = []
    real = jax.random.fold_in

    def counting(key: Any, data: Any) -> Any:
        folds.append(1)
        return real(key, data)

    monkeypatch.setattr(jax.random, "fold_in", counting)
    ctx = Context.root(prng_key=jax.random.PRNGKey(0)).child("a").child("b")
    first = ctx.prng_key
    assert len(folds) == 2
    for _ in range(3):
        np.testing.assert_array_equal(jax.tree_util.tree_leaves(ctx)[0], first)
        np.testing.assert_array_equal(ctx.prng_key, first)
    assert len(folds) == 2  # derived once, remembered


def _chain_reading_keys(depth: int) -> Callable[[jax.Array, jax.Array], Any]:
    """A chain of `depth` nested children, each adding noise from its key."""

    def node(x: jax.Array, ctx: Context, *, i: int) -> tuple[jax.Array, Context]:
        x = x + jax.random.normal(ctx.prng_key, x.shape)
        if i + 1 < depth:
            x, ctx = ctx.call(f"c{i + 1}", node, x, i=i + 1)
        return x, ctx.add_module_output("key", jax.random.key_data(ctx.prng_key))

    def model(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return ctx.call("c0", node, x, i=0)

    def run(x: jax.Array, key: jax.Array) -> Any:
        return functional(
            model,
            prng_key=key,
            is_training=True,
            args=(x,),
            drop_output_collections=(),
        )

    return run


def _reference_keys(key: jax.Array, depth: int) -> list[jax.Array]:
    """`fold_in` by each level's seed, from the root down (AXLearn's derivation)."""
    keys: list[jax.Array] = []
    for i in range(depth):
        key = jax.random.fold_in(key, eqxctx._context.child_seed(f"c{i}"))  # pyright: ignore[reportPrivateUsage]
        keys.append(key)
    return keys


def _folds(jaxpr: Any) -> int:
    return sum(e.primitive.name == "random_fold_in" for e in jaxpr.jaxpr.eqns)


@pytest.mark.parametrize("depth", [3, 12, 40])
def test_traced_keys_cost_one_fold_per_level(depth: int) -> None:
    # Each level reads its key twice: under a trace every frame derives its key once
    # per trace from its parent's (kept with the trace), not once per ancestor per
    # read (depth * (depth + 1) folds before).
    key = jax.random.PRNGKey(3)
    x = jnp.zeros(4)
    jaxpr = jax.make_jaxpr(_chain_reading_keys(depth))(x, key)
    assert _folds(jaxpr) == depth
    # The keys are the eager derivation's, under jit and without it.
    want = np.stack([jax.random.key_data(k) for k in _reference_keys(key, depth)])
    for run in (_chain_reading_keys(depth), jax.jit(_chain_reading_keys(depth))):
        _, coll = run(x, key)
        got, level = [], coll.module_outputs
        for i in range(depth):
            level = level[f"c{i}"]
            got.append(np.asarray(level["key"]))
        np.testing.assert_array_equal(np.stack(got), want)


def test_every_frame_on_the_way_down_keeps_its_traced_key() -> None:
    # Only leaves read keys: level i's leaf derives c0..ci on its way down, which the
    # next leaf reuses (one fold per frame: D chain frames + D leaves), not folds
    # from the root per read (D(D+3)/2).
    depth = 12

    def node(x: jax.Array, ctx: Context, *, i: int) -> tuple[jax.Array, Context]:
        def leaf(x: jax.Array, c: Context) -> tuple[jax.Array, Context]:
            return x + jax.random.normal(c.prng_key, x.shape), c

        x, ctx = ctx.call("leaf", leaf, x)
        if i + 1 < depth:
            x, ctx = ctx.call(f"c{i + 1}", node, x, i=i + 1)
        return x, ctx

    def run(x: jax.Array, key: jax.Array) -> Any:
        model = lambda x, ctx: ctx.call("c0", node, x, i=0)
        return functional(model, prng_key=key, is_training=True, args=(x,))[0]

    key = jax.random.PRNGKey(1)
    assert _folds(jax.make_jaxpr(run)(jnp.zeros(2), key)) == 2 * depth
    want = jnp.zeros(2)
    for k in _reference_keys(key, depth):
        leaf_key = jax.random.fold_in(k, eqxctx._context.child_seed("leaf"))  # pyright: ignore[reportPrivateUsage]
        want = want + jax.random.normal(leaf_key, (2,))
    np.testing.assert_allclose(jax.jit(run)(jnp.zeros(2), key), want, rtol=1e-6)


def _layer_with_cond(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    def branch(x: jax.Array, c: Context) -> tuple[jax.Array, Context]:
        return x + jax.random.normal(c.prng_key, ()), c

    y, coll = cond_in_context(x > 0, branch, lambda x, c: (x, c), x, context=ctx)
    return y, ctx.merge(coll)


def test_no_traced_key_outlives_its_trace_in_a_frame_made_before_it() -> None:
    # Frames made outside a trace (or under an outer one) and read inside it keep no
    # tracer of it: `jax.checking_leaks` finds nothing, in eqxctx's own branches too.
    key = jax.random.PRNGKey(0)
    outside = Context.root(prng_key=key).child("a").child("b")
    want = jax.random.normal(_key_of(key, ("a", "b")), ())

    def read(x: jax.Array) -> jax.Array:
        return x + jax.random.normal(outside.prng_key, ())

    def scan_body(c: jax.Array, _: None) -> tuple[jax.Array, None]:
        return read(c), None

    @jax.jit
    def step(x: jax.Array, k: jax.Array) -> jax.Array:
        model = lambda x, ctx: ctx.call("layer", _layer_with_cond, x)
        return functional(model, prng_key=k, is_training=True, args=(x,))[0]

    with jax.checking_leaks():
        np.testing.assert_allclose(jax.jit(read)(jnp.zeros(())), want, rtol=1e-6)
        got, _ = jax.lax.scan(scan_body, jnp.zeros(()), None, length=2)
        np.testing.assert_allclose(got, 2 * want, rtol=1e-6)
        out = step(jnp.ones(()), key)
    noise = jax.random.normal(_key_of(key, ("layer", "cond")), ())
    np.testing.assert_allclose(out, 1.0 + noise, rtol=1e-6)


def _key_of(key: jax.Array, names: tuple[str, ...]) -> jax.Array:
    for name in names:
        key = jax.random.fold_in(key, eqxctx._context.child_seed(name))  # pyright: ignore[reportPrivateUsage]
    return key


def test_keys_are_concrete_inside_ensure_compile_time_eval() -> None:
    # A key read under a trace is not reused inside `jax.ensure_compile_time_eval`:
    # derived there from a concrete root key, it is concrete.
    key = jax.random.PRNGKey(0)
    seen: list[int] = []

    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        ctx = Context.root(prng_key=key).child("a").child("b")
        x = x + jax.random.normal(ctx.prng_key, ())  # a tracer of this trace
        with jax.ensure_compile_time_eval():
            seen.append(int(jax.random.randint(ctx.prng_key, (), 1, 100)))
        return x + jax.random.normal(ctx.prng_key, ())

    out = f(jnp.zeros(()))
    want = _key_of(key, ("a", "b"))
    assert seen == [int(jax.random.randint(want, (), 1, 100))]
    np.testing.assert_allclose(out, 2 * jax.random.normal(want, ()), rtol=1e-6)


def test_a_traced_key_is_reused_only_under_its_trace() -> None:
    key = jax.random.PRNGKey(5)
    want = _reference_keys(key, 3)
    escaped: list[Context] = []

    def make(escape: bool) -> Callable[[jax.Array], jax.Array]:
        def f(x: jax.Array) -> jax.Array:
            # From a concrete key inside the trace: the keys derived here are tracers
            # of this trace.
            ctx = Context.root(prng_key=key).child("c0").child("c1").child("c2")
            x = x + jax.random.normal(ctx.prng_key, ())
            if escape:
                escaped.append(ctx)

            # Read under an inner transformation, then again under this trace.
            def g(y: jax.Array) -> jax.Array:
                return y + jax.random.normal(ctx.prng_key, ())

            x = x + jax.vmap(g)(jnp.arange(2.0)).sum()
            return x + jax.random.normal(ctx.prng_key, ())

        return f

    noise = float(jax.random.normal(want[2], ()))
    with jax.checking_leaks():  # nothing of eqxctx keeps a tracer past its trace
        out = jax.jit(make(escape=False))(jnp.zeros(()))
    np.testing.assert_allclose(out, 4 * noise + 1.0, rtol=1e-6)  # 0 + 1 from arange
    # A context that outlives its trace (a leak, on purpose) derives its key again,
    # concretely, equal to the reference: no tracer of the finished trace comes back.
    jax.jit(make(escape=True))(jnp.zeros(()))
    ctx = escaped[0]
    assert not isinstance(ctx.prng_key, Tracer)
    np.testing.assert_array_equal(ctx.prng_key, want[2])
    np.testing.assert_array_equal(
        ctx.child("c3").prng_key,
        jax.random.fold_in(want[2], eqxctx._context.child_seed("c3")),  # pyright: ignore[reportPrivateUsage]
    )


def count_own_calls(fn: Callable[[], Any]) -> int:
    """As `count_calls`, without the calls the suite's beartype checks make.

    Beartype's wrapper checks a returned `Mapping` by reading it (`len`, `iter`),
    which a run without the import hook does not do; calls made from a wrapper
    (other than to the function it wraps), and everything below them, are left out.
    """
    calls = 0
    checking: set[int] = set()  # ids of the frames of beartype's checks

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        del arg
        if event == "return":
            checking.discard(id(frame))
            return
        if event != "call":
            return
        parent = frame.f_back
        if parent is not None and (
            id(parent) in checking
            or (
                parent.f_code.co_filename.startswith("<@beartype")
                and parent.f_code.co_name != frame.f_code.co_name
            )
        ):
            checking.add(id(frame))
        elif frame.f_code.co_filename.startswith(_SRC):
            calls += 1

    _run_profiled(fn, profile)
    return calls


@pytest.mark.parametrize("k", [1, 100])
def test_jit_outputs_cost_one_call_per_level(k: int) -> None:
    # A jitted function's returned collection is unflattened (and often flattened
    # again, by `jax.block_until_ready` or the next call) after every call.
    child = OutputCollection.empty()
    for j in range(k):
        child = child.add_summary(f"s{j}", WeightedSummary(jnp.float32(j), 1.0))
    coll = OutputCollection.empty().add_child("cond", child)
    leaves, treedef = jax.tree_util.tree_flatten(coll)
    out: list[Any] = []
    # The collection and its 6 mappings, whatever they hold (the summaries are
    # Equinox's, not counted).
    assert count_own_calls(lambda: out.append(treedef.unflatten(leaves))) == 7
    assert count_own_calls(lambda: jax.tree_util.tree_leaves(out[0])) == 7
    assert count_own_calls(lambda: jax.tree_util.tree_flatten_with_path(out[0])) == 7
    assert jax.tree_util.tree_leaves(out[0]) == leaves


def test_summary_names_are_checked_once_per_structure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Accumulators and writers see one structure every step: its names are checked
    # the first time only; a new structure (or a bad name) is checked again.
    calls: list[str] = []
    check = collection_module.check_summary_name

    def counted(key: object, prefix: str, *, where: str) -> str:
        calls.append(f"{prefix}{key}")
        return check(key, prefix, where=where)

    monkeypatch.setattr(collection_module, "check_summary_name", counted)
    collection_module._NAMES_CHECKED.clear()  # pyright: ignore[reportPrivateUsage]

    def step(i: int) -> dict[str, Any]:
        return {
            "loss": WeightedSummary(jnp.float32(i), 1.0),
            "z": {"acc": jnp.float32(i)},
        }

    acc = SummaryAccumulator().update(step(0))
    assert sorted(calls) == ["loss", "z", "z/acc"]
    calls.clear()
    for i in range(1, 4):
        acc = acc.update(step(i))
    assert calls == []
    np.testing.assert_allclose(acc.summaries()["loss"].value(), 1.5)
    with pytest.raises(ValueError, match=r"invalid summary name 'a/b'"):
        acc.update({**step(4), "a/b": jnp.float32(0)})
    with pytest.raises(ValueError, match=r"invalid summary name 'a/b'"):
        acc.update({**step(4), "a/b": jnp.float32(0)})


def test_jit_outputs_of_a_known_structure_check_only_their_leaves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A jitted step's output is unflattened: its leaves are checked when it enters an
    # accumulator or a writer. For a structure seen before, that is a quick test of
    # the leaves (no walk by path); a bad leaf is still refused, naming its path.
    calls: list[str] = []
    check = iterations_module.check_leaf

    def counted(value: object, path: str, where: str | None = None) -> int:
        calls.append(path)
        return check(value, path, where)

    monkeypatch.setattr(iterations_module, "check_leaf", counted)

    @jax.jit
    def f(x: jax.Array) -> OutputCollection:
        inner = OutputCollection.empty().add_summary("b", x * 2)
        return OutputCollection.empty().add_summary("a", x).add_child("c", inner)

    acc = SummaryAccumulator().update(f(jnp.float32(1)))
    assert sorted(calls) == ["summaries/a", "summaries/c/b"]
    calls.clear()
    acc = acc.update(f(jnp.float32(2)))
    assert calls == []
    assert acc.flatten() == {"a": 3.0, "c/b": 6.0}
    writer = JsonlWriter(tmp_path / "s.jsonl")
    for bad, message in (
        (np.array(["t"]), r"'summaries/a' has dtype <U1"),
        (jax.random.key(0), r"summary at 'summaries/a' is a typed PRNG key"),
    ):
        replaced = jax.tree_util.tree_map(lambda x, bad=bad: bad, f(jnp.float32(3)))
        with pytest.raises(TypeError, match=message):
            acc.update(replaced)
        with pytest.raises(TypeError, match=r"at '(summaries/)?a'"):
            writer.write(0, replaced)
    writer.close()


class _Concat(Summary):
    """Keeps every value (its shape grows with each accumulation)."""

    values: jax.Array

    def value(self) -> jax.Array:
        return self.values

    def accumulate(self, other: Any) -> "_Concat":
        return _Concat(jnp.concatenate([self.values, other.values]))


def test_a_summary_that_changes_shape_costs_no_failed_trace_per_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A shape that differs from the accumulated one falls back to the path-by-path
    # accumulation; the jitted step is tried (and its trace fails) at most once.
    failed: list[int] = []
    real = batches_module._ShapeChanged  # pyright: ignore[reportPrivateUsage]

    class Counted(real):
        def __init__(self) -> None:
            failed.append(1)
            super().__init__()

    monkeypatch.setattr(batches_module, "_ShapeChanged", Counted)
    batches_module._step.cache_clear()  # pyright: ignore[reportPrivateUsage]
    step = {"c": _Concat(jnp.ones(1)), "x": jnp.float32(1)}
    acc = SummaryAccumulator().update(step)
    for _ in range(5):
        acc = acc.update(step)
    assert acc.flatten()["x"] == 6.0
    np.testing.assert_array_equal(acc.flatten()["c"].values, np.ones(6))
    assert len(failed) <= 1


def test_a_rebuilt_structure_is_the_one_remembered() -> None:
    # A FrozenMapping holding plain mappings (and collections) is rebuilt into
    # another structure: the rebuilt one is checked, returned and remembered, every
    # time (the raw one once was, and the next such input then skipped the rebuild).
    base = OutputCollection.empty().add_summary("loss", jnp.float32(1))
    inner = (
        OutputCollection.empty()
        .add_summary("s", jnp.float32(1))
        .add_state_update("u", jnp.float32(10))
    )

    def raw() -> Any:
        return jax.tree_util.tree_map(lambda _: {"c": inner}, base.summaries)

    for _ in range(2):
        acc = SummaryAccumulator().update(raw()).update(raw())
        assert acc.flatten() == {"loss/c/s": 2.0}
        assert isinstance(acc.accumulated, FrozenMapping)
        assert isinstance(acc.accumulated["loss"], FrozenMapping)
        np.testing.assert_array_equal(fetch_summaries(raw())["loss/c/s"], 1.0)


def _levels(tree: FrozenMapping) -> list[FrozenMapping]:
    out = [tree]
    for _, value in tree.items_list():
        if isinstance(value, FrozenMapping):
            out += _levels(value)
    return out


def test_a_frozen_mapping_is_checked_only_where_its_leaves_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `FrozenMapping(items)` claims nothing of its leaves: `freeze` checks them,
    # naming the path (it once claimed them checked and was returned unchecked).
    # Levels rebuilt from checked ones (materialized, pruned, sliced, deep-copied)
    # stay checked, so nothing is walked again.
    with pytest.raises(TypeError, match=r"summaries/c/a"):
        iterations_module.freeze(
            FrozenMapping({"c": FrozenMapping({"a": "text"})}), "summaries"
        )
    coll = OutputCollection(scanned(3, 2).summaries, {}, {})  # checked here
    uniform = coll.prune(lambda path: path.endswith("/s1"))
    sliced = coll.prune(lambda path: path == "summaries/iter1/s0")
    assert isinstance(uniform.summaries["iter"], IterationSummaries)
    assert sorted(sliced.summaries) == ["iter", "iter0", "iter1", "iter2"]
    for view in (coll.materialize(), uniform, sliced):
        levels = _levels(view.summaries)
        assert levels
        assert all(level.checked for level in levels)
    copied = copy.deepcopy(coll.summaries)
    assert copied is not coll.summaries
    assert copied.checked
    calls: list[str] = []
    check = iterations_module.check_leaf
    monkeypatch.setattr(
        iterations_module,
        "check_leaf",
        lambda value, path, where=None: calls.append(path) or check(value, path, where),
    )
    flat = coll.materialize().flatten("summaries")
    iterations_module.freeze(coll.materialize().summaries, "summaries")
    iterations_module.freeze(sliced.summaries, "summaries")
    assert calls == []
    assert [float(flat[f"iter{i}/s1"]) for i in range(3)] == [0.0, 2.0, 4.0]
    assert sorted(sliced.flatten("summaries")) == sorted(
        k for k in flat if k != "iter1/s0"
    )
    # Unflattened (a jitted function's output): not checked, checked where it enters.
    assert not scanned(3, 2).materialize().summaries.checked
    # A scan's entry made by `tree_map` is checked where a mapping holding it enters.
    bad = jax.tree_util.tree_map(lambda x: np.array(["t"] * 3), coll.summaries["iter"])
    with pytest.raises(TypeError, match=r"'summaries/it/s0' has dtype <U1"):
        OutputCollection({"it": bad}, {}, {})


def test_values_inserted_into_a_level_are_checked_where_they_are_written() -> None:
    # `inserted` / `updated` leave checking to their callers (an add checks first);
    # a level grown by them directly is not trusted by writers and accumulators.
    coll = OutputCollection({"x": 1.0}, {}, {})
    for bad, message in (
        ("hello", r"the value at 's' has type str"),
        (jax.random.key(0), r"the summary at 's' is a typed PRNG key"),
        (np.array(["t"]), r"the array at 's' has dtype <U1"),
    ):  # (at the path in what was passed, by the function it was passed to)
        grown = coll.summaries.updated([("s", bad)])
        with pytest.raises(
            TypeError, match=rf"^`SummaryAccumulator.update`: {message}"
        ):
            SummaryAccumulator().update(grown)
        with pytest.raises(TypeError, match=rf"^`fetch_summaries`: {message}"):
            fetch_summaries(grown)
    assert fetch_summaries(coll.summaries.inserted("s", 2.0)) == {"x": 1.0, "s": 2.0}


# -- deep chains ---------------------------------------------------------------------


def test_inserted_and_updated_refuse_a_key_already_present() -> None:
    # A level holds each key once: growing it by a present key (or a key twice) would
    # give a mapping whose length disagrees with its keys.
    coll = OutputCollection({"x": 1.0, "c": {"y": 2.0}}, {}, {})
    level = coll.summaries
    for bad in ("x", "c"):
        with pytest.raises(ValueError, match=rf"`FrozenMapping.inserted`: '{bad}' is"):
            level.inserted(bad, 3.0)
    with pytest.raises(ValueError, match=r"`FrozenMapping.updated`: 'x' is already"):
        level.updated([("z", 3.0), ("x", 4.0)])
    with pytest.raises(ValueError, match=r"`FrozenMapping.updated`: 'z' is already"):
        level.updated([("z", 3.0), ("z", 4.0)])
    with pytest.raises(TypeError, match=r"keys are non-empty strings, got ''"):
        level.inserted("", 3.0)
    for key in (1, None):  # (refused by the checks of the tests' type checker too)
        with pytest.raises(TypeError):
            level.inserted(key, 3.0)  # pyright: ignore[reportArgumentType]
    # Nothing was added by the refused calls, and the accepted ones add in order.
    assert list(level) == ["x", "c"]
    assert len(level) == 2
    grown = level.updated([("z", 3.0), ("w", 4.0)])
    assert list(grown) == ["x", "c", "z", "w"]
    assert len(grown) == 4
    assert grown["z"] == 3.0
    assert grown["w"] == 4.0
    assert list(level) == ["x", "c"]
    assert len(level) == 2
    assert list(level.inserted("v", 5.0)) == ["x", "c", "v"]

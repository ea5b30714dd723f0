"""Host-side cost, through what a user can observe: no eqxctx function is patched.

Complexity is asserted by exact counts at n and 10n (or n, 2n, 4n): Python calls of
eqxctx's functions (`sys.setprofile`), of JAX's, or of a public JAX entry point;
calls of a user-defined `Summary`'s methods; `random_fold_in` equations of a jaxpr;
optimized HLO instructions; trace counts. Each measured run is first run once at its
largest size, so that every cache it fills (names, seeds, JAX's) is warm whatever
ran before it.
"""

import collections
import functools
import gc
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.core import Tracer

import eqxctx
from eqxctx import (
    Context,
    IterationSummaries,
    OutputCollection,
    OutputConflictError,
    Summary,
    SummaryAccumulator,
    WeightedSummary,
    functional,
    scan_in_context,
    vmap_in_context,
)
from eqxctx.writers import JsonlWriter
from helpers import child_seed, key_of


_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+ = ", re.MULTILINE)


_SRC = str(Path(eqxctx.__file__).parent)
_JAX = str(Path(jax.__file__).parent)


def _counting(fn: Callable[[], Any], counts: Callable[[Any], bool]) -> int:
    """The number of Python calls `counts(frame)` accepts while running `fn`.

    A generator's resumptions are not calls (each would be a "call" event). Garbage
    collection is off: it (and JAX's callbacks on it) depends on what ran before.
    """
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        del arg
        code = frame.f_code
        if event == "call" and not code.co_flags & inspect.CO_GENERATOR:
            calls += counts(frame)

    _run_profiled(fn, profile)
    return calls


def _run_profiled(fn: Callable[[], Any], profile: Callable[..., None]) -> None:
    """Run `fn` under `profile`, with garbage collection off."""
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()


def count_calls(fn: Callable[[], Any], root: str = _SRC) -> int:
    """Calls of the Python functions under `root` (eqxctx's own, by default)."""
    return _counting(fn, lambda frame: frame.f_code.co_filename.startswith(root))


def warm_counts(make: Callable[[int], Callable[[], Any]], *sizes: int) -> list[int]:
    """`count_calls(make(n))` for each size, after one run at the largest."""
    make(max(sizes))()
    return [count_calls(make(n)) for n in sizes]


def hlo_size(fn: Callable[..., Any], *args: Any) -> tuple[int, int]:
    """(optimized HLO instructions, output leaves) of `jax.jit(fn)(*args)`."""
    compiled = jax.jit(fn).lower(*args).compile()
    outputs = len(jax.tree_util.tree_leaves(jax.eval_shape(fn, *args)))
    return len(_INSTRUCTION.findall(compiled.as_text() or "")), outputs


# -- adds are O(1), each leaf checked once --------------------------------------------


class _Validated(Summary):
    """A user's summary kind that records each call of its `validate`."""

    x: jax.Array
    calls: ClassVar[list[int]] = []

    def value(self) -> jax.Array:
        return self.x

    def validate(self) -> None:
        self.calls.append(1)

    def accumulate(self, other: Any) -> "_Validated":
        return _Validated(self.x + other.x)


def _with_summaries(k: int, *, validated: bool = False) -> OutputCollection:
    coll = OutputCollection.empty()
    for i in range(k):
        value = _Validated(jnp.float32(i)) if validated else jnp.float32(i)
        coll = coll.add_summary(f"s{i}", value)
    return coll


def test_adds_and_merges_cost_the_same_per_leaf_and_validate_once() -> None:
    # Python calls of k adds, and of merging and nesting a collection of k leaves,
    # are exactly linear in k (O(1) each, whatever the level holds already).
    add = lambda k: lambda: _with_summaries(k)
    c1, c10, c100 = warm_counts(add, 1, 10, 100)
    assert c100 - c10 == 10 * (c10 - c1)

    def merge(k: int) -> Callable[[], Any]:
        coll = _with_summaries(k)

        def run() -> Any:
            parent = Context.root().call("a", lambda c: (None, c.merge(coll)))[1]
            return parent.collection.merge(
                OutputCollection.empty().add_child("b", coll)
            )

        return run

    m1, m10, m100 = warm_counts(merge, 1, 10, 100)
    assert m100 - m10 == 10 * (m10 - m1)
    # Each summary is validated once, where it is added: merging, nesting and
    # reading validate nothing again.
    log = _Validated.calls
    log.clear()
    coll = _with_summaries(50, validated=True)
    assert len(log) == 50
    parent = Context.root().call("a", lambda c: (None, c.merge(coll)))[1]
    parent.collection.merge(OutputCollection.empty().add_child("b", coll))
    flat = parent.collection.flatten("summaries")
    jax.jit(lambda c: c)(parent.collection)
    assert len(log) == 50
    assert [float(flat[f"a/s{i}"].value()) for i in (0, 49)] == [0.0, 49.0]


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


def test_adds_after_a_long_scan_cost_the_same() -> None:
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


def scanned(n: int, s: int) -> OutputCollection:
    """Summaries `s{j}` (`x * (j + 1)`) and `w` of a scan over `arange(n)`."""
    return _scanned_fn(s)(jnp.arange(float(n)))


@functools.cache
def _scanned_fn(s: int) -> Callable[[jax.Array], OutputCollection]:
    """`scanned`'s jitted function, one per `s`: a new collection per call, compiled
    once per length (not once per call)."""

    def body(c: float, x: jax.Array, ctx: Context) -> Any:
        for j in range(s):
            ctx = ctx.add_summary(f"s{j}", x * (j + 1))
        ctx = ctx.add_summary("w", WeightedSummary(x, 2.0))
        return c, None, ctx

    return jax.jit(
        lambda xs: scan_in_context(body, context=Context.root(), carry=0.0, xs=xs)[2]
    )


def _device_gets(fn: Callable[[], Any]) -> list[int]:
    """The number of leaves of each call of the public `jax.device_get` in `fn`."""
    code = inspect.unwrap(jax.device_get).__code__
    got: list[int] = []

    def counts(frame: Any) -> bool:
        if frame.f_code is code:
            got.append(len(jax.tree_util.tree_leaves(frame.f_locals["x"])))
        return False

    _counting(fn, counts)
    return got


def test_host_views_fetch_each_stacked_array_once(tmp_path: Path) -> None:
    coll = scanned(64, 3)
    out: list[Any] = []
    # 3 raw arrays + the weighted summary's 2, at once.
    assert _device_gets(lambda: out.append(coll.flatten("summaries"))) == [5]
    flat = out[0]
    assert len(flat) == 64 * 4
    for i in (0, 17, 63):
        assert isinstance(flat[f"iter{i}/s2"], np.generic | np.ndarray)
        assert float(flat[f"iter{i}/s2"]) == 3.0 * i
        assert float(flat[f"iter{i}/w"].value()) == i
    assert _device_gets(
        lambda: out.append(coll.child("iter9").flatten("summaries"))
    ) == [5]
    assert float(out[-1]["s0"]) == 9.0
    assert _device_gets(lambda: out.append(coll.materialize())) == [5]
    assert float(out[-1].summaries["iter5"]["s1"]) == 10.0

    # A writer (its own batched fetch) and the views: JAX's Python calls are the
    # same for 64 and 640 iterations: nothing is fetched or sliced per iteration.
    with JsonlWriter(tmp_path / "s.jsonl") as writer:
        steps = iter(range(100))

        def write(n: int) -> Callable[[], Any]:
            coll = scanned(n, 3)
            return lambda: writer.write(next(steps), coll)

        def view(n: int) -> Callable[[], Any]:
            coll = scanned(n, 3)
            return lambda: coll.flatten("summaries")

        for make in (write, view):
            for n in (64, 640, 64, 640):  # (the first writes of a structure compile)
                make(n)()
            assert count_calls(make(64), _JAX) == count_calls(make(640), _JAX)
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 6  # writes


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

    # (Warm at 40: child names' seeds and checks are cached per name, and another
    # test may have seen some of c0..c39 already.)
    c10, c20, c40 = warm_counts(make, 10, 20, 40)
    assert c40 - c20 == 2 * (c20 - c10)


# -- keys --------------------------------------------------------------------------


def _folds_in(fn: Callable[[], Any]) -> int:
    """Calls of the public `jax.random.fold_in` while running `fn`."""
    code = inspect.unwrap(jax.random.fold_in).__code__
    return _counting(fn, lambda frame: frame.f_code is code)


def test_a_key_is_derived_where_it_is_read_and_not_kept() -> None:
    # Frames are never written (issue 36): making a child folds nothing, and each
    # read of a key folds once per level from the root, the same key every time.
    root = Context.root(prng_key=jax.random.PRNGKey(0))
    made: list[Context] = []
    assert _folds_in(lambda: made.append(root.child("a").child("b"))) == 0
    ctx = made[0]
    keys: list[jax.Array] = []
    for _ in range(3):
        assert _folds_in(lambda: keys.append(ctx.prng_key)) == 2
    want = key_of(jax.random.PRNGKey(0), ("a", "b"))
    for key in keys:
        np.testing.assert_array_equal(key, want)


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
        key = jax.random.fold_in(key, child_seed(f"c{i}"))
        keys.append(key)
    return keys


def _folds(jaxpr: Any) -> int:
    return sum(e.primitive.name == "random_fold_in" for e in jaxpr.jaxpr.eqns)


def _hand_chain(depth: int) -> Callable[[jax.Array, jax.Array], Any]:
    """`_chain_reading_keys` written by hand: one fold per level, same values."""

    def run(x: jax.Array, key: jax.Array) -> Any:
        keys = _reference_keys(key, depth)
        for k in keys:
            x = x + jax.random.normal(k, x.shape)
        return x, [jax.random.key_data(k) for k in keys]

    return run


def _compiled(
    fn: Callable[..., Any], *args: Any
) -> tuple[Any, collections.Counter[str]]:
    """`jax.jit(fn)` compiled for `args` (callable), and its HLO opcodes counted."""
    compiled = jax.jit(fn).lower(*args).compile()
    text = compiled.as_text() or ""
    return compiled, collections.Counter(re.findall(r"= \S+ ([\w-]+)\(", text))


@pytest.mark.parametrize("depth", [3, 8])
def test_traced_keys_compile_to_one_fold_per_level(depth: int) -> None:
    # Each level reads its key twice. Frames keep nothing (issue 36: no per-trace
    # bookkeeping), so the jaxpr derives each read from the root: depth * (depth +
    # 1) folds, a trace-time cost only; XLA merges the repeated folds, and the
    # compiled program is the hand-written one (one fold per level), op for op.
    key = jax.random.PRNGKey(3)
    x = jnp.zeros(4)
    jaxpr = jax.make_jaxpr(_chain_reading_keys(depth))(x, key)
    assert _folds(jaxpr) == depth * (depth + 1)
    compiled, opcodes = _compiled(_chain_reading_keys(depth), x, key)
    assert opcodes == _compiled(_hand_chain(depth), x, key)[1]
    # The keys are the eager derivation's, under jit (the program compiled above)
    # and without it.
    want = np.stack([jax.random.key_data(k) for k in _reference_keys(key, depth)])
    for run in (_chain_reading_keys(depth), compiled):
        _, coll = run(x, key)
        got, level = [], coll.module_outputs
        for i in range(depth):
            level = level[f"c{i}"]
            got.append(np.asarray(level["key"]))
        np.testing.assert_array_equal(np.stack(got), want)


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


def test_summary_names_are_checked_once_per_structure() -> None:
    # Accumulators and writers see one structure every step: its names are checked
    # the first time only (its leaves, new values, every time); a new structure (or
    # a bad name) is checked again.
    def step(n: int, i: int, tag: str) -> dict[str, Any]:
        out: dict[str, Any] = {
            f"{tag}w{j}": WeightedSummary(jnp.float32(i), 1.0) for j in range(n)
        }
        return out | {f"{tag}a{j}": jnp.float32(i) for j in range(n)}

    def saved_by_known(n: int, tag: str) -> int:
        first, second = step(n, 0, tag), step(n, 1, tag)
        acc: list[SummaryAccumulator] = []
        cost_first = count_calls(lambda: acc.append(SummaryAccumulator().update(first)))
        acc[0].update(second)  # (the first accumulation compiles a step)
        cost_later = count_calls(lambda: acc.append(acc[0].update(second)))
        return cost_first - cost_later

    # (Tags: names no earlier update has seen.)
    saved = [saved_by_known(n, f"n{n}_{i}_") for i, n in enumerate((50, 5, 50))]
    # The calls a known structure saves grow by at least one per name: 2n names.
    assert saved[2] - saved[1] >= 2 * (50 - 5)
    acc0 = SummaryAccumulator().update({"loss": WeightedSummary(jnp.float32(0), 1.0)})
    for i in range(1, 4):
        acc0 = acc0.update({"loss": WeightedSummary(jnp.float32(i), 1.0)})
    np.testing.assert_allclose(acc0.summaries()["loss"].value(), 1.5)
    for _ in range(2):  # refused every time, not remembered
        with pytest.raises(ValueError, match=r"invalid summary name 'a/b'"):
            acc0.update({"loss": WeightedSummary(jnp.float32(0), 1.0), "a/b": 0.0})


def test_jit_outputs_of_a_known_structure_check_only_their_leaves(
    tmp_path: Path,
) -> None:
    # A jitted step's output is unflattened: its leaves are checked when it enters an
    # accumulator or a writer. For a structure seen before, that is a quick test of
    # the leaves (no call per leaf): the same calls for 5 and 50 summaries.
    def make(n: int) -> Callable[[jax.Array], OutputCollection]:
        @jax.jit
        def f(x: jax.Array) -> OutputCollection:
            coll = OutputCollection.empty()
            for j in range(n):
                coll = coll.add_summary(f"j{n}_{j}", x * j)
            return coll

        return f

    known: list[int] = []
    for n in (50, 5, 50):
        f = make(n)
        acc = SummaryAccumulator().update(f(jnp.float32(1))).update(f(jnp.float32(1)))
        out = f(jnp.float32(2))
        known.append(count_calls(lambda acc=acc, out=out: acc.update(out)))
    assert known[1] == known[2]
    # A bad leaf is still refused, naming its path.

    @jax.jit
    def g(x: jax.Array) -> OutputCollection:
        inner = OutputCollection.empty().add_summary("b", x * 2)
        return OutputCollection.empty().add_summary("a", x).add_child("c", inner)

    acc = SummaryAccumulator().update(g(jnp.float32(1))).update(g(jnp.float32(2)))
    assert acc.flatten() == {"a": 3.0, "c/b": 6.0}
    with JsonlWriter(tmp_path / "s.jsonl") as writer:
        for bad, message in (
            (np.array(["t"]), r"'summaries/a' has dtype <U1"),
            (jax.random.key(0), r"summary at 'summaries/a' is a typed PRNG key"),
        ):
            replaced = jax.tree_util.tree_map(lambda x, bad=bad: bad, g(jnp.float32(3)))
            with pytest.raises(TypeError, match=message):
                acc.update(replaced)
            with pytest.raises(TypeError, match=r"at '(summaries/)?a'"):
                writer.write(0, replaced)


class _Concat(Summary):
    """Keeps every value (its shape grows with each accumulation); counts traces."""

    values: jax.Array
    traced: ClassVar[list[int]] = []

    def value(self) -> jax.Array:
        return self.values

    def accumulate(self, other: Any) -> "_Concat":
        if isinstance(self.values, Tracer):
            self.traced.append(1)
        return _Concat(jnp.concatenate([self.values, other.values]))


def test_a_summary_that_changes_shape_costs_no_failed_trace_per_update() -> None:
    # A shape that differs from the accumulated one falls back to the path-by-path
    # accumulation; the jitted step is tried (and its trace fails) at most once.
    traced = _Concat.traced
    traced.clear()
    step = {"c": _Concat(jnp.ones(1)), "x": jnp.float32(1)}
    acc = SummaryAccumulator().update(step)
    for _ in range(5):
        acc = acc.update(step)
    assert acc.flatten()["x"] == 6.0
    np.testing.assert_array_equal(acc.flatten()["c"].values, np.ones(6))
    assert len(traced) <= 1


def test_levels_are_checked_only_where_their_leaves_were_not() -> None:
    # An unflattened level (`tree_map`) claims nothing of its leaves: a collection
    # made of it checks them, naming the path (a nested level was once taken as
    # checked).
    inner = OutputCollection.empty().add_summary("a", 1.0)
    coll = OutputCollection.empty().add_child("c", inner)
    bad = jax.tree_util.tree_map(lambda x: "text", coll.summaries)
    with pytest.raises(TypeError, match=r"summaries/c/a"):
        OutputCollection(bad, {}, {})

    # Levels rebuilt from checked ones (materialized, pruned, sliced) are taken as
    # they are: a collection made of them costs the same calls for 2 and 20
    # summaries per iteration; an unflattened one (`tree_map`) is checked.
    def views(s: int) -> list[OutputCollection]:
        coll = OutputCollection(scanned(3, s).summaries, {}, {})  # checked here
        return [
            coll.materialize(),
            coll.prune(lambda path: path.endswith("/s1")),
            coll.prune(lambda path: path == "summaries/iter1/s0"),
            jax.tree_util.tree_map(lambda x: x, coll),
        ]

    def made_of(s: int, i: int) -> Callable[[], Any]:
        level = views(s)[i].summaries
        return lambda: OutputCollection(level, {}, {})

    for i in range(3):
        small, large = warm_counts(lambda s, i=i: made_of(s, i), 2, 20)
        assert small == large
    small, large = warm_counts(lambda s: made_of(s, 3), 2, 20)
    assert large > small
    uniform, sliced = views(2)[1:3]
    assert isinstance(uniform.summaries["iter"], IterationSummaries)
    assert sorted(sliced.summaries) == ["iter", "iter0", "iter1", "iter2"]
    flat = views(2)[0].flatten("summaries")
    assert [float(flat[f"iter{i}/s1"]) for i in range(3)] == [0.0, 2.0, 4.0]
    assert sorted(sliced.flatten("summaries")) == sorted(
        k for k in flat if k != "iter1/s0"
    )
    # A scan's entry made by `tree_map` is checked where a mapping holding it enters.
    coll = OutputCollection(scanned(3, 2).summaries, {}, {})
    bad = jax.tree_util.tree_map(lambda x: np.array(["t"] * 3), coll.summaries["iter"])
    with pytest.raises(TypeError, match=r"'summaries/it/s0' has dtype <U1"):
        OutputCollection({"it": bad}, {}, {})

import copy
import pickle
import threading
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from jax.core import Tracer

import eqxctx
from eqxctx import (
    Context,
    OutputCollection,
    OutputConflictError,
    WeightedSummary,
    cond_in_context,
    functional,
    scan_in_context,
)
from eqxctx.testing import assert_collections_equal
from helpers import child_seed, key_of, unchecked


# AXLearn's keys, from the issue: PRNGKey(0) -> "encoder" -> "attention".
ENCODER = [482009463, 3787188805]
ATTENTION = [814259125, 3632049740]


def test_child_keys_match_axlearn() -> None:
    root = Context.root(prng_key=jax.random.PRNGKey(0))
    enc = root.child("encoder")
    att = enc.child("attention")
    assert np.asarray(enc.prng_key).tolist() == ENCODER
    assert np.asarray(att.prng_key).tolist() == ATTENTION
    assert att.path == ("root", "encoder", "attention")


def test_typed_keys_give_same_key_data() -> None:
    root = Context.root(prng_key=jax.random.key(0))
    att = root.child("encoder").child("attention")
    assert jnp.issubdtype(att.prng_key.dtype, jax.dtypes.prng_key)
    assert np.asarray(jax.random.key_data(att.prng_key)).tolist() == ATTENTION


def test_keyless_context_stays_keyless() -> None:
    assert Context.root().child("a").child("b").prng_key is None


def test_child_overrides() -> None:
    root = Context.root(prng_key=jax.random.PRNGKey(0), is_training=True)
    key = jax.random.PRNGKey(7)
    child = root.child("a", prng_key=key, is_training=False)
    assert not child.is_training
    assert np.array_equal(child.prng_key, key)
    assert root.child("a").is_training


def test_runtime_shape_checks_are_on() -> None:
    # The test suite runs with jaxtyping's import hook: a float key is refused.
    with pytest.raises(jaxtyping.TypeCheckError):
        Context.root(prng_key=jnp.zeros(2, jnp.float32)).child("a")


def mlp(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    y = jnp.tanh(x)
    ctx = ctx.add_summary("mean", WeightedSummary(jnp.mean(y), 1.0))
    ctx = ctx.add_module_output("y", y)
    return y, ctx


def model(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    h, ctx = ctx.call("enc", mlp, x)
    out, ctx = ctx.call("dec", mlp, h)
    ctx = ctx.add_summary("loss", jnp.sum(out))
    return out, ctx


def test_call_attaches_child_collections() -> None:
    x = jnp.arange(3.0)
    out, ctx = model(x, Context.root())
    flat = ctx.collection.flatten("summaries")
    assert sorted(flat) == ["dec/mean", "enc/mean", "loss"]
    np.testing.assert_allclose(out, jnp.tanh(jnp.tanh(x)))
    np.testing.assert_allclose(flat["enc/mean"].value(), jnp.mean(jnp.tanh(x)))
    np.testing.assert_allclose(ctx.collection.flatten("module_outputs")["dec/y"], out)


def test_call_passes_child_context_with_derived_key() -> None:
    seen: list[Context] = []

    def f(x: int, ctx: Context, *, scale: int) -> tuple[int, Context]:
        seen.append(ctx)
        return x * scale, ctx

    root = Context.root(prng_key=jax.random.PRNGKey(0))
    out, _ = root.call("encoder", f, 2, scale=3)
    assert out == 6
    assert seen[0].path == ("root", "encoder")
    assert np.asarray(seen[0].prng_key).tolist() == ENCODER


def test_call_twice_raises_with_hint() -> None:
    ctx = Context.root()
    _, ctx = ctx.call("enc", lambda c: (None, c))
    with pytest.raises(OutputConflictError, match=r"'enc'.*scan_in_context"):
        ctx.call("enc", lambda c: (None, c))


def test_call_requires_context_returned() -> None:
    with pytest.raises(TypeError, match=r"Context.call\('enc', fn\)`: fn must return"):
        Context.root().call("enc", lambda x, c: x, 1)
    with pytest.raises(TypeError, match="must return"):
        Context.root().call("enc", lambda x, c: (x, 1), 1)  # pyright: ignore[reportArgumentType]


def test_call_bad_name() -> None:
    with pytest.raises(ValueError, match="invalid child name 'Enc'"):
        Context.root().call("Enc", lambda c: (None, c))
    with pytest.raises(ValueError, match="invalid child name"):
        Context.root().child("a/b")


def test_merge_conflict_names_context_and_prefix_hint() -> None:
    ctx = Context.root().add_summary("loss", 1.0)
    other = OutputCollection.empty().add_summary("loss", 2.0)
    with pytest.raises(OutputConflictError, match=r"'root'.*summaries/loss.*prefix"):
        ctx.merge(other)


def test_context_is_unchanged_by_operations() -> None:
    ctx = Context.root(prng_key=jax.random.PRNGKey(0))
    ctx.add_summary("a", 1.0)
    ctx.call("enc", mlp, jnp.ones(2))
    ctx.merge(OutputCollection.empty().add_summary("b", 1.0))
    assert ctx.collection.is_empty()
    assert ctx.collection.child_names() == set()


def loss_fn(w: jax.Array, x: jax.Array, with_summaries: bool) -> jax.Array:
    def f(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        y = jnp.tanh(x * w)
        if with_summaries:
            ctx = ctx.add_summary("y_mean", jnp.mean(y))
            ctx = ctx.add_module_output("y", y)
        return jnp.sum(y**2), ctx

    out, _ = functional(f, prng_key=None, is_training=True, args=(x,))
    return out


def test_grad_unaffected_by_summaries() -> None:
    w, x = jnp.asarray(0.3), jnp.linspace(-1, 1, 5)
    g1 = jax.grad(loss_fn)(w, x, True)
    g2 = jax.grad(loss_fn)(w, x, False)
    np.testing.assert_allclose(g1, g2, rtol=1e-6)
    assert float(g1) != 0.0


def test_grad_through_collection_outputs() -> None:
    def f(w: jax.Array) -> tuple[jax.Array, OutputCollection]:
        out, coll = functional(
            lambda c: (w**2, c.add_summary("w", w)), prng_key=None, is_training=False
        )
        return out, coll

    g, coll = jax.grad(f, has_aux=True)(jnp.asarray(3.0))
    assert float(g) == 6.0
    assert float(coll.flatten("summaries")["w"]) == 3.0


@pytest.mark.parametrize("jit", [jax.jit, eqx.filter_jit])
def test_context_through_jit_as_argument_and_result(jit: Callable[..., Any]) -> None:
    def f(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return model(x, ctx)

    ctx = Context.root(prng_key=jax.random.PRNGKey(0), is_training=True)
    ctx = ctx.add_summary("before", jnp.asarray(1.0))
    out, got = jit(f)(jnp.arange(3.0), ctx)
    want_out, want = f(jnp.arange(3.0), ctx)
    np.testing.assert_allclose(out, want_out)
    assert got.path == ("root",)
    assert got.is_training
    assert_collections_equal(got.collection, want.collection)
    np.testing.assert_array_equal(got.prng_key, ctx.prng_key)


def test_context_through_vmap() -> None:
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    xs = jnp.arange(12.0).reshape(4, 3)

    def f(x: jax.Array, key: jax.Array) -> tuple[jax.Array, Context]:
        return model(x, Context.root(prng_key=key).child("inner"))

    outs, ctxs = jax.vmap(f)(xs, keys)
    for i in range(4):
        want_out, want = f(xs[i], keys[i])
        np.testing.assert_allclose(outs[i], want_out)
        got = jax.tree_util.tree_map(lambda a, i=i: a[i], ctxs.collection)
        assert_collections_equal(got, want.collection)
        np.testing.assert_array_equal(ctxs.prng_key[i], want.prng_key)


def test_functional_drops_module_outputs_by_default() -> None:
    out, coll = functional(model, prng_key=None, is_training=False, args=(jnp.ones(2),))
    assert coll.flatten("module_outputs") == {}
    assert "loss" in coll.flatten("summaries")
    _, coll = functional(
        model,
        prng_key=None,
        is_training=False,
        args=(jnp.ones(2),),
        drop_output_collections=("summaries",),
    )
    assert coll.flatten("summaries") == {}
    assert set(coll.flatten("module_outputs")) == {"enc/y", "dec/y"}
    np.testing.assert_allclose(out, jnp.tanh(jnp.tanh(jnp.ones(2))))


def test_functional_passes_kwargs_and_key() -> None:
    kwargs = {"scale": 2.0}

    def f(x: float, ctx: Context, *, scale: float) -> tuple[float, Context]:
        assert ctx.is_training
        assert np.asarray(ctx.prng_key).tolist() == [0, 0]
        return x * scale, ctx

    out, _ = functional(
        f, prng_key=jax.random.PRNGKey(0), is_training=True, args=(3.0,), kwargs=kwargs
    )
    assert out == 6.0
    assert kwargs == {"scale": 2.0}


def test_functional_errors() -> None:
    with pytest.raises(ValueError, match="unknown kind 'metrics'"):
        functional(
            model, prng_key=None, is_training=False, drop_output_collections=["metrics"]
        )
    with pytest.raises(TypeError, match=r"`functional\(fn\)`: fn must return"):
        functional(lambda c: 1, prng_key=None, is_training=False)  # pyright: ignore[reportArgumentType]


def test_threads_get_their_own_summaries() -> None:
    """8 threads run `functional` at once; each gets exactly its own summaries."""
    n = 8
    barrier = threading.Barrier(n)
    results: dict[int, OutputCollection] = {}
    errors: list[BaseException] = []

    def f(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        barrier.wait(timeout=30)  # all threads are inside `functional` together
        out, ctx = model(x, ctx)
        ctx = ctx.add_summary("x", x)
        return out, ctx

    def run(i: int) -> None:
        try:
            _, coll = functional(
                f, prng_key=None, is_training=False, args=(jnp.full((2,), float(i)),)
            )
            results[i] = coll
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert sorted(results) == list(range(n))
    for i, coll in results.items():
        flat = coll.flatten("summaries")
        assert sorted(flat) == ["dec/mean", "enc/mean", "loss", "x"]
        np.testing.assert_array_equal(flat["x"], np.full((2,), float(i)))
        _, want = functional(
            model,
            prng_key=None,
            is_training=False,
            args=(jnp.full((2,), float(i)),),
        )
        np.testing.assert_allclose(flat["loss"], want.flatten("summaries")["loss"])


def test_a_function_must_return_the_context_it_was_handed() -> None:
    from eqxctx import functional, scan_in_context, vmap_in_context

    root = Context.root().add_summary("outer", 1.0)
    # Returning the parent's context would duplicate its outputs under the child.
    with pytest.raises(ValueError, match=r"returned the context at 'root'.*'root/enc'"):
        root.call("enc", lambda c: (None, root))
    with pytest.raises(ValueError, match=r"'root/enc/x'.*handed.*'root/enc'"):
        root.call("enc", lambda c: (None, c.child("x")))
    with pytest.raises(ValueError, match=r"`functional\(fn\)`.*'root/a'"):
        functional(lambda c: (None, c.child("a")), prng_key=None, is_training=False)
    with pytest.raises(ValueError, match=r"`scan_in_context`.*'root'.*'root/iter'"):
        scan_in_context(
            lambda c, x, ctx: (c, x, root), context=root, carry=0.0, xs=jnp.ones(2)
        )
    with pytest.raises(ValueError, match=r"`vmap_in_context`.*'root'.*'root/iter'"):
        vmap_in_context(lambda x, ctx: (x, root), context=root, xs=jnp.ones(2))
    # The context handed in, with outputs added, is accepted.
    out = root.call("enc", lambda c: (None, c.add_summary("y", 2.0)))[1]
    assert out.collection.flatten("summaries") == {"outer": 1.0, "enc/y": 2.0}


@pytest.mark.parametrize(
    "bad", [0, "key", np.zeros(3, np.uint32), np.zeros(2, np.float32)]
)
def test_keys_are_checked_where_they_enter(bad: Any) -> None:
    from eqxctx import functional

    # The suite's runtime type checks may refuse first (a `TypeError` too).
    with pytest.raises(TypeError, match="prng_key"):
        Context.root(prng_key=bad)
    with pytest.raises(TypeError, match="prng_key"):
        functional(lambda c: (None, c), prng_key=bad, is_training=False)
    # eqxctx's own message, without the suite's checks:
    with (
        unchecked(),
        pytest.raises(TypeError, match=r"`functional`: prng_key must be a raw key"),
    ):
        functional(lambda c: (None, c), prng_key=bad, is_training=False)


def test_is_training_and_root_names_are_checked() -> None:
    from eqxctx import functional

    for bad in ("no", 1, None):
        with pytest.raises(TypeError, match="is_training"):
            Context.root(is_training=bad)  # pyright: ignore[reportArgumentType]
        with pytest.raises(TypeError, match="is_training"):
            Context.root().child("a", is_training=bad)  # pyright: ignore[reportArgumentType]
        with pytest.raises(TypeError, match="is_training"):
            functional(lambda c: (None, c), prng_key=None, is_training=bad)  # pyright: ignore[reportArgumentType]
    assert Context.root(is_training=np.bool_(True)).is_training is True
    for name in (None, "Bad/Name!", ""):
        with pytest.raises((ValueError, TypeError), match="name"):
            Context.root(name=name)  # pyright: ignore[reportArgumentType]
    typed = Context.root(prng_key=jax.random.key(0)).child("a")
    assert jnp.issubdtype(typed.prng_key.dtype, jax.dtypes.prng_key)


# -- the padded step's row mask (issue 35 item 4: reachable from any context) -------


def test_row_mask_reaches_every_context_and_transformation() -> None:
    def look(ctx: Context) -> Context:
        assert ctx.row_mask is not None
        return ctx.add_summary("mask", ctx.row_mask.astype(jnp.int32))

    def layer(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        ctx = look(ctx)

        def body(c: jax.Array, x_i: jax.Array, ctx_i: Context) -> Any:
            return c + x_i, None, look(ctx_i)

        _, _, coll = eqxctx.scan_in_context(
            body, context=ctx, carry=jnp.float32(0), xs=jnp.arange(2.0)
        )
        ctx = ctx.merge(coll)
        _, coll = eqxctx.vmap_in_context(
            lambda x_i, c: (x_i, look(c)), context=ctx, xs=x, child_name_prefix="ex"
        )
        ctx = ctx.merge(coll)
        _, coll = eqxctx.cond_in_context(
            True, lambda c: (None, look(c)), lambda c: (None, look(c)), context=ctx
        )
        ctx = ctx.merge(coll)
        _, coll = eqxctx.fori_in_context(
            0, 2, lambda i, v, c: (v, look(c)), 0.0, context=ctx, child_name="loop"
        )
        ctx = ctx.merge(coll)
        # A transformation of a function taking the context rebuilds it.
        inner = jax.jit(lambda c: look(c.child("jit")).collection)(ctx)
        ctx = ctx.merge(OutputCollection.empty().add_child("jit", inner))
        return x, ctx

    @jax.jit
    def step(x: jax.Array, m: jax.Array) -> Any:
        root = Context.root(prng_key=jax.random.key(0), row_mask=m)
        _, ctx = root.call("layer", layer, x)
        ctx = look(ctx.child("other", prng_key=jax.random.key(1)))
        return root.call("layer", layer, x)[1].collection, ctx.collection

    coll, other = step(jnp.arange(3.0), jnp.asarray([True, True, False]))
    flat = coll.flatten("summaries") | other.flatten("summaries")
    assert sorted(flat) == [
        "layer/cond/mask",
        *[f"layer/ex{i}/mask" for i in range(3)],  # each example sees every row
        "layer/iter0/mask",
        "layer/iter1/mask",
        "layer/jit/mask",
        "layer/loop0/mask",
        "layer/loop1/mask",
        "layer/mask",
        "mask",  # the child made with its own key
    ]
    for path, value in flat.items():
        rows = np.asarray(value).reshape(-1, 3)
        np.testing.assert_array_equal(rows, [[1, 1, 0]] * len(rows), err_msg=path)
    # Outside a padded step there is none.
    plain = Context.root()
    assert plain.row_mask is None
    assert plain.child("a").row_mask is None
    assert plain.row_where(jnp.ones((3, 2))) is None


def test_row_where_broadcasts_over_the_other_axes() -> None:
    mask = np.array([True, False, True, False])
    ctx = Context.root(row_mask=mask).child("stats")
    x = np.arange(24, dtype=np.float32).reshape(4, 3, 2)
    where = ctx.row_where(x)
    assert where is not None
    assert where.shape == (4, 1, 1)
    stats = eqxctx.MomentsSummary(x, where=ctx.row_where(x)).value()
    real = x[mask]
    assert int(stats["count"]) == real.size
    np.testing.assert_allclose(float(stats["mean"]), real.mean())
    np.testing.assert_allclose(float(stats["variance"]), real.var(), rtol=1e-6)
    hist = eqxctx.HistogramSummary(x, where=ctx.row_where(x), bins=4, range=(0, 24))
    np.testing.assert_array_equal(
        np.asarray(hist.value()), np.histogram(real, bins=4, range=(0, 24))[0]
    )
    with pytest.raises(
        ValueError, match=r"row_where\(x\)` in context 'root/stats'.*\(3,\)"
    ):
        ctx.row_where(np.ones(3))
    with pytest.raises(ValueError, match=r"row_where.*shape \(\)"):
        ctx.row_where(np.float32(1))
    for bad in (np.ones(4), np.ones((4, 1), bool)):
        with pytest.raises(TypeError, match=r"`Context.root\(row_mask=...\)`"):
            Context.root(row_mask=bad)
    # The suite's runtime type checks refuse a list first (a `TypeError` too).
    with pytest.raises(TypeError, match="row_mask"):
        Context.root(row_mask=[True, False])  # pyright: ignore[reportArgumentType]
    with (
        unchecked(),
        pytest.raises(TypeError, match=r"`Context.root\(row_mask=...\)`.*got list"),
    ):
        Context.root(row_mask=[True, False])  # pyright: ignore[reportArgumentType]
    # Kept by a copy and a pickle round trip, and shown by repr.
    for c in (copy.deepcopy(ctx), pickle.loads(pickle.dumps(ctx))):
        np.testing.assert_array_equal(np.asarray(c.row_mask), mask)
    assert "row_mask=" in repr(ctx)
    assert "row_mask" not in repr(Context.root())


# From test_regressions.py: found by trying eqxctx as a new user would.
def test_call_forwards_kwargs_named_name_and_fn() -> None:
    def f(x: float, ctx: Context, *, name: str, fn: str) -> tuple[float, Context]:
        return x, ctx.add_summary(name, x).add_summary(fn, 2 * x)

    _, ctx = Context.root().call("blk", f, 1.0, name="b", fn="c")
    assert ctx.collection.flatten("summaries") == {"blk/b": 1.0, "blk/c": 2.0}


# From test_regressions.py: found by trying eqxctx as a new user would.
@pytest.mark.parametrize("name", ["abc\n", "it\n"])
def test_child_name_with_trailing_newline_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="invalid child name"):
        Context.root().child(name)
    with pytest.raises(ValueError, match="invalid child name"):
        scan_in_context(
            lambda c, x, ctx: (c, None, ctx),
            context=Context.root(),
            carry=jnp.float32(0),
            xs=jnp.ones(2),
            child_name_prefix=name,
        )


# From test_regressions.py: found by trying eqxctx as a new user would.
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


# From test_regressions.py (two threads reading keys and paths of versions of one
# context); issue 36 asks for eight threads on one base context.
def test_threads_extending_one_base_context_see_exactly_their_own_entries() -> None:
    n = 8
    base = Context.root(prng_key=jax.random.PRNGKey(0)).child("a")
    base = base.add_summary("shared", 0.0)
    barrier = threading.Barrier(n)
    results: dict[int, tuple[Any, ...]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            ctx = base
            for j in range(50):
                ctx = ctx.add_summary(f"t{i}_{j}", float(i))
            child = ctx.child(f"c{i}")
            _, ctx = ctx.call(f"c{i}", lambda c: (None, c.add_summary("k", 1.0)))
            results[i] = (
                ctx.collection.flatten("summaries"),
                child.path,
                np.asarray(child.prng_key),
                base.path,
                np.asarray(base.prng_key),
            )
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    base_key = key_of(jax.random.PRNGKey(0), ("a",))
    for i in range(n):
        flat, path, key, root_path, root_key = results[i]
        want = {"shared": 0.0, **{f"t{i}_{j}": float(i) for j in range(50)}}
        assert flat == {**want, f"c{i}/k": 1.0}
        assert path == ("root", "a", f"c{i}")
        np.testing.assert_array_equal(key, key_of(base_key, (f"c{i}",)))
        assert root_path == ("root", "a")
        np.testing.assert_array_equal(root_key, base_key)
    assert base.collection.flatten("summaries") == {"shared": 0.0}


# From test_host_cost.py (issue 36: tests mirror modules).
def test_lazy_keys_equal_eager_derivation() -> None:
    root = Context.root(prng_key=jax.random.PRNGKey(7))
    deep = root.child("a").child("b").child("c")
    want = jax.random.PRNGKey(7)
    for name in ("a", "b", "c"):
        want = jax.random.fold_in(want, child_seed(name))
    np.testing.assert_array_equal(deep.prng_key, want)
    # Flattened as a PyTree, the key is the derived one.
    leaves = jax.tree_util.tree_leaves(deep)
    np.testing.assert_array_equal(leaves[0], want)


def _layer_with_cond(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    def branch(x: jax.Array, c: Context) -> tuple[jax.Array, Context]:
        return x + jax.random.normal(c.prng_key, ()), c

    y, coll = cond_in_context(x > 0, branch, lambda x, c: (x, c), x, context=ctx)
    return y, ctx.merge(coll)


# From test_host_cost.py: found in a tester round.
def test_no_traced_key_outlives_its_trace_in_a_frame_made_before_it() -> None:
    # Frames made outside a trace (or under an outer one) and read inside it keep no
    # tracer of it: `jax.checking_leaks` finds nothing, in eqxctx's own branches too.
    key = jax.random.PRNGKey(0)
    outside = Context.root(prng_key=key).child("a").child("b")
    want = jax.random.normal(key_of(key, ("a", "b")), ())

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
    noise = jax.random.normal(key_of(key, ("layer", "cond")), ())
    np.testing.assert_allclose(out, 1.0 + noise, rtol=1e-6)


# From test_host_cost.py: found in a tester round.
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
    want = key_of(key, ("a", "b"))
    assert seen == [int(jax.random.randint(want, (), 1, 100))]
    np.testing.assert_allclose(out, 2 * jax.random.normal(want, ()), rtol=1e-6)


# From test_host_cost.py: found in a tester round.
def test_a_traced_key_is_reused_only_under_its_trace() -> None:
    key = jax.random.PRNGKey(5)
    want = [key_of(key, ("c0", "c1", "c2")[: i + 1]) for i in range(3)]
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
        jax.random.fold_in(want[2], child_seed("c3")),
    )


def _frame_fields(ctx: Context) -> list[object]:
    frame = ctx._frame  # pyright: ignore[reportPrivateUsage]
    return [getattr(frame, name) for name in type(frame).__slots__]


def test_reading_a_context_writes_nothing() -> None:
    # issue 36: a frame is never written after construction (no memo of paths or
    # keys, per trace or otherwise), so versions of a context shared between threads
    # and traces need no lock.
    key = jax.random.PRNGKey(0)
    seen: list[tuple[object, ...]] = []

    def leaf(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        before = _frame_fields(ctx)
        out = x + jax.random.normal(ctx.prng_key, x.shape)
        seen.append((ctx.path, ctx.prng_key))
        assert all(a is b for a, b in zip(before, _frame_fields(ctx), strict=True))
        return out, ctx

    def model(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return ctx.call("a", lambda x, c: c.call("b", leaf, x), x)

    def run(x: jax.Array) -> jax.Array:
        return functional(model, prng_key=key, is_training=False, args=(x,))[0]

    jax.jit(run)(jnp.zeros(2))
    run(jnp.zeros(2))
    outside = Context.root(prng_key=key).child("a").child("b")
    before = _frame_fields(outside)
    want = jax.random.fold_in(jax.random.fold_in(key, child_seed("a")), child_seed("b"))
    np.testing.assert_array_equal(outside.prng_key, want)
    assert outside.path == ("root", "a", "b")
    assert all(a is b for a, b in zip(before, _frame_fields(outside), strict=True))
    assert [p for p, _ in seen] == [("root", "a", "b")] * 2
    np.testing.assert_array_equal(seen[1][1], want)


def test_eight_threads_reading_one_base_contexts_children_see_their_own() -> None:
    # issue 36: eight threads building and reading children of one base context.
    base = Context.root(prng_key=jax.random.PRNGKey(0)).child("base")
    results: dict[int, tuple[tuple[str, ...], np.ndarray, dict[str, object]]] = {}

    def work(i: int) -> None:
        ctx = base.child(f"t{i}").add_summary(f"s{i}", float(i))
        ctx = ctx.child("deep").add_summary("x", float(i))
        results[i] = (
            ctx.path,
            np.asarray(ctx.prng_key),
            ctx.collection.flatten("summaries"),
        )

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(8):
        want = jax.random.PRNGKey(0)
        for name in ("base", f"t{i}", "deep"):
            want = jax.random.fold_in(want, child_seed(name))
        path, key, summaries = results[i]
        assert path == ("root", "base", f"t{i}", "deep")
        np.testing.assert_array_equal(key, want)
        assert summaries == {"x": float(i)}

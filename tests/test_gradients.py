"""Backward-pass summaries: add_gradient_summary / add_gradient_output, value_and_grad.

References are computed by hand: the loss is differentiated with respect to zero
perturbations added at every probed intermediate (`jax.vjp` of the loss with respect
to each intermediate), in a Python loop over the layers.
"""

import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eqxctx
from eqxctx import (
    Context,
    MaxSummary,
    MethodRunner,
    OutputConflictError,
    WeightedSummary,
    functional,
    scan_in_context,
    vmap_in_context,
)


_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+ = ", re.MULTILINE)


def hlo_instructions(fn: Any, *args: Any) -> int:
    """Count the instructions of the optimized HLO of `jax.jit(fn)(*args)`."""
    text = jax.jit(lambda *a: fn(*a)).lower(*args).compile().as_text()
    assert text is not None
    return len(_INSTRUCTION.findall(text))


def _rms(ct: Any) -> Any:
    return jnp.sqrt(jnp.mean(jnp.square(ct.astype(jnp.float32)), axis=(-2, -1)))


def _params(depth: int, width: int, seed: int, members: int = 0) -> Any:
    shape = (members, depth, width, width) if members else (depth, width, width)
    return jax.random.normal(jax.random.PRNGKey(seed), shape) / np.sqrt(width)


def _layers(ws: Any, x: Any, ctx: Context, **scan: Any) -> tuple[Any, Context]:
    """A residual MLP over the layers `ws[i]`, probing the stream entering each."""
    fn = scan.pop("fn", None)

    def body(h: Any, w: Any, ctx: Context) -> tuple[Any, None, Context]:
        h, ctx = ctx.add_gradient_summary("stream", h, fn)
        h, ctx = ctx.add_gradient_output("stream_ct", h)
        ctx = ctx.add_summary("fwd_mean", jnp.mean(h))
        return h + jnp.tanh(h @ w), None, ctx

    h, _, coll = scan_in_context(body, context=ctx, carry=x, xs=ws, **scan)
    return h, ctx.merge(coll)


def _loss(ws: Any, x: Any, ctx: Context, **scan: Any) -> tuple[Any, Context]:
    h, ctx = _layers(ws, x, ctx, **scan)
    return jnp.sum(jnp.sin(h)), ctx


def _reference_cts(ws: Any, x: Any, reverse: bool) -> Any:
    """d loss / d (stream entering layer i), `[depth, batch, width]`, in xs order."""

    def loss(perts: Any) -> Any:
        h = x
        order = range(len(ws))[::-1] if reverse else range(len(ws))
        for i in order:
            h = h + perts[i]
            h = h + jnp.tanh(h @ ws[i])
        return jnp.sum(jnp.sin(h))

    zeros = jnp.zeros((len(ws), *x.shape))
    _, vjp = jax.vjp(loss, zeros)
    return vjp(jnp.ones(()))[0]


@settings(max_examples=8, deadline=None)
@given(
    depth=st.integers(1, 5),
    batch=st.integers(1, 4),
    width=st.integers(1, 5),
    reverse=st.booleans(),
    remat=st.sampled_from(
        [None, {}, {"policy": jax.checkpoint_policies.nothing_saveable}]
    ),
    unroll=st.sampled_from([1, 2, True]),
    seed=st.integers(0, 2**16),
)
def test_per_iteration_equals_vjp_reference(
    depth: int,
    batch: int,
    width: int,
    reverse: bool,
    remat: Any,
    unroll: Any,
    seed: int,
) -> None:
    ws = _params(depth, width, seed)
    x = jax.random.normal(jax.random.PRNGKey(seed + 1), (batch, width))
    (loss, coll), grads = eqxctx.value_and_grad(_loss)(
        ws,
        x,
        prng_key=None,
        is_training=True,
        reverse=reverse,
        remat_kwargs=remat,
        unroll=unroll,
    )
    cts = _reference_cts(ws, x, reverse)
    flat = coll.flatten("summaries")
    assert sorted(flat) == sorted(
        [f"iter{i}/stream" for i in range(depth)]
        + [f"iter{i}/fwd_mean" for i in range(depth)]
    )
    got = np.array([flat[f"iter{i}/stream"] for i in range(depth)])
    np.testing.assert_allclose(got, _rms(cts), rtol=2e-5, atol=1e-6)
    stacked = coll.flatten("module_outputs")["iter/stream_ct"]
    assert stacked.shape == (depth, batch, width)
    np.testing.assert_allclose(stacked, cts, rtol=2e-5, atol=1e-6)
    ref_loss, ref_grads = jax.value_and_grad(
        lambda w: functional(
            _loss,
            prng_key=None,
            is_training=True,
            args=(w, x),
            kwargs={"reverse": reverse},
        )[0]
    )(ws)
    # float32 sums in another order: within a few ulp of the loss's scale.
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grads, ref_grads, rtol=1e-5, atol=1e-6)


@settings(max_examples=6, deadline=None)
@given(
    depth=st.integers(1, 5),
    reverse=st.booleans(),
    remat=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_merged_equals_vjp_reference(
    depth: int, reverse: bool, remat: bool, seed: int
) -> None:
    ws = _params(depth, 3, seed)
    x = jax.random.normal(jax.random.PRNGKey(seed + 1), (2, 3))
    rms = _rms(_reference_cts(ws, x, reverse))
    common = {
        "reverse": reverse,
        "merge_summaries": True,
        "remat_kwargs": {} if remat else None,
    }
    kinds = {
        None: (lambda s: s, rms.sum()),  # raw arrays add up (AXLearn's rule)
        "max": (lambda s: s.value(), rms.max()),
        "mean": (lambda s: s.value(), rms.mean()),
    }
    fns = {
        None: None,
        "max": lambda ct: MaxSummary(jnp.sqrt(jnp.mean(ct**2))),
        "mean": lambda ct: WeightedSummary(jnp.sqrt(jnp.mean(ct**2)), 1.0),
    }
    for name, (read, want) in kinds.items():
        (_, coll), _ = eqxctx.value_and_grad(_loss)(
            ws, x, prng_key=None, is_training=False, fn=fns[name], **common
        )
        flat = coll.flatten("summaries")
        assert sorted(flat) == ["iter/fwd_mean", "iter/stream"]
        np.testing.assert_allclose(read(flat["iter/stream"]), want, rtol=2e-5)
        cts = coll.flatten("module_outputs")["iter/stream_ct"]
        np.testing.assert_allclose(
            cts, _reference_cts(ws, x, reverse), rtol=2e-5, atol=1e-6
        )


@settings(max_examples=6, deadline=None)
@given(
    members=st.integers(1, 3),
    depth=st.integers(1, 4),
    merged=st.sampled_from(["none", "vmap", "scan"]),
    seed=st.integers(0, 2**16),
)
def test_nested_scan_inside_vmap(
    members: int, depth: int, merged: str, seed: int
) -> None:
    ws = _params(depth, 3, seed, members=members)
    x = jax.random.normal(jax.random.PRNGKey(seed + 1), (2, 3))

    def loss(ws: Any, ctx: Context) -> tuple[Any, Context]:
        def member(w: Any, ctx: Context) -> tuple[Any, Context]:
            return _layers(w, x, ctx, merge_summaries=merged == "scan", fn=fn)

        hs, coll = vmap_in_context(
            member, context=ctx, xs=ws, merge_summaries=merged == "vmap"
        )
        return jnp.sum(jnp.sin(hs)), ctx.merge(coll)

    fn = lambda ct: WeightedSummary(jnp.sqrt(jnp.mean(ct**2)), 1.0)
    (_, coll), _ = jax.jit(
        eqxctx.value_and_grad(loss), static_argnames=("is_training",)
    )(ws, prng_key=None, is_training=True)
    rms = np.array([_rms(_reference_cts(ws[e], x, False)) for e in range(members)])
    flat = coll.flatten("summaries")
    if merged == "none":
        got = [
            [flat[f"iter{e}/iter{i}/stream"].value() for i in range(depth)]
            for e in range(members)
        ]
        np.testing.assert_allclose(got, rms, rtol=2e-5)
    elif merged == "vmap":
        got = [flat[f"iter/iter{i}/stream"].value() for i in range(depth)]
        np.testing.assert_allclose(got, rms.mean(0), rtol=2e-5)
    else:
        got = [flat[f"iter{e}/iter/stream"].value() for e in range(members)]
        np.testing.assert_allclose(got, rms.mean(1), rtol=2e-5)
    cts = coll.flatten("module_outputs")["iter/iter/stream_ct"]
    assert cts.shape == (members, depth, 2, 3)


def test_nested_scans_and_calls() -> None:
    ws = _params(6, 3, 0).reshape(2, 3, 3, 3)
    x = jnp.ones((2, 3))

    def loss(ws: Any, ctx: Context) -> tuple[Any, Context]:
        def outer(h: Any, w: Any, ctx: Context) -> tuple[Any, None, Context]:
            h, ctx = ctx.call("block", _layers, w, h, child_name_prefix="layer")
            return h, None, ctx

        h, _, coll = scan_in_context(outer, context=ctx, carry=x, xs=ws)
        return jnp.sum(jnp.sin(h)), ctx.merge(coll)

    (_, coll), _ = eqx.filter_jit(eqxctx.value_and_grad(loss))(
        ws, prng_key=None, is_training=True
    )
    rms = _rms(_reference_cts(ws.reshape(6, 3, 3), x, False))
    flat = coll.flatten("summaries")
    got = [flat[f"iter{i // 3}/block/layer{i % 3}/stream"] for i in range(6)]
    np.testing.assert_allclose(got, rms, rtol=2e-5)


def _model_loss(model: Any, x: Any, ctx: Context) -> tuple[Any, Context]:
    h, ctx = ctx.add_gradient_summary("input", x @ model.w_in)
    h, ctx = _layers(model.ws, h, ctx)
    return jnp.mean((h - model.scale) ** 2), ctx


class _Model(eqx.Module):
    w_in: Any
    ws: Any
    scale: Any
    name: str = "mlp"  # a non-array leaf: no gradient
    steps: Any = eqx.field(default_factory=lambda: jnp.array(3))  # an int leaf


def _make_model() -> _Model:
    k1, k2 = jax.random.split(jax.random.PRNGKey(5))
    return _Model(
        jax.random.normal(k1, (4, 3)), _params(3, 3, 7), jax.random.normal(k2, ())
    )


def test_grads_equal_filter_value_and_grad_exactly() -> None:
    model, x = _make_model(), jnp.ones((2, 4))

    def plain(model: Any, x: Any) -> Any:
        return functional(
            _model_loss, prng_key=None, is_training=True, args=(model, x)
        )[0]

    for jit in (lambda f: f, eqx.filter_jit):
        want_loss, want = jit(eqx.filter_value_and_grad(plain))(model, x)
        (loss, coll), got = jit(eqxctx.value_and_grad(_model_loss))(
            model, x, prng_key=None, is_training=True
        )
        assert bool(eqx.tree_equal(got, want))
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
        assert got.steps is None
        assert got.name is None
        assert float(loss) == float(want_loss)
        assert "input" in coll.flatten("summaries")

    # Without probes: the same program as `eqx.filter_value_and_grad`'s.
    def bare(model: Any, x: Any, ctx: Context) -> tuple[Any, Context]:
        return jnp.mean((x @ model.w_in) ** 2), ctx

    (loss, coll), got = eqxctx.value_and_grad(bare)(
        model, x, prng_key=None, is_training=False
    )
    want_loss, want = eqx.filter_value_and_grad(
        lambda m, x: jnp.mean((x @ m.w_in) ** 2)
    )(model, x)
    assert bool(eqx.tree_equal(got, want) and float(loss) == float(want_loss))
    assert coll.is_empty()


def test_argnums_tuple_and_second_position() -> None:
    model, x = _make_model(), jnp.ones((2, 4))
    (_, _), (gm, gx) = eqxctx.value_and_grad(_model_loss, argnums=(0, 1))(
        model, x, prng_key=None, is_training=True
    )
    (_, _), gx2 = eqxctx.value_and_grad(_model_loss, argnums=1)(
        model, x, prng_key=None, is_training=True
    )
    assert gx.shape == x.shape
    assert eqx.tree_equal(gx, gx2)
    assert gm.w_in.shape == model.w_in.shape


def test_optax_training_step() -> None:
    optax = pytest.importorskip("optax")
    model, x = _make_model(), jnp.ones((2, 4))
    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model: Any, state: Any, key: Any) -> Any:
        (loss, coll), grads = eqxctx.value_and_grad(_model_loss)(
            model, x, prng_key=key, is_training=True
        )
        updates, state = opt.update(
            grads, state, eqx.filter(model, eqx.is_inexact_array)
        )
        return eqx.apply_updates(model, updates), state, loss, coll

    @eqx.filter_jit
    def plain_step(model: Any, state: Any) -> Any:
        loss, grads = eqx.filter_value_and_grad(
            lambda m: functional(
                _model_loss, prng_key=None, is_training=True, args=(m, x)
            )[0]
        )(model)
        updates, state = opt.update(
            grads, state, eqx.filter(model, eqx.is_inexact_array)
        )
        return eqx.apply_updates(model, updates), state, loss

    m1, s1, m2, s2 = model, state, model, state
    for i in range(3):
        with jax.numpy_dtype_promotion("standard"):  # optax mixes int32 and float
            m1, s1, loss, coll = step(m1, s1, jax.random.PRNGKey(i))
            m2, s2, loss2 = plain_step(m2, s2)
        assert float(loss) == float(loss2)
        assert sorted(k for k in coll.flatten("summaries") if "stream" in k) == [
            f"iter{j}/stream" for j in range(3)
        ]
    assert bool(eqx.tree_equal(m1, m2))


def test_method_runner_method() -> None:
    model, x = _make_model(), np.ones((8, 4), np.float32)

    def train_step(model: Any, batch: Any, ctx: Context) -> tuple[Any, Context]:
        (loss, coll), grads = eqxctx.value_and_grad(_model_loss)(
            model, batch["x"], prng_key=ctx.prng_key, is_training=True
        )
        ctx = ctx.merge(coll)
        return {"loss": loss, "g": grads.w_in}, ctx

    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    runner = MethodRunner.create(
        model,
        train_step,
        mesh=mesh,
        prng_key=jax.random.PRNGKey(0),
        output_partition=eqxctx.DataPartition.REPLICATED,
    )
    _, out = runner({"x": x})
    (_, coll), grads = eqxctx.value_and_grad(_model_loss)(
        model, jnp.asarray(x), prng_key=None, is_training=True
    )
    want = coll.flatten("summaries")
    got = out.summaries
    flat = eqxctx.OutputCollection(got, {}, {}).flatten("summaries")
    for i in range(3):
        np.testing.assert_allclose(
            flat[f"iter{i}/stream"], want[f"iter{i}/stream"], rtol=1e-6
        )
    np.testing.assert_allclose(out.output_batch["g"], grads.w_in, rtol=1e-6)


def test_identity_and_no_cost_without_value_and_grad() -> None:
    ws, x = _params(4, 8, 0), jnp.ones((2, 8))

    def probed(ws: Any, x: Any, ctx: Context) -> tuple[Any, Context]:
        return _loss(ws, x, ctx)

    def unprobed(ws: Any, x: Any, ctx: Context) -> tuple[Any, Context]:
        def body(h: Any, w: Any, ctx: Context) -> tuple[Any, None, Context]:
            ctx = ctx.add_summary("fwd_mean", jnp.mean(h))
            return h + jnp.tanh(h @ w), None, ctx

        h, _, coll = scan_in_context(body, context=ctx, carry=x, xs=ws)
        return jnp.sum(jnp.sin(h)), ctx.merge(coll)

    def run(f: Any) -> Any:
        return lambda ws, x: functional(
            f, prng_key=None, is_training=True, args=(ws, x)
        )

    out, coll = run(probed)(ws, x)
    out2, coll2 = run(unprobed)(ws, x)
    assert float(out) == float(out2)
    assert coll.flatten("summaries").keys() == coll2.flatten("summaries").keys()
    assert coll.flatten("module_outputs") == {}
    assert hlo_instructions(run(probed), ws, x) == hlo_instructions(
        run(unprobed), ws, x
    )
    grad = lambda f: eqx.filter_grad(lambda ws, x: run(f)(ws, x)[0])
    assert hlo_instructions(grad(probed), ws, x) == hlo_instructions(
        grad(unprobed), ws, x
    )
    # The very same object comes back, with the very same context.
    ctx = Context.root()
    h, ctx2 = ctx.add_gradient_summary("h", x)
    assert h is x
    assert ctx2 is ctx


def test_no_probe_program_equals_filter_value_and_grad() -> None:
    ws, x = _params(4, 8, 0), jnp.ones((2, 8))

    def bare(ws: Any, x: Any, ctx: Context) -> tuple[Any, Context]:
        return jnp.sum(jnp.sin(jnp.tanh(x @ ws[0]))), ctx

    ours = lambda ws, x: eqxctx.value_and_grad(bare)(
        ws, x, prng_key=None, is_training=False
    )
    theirs = eqx.filter_value_and_grad(
        lambda ws, x: jnp.sum(jnp.sin(jnp.tanh(x @ ws[0])))
    )
    assert hlo_instructions(ours, ws, x) == hlo_instructions(theirs, ws, x)


def test_integer_and_summary_outputs() -> None:
    x = jnp.array([1.0, -2.0, 3.0])

    def loss(x: Any, ctx: Context) -> tuple[Any, Context]:
        h, ctx = ctx.add_gradient_summary(
            "positive", x, lambda ct: jnp.sum(ct > 0).astype(jnp.int32)
        )
        h, ctx = ctx.add_gradient_summary("big", h, lambda ct: jnp.any(ct > 5))
        h, ctx = ctx.add_gradient_summary(
            "mean", h, lambda ct: WeightedSummary(jnp.mean(ct), ct.size)
        )
        return jnp.sum(h * jnp.array([1.0, -1.0, 7.0])), ctx

    (_, coll), _ = eqxctx.value_and_grad(loss)(x, prng_key=None, is_training=True)
    flat = coll.flatten("summaries")
    assert flat["positive"].dtype == jnp.int32
    assert int(flat["positive"]) == 2
    assert flat["big"].dtype == jnp.bool_
    assert bool(flat["big"])
    assert isinstance(flat["mean"], WeightedSummary)
    np.testing.assert_allclose(flat["mean"].value(), 7.0 / 3)
    assert int(flat["mean"].weight) == 3


def test_name_conflicts_name_the_path() -> None:
    x = jnp.ones(3)

    def forward_first(x: Any, ctx: Context) -> tuple[Any, Context]:
        def inner(x: Any, ctx: Context) -> tuple[Any, Context]:
            ctx = ctx.add_summary("h", jnp.sum(x))
            return ctx.add_gradient_summary("h", x)

        h, ctx = ctx.call("layer", inner, x)
        return jnp.sum(h), ctx

    with pytest.raises(OutputConflictError, match=r"'root/layer/h'.*already has"):
        eqxctx.value_and_grad(forward_first)(x, prng_key=None, is_training=True)

    def gradient_first(x: Any, ctx: Context) -> tuple[Any, Context]:
        h, ctx = ctx.add_gradient_summary("h", x)
        return jnp.sum(h), ctx.add_summary("h", jnp.sum(x))

    with pytest.raises(OutputConflictError, match=r"summaries/h"):
        eqxctx.value_and_grad(gradient_first)(x, prng_key=None, is_training=True)

    def twice(x: Any, ctx: Context) -> tuple[Any, Context]:
        h, ctx = ctx.add_gradient_output("h", x)
        h, ctx = ctx.add_gradient_output("h", h)
        return jnp.sum(h), ctx

    with pytest.raises(OutputConflictError, match=r"'root/h'"):
        eqxctx.value_and_grad(twice)(x, prng_key=None, is_training=True)

    # A gradient summary and a gradient output may share a name (two kinds).
    def both(x: Any, ctx: Context) -> tuple[Any, Context]:
        h, ctx = ctx.add_gradient_output("h", x)
        h, ctx = ctx.add_gradient_summary("h", h)
        return jnp.sum(h), ctx

    (_, coll), _ = eqxctx.value_and_grad(both)(x, prng_key=None, is_training=True)
    np.testing.assert_allclose(coll.flatten("module_outputs")["h"], jnp.ones(3))


def test_drawing_from_a_missing_key_names_the_root_and_the_fix() -> None:
    # Issue 35 item 10: JAX's "unexpected PRNG key type <class 'NoneType'>" named
    # neither the context nor how to pass a key.
    def loss(w: Any, ctx: Context) -> tuple[Any, Context]:
        return jnp.sum(w * jax.random.uniform(ctx.prng_key, w.shape)), ctx

    with pytest.raises(TypeError, match="unexpected PRNG key type") as info:
        eqxctx.value_and_grad(loss)(jnp.ones(3), prng_key=None, is_training=True)
    notes = [n for n in info.value.__notes__ if "PRNG key" in n]
    assert len(notes) == 1, info.value.__notes__
    assert notes[0].startswith("`eqxctx.value_and_grad(fn)`: the context at 'root'")
    assert "value_and_grad(fn)(..., prng_key=jax.random.key(0)" in notes[0]
    # With a key it runs.
    (_, _), g = eqxctx.value_and_grad(loss)(
        jnp.ones(3), prng_key=jax.random.key(0), is_training=True
    )
    assert g.shape == (3,)


def test_errors_name_the_path() -> None:
    x = jnp.ones(3)

    def probe(value: Any, fn: Any = None) -> Any:
        def loss(x: Any, ctx: Context) -> tuple[Any, Context]:
            def inner(x: Any, ctx: Context) -> tuple[Any, Context]:
                return ctx.add_gradient_summary("g", value(x), fn)

            h, ctx = ctx.call("layer", inner, x)
            return jnp.sum(h.astype(jnp.float32)), ctx

        return eqxctx.value_and_grad(loss)(x, prng_key=None, is_training=True)

    with pytest.raises(TypeError, match=r"'root/layer/g'.*returned tuple"):
        probe(lambda x: x, lambda ct: (ct, ct))
    with pytest.raises(TypeError, match=r"'root/layer/g'.*returned str"):
        probe(lambda x: x, lambda ct: "rms")
    with pytest.raises(TypeError, match=r"'root/layer/g'.*dtype int32"):
        probe(lambda x: x.astype(jnp.int32))
    with pytest.raises(TypeError, match=r"'root/layer/g'.*got list"):
        probe(lambda x: [x])
    with pytest.raises(TypeError, match=r"'root/layer/g'.*fn must be callable"):
        probe(lambda x: x, 3)
    # Not under value_and_grad, bad input still raises.
    with pytest.raises(TypeError, match=r"'root/g'.*dtype int32"):
        Context.root().add_gradient_summary("g", jnp.arange(3))
    with pytest.raises(ValueError, match="invalid name"):
        Context.root().add_gradient_output("a/b", x)

    def vector_loss(x: Any, ctx: Context) -> tuple[Any, Context]:
        return x * 2, ctx

    with pytest.raises(
        ValueError, match=r"scalar loss \(shape \(\)\), got shape \(3,\)"
    ):
        eqxctx.value_and_grad(vector_loss)(x, prng_key=None, is_training=True)

    def int_loss(x: Any, ctx: Context) -> tuple[Any, Context]:
        return jnp.sum(x).astype(jnp.int32), ctx

    with pytest.raises(TypeError, match="floating-point loss, got dtype int32"):
        eqxctx.value_and_grad(int_loss)(x, prng_key=None, is_training=True)

    def no_ctx(x: Any, ctx: Context) -> Any:
        return jnp.sum(x)

    with pytest.raises(TypeError, match=r"must return `\(output, ctx\)`"):
        eqxctx.value_and_grad(no_ctx)(x, prng_key=None, is_training=True)
    with pytest.raises(TypeError, match="argnums"):
        eqxctx.value_and_grad(vector_loss, argnums="0")  # pyright: ignore[reportArgumentType, reportCallIssue]
    with pytest.raises(ValueError, match="out of range"):
        eqxctx.value_and_grad(vector_loss, argnums=2)(
            x, prng_key=None, is_training=True
        )

    def two(p: Any, q: Any, ctx: Context) -> tuple[Any, Context]:
        return jnp.sum(p**2) + jnp.sum(q), ctx

    for argnums in ((0, -2), (1, 1)):
        with pytest.raises(ValueError, match=r"name one positional argument twice"):
            eqxctx.value_and_grad(two, argnums=argnums)(
                x, x, prng_key=None, is_training=True
            )
    _, (gp, gq) = eqxctx.value_and_grad(two, argnums=(-1, 0))(
        x, x, prng_key=None, is_training=True
    )
    np.testing.assert_allclose(gp, np.ones(3))  # d/dq first, as argnums asks
    np.testing.assert_allclose(gq, 2 * np.asarray(x))
    with pytest.raises(TypeError, match="is_training must be a bool"):
        eqxctx.value_and_grad(vector_loss)(x, prng_key=None, is_training=1)


def test_pending_value_cannot_be_read_inside() -> None:
    def loss(x: Any, ctx: Context) -> tuple[Any, Context]:
        h, ctx = ctx.add_gradient_summary("g", x)
        ctx.collection.flatten("summaries")["g"].value()
        return jnp.sum(h), ctx

    with pytest.raises(TypeError, match=r"'root/g' is filled in by"):
        eqxctx.value_and_grad(loss)(jnp.ones(2), prng_key=None, is_training=True)


_READS: dict[str, Any] = {
    "g + 1": lambda g: g + 1.0,
    "1 + g": lambda g: 1.0 + g,
    "g * array": lambda g: g * jnp.ones(2),
    "array - g": lambda g: jnp.ones(2) - g,
    "-g": lambda g: -g,
    "g ** 2": lambda g: g**2,
    "g > 0": lambda g: g > 0,
    "jnp.asarray": lambda g: jnp.asarray(g),
    "jnp.sum": lambda g: jnp.sum(g),
    "jnp.tanh": lambda g: jnp.tanh(g),
    "np.asarray": lambda g: np.asarray(g),
    "float": lambda g: float(g),
    "g[0]": lambda g: g[0],
}


@pytest.mark.parametrize("read", _READS.values(), ids=_READS.keys())
def test_pending_value_read_by_arithmetic_or_asarray_names_the_probe(
    read: Any,
) -> None:
    # issue 35 item 11: arithmetic and `jnp.asarray` on the placeholder gave JAX's
    # (or Python's) messages.
    def loss(x: Any, ctx: Context) -> tuple[Any, Context]:
        h, ctx = ctx.add_gradient_summary("g", x)
        read(ctx.collection.flatten("summaries")["g"])
        return jnp.sum(h), ctx

    with pytest.raises(TypeError, match=r"'root/g' is filled in by") as info:
        eqxctx.value_and_grad(loss)(jnp.ones(2), prng_key=None, is_training=True)
    assert "PendingGradient" not in str(info.value)


def test_probe_under_plain_jax_vmap_is_refused() -> None:
    def loss(xs: Any, ctx: Context) -> tuple[Any, Context]:
        def one(x: Any, ctx: Context) -> tuple[Any, Context]:
            h, ctx = ctx.add_gradient_summary("g", x)
            return jnp.sum(h), ctx

        out, ctx = jax.vmap(one, in_axes=(0, None), out_axes=(0, 0))(xs, ctx)
        return jnp.sum(out), ctx

    with pytest.raises((ValueError, TypeError)):
        eqxctx.value_and_grad(loss)(jnp.ones((2, 3)), prng_key=None, is_training=True)


def test_context_flattens_with_its_sinks() -> None:
    # A context passed through `jax.checkpoint` keeps its probes live.
    x = jnp.arange(3.0)

    def loss(x: Any, ctx: Context) -> tuple[Any, Context]:
        def layer(x: Any, ctx: Context) -> tuple[Any, Context]:
            h, ctx = ctx.add_gradient_output("h", x)
            return jnp.sin(h), ctx

        h, ctx = jax.checkpoint(layer)(x, ctx)
        return jnp.sum(h * 2), ctx

    (_, coll), _ = eqxctx.value_and_grad(loss)(x, prng_key=None, is_training=True)
    np.testing.assert_allclose(coll.flatten("module_outputs")["h"], 2 * jnp.cos(x))
    # Without value_and_grad the context's leaves are its key and collection only.
    assert (
        len(jax.tree_util.tree_leaves(Context.root(prng_key=jax.random.PRNGKey(0))))
        == 1
    )


def test_inside_cond_in_context_branches() -> None:
    def loss(x: Any, ctx: Context) -> tuple[Any, Context]:
        def branch(scale: float) -> Any:
            def fn(x: Any, ctx: Context) -> tuple[Any, Context]:
                h, ctx = ctx.add_gradient_summary("g", x, lambda ct: jnp.mean(ct))
                return h * scale, ctx

            return fn

        out, coll = eqxctx.cond_in_context(
            x[0] > 0, branch(2.0), branch(3.0), x, context=ctx
        )
        return jnp.sum(out), ctx.merge(coll)

    for value, want in ((1.0, 2.0), (-1.0, 3.0)):
        (_, coll), grads = eqxctx.value_and_grad(loss)(
            jnp.full(4, value), prng_key=None, is_training=True
        )
        assert float(coll.flatten("summaries")["cond/g"]) == want
        np.testing.assert_array_equal(grads, jnp.full(4, want))


def test_probe_in_one_branch_only_names_the_probe() -> None:
    def loss(x: Any, ctx: Context) -> tuple[Any, Context]:
        def probed(x: Any, c: Context) -> tuple[Any, Context]:
            return c.add_gradient_summary("g", x)

        y, coll = eqxctx.cond_in_context(
            True, probed, lambda x, c: (x, c), x, context=ctx
        )
        return jnp.sum(y), ctx.merge(coll)

    with pytest.raises(ValueError, match="gradient probe") as info:
        eqxctx.value_and_grad(loss)(jnp.ones(2), prng_key=None, is_training=True)
    message = str(info.value)
    assert re.search(
        r"a gradient probe \(add_gradient_summary/add_gradient_output\) at "
        r"'root/cond/g' is added in true_fn but not in false_fn.*every branch",
        message,
    ), message
    assert "PendingGradient" not in message

    def shaped(x: Any, ctx: Context) -> tuple[Any, Context]:
        y, coll = eqxctx.cond_in_context(
            True,
            lambda x, c: c.add_gradient_summary("g", x, lambda ct: ct),
            lambda x, c: c.add_gradient_summary("g", x, lambda ct: ct[0]),
            x,
            context=ctx,
        )
        return jnp.sum(y), ctx.merge(coll)

    with pytest.raises(ValueError, match="differs between branches") as info:
        eqxctx.value_and_grad(shaped)(jnp.ones(2), prng_key=None, is_training=True)
    message = str(info.value)
    assert (
        "false_fn: gradient probe(float32[]); true_fn: gradient probe(float32[2])"
        in (message)
    ), message
    assert "PendingGradient" not in message


def _fori_loss(bound: Any) -> Any:
    """`sum(h_n)` with `h_{k+1} = tanh(2 h_k)`, probing each `h_k`."""

    def body(i: Any, h: Any, ctx: Context) -> tuple[Any, Context]:
        h, ctx = ctx.add_gradient_summary("g", h)
        return jnp.tanh(h * 2.0), ctx

    def loss(x: Any, ctx: Context) -> tuple[Any, Context]:
        h, coll = eqxctx.fori_in_context(0, bound(x), body, x, context=ctx)
        return jnp.sum(h), ctx.merge(coll)

    return loss


def _fori_reference(x: Any, n: int) -> tuple[Any, list[Any]]:
    """The gradient and the probes' RMS cotangents, by `jax.vjp` in a Python loop."""
    hs = [x]
    for _ in range(n):
        hs.append(jnp.tanh(hs[-1] * 2.0))
    ct = jnp.ones_like(x)  # d sum(h_n) / d h_n
    rms = [jnp.zeros(())] * n
    for k in reversed(range(n)):
        _, vjp = jax.vjp(lambda h: jnp.tanh(h * 2.0), hs[k])
        (ct,) = vjp(ct)
        rms[k] = jnp.sqrt(jnp.mean(ct**2))
    return ct, rms


@pytest.mark.parametrize("jit", [False, True])
def test_fori_with_concrete_bounds_probes_equal_reference(jit: bool) -> None:
    x = jnp.array([0.1, -0.3, 0.2])
    want_grad, want_rms = _fori_reference(x, 2)
    # A Python int, and a concrete JAX integer from outside the function: a scan.
    n = jnp.int32(2)
    for bound in (lambda x: 2, lambda x: n):
        run = eqxctx.value_and_grad(_fori_loss(bound))
        if jit:
            run = eqx.filter_jit(run)
        (_, coll), grad = run(x, prng_key=None, is_training=True)
        flat = coll.flatten("summaries")
        np.testing.assert_allclose(grad, want_grad, rtol=1e-6)
        for k in range(2):
            np.testing.assert_allclose(flat[f"iter{k}/g"], want_rms[k], rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_probe_in_a_loop_with_traced_bounds_is_refused(jit: bool) -> None:
    # A data-dependent trip count is traced in value_and_grad's abstract first pass
    # (and under jit): the loop is a `jax.lax.while_loop`, which JAX cannot
    # differentiate in reverse mode. Eagerly the second pass used to see it concrete
    # (a scan) and crash inside `jax.lax.scan` with an IndexError.
    run = eqxctx.value_and_grad(_fori_loss(lambda x: jnp.sum(x > 0)))
    if jit:
        run = eqx.filter_jit(run)
    with pytest.raises(
        ValueError,
        match=r"`fori_in_context`: the body adds a gradient probe "
        r"\(add_gradient_summary/add_gradient_output\) at 'root/iter/g', but its "
        r"bounds are traced.*Python-int bounds",
    ):
        run(jnp.array([0.1, -0.3]), prng_key=None, is_training=True)

    def while_loss(x: Any, ctx: Context) -> tuple[Any, Context]:
        def body(h: Any, c: Context) -> tuple[Any, Context]:
            h, c = c.add_gradient_summary("g", h)
            return h * 0.5, c

        h, coll = eqxctx.while_in_context(
            lambda h: jnp.sum(h) > 0.1, body, x, context=ctx
        )
        return jnp.sum(h), ctx.merge(coll)

    with pytest.raises(
        ValueError,
        match=r"`while_in_context`: the body adds a gradient probe .* at "
        r"'root/while/g', but JAX cannot differentiate a `jax.lax.while_loop`",
    ):
        eqxctx.value_and_grad(while_loss)(jnp.ones(2), prng_key=None, is_training=True)


def test_fori_data_dependent_bounds_without_probes_equal_jax_grad() -> None:
    # No probes: eagerly the bound is concrete in the differentiated pass, a scan, as
    # for `jax.lax.fori_loop` under `jax.grad`.
    def body(i: Any, h: Any, ctx: Context) -> tuple[Any, Context]:
        return jnp.tanh(h * 2.0), ctx.add_summary("m", WeightedSummary(h[0], 1.0))

    def loss(x: Any, ctx: Context) -> tuple[Any, Context]:
        h, coll = eqxctx.fori_in_context(0, jnp.sum(x > 0), body, x, context=ctx)
        return jnp.sum(h), ctx.merge(coll)

    x = jnp.array([0.1, -0.3, 0.4])
    (value, coll), grad = eqxctx.value_and_grad(loss)(
        x, prng_key=None, is_training=True
    )

    def plain(x: Any) -> Any:
        return jnp.sum(
            jax.lax.fori_loop(0, jnp.sum(x > 0), lambda i, h: jnp.tanh(h * 2.0), x)
        )

    np.testing.assert_allclose(value, plain(x), rtol=1e-6)
    np.testing.assert_allclose(grad, jax.grad(plain)(x), rtol=1e-6)
    assert sorted(coll.flatten("summaries")) == ["iter0/m", "iter1/m"]


# Found by a new-user review: a probe's integer outputs (a MomentsSummary's count
# words) went through a float32 sink and lost their low bits above 2**24.
@pytest.mark.parametrize(
    ("dtype", "value"),
    [(jnp.uint32, 2**32 - 3), (jnp.uint32, 2**24 + 3), (jnp.int32, -(2**31) + 5)],
)
def test_integer_probe_outputs_are_exact_past_2_24(dtype: Any, value: int) -> None:
    want = np.asarray(value, dtype) + np.arange(3, dtype=dtype)

    def body(
        c: jax.Array, x: jax.Array, ctx: eqxctx.Context
    ) -> tuple[jax.Array, None, eqxctx.Context]:
        def fn(ct: jax.Array) -> jax.Array:
            return jnp.asarray(want) + 0 * ct[:3].astype(dtype)

        h, ctx = ctx.add_gradient_summary("n", c * x, fn)
        return h, None, ctx

    def loss(w: jax.Array, ctx: eqxctx.Context) -> tuple[jax.Array, eqxctx.Context]:
        h, _, coll = eqxctx.scan_in_context(
            body, context=ctx, carry=w, xs=jnp.ones((2, 3))
        )
        return jnp.sum(h), ctx.merge(coll)

    (_, coll), _ = jax.jit(
        lambda w: eqxctx.value_and_grad(loss)(w, prng_key=None, is_training=True)
    )(jnp.ones(3))
    for i in range(2):
        got = coll.flatten("summaries")[f"iter{i}/n"]
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got), want)

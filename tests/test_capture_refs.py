"""capture's ref path (`_capture/_refs.py`): where it records, and where it does not.

Issue 38 (jax.ref): `capture` records forward values through `jax.ref` writes inside
the user's scan where its rule allows, and through sink cotangents elsewhere. Each
test here answers one of the issue's open questions: (a) a JAX without
`jax.new_ref`, (b) a `jax.vmap` inside fn, (c) `jax.checkpoint`, (d) gradients.
`tests/test_capture.py` runs the capture tests on both paths.
"""

import inspect
import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.ref
import numpy as np
import pytest

import eqxctx
from capture_models import GPT, gpt_reference, rms
from eqxctx import Tap, capture
from eqxctx._capture._session import Session


KEY = jax.random.key(0)
TOKENS = jnp.arange(5) % 11
# Recording points that run in the model's scan, under no `jax.vmap`.
TAP = Tap(["blocks", "blocks.attn"], output=True, summaries={"rms": rms})


def close(a: object, b: object, rtol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-5)


def _forward(m: Any, x: jax.Array) -> jax.Array:
    return m(x)


def _gpt() -> GPT:
    return GPT(11, 8, 2, 3, key=KEY)


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths the captures of a test took, in order ("refs" or "sinks")."""
    taken: list[str] = []
    for method, name in (("ref_collection", "refs"), ("collection", "sinks")):
        original: Callable[..., Any] = getattr(Session, method)

        def spy(
            self: Session, *a: Any, _f: Callable[..., Any] = original, _n: str = name
        ) -> Any:
            taken.append(_n)
            return _f(self, *a)

        monkeypatch.setattr(Session, method, spy)
    return taken


def _check(out: jax.Array, coll: eqxctx.OutputCollection, model: GPT) -> None:
    ref, per_layer = gpt_reference(model, TOKENS)
    close(out, ref)
    outs = coll.flatten("module_outputs")
    sums = coll.flatten("summaries")
    for name, path in (("block", "blocks/"), ("attn", "blocks/attn/")):
        assert outs[path + "layer/output"].shape == (3, 5, 8)
        for i, layer in enumerate(per_layer):
            close(outs[path + "layer/output"][i], layer[name])
            close(sums[f"{path}layer{i}/rms"], rms(layer[name]))


def test_scanned_stack_records_through_refs(paths: list[str]) -> None:
    model = _gpt()
    out, coll = capture(_forward, model, TOKENS, taps=TAP)  # eagerly
    _check(out, coll, model)
    out, coll = eqx.filter_jit(capture)(_forward, model, TOKENS, taps=TAP)
    _check(out, coll, model)
    assert paths == ["refs", "refs"]


def _count(op: str, fn: Callable[..., Any], *args: Any) -> int:
    """How many `op` instructions the optimized program of `fn` holds."""
    params, static = eqx.partition(args, eqx.is_array)
    text = jax.jit(lambda p: fn(*eqx.combine(p, static))).lower(params).compile()
    return len(re.findall(rf"\b{op}\(", text.as_text() or ""))


def test_ref_path_keeps_one_loop() -> None:
    # The sink path hands the records out of a second (transposed) loop; the ref
    # path writes them inside the model's own loop, as a hand-written scan would.
    from eqxctx._capture import _refs

    model = _gpt()
    tap = Tap("blocks", output=True)

    def captured(m: GPT, t: jax.Array) -> Any:
        return capture(_forward, m, t, taps=tap)

    assert _count("while", _forward, model, TOKENS) == 1
    assert _count("while", captured, model, TOKENS) == 1
    # The point runs once per layer by construction (under the stack's scan only):
    # no call count and no run-time check (a `conditional` holding its callback).
    assert _count("conditional", captured, model, TOKENS) == 0
    _refs.USE_REFS = False
    try:
        assert _count("while", captured, model, TOKENS) == 2
        assert _count("conditional", captured, model, TOKENS) == 1
    finally:
        _refs.USE_REFS = True


def test_a_point_under_a_cond_keeps_its_run_time_check() -> None:
    mlp = eqx.nn.MLP(2, 2, 4, 1, key=KEY)

    def fn(m: eqx.nn.MLP, x: jax.Array, pred: jax.Array) -> jax.Array:
        return jax.lax.cond(pred, lambda: m.layers[1](m.layers[0](x)), lambda: x)

    tap = Tap("layers[0]", output=True)
    run = eqx.filter_jit(capture)
    _, coll = run(fn, mlp, jnp.ones(2), jnp.array(True), taps=tap)
    close(coll.flatten("module_outputs")["layers_0/output"], mlp.layers[0](jnp.ones(2)))
    with pytest.raises(
        (eqx.EquinoxRuntimeError, ValueError), match="did not run exactly once"
    ):  # (JAX 0.8's CPU callback in a cond wraps Equinox's error in a ValueError)
        run(fn, mlp, jnp.ones(2), jnp.array(False), taps=tap)


# (a) `make test-min` runs the oldest JAX allowed; where `jax.new_ref` is missing,
# capture uses the sink path (a `hasattr` check, no version parsing).
def test_without_new_ref_the_sink_path_records(
    monkeypatch: pytest.MonkeyPatch, paths: list[str]
) -> None:
    monkeypatch.delattr(jax, "new_ref")
    model = _gpt()
    out, coll = capture(_forward, model, TOKENS, taps=TAP)
    _check(out, coll, model)
    assert paths == ["sinks"]


# (b) JAX refuses a batched value written into a ref made outside the `jax.vmap`:
# a recording point under a `jax.vmap` inside fn takes the sink path.
def test_jax_refuses_a_batched_write_into_an_outer_ref() -> None:
    def fn(xs: jax.Array) -> jax.Array:
        ref = jax.new_ref(jnp.zeros(2))

        def write(x: jax.Array) -> jax.Array:
            ref[...] = x
            return x

        jax.vmap(write)(xs)
        return jax.ref.freeze(ref)

    with pytest.raises(Exception, match="unbatched array reference"):
        fn(jnp.ones((3, 2)))


def test_point_under_a_vmap_inside_fn_takes_the_sink_path(paths: list[str]) -> None:
    model = _gpt()
    tokens = jnp.stack([TOKENS, (TOKENS + 3) % 11])
    tap = Tap("blocks.attn", output=True)
    _, coll = capture(lambda m, t: jax.vmap(m)(t), model, tokens, taps=tap)
    got = coll.flatten("module_outputs")["blocks/attn/layer/output"]
    for b in range(2):
        want = np.stack([layer["attn"] for layer in gpt_reference(model, tokens[b])[1]])
        close(got[:, b], want)
    assert paths == ["sinks"]


def test_vmap_of_capture_takes_the_sink_path(paths: list[str]) -> None:
    model = _gpt()
    tokens = jnp.stack([TOKENS, (TOKENS + 3) % 11])
    _, coll = jax.vmap(lambda t: capture(_forward, model, t, taps=TAP))(tokens)
    want = np.stack([gpt_reference(model, t)[1][2]["block"] for t in tokens])
    close(coll.flatten("module_outputs")["blocks/layer/output"][:, 2], want)
    assert paths == ["sinks"]


# (c) Refs run forward under `jax.checkpoint`, but JAX cannot differentiate a
# program that writes one under remat (jax 0.10: AttributeError; jax 0.8:
# NotImplementedError), and capture cannot always see a differentiation around it;
# so a fn that holds a `jax.checkpoint` takes the sink path.
def _remat_forward(m: GPT, tokens: jax.Array) -> jax.Array:
    x = jax.vmap(m.embed)(tokens)
    dynamic, static = eqx.partition(m.blocks, eqx.is_array)

    @eqx.filter_checkpoint
    def body(x: jax.Array, layer: Any) -> tuple[jax.Array, None]:
        return eqx.combine(layer, static)(x), None

    return jax.vmap(m.head)(jax.lax.scan(body, x, dynamic)[0])


def test_jax_refuses_to_differentiate_a_ref_write_under_remat() -> None:
    def loss(w: jax.Array) -> jax.Array:
        ref = jax.new_ref(jnp.zeros(()))

        @jax.checkpoint
        def f(w: jax.Array) -> jax.Array:
            ref[...] = jax.lax.stop_gradient(w)
            return jnp.sin(w)

        return f(w)

    with pytest.raises((AttributeError, NotImplementedError)):
        jax.grad(loss)(1.0)


def test_checkpointed_fn_takes_the_sink_path_also_under_grad(
    paths: list[str],
) -> None:
    model = _gpt()
    out, coll = capture(_remat_forward, model, TOKENS, taps=TAP)
    _check(out, coll, model)

    def loss(m: GPT) -> jax.Array:  # jitted inside: capture sees no differentiation
        out, coll = capture(_remat_forward, m, TOKENS, taps=TAP)
        return jnp.mean(out**2) + coll.flatten("summaries")["blocks/layer1/rms"]

    def ref_loss(m: GPT) -> jax.Array:
        out, per_layer = gpt_reference(m, TOKENS)
        return jnp.mean(out**2) + rms(per_layer[1]["block"])

    grads = eqx.filter_grad(eqx.filter_jit(loss))(model)
    assert eqx.tree_equal(grads, eqx.filter_grad(ref_loss)(model), rtol=1e-4, atol=1e-6)
    assert paths == ["sinks", "sinks"]


# (d) Records stay differentiable on both paths. Under a differentiation capture
# sees (its model or arguments are differentiated), it takes the sink path; where
# it does not see one (a `jax.jit` inside the differentiated function), JAX
# differentiates through the ref writes.
@pytest.mark.parametrize("jit_inside", [False, True], ids=["seen", "unseen"])
def test_records_are_differentiable(jit_inside: bool, paths: list[str]) -> None:
    model = _gpt()

    def loss(m: GPT) -> jax.Array:
        out, coll = capture(_forward, m, TOKENS, taps=TAP)
        attn = coll.flatten("module_outputs")["blocks/attn/layer/output"]
        return (
            jnp.mean(out**2)
            + jnp.sum(attn[1] ** 2)
            + coll.flatten("summaries")["blocks/layer2/rms"]
        )

    def ref_loss(m: GPT) -> jax.Array:
        out, per_layer = gpt_reference(m, TOKENS)
        attn = per_layer[1]["attn"]
        return jnp.mean(out**2) + jnp.sum(attn**2) + rms(per_layer[2]["block"])

    if jit_inside:
        value, grads = eqx.filter_value_and_grad(eqx.filter_jit(loss))(model)
    else:
        value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model)
    ref_value, ref_grads = eqx.filter_value_and_grad(ref_loss)(model)
    close(value, ref_value)
    assert eqx.tree_equal(grads, ref_grads, rtol=1e-4, atol=1e-6)
    assert paths == (["refs"] if jit_inside else ["sinks"])


def test_capture_value_and_grad_records_through_refs(paths: list[str]) -> None:
    # Forward records of a training step take the ref path (the buffers made inside
    # the differentiated function); a gradient tap takes the sink path.
    model = _gpt()

    def mse(m: GPT, t: jax.Array) -> jax.Array:
        return jnp.mean(m(t) ** 2)

    (loss, coll), grads = eqxctx.capture_value_and_grad(mse, model, TOKENS, taps=TAP)
    ref_loss, ref_grads = eqx.filter_value_and_grad(mse)(model, TOKENS)
    close(loss, ref_loss)
    assert eqx.tree_equal(grads, ref_grads, rtol=1e-5, atol=1e-6)
    _check(model(TOKENS), coll, model)
    tap = Tap("blocks", summaries={"rms": rms}, gradient_summaries={"g": None})
    eqxctx.capture_value_and_grad(mse, model, TOKENS, taps=tap)
    assert paths == ["refs", "sinks"]


def test_step_records_are_differentiable_through_the_sink_path(
    paths: list[str],
) -> None:
    # (d) A loss of the step's records, differentiated (a second order through the
    # step): capture sees the model differentiated and takes the sink path.
    model = _gpt()

    def mse(m: GPT, t: jax.Array) -> jax.Array:
        return jnp.mean(m(t) ** 2)

    def meta(m: GPT) -> jax.Array:
        (_, coll), _ = eqxctx.capture_value_and_grad(mse, m, TOKENS, taps=TAP)
        return coll.flatten("summaries")["blocks/attn/layer1/rms"]

    def ref_meta(m: GPT) -> jax.Array:
        return rms(gpt_reference(m, TOKENS)[1][1]["attn"])

    grads = eqx.filter_jit(eqx.filter_grad(meta))(model)
    assert eqx.tree_equal(grads, eqx.filter_grad(ref_meta)(model), rtol=1e-4, atol=1e-6)
    assert paths == ["sinks"]
    # Hidden from capture by a `jax.jit`, the second order runs through the ref
    # writes: jax 0.8 differentiates them, jax 0.10 raises (`AttributeError`, its
    # linearization of a ref under a second differentiation); never zeros.
    try:
        hidden = eqx.filter_grad(eqx.filter_jit(meta))(model)
    except AttributeError:
        return
    assert eqx.tree_equal(hidden, grads, rtol=1e-4, atol=1e-6)


def test_capture_per_step_of_a_scan_and_through_an_inner_jit(
    paths: list[str],
) -> None:
    # The buffers are made where `capture` runs (here in a scan body over steps),
    # and a `jax.jit` inside fn writes into them from its own trace.
    model = _gpt()
    tokens = jnp.stack([TOKENS, (TOKENS + 2) % 11])

    def inner_jit(m: GPT, t: jax.Array) -> jax.Array:
        return eqx.filter_jit(_forward)(m, t)

    def step(carry: None, t: jax.Array) -> tuple[None, jax.Array]:
        _, coll = capture(inner_jit, model, t, taps=TAP)
        return carry, coll.flatten("module_outputs")["blocks/attn/layer/output"]

    _, outs = jax.jit(lambda: jax.lax.scan(step, None, tokens))()
    for b in range(2):
        want = np.stack([layer["attn"] for layer in gpt_reference(model, tokens[b])[1]])
        close(outs[b], want)
    assert paths == ["refs"]


@pytest.mark.skipif(
    "scan" not in inspect.signature(eqx.nn.MLP.__init__).parameters,
    reason="eqx.nn.MLP(scan=True) needs Equinox >= 0.13.5",
)
def test_integer_records_take_the_sink_path_under_grad(paths: list[str]) -> None:
    # Found by a new-user review (fourth session): a `MomentsSummary` tap (its count
    # is an integer) on a scanned stack under `capture_value_and_grad`, or under a
    # `jax.grad` capture cannot see, failed in JAX's differentiation of the indexed
    # write into an integer ref (AttributeError). Integer records now take sinks.
    mlp = eqx.nn.MLP(4, 2, 8, depth=3, scan=True, key=KEY)
    first, hidden, _ = mlp.layers  # hidden: 2 stacked layers, the point
    tap = Tap("layers[1]", summaries={"m": eqxctx.MomentsSummary})
    x = jnp.linspace(-1.0, 1.0, 4)

    def loss(m: Any, x: jax.Array) -> jax.Array:
        return jnp.sum(m(x) ** 2)

    (_, coll), _ = eqxctx.capture_value_and_grad(loss, mlp, x, taps=tap)

    def moments_loss(x: jax.Array) -> jax.Array:  # x closed over: grad unseen
        _, c = capture(lambda m: m(x), mlp, taps=tap)
        return jnp.sum(jnp.stack([v.mean for v in c.flatten("summaries").values()]))

    g = jax.grad(moments_loss)(x)
    assert paths == ["sinks", "sinks"]

    def reference(x: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        h, outs = mlp.activation(first(x)), list[jax.Array]()
        for i in range(2):  # a Python loop over the stacked layers
            layer = jax.tree_util.tree_map(
                lambda a, i=i: a[i] if eqx.is_array(a) else a, hidden
            )
            outs.append(layer(h))
            h = mlp.activation(outs[-1])
        return jnp.sum(jnp.stack([jnp.mean(o) for o in outs])), outs

    total, outs = reference(x)
    for i, out in enumerate(outs):
        m = coll.flatten("summaries")[f"layers_1/layer{i}/m"]
        close(m.mean, jnp.mean(out))
        assert int(m.count) == out.size
    close(moments_loss(x), total)
    close(g, jax.grad(lambda x: reference(x)[0])(x))

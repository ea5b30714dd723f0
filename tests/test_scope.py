"""Children's named scopes: op names show the model tree (`c0/c1/sin`)."""

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from eqxctx import (
    Context,
    cond_in_context,
    fori_in_context,
    functional,
    scan_in_context,
    vmap_in_context,
    while_in_context,
)


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _op_names(fn: Callable[[jax.Array], Any], x: jax.Array) -> list[str]:
    """Every HLO instruction's `op_name`, in program order (unoptimized HLO)."""
    text = jax.jit(fn).lower(x).as_text(dialect="hlo", debug_info=True)
    return _OP_NAME.findall(text)


def _chain(depth: int) -> Callable[[jax.Array, Context], tuple[jax.Array, Context]]:
    def node(x: jax.Array, ctx: Context, *, i: int) -> tuple[jax.Array, Context]:
        h = jnp.sin(x) * (i + 1.0)
        ctx = ctx.add_summary("s", jnp.mean(h))
        if i + 1 < depth:
            h, ctx = ctx.call(f"c{i + 1}", node, h, i=i + 1)
        return h, ctx

    def model(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return ctx.call("c0", node, x, i=0)

    return model


def _run(
    model: Callable[..., tuple[jax.Array, Context]], keyed: bool = True
) -> Callable[[jax.Array], Any]:
    def run(x: jax.Array) -> jax.Array:
        key = jax.random.key(0) if keyed else None
        y, _ = functional(model, prng_key=key, is_training=True, args=(x,))
        return jnp.sum(y * x)

    return run


def _in_user_scopes(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    with jax.named_scope("user"):
        x, ctx = ctx.call("a", _chain(3), x)

    def inner(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        with jax.named_scope("mid"):
            return ctx.call("b", _chain(3), x)

    return ctx.call("outer", inner, x)


def _jitted_child(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    @jax.jit
    def child(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return _chain(3)(x, ctx)

    x, ctx = ctx.call("j", child, x)
    return ctx.call("k", jax.checkpoint(_chain(3)), x)


def _scanned(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    def body(
        carry: jax.Array, _: None, ctx: Context
    ) -> tuple[jax.Array, None, Context]:
        carry, ctx = ctx.call("layer", _chain(3), carry)
        return carry, None, ctx

    def nested(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        x, _, coll = scan_in_context(body, context=ctx, carry=x, xs=None, length=2)
        return x, ctx.merge(coll)

    x, ctx = ctx.call("stack", nested, x)
    ys, coll = vmap_in_context(_chain(2), context=ctx, xs=jnp.stack([x, x]))
    return jnp.sum(ys, axis=0), ctx.merge(coll)


def _branched(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    x, coll = cond_in_context(
        jnp.sum(x) > 0, _chain(3), lambda x, ctx: _chain(3)(-x, ctx), x, context=ctx
    )
    ctx = ctx.merge(coll)
    x, coll = fori_in_context(0, 2, lambda i, x, ctx: _chain(2)(x, ctx), x, context=ctx)
    return x, ctx.merge(coll)


def _looped(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    (_, x), coll = while_in_context(
        lambda c: c[0] < 2, _count_and_chain, (jnp.asarray(0), x), context=ctx
    )
    return x, ctx.merge(coll)


def _count_and_chain(
    c: tuple[jax.Array, jax.Array], ctx: Context
) -> tuple[tuple[jax.Array, jax.Array], Context]:
    x, ctx = _chain(2)(c[1], ctx)
    return (c[0] + 1, x), ctx


def _transposed(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    """`jax.linear_transpose` of a function running children, inside children."""

    def inner(v: jax.Array, ctx: Context, *, k: int) -> tuple[jax.Array, Context]:
        if k < 2:
            return ctx.call(f"r{k + 1}", inner, v, k=k + 1)
        return jax.lax.mul(v, jnp.full_like(v, 3.0)), ctx

    def node(x: jax.Array, ctx: Context, *, i: int) -> tuple[jax.Array, Context]:
        if i < 2:
            return ctx.call(f"c{i + 1}", node, x, i=i + 1)

        def linear(v: jax.Array) -> jax.Array:  # its children are the node's
            return ctx.call("r0", inner, v, k=0)[0]

        (y,) = jax.linear_transpose(linear, x)(x)
        return y, ctx

    return ctx.call("c0", node, x, i=0)


def _custom_jvp_rule(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    """A `jax.custom_jvp` rule that runs a child, two children deep."""

    def leaf(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        @jax.custom_jvp
        def f(x: jax.Array) -> jax.Array:
            return jnp.sin(x)

        @f.defjvp
        def f_jvp(
            primals: tuple[jax.Array], tangents: tuple[jax.Array]
        ) -> tuple[jax.Array, jax.Array]:
            ((x,), (dx,)) = primals, tangents
            g, _ = ctx.call(
                "rule", lambda x, ctx: (jax.lax.mul(jnp.cos(x), dx), ctx), x
            )
            return jnp.sin(x), g

        return f(x), ctx

    return ctx.call("c0", lambda x, ctx: ctx.call("c1", leaf, x), x)


MODELS: dict[str, Callable[..., tuple[jax.Array, Context]]] = {
    "chain": _chain(6),
    "user_scopes": _in_user_scopes,
    "jit_and_checkpoint": _jitted_child,
    "scan_and_vmap": _scanned,
    "cond_and_fori": _branched,
    "while": _looped,  # (not differentiable)
    "linear_transpose": _transposed,
    "custom_jvp_rule": _custom_jvp_rule,
}
#: Op names each model must show, beyond `c0/c1/` (where a scope is easy to lose):
#: these run children in a trace that names its equations relative to the stack it
#: began under (linear transposition, a custom JVP rule), which a closed-over key
#: would change (so they run without one).
EXPECTED = {
    "linear_transpose": r"c0\)*/c1/c2/transpose\(r0\)/r1/r2/mul",
    "custom_jvp_rule": r"c0\)*/c1/rule/",
}


def _transformed(model: str, transform: str) -> Callable[[jax.Array], Any]:
    run = _run(MODELS[model], keyed=model not in EXPECTED)
    return {
        "jit": run,
        "grad": jax.grad(run),
        "grad_of_jit": jax.grad(jax.jit(run)),
        "linearize": lambda x: jax.linearize(run, x)[1](x),
        "vmap_of_grad": lambda x: jax.vmap(jax.grad(run))(jnp.stack([x, -x])),
    }[transform]


@pytest.mark.parametrize(
    "transform", ["jit", "grad", "grad_of_jit", "linearize", "vmap_of_grad"]
)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_op_names_show_the_model_tree(model: str, transform: str) -> None:
    if model == "while" and transform != "jit":
        pytest.skip("jax.lax.while_loop has no reverse-mode derivative")
    x = jnp.linspace(-1.0, 1.0, 4)
    ours = _op_names(_transformed(model, transform), x)
    # Nested children's ops are named by the tree (`c0/c1/sin`, `jvp(c0)/c1/sin`),
    # (every lowered instruction's `op_name`).
    assert any(re.search(r"c0\)*/c1/", name) for name in ours)
    if transform not in ("jit", "linearize") or model == "linear_transpose":
        assert any("transpose(" in name for name in ours)
    if model in EXPECTED and (transform != "jit" or model != "custom_jvp_rule"):
        assert any(re.search(EXPECTED[model], name) for name in ours), ours


def test_a_chain_names_its_ops_by_every_ancestor() -> None:
    names = _op_names(_run(_chain(6)), jnp.linspace(-1.0, 1.0, 4))
    deepest = "/".join(f"c{i}" for i in range(6))
    assert f"jit(run)/{deepest}/sin" in names, names
    # Each level's own ops sit under its path, never under a deeper one's.
    for depth in range(1, 7):
        path = "/".join(f"c{i}" for i in range(depth))
        assert f"jit(run)/{path}/sin" in names


def test_a_user_scope_keeps_its_entry() -> None:
    names = _op_names(_run(_in_user_scopes), jnp.linspace(-1.0, 1.0, 4))
    assert "jit(run)/user/a/c0/c1/c2/sin" in names, names
    assert "jit(run)/outer/mid/b/c0/sin" in names, names

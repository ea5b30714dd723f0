"""Children's named scopes: `jax.named_scope`'s op names, a stack of bounded size."""

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax._src import source_info_util

import eqxctx._combinators as combinators_module
import eqxctx._context as context_module
import eqxctx._control as control_module
import eqxctx._loops as loops_module
from eqxctx import (
    Context,
    cond_in_context,
    fori_in_context,
    functional,
    scan_in_context,
    vmap_in_context,
    while_in_context,
)
from eqxctx._scope import child_scope


_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SCOPED_MODULES = (context_module, combinators_module, control_module, loops_module)


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


def _run(model: Callable[..., tuple[jax.Array, Context]]) -> Callable[[jax.Array], Any]:
    def run(x: jax.Array) -> jax.Array:
        y, _ = functional(
            model, prng_key=jax.random.key(0), is_training=True, args=(x,)
        )
        return jnp.sum(y)

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


MODELS: dict[str, Callable[..., tuple[jax.Array, Context]]] = {
    "chain": _chain(6),
    "user_scopes": _in_user_scopes,
    "jit_and_checkpoint": _jitted_child,
    "scan_and_vmap": _scanned,
    "cond_and_fori": _branched,
    "while": _looped,  # (not differentiable)
}


@pytest.mark.parametrize("transform", ["jit", "grad", "grad_of_jit"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_op_names_are_those_of_nested_named_scopes(
    model: str, transform: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if model == "while" and transform != "jit":
        pytest.skip("jax.lax.while_loop has no reverse-mode derivative")
    run = _run(MODELS[model])
    fn: Callable[[jax.Array], Any] = {
        "jit": run,
        "grad": jax.grad(run),
        "grad_of_jit": jax.grad(jax.jit(run)),
    }[transform]
    x = jnp.linspace(-1.0, 1.0, 4)
    ours = _op_names(fn, x)
    for module in _SCOPED_MODULES:
        monkeypatch.setattr(module, "child_scope", jax.named_scope)
    reference = _op_names(fn, x)
    assert ours == reference
    # The comparison sees the scopes: nested children's ops are named by the tree
    # (`c0/c1/sin`, `jvp(c0)/c1/sin`).
    assert any(re.search(r"c0\)*/c1/", name) for name in ours)
    if transform != "jit":
        assert any("transpose(" in name for name in ours)


def test_the_name_stack_does_not_grow_with_depth() -> None:
    seen: list[tuple[int, str]] = []

    def leaf(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        stack = source_info_util.current_name_stack()
        seen.append((len(stack), str(stack)))
        return x, ctx

    def chain(x: jax.Array, ctx: Context, *, i: int) -> tuple[jax.Array, Context]:
        if i == 30:
            return ctx.call("leaf", leaf, x)
        return ctx.call(f"c{i}", chain, x, i=i + 1)

    def model(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        with jax.named_scope("user"):
            return chain(x, ctx, i=0)

    jax.jit(_run(model)).trace(jnp.ones(2))
    names = "/".join([f"c{i}" for i in range(30)] + ["leaf"])
    # user, c0, and "c1/.../leaf": three entries (jax.named_scope's stack: 32).
    assert seen == [(3, f"user/{names}")]


def test_child_scope_is_a_context_manager_restoring_the_stack() -> None:
    before = source_info_util.current_name_stack()
    inside: list[str] = []

    def fail() -> None:
        with child_scope("a"), child_scope("b"):
            inside.append(str(source_info_util.current_name_stack()))
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        fail()
    assert inside == [f"{before}/a/b" if len(before) else "a/b"]
    assert source_info_util.current_name_stack() is before


def test_child_scope_falls_back_to_jax_named_scope_where_jax_differs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from eqxctx import _scope

    assert _scope._joining_scope() is not None  # pyright: ignore[reportPrivateUsage]

    def arrows(self: source_info_util.NameStack) -> str:
        return ">".join(entry.name for entry in self.stack)

    # A JAX whose name stack prints entries otherwise than joined by "/".
    monkeypatch.setattr(source_info_util.NameStack, "__str__", arrows)
    assert _scope._joining_scope() is None  # pyright: ignore[reportPrivateUsage]
    # A JAX whose `named_scope` does more than extend the stack.
    monkeypatch.undo()
    monkeypatch.setattr(jax, "named_scope", lambda name: child_scope(name))
    assert _scope._joining_scope() is None  # pyright: ignore[reportPrivateUsage]

"""Static check (pyright, in CI) that the combinators' carry and ys types are inferred.

`typing.assert_type` fails pyright if a returned type were `Any` or wrong. Nothing runs
at import time; pytest does not collect this file (no `test_` prefix) and its doctest
pass only imports it.
"""

from typing import NamedTuple, assert_type

import jax
import jax.numpy as jnp

from eqxctx import Context, OutputCollection, scan_in_context, vmap_in_context


class Carry(NamedTuple):
    h: jax.Array
    step: int


def _body(
    c: Carry, x: jax.Array, ctx: Context
) -> tuple[Carry, dict[str, jax.Array], Context]:
    h = jnp.tanh(c.h * x)
    return Carry(h, c.step + 1), {"h": h}, ctx.add_summary("h", jnp.mean(h))


def _example(w: jax.Array) -> dict[str, jax.Array]:
    return {"y": w * 2}


def check_scan() -> None:
    ctx = Context.root()
    carry, ys, coll = scan_in_context(
        _body, context=ctx, carry=Carry(jnp.ones(3), 0), xs=jnp.ones((4, 3))
    )
    assert_type(carry, Carry)
    assert_type(ys, dict[str, jax.Array])
    assert_type(coll, OutputCollection)


def check_scan_without_xs() -> None:
    def body(c: jax.Array, x: None, ctx: Context) -> tuple[jax.Array, float, Context]:
        del x
        return c + 1, 0.5, ctx

    carry, ys, _ = scan_in_context(
        body, context=Context.root(), carry=jnp.zeros(()), xs=None, length=3
    )
    assert_type(carry, jax.Array)
    assert_type(ys, float)


def check_vmap() -> None:
    def body(x: jax.Array, ctx: Context) -> tuple[dict[str, jax.Array], Context]:
        return _example(x), ctx

    ys, coll = vmap_in_context(body, context=Context.root(), xs=jnp.ones((2, 3)))
    assert_type(ys, dict[str, jax.Array])
    assert_type(coll, OutputCollection)


def check_call() -> None:
    def layer(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return x * 2, ctx.add_summary("x", jnp.mean(x))

    y, ctx = Context.root().call("layer", layer, jnp.ones(3))
    assert_type(y, jax.Array)
    assert_type(ctx, Context)


def check_call_with_args() -> None:
    def block(
        x: jax.Array, ctx: Context, *, scale: float
    ) -> tuple[tuple[jax.Array, dict[str, jax.Array]], Context]:
        return (x * scale, {"x": x}), ctx

    ctx = Context.root()
    (y, aux), ctx = ctx.call("block", block, jnp.ones(3), scale=2.0)
    assert_type(y, jax.Array)
    assert_type(aux, dict[str, jax.Array])
    assert_type(ctx, Context)

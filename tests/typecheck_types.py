"""Static check (pyright, in CI) that gradients, runner outputs and models are typed.

Issue 35 item 17: `eqxctx.value_and_grad`'s `grads` was `Any`,
`MethodRunner.Output.output_batch` Unknown and `runner.model` `Any`. Here they take
the types of what was passed in; `typing.assert_type` fails pyright if one were
`Any` or wrong. Nothing runs at import time; pytest does not collect this file (no
`test_` prefix) and its doctest pass only imports it.
"""

from collections.abc import Iterator
from typing import Any, assert_type

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import eqxctx
from eqxctx import Context, MethodRunner, OutputCollection


class Model(eqx.Module):
    w: jax.Array

    def predict(
        self, batch: dict[str, jax.Array], ctx: Context
    ) -> tuple[dict[str, jax.Array], Context]:
        return {"y": batch["x"] @ self.w}, ctx


def _loss(model: Model, x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    return jnp.sum(x @ model.w), ctx


def check_value_and_grad() -> None:
    model, x = Model(jnp.ones((3, 2))), jnp.ones((4, 3))
    (loss, coll), grads = eqxctx.value_and_grad(_loss)(
        model, x, prng_key=None, is_training=True
    )
    assert_type(loss, jax.Array)
    assert_type(coll, OutputCollection)
    assert_type(grads, Model)
    _, x_grads = eqxctx.value_and_grad(_loss, argnums=1)(
        model, x, prng_key=None, is_training=True
    )
    assert_type(x_grads, jax.Array)
    _, both = eqxctx.value_and_grad(_loss, argnums=(0, 1))(
        model, x, prng_key=None, is_training=True
    )
    assert_type(both, tuple[Model, jax.Array])
    _, other = eqxctx.value_and_grad(_loss, argnums=(1, 0))(
        model, x, prng_key=None, is_training=True
    )
    assert_type(other, Any)  # other positions: not inferred


def _predict(
    model: Model, batch: dict[str, jax.Array], ctx: Context
) -> tuple[dict[str, jax.Array], Context]:
    return model.predict(batch, ctx)


def check_runner(mesh: Mesh) -> None:
    model = Model(jnp.ones((3, 2)))
    runner = MethodRunner.create(model, _predict, mesh=mesh, prng_key=jax.random.key(0))
    assert_type(runner, MethodRunner[Model, dict[str, jax.Array]])
    assert_type(runner.model, Model)
    runner, out = runner({"x": jnp.ones((2, 3))})
    assert_type(runner, MethodRunner[Model, dict[str, jax.Array]])
    assert_type(out, MethodRunner.Output[dict[str, jax.Array]])
    assert_type(out.output_batch, dict[str, jax.Array])
    outs = eqxctx.run_batches(runner, [{"x": jnp.ones((2, 3))}])
    assert_type(outs, Iterator[MethodRunner.Output[dict[str, jax.Array]]])
    compiled = runner.lower({"x": jax.ShapeDtypeStruct((2, 3), jnp.float32)}).compile()
    runner, out = compiled({"x": jnp.ones((2, 3))})
    assert_type(out.output_batch, dict[str, jax.Array])
    assert_type(runner.model, Model)
    # A method named by a string: the model's type is known, the output's not.
    by_name = MethodRunner.create(
        model, "predict", mesh=mesh, prng_key=jax.random.key(0)
    )
    assert_type(by_name.model, Model)

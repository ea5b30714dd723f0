"""The runner's one path (`_step.Step`): placement, equivalent shardings, trace counts,
padding with a mask, donation; on 8 simulated CPU devices."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from eqxctx import Context, MethodRunner


pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 (simulated) devices"
)

AXIS_TYPES = [AxisType.Auto, AxisType.Explicit]


def mesh_1d(axis_type: AxisType) -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("data",), axis_types=(axis_type,))


def mesh_2d(axis_type: AxisType) -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)


class Affine(eqx.Module):
    w: jax.Array
    b: jax.Array

    def apply(
        self, batch: dict[str, jax.Array], ctx: Context
    ) -> tuple[dict[str, jax.Array], Context]:
        y = batch["x"] @ self.w + self.b[None, :]
        return {"y": y, "id": batch["id"] * 2}, ctx.add_summary("n", batch["id"].size)


def affine(seed: int = 0) -> Affine:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return Affine(jax.random.normal(k1, (4, 3)), jax.random.normal(k2, (3,)))


def buffers(x: jax.Array) -> list[int]:
    return [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]


# -- equivalent shardings pass through ---------------------------------------------


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize(
    ("mesh_fn", "spellings"),
    [
        (mesh_1d, [P("data"), P("data", None), P(("data",), None)]),
        (mesh_2d, [P(("data", "model")), P(("data", "model"), None)]),
    ],
)
def test_a_batch_placed_with_an_equivalent_sharding_is_not_copied(
    axis_type: AxisType, mesh_fn: Any, spellings: list[P]
) -> None:
    mesh = mesh_fn(axis_type)
    runner = MethodRunner.create(
        affine(), "apply", mesh=mesh, prng_key=jax.random.PRNGKey(0)
    )
    host = np.arange(64, dtype=np.float32).reshape(16, 4)
    ids = np.arange(16, dtype=np.int32)
    _, ref = runner({"x": host, "id": ids})
    for spec in spellings:
        x = jax.device_put(host, NamedSharding(mesh, spec))
        i = jax.device_put(ids, NamedSharding(mesh, P(spec[0])))
        before = buffers(x)
        for _ in range(3):  # the slow path, then the fast path
            runner, out = runner({"x": x, "id": i})
            assert out.input_batch["x"] is x, spec
            assert out.input_batch["id"] is i, spec
            assert buffers(out.input_batch["x"]) == before
            np.testing.assert_array_equal(
                np.asarray(out.output_batch["y"]), np.asarray(ref.output_batch["y"])
            )
    # A sharding that is not equivalent is placed (a copy with the input partition).
    other = jax.device_put(host, NamedSharding(mesh, P()))
    _, out = runner({"x": other, "id": ids})
    assert out.input_batch["x"] is not other
    assert out.input_batch["x"].sharding.is_equivalent_to(
        ref.input_batch["x"].sharding, 2
    )


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_parameters_and_keys_placed_equivalently_are_not_copied(
    axis_type: AxisType,
) -> None:
    mesh = mesh_2d(axis_type)
    w = jax.device_put(jnp.ones((4, 3)), NamedSharding(mesh, P("model", None)))
    b = jax.device_put(jnp.ones(3), NamedSharding(mesh, P()))
    key = jax.device_put(jax.random.PRNGKey(0), NamedSharding(mesh, P()))
    runner = MethodRunner.create(
        Affine(w, b),
        "apply",
        mesh=mesh,
        prng_key=key,
        param_partition=lambda path, leaf: P("model") if path == "w" else P(),
    )
    assert runner.param_leaves[0] is w
    assert runner.param_leaves[1] is b
    assert runner.prng_key is key


# -- trace counts and the compiled program -----------------------------------------


def identity(model: Any, batch: Any, ctx: Context) -> tuple[Any, Context]:
    return batch, ctx


def test_trace_count_counts_each_new_signature_once() -> None:
    mesh = mesh_1d(AxisType.Explicit)

    # A method of its own: no other test shares this step's traces.
    def method(model: Any, batch: Any, ctx: Context) -> tuple[Any, Context]:
        return batch * 2, ctx

    runner = MethodRunner.create({}, method, mesh=mesh, prng_key=jax.random.key(0))
    assert runner.trace_count == 0
    x = np.ones((8, 4), np.float32)
    runner, out = runner(x)
    assert runner.trace_count == 1
    for _ in range(3):
        runner, out = runner(x)
        runner, out = runner(out.input_batch)
    assert runner.trace_count == 1
    # An equivalent sharding compiles again without tracing.
    runner, _ = runner(jax.device_put(x, NamedSharding(mesh, P("data"))))
    assert runner.trace_count == 1
    runner, _ = runner(np.ones((16, 4), np.float32))
    assert runner.trace_count == 2
    # Runners from equal settings share the count; lowering traces once.
    again = MethodRunner.create({}, method, mesh=mesh, prng_key=jax.random.key(1))
    assert again.trace_count == 2
    again.lower(jax.ShapeDtypeStruct((24, 4), jnp.float32)).compile()
    assert runner.trace_count == 3


def test_compiled_runner_cost_and_memory_analysis() -> None:
    mesh = mesh_1d(AxisType.Auto)
    runner = MethodRunner.create(
        affine(), "apply", mesh=mesh, prng_key=jax.random.PRNGKey(0)
    )
    spec = {
        "x": jax.ShapeDtypeStruct((16, 4), jnp.float32),
        "id": jax.ShapeDtypeStruct((16,), jnp.int32),
    }
    compiled = runner.lower(spec).compile()
    cost = compiled.cost_analysis()
    assert isinstance(cost, dict)
    assert cost["flops"] > 0
    memory = compiled.memory_analysis()
    assert memory is not None
    assert memory.argument_size_in_bytes > 0
    assert memory.output_size_in_bytes > 0

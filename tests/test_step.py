"""The runner's one path (`_step.Step`): placement, equivalent shardings, trace counts,
padding with a mask, donation; on 8 simulated CPU devices."""

import dataclasses
import gc
import re
import warnings
import weakref
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqxctx
from eqxctx import Context, DataPartition, MethodRunner


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
    # The same buffers, with the shardings the step uses and returns (equal, not
    # just equivalent: another spelling is another `jax.jit` cache entry; issue 35
    # item 1). Auto meshes spell the key's `P()` as JAX does; Explicit ones pad it.
    after, _ = runner({"x": np.ones((8, 4), np.float32), "id": np.arange(8)})
    for got, given, sharding in zip(
        (*runner.param_leaves, runner.prng_key),
        (w, b, key),
        (*runner.step.param_shardings, after.prng_key.sharding),
        strict=True,
    ):
        assert buffers(got) == buffers(given)
        assert got.sharding == sharding
    assert (runner.prng_key is key) == (axis_type == AxisType.Auto)


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


# -- padding and the mask ----------------------------------------------------------


class Regressor(eqx.Module):
    w: jax.Array
    b: jax.Array

    def evaluate(
        self, batch: dict[str, jax.Array], ctx: Context, *, mask: jax.Array
    ) -> tuple[dict[str, jax.Array], Context]:
        y = batch["x"] @ self.w + self.b[None, :]
        err = jnp.sum((y - batch["t"]) ** 2, axis=-1)
        weight = mask.astype(jnp.float32)
        n = jnp.sum(weight)
        mean = jnp.sum(err * weight) / jnp.maximum(n, 1.0)
        ctx = ctx.add_summary("mse", eqxctx.WeightedSummary(mean, n))
        ctx = ctx.add_summary("rows", eqxctx.SumSummary(n))
        worst = jnp.max(jnp.where(mask, err, -jnp.inf))
        ctx = ctx.add_summary("worst", eqxctx.MaxSummary(worst))
        return {"y": y, "err": err, "mask": mask}, ctx


def regressor() -> Regressor:
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    return Regressor(jax.random.normal(k1, (4, 3)), jax.random.normal(k2, (3,)))


def eval_set(n: int = 37) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(n, 4)).astype(np.float32),
        "t": rng.normal(size=(n, 3)).astype(np.float32),
    }


def numpy_reference(model: Regressor, data: dict[str, np.ndarray]) -> Any:
    y = data["x"] @ np.asarray(model.w) + np.asarray(model.b)
    err = ((y - data["t"]) ** 2).sum(-1)
    return y, err


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("batch_sizes", [None, (8, 32)])
def test_padded_ragged_evaluation_equals_numpy(
    axis_type: AxisType, batch_sizes: tuple[int, ...] | None
) -> None:
    model, data = regressor(), eval_set()
    total = len(data["x"])
    ref_y, ref_err = numpy_reference(model, data)
    runner = MethodRunner.create(
        model,
        "evaluate",
        mesh=mesh_1d(axis_type),
        prng_key=jax.random.PRNGKey(0),
        pad_batches=True,
        batch_sizes=batch_sizes,
        mask_kwarg="mask",
    )
    before = runner.trace_count
    # Each padded size's bounds (multiples of the 8 devices, up to 32): every
    # program, each edge, not every size (each costs a pass over the data).
    for size in (1, 2, 7, 8, 9, 15, 16, 17, 23, 24, 25):
        batches = [
            {k: v[i : i + size] for k, v in data.items()} for i in range(0, total, size)
        ]
        acc = eqxctx.SummaryAccumulator()
        ys, errs = [], []
        for batch, out in zip(
            batches, eqxctx.run_batches(runner, batches), strict=True
        ):
            rows = len(batch["x"])
            assert out.output_batch["y"].shape == (rows, 3), size
            assert out.input_batch["x"].shape == (rows, 4)
            np.testing.assert_array_equal(np.asarray(out.input_batch["x"]), batch["x"])
            assert bool(np.asarray(out.output_batch["mask"]).all())
            ys.append(np.asarray(out.output_batch["y"]))
            errs.append(np.asarray(out.output_batch["err"]))
            acc = acc.update(out.summaries)
        np.testing.assert_allclose(np.concatenate(ys), ref_y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.concatenate(errs), ref_err, rtol=1e-5)
        summaries = acc.summaries()
        np.testing.assert_allclose(
            float(summaries["mse"].value()), ref_err.mean(), rtol=1e-5
        )
        assert float(summaries["rows"].value()) == total
        np.testing.assert_allclose(
            float(summaries["worst"].value()), ref_err.max(), rtol=1e-5
        )
    # One trace per distinct padded size: multiples of 8 up to 32, or the buckets.
    assert runner.trace_count - before <= (4 if batch_sizes is None else 2)


def test_padding_leaves_batches_that_need_none_unchanged() -> None:
    mesh = mesh_1d(AxisType.Explicit)
    model, data = regressor(), eval_set(16)
    kw: dict[str, Any] = {"mesh": mesh, "prng_key": jax.random.PRNGKey(0)}

    def evaluate(m: Regressor, b: Any, ctx: Context) -> tuple[Any, Context]:
        return m.evaluate(b, ctx, mask=jnp.ones(b["x"].shape[0], bool))

    plain = MethodRunner.create(model, evaluate, **kw)
    padded = MethodRunner.create(
        model, "evaluate", pad_batches=True, mask_kwarg="mask", **kw
    )
    placed = plain(data)[1].input_batch
    _, want = plain(placed)
    for batch in (data, placed):
        _, got = padded(batch)
        for name in ("y", "err"):
            assert got.output_batch[name].sharding == want.output_batch[name].sharding
            np.testing.assert_array_equal(
                np.asarray(got.output_batch[name]), np.asarray(want.output_batch[name])
            )
    _, got = padded(placed)
    assert got.input_batch["x"] is placed["x"]
    # The mask alone (no padding) is all True.
    masked = MethodRunner.create(model, "evaluate", mask_kwarg="mask", **kw)
    _, out = masked(data)
    assert bool(np.asarray(out.output_batch["mask"]).all())


def test_padding_errors_name_the_sizes() -> None:
    mesh = mesh_1d(AxisType.Auto)
    kw: dict[str, Any] = {"mesh": mesh, "prng_key": jax.random.PRNGKey(0)}
    model, data = regressor(), eval_set(40)
    bucketed = MethodRunner.create(
        model,
        "evaluate",
        pad_batches=True,
        batch_sizes=(16, 8),
        mask_kwarg="mask",
        **kw,
    )
    assert bucketed.settings.batch_sizes == (8, 16)
    with pytest.raises(ValueError, match=r"17 rows is larger than the largest.*16"):
        bucketed({k: v[:17] for k, v in data.items()})
    with pytest.raises(ValueError, match=r"different leading.*'t': 5, 'x': 6"):
        bucketed({"x": data["x"][:6], "t": data["t"][:5]})
    odd = MethodRunner.create(
        model, "evaluate", pad_batches=True, batch_sizes=(12,), mask_kwarg="mask", **kw
    )
    with pytest.raises(ValueError, match=r"size 12 does not divide over the 8"):
        odd({k: v[:5] for k, v in data.items()})
    with pytest.raises(ValueError, match=r"pass `pad_batches=True` too"):
        MethodRunner.create(model, "evaluate", batch_sizes=(8,), **kw)
    with pytest.raises(ValueError, match=r"positive integers"):
        MethodRunner.create(model, "evaluate", pad_batches=True, batch_sizes=(0,), **kw)
    with pytest.raises(ValueError, match=r"mask_kwarg='a b'.*identifier"):
        MethodRunner.create(model, "evaluate", mask_kwarg="a b", **kw)
    with pytest.raises(ValueError, match=r"passes `mask` to the method itself"):
        bucketed({k: v[:8] for k, v in data.items()}, mask=jnp.ones(8, bool))
    # A mask needs rows: a batch of scalars has none (the method would miss `mask`).
    with pytest.raises(ValueError, match=r"mask_kwarg='mask'.*no leaf of rank >= 1"):
        bucketed({"x": np.float32(1.0), "t": np.float32(2.0)})
    scalars = jax.ShapeDtypeStruct((), np.float32)
    with pytest.raises(ValueError, match=r"mask_kwarg='mask'.*no leaf of rank >= 1"):
        bucketed.lower({"x": scalars, "t": scalars})


def test_padding_on_a_2d_mesh_pads_to_the_data_axis_and_compiles_ahead() -> None:
    mesh = mesh_2d(AxisType.Auto)
    model, data = regressor(), eval_set(10)
    runner = MethodRunner.create(
        model,
        "evaluate",
        mesh=mesh,
        prng_key=jax.random.PRNGKey(0),
        input_partition=DataPartition.BATCH,
        pad_batches=True,
        mask_kwarg="mask",
    )
    _, out = runner({k: v[:5] for k, v in data.items()})  # padded to 8 (4 shards)
    ref_y, _ = numpy_reference(model, {k: v[:5] for k, v in data.items()})
    np.testing.assert_allclose(np.asarray(out.output_batch["y"]), ref_y, rtol=1e-5)
    # A compiled runner pads smaller batches to the size it was lowered for.
    spec = {k: jax.ShapeDtypeStruct((8, v.shape[1]), v.dtype) for k, v in data.items()}
    compiled = runner.lower(spec).compile()
    for rows in (3, 8):
        part = {k: v[:rows] for k, v in data.items()}
        _, out = compiled(part)
        ref_y, _ = numpy_reference(model, part)
        np.testing.assert_allclose(np.asarray(out.output_batch["y"]), ref_y, rtol=1e-5)
        assert out.output_batch["y"].shape == (rows, 3)
    with pytest.raises(ValueError, match=r"9 rows is larger than the batch size it"):
        compiled({k: v[:9] for k, v in data.items()})


def per_example_draws(
    model: Any, batch: Any, ctx: Context, *, mask: Any
) -> tuple[Any, Context]:
    draws = jax.vmap(jax.random.uniform)(batch["key"]) + batch["x"]
    return {"draws": draws, "mask": mask}, ctx


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_padding_pads_typed_key_leaves(axis_type: AxisType) -> None:
    # issue 35 item 6: per-example typed keys in a padded batch gave NumPy's
    # "PRNGKey dtype cannot be converted" TypeError, naming no leaf.
    if axis_type == AxisType.Explicit and jax.__version_info__ < (0, 9):
        # JAX 0.8 (`make test-min`) cannot vmap `jax.random.uniform` over keys split
        # on an Explicit axis ("Resource axis: data ... is not found in mesh: ()").
        pytest.skip("JAX < 0.9: random draws from keys split on an Explicit axis")
    runner = MethodRunner.create(
        {},
        per_example_draws,
        mesh=mesh_1d(axis_type),
        prng_key=jax.random.key(0),
        pad_batches=True,
        mask_kwarg="mask",
    )
    keys = jax.random.split(jax.random.key(7), 5)
    x = np.arange(5, dtype=np.float32)
    want = np.asarray(jax.vmap(jax.random.uniform)(keys)) + x
    for batch_keys in (keys, jax.device_put(keys, jax.devices()[3])):
        _, out = runner({"key": batch_keys, "x": x})  # padded to 8 rows
        np.testing.assert_allclose(np.asarray(out.output_batch["draws"]), want)
        np.testing.assert_array_equal(np.asarray(out.output_batch["mask"]), [True] * 5)
        np.testing.assert_array_equal(
            jax.random.key_data(out.input_batch["key"]), jax.random.key_data(keys)
        )

    # Inside a trace (a runner called in `jax.jit`) the keys are padded there.
    @jax.jit
    def draws(keys: jax.Array, x: jax.Array) -> jax.Array:
        return runner({"key": keys, "x": x})[1].output_batch["draws"]

    with jax.set_mesh(runner.mesh):
        np.testing.assert_allclose(np.asarray(draws(keys, jnp.asarray(x))), want)


class Deep(eqx.Module):
    """Summaries of the rows two levels down (a call, then a scan over layers)."""

    w: jax.Array  # [layers, features, features]

    def evaluate(
        self, batch: dict[str, jax.Array], ctx: Context
    ) -> tuple[dict[str, jax.Array], Context]:
        def layer(h: jax.Array, w: jax.Array, ctx: Context) -> Any:
            h = jnp.tanh(h @ w)
            rows = ctx.row_mask
            assert rows is not None  # a padded step
            n = jnp.sum(rows.astype(jnp.float32))
            mean = jnp.sum(jnp.where(rows[:, None], h, 0.0)) / (n * h.shape[1])
            ctx = ctx.add_summary("mean", eqxctx.WeightedSummary(mean, n))
            ctx = ctx.add_summary("h", eqxctx.MomentsSummary(h, where=ctx.row_where(h)))
            return h, None, ctx

        def stack(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
            h, _, coll = eqxctx.scan_in_context(
                layer, context=ctx, carry=x, xs=self.w, merge_summaries=True
            )
            return h, ctx.merge(coll)

        h, ctx = ctx.call("stack", stack, batch["x"])
        return {"h": h}, ctx


def deep_reference(model: Deep, x: np.ndarray) -> list[np.ndarray]:
    """Each layer's activations over the real rows, in NumPy (float64)."""
    h, out = x.astype(np.float64), []
    for w in np.asarray(model.w):
        h = np.tanh(h @ w)
        out.append(h)
    return out


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_padded_summaries_read_the_row_mask_from_any_context(
    axis_type: AxisType,
) -> None:
    # issue 35 item 4: without `mask_kwarg` the zero rows counted in every summary
    # (a mean of 0.192 with weight 24 where the 9 real rows give 0.513 with weight
    # 9), and with it the mask had to be threaded by hand down to each summary.
    model = Deep(jax.random.normal(jax.random.PRNGKey(3), (2, 4, 4)) / 2)
    runner = MethodRunner.create(
        model,
        "evaluate",
        mesh=mesh_1d(axis_type),
        prng_key=jax.random.PRNGKey(0),
        pad_batches=True,
    )
    x = np.random.default_rng(0).normal(size=(29, 4)).astype(np.float32)
    batches = [x[:9], x[9:25], x[25:]]  # 9 -> 16, 16 (no padding), 4 -> 8 rows
    acc = eqxctx.SummaryAccumulator()
    for batch, out in zip(
        batches, eqxctx.run_batches(runner, [{"x": b} for b in batches]), strict=True
    ):
        assert out.output_batch["h"].shape == (len(batch), 4)
        acc = acc.update(out.summaries)
    got = acc.summaries()["stack"]["iter"]
    layers = deep_reference(model, x)
    every = np.concatenate(layers)  # merged over the layers, as the scan does
    assert float(got["mean"].weight) == 2 * len(x)  # real rows, once per layer
    np.testing.assert_allclose(float(got["mean"].value()), every.mean(), rtol=1e-5)
    stats = got["h"].value()
    assert int(stats["count"]) == every.size
    np.testing.assert_allclose(float(stats["mean"]), every.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(stats["variance"]), every.var(), rtol=1e-4)
    np.testing.assert_allclose(float(stats["min"]), every.min(), rtol=1e-5)
    np.testing.assert_allclose(float(stats["max"]), every.max(), rtol=1e-5)
    # The same ahead of time: the compiled runner passes the mask too.
    spec = {"x": jax.ShapeDtypeStruct((16, 4), jnp.float32)}
    _, out = runner.lower(spec).compile()({"x": x[:9]})
    _, want = runner({"x": x[:9]})
    np.testing.assert_allclose(
        float(out.summaries["stack"]["iter"]["mean"].value()),
        float(want.summaries["stack"]["iter"]["mean"].value()),
        rtol=1e-6,
    )


def unmasked_mean(
    model: Any, batch: dict[str, jax.Array], ctx: Context
) -> tuple[dict[str, jax.Array], Context]:
    n = jnp.float32(batch["x"].shape[0])
    ctx = ctx.add_summary("mean", eqxctx.WeightedSummary(jnp.mean(batch["x"]), n))
    return {"y": batch["x"]}, ctx


def test_a_padded_step_whose_summaries_never_read_the_mask_warns_once() -> None:
    # issue 35 item 4: the padded rows counted "without a word".
    mesh = mesh_1d(AxisType.Auto)
    kw: dict[str, Any] = {"mesh": mesh, "prng_key": jax.random.PRNGKey(0)}

    def method(*args: Any) -> Any:  # a step of its own: it warns once
        return unmasked_mean(*args)

    runner = MethodRunner.create({}, method, pad_batches=True, **kw)
    x = np.ones((9, 2), np.float32)
    with pytest.warns(
        UserWarning, match=r"pad_batches=True.*summaries \('mean'\).*ctx.row_mask"
    ):
        _, out = runner({"x": x})
    # What it warns about: the mean counts the 7 zero rows of the padded 16.
    assert float(out.summaries["mean"].weight) == 16
    np.testing.assert_allclose(float(out.summaries["mean"].value()), 9 / 16)
    # Once: not again for this signature, nor for a new padded size.
    runner({"x": x})
    runner({"x": np.ones((3, 2), np.float32)})
    assert runner.trace_count == 2
    # The documented filter silences it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*never read the row mask")

        def again(*args: Any) -> Any:
            return unmasked_mean(*args)

        MethodRunner.create({}, again, pad_batches=True, **kw)({"x": x})
    # A method that reads the mask, or gets it as `mask_kwarg`, is not warned.

    def reads(model: Any, batch: Any, ctx: Context) -> Any:
        del model
        assert ctx.row_mask is not None
        return unmasked_mean({}, batch, ctx)

    MethodRunner.create({}, reads, pad_batches=True, **kw)({"x": x})

    def takes(model: Any, batch: Any, ctx: Context, *, mask: jax.Array) -> Any:
        assert ctx.row_mask is mask  # the same array
        return unmasked_mean(model, batch, ctx)

    MethodRunner.create({}, takes, pad_batches=True, mask_kwarg="mask", **kw)({"x": x})
    # Without padding there is no mask and nothing to warn about.
    plain = MethodRunner.create({}, method, **kw)
    _, out = plain({"x": np.ones((8, 2), np.float32)})
    assert float(out.summaries["mean"].weight) == 8


def test_lowering_a_padded_runner_for_rows_that_do_not_divide_names_the_size() -> None:
    # issue 35 item 14: the message said "use a batch size divisible by 8" without
    # saying that `lower` takes the padded size.
    model, data = regressor(), eval_set(12)
    kw: dict[str, Any] = {"prng_key": jax.random.PRNGKey(0), "mask_kwarg": "mask"}

    def spec(rows: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {
            k: jax.ShapeDtypeStruct((rows, v.shape[1]), v.dtype)
            for k, v in data.items()
        }

    cases = [  # mesh, input partition, batch_sizes, rows, the size to lower for
        (mesh_1d(AxisType.Explicit), DataPartition.FULL, None, 5, 8),
        (mesh_1d(AxisType.Auto), DataPartition.FULL, (8, 16), 12, 16),
        (mesh_2d(AxisType.Auto), DataPartition.BATCH, None, 5, 8),
        (mesh_2d(AxisType.Auto), DataPartition.FULL, (4, 16), 7, 16),
    ]
    for mesh, partition, sizes, rows, padded in cases:
        runner = MethodRunner.create(
            model,
            "evaluate",
            mesh=mesh,
            input_partition=partition,
            pad_batches=True,
            batch_sizes=sizes,
            **kw,
        )
        with pytest.raises(
            ValueError,
            match=rf"`MethodRunner.lower`.*pad_batches=True.*padded size.*{rows} rows "
            rf".*Lower for {padded} rows",
        ):
            runner.lower(spec(rows))
        # Lowered for the padded size, it runs the smaller batch.
        part = {k: v[:rows] for k, v in data.items()}
        _, out = runner.lower(spec(padded)).compile()(part)
        ref_y, _ = numpy_reference(model, part)
        np.testing.assert_allclose(np.asarray(out.output_batch["y"]), ref_y, rtol=1e-5)
    # Without padding the message is the divisibility one.
    plain = MethodRunner.create(model, "evaluate", mesh=mesh_1d(AxisType.Auto), **kw)
    with pytest.raises(ValueError, match=r"Leaf 't' of shape \(5, 3\).*divisible by 8"):
        plain.lower(spec(5))


# -- donation ----------------------------------------------------------------------


def doubled(model: Any, batch: Any, ctx: Context, **kwargs: Any) -> tuple[Any, Context]:
    # The output has the batch's shape and dtype: XLA can reuse a donated buffer.
    return {"y": batch["x"] * 2 + kwargs.get("shift", 0.0)}, ctx


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_donated_batches_are_deleted_and_results_unchanged(
    axis_type: AxisType,
) -> None:
    mesh = mesh_1d(axis_type)
    kw: dict[str, Any] = {"mesh": mesh, "prng_key": jax.random.PRNGKey(0)}
    keep = MethodRunner.create({}, doubled, **kw)
    donate = MethodRunner.create({}, doubled, donate_batch=True, **kw)
    host = {"x": np.arange(64, dtype=np.float32).reshape(16, 4)}
    _, want = keep(host)
    placed = keep(host)[1].input_batch
    shift = {"shift": jnp.float32(0.0)}
    for call in (
        lambda b: donate(b),
        lambda b: donate(b, **shift),  # the path with keyword arguments
        lambda b: donate.lower(b).compile()(b),
    ):
        batch = {"x": jax.device_put(host["x"], placed["x"].sharding)}
        _, out = call(batch)
        assert out.input_batch is None
        assert batch["x"].is_deleted()
        np.testing.assert_array_equal(
            np.asarray(out.output_batch["y"]), np.asarray(want.output_batch["y"])
        )
    # A host batch: the placed copy is donated, the NumPy array is untouched.
    _, out = donate(host)
    np.testing.assert_array_equal(host["x"], np.arange(64).reshape(16, 4))
    np.testing.assert_array_equal(
        np.asarray(out.output_batch["y"]), np.asarray(want.output_batch["y"])
    )
    assert not placed["x"].is_deleted()  # the non-donating runner kept its input


def test_a_donated_batch_array_passed_again_is_refused() -> None:
    # XLA may write an output into a donated buffer that the call also reads as a
    # keyword argument or a parameter (JAX then fails, or the process crashes).
    mesh = mesh_1d(AxisType.Explicit)
    kw: dict[str, Any] = {"mesh": mesh, "prng_key": jax.random.PRNGKey(0)}
    host = np.arange(64, dtype=np.float32).reshape(16, 4)
    placed = MethodRunner.create({}, doubled, **kw)({"x": host})[1].input_batch["x"]
    donate = MethodRunner.create({}, doubled, donate_batch=True, **kw)
    x = jax.device_put(host, placed.sharding)
    with pytest.raises(
        ValueError, match=r"batch leaf 'x' is also passed as keyword argument shift"
    ):
        donate({"x": x}, shift=x)
    compiled = donate.lower({"x": x}, shift=x).compile()
    with pytest.raises(ValueError, match=r"`CompiledRunner\(donate_batch=True\)`"):
        compiled({"x": x}, shift=x)
    assert not x.is_deleted()  # refused before the call: nothing was donated
    # A parameter placed like the batch is the same array too.
    with_param = MethodRunner.create(
        {"w": host}, doubled, param_partition=P("data"), donate_batch=True, **kw
    )
    (w,) = with_param.param_leaves
    with pytest.raises(ValueError, match=r"'x' is also passed as the model's param"):
        with_param({"x": w})
    assert not w.is_deleted()
    # The same array twice in the batch.
    with pytest.raises(
        ValueError, match=r"batch leaf 'x' is also passed as the batch leaf 'z'"
    ):
        donate({"x": x, "z": x})
    # Copies are fine, and give the result.
    _, out = donate({"x": x}, shift=jnp.copy(x))
    np.testing.assert_array_equal(np.asarray(out.output_batch["y"]), host * 3)
    # The check keeps no parameter alive once its runner is gone.
    with_param({"x": host})
    param = weakref.ref(with_param.param_leaves[0])
    del with_param, w
    gc.collect()
    assert param() is None


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_a_donated_and_deleted_batch_passed_again_is_refused(
    axis_type: AxisType,
) -> None:
    # issue 35 item 8: XLA crashed the process (segfault) on >= 2 devices when a
    # batch array donated by the last call was passed again.
    mesh = mesh_1d(axis_type)
    kw: dict[str, Any] = {"mesh": mesh, "prng_key": jax.random.PRNGKey(0)}
    host = np.arange(64, dtype=np.float32).reshape(16, 4)
    donate = MethodRunner.create({}, doubled, donate_batch=True, **kw)
    sharding = donate({"x": host})[1].output_batch["y"].sharding
    x = jax.device_put(host, sharding)
    runner, out = donate({"x": x, "z": jnp.ones(16)})
    assert x.is_deleted()
    np.testing.assert_array_equal(np.asarray(out.output_batch["y"]), host * 2)
    calls = {
        "call": lambda b: runner(b),
        "call with kwargs": lambda b: runner(b, shift=jnp.float32(1.0)),
        "run_batches": lambda b: next(iter(eqxctx.run_batches(runner, [b]))),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"batch leaf 'x' .*deleted") as info:
            call({"x": x, "z": jnp.ones(16)})
        assert "donate_batch=True" in str(info.value), name
    compiled = donate.lower({"x": host}).compile()
    with pytest.raises(ValueError, match=r"`CompiledRunner.*batch leaf 'x' .*deleted"):
        compiled({"x": x})
    # A fresh array is fine afterwards.
    _, out = runner({"x": jax.device_put(host, sharding), "z": jnp.ones(16)})
    np.testing.assert_array_equal(np.asarray(out.output_batch["y"]), host * 2)


RAGGED_PAGE = (
    Path(__file__).parent.parent / "docs" / "examples" / "ragged_evaluation.md"
)


def test_ragged_evaluation_page(capsys: pytest.CaptureFixture[str]) -> None:
    """Runs docs/examples/ragged_evaluation.md and checks it against NumPy."""
    blocks = re.findall(r"```python\n(.*?)```", RAGGED_PAGE.read_text(), re.DOTALL)
    assert len(blocks) == 2
    ns: dict[str, Any] = {"__name__": "ragged_evaluation"}
    exec(compile("\n".join(blocks), str(RAGGED_PAGE), "exec"), ns)
    data, model = ns["data"], ns["model"]
    logits = data["x"] @ np.asarray(model.w)
    accuracy = float((logits.argmax(-1) == data["label"]).mean())
    np.testing.assert_allclose(ns["accuracy"], accuracy, rtol=1e-6)
    np.testing.assert_allclose(
        np.concatenate(ns["logits"]), logits, rtol=1e-4, atol=1e-5
    )
    stats = ns["stats"]
    assert int(stats["count"]) == logits.size
    np.testing.assert_allclose(stats["mean"], logits.mean(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(stats["variance"], logits.var(), rtol=1e-4)
    np.testing.assert_allclose(stats["min"], logits.min(), rtol=1e-5)
    np.testing.assert_allclose(stats["max"], logits.max(), rtol=1e-5)
    assert capsys.readouterr().out.splitlines() == [
        f"accuracy over 1000 rows: {accuracy:.4f}",
        f"logits: {logits.size} values, mean {float(stats['mean']):.4f}",
        "compilations: 1",
        "last batch: (40, 4)",
    ]


DECODING_PAGE = (
    Path(__file__).parent.parent / "docs" / "examples" / "greedy_decoding.md"
)


def test_greedy_decoding_page(capsys: pytest.CaptureFixture[str]) -> None:
    """Runs docs/examples/greedy_decoding.md: the runner's tokens equal the loop's."""
    blocks = re.findall(r"```python\n(.*?)```", DECODING_PAGE.read_text(), re.DOTALL)
    assert len(blocks) == 3
    ns: dict[str, Any] = {"__name__": "greedy_decoding"}
    exec(compile("\n".join(blocks), str(DECODING_PAGE), "exec"), ns)
    tokens, expected, prompts = ns["tokens"], ns["expected"], ns["prompts"]
    assert tokens.shape == (8, 12)
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_array_equal(tokens[:, :4], prompts)
    # Greedy steps do not all repeat one token: the check has something to compare.
    assert len(np.unique(tokens[:, 4:])) > 1
    # jax < 0.9 prints `PartitionSpec(...)` where later versions print `P(...)`.
    printed = capsys.readouterr().out.replace("PartitionSpec(", "P(").splitlines()
    assert printed[0].startswith("(8, 12) P(")
    assert printed[-1] == "same tokens: True"
    # The weights were split over `model`, the prompts over `data`.
    runner = ns["runner"]
    assert runner.params.wq.sharding.spec == P(None, "model")
    assert ns["out"].input_batch["prompt"].sharding.spec == P(("data",))


# -- the runner's values: Output, Settings, public-API rebuilds --------------------


def test_output_is_a_frozen_pytree_dataclass_and_settings_hold_no_caches() -> None:
    runner = MethodRunner.create(
        affine(), "apply", mesh=mesh_1d(AxisType.Auto), prng_key=jax.random.PRNGKey(0)
    )
    batch = {"x": np.ones((8, 4), np.float32), "id": np.arange(8, dtype=np.int32)}
    _, out = runner(batch)
    assert isinstance(out, MethodRunner.Output)
    assert [f.name for f in dataclasses.fields(out)] == [
        "output_batch",
        "input_batch",
        "summaries",
        "module_outputs",
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.output_batch = None  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(dataclasses.FrozenInstanceError, match="'extra'"):
        out.extra = None  # pyright: ignore[reportAttributeAccessIssue]
    doubled = jax.tree.map(lambda x: x * 2, out)
    assert isinstance(doubled, MethodRunner.Output)
    np.testing.assert_array_equal(
        np.asarray(doubled.input_batch["id"]), np.arange(8) * 2
    )
    assert len(jax.tree.leaves(out)) == 5  # y, id (out); x, id (in); n (summary)
    # Settings: hashable configuration only, equal for equal arguments.
    settings = runner.settings
    assert dataclasses.is_dataclass(settings)
    again = MethodRunner.create(
        affine(1), "apply", mesh=mesh_1d(AxisType.Auto), prng_key=jax.random.key(1)
    )
    assert hash(again.settings) == hash(settings)
    assert again.settings == settings
    assert again.step is runner.step
    for f in dataclasses.fields(settings):
        hash(getattr(settings, f.name))


def test_runner_is_a_frozen_pytree_dataclass_rebuilt_by_its_constructor() -> None:
    runner = MethodRunner.create(
        affine(), "apply", mesh=mesh_1d(AxisType.Auto), prng_key=jax.random.PRNGKey(0)
    )
    assert [f.name for f in dataclasses.fields(runner)] == [
        "param_leaves",
        "prng_key",
        "step",
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        runner.prng_key = jax.random.PRNGKey(1)  # pyright: ignore[reportAttributeAccessIssue]
    # Not a field either (Python 3.11's generated method raised a `super()` TypeError).
    with pytest.raises(dataclasses.FrozenInstanceError, match="'extra'"):
        runner.extra = 1  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(dataclasses.FrozenInstanceError, match="delete"):
        del runner.prng_key  # pyright: ignore[reportAttributeAccessIssue]
    # Children: the parameter leaves and the key; the step is static.
    leaves, treedef = jax.tree.flatten(runner)
    assert len(leaves) == len(runner.param_leaves) + 1
    assert leaves[-1] is runner.prng_key
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert isinstance(rebuilt, MethodRunner)
    assert rebuilt.step is runner.step
    batch = {"x": np.ones((8, 4), np.float32), "id": np.arange(8, dtype=np.int32)}
    nxt, _ = runner(batch)
    assert type(nxt) is MethodRunner
    assert nxt.step is runner.step
    assert nxt.param_leaves is runner.param_leaves  # the same placed parameters
    expected_key = jax.random.split(runner.prng_key)[0]
    np.testing.assert_array_equal(np.asarray(nxt.prng_key), np.asarray(expected_key))
    # Another key by `dataclasses.replace` gives the same result as a new runner.
    other = dataclasses.replace(runner, prng_key=nxt.prng_key)
    again = MethodRunner.create(
        affine(), "apply", mesh=mesh_1d(AxisType.Auto), prng_key=nxt.prng_key
    )
    for got, want in zip(
        jax.tree.leaves(other(batch)[1]), jax.tree.leaves(again(batch)[1]), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert "MethodRunner(" in repr(runner)
    assert "param_leaves" in repr(runner)


class _Constant(eqx.Module):
    w: jax.Array

    def apply(
        self, batch: dict[str, jax.Array], ctx: Context
    ) -> tuple[dict[str, jax.Array], Context]:
        del batch
        return {"z": self.w * 2}, ctx


def _constant_runner(
    cls: type[MethodRunner[Any, Any]] = MethodRunner,
) -> MethodRunner[Any, Any]:
    return cls.create(
        _Constant(jnp.arange(3.0)),
        "apply",
        mesh=mesh_1d(AxisType.Auto),
        prng_key=jax.random.PRNGKey(0),
        output_partition=DataPartition.REPLICATED,
    )


def test_runner_runs_an_empty_dict_batch_warm_and_cold() -> None:
    runner = _constant_runner()
    for _ in range(3):  # cold, then twice through the fast path's checks
        runner, out = runner({})
        np.testing.assert_array_equal(np.asarray(out.output_batch["z"]), [0, 2, 4])
        assert out.input_batch == {}
    outs = list(eqxctx.run_batches(_constant_runner(), [{}, {}]))
    assert len(outs) == 2
    np.testing.assert_array_equal(np.asarray(outs[1].output_batch["z"]), [0, 2, 4])


def test_runners_compare_like_modules_and_subclasses_stay_pytrees() -> None:
    a, b = _constant_runner(), _constant_runner()
    assert a == b  # `eqx.tree_equal`, as for an `eqx.Module`
    nxt, _ = a({})
    assert nxt != a  # another key
    with pytest.raises(TypeError):
        hash(a)

    class Sub(MethodRunner[Any, Any]):
        pass

    sub = _constant_runner(Sub)
    assert len(jax.tree.leaves(sub)) == 2  # the parameter and the key
    assert type(sub({})[0]) is Sub
    assert type(sub.lower({}).compile()({})[0]) is Sub
    key = jax.jit(lambda r: r.prng_key)(sub)
    np.testing.assert_array_equal(np.asarray(key), np.asarray(sub.prng_key))
    assert (a == 1) is False  # another type: not equal, no error
    with pytest.raises(TypeError, match="may add methods, not fields"):

        class WithField(MethodRunner[Any, Any]):  # pyright: ignore[reportUnusedClass]
            extra: int = 0


def test_runner_internals_use_public_apis_only() -> None:
    """No `object.__new__`, `__dict__` writes or `__getattribute__` overrides (#11)."""
    src = Path(eqxctx.__file__).parent
    names = ("_runner", "_step", "_aot", "_plan", "_traced", "_transfer")
    for name in (*names, "_meshes", "_donation"):
        text = (src / f"{name}.py").read_text()
        for banned in ("object.__new__", "__dict__", "__getattribute__ =", "_setattr"):
            assert banned not in text, (name, banned)

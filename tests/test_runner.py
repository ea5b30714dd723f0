"""MethodRunner, run_batches and SummaryAccumulator on 8 simulated CPU devices."""

import collections
import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqxctx
from eqxctx import Context, DataPartition, MethodRunner
from eqxctx._step import Step


pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 (simulated) devices"
)

TRACES: list[str] = []


class MLP(eqx.Module):
    w1: jax.Array
    b1: jax.Array
    w2: jax.Array
    scale: float = eqx.field(static=True)
    name: str = "mlp"  # a non-array leaf: static, like in eqx.filter_jit
    # Explicit meshes: the sharding of `h @ w2` when its contracted axis is split.
    out_sharding: Any = eqx.field(static=True, default=None)

    def predict(
        self, batch: dict[str, Any], ctx: Context, *, shift: Any = 0.0
    ) -> tuple[dict[str, jax.Array], Context]:
        TRACES.append(self.name)
        x = batch["x"]

        def stats(x: jax.Array, ctx: Context) -> tuple[None, Context]:
            ctx = ctx.add_module_output("x_mean", jnp.mean(x, axis=0))
            return None, ctx.add_module_output("x_max", jnp.max(x))

        _, ctx = ctx.call("input_stats", stats, x)
        h = jax.nn.relu(x @ self.w1 + self.b1[None, :])
        y = jnp.matmul(h, self.w2, out_sharding=self.out_sharding) * self.scale + shift
        noise = jax.random.uniform(ctx.prng_key, (x.shape[0],))
        n = jnp.asarray(x.shape[0], jnp.float32)
        ctx = ctx.add_summary("y_mean", eqxctx.WeightedSummary(jnp.mean(y), n))
        ctx = ctx.add_summary("y_min", eqxctx.MinSummary(jnp.min(y)))
        ctx = ctx.add_summary("count", n)
        return {"y": y, "noise": noise, "label": batch["label"] + 1}, ctx


def make_model(seed: int = 0, hidden: int = 8, out_sharding: Any = None) -> MLP:
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return MLP(
        jax.random.normal(k1, (4, hidden)),
        jax.random.normal(k2, (hidden,)),
        jax.random.normal(k3, (hidden, 3)),
        scale=0.5,
        out_sharding=out_sharding,
    )


def make_batch(n: int = 16, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(n, 4)).astype(np.float32),
        "label": np.arange(n, dtype=np.int32),
    }


def reference(
    model: MLP, batch: dict[str, Any], key: jax.Array, **kwargs: Any
) -> tuple[jax.Array, dict[str, jax.Array], eqxctx.OutputCollection]:
    """The unsharded computation on one device: AXLearn's key split, then the method."""
    new_key, iter_key = jax.random.split(key)
    out, ctx = model.predict(
        jax.tree.map(jnp.asarray, batch), Context.root(prng_key=iter_key), **kwargs
    )
    return new_key, out, ctx.collection


def mesh_1d(axis_type: AxisType = AxisType.Auto) -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("data",), axis_types=(axis_type,))


def mesh_2d(axis_type: AxisType = AxisType.Auto) -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)


def model_parallel(path: str, leaf: jax.Array) -> P:
    """Weight matrices split over `model`; the rest replicated."""
    return {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}[path]


def spec_of(x: jax.Array) -> tuple[Any, ...]:
    """The sharding spec without trailing Nones (Auto and Explicit compare equal)."""
    assert isinstance(x.sharding, NamedSharding)
    spec = list(x.sharding.spec)
    while spec and spec[-1] is None:
        spec.pop()
    return tuple(spec)


def assert_matches_reference(
    out: MethodRunner.Output[Any], model: MLP, batch: dict[str, Any], key: jax.Array
) -> None:
    _, ref_out, ref_coll = reference(model, batch, key)
    for name in ("y", "noise", "label"):
        np.testing.assert_allclose(
            np.asarray(out.output_batch[name]),
            np.asarray(ref_out[name]),
            rtol=1e-5,
            atol=1e-5,
        )
    ref_sum = ref_coll.flatten("summaries")
    got_sum = eqxctx.OutputCollection(out.summaries, {}, {}).flatten("summaries")
    assert got_sum.keys() == ref_sum.keys()
    for k, v in ref_sum.items():
        a, b = jax.tree.leaves(got_sum[k]), jax.tree.leaves(v)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


MESHES = {
    "one_device": lambda: jax.make_mesh((1,), ("data",), devices=jax.devices()[:1]),
    "auto_1d": lambda: mesh_1d(AxisType.Auto),
    "explicit_1d": lambda: mesh_1d(AxisType.Explicit),
    "auto_2d_model_parallel": lambda: mesh_2d(AxisType.Auto),
    "explicit_2d_model_parallel": lambda: mesh_2d(AxisType.Explicit),
}


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_sharded_equals_unsharded(mesh_name: str) -> None:
    mesh = MESHES[mesh_name]()
    two_d = "2d" in mesh_name
    explicit = "explicit" in mesh_name
    model, batch, key = make_model(), make_batch(), jax.random.PRNGKey(3)
    if explicit and two_d:
        model = make_model(out_sharding=NamedSharding(mesh, P("data", None)))
    # Explicit axes: a batch split over `model` cannot meet weights split over
    # `model` in one matmul (JAX's sharding-in-types rejects it), so use BATCH.
    input_partition = DataPartition.BATCH if explicit and two_d else DataPartition.FULL
    runner = MethodRunner.create(
        model,
        "predict",
        mesh=mesh,
        prng_key=key,
        input_partition=input_partition,
        param_partition=model_parallel if two_d else None,
        drop_module_outputs=lambda path: False,
    )
    new_runner, out = runner(batch)
    assert_matches_reference(out, model, batch, key)
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(new_runner.prng_key)),
        np.asarray(jax.random.key_data(jax.random.split(key)[0])),
    )
    # Shardings: inputs by the input partition, outputs BATCH, module outputs and
    # summaries replicated, the key replicated.
    in_axes = ("data", "model") if two_d and not explicit else ("data",)
    if input_partition is DataPartition.FULL and two_d:
        assert spec_of(out.input_batch["x"]) == (in_axes,)
    else:
        assert spec_of(out.input_batch["x"]) in ((("data",),), ("data",))
    assert spec_of(out.input_batch["label"]) == spec_of(out.input_batch["x"])[:1]
    # On one device every spec is the same placement; jax < 0.9 reports P() there.
    one_device = () if mesh.size == 1 else ("data",)
    assert spec_of(out.output_batch["y"]) in ((("data",),), ("data",), one_device)
    assert spec_of(out.output_batch["noise"]) == spec_of(out.output_batch["y"])
    for leaf in jax.tree.leaves((out.module_outputs, out.summaries)):
        assert leaf.sharding.is_fully_replicated
    assert new_runner.prng_key.sharding.is_fully_replicated
    if two_d:
        assert spec_of(new_runner.params.w1) == (None, "model")
        assert spec_of(new_runner.params.w2) == ("model",)
    np.testing.assert_allclose(
        np.asarray(out.module_outputs["input_stats"]["x_mean"]),
        batch["x"].mean(axis=0),
        rtol=1e-5,
    )


def test_key_sequence_matches_axlearn() -> None:
    model, batch, key = make_model(), make_batch(), jax.random.PRNGKey(7)
    runner = MethodRunner.create(model, "predict", mesh=mesh_1d(), prng_key=key)
    expected_key = key
    for _ in range(3):
        expected_key, iter_key = jax.random.split(expected_key)
        runner, out = runner(batch)
        np.testing.assert_array_equal(
            np.asarray(runner.prng_key), np.asarray(expected_key)
        )
        np.testing.assert_allclose(
            np.asarray(out.output_batch["noise"]),
            np.asarray(jax.random.uniform(iter_key, (16,))),
        )


def test_typed_key_and_same_runner_twice() -> None:
    model, batch = make_model(), make_batch()
    runner = MethodRunner.create(
        model, "predict", mesh=mesh_1d(), prng_key=jax.random.key(5)
    )
    r1, out1 = runner(batch)
    r2, out2 = runner(batch)
    assert eqx.tree_equal(out1.output_batch, out2.output_batch)
    assert jnp.array_equal(
        jax.random.key_data(r1.prng_key), jax.random.key_data(r2.prng_key)
    )
    _, out3 = r1(batch)
    assert not np.array_equal(out3.output_batch["noise"], out1.output_batch["noise"])
    # The runner is unchanged by calls (a value).
    assert jnp.array_equal(
        jax.random.key_data(runner.prng_key), jax.random.key_data(jax.random.key(5))
    )


def test_host_local_global_and_mixture_give_identical_results() -> None:
    model, batch, key = make_model(), make_batch(), jax.random.PRNGKey(0)
    mesh = mesh_2d()
    runner = MethodRunner.create(model, "predict", mesh=mesh, prng_key=key)
    full = NamedSharding(mesh, P(("data", "model")))
    pre_sharded = {k: jax.device_put(v, full) for k, v in batch.items()}
    mixture = {"x": pre_sharded["x"], "label": batch["label"]}
    # A single-device array is host-local too; a wrongly sharded global array is
    # resharded.
    other = {
        "x": jax.device_put(batch["x"], jax.devices()[3]),
        "label": jax.device_put(batch["label"], NamedSharding(mesh, P())),
    }
    outs = [runner(b)[1] for b in (batch, pre_sharded, mixture, other)]
    for out in outs[1:]:
        assert eqx.tree_equal(out.output_batch, outs[0].output_batch)
        assert eqx.tree_equal(out.input_batch, outs[0].input_batch)
        for a, b in zip(
            jax.tree.leaves(out.input_batch),
            jax.tree.leaves(outs[0].input_batch),
            strict=True,
        ):
            assert a.sharding == b.sharding
    # Pre-sharded inputs pass through untouched.
    assert outs[1].input_batch["x"] is pre_sharded["x"]
    # Chaining: the outputs of one call feed the next without a transfer.
    _, again = runner(outs[0].input_batch)
    assert again.input_batch["x"] is outs[0].input_batch["x"]


def test_dict_batches_after_a_placed_one_are_checked_leaf_by_leaf(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plain dict batch with the last batch's keys skips flattening (fast path).

    Every variant that is not already placed must still be placed: NumPy leaves,
    wrongly sharded leaves, other keys, other insertion order, dict subclasses.
    """
    model, batch, key = make_model(), make_batch(), jax.random.PRNGKey(0)
    mesh = mesh_1d()
    runner = MethodRunner.create(model, "predict", mesh=mesh, prng_key=key)
    full = NamedSharding(mesh, P("data"))
    _, first = runner(batch)
    placed = first.input_batch
    assert all(x.sharding == full for x in placed.values())
    ref = first.output_batch
    placements: list[int] = []
    place_batch = Step.place_batch

    def counting(self: Step, leaves: Any, treedef: Any, lowered: Any = None) -> Any:
        placements.append(1)
        return place_batch(self, leaves, treedef, lowered)

    monkeypatch.setattr(Step, "place_batch", counting)
    wrong = jax.device_put(batch["x"], NamedSharding(mesh, P()))
    variants: list[dict[str, Any]] = [
        dict(placed),  # fast path: passed through
        {"x": placed["x"], "label": batch["label"]},  # a NumPy leaf
        {"x": wrong, "label": placed["label"]},  # another sharding
        {"label": placed["label"], "x": placed["x"]},  # another insertion order
        {"x": placed["x"], "label": placed["label"], "extra": batch["label"]},
        {"x": placed["x"], "lbl": placed["label"], "label": batch["label"]},
        {"x": placed["x"], "label": {"nested": batch["label"]}},
        collections.OrderedDict(placed),
        dict(placed),  # found in the cache by its structure: passed through
        dict(placed),  # back to the fast path
    ]
    for i, b in enumerate(variants):
        if i == 6:  # a nested value reaches the method: label["nested"] + 1
            with pytest.raises(TypeError):
                runner(b)
            continue
        placements.clear()
        _, out = runner(b)
        # Only a batch with the last batch's keys and shardings skips placing.
        assert len(placements) == (0 if i in (0, 3, 9) else 1), i
        assert out.input_batch.keys() == b.keys()
        for name, x in out.input_batch.items():
            assert isinstance(x, jax.Array)
            assert x.sharding == full, (i, name)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(b[name]))
        np.testing.assert_allclose(
            np.asarray(out.output_batch["y"]), np.asarray(ref["y"]), rtol=1e-6
        )
        np.testing.assert_array_equal(
            np.asarray(out.output_batch["label"]), np.asarray(ref["label"])
        )
        if i in (0, 3, 7, 8, 9):
            assert out.input_batch["x"] is placed["x"]
        if i == 1:
            assert out.input_batch["x"] is placed["x"]
            assert out.input_batch["label"] is not placed["label"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QArray:
    """A PyTree of two arrays that looks like an array (`.sharding`, `.ndim`)."""

    value: jax.Array
    scale: Any

    @property
    def sharding(self) -> Any:
        return self.value.sharding

    @property
    def ndim(self) -> int:
        return self.value.ndim


class Dequantize(eqx.Module):
    def f(self, batch: dict[str, Any], ctx: Context) -> tuple[Any, Context]:
        x = batch["x"]
        x = x.value * x.scale if isinstance(x, QArray) else x
        return {"y": jnp.sum(x, axis=-1) if jnp.ndim(x) else x}, ctx


def test_batch_leaves_are_checked_by_type_and_rank_not_only_sharding() -> None:
    """A warm runner places what a fresh runner would place."""
    mesh = mesh_2d()
    full = NamedSharding(mesh, P(("data", "model")))

    def fresh(b: Any, **kw: Any) -> MethodRunner.Output[Any]:
        r = MethodRunner.create(
            Dequantize(), "f", mesh=mesh, prng_key=jax.random.PRNGKey(0), **kw
        )
        return r(b)[1]

    # A PyTree with a `.sharding` is not an array: its leaves are placed.
    runner = MethodRunner.create(
        Dequantize(), "f", mesh=mesh, prng_key=jax.random.PRNGKey(0)
    )
    runner, _ = runner({"x": np.ones((8, 4), np.float32)})
    q = QArray(jax.device_put(jnp.ones((8, 4)), full), np.full((8, 1), 3.0, np.float32))
    _, out = runner({"x": q})
    assert isinstance(out.input_batch["x"].scale, jax.Array)
    assert out.input_batch["x"].scale.sharding == full
    np.testing.assert_allclose(np.asarray(out.output_batch["y"]), np.full(8, 12.0))
    # A leaf whose rank changed, with the sharding of the old rank's spec.
    for partition, first, second, want in (
        (P("data", "model"), np.ones((8,), np.float32), P("data"), ("data", "model")),
        (DataPartition.FULL, np.float32(3), P(), (("data", "model"),)),
    ):
        runner = MethodRunner.create(
            Dequantize(),
            "f",
            mesh=mesh,
            prng_key=jax.random.PRNGKey(0),
            input_partition=partition,
        )
        runner, _ = runner({"x": first})
        x2 = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, second))
        _, out = runner({"x": x2})
        assert spec_of(out.input_batch["x"]) == want
        assert spec_of(
            fresh({"x": x2}, input_partition=partition).input_batch["x"]
        ) == (want)
        np.testing.assert_allclose(np.asarray(out.output_batch["y"]), np.full(8, 4.0))


def test_input_batch_never_aliases_the_callers_containers() -> None:
    mesh = mesh_2d()
    full = NamedSharding(mesh, P(("data", "model")))
    runner = MethodRunner.create(
        Dequantize(), "f", mesh=mesh, prng_key=jax.random.PRNGKey(0)
    )
    for make in (lambda x: {"x": x}, lambda x: [{"x": x}][0], lambda x: ({"x": x},)):
        buf = make(jax.device_put(jnp.zeros((8, 4)), full))
        batch = buf if isinstance(buf, dict) else buf[0]
        runner, _ = runner(batch)  # placed: now on the fast path
        outs = []
        for i in range(3):
            batch["x"] = jax.device_put(jnp.full((8, 4), float(i)), full)
            runner, out = runner(batch)
            outs.append(out)
        assert [float(o.input_batch["x"][0, 0]) for o in outs] == [0.0, 1.0, 2.0]
        assert all(o.input_batch is not batch for o in outs)
    # A tuple batch (the general path) gets new containers too.
    tupled = MethodRunner.create(
        TupleIn(), "f", mesh=mesh, prng_key=jax.random.PRNGKey(0)
    )
    inner = [jax.device_put(jnp.ones((8, 4)), full)]
    tupled, _ = tupled((inner,))
    _, out = tupled((inner,))
    assert out.input_batch[0] is not inner
    assert out.input_batch[0][0] is inner[0]


class TupleIn(eqx.Module):
    def f(self, batch: Any, ctx: Context) -> tuple[Any, Context]:
        return jnp.sum(batch[0][0], axis=-1), ctx


class Scaled(eqx.Module):
    n: Any  # a non-array leaf: static

    def f(self, batch: dict[str, Any], ctx: Context) -> tuple[Any, Context]:
        y = jnp.full(batch["x"].shape, self.n)  # the dtype follows the leaf's type
        return {"y": y, "label": str(self.n)}, ctx


def test_static_leaves_equal_in_value_but_not_type_do_not_share_a_compilation() -> None:
    mesh = mesh_1d()
    batch = {"x": np.ones((8,), np.int32)}
    outs = {}
    for n in (2, 2.0, True):
        runner = MethodRunner.create(
            Scaled(n), "f", mesh=mesh, prng_key=jax.random.PRNGKey(0)
        )
        outs[type(n)] = runner(batch)[1].output_batch
    assert outs[int]["label"] == "2"
    assert outs[float]["label"] == "2.0"
    assert outs[bool]["label"] == "True"
    assert outs[int]["y"].dtype == jnp.int32
    assert outs[float]["y"].dtype == jnp.float32
    assert outs[bool]["y"].dtype == jnp.bool_


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_runner_called_inside_jit_and_eval_shape(axis_type: AxisType) -> None:
    model, batch, key = make_model(), make_batch(), jax.random.PRNGKey(0)
    runner = MethodRunner.create(
        model, "predict", mesh=mesh_1d(axis_type), prng_key=key
    )
    want_runner, want = runner(batch)

    @jax.jit
    def step(r: MethodRunner[Any, Any], b: dict[str, Any]) -> Any:
        r, out = r(b)
        return r, out.output_batch, out.summaries

    got_runner, got, summaries = step(runner, batch)
    np.testing.assert_array_equal(
        np.asarray(got_runner.prng_key), np.asarray(want_runner.prng_key)
    )
    for name in ("y", "noise", "label"):
        np.testing.assert_allclose(
            np.asarray(got[name]), np.asarray(want.output_batch[name]), rtol=1e-6
        )
    assert spec_of(got["y"]) == ("data",)
    np.testing.assert_allclose(
        np.asarray(summaries["y_mean"].value()),
        np.asarray(want.summaries["y_mean"].value()),
        rtol=1e-6,
    )
    shapes = jax.eval_shape(lambda r, b: r(b)[1].output_batch, runner, batch)
    assert shapes["y"].shape == (16, 3)


def test_runner_called_inside_jit_on_a_batch_it_closes_over() -> None:
    model, batch, key = make_model(), make_batch(), jax.random.PRNGKey(0)
    runner = MethodRunner.create(model, "predict", mesh=mesh_1d(), prng_key=key)
    _, want = runner(batch)
    got = jax.jit(lambda r: r(batch)[1].output_batch)(runner)
    np.testing.assert_allclose(
        np.asarray(got["y"]), np.asarray(want.output_batch["y"]), rtol=1e-6
    )
    shapes = jax.eval_shape(lambda r: r(batch)[1].output_batch, runner)
    assert shapes["noise"].shape == (16,)
    _, again = runner(batch)  # the traced call left nothing behind
    assert eqx.tree_equal(again.output_batch, want.output_batch)


class StaticScale(eqx.Module):
    w: jax.Array
    scale: Any = eqx.field(static=True)

    def f(self, batch: dict[str, Any], ctx: Context) -> tuple[Any, Context]:
        return {"y": jnp.full(batch["x"].shape, self.scale)}, ctx


def test_static_fields_equal_in_value_but_not_type_do_not_share_a_compilation() -> None:
    batch = {"x": np.ones((8,), np.int32)}
    dtypes = []
    for scale in (2, 2.0):
        runner = MethodRunner.create(
            StaticScale(jnp.ones(2), scale),
            "f",
            mesh=mesh_1d(),
            prng_key=jax.random.PRNGKey(0),
        )
        dtypes.append(runner(batch)[1].output_batch["y"].dtype)
    assert dtypes == [jnp.int32, jnp.float32]


def test_compiled_runner_places_kwargs_and_bind_checks_parameters() -> None:
    model, batch, key = make_model(), make_batch(), jax.random.PRNGKey(0)
    mesh = mesh_2d()
    runner = MethodRunner.create(model, "predict", mesh=mesh, prng_key=key)
    compiled = runner.lower(batch, shift=jnp.zeros((16, 3))).compile()
    _, ref, _ = reference(model, batch, key, shift=1.5)
    host = np.full((16, 3), 1.5, np.float32)
    for shift in (
        jax.device_put(host, jax.devices()[0]),  # committed to one device
        jax.device_put(host, NamedSharding(mesh, P("model"))),
        host,
    ):
        _, out = compiled(batch, shift=shift)
        _, out_call = runner(batch, shift=shift)
        np.testing.assert_allclose(np.asarray(out.output_batch["y"]), ref["y"], 1e-5)
        np.testing.assert_allclose(
            np.asarray(out_call.output_batch["y"]), ref["y"], rtol=1e-5
        )
    with pytest.raises(ValueError, match=r"static: pass `jnp\.asarray"):
        compiled(batch, shift=1.5)
    # A missing (or extra) keyword argument is named as such.
    with pytest.raises(ValueError, match=r"lowered with \['shift'\], called with \[\]"):
        compiled(batch)
    with pytest.raises(ValueError, match=r"called with \['other', 'shift'\]"):
        compiled(batch, shift=host, other=1)
    # An array keyword argument can be lowered from its shape and dtype.
    from_struct = runner.lower(
        batch, shift=jax.ShapeDtypeStruct((16, 3), jnp.float32)
    ).compile()
    _, out = from_struct(batch, shift=host)
    np.testing.assert_allclose(np.asarray(out.output_batch["y"]), ref["y"], 1e-5)
    wider = MethodRunner.create(
        make_model(hidden=16), "predict", mesh=mesh, prng_key=key
    )
    with pytest.raises(ValueError, match="shape, dtype or sharding"):
        compiled.bind(wider)


def test_batch_leaves_that_are_not_arrays_get_a_clear_error() -> None:
    runner = MethodRunner.create(
        Dequantize(), "f", mesh=mesh_1d(), prng_key=jax.random.PRNGKey(0)
    )
    spec = {"x": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    with pytest.raises(TypeError, match=r"'x'.*ShapeDtypeStruct.*runner\.lower"):
        runner(spec)

    class Box(dict[str, Any]):  # not a registered PyTree: one opaque leaf
        pass

    with pytest.raises(TypeError, match=r"batch leaf 'x' is a Box, not an array"):
        runner({"x": Box(a=np.ones((8, 4), np.float32))})
    with pytest.raises(TypeError, match=r"batch leaf 'name' is a str, not an array"):
        runner({"x": np.ones((8, 4), np.float32), "name": "abc"})


def test_copied_runners_share_settings_and_give_the_same_results() -> None:
    model, batch, key = make_model(), make_batch(), jax.random.PRNGKey(0)
    runner = MethodRunner.create(model, "predict", mesh=mesh_1d(), prng_key=key)
    _, want = runner(batch)
    for clone in (copy.copy(runner), copy.deepcopy(runner)):
        assert clone.settings is runner.settings
        assert eqx.tree_equal(clone, runner)
        _, got = clone(batch)
        assert eqx.tree_equal(got.output_batch, want.output_batch)


def test_params_in_the_model_structure_and_runner_leaves() -> None:
    model = make_model()
    runner = MethodRunner.create(
        model, "predict", mesh=mesh_1d(), prng_key=jax.random.PRNGKey(3)
    )
    # Flattened once in `create`; `params` and `model` rebuild the structure.
    assert isinstance(runner.param_leaves, tuple)
    assert len(runner.param_leaves) == 3
    assert isinstance(runner.params, MLP)
    assert runner.params.name is None  # the non-array part is in `settings`
    assert eqx.tree_equal(runner.model, model)
    # The runner is a PyTree of its parameters and its key.
    leaves = jax.tree.leaves(runner)
    assert len(leaves) == 4
    arrays = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    for got, want in zip(leaves[:3], arrays, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(
        np.asarray(leaves[3]), np.asarray(jax.random.PRNGKey(3))
    )


def cache_size(jitted: Any) -> int:
    """The number of entries in a `jax.jit` function's C++ dispatch cache."""
    return jitted._cache_size()


def named_model(name: str, seed: int = 0) -> MLP:
    return eqx.tree_at(lambda m: m.name, make_model(seed=seed), name)


def test_one_compilation_and_no_retrace() -> None:
    TRACES.clear()
    batch = make_batch()
    # A static part of its own, so that no other test shares this compilation cache.
    runner = MethodRunner.create(
        named_model("compiles"),
        "predict",
        mesh=mesh_1d(),
        prng_key=jax.random.PRNGKey(0),
    )
    jitted = runner.step.jitted
    assert cache_size(jitted) == 0
    runner, out = runner(batch)
    for _ in range(3):
        runner, out = runner(batch)
    jax.block_until_ready(out)
    assert TRACES == ["compiles"]
    assert cache_size(jitted) == 1  # the key's sharding is stable from call 1
    # Global inputs from a previous call, and a runner re-created from equal settings
    # (other parameter values, equal static parts) share the compilation.
    runner, _ = runner(out.input_batch)
    again = MethodRunner.create(
        named_model("compiles", seed=9),
        "predict",
        mesh=mesh_1d(),
        prng_key=jax.random.PRNGKey(1),
    )
    assert again.settings == runner.settings
    assert again.step.jitted is jitted
    again(batch)
    assert TRACES == ["compiles"]
    assert cache_size(jitted) == 1
    # A new batch shape compiles once more, then is cached.
    for _ in range(3):
        runner, _ = runner(make_batch(n=24))
    assert TRACES == ["compiles"] * 2
    assert cache_size(jitted) == 2
    # Other static settings do not share the compilation.
    other = MethodRunner.create(
        named_model("other"), "predict", mesh=mesh_1d(), prng_key=jax.random.PRNGKey(1)
    )
    assert other.settings != runner.settings
    other(batch)
    assert TRACES[-1] == "other"


def test_no_retrace_with_assert_max_traces() -> None:
    @eqx.debug.assert_max_traces(max_traces=1)
    def method(model: MLP, batch: Any, ctx: Context) -> tuple[Any, Context]:
        return batch["x"] @ model.w1, ctx

    runner = MethodRunner.create(
        make_model(), method, mesh=mesh_1d(), prng_key=jax.random.PRNGKey(0)
    )
    for _ in range(3):
        runner, _ = runner(make_batch())
    runner.__class__.create(
        make_model(seed=4), method, mesh=mesh_1d(), prng_key=jax.random.PRNGKey(1)
    )(make_batch())


def test_method_kwargs_traced_and_static() -> None:
    TRACES.clear()
    model, batch, key = make_model(hidden=6), make_batch(), jax.random.PRNGKey(0)
    runner = MethodRunner.create(model, "predict", mesh=mesh_1d(), prng_key=key)
    _, out = runner(batch, shift=jnp.asarray(2.0))
    _, out2 = runner(batch, shift=jnp.asarray(3.0))
    assert len(TRACES) == 1  # arrays are traced
    np.testing.assert_allclose(
        np.asarray(out2.output_batch["y"] - out.output_batch["y"]), 1.0, rtol=1e-5
    )
    _, out3 = runner(batch, shift=1.5)  # a Python float is static: a new trace
    assert len(TRACES) == 2
    _, ref, _ = reference(model, batch, key, shift=1.5)
    np.testing.assert_allclose(np.asarray(out3.output_batch["y"]), ref["y"], rtol=1e-5)
    # An array committed to one device off the mesh's device set is replicated.
    off_mesh = jax.device_put(jnp.asarray(2.0), jax.devices()[3])
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[4:])
    runner = MethodRunner.create(model, "predict", mesh=mesh, prng_key=key)
    _, out4 = runner(batch, shift=off_mesh)
    _, ref, _ = reference(model, batch, key, shift=2.0)
    np.testing.assert_allclose(np.asarray(out4.output_batch["y"]), ref["y"], rtol=1e-5)


def test_drop_module_outputs_paths_and_default() -> None:
    seen: list[str] = []

    def drop(path: str) -> bool:
        seen.append(path)
        return path == "input_stats/x_max"

    model, batch = make_model(), make_batch()
    key = jax.random.PRNGKey(0)
    runner = MethodRunner.create(
        model, "predict", mesh=mesh_1d(), prng_key=key, drop_module_outputs=drop
    )
    _, out = runner(batch)
    assert set(seen) == {"input_stats/x_mean", "input_stats/x_max", "input_stats"}
    assert list(out.module_outputs["input_stats"]) == ["x_mean"]
    default = MethodRunner.create(model, "predict", mesh=mesh_1d(), prng_key=key)
    assert default(batch)[1].module_outputs == {}


def test_summaries_from_scan_and_non_array_outputs() -> None:
    def method(model: MLP, batch: Any, ctx: Context) -> tuple[Any, Context]:
        def body(
            carry: jax.Array, x: jax.Array, ctx: Context
        ) -> tuple[jax.Array, None, Context]:
            return carry + x, None, ctx.add_summary("step", x)

        carry, _, coll = eqxctx.scan_in_context(
            body, context=ctx, carry=jnp.zeros(4), xs=batch["x"][:3]
        )
        ctx = ctx.merge(coll).add_summary("python_number", 2.5)
        return {"carry": carry, "tag": "done"}, ctx

    batch = make_batch()
    runner = MethodRunner.create(
        make_model(),
        method,
        mesh=mesh_1d(),
        prng_key=jax.random.PRNGKey(0),
        # `carry` has no batch axis: 4 rows do not divide over 8 devices.
        output_partition=DataPartition.REPLICATED,
    )
    _, out = runner(batch)
    flat = eqxctx.OutputCollection(out.summaries, {}, {}).flatten("summaries")
    assert set(flat) == {"iter0/step", "iter1/step", "iter2/step", "python_number"}
    np.testing.assert_allclose(np.asarray(flat["iter2/step"]), batch["x"][2])
    assert flat["python_number"] == 2.5
    assert out.output_batch["tag"] == "done"
    np.testing.assert_allclose(
        np.asarray(out.output_batch["carry"]), batch["x"][:3].sum(0), rtol=1e-5
    )


def test_lower_and_compile_match_the_call() -> None:
    model, batch, key = make_model(), make_batch(), jax.random.PRNGKey(2)
    runner = MethodRunner.create(model, "predict", mesh=mesh_2d(), prng_key=key)
    spec = {
        "x": jax.ShapeDtypeStruct((16, 4), jnp.float32),
        "label": jax.ShapeDtypeStruct((16,), jnp.int32),
    }
    lowered = runner.lower(spec)
    assert "func" in lowered.as_text()
    compiled = lowered.compile()
    r_aot, out_aot = compiled(batch)
    r_jit, out_jit = runner(batch)
    assert eqx.tree_equal(out_aot.output_batch, out_jit.output_batch)
    assert jnp.array_equal(r_aot.prng_key, r_jit.prng_key)
    # ShapeDtypeStructs with shardings are taken as they are.
    sharded = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        out_jit.input_batch,
    )
    _, out2 = runner.lower(sharded).compile()(out_jit.input_batch)
    assert eqx.tree_equal(out2.output_batch, out_jit.output_batch)


def test_compiled_runner_in_a_loop_follows_the_key_sequence() -> None:
    model, batch, key = make_model(), make_batch(), jax.random.PRNGKey(5)
    runner = MethodRunner.create(model, "predict", mesh=mesh_1d(), prng_key=key)
    compiled = runner.lower(batch).compile()
    assert compiled.runner is runner
    jit_runner = runner
    for _ in range(3):
        aot_runner, aot_out = compiled(batch)
        again_runner, _ = compiled(batch)  # the same binding: the same key
        assert jnp.array_equal(again_runner.prng_key, aot_runner.prng_key)
        jit_runner, jit_out = jit_runner(batch)
        assert jnp.array_equal(aot_runner.prng_key, jit_runner.prng_key)
        np.testing.assert_array_equal(
            np.asarray(aot_out.output_batch["noise"]),
            np.asarray(jit_out.output_batch["noise"]),
        )
        compiled = compiled.bind(aot_runner)
    other = MethodRunner.create(
        named_model("other"), "predict", mesh=mesh_1d(), prng_key=key
    )
    with pytest.raises(ValueError, match="other settings"):
        compiled.bind(other)


def test_errors() -> None:
    model, key = make_model(), jax.random.PRNGKey(0)
    with pytest.raises(AttributeError, match=r"no method 'predcit'.*\['predict'\]"):
        MethodRunner.create(model, "predcit", mesh=mesh_1d(), prng_key=key)
    with pytest.raises(ValueError, match=r"mesh has axes \('x',\)"):
        MethodRunner.create(
            model, "predict", mesh=jax.make_mesh((8,), ("x",)), prng_key=key
        )
    runner = MethodRunner.create(model, "predict", mesh=mesh_2d(), prng_key=key)
    with pytest.raises(
        ValueError, match=r"'label' of shape \(12,\).*\('data', 'model'\).*size 8"
    ):
        runner(make_batch(n=12))
    bad_tree = MethodRunner.create(
        model,
        "predict",
        mesh=mesh_2d(),
        prng_key=key,
        input_partition={"x": DataPartition.FULL, "other": DataPartition.FULL},
    )
    with pytest.raises(ValueError, match="does not match"):
        bad_tree(make_batch())
    with pytest.raises(ValueError, match="does not match"):
        MethodRunner.create(
            model, "predict", mesh=mesh_2d(), prng_key=key, param_partition=[P()]
        )
    with pytest.raises(ValueError, match=r"'w1' of shape \(4, 8\).*dimension 0"):
        MethodRunner.create(
            model,
            "predict",
            mesh=mesh_2d(),
            prng_key=key,
            param_partition=lambda path, leaf: (
                P(("data", "model")) if path == "w1" else P()
            ),
        )
    wrong = MethodRunner.create(
        model, lambda m, b, ctx: b["x"], mesh=mesh_1d(), prng_key=key
    )
    with pytest.raises(TypeError, match=r"must return `\(output, ctx\)`"):
        wrong(make_batch())
    with pytest.raises(TypeError, match="not hashable"):
        runner(make_batch(), shift={1, 2})


def test_explicit_partition_trees_and_rank_rule() -> None:
    mesh = mesh_2d()
    runner = MethodRunner.create(
        make_model(),
        "predict",
        mesh=mesh,
        prng_key=jax.random.PRNGKey(0),
        input_partition={"x": P("data", "model"), "label": DataPartition.REPLICATED},
        output_partition={"y": P("data"), "noise": P(("data", "model")), "label": None},
    )
    batch = make_batch()
    batch["x"] = np.ones((16, 4), np.float32)
    _, out = runner(batch)
    assert spec_of(out.input_batch["x"]) == ("data", "model")
    assert spec_of(out.input_batch["label"]) == ()
    assert spec_of(out.output_batch["y"]) == ("data",)
    assert spec_of(out.output_batch["noise"]) == (("data", "model"),)
    assert out.output_batch["label"].sharding.is_fully_replicated
    # Rank rule: a rank-0 leaf is replicated, a rank-1 leaf uses the first entry.
    scalar = MethodRunner.create(
        make_model(),
        lambda m, b, ctx: (b, ctx),
        mesh=mesh,
        prng_key=jax.random.PRNGKey(0),
        input_partition=P("data", "model"),
    )
    _, out = scalar({"s": np.float32(3.0), "v": np.arange(8, dtype=np.int32)})
    assert spec_of(out.input_batch["s"]) == ()
    assert spec_of(out.input_batch["v"]) == ("data",)


def test_run_batches_and_summary_accumulator() -> None:
    model, key = make_model(), jax.random.PRNGKey(0)
    runner = MethodRunner.create(model, "predict", mesh=mesh_1d(), prng_key=key)
    batches = [make_batch(n=8 * (i + 1), seed=i) for i in range(3)]
    acc = eqxctx.SummaryAccumulator()
    outs = []
    for out in eqxctx.run_batches(runner, batches, progress=True, max_in_flight=1):
        outs.append(out)
        acc = acc.update(out.summaries)
    # Same as calling the runner by hand, threading the key.
    r = runner
    for out, batch in zip(outs, batches, strict=True):
        r, expected = r(batch)
        assert eqx.tree_equal(out.output_batch, expected.output_batch)
    # Weighted mean over all examples, minimum over all, counts summed.
    ys = [np.asarray(o.output_batch["y"]) for o in outs]
    total = sum(len(b["x"]) for b in batches)
    summaries = acc.summaries()
    np.testing.assert_allclose(
        float(summaries["y_mean"].value()),
        np.concatenate(ys).mean(),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        float(summaries["y_min"].value()), min(y.min() for y in ys)
    )
    assert float(summaries["count"]) == total
    assert set(acc.flatten()) == {"y_mean", "y_min", "count"}
    # Pure: an update leaves the accumulator unchanged.
    before = acc.flatten()
    acc.update(outs[0].summaries)
    assert acc.flatten().keys() == before.keys()
    assert eqx.tree_equal(acc.flatten(), before)
    with pytest.raises(ValueError, match=r"missing: \['count'"):
        acc.update({"y_mean": outs[0].summaries["y_mean"]})
    with pytest.raises(ValueError, match="max_in_flight"):
        next(eqxctx.run_batches(runner, batches, max_in_flight=0))
    assert eqxctx.SummaryAccumulator().summaries() == {}


def test_accumulated_summaries_are_plain_dicts() -> None:
    # Issue 35 item 18: `summaries()` returned read-only mappings whose PyTree
    # structure differs from a dict's, so `jax.tree.map` over it and a dict failed
    # (AXLearn's `MetricAccumulator.summaries()` returns a dict).
    def step(ctx: Context, k: float) -> eqxctx.OutputCollection:
        ctx = ctx.add_summary("loss", eqxctx.WeightedSummary(jnp.float32(k), 2.0))
        _, _, coll = eqxctx.scan_in_context(
            lambda c, x, cx: (c, None, cx.add_summary("x", x * k)),
            context=ctx,
            carry=0.0,
            xs=jnp.arange(2.0),
            child_name_prefix="layer",
        )
        return ctx.merge(coll).collection

    acc = eqxctx.SummaryAccumulator()
    for k in (1.0, 3.0):
        acc = acc.update(step(Context.root(), k))
    got = acc.summaries()
    # Reference: the per-iteration summaries by hand (raw arrays add: 1x + 3x).
    want = {"loss": 2.0, "layer": {}, "layer0": {"x": 0.0}, "layer1": {"x": 4.0}}
    assert type(got) is dict
    assert all(type(got[k]) is dict for k in ("layer", "layer0", "layer1"))
    values = jax.tree.map(
        lambda s, w: (float(s.value() if isinstance(s, eqxctx.Summary) else s), w),
        got,
        want,
        is_leaf=lambda x: isinstance(x, eqxctx.Summary),
    )
    assert jax.tree.leaves(values) == jax.tree.leaves(
        jax.tree.map(lambda w: (w, w), want)
    )
    # A new value on each call: changing it changes nothing else.
    got["loss"] = None
    got["layer0"]["x"] = None
    assert float(acc.summaries()["loss"].value()) == 2.0
    assert float(acc.summaries()["layer0"]["x"]) == 0.0
    flat = acc.flatten()
    assert type(flat) is dict
    assert sorted(flat) == ["layer0/x", "layer1/x", "loss"]
    flat.clear()
    assert len(acc.flatten()) == 3
    empty = eqxctx.SummaryAccumulator().summaries()
    assert type(empty) is dict
    assert empty == {}


@pytest.mark.parametrize("max_in_flight", [1, 2, None])
def test_run_batches_bounds_on_each_steps_key(max_in_flight: int | None) -> None:
    # The bound waits on each step's new key (a typed key here), also for a method
    # whose output has no arrays to wait on.
    def no_output(model: MLP, batch: Any, ctx: Context) -> Any:
        del model
        return None, ctx.add_summary("n", jnp.sum(batch["x"]))

    for method in ("predict", no_output):
        runner = MethodRunner.create(
            make_model(), method, mesh=mesh_1d(), prng_key=jax.random.key(3)
        )
        batches = [make_batch(n=8, seed=i) for i in range(4)]
        outs = list(eqxctx.run_batches(runner, batches, max_in_flight=max_in_flight))
        r = runner
        for out, batch in zip(outs, batches, strict=True):
            r, expected = r(batch)
            assert eqx.tree_equal(out.output_batch, expected.output_batch)
            assert eqx.tree_equal(dict(out.summaries), dict(expected.summaries))


@settings(max_examples=6, deadline=None)
@given(
    per_device=st.integers(1, 3),
    hidden=st.integers(1, 6),
    explicit=st.booleans(),
)
def test_property_sharded_equals_unsharded(
    per_device: int, hidden: int, explicit: bool
) -> None:
    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    model, key = make_model(seed=hidden, hidden=hidden), jax.random.PRNGKey(hidden)
    batch = make_batch(n=8 * per_device, seed=per_device)
    runner = MethodRunner.create(
        model, "predict", mesh=mesh_1d(axis_type), prng_key=key
    )
    _, out = runner(batch)
    assert_matches_reference(out, model, batch, key)


PAGE = Path(__file__).parent.parent / "docs" / "examples" / "running_on_batches.md"


def test_running_on_batches_page(capsys: pytest.CaptureFixture[str]) -> None:
    """Runs the code of docs/examples/running_on_batches.md and checks its results."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)
    assert len(blocks) >= 5
    ns: dict[str, Any] = {"__name__": "running_on_batches"}
    exec(compile("\n".join(blocks), str(PAGE), "exec"), ns)
    printed = capsys.readouterr().out.splitlines()
    # jax < 0.9 prints `PartitionSpec(...)` where later versions print `P(...)`.
    printed = [line.replace("PartitionSpec(", "P(") for line in printed]
    assert printed[:3] == ["P(('data', 'model'),)", "P('data',)", "True"]
    # Reference: the unsharded model on one device, batch by batch, with the keys
    # AXLearn's runner would use.
    model, batches = ns["model"], ns["batches"]
    correct = 0
    for batch in batches:
        logits = np.asarray(jax.nn.relu(batch["x"] @ model.w1) @ model.w2)
        correct += int((logits.argmax(-1) == batch["label"]).sum())
    accuracy = correct / sum(len(b["label"]) for b in batches)
    np.testing.assert_allclose(ns["accuracy"], accuracy, rtol=1e-5)
    assert printed[3] == f"accuracy: {accuracy:.3f} (64, 4)"
    np.testing.assert_allclose(
        ns["host"].output_batch["logits"],
        np.asarray(jax.nn.relu(batches[-1]["x"] @ model.w1) @ model.w2),
        rtol=1e-4,
        atol=1e-4,
    )
    # The loop with a bounded window (issue 35 item 9) equals `run_batches`.
    assert len(ns["loop_logits"]) == len(batches)
    for got, batch in zip(ns["loop_logits"], batches, strict=True):
        np.testing.assert_allclose(
            np.asarray(got["logits"]),
            np.asarray(jax.nn.relu(batch["x"] @ model.w1) @ model.w2),
            rtol=1e-4,
            atol=1e-4,
        )
    # The runner passed into `jax.jit` on an Explicit mesh (issue 35 item 15).
    first = ns["batch"]
    np.testing.assert_allclose(
        np.asarray(ns["logits"]),
        np.asarray(jax.nn.relu(first["x"] @ model.w1) @ model.w2),
        rtol=1e-4,
        atol=1e-4,
    )
    assert ns["logits"].sharding.mesh.axis_types == (AxisType.Explicit,)


def test_is_training_and_param_partition_tree() -> None:
    def method(
        params: dict[str, jax.Array], batch: jax.Array, ctx: Context
    ) -> tuple[jax.Array, Context]:
        y = batch @ params["w"] + params["b"][None, :]
        return (y * 2 if ctx.is_training else y), ctx

    params = {"w": jnp.arange(8.0).reshape(2, 4), "b": jnp.ones(4)}
    batch = np.arange(16.0, dtype=np.float32).reshape(8, 2)
    expected = batch @ np.asarray(params["w"]) + 1.0
    for is_training, factor in ((False, 1.0), (True, 2.0)):
        runner = MethodRunner.create(
            params,
            method,
            mesh=mesh_2d(),
            prng_key=jax.random.PRNGKey(0),
            param_partition={"w": P(None, "model"), "b": P("model")},
            is_training=is_training,
        )
        assert spec_of(runner.params["w"]) == (None, "model")
        assert spec_of(runner.params["b"]) == ("model",)
        jax.tree.map(np.testing.assert_array_equal, runner.model, params)
        _, out = runner(batch)
        np.testing.assert_allclose(np.asarray(out.output_batch), expected * factor)


AXIS_TYPES = [AxisType.Auto, AxisType.Explicit]


class WithNone(eqx.Module):
    y: jax.Array
    aux: Any = None


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_none_leaves_are_empty_subtrees(axis_type: AxisType) -> None:
    def method(m: Any, b: dict[str, Any], ctx: Context) -> tuple[Any, Context]:
        assert b["mask"] is None
        return {"out": WithNone(b["x"] * 2), "none": None}, ctx

    def returns_none(m: Any, b: Any, ctx: Context) -> tuple[None, Context]:
        return None, ctx

    key = jax.random.PRNGKey(0)
    x = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    runner = MethodRunner.create({}, method, mesh=mesh_1d(axis_type), prng_key=key)
    _, out = runner({"x": x, "mask": None})
    np.testing.assert_array_equal(np.asarray(out.output_batch["out"].y), x * 2)
    assert out.output_batch["out"].aux is None
    assert out.output_batch["none"] is None
    assert out.input_batch["mask"] is None
    runner = MethodRunner.create(
        {}, returns_none, mesh=mesh_1d(axis_type), prng_key=key
    )
    _, out = runner(x)
    assert out.output_batch is None
    # A model with a None field (no bias), with each form of param_partition.
    lin = eqx.nn.Linear(4, 2, use_bias=False, key=key)
    for part in (None, lambda path, leaf: P(), jax.tree.map(lambda _: P(), lin)):
        runner = MethodRunner.create(
            lin,
            lambda m, b, ctx: (jax.vmap(m)(b), ctx),
            mesh=mesh_1d(axis_type),
            prng_key=key,
            param_partition=part,
        )
        _, out = runner(x)
        np.testing.assert_allclose(
            np.asarray(out.output_batch), x @ np.asarray(lin.weight).T, rtol=1e-6
        )


class CallableNet(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return jax.vmap(self.lin)(x), ctx


def test_param_partition_tree_of_a_callable_module() -> None:
    net = CallableNet(eqx.nn.Linear(4, 8, key=jax.random.PRNGKey(0)))
    spec_tree = jax.tree.map(lambda _: P(), net)
    spec_tree = eqx.tree_at(lambda t: t.lin.weight, spec_tree, P("model"))
    assert callable(spec_tree)  # a tree, not the callable form
    runner = MethodRunner.create(
        net,
        "__call__",
        mesh=mesh_2d(),
        prng_key=jax.random.PRNGKey(0),
        param_partition=spec_tree,
    )
    assert spec_of(runner.params.lin.weight) == ("model",)
    assert spec_of(runner.params.lin.bias) == ()
    x = np.ones((8, 4), np.float32)
    _, out = runner(x)
    expected = x @ np.asarray(net.lin.weight).T + np.asarray(net.lin.bias)
    np.testing.assert_allclose(np.asarray(out.output_batch), expected, rtol=1e-5)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_lower_with_shardings_other_than_the_input_partition(
    axis_type: AxisType,
) -> None:
    mesh = mesh_2d(axis_type)
    model, batch, key = make_model(), make_batch(), jax.random.PRNGKey(2)
    runner = MethodRunner.create(model, "predict", mesh=mesh, prng_key=key)
    replicated = NamedSharding(mesh, P())
    by_model = NamedSharding(mesh, P("model"))
    spec = {
        "x": jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=replicated),
        "label": jax.ShapeDtypeStruct((16,), jnp.int32, sharding=by_model),
    }
    compiled = runner.lower(spec).compile()
    r_jit, out_jit = runner(batch)
    global_batch = {
        "x": jax.device_put(batch["x"], replicated),
        "label": jax.device_put(batch["label"], by_model),
    }
    other = {"x": out_jit.input_batch["x"], "label": batch["label"]}  # a mixture
    for inputs in (batch, global_batch, other):
        r_aot, out_aot = compiled(inputs)
        for name in ("y", "noise", "label"):
            np.testing.assert_allclose(
                np.asarray(out_aot.output_batch[name]),
                np.asarray(out_jit.output_batch[name]),
                rtol=1e-6,
            )
        assert jnp.array_equal(r_aot.prng_key, r_jit.prng_key)
        assert out_aot.input_batch["x"].sharding.is_fully_replicated
    with pytest.raises(ValueError, match="structure differs"):
        compiled({"x": batch["x"]})


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_output_that_does_not_divide_names_the_leaf(axis_type: AxisType) -> None:
    def method(m: Any, b: jax.Array, ctx: Context) -> tuple[Any, Context]:
        return {"ok": b, "short": {"y": jnp.ones((6, 4)) * jnp.sum(b)}}, ctx

    runner = MethodRunner.create(
        {}, method, mesh=mesh_2d(axis_type), prng_key=jax.random.PRNGKey(0)
    )
    with pytest.raises(
        ValueError,
        match=r"Output leaf 'short/y' of shape \(6, 4\): dimension 0.*\('data',\)"
        r".*size 4.*output_partition",
    ):
        runner(np.ones((8, 4), np.float32))
    replicated = MethodRunner.create(
        {},
        method,
        mesh=mesh_2d(axis_type),
        prng_key=jax.random.PRNGKey(0),
        output_partition={"ok": DataPartition.BATCH, "short": DataPartition.REPLICATED},
    )
    _, out = replicated(np.ones((8, 4), np.float32))
    assert out.output_batch["short"]["y"].sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(out.output_batch["short"]["y"]), 32.0)
    assert out.output_batch["ok"].sharding.is_equivalent_to(
        NamedSharding(out.output_batch["ok"].sharding.mesh, P("data")), 2
    )


def test_method_and_partition_errors() -> None:
    model, key = make_model(), jax.random.PRNGKey(0)
    with pytest.raises(
        TypeError, match=r"bound method.*method='predict'.*type\(model\)"
    ):
        MethodRunner.create(model, model.predict, mesh=mesh_1d(), prng_key=key)
    net = CallableNet(eqx.nn.Linear(4, 8, key=key))
    with pytest.raises(AttributeError, match=r"available methods: \['__call__'\]"):
        MethodRunner.create(net, "predict", mesh=mesh_1d(), prng_key=key)
    params = {"b": np.ones(8, np.float32), "w1": np.ones((8, 4), np.float32)}
    for part in ({"b": P(), "w1": P("modle")}, lambda path, leaf: P(None, "modle")):
        with pytest.raises(
            ValueError,
            match=r"param_partition=.*leaf '(b|w1)' names mesh axes \['modle'\]"
            r".*\('data', 'model'\)",
        ):
            MethodRunner.create(
                params,
                lambda m, b, ctx: (b, ctx),
                mesh=mesh_2d(),
                prng_key=key,
                param_partition=part,
            )
    runner = MethodRunner.create(
        model,
        "predict",
        mesh=mesh_2d(),
        prng_key=key,
        input_partition={"x": P("data"), "label": P("modle")},
    )
    with pytest.raises(
        ValueError, match=r"input_partition=.*leaf 'label' names mesh axes \['modle'\]"
    ):
        runner(make_batch())
    with pytest.raises(ValueError, match="structure of the model's parameters") as e:
        MethodRunner.create(
            model, "predict", mesh=mesh_2d(), prng_key=key, param_partition=[P()]
        )
    assert "batch" not in str(e.value)
    with pytest.raises(ValueError, match=r"^Parameter 'w1'.*param_partition") as e:
        MethodRunner.create(
            model,
            "predict",
            mesh=mesh_2d(),
            prng_key=key,
            param_partition=lambda path, leaf: P(("data", "model")),
        )
    assert "batch" not in str(e.value)
    swapped = MethodRunner.create(
        model, lambda m, b, ctx: (ctx, b["x"]), mesh=mesh_1d(), prng_key=key
    )
    with pytest.raises(TypeError, match=r"returned `\(ctx, output\)`.*Swap"):
        swapped(make_batch())


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_specs_longer_than_the_rank_behave_the_same(axis_type: AxisType) -> None:
    mesh, key = mesh_2d(axis_type), jax.random.PRNGKey(0)
    identity = MethodRunner.create(
        {"w": np.ones((8, 4), np.float32)},
        lambda m, b, ctx: (b, ctx),
        mesh=mesh,
        prng_key=key,
        input_partition=P("data", "model", None),
        output_partition=P("data", None, None),
        param_partition={"w": P("data", None, None)},
    )
    assert spec_of(identity.params["w"]) == ("data",)
    x = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    _, out = identity(x)
    assert spec_of(out.input_batch) == ("data", "model")
    assert spec_of(out.output_batch) == ("data",)
    np.testing.assert_array_equal(np.asarray(out.output_batch), x)
    too_long = MethodRunner.create(
        {},
        lambda m, b, ctx: (b, ctx),
        mesh=mesh,
        prng_key=key,
        input_partition={"x": P("data", None, "model")},
    )
    with pytest.raises(ValueError, match=r"'x' has rank 2.*P\('data', None, 'model'\)"):
        too_long({"x": x})


def test_summary_accumulator_changed_kind_or_shape_names_the_path() -> None:
    acc = eqxctx.SummaryAccumulator().update(
        {"a": {"w": eqxctx.WeightedSummary(1.0, 1.0)}, "r": jnp.ones(3)}
    )
    with pytest.raises(TypeError, match=r"'a/w' was WeightedSummary and is now a raw"):
        acc.update({"a": {"w": 1.0}, "r": jnp.ones(3)})
    with pytest.raises(TypeError, match=r"'a/w' was WeightedSummary.*MinSummary"):
        acc.update({"a": {"w": eqxctx.MinSummary(1.0)}, "r": jnp.ones(3)})
    with pytest.raises(
        ValueError, match=r"'r' had shape \(3,\) and now has shape \(4,\)"
    ):
        acc.update({"a": {"w": eqxctx.WeightedSummary(1.0, 1.0)}, "r": jnp.ones(4)})
    with pytest.raises(ValueError, match=r"MinSummary at 'm'"):
        eqxctx.SummaryAccumulator().update(
            {"m": eqxctx.MinSummary(jnp.ones(3))}
        ).update({"m": eqxctx.MinSummary(jnp.ones(4))})
    ok = acc.update({"a": {"w": eqxctx.WeightedSummary(4.0, 2.0)}, "r": jnp.ones(3)})
    assert float(ok.summaries()["a"]["w"].value()) == 3.0
    np.testing.assert_array_equal(np.asarray(ok.summaries()["r"]), np.full(3, 2.0))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_the_method_runs_under_the_runners_mesh(axis_type: AxisType) -> None:
    # As AXLearn's runner runs under its mesh: under a context mesh other than the
    # runner's, the method runs under the runner's (a bare `PartitionSpec` refers
    # to it, the key's split works), and it is the program of a call under
    # `jax.set_mesh(runner.mesh)`. With no mesh set, it runs under none (as jit).
    seen: list[Any] = []

    def method(
        params: dict[str, jax.Array], batch: dict[str, jax.Array], ctx: Context
    ) -> tuple[dict[str, jax.Array], Context]:
        context = jax.sharding.get_abstract_mesh()
        seen.append(None if context.empty else dict(context.shape))
        y = batch["x"] * params["w"]
        if not context.empty:
            y = jax.lax.with_sharding_constraint(y, P("data"))
        key = jax.random.split(ctx.prng_key)[0]
        ctx = ctx.add_summary("sum", jnp.sum(y))
        return {"y": y, "u": jax.random.uniform(key, (8,))}, ctx

    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    other = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
    runner = MethodRunner.create(
        {"w": jnp.float32(3.0)}, method, mesh=mesh, prng_key=jax.random.key(0)
    )
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    outs = []
    for where in (None, other, mesh, other, None):
        if where is None:
            runner, out = runner({"x": x})
        else:
            with jax.set_mesh(where):
                runner, out = runner({"x": x})
        outs.append(out)
    # Traced once with no mesh, once under the runner's (for both set meshes).
    assert seen == [None, {"data": 8}]
    assert runner.trace_count == 2
    for out in outs:
        np.testing.assert_array_equal(np.asarray(out.output_batch["y"]), x * 3)
        assert float(out.summaries["sum"]) == float(np.sum(x * 3))
        assert out.output_batch["y"].sharding.mesh.shape == mesh.shape
    # Each call drew from the next key, wherever it was made.
    draws = {tuple(np.asarray(out.output_batch["u"]).tolist()) for out in outs}
    assert len(draws) == 5
    # Lowered and compiled under another mesh: under the runner's, as a call.
    with jax.set_mesh(other):
        compiled = runner.lower({"x": jax.ShapeDtypeStruct(x.shape, x.dtype)}).compile()
        _, out = compiled({"x": x})
    assert seen[-1] == {"data": 8}
    np.testing.assert_array_equal(np.asarray(out.output_batch["y"]), x * 3)


def test_a_runner_traced_under_another_mesh_says_what_to_do() -> None:
    # Inside `jax.jit` under another context mesh the runner cannot enter its own
    # (JAX refuses `jax.set_mesh` in a trace): a clear error, not JAX's mismatch.
    def method(
        params: dict[str, jax.Array], batch: dict[str, jax.Array], ctx: Context
    ) -> tuple[dict[str, jax.Array], Context]:
        return {"y": batch["x"] * params["w"]}, ctx

    mesh = jax.make_mesh((8,), ("data",))
    other = jax.make_mesh((2, 4), ("data", "model"))
    runner = MethodRunner.create(
        {"w": jnp.float32(2.0)}, method, mesh=mesh, prng_key=jax.random.key(0)
    )
    x = np.ones((8, 2), np.float32)

    def outputs(x: jax.Array) -> jax.Array:
        return runner({"x": x})[1].output_batch["y"]

    with (
        jax.set_mesh(other),
        pytest.raises(
            ValueError, match=r"called inside a trace .*\{'data': 2, 'model': 4\}"
        ),
    ):
        jax.jit(outputs)(x)
    with jax.set_mesh(mesh):  # under its own mesh it works inside jit
        np.testing.assert_array_equal(np.asarray(jax.jit(outputs)(x)), x * 2)


# -- one trace per signature (issue 35 item 1: a one-device mesh traced twice) ------


def mesh_of(devices: int, axis_type: AxisType) -> jax.sharding.Mesh:
    return jax.make_mesh(
        (devices,), ("data",), axis_types=(axis_type,), devices=jax.devices()[:devices]
    )


def noisy(
    params: dict[str, jax.Array], batch: dict[str, jax.Array], ctx: Context
) -> tuple[dict[str, jax.Array], Context]:
    noise = jax.random.uniform(ctx.prng_key, (batch["x"].shape[0], 1))
    return {"y": batch["x"] @ params["w"] + noise}, ctx


@pytest.mark.parametrize("typed", [False, True], ids=["raw_key", "typed_key"])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("devices", [1, 8])
def test_one_trace_for_every_key_and_parameter_origin(
    devices: int, axis_type: AxisType, typed: bool
) -> None:
    # The key and parameters given to `create` are placed as the step returns (and
    # is given) them, so the first call and every later one hit one cache entry.
    mesh = mesh_of(devices, axis_type)

    def method(*args: Any) -> Any:  # a step of its own: its own trace count
        return noisy(*args)

    make_key = jax.random.key if typed else jax.random.PRNGKey
    keys = {
        "uncommitted": make_key(0),
        "committed to device 0": jax.device_put(make_key(0), jax.devices()[0]),
        "committed to the last device": jax.device_put(make_key(0), jax.devices()[-1]),
        "on the mesh": jax.device_put(make_key(0), NamedSharding(mesh, P())),
    }
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    # NumPy, then placed by the user, then a JAX array on one device, then NumPy.
    batches = [
        x,
        x,
        jax.device_put(x, NamedSharding(mesh, P("data"))),
        jnp.asarray(x),
        x,
    ]
    for name, key in keys.items():
        for params in (w, jnp.asarray(w)):
            runner = MethodRunner.create({"w": params}, method, mesh=mesh, prng_key=key)
            ref_key = key
            for batch in batches:
                runner, out = runner({"x": batch})
                ref_key, iter_key = jax.random.split(ref_key)
                noise = np.asarray(jax.random.uniform(iter_key, (8, 1)))
                np.testing.assert_allclose(
                    np.asarray(out.output_batch["y"]), x @ w + noise, rtol=1e-6
                )
            assert runner.trace_count == 1, (name, type(params).__name__)
            np.testing.assert_array_equal(
                eqxctx.to_host(runner.prng_key), eqxctx.to_host(ref_key)
            )


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("devices", [1, 8])
def test_one_trace_per_bucket(devices: int, axis_type: AxisType) -> None:
    def method(*args: Any) -> Any:  # a step of its own: its own trace count
        return noisy(*args)

    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    runner = MethodRunner.create(
        {"w": w},
        method,
        mesh=mesh_of(devices, axis_type),
        prng_key=jax.random.PRNGKey(0),
        pad_batches=True,
        batch_sizes=(8, 16),
    )
    ref_key = jax.random.PRNGKey(0)
    for rows in (3, 5, 12, 8, 16, 1, 9):
        x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
        runner, out = runner({"x": x})
        ref_key, iter_key = jax.random.split(ref_key)
        size = 8 if rows <= 8 else 16
        noise = np.asarray(jax.random.uniform(iter_key, (size, 1)))[:rows]
        np.testing.assert_allclose(
            np.asarray(out.output_batch["y"]), x @ w + noise, rtol=1e-6
        )
    assert runner.trace_count == 2  # one per bucket


def test_explicit_runner_closed_over_in_jit_on_a_traced_host_batch() -> None:
    # issue 35 item 15: JAX's "Length of device assignment 1 is not equal to the
    # size of the mesh 8" (a jitted function whose only arguments are not on the
    # mesh cannot return arrays typed with it); refused with eqxctx's message.
    mesh = mesh_1d(AxisType.Explicit)
    runner = MethodRunner.create(
        {"w": jnp.float32(3.0)},
        lambda p, b, ctx: ({"y": b["x"] * p["w"]}, ctx),
        mesh=mesh,
        prng_key=jax.random.key(0),
    )
    x = np.arange(32, dtype=np.float32).reshape(8, 4)

    def closed_over(b: dict[str, Any]) -> jax.Array:
        return runner(b)[1].output_batch["y"]

    def passed_in(r: MethodRunner[Any, Any], b: dict[str, Any]) -> jax.Array:
        return r(b)[1].output_batch["y"]

    match = r"Explicit axes.*leaf 'x'.*not placed on its mesh.*jax.set_mesh"
    for batch in ({"x": x}, {"x": jnp.asarray(x)}):
        with pytest.raises(ValueError, match=match):
            jax.jit(closed_over)(batch)
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(closed_over, batch)
        with pytest.raises(ValueError, match=match):
            jax.grad(lambda b: jnp.sum(closed_over(b)))(batch)
        # Each fix the message gives works, with the call's values.
        with jax.set_mesh(mesh):
            np.testing.assert_array_equal(
                np.asarray(jax.jit(closed_over)(batch)), x * 3
            )
        y = jax.jit(passed_in)(runner, batch)
        np.testing.assert_array_equal(np.asarray(y), x * 3)
        placed = {"x": jax.device_put(x, NamedSharding(mesh, P("data")))}
        np.testing.assert_array_equal(np.asarray(jax.jit(closed_over)(placed)), x * 3)
    # A batch the traced function closes over is placed there, on the mesh.
    y = jax.jit(lambda: closed_over({"x": x}))()
    np.testing.assert_array_equal(np.asarray(y), x * 3)
    # Auto axes need none of this.
    auto = MethodRunner.create(
        {"w": jnp.float32(3.0)},
        lambda p, b, ctx: ({"y": b["x"] * p["w"]}, ctx),
        mesh=mesh_1d(AxisType.Auto),
        prng_key=jax.random.key(0),
    )
    y = jax.jit(lambda b: auto(b)[1].output_batch["y"])({"x": x})
    np.testing.assert_array_equal(np.asarray(y), x * 3)


# From test_regressions.py: found by trying eqxctx as a new user would.
def test_runner_without_key_is_a_clear_error() -> None:
    from eqxctx import MethodRunner

    mesh = jax.make_mesh((1,), ("data",))
    with pytest.raises(TypeError, match=r"prng_key=None"):
        MethodRunner.create(
            {"w": jnp.ones(2)}, lambda m, b, c: (b, c), mesh=mesh, prng_key=None
        )

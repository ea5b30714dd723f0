"""Partition specs, the rank rule, host-local -> global arrays, constraints, to_host."""

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqxctx
from eqxctx import DataPartition
from eqxctx._partition import (
    check_divisible,
    data_partition_spec,
    leaf_spec,
    normalize_spec,
    resolve_specs,
)
from eqxctx._transfer import constrain, to_global


pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 (simulated) devices"
)


def mesh_2d(axis_type: AxisType = AxisType.Auto) -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)


def test_data_partition_specs() -> None:
    mesh = mesh_2d()
    assert data_partition_spec(DataPartition.FULL, mesh) == P(("data", "model"))
    assert data_partition_spec(DataPartition.BATCH, mesh) == P(("data",))
    assert data_partition_spec(DataPartition.REPLICATED, mesh) == P()
    fsdp = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"))
    assert data_partition_spec(DataPartition.BATCH, fsdp) == P(("data", "fsdp"))
    with pytest.raises(ValueError, match=r"mesh has axes \('x', 'y'\)"):
        data_partition_spec(DataPartition.BATCH, jax.make_mesh((4, 2), ("x", "y")))


@pytest.mark.parametrize("explicit", [False, True])
def test_rank_rule(explicit: bool) -> None:
    spec = P("data", "model")
    assert leaf_spec(spec, 0, explicit=explicit) == P()
    assert leaf_spec(spec, 1, explicit=explicit) == P("data")
    assert leaf_spec(spec, 2, explicit=explicit) == spec
    three = P("data", "model", None) if explicit else spec
    assert leaf_spec(spec, 3, explicit=explicit) == three
    assert leaf_spec(P(), 2, explicit=explicit) == (P(None, None) if explicit else P())
    # Normal forms as JAX gives them: padded (Explicit), no trailing None (Auto).
    assert normalize_spec(P("data", None), 2, explicit=False) == P("data")
    assert normalize_spec(P("data"), 2, explicit=True) == P("data", None)


def test_resolve_specs_prefix_trees_and_mismatch() -> None:
    mesh = mesh_2d()
    batch = {"a": {"x": 1, "y": 2}, "b": 3}
    specs = resolve_specs(
        {"a": DataPartition.BATCH, "b": P("model")}, batch, mesh, what="input"
    )
    assert specs == [P(("data",)), P(("data",)), P("model")]
    assert resolve_specs(None, batch, mesh, what="input") == [P()] * 3
    assert (
        resolve_specs(DataPartition.FULL, batch, mesh, what="input")
        == [P(("data", "model"))] * 3
    )
    with pytest.raises(
        ValueError, match=r"`MethodRunner\(input=...\)`.*does not match"
    ):
        resolve_specs({"a": P(), "c": P()}, batch, mesh, what="input")


def test_check_divisible_messages() -> None:
    mesh = mesh_2d()
    check_divisible((8, 3), P(("data", "model")), mesh, path="ok")
    with pytest.raises(
        ValueError,
        match=r"'batch/x' of shape \(6, 3\): dimension 0.*\('data', 'model'\).*size 8",
    ):
        check_divisible((6, 3), P(("data", "model")), mesh, path="batch/x")
    with pytest.raises(ValueError, match=r"'v' of shape \(4,\) has rank 1"):
        check_divisible((4,), P("data", "model"), mesh, path="v")


@given(
    rows=st.integers(1, 3),
    cols=st.integers(1, 5),
    spec=st.sampled_from([P(("data", "model")), P("data"), P(), P("data", "model")]),
    dtype=st.sampled_from([np.float32, np.int32]),
    data=st.data(),
)
def test_to_global_then_to_host_round_trips(
    rows: int, cols: int, spec: P, dtype: type, data: st.DataObject
) -> None:
    mesh = mesh_2d()
    x = data.draw(hnp.arrays(dtype, (8 * rows, 2 * cols)))
    sharding = NamedSharding(mesh, spec)
    for leaf in (x, jnp.asarray(x), jax.device_put(x, jax.devices()[5])):
        g = to_global(leaf, sharding, path="x")
        assert g.sharding == sharding
        np.testing.assert_array_equal(np.asarray(g), x)
        np.testing.assert_array_equal(eqxctx.to_host(g), x)
        np.testing.assert_array_equal(eqxctx.to_host(g, gather=False), x)
    # x is unchanged (the input is never mutated).
    assert x.shape == (8 * rows, 2 * cols)


def test_to_global_reshards_global_arrays_and_checks_shapes() -> None:
    mesh = mesh_2d()
    x = jax.device_put(np.arange(16.0), NamedSharding(mesh, P("model")))
    g = to_global(x, NamedSharding(mesh, P(("data", "model"))), path="x")
    assert g.sharding == NamedSharding(mesh, P(("data", "model")))
    np.testing.assert_array_equal(np.asarray(g), np.arange(16.0))
    with pytest.raises(ValueError, match=r"'x' of shape \(9,\)"):
        to_global(np.arange(9.0), NamedSharding(mesh, P("data")), path="x")


def test_to_host_trees() -> None:
    mesh = mesh_2d()
    tree = {
        "replicated": jax.device_put(jnp.ones(3), NamedSharding(mesh, P())),
        "sharded": jax.device_put(jnp.arange(8), NamedSharding(mesh, P("data"))),
        "summary": eqxctx.WeightedSummary(jnp.asarray(2.0), jnp.asarray(3.0)),
        "number": 1.5,
        "text": "kept",
    }
    host = eqxctx.to_host(tree)
    assert isinstance(host["replicated"], np.ndarray)
    np.testing.assert_array_equal(host["sharded"], np.arange(8))
    assert isinstance(host["summary"], eqxctx.WeightedSummary)
    assert isinstance(host["summary"].mean, np.ndarray)
    assert host["number"] == 1.5
    assert host["text"] == "kept"


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_constrain_by_axis_type(axis_type: AxisType) -> None:
    mesh = mesh_2d(axis_type)
    explicit = axis_type == AxisType.Explicit
    target = NamedSharding(mesh, leaf_spec(P("data"), 2, explicit=explicit))

    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        return constrain(x * 2, target, explicit=explicit)

    x = jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, P()))
    y = f(x)
    assert y.sharding == target
    np.testing.assert_array_equal(np.asarray(y), 2 * np.ones((8, 2)))
    assert constrain("not an array", target, explicit=explicit) == "not an array"


def test_resolve_specs_treats_none_leaves_as_empty_subtrees() -> None:
    mesh = mesh_2d()
    tree = {"a": np.ones(8), "b": None, "c": (None, np.ones(8))}
    assert len(jax.tree.leaves(tree)) == 2
    assert (
        resolve_specs(DataPartition.BATCH, tree, mesh, what="input")
        == [P(("data",))] * 2
    )
    # A None in the partition is a leaf (replicated), also over a None subtree.
    specs = resolve_specs(
        {"a": P("model"), "b": None, "c": None}, tree, mesh, what="input"
    )
    assert specs == [P("model"), P()]
    assert resolve_specs(DataPartition.FULL, None, mesh, what="output") == []


def test_resolve_specs_names_unknown_axes_and_the_tree() -> None:
    mesh = mesh_2d()
    tree = {"a": np.ones(8), "b": {"c": np.ones(8)}}
    with pytest.raises(
        ValueError,
        match=r"input_partition=.*leaf 'b/c' names mesh axes \['modle'\].*"
        r"\('data', 'model'\)",
    ):
        resolve_specs(
            {"a": P("data"), "b": P(("data", "modle"))},
            tree,
            mesh,
            what="input_partition",
        )
    with pytest.raises(ValueError, match="structure of the model's parameters"):
        resolve_specs([P()], tree, mesh, what="param_partition")
    with pytest.raises(ValueError, match="structure of the method's output"):
        resolve_specs([P()], tree, mesh, what="output_partition")


@pytest.mark.parametrize("explicit", [False, True])
def test_specs_longer_than_the_rank(explicit: bool) -> None:
    # Trailing Nones beyond the rank are dropped on both kinds of mesh.
    padded = P("data", None) if explicit else P("data")
    assert leaf_spec(P("data", None, None), 2, explicit=explicit) == padded
    assert normalize_spec(P("data", None, None), 2, explicit=explicit) == padded
    with pytest.raises(ValueError, match=r"'x' has rank 2.*P\('data', None, 'model'\)"):
        leaf_spec(P("data", None, "model"), 2, explicit=explicit, path="x")
    check_divisible((8, 3), P("data", None, None), mesh_2d(), path="ok")


def test_check_divisible_wording_per_kind() -> None:
    mesh = mesh_2d()
    with pytest.raises(ValueError, match=r"^Parameter 'w'.*`param_partition`") as e:
        check_divisible((6, 3), P("data"), mesh, path="w", what="parameter")
    assert "batch" not in str(e.value)
    with pytest.raises(ValueError, match=r"^Output leaf 'y'.*`output_partition`"):
        check_divisible((6, 3), P("data"), mesh, path="y", what="output")


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_to_host_typed_keys_give_their_key_data(axis_type: AxisType) -> None:
    mesh = mesh_2d(axis_type)
    keys = jax.random.split(jax.random.key(1), 8)
    sharded = jax.device_put(keys, NamedSharding(mesh, P("data")))
    host = eqxctx.to_host({"one": jax.random.key(1), "many": sharded})
    np.testing.assert_array_equal(
        host["one"], np.asarray(jax.random.key_data(jax.random.key(1)))
    )
    assert host["one"].dtype == np.uint32
    assert host["many"].shape == (8, 2)
    np.testing.assert_array_equal(host["many"], np.asarray(jax.random.key_data(keys)))
    local = eqxctx.to_host(sharded, gather=False)
    np.testing.assert_array_equal(local, host["many"])

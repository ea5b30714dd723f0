"""The writers' one-process fetch: one transfer per dtype, device_get's bits."""

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import eqxctx
import eqxctx.writers._fetch as fetch
from eqxctx.writers import Histogram, fetch_summaries


def device_get(tree: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef.unflatten(fetch.device_get_leaves(leaves))


@pytest.fixture(autouse=True)
def fresh_plans() -> Iterator[None]:
    fetch._plans.clear()  # pyright: ignore[reportPrivateUsage]
    yield
    fetch._plans.clear()  # pyright: ignore[reportPrivateUsage]


def mixed_tree() -> dict[str, Any]:
    nan_payload = jnp.asarray(np.array([0x7FC00001, 0xFFC12345], np.uint32)).view(
        jnp.float32
    )
    return {
        "f32": jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3),
        "scalar": jnp.float32(-0.0),
        "nan": nan_payload,
        "i32": jnp.arange(4, dtype=jnp.int32),
        "bool": jnp.asarray([True, False, True]),
        "u8": jnp.asarray([0, 255], jnp.uint8),
        "f16": jnp.asarray([1.5, -2.25], jnp.float16),
        "bf16": jnp.asarray([3.0, 1e-3], jnp.bfloat16),
        "empty": jnp.zeros((0, 3), jnp.float32),
        "weak": jnp.asarray(2.0) * 3,  # weakly typed float32
        "large": jnp.arange(fetch.MAX_BATCHED_SIZE + 1, dtype=jnp.float32),
        "i32 scalar": jnp.int32(7),
        "numpy": np.arange(3.0),
        "python": 1.25,
        "f32 2": jnp.full((2, 2, 2), jnp.inf, jnp.float32),
    }


def arrays_of(tree: Any) -> list[jax.Array]:
    return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]


def assert_same_bits(got: Any, want: Any) -> None:
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert type(g) is type(w)
        if isinstance(w, np.ndarray):
            assert g.dtype == w.dtype
            assert g.shape == w.shape
            assert g.tobytes() == w.tobytes()
        else:
            assert g == w


def test_same_bits_as_device_get_and_one_transfer_per_width() -> None:
    tree = mixed_tree()
    want = jax.device_get(tree)
    first = device_get(tree)  # first sighting: array by array, no plan
    assert_same_bits(first, want)
    (plan,) = fetch._plans.values()  # pyright: ignore[reportPrivateUsage]
    assert plan is None
    second = device_get(tree)  # second: the batched plan
    assert_same_bits(second, want)
    (plan,) = fetch._plans.values()  # pyright: ignore[reportPrivateUsage]
    assert plan is not None
    # One flat output per width of raw bits: 32 (six f32 arrays and two i32), 16
    # (f16), 8 (u8); and bool, as it is. bfloat16 is fetched alone (on TPUs XLA
    # flushed its subnormals in a concatenation).
    assert len(plan.splits) == 4
    assert sorted(len(items) for items in plan.splits) == [1, 1, 1, 8]
    outs = plan.fn([arrays_of(tree)[k] for k in plan.batched])
    assert sorted(str(x.dtype) for x in outs) == ["bool", "uint16", "uint32", "uint8"]
    arrays = [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]
    large = [i for i, x in enumerate(arrays) if x.size > fetch.MAX_BATCHED_SIZE]
    bf16 = [i for i, x in enumerate(arrays) if x.dtype == jnp.bfloat16]
    assert plan.alone == tuple(sorted(large + bf16))
    assert_same_bits(device_get(tree), want)


def test_float64_is_batched_except_on_a_tpu() -> None:
    # A TPU emulates float64: its bitcast to uint64 in the batched transfer gave
    # other values from the second write on. There it is fetched array by array.
    assert np.dtype(np.float64) in fetch.raw_bits("cpu")
    assert np.dtype(np.float64) in fetch.raw_bits("gpu")
    assert np.dtype(np.float64) not in fetch.raw_bits("tpu")
    assert np.dtype(np.int64) in fetch.raw_bits("tpu")
    with jax.enable_x64(True):
        tree = {
            "f64": jnp.asarray([0.1, 0.2], jnp.float64),
            "f64 scalar": jnp.float64(0.3),
            "i64": jnp.asarray([2**40, -1], jnp.int64),
            "f32": jnp.float32(0.75),
        }
        want = jax.device_get(tree)
        for _ in range(3):
            assert_same_bits(device_get(tree), want)
        (plan,) = fetch._plans.values()  # pyright: ignore[reportPrivateUsage]
        assert plan is not None
        platform = jax.devices()[0].platform
        f64 = [i for i, x in enumerate(arrays_of(tree)) if x.dtype == jnp.float64]
        assert len(f64) == 2
        assert plan.alone == (tuple(f64) if platform == "tpu" else ())


def test_fresh_arrays_of_one_signature_reuse_the_plan() -> None:
    def step(i: jax.Array) -> dict[str, Any]:
        return {"a": i * 2.0, "b": jnp.stack([i, -i]), "c": (i > 3).astype(jnp.int32)}

    jitted = jax.jit(step)
    for i in range(5):
        tree = jitted(jnp.float32(i))
        assert_same_bits(device_get(tree), jax.device_get(tree))
    assert len(fetch._plans) == 1  # pyright: ignore[reportPrivateUsage]


def test_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # A small bound: each new signature compiles a plan (the default, 64, took 12 s).
    monkeypatch.setattr(fetch, "MAX_PLANS", 4)
    sizes = []
    for n in range(fetch.MAX_PLANS + 5):
        tree = [jax.device_put(np.zeros((n,), np.float32)), jnp.ones((1,))]
        assert_same_bits(device_get(tree), jax.device_get(tree))
        assert_same_bits(device_get(tree), jax.device_get(tree))
        sizes.append(len(fetch._plans))  # pyright: ignore[reportPrivateUsage]
    assert sizes == [1, 2, 3, 4, 1, 2, 3, 4, 1]


def test_key_arrays_and_other_shardings_are_fetched_alone() -> None:
    devices = np.array(jax.devices()[:2])
    if devices.size < 2:
        pytest.skip("needs two devices")
    mesh = Mesh(devices, ("data",))
    split = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, PartitionSpec("data")))
    replicated = jax.device_put(jnp.arange(3.0), NamedSharding(mesh, PartitionSpec()))
    tree = {"split": split, "replicated": replicated, "small": jnp.ones(2)}
    want = jax.device_get(tree)
    for _ in range(3):
        assert_same_bits(device_get(tree), want)
    keys = {"key": jax.random.key(0), "x": jnp.ones(2), "y": jnp.zeros(3)}
    for _ in range(3):  # `jax.device_get`'s result, as before
        got = device_get(keys)
        want_keys = jax.device_get(keys)
        np.testing.assert_array_equal(got["x"], want_keys["x"])
        np.testing.assert_array_equal(
            jax.random.key_data(got["key"]), jax.random.key_data(want_keys["key"])
        )


def test_replicated_runner_outputs_batch_on_their_mesh() -> None:
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("data",))
    sharding = NamedSharding(mesh, PartitionSpec())
    tree = [jax.device_put(jnp.arange(float(n)), sharding) for n in (1, 2, 3)]
    want = jax.device_get(tree)
    for _ in range(3):
        assert_same_bits(device_get(tree), want)
    (plan,) = fetch._plans.values()  # pyright: ignore[reportPrivateUsage]
    assert plan is not None
    assert len(plan.batched) == 3


def test_fetch_summaries_values_unchanged() -> None:
    summaries = {
        "loss": eqxctx.WeightedSummary(jnp.float32(0.5), jnp.float32(3.0)),
        "m": eqxctx.MomentsSummary(jnp.arange(5.0)),
        "h": eqxctx.HistogramSummary(jnp.arange(5.0), bins=4, range=(0.0, 5.0)),
        "raw": jnp.asarray([1, 2], jnp.int32),
    }
    first = fetch_summaries(summaries)
    again = first
    for _ in range(2):
        again = fetch_summaries(summaries)
        assert list(again) == list(first)
        for path, value in first.items():
            if isinstance(value, np.ndarray):
                got = again[path]
                assert isinstance(got, np.ndarray)
                assert got.dtype == value.dtype
                assert got.tobytes() == value.tobytes()
    hist = again["h"]
    assert isinstance(hist, Histogram)  # `HistogramSummary.host_value`'s record
    assert hist.edges == (0.0, 1.25, 2.5, 3.75, 5.0)
    want = np.histogram(np.arange(5.0), bins=4, range=(0.0, 5.0))[0]
    np.testing.assert_array_equal(np.asarray(hist.counts), want)


@pytest.mark.cpu_only(
    reason="XLA:TPU aborts the process (illegal instruction) compiling the int2 "
    "array itself (jnp.asarray), before eqxctx runs"
)
def test_8_bit_floats_and_sub_byte_integers_keep_their_bits() -> None:
    # Fetched array by array: XLA canonicalized float8 NaN payloads in a
    # concatenation and aborted on one of int2 arrays.
    f8 = jnp.asarray(
        np.asarray([0x7D, 0xFF, 0x7E, 0x01], np.uint8).view(ml_dtypes.float8_e5m2)
    )
    i2 = jnp.asarray(np.asarray([1, -1, 0, -2], ml_dtypes.int2))
    tree = {"f8": f8, "f8 2": f8 + 0, "i2": i2, "i2 2": i2 + 0, "f32": jnp.ones(2)}
    want = jax.device_get(tree)
    for _ in range(3):  # the first write, then the batched plan's
        assert_same_bits(device_get(tree), want)

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from eqxctx import (
    HistogramSummary,
    MaxSummary,
    MinSummary,
    SumSummary,
    WeightedSummary,
)


floats = st.floats(-1e3, 1e3, width=32)
weights = st.floats(0, 1e3, width=32)


@given(st.lists(st.tuples(floats, weights), min_size=1, max_size=6))
def test_weighted_accumulate_is_weighted_mean(pairs: list[tuple[float, float]]) -> None:
    acc = WeightedSummary(jnp.float32(pairs[0][0]), jnp.float32(pairs[0][1]))
    for m, w in pairs[1:]:
        acc = acc + WeightedSummary(jnp.float32(m), jnp.float32(w))
    means = np.array([m for m, _ in pairs], np.float64)
    ws = np.array([w for _, w in pairs], np.float64)
    total = ws.sum()
    if len(pairs) == 1:
        want = means[0]
    else:
        want = (means * ws).sum() / total if total > 0 else 0.0
    np.testing.assert_allclose(float(acc.value()), want, rtol=1e-4, atol=1e-2)
    np.testing.assert_allclose(float(acc.weight), total, rtol=1e-5)


def test_weighted_zero_weight_is_nan_free_with_grad() -> None:
    def f(m: jax.Array) -> jax.Array:
        s = WeightedSummary(m, jnp.float32(0)) + WeightedSummary(2 * m, jnp.float32(0))
        return jnp.asarray(s.value())

    assert float(f(jnp.float32(3.0))) == 0.0
    g = jax.grad(f)(jnp.float32(3.0))
    assert float(g) == 0.0
    assert not np.isnan(g)


def test_weighted_int_weight_and_vector_mean() -> None:
    s = WeightedSummary(jnp.array([1.0, 3.0]), 2) + WeightedSummary(
        jnp.array([3.0, 5.0]), 2
    )
    np.testing.assert_allclose(s.value(), [2.0, 4.0])
    assert int(s.weight) == 4


def test_min_max_sum() -> None:
    a, b = jnp.array([1.0, 5.0]), jnp.array([3.0, 2.0])
    np.testing.assert_array_equal(
        MinSummary(a).accumulate(MinSummary(b)).value(), [1, 2]
    )
    np.testing.assert_array_equal(
        MaxSummary(a).accumulate(MaxSummary(b)).value(), [3, 5]
    )
    np.testing.assert_array_equal(
        SumSummary(a).accumulate(SumSummary(b)).value(), [4, 7]
    )


def test_summaries_are_pytrees_through_scan() -> None:
    def body(c: jax.Array, x: jax.Array) -> tuple[jax.Array, WeightedSummary]:
        return c, WeightedSummary(x, jnp.float32(1))

    _, stacked = jax.lax.scan(body, jnp.float32(0), jnp.arange(4.0))
    assert stacked.mean.shape == (4,)
    acc = stacked
    first = jax.tree_util.tree_map(lambda a: a[0], acc)
    for i in range(1, 4):
        first = first + jax.tree_util.tree_map(lambda a, i=i: a[i], acc)
    np.testing.assert_allclose(first.value(), 1.5)


def test_summary_kinds_refuse_typed_keys() -> None:
    key = jax.random.key(0)
    for make in (
        lambda: MinSummary(key),
        lambda: MaxSummary(key),
        lambda: SumSummary(key),
        lambda: WeightedSummary(key, 1.0),
        lambda: WeightedSummary(1.0, key),
    ):
        with pytest.raises(TypeError, match=r"typed PRNG key \(key<fry>\).*key_data"):
            make()
    data = jax.random.key_data(key)
    assert MaxSummary(data).value().dtype == jnp.uint32


def test_summaries_made_from_a_refilled_numpy_buffer_keep_their_values() -> None:
    from eqxctx import MomentsSummary

    # A host buffer refilled for every batch, with no wait in between: on the CPU,
    # JAX may read a NumPy argument after the call that was given it returns.
    buf = np.zeros(4096, np.float32)
    made = []
    for v in range(6):
        buf[:] = v
        made.append(
            (
                WeightedSummary(buf, 2.0),
                MaxSummary(buf),
                MomentsSummary(buf, where=buf >= 0),
                HistogramSummary(buf, bins=6, range=(0, 6)),
            )
        )
    for v, (weighted, largest, moments, histogram) in enumerate(made):
        assert float(weighted.value().max()) == v
        assert float(largest.value().min()) == v
        assert float(moments.value()["mean"]) == v
        assert int(histogram.counts[v]) == 4096


@pytest.mark.parametrize(
    ("w1", "w2"),
    [
        (2.0**127, 2.0**127),  # issue 39: NaN on a TPU
        (3e38, 3e38),
        (1.0, 2.0**127),
        (2.0**127, 5.0),
        (2.0**-120, 2.0**-125),  # tiny weights: their total's reciprocal is huge
        (1e-30, 3e38),
        (3.0, 0.0),
        (0.0, 0.0),
    ],
)
def test_weighted_accumulate_with_subnormals_flushed_as_on_a_tpu(
    w1: float, w2: float
) -> None:
    # issue 39: weights above ~2**126 gave NaN on the TPU, where the overflow-safe
    # mean divided by the larger weight through a flushed subnormal reciprocal.
    from helpers import run_flushing_subnormals

    a = WeightedSummary(jnp.float32(1.0), jnp.float32(w1))
    b = WeightedSummary(jnp.float32(3.0), jnp.float32(w2))
    w64 = np.float64(np.float32(w1)), np.float64(np.float32(w2))
    want = (w64[0] * 1 + w64[1] * 3) / sum(w64) if sum(w64) > 0 else 0.0
    for got in (
        run_flushing_subnormals(lambda a, b: a.accumulate(b).mean, a, b),
        a.accumulate(b).mean,
    ):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_documented_limits_of_weight_totals_and_raw_sums() -> None:
    # issue 35 item 2: the documented limits (WeightedSummary, Summary, SumSummary
    # docstrings and docs/api/summaries.md), pinned.
    from eqxctx import Context, scan_in_context

    # float32 weights: a unit weight no longer changes a total of 2**24 ...
    s = WeightedSummary(jnp.float32(0.0), jnp.float32(2**24)) + WeightedSummary(
        jnp.float32(1000.0), jnp.float32(1.0)
    )
    assert float(s.weight) == 2**24
    # ... and still moves the mean by its fraction, 1 / (2**24 + 1).
    np.testing.assert_allclose(float(s.mean), 1000.0 / (2**24 + 1), rtol=1e-6)
    # int32 weights add exactly up to 2**31 - 1, then wrap.
    i = WeightedSummary(1.0, jnp.int32(2**31 - 2)) + WeightedSummary(1.0, jnp.int32(1))
    assert int(i.weight) == 2**31 - 1
    wrapped = i + WeightedSummary(1.0, jnp.int32(1))
    assert int(wrapped.weight) == -(2**31)

    # Raw bfloat16 summaries (and SumSummary) sum in bfloat16: 1,000 ones read 256.
    def body(
        c: jax.Array, x: jax.Array, ctx: Context
    ) -> tuple[jax.Array, None, Context]:
        ctx = ctx.add_summary("raw", x)
        ctx = ctx.add_summary("sum", SumSummary(x))
        return c, None, ctx.add_summary("f32", x.astype(jnp.float32))

    _, _, coll = jax.jit(
        lambda xs: scan_in_context(
            body,
            context=Context.root(),
            carry=jnp.zeros(()),
            xs=xs,
            merge_summaries=True,
        )
    )(jnp.ones(1000, jnp.bfloat16))
    flat = coll.flatten("summaries")
    assert float(flat["iter/raw"]) == 256.0
    assert float(flat["iter/sum"].value()) == 256.0
    assert float(flat["iter/f32"]) == 1000.0  # the documented remedy


# From test_regressions.py: found by trying eqxctx as a new user would.
def test_weighted_summary_mixed_dtypes_under_strict_promotion() -> None:
    a = WeightedSummary(jnp.bfloat16(1.0), jnp.int32(1))
    b = WeightedSummary(jnp.float32(3.0), jnp.float32(3.0))
    s = a + b
    assert s.mean.dtype == jnp.float32
    np.testing.assert_allclose(s.value(), 2.5)
    np.testing.assert_allclose(s.weight, 4.0)


# From test_regressions.py: found by trying eqxctx as a new user would.
def test_weighted_summary_zero_weight_nan_mean_is_nan() -> None:
    # Issue 10 (summary laws): a NaN anywhere gives NaN, also a NaN mean with zero
    # weight (the 0/0 mean of an empty batch): a broken batch is never hidden.
    empty = WeightedSummary(jnp.float32(jnp.nan), jnp.float32(0))
    s = empty + WeightedSummary(jnp.float32(5), jnp.float32(1))
    assert np.isnan(s.value())
    # A finite mean with zero weight adds nothing, and its gradient is finite.
    s = WeightedSummary(jnp.float32(7), jnp.float32(0)) + WeightedSummary(5.0, 1.0)
    np.testing.assert_allclose(s.value(), 5.0)
    g = jax.grad(
        lambda m: (WeightedSummary(m, jnp.float32(0)) + WeightedSummary(m, 1.0)).value()
    )(jnp.float32(2.0))
    np.testing.assert_allclose(g, 1.0)

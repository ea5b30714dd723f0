"""HistogramSummary and MomentsSummary against numpy.histogram and float64 NumPy."""

from typing import Any

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import eqxctx
from eqxctx import Context, HistogramSummary, MomentsSummary
from eqxctx._statistics import tensorflow_edges
from eqxctx.writers import JsonlWriter, fetch_summaries


# A few shapes of every rank (scalar and empty included), not any shape: each new
# shape compiles every operation again, eagerly and under jit.
SHAPES = [(), (0,), (1,), (6,), (2, 3), (0, 4), (3, 1, 2), (2, 6, 1)]

values = hnp.arrays(
    st.sampled_from([np.float32, np.int32, np.float16]),
    st.sampled_from(SHAPES),
    elements={"min_value": -100, "max_value": 100, "allow_nan": False},
)


def np_histogram(x: np.ndarray, edges: tuple[float, ...]) -> np.ndarray:
    """The reference: numpy.histogram with the edges rounded to float32."""
    with np.errstate(over="ignore"):
        e32 = np.asarray(edges, np.float64).astype(np.float32)
    return np.histogram(np.asarray(x).astype(np.float32), bins=e32)[0]


@given(
    x=values,
    lo=st.integers(-50, 0),
    width=st.integers(1, 100),
    bins=st.integers(1, 12),
)
def test_histogram_equals_numpy(x: np.ndarray, lo: int, width: int, bins: int) -> None:
    h = HistogramSummary(x, bins=bins, range=(lo, lo + width))
    np.testing.assert_allclose(h.edges, np.linspace(lo, lo + width, bins + 1))
    got = np.asarray(h.counts)
    assert got.dtype == np.int64  # exact, read on the host (issue 35 item 2)
    np.testing.assert_array_equal(got, np_histogram(x, h.edges))
    jitted = jax.jit(lambda v: HistogramSummary(v, bins=bins, range=(lo, lo + width)))
    np.testing.assert_array_equal(jitted(x).counts, got)


# The TPU's two ways (`_counts_from_below`: every value against every edge, or
# sorted values searched), run here on the CPU against the CPU's scatter-add.
_TPU_EDGES = (
    (0.0, 1.0, 2.0, 3.0),
    tuple(np.linspace(-5.0, 5.0, 64).tolist()),  # the most compared densely
    tuple(np.linspace(-5.0, 5.0, 65).tolist()),  # the fewest sorted
    tensorflow_edges(),
)


@pytest.mark.parametrize("edges", _TPU_EDGES, ids=["4", "64", "65", "tf"])
@given(
    x=hnp.arrays(
        np.float32,
        st.sampled_from([0, 1, 7, 40]),  # a few lengths: each one compiles
        elements=st.floats(-8, 8, width=32)
        | st.sampled_from([np.nan, np.inf, -np.inf, -0.0, 0.0, 3.0, 5.0, -5.0]),
    )
)
def test_tpu_counts_equal_numpy(edges: tuple[float, ...], x: np.ndarray) -> None:
    from eqxctx._statistics import (
        MAX_DENSE_EDGES,
        _counts_from_below,  # pyright: ignore[reportPrivateUsage]
        _counts_scatter,  # pyright: ignore[reportPrivateUsage]
    )

    assert (len(edges) <= MAX_DENSE_EDGES) == (len(edges) < 65)
    e32 = jnp.asarray(np.asarray(edges, np.float64).astype(np.float32))
    got = np.asarray(jax.jit(_counts_from_below)(jnp.asarray(x), e32))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, jax.jit(_counts_scatter)(jnp.asarray(x), e32))
    # XLA flushes subnormal values to zero (on the CPU as on TPUs), NumPy does not.
    flushed = np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0), x)
    np.testing.assert_array_equal(got, np_histogram(flushed[~np.isnan(x)], edges))


def _instructions(fn: Any, spec: jax.ShapeDtypeStruct) -> int:
    text = jax.jit(fn).lower(spec).compile().as_text()
    assert text is not None
    return sum(" = " in line for line in text.splitlines())


@pytest.mark.cpu_only("XLA:CPU instruction counts")
def test_histogram_program_is_one_search_per_value() -> None:
    # issue 36: the bucket search is `jnp.searchsorted` (a loop over the edges'
    # halvings, or every edge compared for few edges), not one unrolled step per
    # halving: the program does not grow with the number of edges.
    spec = jax.ShapeDtypeStruct((1000,), jnp.float32)
    assert _instructions(lambda v: HistogramSummary(v), spec) <= 200
    ranged = _instructions(lambda v: HistogramSummary(v, bins=30, range=(-1, 1)), spec)
    assert ranged <= 100


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16, np.float32])
@pytest.mark.parametrize("edges", _TPU_EDGES, ids=["4", "64", "65", "tf"])
def test_histogram_edge_cases_equal_numpy(edges: tuple[float, ...], dtype: Any) -> None:
    # issue 36: NaN, infinities, signed zeros, values on every edge and between.
    e32 = np.asarray(edges, np.float64).astype(np.float32)
    finite = e32[np.isfinite(e32)][:200]
    special = [np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 3.0, 5.0, -5.0]
    x = np.concatenate([special, finite, np.nextafter(finite, np.inf)])
    with np.errstate(over="ignore"):  # large edges are infinite in float16
        x = x.astype(dtype)
    got = HistogramSummary(jnp.asarray(x), edges=edges).counts
    x32 = x.astype(np.float32)
    flushed = np.where(np.abs(x32) < np.finfo(np.float32).tiny, np.float32(0), x32)
    np.testing.assert_array_equal(got, np_histogram(flushed[~np.isnan(x32)], edges))


def test_histogram_edge_rules_and_explicit_edges() -> None:
    x = np.asarray([-1.0, 0.0, 0.5, 1.0, 1.5, 3.0, 4.0, np.nan, np.inf], np.float32)
    h = HistogramSummary(x, edges=[0.0, 1.0, 2.0, 3.0])
    # [0,1) [1,2) [2,3]: 3.0 is in the closed last bucket; -1, 4, NaN, inf are not.
    assert h.counts.tolist() == [2, 2, 1]
    assert h.bins == 3
    ref = np.histogram(x[np.isfinite(x)], bins=[0.0, 1.0, 2.0, 3.0])[0]
    assert h.counts.tolist() == ref.tolist()


def test_float64_values_are_bucketed_with_edges_checked_in_float64() -> None:
    # issue 35 item 12: edges distinct only in float64 were refused with a float32
    # message, for float64 values which are compared in float64.
    edges = [1.0, 1.0 + 1e-12, 2.0]
    x = np.array([1.0, 1.0 + 5e-13, 1.0 + 2e-12, 1.5, 2.0], np.float64)
    with jax.enable_x64(True):
        h = HistogramSummary(x, edges=edges)
        assert h.edges == tuple(edges)
        np.testing.assert_array_equal(h.counts, np.histogram(x, bins=edges)[0])
        assert h.counts.tolist() == [2, 3]
    with pytest.raises(ValueError, match="also when rounded to float32") as info:
        HistogramSummary(x.astype(np.float32), edges=edges)
    assert "compared in float32" in str(info.value)


@pytest.mark.parametrize("kind", [HistogramSummary, MomentsSummary])
@pytest.mark.parametrize(
    "value",
    [np.array(["a"]), np.array([object()]), np.array([b"x"])],
    ids=["str", "object", "bytes"],
)
def test_non_numeric_values_get_the_kinds_error(kind: Any, value: Any) -> None:
    # issue 35 item 13: JAX's "Error interpreting argument" instead of this error.
    name = kind.__name__
    with pytest.raises(TypeError, match=rf"`{name}`: expected real \(bool, integer"):
        kind(value)


def test_histogram_default_edges_are_tensorflows() -> None:
    edges = tensorflow_edges()
    assert len(edges) == 1551
    assert (edges[0], edges[-1], edges[775], edges[776]) == (-np.inf, np.inf, 0, 1e-12)
    np.testing.assert_allclose(edges[777] / edges[776], 1.1)
    assert edges[-2] < 1e20 <= edges[-2] * 1.1
    rng = np.random.default_rng(0)
    x = (rng.normal(size=1000) * 10.0 ** rng.integers(-8, 8, size=1000)).astype(
        np.float32
    )
    x[:3] = [np.inf, -np.inf, 0.0]
    h = HistogramSummary(jnp.asarray(x))
    assert h.edges is edges
    np.testing.assert_array_equal(h.counts, np_histogram(x, edges))
    assert int(h.counts.sum()) == 1000  # every non-NaN value is in a bucket


@given(chunks=st.lists(values, min_size=1, max_size=5))
def test_histogram_accumulate_adds_counts(chunks: list[np.ndarray]) -> None:
    made = [HistogramSummary(c, bins=7, range=(-60.0, 60.0)) for c in chunks]
    acc = made[0]
    for h in made[1:]:
        acc = acc.accumulate(h)
    everything = np.concatenate([np.ravel(c).astype(np.float32) for c in chunks])
    np.testing.assert_array_equal(acc.counts, np_histogram(everything, acc.edges))


def test_histogram_errors() -> None:
    x = jnp.arange(3.0)
    with pytest.raises(ValueError, match=r"bins=5\)`: fixed edges need a range"):
        HistogramSummary(x, bins=5)
    with pytest.raises(ValueError, match="either `edges` or `bins`/`range`"):
        HistogramSummary(x, edges=[0, 1], range=(0, 1))
    with pytest.raises(ValueError, match="low < high"):
        HistogramSummary(x, range=(1, 1))
    with pytest.raises(ValueError, match="low < high"):
        HistogramSummary(x, range=(0, np.inf))
    with pytest.raises(ValueError, match="positive int"):
        HistogramSummary(x, bins=0, range=(0, 1))
    import inspect

    # As called without this suite's runtime type checks (which refuse it first).
    from eqxctx._statistics import _make_edges  # pyright: ignore[reportPrivateUsage]

    unchecked = inspect.unwrap(_make_edges)
    with pytest.raises(ValueError, match=r"`HistogramSummary\(bins=...\)`.*got 2.0"):
        unchecked(2.0, (0, 1), None)
    assert HistogramSummary(x, bins=int(np.int64(2)), range=(0, 1)).edges == (
        0.0,
        0.5,
        1.0,
    )
    with pytest.raises(ValueError, match="strictly increasing"):
        HistogramSummary(x, edges=[0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="strictly increasing, also when rounded"):
        HistogramSummary(x, edges=[1.0, 1.0 + 1e-12])
    with pytest.raises(ValueError, match="at least 2 edges"):
        HistogramSummary(x, edges=[0.0])
    with pytest.raises(TypeError, match="complex"):
        HistogramSummary(jnp.asarray([1j]))
    a = HistogramSummary(x, bins=3, range=(0, 3))
    with pytest.raises(
        ValueError, match=r"edges differ \(3 buckets from 0.0 to 3.0 vs"
    ):
        a.accumulate(HistogramSummary(x, bins=4, range=(0, 3)))
    with pytest.raises(ValueError, match="cannot accumulate a HistogramSummary with a"):
        a.accumulate(eqxctx.SumSummary(1.0))
    stacked = jax.vmap(lambda v: HistogramSummary(v, bins=3, range=(0, 3)))(
        jnp.ones((2, 3))
    )
    with pytest.raises(ValueError, match="counts of shapes"):
        a.accumulate(stacked)


# -- moments -------------------------------------------------------------------------


def reference_moments(x: np.ndarray) -> dict[str, float]:
    x64 = np.asarray(x, np.float64).ravel()
    return {
        "count": x64.size,
        "mean": float(np.mean(x64)),
        "variance": float(np.var(x64)),
        "min": float(np.min(x64)),
        "max": float(np.max(x64)),
        "nonfinite": int(np.sum(~np.isfinite(x64))),
    }


def check_moments(m: MomentsSummary, x: np.ndarray) -> None:
    got = {k: float(v) for k, v in m.value().items()}
    want = reference_moments(x)
    assert got["count"] == want["count"]
    assert got["nonfinite"] == want["nonfinite"]
    assert (got["min"], got["max"]) == (want["min"], want["max"])
    scale = max(1.0, float(np.max(np.abs(x))))
    np.testing.assert_allclose(got["mean"], want["mean"], rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(
        got["variance"], want["variance"], rtol=1e-4, atol=1e-5 * scale**2
    )


# No subnormals: XLA on the CPU flushes them to zero under `jax.jit` (documented in
# `HistogramSummary`), so the jitted min/max of [1e-45] is 0.0 where NumPy's is not.
nonempty = hnp.arrays(
    st.sampled_from([np.float32, np.int32, np.float16]),
    st.sampled_from([s for s in SHAPES if 0 not in s and len(s) <= 2]),
    elements={
        "min_value": -1000,
        "max_value": 1000,
        "allow_nan": False,
        "allow_subnormal": False,
    },
)


def combine(parts: list[MomentsSummary], split: list[int]) -> MomentsSummary:
    """Accumulate `parts` as a tree: split at `split[0]`, recurse on both halves."""
    if len(parts) == 1:
        return parts[0]
    at = 1 + split[0] % (len(parts) - 1)
    left = combine(parts[:at], split[1:] or [0])
    right = combine(parts[at:], split[1:] or [0])
    return left.accumulate(right)


@given(
    chunks=st.lists(nonempty, min_size=1, max_size=6),
    split=st.lists(st.integers(0, 10), min_size=1, max_size=6),
    shift=st.sampled_from([0.0, 1e4]),
)
def test_moments_equal_float64_numpy_in_any_grouping(
    chunks: list[np.ndarray], split: list[int], shift: float
) -> None:
    # A large common offset (shift) is where a sum-of-squares formula cancels.
    chunks = [(c.astype(np.float32) + np.float32(shift)) for c in chunks]
    parts = [MomentsSummary(c) for c in chunks]
    everything = np.concatenate([c.ravel() for c in chunks])
    check_moments(combine(parts, split), everything)
    check_moments(jax.jit(lambda ps: combine(ps, split))(parts), everything)


def test_moments_single_dtypes_and_empty() -> None:
    x = np.asarray([[1, -7], [3, 4]], np.int32)
    m = MomentsSummary(x)
    check_moments(m, x)
    assert (m.min_.dtype, m.mean.dtype) == (jnp.int32, jnp.float32)
    b = MomentsSummary(np.asarray([True, False, True]))
    assert {k: float(v) for k, v in b.value().items()}["mean"] == pytest.approx(2 / 3)
    bf = MomentsSummary(jnp.asarray([1.5, -2.0], jnp.bfloat16))
    assert bf.max_.dtype == jnp.bfloat16
    assert float(bf.max_) == 1.5
    empty = MomentsSummary(np.zeros((0, 3), np.float32))
    value = {k: float(v) for k, v in empty.value().items()}
    assert value == {
        "count": 0.0,
        "mean": 0.0,
        "variance": 0.0,
        "min": np.inf,
        "max": -np.inf,
        "nonfinite": 0.0,
    }
    # The empty summary is an identity.
    check_moments(empty.accumulate(m).accumulate(empty), x)
    with pytest.raises(TypeError, match="complex"):
        MomentsSummary(np.asarray([1j]))
    with pytest.raises(ValueError, match="cannot accumulate a MomentsSummary with a"):
        m.accumulate(HistogramSummary(x))


def test_moments_non_finite_values_are_counted_and_propagate() -> None:
    x = np.asarray([1.0, np.nan, np.inf, -np.inf, 2.0], np.float32)
    value = MomentsSummary(x).value()
    assert int(value["nonfinite"]) == 3
    assert int(value["count"]) == 5
    for k in ("mean", "variance", "min", "max"):
        assert np.isnan(value[k]), k  # NaN anywhere gives NaN, as in NumPy
    acc = MomentsSummary(np.ones(3, np.float32)) + MomentsSummary(x[2:3])
    assert int(acc.nonfinite) == 1
    assert not np.isfinite(acc.value()["mean"])
    assert (float(acc.max_), float(acc.min_)) == (np.inf, 1.0)


@given(x=nonempty, data=st.data())
def test_where_keeps_only_the_selected_values(x: np.ndarray, data: Any) -> None:
    mask = data.draw(hnp.arrays(np.bool_, x.shape))
    if x.dtype.kind == "f":  # values left out count nowhere, NaN included
        x = x.copy()
        x[~mask] = np.nan
    selected = x[mask]

    def both(v: Any, w: Any) -> tuple[MomentsSummary, HistogramSummary]:
        return (
            MomentsSummary(v, where=w),
            HistogramSummary(v, bins=5, range=(-1000, 1000), where=w),
        )

    for moments, histogram in (both(x, mask), jax.jit(both)(x, mask)):
        if selected.size:
            check_moments(moments, selected)
        else:
            got = {k: float(v) for k, v in moments.value().items()}
            want = {k: float(v) for k, v in MomentsSummary(selected).value().items()}
            assert got == want
        np.testing.assert_array_equal(
            histogram.counts, np_histogram(selected, histogram.edges)
        )


def test_where_broadcasts_as_numpy_and_refuses_what_does_not() -> None:
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    rows = np.array([True, False, True, False])  # a padded batch's mask
    check_moments(MomentsSummary(x, where=rows[:, None]), x[rows])
    columns = np.array([True, False, True])  # broadcast over the rows
    check_moments(MomentsSummary(x, where=columns), x[:, columns])
    h = HistogramSummary(x, bins=3, range=(0, 12), where=rows[:, None])
    np.testing.assert_array_equal(h.counts, np_histogram(x[rows], h.edges))
    with pytest.raises(ValueError, match=r"shape \(4,\) does not broadcast.*\(4, 3\)"):
        MomentsSummary(x, where=rows)
    with pytest.raises(ValueError, match=r"`HistogramSummary\(value, where=...\)`"):
        HistogramSummary(x, where=rows)
    with pytest.raises(TypeError, match="must be a bool array, got dtype int32"):
        MomentsSummary(x, where=rows.astype(np.int32))
    # Under vmap (per example) and accumulated: as if only the kept values existed.
    keep = rows[:, None] | (x > 9)
    per_row = jax.vmap(lambda v, w: MomentsSummary(v, where=w))(x, keep)
    assert per_row.count.tolist() == [3, 0, 3, 2]
    assert per_row.max_.tolist() == [2.0, -np.inf, 8.0, 11.0]
    total = MomentsSummary(x[:2], where=rows[:2, None]) + MomentsSummary(
        x[2:], where=rows[2:, None]
    )
    check_moments(total, x[rows])


# -- inside scan, vmap and the runner ----------------------------------------------


def _stats_body(carry: Any, x: jax.Array, ctx: Context) -> tuple[Any, None, Context]:
    ctx = ctx.add_summary("hist", HistogramSummary(x, bins=4, range=(0.0, 8.0)))
    ctx = ctx.add_summary("moments", MomentsSummary(x))
    return carry, None, ctx


@pytest.mark.parametrize("reverse", [False, True])
def test_statistics_in_scan_per_iteration_and_merged(reverse: bool) -> None:
    xs = np.random.default_rng(1).uniform(0, 8, size=(5, 7)).astype(np.float32)

    def run(merge: bool) -> dict[str, Any]:
        _, _, coll = jax.jit(
            lambda xs: eqxctx.scan_in_context(
                _stats_body,
                context=Context.root(),
                carry=0,
                xs=xs,
                reverse=reverse,
                merge_summaries=merge,
            )
        )(xs)
        return coll.flatten("summaries")

    per = run(False)
    for i in range(5):
        np.testing.assert_array_equal(
            per[f"iter{i}/hist"].counts, np_histogram(xs[i], per[f"iter{i}/hist"].edges)
        )
        check_moments(per[f"iter{i}/moments"], xs[i])
    merged = run(True)
    assert set(merged) == {"iter/hist", "iter/moments"}
    np.testing.assert_array_equal(
        merged["iter/hist"].counts, np_histogram(xs, merged["iter/hist"].edges)
    )
    check_moments(merged["iter/moments"], xs)


def test_statistics_in_vmap_per_example_and_merged() -> None:
    xs = np.random.default_rng(2).uniform(0, 8, size=(3, 6)).astype(np.float32)

    def body(x: jax.Array, ctx: Context) -> tuple[None, Context]:
        _, _, ctx = _stats_body(None, x, ctx)
        return None, ctx

    for merge in (False, True):
        _, coll = eqxctx.vmap_in_context(
            body, context=Context.root(), xs=jnp.asarray(xs), merge_summaries=merge
        )
        flat = coll.flatten("summaries")
        if merge:
            np.testing.assert_array_equal(
                flat["iter/hist"].counts, np_histogram(xs, flat["iter/hist"].edges)
            )
            check_moments(flat["iter/moments"], xs)
        else:
            for i in range(3):
                check_moments(flat[f"iter{i}/moments"], xs[i])
                counts = flat[f"iter{i}/hist"].counts
                np.testing.assert_array_equal(
                    counts, np_histogram(xs[i], (0, 2, 4, 6, 8))
                )


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (simulated) devices")
def test_statistics_from_the_runner_and_accumulated_over_batches() -> None:
    import equinox as eqx

    class Stats(eqx.Module):
        scale: jax.Array

        def __call__(
            self, batch: dict[str, jax.Array], ctx: Context
        ) -> tuple[jax.Array, Context]:
            y = batch["x"] * self.scale
            ctx = ctx.add_summary("hist", HistogramSummary(y, bins=5, range=(-4, 4)))
            ctx = ctx.add_summary("moments", MomentsSummary(y))
            return y, ctx

    mesh = jax.make_mesh((2,), ("data",))
    runner = eqxctx.MethodRunner.create(
        Stats(jnp.float32(2.0)),
        lambda m, b, ctx: m(b, ctx),
        mesh=mesh,
        prng_key=jax.random.PRNGKey(0),
    )
    rng = np.random.default_rng(3)
    batches = [{"x": rng.normal(size=(8, 3)).astype(np.float32)} for _ in range(3)]
    acc = eqxctx.SummaryAccumulator()
    for out in eqxctx.run_batches(runner, batches):
        hist = out.summaries["hist"]
        for words in (hist.counts_high, hist.counts_low):
            assert isinstance(words, jax.Array)
            assert words.sharding.is_fully_replicated
        acc = acc.update(out.summaries)
    flat = acc.flatten()
    y = np.concatenate([b["x"] for b in batches]) * np.float32(2.0)
    np.testing.assert_array_equal(
        flat["hist"].counts, np_histogram(y, flat["hist"].edges)
    )
    check_moments(flat["moments"], y)


def test_histogram_and_moments_identities_change_nothing() -> None:
    import numpy as np

    from eqxctx import HistogramSummary, MomentsSummary

    x = jnp.asarray([0.5, -2.0, 3.0, 7.0])
    h = HistogramSummary(x, bins=4, range=(-4.0, 8.0))
    np.testing.assert_array_equal(h.identity().counts, np.zeros(4))
    np.testing.assert_array_equal(h.identity().accumulate(h).counts, h.counts)
    m = MomentsSummary(x)
    both = m.identity().accumulate(m)
    for field in ("count", "mean", "m2", "min_", "max_", "nonfinite"):
        np.testing.assert_allclose(getattr(both, field), getattr(m, field))
    assert float(m.identity().min_) == np.inf


def test_moments_with_an_empty_side_keep_large_means_finite() -> None:
    m = MomentsSummary(jnp.array([2e19, 2e19], jnp.float32))  # mean**2 > float32 max
    empty = MomentsSummary(jnp.array([1.0]), where=jnp.array([False]))
    for got in (m.identity().accumulate(m), m.accumulate(m.identity()), empty + m):
        assert isinstance(got, MomentsSummary)
        value = got.value()
        assert float(value["variance"]) == 0.0
        assert float(value["mean"]) == pytest.approx(2e19)
        assert int(got.count) == 2


# -- counts past 2**31 (issue 35 item 2) ------------------------------------------

_add = jax.jit(lambda a, b: a.accumulate(b))


def repeated(summary: Any, times: int) -> Any:
    """The summary of `times` copies of `summary`'s values, by doubling (jitted)."""
    out, power = None, summary
    while times:
        if times & 1:
            out = power if out is None else _add(out, power)
        times >>= 1
        if times:
            power = _add(power, power)
    return out


def test_moments_count_stays_exact_past_2_31_and_the_moments_right() -> None:
    # issue 35 item 2: the count was int32 and wrapped at 2**31 (then mean 1e7,
    # variance 1.5e16, negative, NaN).
    base_a, base_b = (
        np.array([1, 2, 6], np.float32),
        np.array([10, 20, np.inf], np.float32),
    )
    ra, rb = 715_827_882, 1_000_000_007  # 2**31 - 2 values, and 3e9 (1e9 inf)
    a = repeated(MomentsSummary(base_a), ra)
    b = repeated(MomentsSummary(base_b[:2]), rb)
    acc, parts = a, [(ra * 3, 3.0, 14 / 3)]
    for k in range(1, 9):
        acc = _add(acc, b if k % 2 else a)
        parts.append((rb * 2, 15.0, 25.0) if k % 2 else (ra * 3, 3.0, 14 / 3))
    # The reference, analytically in float64 NumPy.
    n, mu, var = (np.array(column, np.float64) for column in zip(*parts, strict=True))
    mean = np.sum(n * mu) / np.sum(n)
    variance = np.sum(n * (var + (mu - mean) ** 2)) / np.sum(n)
    count = sum(p[0] for p in parts)
    assert count > 2**34
    value = acc.value()
    np.testing.assert_allclose(float(value["mean"]), mean, rtol=1e-5)
    np.testing.assert_allclose(float(value["variance"]), variance, rtol=1e-4)
    np.testing.assert_allclose(float(value["count"]), count, rtol=1e-6)
    assert int(acc.count) == count  # exact, on the host
    assert acc.count.dtype == np.int64
    # What the writers write: the exact count.
    host = fetch_summaries({"m": acc})
    assert int(np.asarray(host["m/count"])) == count
    np.testing.assert_allclose(np.asarray(host["m/variance"]), variance, rtol=1e-4)
    # The non-finite count too: 1e9 infinities in each of 3e9 values.
    inf = repeated(MomentsSummary(base_b), rb)
    assert int(inf.count) == 3 * rb
    assert int(inf.nonfinite) == rb
    assert int(np.asarray(fetch_summaries({"m": inf})["m/nonfinite"])) == rb


def test_histogram_counts_stay_exact_past_2_31(tmp_path: Any) -> None:
    # issue 35 item 2: bucket counts were int32 (2**31 - 1 at most, then wrapped).
    h = HistogramSummary(np.array([0.5, 1.5, 1.5], np.float32), bins=2, range=(0, 2))
    times = 2**33 + 5
    big = repeated(h, times)
    assert big.counts.tolist() == [times, 2 * times]
    assert big.counts.dtype == np.int64
    with JsonlWriter(tmp_path / "s.jsonl") as writer:
        writer.write(3, {"h": big})
    import json

    line = json.loads((tmp_path / "s.jsonl").read_text())
    assert line["h"] == {"edges": [0.0, 1.0, 2.0], "counts": [times, 2 * times]}


def test_exact_counts_of_values_split_into_chunks(monkeypatch: Any) -> None:
    # Values with more elements than one uint32 (or int32) sum can count are counted
    # in chunks; emulated here with chunks of 4 elements.
    import eqxctx._counting as counting

    monkeypatch.setattr(counting, "MAX_CHUNK", 4)
    x = np.array(
        [0.5, np.inf, 1.5, 1.5, np.nan, 0.25, 1.0, 3.0, 1.75, 0.0, 1.0], np.float32
    )
    keep = np.array([True] * 9 + [False, True])
    for mask in (np.ones_like(keep), keep):
        moments = MomentsSummary(x, where=mask)
        assert int(moments.count) == int(mask.sum())
        assert int(moments.nonfinite) == int((~np.isfinite(x) & mask).sum())
    h = HistogramSummary(x, bins=2, range=(0, 2))
    np.testing.assert_array_equal(h.counts, np_histogram(x, h.edges))
    h = HistogramSummary(x, bins=2, range=(0, 2), where=keep)
    np.testing.assert_array_equal(h.counts, np_histogram(x[keep], h.edges))


# -- infinite and overflowing means (issue 35 item 3) ------------------------------


@pytest.mark.parametrize(
    "parts",
    [
        [[3e38, np.inf], [1.0]],  # the case: NaN instead of inf
        [[1.0], [3e38, np.inf]],
        [[-np.inf, 2.0], [1.0, 5.0]],
        [[np.inf], [-np.inf]],  # inf - inf: NaN, as in NumPy
        [[np.inf, -np.inf], [1.0]],
        [[np.nan], [np.inf]],
        [[3e38, 3e38], [1.0]],  # the sum overflows float32; the mean does not
        [[-3e38], [3e38]],  # the means' difference overflows
        [[-3e38, -3e38, -3e38], [3e38]],
    ],
)
def test_moments_of_infinite_and_huge_values_follow_numpy(parts: list[Any]) -> None:
    chunks = [np.float32(p) for p in parts]
    everything = np.concatenate(chunks).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        want_mean = np.mean(everything)
    a, b = (MomentsSummary(c) for c in chunks)
    for got in (a.accumulate(b), _add(a, b)):
        np.testing.assert_allclose(float(got.value()["mean"]), want_mean, rtol=1e-6)
    for c in chunks:  # each part alone too
        with np.errstate(invalid="ignore", over="ignore"):
            want = np.mean(c.astype(np.float64))
        np.testing.assert_allclose(float(MomentsSummary(c).mean), want, rtol=1e-6)

"""Hypothesis laws of every `Summary` kind's `accumulate` (issue 10).

Associativity (within float tolerance), identities (the zero weight of
`WeightedSummary` and each kind's `identity()`), and equality with a NumPy reference
over random sequences of summaries.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

from eqxctx import (
    AudioSummary,
    CallbackSummary,
    HistogramSummary,
    ImageSummary,
    MaxSummary,
    MinSummary,
    MomentsSummary,
    Summary,
    SumSummary,
    WeightedSummary,
)


SHAPES = st.sampled_from([(), (2,), (2, 3)])


def _floats(shape: tuple[int, ...], lo: float = -100, hi: float = 100) -> Any:
    floats = st.floats(lo, hi, width=32, allow_subnormal=False)
    return hnp.arrays(np.float32, shape, elements=floats)


@st.composite
def _weighted_sequences(draw: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    shape = draw(SHAPES)
    weight_shape = draw(st.sampled_from([(), shape]))
    n = draw(st.integers(1, 6))
    # Weights include 0 (also several zeros in a row) and large ones.
    weights = st.one_of(
        st.just(0.0),
        st.floats(0, 10, width=32),
        st.floats(float(np.float32(1e30)), float(np.float32(1e36)), width=32),
    )
    return [
        (
            draw(_floats(shape)),
            draw(hnp.arrays(np.float32, weight_shape, elements=weights)),
        )
        for _ in range(n)
    ]


def _fold(items: Sequence[Summary]) -> Summary:
    return functools.reduce(lambda a, b: a.accumulate(b), items)


def _weighted_reference(
    pairs: list[tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray]:
    means = np.stack([np.broadcast_to(m, pairs[0][0].shape) for m, _ in pairs])
    weights = np.stack(
        [np.broadcast_to(w, pairs[0][0].shape) for _, w in pairs]
    ).astype(np.float64)
    total = weights.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(total > 0, (means * weights).sum(0) / total, 0.0)
    return mean, np.stack([w for _, w in pairs]).astype(np.float64).sum(0)


@given(_weighted_sequences())
def test_weighted_summary_equals_numpy(pairs: list[Any]) -> None:
    got = _fold([WeightedSummary(m, w) for m, w in pairs])
    assert isinstance(got, WeightedSummary)
    mean, weight = _weighted_reference(pairs)
    if len(pairs) == 1:  # nothing accumulated: the mean as given, also at weight 0
        mean = pairs[0][0]
    np.testing.assert_allclose(got.value(), mean, rtol=2e-5, atol=1e-4)
    np.testing.assert_allclose(got.weight, weight, rtol=1e-5)


@given(_weighted_sequences().filter(lambda p: len(p) >= 2))
def test_weighted_summary_nan_anywhere_gives_nan(pairs: list[Any]) -> None:
    (m, w), *rest = pairs
    for bad in (
        WeightedSummary(np.full_like(m, np.nan), w),
        WeightedSummary(m, np.full_like(w, np.nan)),
    ):
        got = _fold([WeightedSummary(*p) for p in rest] + [bad])
        assert np.all(np.isnan(got.value()))
        got = _fold([bad] + [WeightedSummary(*p) for p in rest])
        assert np.all(np.isnan(got.value()))


@given(_weighted_sequences())
def test_weighted_summary_zero_weight_is_an_identity(pairs: list[Any]) -> None:
    s = _fold([WeightedSummary(m, w) for m, w in pairs])
    assert isinstance(s, WeightedSummary)
    zero = WeightedSummary(np.full_like(pairs[0][0], 17.0), np.zeros_like(pairs[0][1]))
    # Accumulated, a mean of zero total weight is 0 (a lone summary keeps its own).
    want = np.where(np.asarray(s.weight) > 0, s.value(), 0.0)
    for side in (zero.accumulate(s), s.accumulate(zero), s.identity().accumulate(s)):
        assert isinstance(side, WeightedSummary)
        np.testing.assert_allclose(side.value(), want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(side.weight, s.weight, rtol=1e-6)


@given(_weighted_sequences().filter(lambda p: len(p) >= 3))
def test_weighted_summary_is_associative(pairs: list[Any]) -> None:
    a, b, c = (WeightedSummary(m, w) for m, w in pairs[:3])
    left = a.accumulate(b).accumulate(c)
    right = a.accumulate(b.accumulate(c))
    np.testing.assert_allclose(left.value(), right.value(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(left.weight, right.weight, rtol=1e-6)


_ELEMENTWISE: list[tuple[type[Any], Callable[..., Any]]] = [
    (MinSummary, np.minimum),
    (MaxSummary, np.maximum),
    (SumSummary, np.add),
]


@st.composite
def _value_sequences(draw: Any, dtype: Any = np.float32) -> list[np.ndarray]:
    shape = draw(SHAPES)
    n = draw(st.integers(1, 6))
    if np.issubdtype(dtype, np.integer):
        elements: Any = st.integers(-1000, 1000)
    else:
        # No subnormals: XLA's CPU backend flushes them to zero.
        elements = st.floats(-100, 100, width=32, allow_subnormal=False)
    return [draw(hnp.arrays(dtype, shape, elements=elements)) for _ in range(n)]


@given(
    st.sampled_from(range(len(_ELEMENTWISE))),
    st.sampled_from([np.float32, np.int32]),
    st.data(),
)
def test_elementwise_kinds_equal_numpy(i: int, dtype: Any, data: st.DataObject) -> None:
    kind, op = _ELEMENTWISE[i]
    values = data.draw(_value_sequences(dtype))
    got = _fold([kind(v) for v in values])
    want = functools.reduce(op, values)
    np.testing.assert_allclose(got.value(), want, rtol=1e-5, atol=1e-3)
    assert got.value().dtype == want.dtype
    # Associativity (exact for min/max and integer sums; float sums within
    # tolerance), and the identity on both sides.
    if len(values) >= 3:
        a, b, c = (kind(v) for v in values[:3])
        np.testing.assert_allclose(
            a.accumulate(b).accumulate(c).value(),
            a.accumulate(b.accumulate(c)).value(),
            rtol=1e-5,
            atol=1e-3,
        )
    identity = got.identity()
    assert identity is not None
    np.testing.assert_array_equal(identity.accumulate(got).value(), got.value())
    np.testing.assert_array_equal(got.accumulate(identity).value(), got.value())


@given(st.sampled_from(range(len(_ELEMENTWISE))), st.data())
def test_elementwise_kinds_propagate_nan(i: int, data: st.DataObject) -> None:
    kind, _ = _ELEMENTWISE[i]
    values = data.draw(_value_sequences())
    position = data.draw(st.integers(0, len(values)))
    items = [kind(v) for v in values]
    items.insert(position, kind(np.full_like(values[0], np.nan)))
    assert np.all(np.isnan(_fold(items).value()))


@given(_value_sequences())
def test_histogram_equals_numpy(values: list[np.ndarray]) -> None:
    edges = np.linspace(-100, 100, 9)
    got = _fold([HistogramSummary(v, edges=edges) for v in values])
    assert isinstance(got, HistogramSummary)
    want = np.histogram(np.concatenate([v.ravel() for v in values]), bins=edges)[0]
    np.testing.assert_array_equal(got.value(), want)
    if len(values) >= 3:
        a, b, c = (HistogramSummary(v, edges=edges) for v in values[:3])
        np.testing.assert_array_equal(
            a.accumulate(b).accumulate(c).value(), a.accumulate(b.accumulate(c)).value()
        )
    np.testing.assert_array_equal(got.identity().accumulate(got).value(), want)


@given(_value_sequences())
def test_moments_equal_numpy(values: list[np.ndarray]) -> None:
    got = _fold([MomentsSummary(v) for v in values])
    assert isinstance(got, MomentsSummary)
    every = np.concatenate([v.ravel() for v in values]).astype(np.float64)
    value = got.value()
    assert int(value["count"]) == every.size
    if every.size:
        np.testing.assert_allclose(value["mean"], every.mean(), rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(value["variance"], every.var(), rtol=1e-3, atol=1e-2)
        np.testing.assert_allclose(value["min"], every.min())
        np.testing.assert_allclose(value["max"], every.max())
    if len(values) >= 3:
        a, b, c = (MomentsSummary(v) for v in values[:3])
        left = a.accumulate(b).accumulate(c).value()
        right = a.accumulate(b.accumulate(c)).value()
        for key in left:
            np.testing.assert_allclose(left[key], right[key], rtol=1e-4, atol=1e-2)
    same = got.identity().accumulate(got).value()
    for key in value:
        np.testing.assert_allclose(same[key], value[key], rtol=1e-6)


def _sum(x: Any) -> Any:
    return np.sum(x)


@given(st.integers(1, 5), st.data())
def test_media_kinds_keep_the_first(n: int, data: st.DataObject) -> None:
    images = [data.draw(_floats((1, 2, 2, 3), 0, 1)) for _ in range(n)]
    got = _fold([ImageSummary(x) for x in images])
    np.testing.assert_array_equal(got.value(), images[0])
    waves = [data.draw(_floats((4,), -1, 1)) for _ in range(n)]
    got = _fold([AudioSummary(x, sample_rate=8000) for x in waves])
    np.testing.assert_array_equal(got.value(), waves[0])
    args = [data.draw(_floats((2,))) for _ in range(n)]
    got = _fold([CallbackSummary(_sum, x) for x in args])
    np.testing.assert_allclose(got.value(), np.sum(args[0]))
    # Associativity holds trivially; there is no identity (None).
    assert ImageSummary(images[0]).identity() is None


@given(_weighted_sequences())
def test_accumulate_under_jit_equals_eager(pairs: list[Any]) -> None:
    items = [WeightedSummary(m, w) for m, w in pairs]
    eager = _fold(list(items))
    jitted = jax.jit(lambda xs: _fold(list(xs)))(items)
    np.testing.assert_allclose(jitted.value(), eager.value(), rtol=1e-6, atol=1e-6)
    assert jnp.shape(jitted.value()) == jnp.shape(eager.value())


@given(
    _weighted_sequences(),
    st.sampled_from(["none", "nan mean", "nan weight", "near the maximum"]),
    st.data(),
)
def test_one_reduction_over_stacked_equals_accumulate(
    pairs: list[Any], case: str, data: st.DataObject
) -> None:
    """Merged vmaps, `merge_iterations` and merged gradient summaries reduce a stacked
    `WeightedSummary` in one reduction; it follows `accumulate`'s rule: NaN anywhere
    (a NaN mean at zero weight too) gives NaN, weights near the maximum do not
    overflow."""
    from eqxctx import Context, IterationSummaries, OutputCollection, vmap_in_context

    means = np.stack([m for m, _ in pairs])
    weights = np.stack([w for _, w in pairs])
    i = data.draw(st.integers(0, len(pairs) - 1))
    if case == "nan mean":
        means[i] = np.nan
        weights[i] = data.draw(st.sampled_from([0.0, 1.0]))
    elif case == "nan weight":
        weights[i] = np.nan
    elif case == "near the maximum":  # (their total still finite)
        weights[...] = np.float32(3.2e38 / len(pairs))
    want = _fold([WeightedSummary(m, w) for m, w in zip(means, weights, strict=True)])
    assert isinstance(want, WeightedSummary)
    stacked = {"s": WeightedSummary(means, weights)}
    entry = OutputCollection({"iter": IterationSummaries(len(pairs), stacked)}, {}, {})
    got = entry.merge_iterations().flatten("summaries")["iter/s"]
    np.testing.assert_allclose(got.value(), want.value(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got.weight, want.weight, rtol=1e-5)
    if len(pairs) >= 2:  # a merged vmap (one example is returned as it is)

        def body(x: Any, ctx: Context) -> tuple[None, Context]:
            return None, ctx.add_summary("s", WeightedSummary(*x))

        _, coll = vmap_in_context(
            body, context=Context.root(), xs=(means, weights), merge_summaries=True
        )
        merged = coll.flatten("summaries")["iter/s"]
        np.testing.assert_allclose(merged.value(), want.value(), rtol=1e-5, atol=1e-4)
    if case in ("nan mean", "nan weight") and len(pairs) >= 2:
        assert np.all(np.isnan(np.asarray(got.value())))


def test_merged_weighted_means_agree_across_constructs() -> None:
    """The reviewer's cases: a float16 mean with large integer weights, a NaN mean at
    zero weight, a NaN weight, float32 weights near the maximum; a merged scan
    (`accumulate`, pairwise), a merged vmap and `merge_iterations` (one reduction)
    give `accumulate`'s answer."""
    from eqxctx import Context, scan_in_context, vmap_in_context

    cases = [
        (np.array([1.0, 1.0], np.float16), np.array([40000, 40000], np.int32), 1.0),
        (np.array([np.nan, 2.0], np.float32), np.array([0.0, 1.0], np.float32), None),
        (np.array([1.0, 2.0], np.float32), np.array([np.nan, 1.0], np.float32), None),
        (np.array([1.0, 3.0], np.float32), np.array([3e38, 3e38], np.float32), 2.0),
    ]

    def body(x: Any, ctx: Context) -> tuple[None, Context]:
        return None, ctx.add_summary("s", WeightedSummary(*x))

    def scan_body(c: Any, x: Any, ctx: Context) -> tuple[Any, None, Context]:
        return c, None, body(x, ctx)[1]

    root = Context.root()
    for means, weights, want in cases:
        xs = (jnp.asarray(means), jnp.asarray(weights))
        _, _, merged = scan_in_context(
            scan_body, context=root, carry=0, xs=xs, merge_summaries=True
        )
        _, _, per_iteration = scan_in_context(scan_body, context=root, carry=0, xs=xs)
        _, vmapped = vmap_in_context(body, context=root, xs=xs, merge_summaries=True)
        for coll in (merged, per_iteration.merge_iterations(), vmapped):
            got = float(coll.flatten("summaries")["iter/s"].value())
            if want is None:
                assert np.isnan(got)
            else:
                assert got == pytest.approx(want, rel=1e-3)


def test_weights_are_added_and_scaled_in_at_least_32_bits() -> None:
    from eqxctx import Context, scan_in_context

    # A float16 mean whose weights pass float16's maximum (token counts).
    got = WeightedSummary(jnp.float16(1.0), jnp.float32(70000.0)).accumulate(
        WeightedSummary(jnp.float16(3.0), jnp.float32(1.0))
    )
    assert got.mean.dtype == jnp.float16
    assert float(got.value()) == pytest.approx((70000 + 3) / 70001, rel=1e-3)

    def body(c: Any, x: Any, ctx: Context) -> tuple[Any, None, Context]:
        m, w = x
        return c, None, ctx.add_summary("s", WeightedSummary(m, w))

    means = jnp.array([0.0, 1.0, 2.0])
    for weights, want_weight in (
        (jnp.full(3, 40000.0, jnp.float16), 120000.0),  # float16 overflows at 65504
        (jnp.full(3, 200, jnp.uint8), 600),  # uint8 wraps at 255
        (jnp.ones(3, jnp.bool_), 3),  # `True + True` is a logical or
    ):
        for m in (means, means.astype(jnp.float16)):
            _, _, coll = scan_in_context(
                body,
                context=Context.root(),
                carry=0,
                xs=(m, weights),
                merge_summaries=True,
            )
            s = coll.flatten("summaries")["iter/s"]
            assert float(s.value()) == pytest.approx(1.0, rel=1e-3)
            assert float(s.weight) == want_weight
            merged = scan_in_context(
                body, context=Context.root(), carry=0, xs=(m, weights)
            )[2].merge_iterations()
            assert float(merged.flatten("summaries")["iter/s"].weight) == want_weight

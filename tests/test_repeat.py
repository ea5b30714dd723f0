"""merge_iterations against merge_summaries=True and a loop, in both directions."""

from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from combinators_reference import assert_flat_close
from eqxctx import (
    AudioSummary,
    CallbackSummary,
    Context,
    HistogramSummary,
    ImageSummary,
    IterationSummaries,
    MaxSummary,
    MinSummary,
    MomentsSummary,
    OutputCollection,
    SumSummary,
    WeightedSummary,
    cond_in_context,
    scan_in_context,
)


def _host(x: Any) -> Any:
    return x


KINDS = (
    "raw",
    "weighted",
    "min",
    "max",
    "sum",
    "image",
    "audio",
    "callback",
    "hist",
    "moments",
)


def _summary(kind: str, x: jax.Array) -> Any:
    """A summary of `kind` whose value tells the iteration that made it."""
    if kind == "raw":
        return x * 2.0
    if kind == "weighted":
        return WeightedSummary(x, jnp.abs(x) + 0.5)
    if kind == "min":
        return MinSummary(x)
    if kind == "max":
        return MaxSummary(x)
    if kind == "sum":
        return SumSummary(x)
    if kind == "image":
        return ImageSummary(jnp.broadcast_to(x, (1, 2, 2)))
    if kind == "audio":
        return AudioSummary(jnp.broadcast_to(x, (3,)))
    if kind == "callback":
        return CallbackSummary(_host, x)
    if kind == "hist":
        return HistogramSummary(jnp.stack([x, -x]))
    if kind == "moments":
        return MomentsSummary(jnp.stack([x, 2 * x]))
    raise AssertionError(kind)


@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=4),
    n=st.integers(0, 4),
    reverse=st.booleans(),
    inner_reverse=st.booleans(),
    nested=st.booleans(),
    jit=st.booleans(),
)
def test_merge_iterations_equals_merged_scan(
    kinds: list[str],
    n: int,
    reverse: bool,
    inner_reverse: bool,
    nested: bool,
    jit: bool,
) -> None:
    """For every kind, also under `reverse=True` (keep-first kinds used index order)."""

    def leaf_body(c: Any, x: Any, ctx: Context) -> tuple[Any, None, Context]:
        for k, kind in enumerate(kinds):
            ctx = ctx.add_summary(f"s{k}", _summary(kind, x))
        return c, None, ctx

    def run(merge: bool) -> OutputCollection:
        def body(c: Any, x: Any, ctx: Context) -> tuple[Any, None, Context]:
            if not nested:
                return leaf_body(c, x, ctx)
            _, _, inner = scan_in_context(
                leaf_body,
                context=ctx,
                carry=0.0,
                xs=x + jnp.arange(3.0),
                merge_summaries=merge,
                reverse=inner_reverse,
                child_name_prefix="layer",
            )
            return c, None, ctx.merge(inner)

        xs = jnp.linspace(-1.0, 2.0, n)
        return scan_in_context(
            body,
            context=Context.root(),
            carry=0.0,
            xs=xs,
            merge_summaries=merge,
            reverse=reverse,
        )[2]

    per_iteration = jax.jit(lambda: run(False))() if jit else run(False)
    assert per_iteration.summaries["iter"].reverse == reverse
    assert_flat_close(
        per_iteration.merge_iterations().flatten("summaries"),
        run(True).flatten("summaries"),
        "merged",
    )


@pytest.mark.parametrize("reverse", [False, True])
def test_keep_first_kinds_keep_the_first_iteration_run(reverse: bool) -> None:
    """A Python loop in execution order: media kinds keep the first one run."""

    def body(c: Any, x: Any, ctx: Context) -> tuple[Any, None, Context]:
        for kind in ("image", "audio", "callback", "sum"):
            ctx = ctx.add_summary(kind, _summary(kind, x))
        return c, None, ctx

    xs = jnp.array([1.0, 2.0, 3.0])
    coll = scan_in_context(
        body, context=Context.root(), carry=0.0, xs=xs, reverse=reverse
    )[2]
    got = coll.merge_iterations().flatten("summaries")
    first = float(xs[-1] if reverse else xs[0])  # the first iteration run
    np.testing.assert_array_equal(got["iter/image"].value_, np.full((1, 2, 2), first))
    np.testing.assert_array_equal(got["iter/audio"].value_, np.full(3, first))
    assert float(got["iter/callback"].args[0]) == first
    assert float(got["iter/sum"].value()) == 6.0
    # The per-iteration views are by xs index in both directions.
    flat = coll.flatten("summaries")
    assert [float(flat[f"iter{i}/sum"].value()) for i in range(3)] == [1.0, 2.0, 3.0]


def test_reverse_flag_survives_jit_prune_and_cond() -> None:
    def body(c: Any, x: Any, ctx: Context) -> tuple[Any, None, Context]:
        ctx = ctx.add_summary("img", _summary("image", x))
        return c, None, ctx.add_summary("x", x)

    def scan(ctx: Context, reverse: bool) -> OutputCollection:
        xs = jnp.array([1.0, 2.0, 3.0])
        return scan_in_context(body, context=ctx, carry=0.0, xs=xs, reverse=reverse)[2]

    def kept(coll: OutputCollection) -> float:
        merged = coll.merge_iterations().flatten("summaries")
        return float(np.ravel(merged["iter/img"].value_)[0])

    coll = scan(Context.root(), True)
    assert kept(coll) == 3.0
    assert kept(jax.jit(lambda c: c)(coll)) == 3.0
    assert kept(coll.prune(lambda p: p.endswith("/x"))) == 3.0

    def branch(reverse: bool) -> Any:
        def fn(ctx: Context) -> tuple[None, Context]:
            return None, ctx.merge(scan(ctx, reverse))

        return fn

    _, in_cond = cond_in_context(
        jnp.array(True), branch(True), branch(True), context=Context.root()
    )
    assert kept(in_cond.child("cond")) == 3.0
    with pytest.raises(ValueError, match="forward in some branches and in reverse"):
        cond_in_context(
            jnp.array(True), branch(True), branch(False), context=Context.root()
        )


def test_reverse_argument_is_checked() -> None:
    with pytest.raises(TypeError, match="reverse must be a bool"):
        IterationSummaries(2, {"x": np.zeros(2)}, reverse=1)
    a = IterationSummaries(2, {"x": np.zeros(2)}, reverse=True)
    b = IterationSummaries(2, {"x": np.zeros(2)})
    assert a.reverse
    assert not b.reverse
    assert jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b)

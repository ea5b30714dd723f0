"""scan_in_context's compiled program: size, outputs, memory, gradients, errors."""

import functools
import re
import types
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxctx import (
    AudioSummary,
    CallbackSummary,
    Context,
    HistogramSummary,
    ImageSummary,
    IterationSummaries,
    MaxSummary,
    MinSummary,
    SumSummary,
    WeightedSummary,
    scan_in_context,
    vmap_in_context,
)


_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+ = ", re.MULTILINE)


def hlo_instructions(fn: Any, *args: Any) -> int:
    """Count the instructions of the optimized HLO of `jax.jit(fn)(*args)`."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    assert text is not None
    return len(_INSTRUCTION.findall(text))


def _layer(
    h: jax.Array, w: jax.Array, s: int
) -> tuple[jax.Array, dict[str, jax.Array]]:
    h = jnp.tanh(h @ w)
    return h, {f"s{j}": jnp.mean(h) * (j + 1.0) for j in range(s)}


def _ours(s: int, **kwargs: Any) -> Any:
    def body(h: jax.Array, w: jax.Array, ctx: Context) -> Any:
        h, sums = _layer(h, w, s)
        for name, value in sums.items():
            ctx = ctx.add_summary(name, value)
        return h, None, ctx.add_module_output("h", h)

    def run(h: jax.Array, ws: jax.Array, key: Any) -> Any:
        context = Context.root(prng_key=key)
        return scan_in_context(body, context=context, carry=h, xs=ws, **kwargs)

    return run


def _hand(s: int) -> Any:
    def run(h: jax.Array, ws: jax.Array, key: Any) -> Any:
        del key

        def f(h: jax.Array, w: jax.Array) -> Any:
            h, sums = _layer(h, w, s)
            return h, (sums, h)

        return jax.lax.scan(f, h, ws)

    return run


def _args(n: int, width: int = 16) -> tuple[jax.Array, jax.Array]:
    h = jnp.linspace(-1.0, 1.0, 4 * width).reshape(4, width)
    ws = jnp.linspace(-0.2, 0.2, n * width * width).reshape(n, width, width)
    return h, ws


@pytest.mark.parametrize("s", [1, 4])
def test_same_program_as_hand_written_scan(s: int) -> None:
    counts: list[int] = []
    for n in (2, 8, 32):
        h, ws = _args(n)
        for key in (None, jax.random.PRNGKey(0)):
            ours = hlo_instructions(_ours(s), h, ws, key)
            hand = hlo_instructions(_hand(s), h, ws, key)
            assert abs(ours - hand) <= 0.02 * hand, (n, key, ours, hand)
            counts.append(ours)
        carry, _, coll = jax.jit(_ours(s))(h, ws, None)
        hand_carry, (sums, hs) = jax.jit(_hand(s))(h, ws, None)
        np.testing.assert_allclose(carry, hand_carry, rtol=1e-6)
        np.testing.assert_allclose(
            coll.flatten("module_outputs")["iter/h"], hs, rtol=1e-6
        )
        stacked = coll.summaries["iter"]
        assert isinstance(stacked, IterationSummaries)
        for name, value in sums.items():
            np.testing.assert_allclose(stacked.stacked[name], value, rtol=1e-6)
            np.testing.assert_allclose(
                coll.flatten("summaries")[f"iter{n - 1}/{name}"], value[-1], rtol=1e-6
            )
    # Independent of the number of layers: exactly on XLA:CPU; XLA:TPU's count moves
    # by an instruction or two with the trip count, for the hand-written scan too.
    if jax.default_backend() == "cpu":
        assert len(set(counts)) == 1, counts
    else:
        assert max(counts) - min(counts) <= 0.05 * min(counts), counts


def test_jitted_per_iteration_mode_returns_one_array_per_summary() -> None:
    n, s = 64, 8
    h, ws = _args(n, width=4)
    lowered = jax.jit(_ours(s)).lower(h, ws, None)
    outputs = jax.tree_util.tree_leaves(lowered.out_info)
    # carry + module output + S stacked summaries, not N * S scalars.
    assert len(outputs) == 2 + s
    assert sorted(o.shape for o in outputs) == sorted([(4, 4), (n, 4, 4)] + [(n,)] * s)


def test_dropped_outputs_are_not_program_outputs() -> None:
    h, ws = _args(16, width=4)
    run = _ours(3, drop_output=lambda p: p in {"module_outputs/h", "summaries/s1"})
    outputs = jax.tree_util.tree_leaves(jax.jit(run).lower(h, ws, None).out_info)
    assert sorted(o.shape for o in outputs) == [(4, 4), (16,), (16,)]
    _, _, coll = jax.jit(run)(h, ws, None)
    assert coll.flatten("module_outputs") == {}
    assert {p.split("/")[1] for p in coll.flatten("summaries")} == {"s0", "s2"}


def test_nested_scan_with_drop_output_keeps_inner_summaries_stacked() -> None:
    """Pruning an outer body does not slice an inner scan's per-iteration summaries."""
    m, n, s = 3, 5, 2
    h0 = jnp.ones((2, 4), jnp.float32)
    ws = jax.random.normal(jax.random.PRNGKey(0), (m, n, 4, 4)) * 0.3

    def outer_body(h: jax.Array, w_block: jax.Array, ctx: Context) -> Any:
        h, _, inner = _ours(s)(h, w_block, None)
        return h, None, ctx.merge(inner)

    def run(drop: Any) -> Any:
        return scan_in_context(
            outer_body,
            context=Context.root(prng_key=None),
            carry=h0,
            xs=ws,
            child_name_prefix="block",
            drop_output=drop,
        )

    for drop, compact in (
        (lambda p: p.startswith("module_outputs"), True),  # the same per iteration
        (  # depends on the inner iteration: sliced
            lambda p: p == "summaries/iter2/s0" or p.startswith("module_outputs"),
            False,
        ),
    ):
        jitted = jax.jit(functools.partial(run, drop))
        outputs = jax.tree_util.tree_leaves(jitted.lower().out_info)
        if compact:
            # The carry and S stacked [M, N] summaries, not M * N * S slices.
            assert sorted(o.shape for o in outputs) == [(2, 4)] + [(m, n)] * s
        else:
            # The carry and the N * S - 1 kept slices, each stacked over M.
            assert sorted(o.shape for o in outputs) == [(2, 4)] + [(m,)] * (n * s - 1)
        h, _, coll = jitted()
        entry = coll.summaries["block"]
        assert isinstance(entry, IterationSummaries)
        inner = entry.stacked.get("iter")
        assert isinstance(inner, IterationSummaries) == compact
        # Values: a Python loop over the blocks and layers.
        ref_h = h0
        for i in range(m):
            for j in range(n):
                ref_h, sums = _layer(ref_h, ws[i, j], s)
                for name, value in sums.items():
                    path = f"block{i}/iter{j}/{name}"
                    got = coll.flatten("summaries").get(path)
                    if drop(f"summaries/iter{j}/{name}"):
                        assert got is None, path
                    else:
                        np.testing.assert_allclose(got, value, rtol=1e-5, err_msg=path)
        np.testing.assert_allclose(h, ref_h, rtol=1e-5)
        assert coll.flatten("module_outputs") == {}


def test_stacked_module_with_a_function_field_gets_a_clear_error() -> None:
    mlps = eqx.filter_vmap(lambda k: eqx.nn.MLP(2, 2, 4, 1, key=k))(
        jax.random.split(jax.random.PRNGKey(0), 3)
    )
    with pytest.raises(
        TypeError, match=r"xs\.activation is a .*not an array.*eqx\.partition"
    ):
        scan_in_context(
            lambda h, m, c: (m(h), None, c),
            context=Context.root(),
            carry=jnp.ones(2),
            xs=mlps,
        )
    with pytest.raises(TypeError, match=r"xs\.activation is a .*not an array"):
        vmap_in_context(
            lambda m, c: (m(jnp.ones(2)), c), context=Context.root(), xs=mlps
        )
    # The documented way works and matches a Python loop.
    params, static = eqx.partition(mlps, eqx.is_array)
    h, _, _ = scan_in_context(
        lambda h, p, c: (eqx.combine(p, static)(h), None, c),
        context=Context.root(),
        carry=jnp.ones(2),
        xs=params,
    )
    ref = jnp.ones(2)
    for i in range(3):
        ref = eqx.combine(jax.tree.map(lambda a, i=i: a[i], params), static)(ref)
    np.testing.assert_allclose(h, ref, rtol=1e-6)


def test_carry_that_changes_dtype_names_the_carry() -> None:
    with pytest.raises(
        TypeError,
        match=r"carry\['n'\] went in as int32\[\] but the body returned float32\[\]",
    ):
        scan_in_context(
            lambda c, x, k: ({"n": c["n"].astype(jnp.float32) + x}, None, k),
            context=Context.root(),
            carry={"n": jnp.int32(0)},
            xs=jnp.arange(3.0),
        )
    with pytest.raises(TypeError, match="carry with structure"):
        scan_in_context(
            lambda c, x, k: ((c, c), None, k),
            context=Context.root(),
            carry=jnp.float32(0),
            xs=jnp.arange(3.0),
        )
    # A Python float carry is weakly typed: float32 in, float32 out is fine.
    c, _, _ = scan_in_context(
        lambda c, x, k: (c + x, None, k),
        context=Context.root(),
        carry=0.0,
        xs=jnp.arange(3.0),
    )
    assert float(c) == 3.0


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize(
    ("init", "factor"),
    [
        (0.0, jnp.bfloat16(2)),  # narrowed, as in mixed precision
        (1, jnp.int8(2)),
        (1, jnp.float32(2)),  # widened
        (jnp.asarray(0.5), jnp.bfloat16(3)),  # a weakly typed array
        (0.0, jnp.float32(2)),  # unchanged
    ],
)
def test_weakly_typed_carry_follows_lax_scan(
    init: Any, factor: Any, merge: bool
) -> None:
    """A weakly typed carry may change dtype once, as in `jax.lax.scan`."""
    traces = {"lax": 0, "ctx": 0}

    def lax_body(c: Any, x: Any) -> Any:
        traces["lax"] += 1
        return c * factor + 1, c

    def body(c: Any, x: Any, ctx: Context) -> Any:
        traces["ctx"] += 1
        return c * factor + 1, c, ctx.add_summary("c", c)

    want, want_ys = jax.lax.scan(lax_body, init, None, length=3)
    got, ys, coll = scan_in_context(
        body,
        context=Context.root(),
        carry=init,
        xs=None,
        length=3,
        merge_summaries=merge,
    )
    assert got.dtype == want.dtype
    assert ys.dtype == want_ys.dtype
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ys, want_ys)
    summaries = coll.flatten("summaries")
    if merge:
        assert summaries["iter/c"].dtype == want_ys.dtype
        np.testing.assert_array_equal(
            summaries["iter/c"], np.sum(want_ys, dtype=want_ys.dtype)
        )
        # One abstract pass for the accumulator; the carry is converted between
        # passes, so the scan itself traces the body once.
        assert traces["ctx"] == traces["lax"] + 1
    else:
        assert [summaries[f"iter{i}/c"] for i in range(3)] == list(np.asarray(want_ys))
        assert {summaries[f"iter{i}/c"].dtype for i in range(3)} == {want_ys.dtype}
        assert traces["ctx"] == traces["lax"]


def test_weakly_typed_carry_errors() -> None:
    ctx = Context.root()
    zero: Any = 0.0  # a weakly typed carry
    # A weakly typed carry may change dtype, never shape.
    with pytest.raises(TypeError, match="shapes do not match"):
        jax.lax.scan(
            lambda c, x: (jnp.zeros(3, jnp.bfloat16), None), zero, None, length=2
        )
    with pytest.raises(
        TypeError,
        match=r"carry went in as a weakly typed float32\[\] \(e\.g\. a Python scalar\) "
        r"but the body returned bfloat16\[3\]; .* may change its dtype once, never "
        "its shape",
    ):
        scan_in_context(
            lambda c, x, k: (jnp.zeros(3, jnp.bfloat16), None, k),
            context=ctx,
            carry=zero,
            xs=None,
            length=2,
        )

    # Converted once: given bfloat16 the body must return bfloat16.
    def flip(c: Any, x: Any = None, k: Any = None) -> Any:
        out = c.astype(jnp.float32) if c.dtype == jnp.bfloat16 else c * jnp.bfloat16(2)
        return out, None, k

    with pytest.raises(TypeError):
        jax.lax.scan(lambda c, x: flip(c)[:2], zero, None, length=2)
    for merge in (False, True):
        with pytest.raises(
            TypeError,
            match=r"carry went in as a weakly typed float32\[\] .*, which "
            r"`jax\.lax\.scan` converted to bfloat16\[\] .* but the body returned "
            r"float32\[\]",
        ):
            scan_in_context(
                flip, context=ctx, carry=zero, xs=None, length=2, merge_summaries=merge
            )
    # No promotion path under strict promotion (conftest): JAX's own error, as in
    # `jax.lax.scan`.
    promotion = "no available implicit dtype promotion path"
    with pytest.raises(ValueError, match=promotion):  # TypePromotionError
        jax.lax.scan(lambda c, x: (jnp.int32(3), None), zero, None, length=2)
    with pytest.raises(ValueError, match=promotion):
        scan_in_context(
            lambda c, x, k: (jnp.int32(3), None, k),
            context=ctx,
            carry=zero,
            xs=None,
            length=2,
        )
    # A strongly typed carry is not converted (as in `jax.lax.scan`).
    with pytest.raises(TypeError, match=r"carry went in as float32\[\] but"):
        scan_in_context(
            lambda c, x, k: (c.astype(jnp.bfloat16), None, k),
            context=ctx,
            carry=jnp.float32(0),
            xs=None,
            length=2,
        )


@pytest.mark.cpu_only(
    reason="XLA:TPU's buffer assignment adds a few percent of temp bytes at 256 "
    "iterations (483,840 vs 451,584 bytes at 8 on a v5e), far below a stacked [N, 64]"
)
def test_merge_memory_does_not_grow_with_iterations() -> None:
    def body(h: jax.Array, w: jax.Array, ctx: Context) -> Any:
        h = jnp.tanh(h * w)
        ctx = ctx.add_summary("act", h)  # a [64] summary: stacked, it would grow
        ctx = ctx.add_summary("mean", WeightedSummary(jnp.mean(h), 1.0))
        ctx = ctx.add_summary("max", MaxSummary(h))
        ctx = ctx.add_summary("noise", jax.random.uniform(ctx.prng_key, (64,)))
        return h, None, ctx

    def temp_bytes(n: int) -> int:
        def run(h: jax.Array, ws: jax.Array, key: jax.Array) -> Any:
            context = Context.root(prng_key=key)
            return scan_in_context(
                body, context=context, carry=h, xs=ws, merge_summaries=True
            )

        args = (jnp.ones(64), jnp.ones((n, 64)), jax.random.PRNGKey(0))
        analysis = jax.jit(run).lower(*args).compile().memory_analysis()
        assert analysis is not None
        return analysis.temp_size_in_bytes

    assert temp_bytes(256) <= temp_bytes(8)


def _loss_terms(carry: jax.Array, hs: jax.Array, sums: dict[str, Any]) -> jax.Array:
    return jnp.sum(carry) + jnp.sum(hs**2) + sum(jnp.sum(v) for v in sums.values())


@pytest.mark.parametrize(
    "remat",
    [None, {}, {"policy": jax.checkpoint_policies.nothing_saveable}],
)
def test_gradients_equal_hand_written_scan(remat: Any) -> None:
    h, ws = _args(6, width=8)

    def ours(h: jax.Array, ws: jax.Array, merge: bool) -> jax.Array:
        carry, _, coll = _ours(2, remat_kwargs=remat, merge_summaries=merge)(
            h, ws, None
        )
        sums = {k: v for k, v in coll.flatten("summaries").items()}
        return _loss_terms(carry, coll.flatten("module_outputs")["iter/h"], sums)

    def hand(h: jax.Array, ws: jax.Array) -> jax.Array:
        carry, (sums, hs) = _hand(2)(h, ws, None)
        return _loss_terms(carry, hs, sums)

    want = jax.grad(hand, argnums=(0, 1))(h, ws)
    for merge in (False, True):
        got = jax.jit(jax.grad(ours, argnums=(0, 1)), static_argnums=2)(h, ws, merge)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _kinds_body(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    i = x.astype(jnp.float32)
    ctx = ctx.add_summary("weighted", WeightedSummary(i * 2.0, i + 1.0))
    ctx = ctx.add_summary("min", MinSummary(jnp.stack([i, -i])))
    ctx = ctx.add_summary("max", MaxSummary(jnp.stack([i, -i])))
    ctx = ctx.add_summary("sum", SumSummary(i))
    ctx = ctx.add_summary("raw", i)
    ctx = ctx.add_summary("image", ImageSummary(jnp.full((1, 2, 2), i)))
    ctx = ctx.add_summary("audio", AudioSummary(jnp.full((4,), i), sample_rate=8000))
    hist = HistogramSummary(jnp.full((3,), i), bins=8, range=(0, 8))
    ctx = ctx.add_summary("hist", hist)
    ctx = ctx.add_summary("callback", CallbackSummary(lambda v: v + 100.0, i))
    return x, ctx


def _check_kinds(flat: dict[str, Any], n: int, first: int) -> None:
    i = np.arange(n, dtype=np.float32)
    weighted = flat["iter/weighted"]
    np.testing.assert_allclose(
        weighted.value(), np.sum(2 * i * (i + 1)) / np.sum(i + 1)
    )
    np.testing.assert_allclose(weighted.weight, np.sum(i + 1))
    np.testing.assert_array_equal(flat["iter/min"].value(), [0.0, -(n - 1.0)])
    np.testing.assert_array_equal(flat["iter/max"].value(), [n - 1.0, 0.0])
    np.testing.assert_allclose(flat["iter/sum"].value(), np.sum(i))
    np.testing.assert_allclose(flat["iter/raw"], np.sum(i))
    # Media and callbacks keep the first value in accumulation order.
    np.testing.assert_array_equal(flat["iter/image"].value(), np.full((1, 2, 2), first))
    np.testing.assert_array_equal(flat["iter/audio"].value(), np.full((4,), first))
    assert flat["iter/audio"].sample_rate == 8000
    # Histograms add their counts: 3 values of i in bucket i, for each i < n.
    np.testing.assert_array_equal(flat["iter/hist"].value(), 3 * (np.arange(8) < n))
    np.testing.assert_allclose(flat["iter/callback"].value(), first + 100.0)


@pytest.mark.parametrize("reverse", [False, True])
def test_merged_summary_kinds_scan(reverse: bool) -> None:
    n = 5

    def body(c: Any, x: jax.Array, ctx: Context) -> Any:
        y, ctx = _kinds_body(x, ctx)
        return c, y, ctx

    _, _, coll = jax.jit(
        lambda xs: scan_in_context(
            body,
            context=Context.root(),
            carry=0,
            xs=xs,
            reverse=reverse,
            merge_summaries=True,
        )
    )(jnp.arange(n))
    # Execution order: under reverse=True the first accumulated is the last index.
    _check_kinds(coll.flatten("summaries"), n, first=n - 1 if reverse else 0)


def test_merged_summary_kinds_vmap() -> None:
    _, coll = vmap_in_context(
        _kinds_body, context=Context.root(), xs=jnp.arange(4), merge_summaries=True
    )
    _check_kinds(coll.flatten("summaries"), 4, first=0)


def _never(c: Any, x: Any, ctx: Context) -> Any:
    raise AssertionError("the body must not be traced")


def _never_vmap(x: Any, ctx: Context) -> Any:
    raise AssertionError("the body must not be traced")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"xs": {"a": jnp.ones((3, 2)), "b": jnp.ones(4)}},
            r"disagree: xs\['a'\] \(3, 2\), xs\['b'\] \(4,\)",
        ),
        (
            {
                "xs": jnp.ones(3),
                "per_iteration": {"prng_key": jnp.zeros((2, 2), jnp.uint32)},
            },
            r"xs \(3,\), per_iteration\['prng_key'\] \(2, 2\)",
        ),
        ({"xs": jnp.ones(3), "length": 4}, r"xs \(3,\) and length=4"),
        ({"xs": None}, "no array leaf and `length` is None"),
        ({"xs": jnp.ones(())}, r"xs has shape \(\)"),
        ({"xs": None, "length": -1}, "non-negative int"),
        ({"xs": jnp.ones(3), "child_name_prefix": "Iter"}, "invalid child name 'Iter'"),
        ({"xs": jnp.ones(3), "child_name_prefix": "iter/x"}, "invalid child name"),
        ({"xs": jnp.ones(3), "per_iteration": {"is_training": True}}, "is_training"),
        ({"xs": jnp.ones(3), "remat_kwargs": {"prevent_cse": True}}, "prevent_cse"),
    ],
)
def test_scan_errors_before_tracing(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        scan_in_context(_never, context=Context.root(), carry=0, **kwargs)


def test_per_iteration_keys_must_be_a_batch_of_keys() -> None:
    for keys, given in (
        (jnp.zeros((3, 2), jnp.float32), r"dtype float32 and shape \(3, 2\)"),
        (jnp.zeros((3,), jnp.uint32), r"dtype uint32 and shape \(3,\)"),
        (jax.random.PRNGKey(0), r"dtype uint32 and shape \(2,\)"),
        (jax.random.key(0), r"shape \(\)"),
        ([1, 2, 3], "got list"),
    ):
        with pytest.raises(TypeError, match=r"one key per iteration.*" + given):
            scan_in_context(
                _never,
                context=Context.root(),
                carry=0,
                xs=None,
                length=3,
                per_iteration={"prng_key": keys},
            )

    def body(c: Any, x: Any, ctx: Context) -> tuple[Any, Any, Context]:
        return c, jax.random.key_data(ctx.prng_key), ctx

    # Typed keys per iteration give the same key data as the raw ones.
    raw = jax.random.split(jax.random.PRNGKey(5), 3)
    typed = jax.random.split(jax.random.key(5), 3)
    for keys in (raw, typed):
        _, ys, _ = scan_in_context(
            body,
            context=Context.root(),
            carry=0,
            xs=None,
            length=3,
            per_iteration={"prng_key": keys},
        )
        np.testing.assert_array_equal(ys, raw)


def test_remat_kwargs_not_mutated_and_read_only_mapping() -> None:
    remat = types.MappingProxyType({"policy": jax.checkpoint_policies.dots_saveable})
    h, ws = _args(3, width=4)
    carry, _, _ = _ours(1, remat_kwargs=remat)(h, ws, None)
    np.testing.assert_allclose(carry, _hand(1)(h, ws, None)[0], rtol=1e-6)
    assert dict(remat) == {"policy": jax.checkpoint_policies.dots_saveable}
    plain = {"prevent_cse": False}
    _ours(1, remat_kwargs=plain)(h, ws, None)
    assert plain == {"prevent_cse": False}


def test_body_must_return_context() -> None:
    bad_scan: Any = lambda c, x, ctx: (c, x)
    bad_vmap: Any = lambda x, ctx: x
    with pytest.raises(TypeError, match=r"\(carry, y, ctx\)"):
        scan_in_context(bad_scan, context=Context.root(), carry=0, xs=jnp.ones(2))
    with pytest.raises(TypeError, match=r"\(y, ctx\)"):
        vmap_in_context(bad_vmap, context=Context.root(), xs=jnp.ones(2))


def test_vmap_takes_numpy_integer_in_axes() -> None:
    import inspect

    def body(x: Any, ctx: Context) -> tuple[Any, Context]:
        return jnp.sum(jax.tree_util.tree_leaves(x)[0]), ctx

    xs = jnp.arange(6.0).reshape(2, 3)
    want = jnp.sum(xs, axis=0)  # mapped over axis 1
    # A NumPy integer at the top is outside the annotation (`int`): as called
    # without this suite's runtime type checks.
    unchecked = inspect.unwrap(vmap_in_context)
    cases: list[tuple[Callable[..., Any], Any, Any]] = [
        (unchecked, xs, np.int64(1)),
        (vmap_in_context, [xs], [np.int32(1)]),
        (vmap_in_context, {"a": xs}, {"a": np.int64(1)}),
    ]
    for run, arg, in_axes in cases:
        got, _ = run(body, context=Context.root(), xs=arg, in_axes=in_axes)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("xs", "in_axes", "match"),
    [
        (
            {"a": jnp.ones((2, 3)), "b": jnp.ones(3)},
            0,
            r"xs\['a'\] \(2, 3\) mapped over axis 0 \(size 2\), xs\['b'\] \(3,\) "
            r"mapped over axis 0 \(size 3\)",
        ),
        (
            [jnp.ones((3, 4)), jnp.ones((3, 4))],
            [0, 1],
            r"xs\[0\] \(3, 4\) mapped over axis 0 \(size 3\), xs\[1\] \(3, 4\) "
            r"mapped over axis 1 \(size 4\)",
        ),
        ({"a": jnp.ones(2)}, {"a": None}, "no leaf of `xs` is mapped"),
        ({"a": jnp.ones(2)}, {"a": 1}, "out of range"),
        ({"a": jnp.ones(2)}, {"b": 0}, "prefix"),
        ({"a": jnp.ones(2)}, 0, None),
    ],
)
def test_vmap_errors_before_tracing(xs: Any, in_axes: Any, match: str | None) -> None:
    if match is None:
        with pytest.raises(ValueError, match="invalid child name"):
            vmap_in_context(
                _never_vmap, context=Context.root(), xs=xs, child_name_prefix="2x"
            )
        return
    with pytest.raises(ValueError, match=match):
        vmap_in_context(_never_vmap, context=Context.root(), xs=xs, in_axes=in_axes)

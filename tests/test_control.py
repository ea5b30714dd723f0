"""cond/switch/while/fori_in_context, vmap axis names and merge_iterations."""

import pathlib
import re
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
    Context,
    HistogramSummary,
    ImageSummary,
    MaxSummary,
    MinSummary,
    OutputCollection,
    OutputConflictError,
    Summary,
    SummaryAccumulator,
    SumSummary,
    WeightedSummary,
    cond_in_context,
    fori_in_context,
    scan_in_context,
    switch_in_context,
    vmap_in_context,
    while_in_context,
)


# -- identities -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "summary",
    [
        WeightedSummary(jnp.array([1.0, -2.0]), jnp.array(3.0)),
        MinSummary(jnp.array([1.0, -2.0])),
        MaxSummary(jnp.array([1.0, -2.0])),
        SumSummary(jnp.array([1.0, -2.0])),
        MinSummary(jnp.array([3, -4], jnp.int32)),
        MaxSummary(jnp.array([3, -4], jnp.int8)),
        SumSummary(jnp.array(5, jnp.int32)),
        MinSummary(jnp.array([True, False])),
        MaxSummary(jnp.array([True, False])),
    ],
)
def test_identity_leaves_accumulation_unchanged(summary: Summary) -> None:
    ident = summary.identity()
    assert ident is not None
    assert type(ident) is type(summary)
    for a, b in zip(
        jax.tree_util.tree_leaves(ident),
        jax.tree_util.tree_leaves(summary),
        strict=True,
    ):
        assert a.shape == b.shape
        assert a.dtype == b.dtype
    for got in (ident.accumulate(summary), summary.accumulate(ident)):
        assert jax.tree_util.tree_all(
            jax.tree_util.tree_map(lambda a, b: bool(jnp.all(a == b)), got, summary)
        )


def test_identity_values() -> None:
    assert float(WeightedSummary(2.0, 1.0).identity().weight) == 0.0
    assert float(MinSummary(2.0).identity().value_) == np.inf
    assert float(MaxSummary(2.0).identity().value_) == -np.inf
    assert int(MinSummary(jnp.int32(2)).identity().value_) == 2**31 - 1
    assert int(MaxSummary(jnp.int32(2)).identity().value_) == -(2**31)
    assert float(SumSummary(2.0).identity().value_) == 0.0
    for media in (ImageSummary(jnp.zeros((1, 2, 2))), AudioSummary(jnp.zeros(4))):
        assert media.identity() is None
    hist = HistogramSummary(jnp.zeros(3), bins=2, range=(-1.0, 1.0))
    np.testing.assert_array_equal(hist.identity().counts, np.zeros(2))


# -- cond / switch against a Python reference ----------------------------------------

IDENTITY_VARIANTS = ("weighted", "min", "max", "sum", "weighted_vec", "sum_int")


def _value(variant: str, x: jax.Array, j: int) -> Summary:
    v = x * (j + 1.0) + 0.5
    if variant == "weighted":
        return WeightedSummary(jnp.mean(v), jnp.abs(x[0]) + 1.0)
    if variant == "weighted_vec":
        return WeightedSummary(v, jnp.float32(j + 1.0))
    if variant == "min":
        return MinSummary(v)
    if variant == "max":
        return MaxSummary(v)
    if variant == "sum":
        return SumSummary(jnp.sum(v))
    if variant == "sum_int":
        return SumSummary(jnp.int32(j + 1))
    raise AssertionError(variant)


def _branch(j: int, names: list[Any], variants: dict[str, str]) -> Any:
    def fn(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        for name in names:
            ctx = ctx.add_summary(name, _value(variants[name], x, j))
        if ctx.prng_key is not None:
            x = x + jax.random.uniform(ctx.prng_key, x.shape)
        return x * (j + 2.0), ctx

    return fn


@st.composite
def branch_specs(draw: st.DrawFn) -> tuple[dict[str, str], list[list[str]]]:
    pool = draw(st.lists(st.sampled_from(IDENTITY_VARIANTS), min_size=1, max_size=5))
    variants = {f"s{k}": v for k, v in enumerate(pool)}
    n = draw(st.integers(1, 4))
    contents = [
        sorted(draw(st.sets(st.sampled_from(sorted(variants))))) for _ in range(n)
    ]
    return variants, contents


def _reference(
    branches: list[Any], j: int, x: Any, context: Context, name: str, union: Any
) -> tuple[Any, dict[str, Any]]:
    """Run branch j in the child context; other names of the union: identities."""
    out, ctx = branches[j](x, context.child(name))
    flat = {f"{name}/{k}": v for k, v in ctx.collection.flatten("summaries").items()}
    for path, spec in union.items():
        if path not in flat:
            flat[path] = spec.identity()
    return out, flat


def _union_examples(branches: list[Any], x: Any, name: str) -> dict[str, Any]:
    union: dict[str, Any] = {}
    for fn in branches:
        _, ctx = fn(x, Context.root().child(name))
        for k, v in ctx.collection.flatten("summaries").items():
            union.setdefault(f"{name}/{k}", v)
    return union


@given(spec=branch_specs(), data=st.data())
def test_switch_matches_reference(spec: Any, data: st.DataObject) -> None:
    variants, contents = spec
    branches = [_branch(j, names, variants) for j, names in enumerate(contents)]
    index = data.draw(st.integers(-1, len(branches)), label="index")
    jit = data.draw(st.booleans(), label="jit")
    key = data.draw(st.sampled_from([None, 0]), label="key")
    use_cond = len(branches) == 2 and data.draw(st.booleans(), label="cond")
    context = Context.root(prng_key=None if key is None else jax.random.PRNGKey(key))
    x = jnp.array([0.5, -1.5])
    name = "cond" if use_cond else "switch"

    def run(i: Any, x: Any) -> Any:
        if use_cond:
            return cond_in_context(i != 0, branches[1], branches[0], x, context=context)
        return switch_in_context(i, branches, x, context=context)

    out, coll = (jax.jit(run) if jit else run)(jnp.int32(index), x)
    taken = min(max(index, 0), len(branches) - 1)
    if use_cond:
        taken = int(index != 0)
    union = _union_examples(branches, x, name)
    want_out, want = _reference(branches, taken, x, context, name, union)
    np.testing.assert_allclose(out, want_out, rtol=1e-6)
    assert_flat_close(coll.flatten("summaries"), want, "summaries")


@given(spec=branch_specs(), data=st.data())
def test_switch_under_vmap_selects_per_example(spec: Any, data: st.DataObject) -> None:
    variants, contents = spec
    branches = [_branch(j, names, variants) for j, names in enumerate(contents)]
    indices = data.draw(
        st.lists(st.integers(0, len(branches) - 1), min_size=1, max_size=4),
        label="indices",
    )
    context = Context.root()
    xs = jnp.stack([jnp.array([0.5, -1.5]) * (b + 1.0) for b in range(len(indices))])

    def run(i: Any, x: Any) -> Any:
        return switch_in_context(i, branches, x, context=context)

    outs, coll = jax.vmap(run)(jnp.array(indices, jnp.int32), xs)
    union = _union_examples(branches, xs[0], "switch")
    got = coll.flatten("summaries")
    for b, j in enumerate(indices):
        want_out, want = _reference(branches, j, xs[b], context, "switch", union)
        np.testing.assert_allclose(outs[b], want_out, rtol=1e-6)
        got_b = {k: jax.tree_util.tree_map(lambda a: a[b], v) for k, v in got.items()}  # noqa: B023
        assert_flat_close(got_b, want, f"example {b}")


@given(data=st.data())
def test_averaging_over_steps_ignores_untaken_branches(data: st.DataObject) -> None:
    preds = data.draw(st.lists(st.booleans(), min_size=1, max_size=6), label="preds")
    losses = np.linspace(0.5, 3.0, len(preds)).astype(np.float32)

    def taken(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return x, ctx.add_summary("loss", WeightedSummary(x, 2.0))

    def skipped(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return x, ctx

    step = jax.jit(
        lambda p, x: cond_in_context(p, taken, skipped, x, context=Context.root())[1]
    )
    acc = SummaryAccumulator()
    for p, loss in zip(preds, losses, strict=True):
        acc = acc.update(step(p, jnp.asarray(loss)))
    got = acc.flatten()["cond/loss"]
    chosen = [float(v) for p, v in zip(preds, losses, strict=True) if p]
    assert float(got.weight) == 2.0 * len(chosen)
    np.testing.assert_allclose(
        float(got.value()), np.mean(chosen) if chosen else 0.0, rtol=1e-6
    )


def test_branch_key_path_and_merge() -> None:
    key = jax.random.PRNGKey(3)
    context = Context.root(prng_key=key)

    paths: set[Any] = set()

    def f(x: jax.Array, ctx: Context) -> tuple[Any, Context]:
        paths.add(ctx.path)
        return ctx.prng_key, ctx.add_summary("x", SumSummary(x))

    got_key, coll = cond_in_context(True, f, f, 1.0, context=context)
    assert paths == {("root", "cond")}
    np.testing.assert_array_equal(got_key, context.child("cond").prng_key)
    ctx = context.merge(coll)
    assert ctx.collection.flatten("summaries")["cond/x"].value() == 1.0


def test_grad_through_taken_branch_equals_lax_cond() -> None:
    def t(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return jnp.sin(x) * 3.0, ctx.add_summary("a", WeightedSummary(x**2, 1.0))

    def f(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return x**3, ctx.add_summary("b", MaxSummary(x))

    def mine(x: jax.Array, p: jax.Array) -> jax.Array:
        out, _ = cond_in_context(p, t, f, x, context=Context.root())
        return out

    def ref(x: jax.Array, p: jax.Array) -> jax.Array:
        return jax.lax.cond(p, lambda v: jnp.sin(v) * 3.0, lambda v: v**3, x)

    for p in (True, False):
        pa = jnp.asarray(p)
        np.testing.assert_allclose(
            jax.grad(mine)(1.3, pa), jax.grad(ref)(1.3, pa), rtol=1e-6
        )
        np.testing.assert_allclose(
            jax.jit(jax.grad(mine))(1.3, pa), jax.grad(ref)(1.3, pa), rtol=1e-6
        )


def test_branch_that_scans_and_cond_inside_scan() -> None:
    def scans(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        def body(c: Any, v: Any, ctx: Context) -> tuple[Any, None, Context]:
            return c + v, None, ctx.add_summary("s", WeightedSummary(v, 1.0))

        c, _, coll = scan_in_context(body, context=ctx, carry=x, xs=jnp.arange(3.0))
        return c, ctx.merge(coll)

    def plain(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return x, ctx.add_summary("p", MinSummary(x))

    _, coll = cond_in_context(False, scans, plain, 1.0, context=Context.root())
    flat = coll.flatten("summaries")
    assert sorted(flat) == ["cond/iter0/s", "cond/iter1/s", "cond/iter2/s", "cond/p"]
    assert float(flat["cond/iter1/s"].weight) == 0.0
    _, coll = cond_in_context(True, scans, plain, 1.0, context=Context.root())
    flat = coll.flatten("summaries")
    assert float(flat["cond/iter2/s"].mean) == 2.0
    assert float(flat["cond/p"].value()) == np.inf

    # A branchy scan body (and a cond nested in a branch), merged and per-iteration.
    def inner(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        y, c = cond_in_context(x > 0, plain, scans, x, context=ctx, child_name="deep")
        return y, ctx.merge(c)

    def body(c: Any, x: Any, ctx: Context) -> tuple[Any, Any, Context]:
        y, coll = cond_in_context(x > 1.0, inner, plain, x, context=ctx)
        return c + y, y, ctx.merge(coll)

    xs = jnp.array([0.5, 2.0, 3.0])
    for merge in (False, True):
        _, ys, coll = jax.jit(
            lambda xs, merge=merge: scan_in_context(
                body, context=Context.root(), carry=0.0, xs=xs, merge_summaries=merge
            )
        )(xs)
        flat = coll.flatten("summaries")
        if merge:
            assert float(flat["iter/cond/p"].value()) == 0.5
            assert float(flat["iter/cond/deep/p"].value()) == 2.0
        else:
            assert float(flat["iter0/cond/deep/p"].value()) == np.inf
            assert float(flat["iter2/cond/deep/p"].value()) == 3.0
        np.testing.assert_allclose(ys, [0.5, 2.0, 3.0])


# -- errors ---------------------------------------------------------------------------


def _adds(**outputs: Any) -> Any:
    def fn(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        for name, (kind, value) in outputs.items():
            ctx = getattr(ctx, f"add_{kind}")(name, value)
        return x, ctx

    return fn


@pytest.mark.parametrize(
    ("one", "other", "match"),
    [
        (
            _adds(r=("summary", 1.0)),
            _adds(),
            r"a raw-array summary at 'root/model/cond/r' is added in true_fn but not "
            r"in false_fn",
        ),
        (
            _adds(i=("summary", ImageSummary(jnp.zeros((1, 2, 2))))),
            _adds(),
            r"an ImageSummary \(a kind without an identity\) at 'root/model/cond/i'",
        ),
        (
            _adds(m=("module_output", 1.0)),
            _adds(),
            r"module output at 'root/model/cond/m'",
        ),
        (
            _adds(u=("state_update", 1.0)),
            _adds(),
            r"state update at 'root/model/cond/u'",
        ),
        (
            _adds(s=("summary", SumSummary(1.0))),
            _adds(s=("summary", MinSummary(1.0))),
            r"the summary at 'root/model/cond/s' differs between branches",
        ),
        (
            _adds(s=("summary", SumSummary(jnp.zeros(2)))),
            _adds(s=("summary", SumSummary(jnp.zeros(3)))),
            r"'root/model/cond/s' differs.*false_fn: SumSummary\(float32\[3\]\); "
            r"true_fn",
        ),
        (
            _adds(s=("summary", SumSummary(jnp.zeros(2)))),
            _adds(s=("summary", SumSummary(jnp.zeros(2, jnp.int32)))),
            r"'root/model/cond/s' differs.*int32",
        ),
    ],
    ids=["raw", "media", "module_output", "state_update", "kind", "shape", "dtype"],
)
def test_cond_errors_name_path_and_branches(one: Any, other: Any, match: str) -> None:
    # The message names the full context path of the entry, not the path below the
    # construct (a model has many conds).
    def model(x: Any, ctx: Context) -> tuple[Any, Context]:
        y, coll = cond_in_context(True, one, other, x, context=ctx)
        return y, ctx.merge(coll)

    with pytest.raises(ValueError, match=match):
        Context.root().call("model", model, 1.0)


def test_branch_error_lists_every_kind_with_an_identity() -> None:
    with pytest.raises(ValueError, match="can be missing from a branch") as info:
        cond_in_context(
            True, _adds(r=("summary", 1.0)), _adds(), 1.0, context=Context.root()
        )
    listed = re.search(r"has an identity \(([^)]*)\)", str(info.value))
    assert listed is not None
    # Every kind of eqxctx with an identity, HistogramSummary and MomentsSummary too.
    want = [
        "HistogramSummary",
        "MaxSummary",
        "MinSummary",
        "MomentsSummary",
        "SumSummary",
        "WeightedSummary",
    ]
    assert listed.group(1).split(", ")[: len(want)] == want


def test_two_branch_collections_conflict_suggests_child_name() -> None:
    ctx = Context.root()
    _, coll = cond_in_context(
        True,
        lambda c: (0, c.add_summary("n", SumSummary(1))),
        lambda c: (0, c),
        context=ctx,
    )
    ctx = ctx.merge(coll)
    with pytest.raises(
        OutputConflictError,
        match=r"child 'cond'.*from `cond_in_context`.*pass another `child_name=`",
    ):
        ctx.merge(coll)


def test_switch_errors() -> None:
    with pytest.raises(
        ValueError,
        match=r"'root/switch/r' is added in branches\[0\] but not in branches\[1\]",
    ):
        switch_in_context(
            0, [_adds(r=("summary", 1.0)), _adds()], 1.0, context=Context.root()
        )
    with pytest.raises(ValueError, match="must not be empty"):
        switch_in_context(0, [], 1.0, context=Context.root())
    with pytest.raises(ValueError, match="child_name"):
        switch_in_context(0, [_adds()], 1.0, context=Context.root(), child_name="X")


def test_branches_with_other_output_types_are_named_in_jaxs_error() -> None:
    def as_int(x: Any, ctx: Context) -> tuple[Any, Context]:
        return (x, x.astype(jnp.int32)), ctx

    def as_float(x: Any, ctx: Context) -> tuple[Any, Context]:
        return (x, x), ctx

    with pytest.raises(TypeError, match="equal output types") as info:
        cond_in_context(
            jnp.array(True), as_int, as_float, jnp.ones(3), context=Context.root()
        )
    note = info.value.__notes__[-1]
    assert note.startswith("`cond_in_context` at 'root/cond': false_fn (")
    assert "as_float) returns ('float32[3]', 'float32[3]')" in note
    assert "as_int) returns ('float32[3]', 'int32[3]')." in note
    with pytest.raises(TypeError) as info:
        switch_in_context(
            1, [as_float, as_int], jnp.ones(3), context=Context.root(), child_name="s"
        )
    assert "at 'root/s': branches[0] (" in info.value.__notes__[-1]
    # JAX's own rules still decide: a weak-typed Python float matches float32.
    out, _ = cond_in_context(
        True,
        lambda x, ctx: (1.0, ctx),
        lambda x, ctx: (x, ctx),
        jnp.float32(2.0),
        context=Context.root(),
    )
    assert float(out) == 1.0


def test_branch_must_return_its_context() -> None:
    with pytest.raises(TypeError, match=r"true_fn must return"):
        cond_in_context(True, lambda x, ctx: x, _adds(), 1.0, context=Context.root())
    with pytest.raises(
        ValueError, match=r"true_fn returned the context at 'other'.*'root/cond'"
    ):
        cond_in_context(
            True,
            lambda x, ctx: (x, Context.root(name="other")),
            _adds(),
            1.0,
            context=Context.root(),
        )


def _draw(x: Any, ctx: Context) -> tuple[Any, Context]:
    return x + jax.random.uniform(ctx.prng_key), ctx


def test_drawing_from_a_missing_key_names_the_branch_or_loop_context() -> None:
    # Issue 35 item 10: JAX's "unexpected PRNG key type <class 'NoneType'>" named
    # neither the context nor the fix.
    root = Context.root()
    x = jnp.float32(1.0)
    calls = {
        "`cond_in_context`: true_fn: the context at 'root/cond'": lambda: (
            cond_in_context(True, _draw, lambda v, c: (v, c), x, context=root)
        ),
        "`switch_in_context`: branches[0]: the context at 'root/pick'": lambda: (
            switch_in_context(0, [_draw], x, context=root, child_name="pick")
        ),
        "`while_in_context`: body_fn: the context at 'root/while'": lambda: (
            while_in_context(lambda v: v < 3, _draw, x, context=root)
        ),
        "`fori_in_context`: body_fn: the context at 'root/iter'": lambda: jax.jit(
            lambda n: fori_in_context(
                0, n, lambda i, v, c: _draw(v, c), x, context=root
            )
        )(3),
    }
    for where, call in calls.items():
        with pytest.raises(TypeError, match="unexpected PRNG key type") as info:
            call()
        notes = [n for n in info.value.__notes__ if "PRNG key" in n]
        assert len(notes) == 1, info.value.__notes__
        assert notes[0].startswith(where), notes[0]
        assert "prng_key=jax.random.key(0)" in notes[0]


# -- while / fori ---------------------------------------------------------------------


def _while_body(x: Any, ctx: Context) -> tuple[Any, Context]:
    v, n = x
    ctx = ctx.add_summary("w", WeightedSummary(v, 1.0 + v))
    ctx = ctx.add_summary("lo", MinSummary(v)).add_summary("hi", MaxSummary(v))
    ctx = ctx.add_summary("n", SumSummary(jnp.int32(1))).add_summary("raw", v * 2.0)
    r = jnp.zeros(()) if ctx.prng_key is None else jax.random.uniform(ctx.prng_key)
    return (v * 1.5 + r * 0.0 + 0.25, n + 1), ctx.add_summary("r", SumSummary(r))


@given(start=st.floats(0.1, 20.0), limit=st.floats(0.0, 30.0), jit=st.booleans())
def test_while_matches_python_loop(start: float, limit: float, jit: bool) -> None:
    key = jax.random.PRNGKey(7)
    context = Context.root(prng_key=key)
    init = (jnp.float32(start), jnp.int32(0))

    def run(init: Any) -> Any:
        return while_in_context(
            lambda x: x[0] < limit, _while_body, init, context=context
        )

    (v, n), coll = (jax.jit(run) if jit else run)(init)
    # Reference: a Python loop, each iteration in its own child context.
    child_key = context.child("while").prng_key
    x, acc, i = init, None, 0
    while bool(x[0] < limit):  # in float32, as the loop compares
        ctx = context.child("while", prng_key=jax.random.fold_in(child_key, i))
        x, ctx = _while_body(x, ctx)
        s = dict(ctx.collection.flatten("summaries"))
        acc = s if acc is None else {k: _acc(acc[k], s[k]) for k in s}
        i += 1
    assert int(n) == i
    np.testing.assert_allclose(v, x[0], rtol=1e-6)
    got = {
        k.removeprefix("while/"): val for k, val in coll.flatten("summaries").items()
    }
    if acc is None:  # zero iterations: identities (0 for raw arrays)
        assert float(got["w"].weight) == 0.0
        assert float(got["lo"].value()) == np.inf
        assert float(got["hi"].value()) == -np.inf
        assert int(got["n"].value()) == 0
        assert float(got["raw"]) == 0.0
    else:
        assert_flat_close(got, acc, "while")


def _acc(a: Any, b: Any) -> Any:
    return a.accumulate(b) if isinstance(a, Summary) else a + b


def test_while_body_module_outputs_raise() -> None:
    with pytest.raises(ValueError, match=r"adds the module output 'root/while/h'"):
        while_in_context(
            lambda x: x < 3,
            lambda x, ctx: (x + 1, ctx.add_module_output("h", x)),
            0,
            context=Context.root(),
        )
    with pytest.raises(ValueError, match=r"adds the state update 'root/loop/s'"):
        while_in_context(
            lambda x: x < 3,
            lambda x, ctx: (x + 1, ctx.add_state_update("s", x)),
            0,
            context=Context.root(),
            child_name="loop",
        )
    with pytest.raises(TypeError, match="body_fn must return"):
        while_in_context(
            lambda x: x < 3,
            lambda x, ctx: x,  # pyright: ignore[reportArgumentType]
            0,
            context=Context.root(),
        )


def _layer(x: Any, ctx: Context) -> tuple[Any, Context]:
    """A normal layer: a module output, a state update and two summaries."""
    h = jnp.tanh(x) + 0.5
    ctx = ctx.add_module_output("h", h).add_state_update("count", jnp.int32(1))
    ctx = ctx.add_summary("mean", WeightedSummary(h, 1.0))
    return h, ctx.add_summary("steps", SumSummary(jnp.int32(1)))


@pytest.mark.parametrize("jit", [False, True])
def test_while_drop_output_keeps_a_layers_summaries(jit: bool) -> None:
    # Issue 35 item 16: a body adding a module output or a state update was refused
    # with no way to drop them but pruning by hand.
    dropped: list[str] = []

    def drop(path: str) -> bool:
        dropped.append(path)
        return path.startswith(("module_outputs", "state_updates"))

    def run(x: Any) -> Any:
        return while_in_context(
            lambda v: v < 1.0, _layer, x, context=Context.root(), drop_output=drop
        )

    x, coll = (jax.jit(run) if jit else run)(jnp.float32(-1.0))
    # Reference: a Python loop.
    v, hs = np.float32(-1.0), []
    while v < 1.0:
        v = np.float32(np.tanh(v) + 0.5)
        hs.append(v)
    np.testing.assert_allclose(x, v, rtol=1e-6)
    flat = coll.flatten("summaries")
    assert sorted(flat) == ["while/mean", "while/steps"]
    assert int(flat["while/steps"].value()) == len(hs) == 4
    np.testing.assert_allclose(flat["while/mean"].value(), np.mean(hs), rtol=1e-6)
    assert coll.flatten("module_outputs") == coll.flatten("state_updates") == {}
    assert "module_outputs/h" in dropped
    assert "state_updates/count" in dropped
    # Summaries may be dropped too.
    _, coll = while_in_context(
        lambda v: v < 1.0,
        _layer,
        jnp.float32(-1.0),
        context=Context.root(),
        drop_output=lambda p: p == "summaries/mean" or not p.startswith("summaries"),
    )
    assert list(coll.flatten("summaries")) == ["while/steps"]
    # Without it, the error says how to drop them.
    with pytest.raises(ValueError, match=r"'root/while/count'.*drop_output="):
        while_in_context(lambda v: v < 1.0, _layer, 0.0, context=Context.root())


def _jax_raises(fn: Any, *args: Any) -> bool:
    try:
        fn(*args)
    except TypeError:
        return True
    return False


@pytest.mark.parametrize("jit", [False, True])
def test_while_carry_must_keep_its_type(jit: bool) -> None:
    """The body returns the carry's structure, shapes, dtypes (`jax.lax.while_loop`)."""

    def run(init: Any, body: Any) -> Any:
        def loop(init: Any) -> Any:
            return while_in_context(
                lambda v: jnp.all(jax.tree_util.tree_leaves(v)[0] > 1),
                lambda v, ctx: (body(v), ctx),
                init,
                context=Context.root().call("model", lambda c: (None, c))[1],
            )

        return (jax.jit(loop) if jit else loop)(init)

    cases = [
        # (initial carry, body, message)
        (
            jnp.int32(40),
            # float32 from an int32 carry: no silent truncation
            lambda x: x.astype(jnp.float32) * 0.75,
            r"`while_in_context` at 'root/while': `init_val` went in as int32\[\] but "
            r"body_fn returned float32\[\] for it.*astype",
        ),
        (
            (jnp.int32(3), jnp.zeros(2)),
            lambda v: (v[0] - 1, v[1].astype(jnp.int32)),
            r"`init_val\[1\]` went in as float32\[2\] but body_fn returned int32\[2\]",
        ),
        (
            {"n": jnp.int32(3), "h": jnp.zeros(2)},
            lambda v: {"n": v["n"] - 1, "h": jnp.zeros(3)},
            r"`init_val\['h'\]` went in as float32\[2\] but body_fn returned "
            r"float32\[3\]",
        ),
        (
            (3, jnp.ones(2)),
            lambda v: [v[0] - 1, v[1]],  # a list from a tuple
            r"body_fn returned a carry with structure PyTreeDef\(\[\*, \*\]\), but "
            r"`init_val` has structure PyTreeDef\(\(\*, \*\)\)",
        ),
    ]
    for init, body, match in cases:
        # The reference raises too.
        assert _jax_raises(
            jax.lax.while_loop,
            lambda v: jnp.all(jax.tree_util.tree_leaves(v)[0] > 1),
            body,
            init,
        )
        with pytest.raises(TypeError, match=match):
            run(init, body)


@pytest.mark.parametrize("jit", [False, True])
def test_while_python_scalar_carry_takes_the_body_dtype(jit: bool) -> None:
    """A weakly typed initial carry is promoted as `jax.lax.while_loop` promotes it."""
    cases = [
        (3, lambda x: x * 1.5),  # int -> float32
        (1.0, lambda x: x * jnp.bfloat16(2.5) + 1),  # float -> bfloat16
        (1, lambda x: x * jnp.int8(2)),  # int -> int8
        (jnp.asarray(1), lambda x: x + jnp.int16(3)),  # a weak array -> int16
    ]
    for init, body in cases:
        want, want_n = jax.lax.while_loop(
            lambda s: s[0] < 10,
            lambda s: (body(s[0]), s[1] + 1),  # noqa: B023
            (init, jnp.int32(0)),
        )

        def loop(init: Any) -> Any:
            return while_in_context(
                lambda x: x < 10,
                lambda x, ctx: (body(x), ctx.add_summary("n", SumSummary(1))),  # noqa: B023
                init,
                context=Context.root(),
            )

        got, coll = (jax.jit(loop) if jit else loop)(init)
        assert jnp.result_type(got) == jnp.result_type(want), (init, got, want)
        np.testing.assert_array_equal(got, want)
        assert int(coll.flatten("summaries")["while/n"].value()) == int(want_n) > 0


def test_while_carry_checked_inside_an_outer_scan() -> None:
    """The carry rule holds in a shape-only pass (a while in a scan body) too."""

    def scan_body(c: Any, x: Any, ctx: Context) -> tuple[Any, None, Context]:
        v, coll = while_in_context(
            lambda v: v > 1,
            lambda v, c: (v.astype(jnp.float32) * 0.75, c),
            c,
            context=ctx,
        )
        return v, None, ctx.merge(coll)

    with pytest.raises(
        TypeError, match=r"'root/iter/while': `init_val` went in as int32"
    ):
        scan_in_context(
            scan_body, context=Context.root(), carry=jnp.int32(40), xs=jnp.arange(2)
        )
    want = jax.lax.scan(
        lambda c, x: (
            jax.lax.while_loop(
                lambda v: v > 1, lambda v: v.astype(jnp.float32) * 0.75, c
            ),
            None,
        ),
        jnp.float32(40),
        jnp.arange(2),
    )[0]
    got = scan_in_context(
        scan_body, context=Context.root(), carry=jnp.float32(40), xs=jnp.arange(2)
    )[0]
    np.testing.assert_array_equal(got, want)


def test_fori_traced_bounds_carry_must_keep_its_type() -> None:
    def body(i: Any, x: Any, ctx: Context) -> tuple[Any, Context]:
        return x.astype(jnp.float32) * 0.75, ctx

    run = jax.jit(
        lambda n, init: fori_in_context(0, n, body, init, context=Context.root())[0]
    )
    assert _jax_raises(
        lambda: jax.jit(
            lambda n: jax.lax.fori_loop(
                0, n, lambda i, x: x.astype(jnp.float32) * 0.75, jnp.int32(40)
            )
        )(3)
    )
    with pytest.raises(
        TypeError,
        match=r"`fori_in_context` at 'root/iter': `init_val` went in as int32\[\] but "
        r"body_fn returned float32\[\]",
    ):
        run(3, jnp.int32(40))
    # A Python scalar takes the body's dtype, as in `jax.lax.fori_loop`.
    got = jax.jit(lambda n: fori_in_context(0, n, body, 40, context=Context.root())[0])(
        3
    )
    want = jax.jit(
        lambda n: jax.lax.fori_loop(0, n, lambda i, x: x.astype(jnp.float32) * 0.75, 40)
    )(3)
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_array_equal(got, want)


def test_fori_bounds_must_be_integers() -> None:
    def body(i: Any, v: Any, ctx: Context) -> tuple[Any, Context]:
        return v + 1.0, ctx

    for lower, upper, shown in (
        (0, 2.5, "float 2.5"),
        (0.0, 3, "float 0.0"),
        (0, jnp.float32(3.0), "dtype float32"),
        (True, 3, "bool True"),
    ):
        assert _jax_raises(
            lambda lower=lower, upper=upper: jax.lax.fori_loop(
                lower, upper, lambda i, v: v + 1.0, 0.0
            )
        ) or isinstance(lower, bool)
        with pytest.raises(TypeError, match=r"must be an integer .*got " + shown):
            fori_in_context(lower, upper, body, 0.0, context=Context.root())
    # NumPy and JAX integers, static or traced, are integers.
    for upper in (np.int64(3), jnp.int32(3)):
        got, _ = fori_in_context(0, upper, body, 0.0, context=Context.root())
        assert float(got) == 3.0
    got = jax.jit(
        lambda n: fori_in_context(0, n, body, 0.0, context=Context.root())[0]
    )(jnp.int32(3))
    assert float(got) == 3.0


def _fori_body(i: Any, v: Any, ctx: Context) -> tuple[Any, Context]:
    ctx = ctx.add_summary("w", WeightedSummary(v, 1.0)).add_summary("i", i)
    return v * 0.5 + i.astype(jnp.float32), ctx.add_module_output("v", v)


@pytest.mark.parametrize("merge", [False, True])
def test_fori_static_bounds_is_a_scan(merge: bool) -> None:
    context = Context.root(prng_key=jax.random.PRNGKey(0))
    v, coll = fori_in_context(
        2, 6, _fori_body, jnp.float32(1.0), context=context, merge_summaries=merge
    )

    def body(c: Any, i: Any, ctx: Context) -> tuple[Any, None, Context]:
        c, ctx = _fori_body(i, c, ctx)
        return c, None, ctx

    want_v, _, want = scan_in_context(
        body,
        context=context,
        carry=jnp.float32(1.0),
        xs=jnp.arange(2, 6),
        merge_summaries=merge,
    )
    np.testing.assert_allclose(v, want_v)
    for kind in ("summaries", "module_outputs"):
        assert_flat_close(coll.flatten(kind), want.flatten(kind), kind)
    # The same program as the scan.
    hlo = (
        jax.jit(lambda v: fori_in_context(2, 6, _fori_body, v, context=context))
        .lower(jnp.float32(1.0))
        .as_text()
    )
    hlo_scan = (
        jax.jit(
            lambda v: scan_in_context(
                body, context=context, carry=v, xs=jnp.arange(2, 6)
            )[::2]
        )
        .lower(jnp.float32(1.0))
        .as_text()
    )
    assert len(hlo.splitlines()) == len(hlo_scan.splitlines())


@pytest.mark.parametrize(("lo", "hi"), [(0, 5), (3, 3), (4, 1)])
def test_fori_traced_bounds_is_a_while(lo: int, hi: int) -> None:
    def body(i: Any, v: Any, ctx: Context) -> tuple[Any, Context]:
        return v + i, ctx.add_summary("i", SumSummary(i)).add_summary("n", i * 0 + 1)

    run = jax.jit(
        lambda lo, hi: fori_in_context(
            lo, hi, body, jnp.int32(0), context=Context.root()
        )
    )
    v, coll = run(jnp.int32(lo), jnp.int32(hi))
    flat = coll.flatten("summaries")
    total = sum(range(lo, hi))
    assert int(v) == total
    assert int(flat["iter/i"].value()) == total
    assert int(flat["iter/n"]) == max(hi - lo, 0)
    dropped = jax.jit(
        lambda hi: fori_in_context(
            0,
            hi,
            body,
            jnp.int32(0),
            context=Context.root(),
            drop_output=lambda p: p == "summaries/n",
        )
    )(jnp.int32(hi))[1]
    assert sorted(dropped.flatten("summaries")) == ["iter/i"]
    with pytest.raises(ValueError, match="unroll"):
        jax.jit(
            lambda hi: fori_in_context(0, hi, body, 0, context=Context.root(), unroll=2)
        )(2)


def test_fori_static_bounds_with_while_inside() -> None:
    def body(i: Any, v: Any, ctx: Context) -> tuple[Any, Context]:
        def inner(x: Any, c: Context) -> tuple[Any, Context]:
            return x * 2.0, c.add_summary("x", WeightedSummary(x, 1.0))

        (w, _), coll = while_in_context(
            lambda s: s[1] < 2,
            lambda s, c: (lambda r: ((r[0], s[1] + 1), r[1]))(inner(s[0], c)),
            (v, jnp.int32(0)),
            context=ctx,
        )
        return w, ctx.merge(coll)

    def loss(v: Any) -> Any:
        out, coll = fori_in_context(0, 3, body, v, context=Context.root())
        return out + coll.flatten("summaries")["iter0/while/x"].value()

    # Each fori iteration doubles twice; iteration 0's while saw 1 and 2.
    np.testing.assert_allclose(jax.jit(loss)(1.0), 64.0 + 1.5)
    # Forward-mode derivatives pass through the while loop (reverse mode does not,
    # as for `jax.lax.while_loop`).
    np.testing.assert_allclose(jax.jvp(loss, (1.0,), (1.0,))[1], 64.0 + 1.5)


# -- vmap axis_name, merge_iterations --------------------------------------------------


def test_vmap_axis_name_collectives() -> None:
    def f(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        m = jax.lax.pmean(x, "b")
        return x - m, ctx.add_summary("mean", m)

    xs = jnp.array([1.0, 2.0, 6.0])
    ys, coll = vmap_in_context(f, context=Context.root(), xs=xs, axis_name="b")
    np.testing.assert_allclose(ys, xs - 3.0)
    assert all(float(v) == 3.0 for v in coll.flatten("summaries").values())


SCAN_VARIANTS = ("raw", "weighted", "min", "max", "sum", "image", "hist", "int")


def _scan_value(variant: str, x: jax.Array) -> Any:
    if variant == "raw":
        return x * 2.0
    if variant == "weighted":
        return WeightedSummary(x, jnp.abs(x) + 0.5)
    if variant == "min":
        return MinSummary(x)
    if variant == "max":
        return MaxSummary(x)
    if variant == "sum":
        return SumSummary(x)
    if variant == "image":
        return ImageSummary(jnp.broadcast_to(jnp.tanh(x), (1, 2, 2)))
    if variant == "hist":
        return HistogramSummary(jnp.stack([x, -x]))
    if variant == "int":
        return jnp.asarray(jnp.round(x * 10.0), jnp.int32)
    raise AssertionError(variant)


@given(
    variants=st.lists(st.sampled_from(SCAN_VARIANTS), min_size=1, max_size=4),
    n=st.integers(0, 5),
    nested=st.booleans(),
    jit=st.booleans(),
)
def test_merge_iterations_equals_merged_scan(
    variants: list[Any], n: int, nested: bool, jit: bool
) -> None:
    def leaf_body(c: Any, x: Any, ctx: Context) -> tuple[Any, None, Context]:
        for k, v in enumerate(variants):
            ctx = ctx.add_summary(f"s{k}", _scan_value(v, x))
        return c, None, ctx

    def run(merge: bool) -> OutputCollection:
        def body(c: Any, x: Any, ctx: Context) -> tuple[Any, None, Context]:
            if not nested:
                return leaf_body(c, x, ctx)
            _, _, inner = scan_in_context(
                leaf_body,
                context=ctx,
                carry=0.0,
                xs=x + jnp.arange(2.0),
                merge_summaries=merge,
                child_name_prefix="layer",
            )
            return c, None, ctx.merge(inner).add_summary("o", SumSummary(x))

        xs = jnp.linspace(-1.0, 2.0, n)
        return scan_in_context(
            body, context=Context.root(), carry=0.0, xs=xs, merge_summaries=merge
        )[2]

    per_iteration = jax.jit(lambda: run(False))() if jit else run(False)
    got = per_iteration.merge_iterations()
    want = run(True)
    assert_flat_close(got.flatten("summaries"), want.flatten("summaries"), "merged")
    # `self` is unchanged: it still holds the per-iteration view.
    assert sorted(per_iteration.flatten("summaries")) == sorted(
        run(False).flatten("summaries")
    )


def test_merge_iterations_of_vmapped_scan_keeps_outer_axis() -> None:
    def body(c: Any, x: Any, ctx: Context) -> tuple[Any, None, Context]:
        return c, None, ctx.add_summary("w", WeightedSummary(x, 1.0))

    def f(x: Any) -> OutputCollection:
        return scan_in_context(body, context=Context.root(), carry=0.0, xs=x)[2]

    coll = jax.vmap(f)(jnp.arange(6.0).reshape(2, 3))
    merged = coll.merge_iterations().flatten("summaries")["iter/w"]
    np.testing.assert_allclose(merged.value(), [1.0, 4.0])
    assert OutputCollection.empty().merge_iterations().is_empty()


# -- the docs page ---------------------------------------------------------------


def test_branches_and_loops_page_runs() -> None:
    page = pathlib.Path(__file__).parent.parent / "docs" / "branches_and_loops.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)
    assert len(blocks) >= 6
    namespace: dict[str, Any] = {"__name__": "branches_and_loops"}
    exec(compile("\n".join(blocks), str(page), "exec"), namespace)  # its asserts
    np.testing.assert_allclose(namespace["y"], [0.3, 0.4])


def test_while_under_vmap_equals_per_example() -> None:
    def run(start: Any) -> Any:
        return while_in_context(
            lambda x: x[0] < 10.0,
            _while_body,
            (start, jnp.int32(0)),
            context=Context.root(),
        )

    starts = jnp.array([0.5, 4.0, 12.0])
    (vs, ns), coll = jax.vmap(run)(starts)
    flat = coll.flatten("summaries")
    for b, start in enumerate(starts):
        (v, n), one = run(start)
        assert int(ns[b]) == int(n)
        np.testing.assert_allclose(vs[b], v, rtol=1e-6)
        got = {k: jax.tree_util.tree_map(lambda a: a[b], s) for k, s in flat.items()}  # noqa: B023
        assert_flat_close(got, one.flatten("summaries"), f"example {b}")

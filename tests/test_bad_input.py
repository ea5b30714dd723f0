"""Every bad input of issue 10 gets a clear error; the silent cases compute correctly.

Each case raises the documented exception with a message naming the eqxctx argument
(and the path where there is one). Where the suite's runtime type checks (jaxtyping +
beartype) would refuse an argument before eqxctx sees it, the call runs inside
`unchecked()`, so that eqxctx's own message is what is tested (users without the
import hook get it).
"""

import os
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
    MethodRunner,
    MinSummary,
    MomentsSummary,
    OutputCollection,
    OutputConflictError,
    SummaryAccumulator,
    SumSummary,
    WeightedSummary,
    cond_in_context,
    fori_in_context,
    functional,
    run_batches,
    scan_in_context,
    switch_in_context,
    vmap_in_context,
    while_in_context,
)
from eqxctx._errors import PREFIX_HINT
from eqxctx.writers import JsonlWriter
from helpers import unchecked


KEY = jax.random.PRNGKey(0)


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])


def _identity_method(model: Any, batch: Any, ctx: Context) -> tuple[Any, Context]:
    del model
    return batch, ctx


# -- silent wrong results ------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((1.0, np.nan), (2.0, 1.0)),  # a NaN weight
        ((np.nan, 1.0), (2.0, 1.0)),  # a NaN mean
        ((np.nan, 0.0), (2.0, 1.0)),  # a NaN mean with zero weight
        ((1.0, 1.0), (np.nan, 0.0)),
        ((np.nan, 0.0), (np.nan, 0.0)),
    ],
)
def test_weighted_summary_nan_anywhere_gives_nan(
    a: tuple[float, float], b: tuple[float, float]
) -> None:
    s = WeightedSummary(*a) + WeightedSummary(*b)
    assert np.isnan(s.value())
    assert np.isnan(s.accumulate(WeightedSummary(3.0, 1.0)).value())


def test_weighted_summary_zero_and_large_weights() -> None:
    zero = WeightedSummary(jnp.float32(5), jnp.float32(0))
    np.testing.assert_allclose((zero + zero).value(), 0.0)
    np.testing.assert_allclose((zero + WeightedSummary(2.0, 3.0)).value(), 2.0)
    # Weights near float32's maximum: their sum overflows, the mean does not.
    big = np.float32(3e38)
    s = WeightedSummary(1.0, big) + WeightedSummary(3.0, big)
    np.testing.assert_allclose(s.value(), 2.0, rtol=1e-6)
    s = WeightedSummary(1.0, big) + WeightedSummary(3.0, np.float32(1.0))
    np.testing.assert_allclose(s.value(), 1.0, rtol=1e-6)
    # Integer weights, the example of the issue with a valid weight.
    s = WeightedSummary(1.0, 1) + WeightedSummary(2.0, 3)
    np.testing.assert_allclose(s.value(), 1.75)
    # The gradient at zero total weight is finite (0), not NaN.
    g = jax.grad(lambda m: (WeightedSummary(m, 0.0) + WeightedSummary(m, 0.0)).value())(
        jnp.float32(1.0)
    )
    np.testing.assert_allclose(g, 0.0)


def test_negative_weights_are_refused_naming_the_path() -> None:
    bad = WeightedSummary(1.0, -1.0)
    with pytest.raises(ValueError, match=r"summaries/loss.*must not be negative"):
        Context.root().add_summary("loss", bad)
    with pytest.raises(ValueError, match="must not be negative"):
        bad.validate()
    with (
        JsonlWriter(os.devnull) as writer,
        pytest.raises(ValueError, match=r"'eval/loss'.*must not be negative"),
    ):
        writer.write(0, {"eval": {"loss": bad}})
    # Traced weights are not checked (their values are unknown at trace time).
    jax.jit(lambda w: WeightedSummary(1.0, w).validate())(jnp.float32(-1))


_SAME_KIND: list[tuple[Any, Any]] = [
    (WeightedSummary(1.0, 1.0), WeightedSummary(jnp.ones(3), 1.0)),
    (WeightedSummary(jnp.ones(2), 1.0), WeightedSummary(jnp.ones(3), 1.0)),
    (WeightedSummary(jnp.ones(3), 1.0), WeightedSummary(jnp.ones(3), jnp.ones(3))),
    (MinSummary(1.0), MinSummary(jnp.ones(3))),
    (MaxSummary(jnp.ones(2)), MaxSummary(jnp.ones((2, 1)))),
    (SumSummary(1.0), SumSummary(jnp.ones(3))),
    (ImageSummary(jnp.zeros((1, 2, 2))), ImageSummary(jnp.zeros((2, 2, 2)))),
    (AudioSummary(jnp.zeros(3)), AudioSummary(jnp.zeros(4))),
    (MomentsSummary(1.0), jax.vmap(MomentsSummary)(jnp.ones(2))),
]


@pytest.mark.parametrize(("a", "b"), _SAME_KIND)
def test_accumulate_requires_the_same_shape(a: Any, b: Any) -> None:
    with pytest.raises(ValueError, match=r"shapes .*\(.*\).* with one of shapes"):
        a.accumulate(b)
    with pytest.raises(ValueError, match="shapes"):
        b.accumulate(a)


_KINDS: list[Any] = [
    WeightedSummary(1.0, 1.0),
    MinSummary(1.0),
    MaxSummary(1.0),
    SumSummary(1.0),
    ImageSummary(jnp.zeros((1, 2, 2))),
    AudioSummary(jnp.zeros(3)),
    CallbackSummary(lambda: 1.0),
    HistogramSummary(1.0, bins=2, range=(0, 2)),
    MomentsSummary(1.0),
]


@pytest.mark.parametrize("i", range(len(_KINDS)))
def test_accumulate_requires_the_same_kind(i: int) -> None:
    a = _KINDS[i]
    for j, b in enumerate(_KINDS):
        if i != j:
            with pytest.raises(ValueError, match=type(b).__name__):
                a.accumulate(b)
    for other in (2.0, jnp.ones(()), None):
        with pytest.raises(ValueError, match=type(a).__name__):
            a.accumulate(other)


def test_weighted_summary_plus_a_number() -> None:
    with pytest.raises(ValueError, match=r"WeightedSummary with float 2\.0"):
        WeightedSummary(1.0, 1.0) + 2.0  # pyright: ignore[reportUnusedExpression]


def test_summary_accumulator_applies_one_shape_rule() -> None:
    acc = SummaryAccumulator().update({"w": WeightedSummary(1.0, 1.0)})
    with pytest.raises(ValueError, match=r"'w'.*mean \(\) .*mean \(3,\)"):
        acc.update({"w": WeightedSummary(jnp.ones(3), 1.0)})
    acc = SummaryAccumulator().update({"x": jnp.ones(())})
    with pytest.raises(ValueError, match=r"'x' had shape \(\) and now has shape"):
        acc.update({"x": jnp.ones(3)})
    acc = SummaryAccumulator().update({"m": MinSummary(1.0)})
    with pytest.raises(TypeError, match="'m' was MinSummary and is now MaxSummary"):
        acc.update({"m": MaxSummary(1.0)})


def test_child_does_not_reserve_but_call_add_child_and_merge_do() -> None:
    ctx = Context.root(prng_key=KEY)
    # `child` is the low-level step: it records nothing.
    first = ctx.child("layer")
    assert ctx.collection.child_names() == set()
    # Its outputs come back through `add_child` / `merge`, which reserve the name.
    coll = OutputCollection.empty().add_child("layer", first.collection)
    merged = ctx.merge(coll)
    with pytest.raises(OutputConflictError, match="'layer' is already used"):
        merged.call("layer", lambda c: (None, c))
    with pytest.raises(OutputConflictError, match="layer"):
        merged.merge(coll)
    with pytest.raises(OutputConflictError, match="layer"):
        merged.replace_collection(merged.collection.add_child("layer", coll))
    # And `call` reserves it for `add_child` / `merge`.
    _, called = ctx.call("layer", lambda c: (None, c))
    with pytest.raises(OutputConflictError, match="layer"):
        called.merge(coll)
    with pytest.raises(OutputConflictError, match="layer"):
        called.collection.add_child("layer", OutputCollection.empty())


@pytest.mark.parametrize("bad", ["no", 1, None, np.array([True])])
def test_is_training_must_be_a_bool(bad: Any) -> None:
    with unchecked():
        with pytest.raises(TypeError, match=r"`functional`: is_training must be a"):
            functional(lambda c: (None, c), prng_key=None, is_training=bad)
        with pytest.raises(TypeError, match=r"`Context\.child`: is_training"):
            Context.root().child("a", is_training=bad)
        with pytest.raises(TypeError, match=r"`MethodRunner\.create`: is_training"):
            MethodRunner.create(
                {}, _identity_method, mesh=_mesh(), prng_key=KEY, is_training=bad
            )
    runner = MethodRunner.create(
        {}, _identity_method, mesh=_mesh(), prng_key=KEY, is_training=np.bool_(True)
    )
    assert runner.step.settings.is_training is True


# -- errors that name the eqxctx argument --------------------------------------------


@pytest.mark.parametrize(
    "bad", [0, "key", np.zeros(3, np.uint32), np.zeros(2, np.float32)]
)
def test_keys_are_checked_where_they_enter(bad: Any) -> None:
    with unchecked():
        for call in (
            lambda: Context.root(prng_key=bad),
            lambda: functional(lambda c: (None, c), prng_key=bad, is_training=False),
            lambda: Context.root().child("a", prng_key=bad),
            lambda: MethodRunner.create(
                {}, _identity_method, mesh=_mesh(), prng_key=bad
            ),
        ):
            with pytest.raises(TypeError, match=r"prng_key must be a raw key.*got"):
                call()


def _draw(x: Any, ctx: Context) -> tuple[Any, Context]:
    return x + jax.random.normal(ctx.prng_key), ctx


def test_drawing_from_a_missing_key_names_the_context() -> None:
    with pytest.raises(TypeError, match=r"'root/layer'.*has no PRNG key"):
        functional(
            lambda c: c.call("layer", _draw, 1.0), prng_key=None, is_training=False
        )
    with pytest.raises(TypeError, match=r"'root/iter'.*has no PRNG key") as info:
        scan_in_context(
            lambda a, x, c: (a, *_draw(x, c)),
            context=Context.root(),
            carry=0.0,
            xs=jnp.ones(2),
        )
    assert len(info.value.__notes__) >= 1
    with pytest.raises(TypeError, match=r"'root/iter'.*has no PRNG key"):
        vmap_in_context(_draw, context=Context.root(), xs=jnp.ones(2))
    with pytest.raises(TypeError, match=r"`functional\(fn\)`: the context at 'root'"):
        functional(lambda c: _draw(1.0, c), prng_key=None, is_training=False)


@pytest.mark.parametrize("name", [None, "Bad/Name!", "", "1a"])
def test_root_names_are_checked(name: Any) -> None:
    with unchecked(), pytest.raises(ValueError, match=r"Context.root\(name=\.\.\.\)"):
        Context.root(name=name)


def _scan(**kwargs: Any) -> Any:
    body = lambda a, x, c: (a, x, c)
    args: dict[str, Any] = {"context": Context.root(), "carry": 0.0, "xs": jnp.ones(2)}
    return scan_in_context(body, **(args | kwargs))


def _vmap(**kwargs: Any) -> Any:
    args: dict[str, Any] = {"context": Context.root(), "xs": jnp.ones(2)}
    return vmap_in_context(lambda x, c: (x, c), **(args | kwargs))


_CONTEXT_USERS: dict[str, Callable[[Any], Any]] = {
    "scan_in_context": lambda ctx: _scan(context=ctx),
    "vmap_in_context": lambda ctx: _vmap(context=ctx),
    "cond_in_context": lambda ctx: cond_in_context(
        True, lambda c: (1, c), lambda c: (1, c), context=ctx
    ),
    "switch_in_context": lambda ctx: switch_in_context(
        0, [lambda c: (1, c)], context=ctx
    ),
    "while_in_context": lambda ctx: while_in_context(
        lambda x: x < 1, lambda x, c: (x + 1, c), 0, context=ctx
    ),
    "fori_in_context": lambda ctx: fori_in_context(
        0, 2, lambda i, x, c: (x, c), 0, context=ctx
    ),
}


@pytest.mark.parametrize("where", sorted(_CONTEXT_USERS))
@pytest.mark.parametrize("bad", [None, OutputCollection.empty(), "ctx"])
def test_context_must_be_a_context(where: str, bad: Any) -> None:
    with unchecked(), pytest.raises(TypeError, match=rf"`{where}\(context=\.\.\.\)`"):
        _CONTEXT_USERS[where](bad)
    with pytest.raises(TypeError, match="context"):  # the runtime checks' or ours
        _CONTEXT_USERS[where](bad)


@pytest.mark.parametrize("bad", ["0", 1.0, True, (0, "1"), {"a": 0.5}])
def test_vmap_in_axes_must_be_ints_or_none(bad: Any) -> None:
    xs = {"a": jnp.ones(2)} if isinstance(bad, dict) else jnp.ones(2)
    if isinstance(bad, tuple):
        xs = (jnp.ones(2), jnp.ones(2))
    with unchecked(), pytest.raises(TypeError, match=r"`vmap_in_context\(in_axes="):
        _vmap(xs=xs, in_axes=bad)


def test_vmap_xs_message_names_only_vmap_arguments() -> None:
    with pytest.raises(TypeError, match=r"`xs` may hold arrays only") as info:
        _vmap(xs="ab")
    assert "per_iteration" not in str(info.value)
    with pytest.raises(TypeError, match="`xs` and `per_iteration` may hold arrays"):
        _scan(xs="ab")


@pytest.mark.parametrize("call", [_scan, _vmap])
def test_drop_output_must_be_callable(call: Callable[..., Any]) -> None:
    with unchecked(), pytest.raises(TypeError, match=r"drop_output=\.\.\.\)`.*'summ"):
        call(drop_output="summaries")
    one: Any = 1
    with unchecked(), pytest.raises(TypeError, match=r"fori_in_context\(drop_output"):
        fori_in_context(
            0, 2, lambda i, x, c: (x, c), 0, context=Context.root(), drop_output=one
        )
    with unchecked(), pytest.raises(TypeError, match=r"while_in_context\(drop_output"):
        while_in_context(
            lambda x: x < 1,
            lambda x, c: (x, c),
            0,
            context=Context.root(),
            drop_output=one,
        )


def test_runner_arguments() -> None:
    mesh = _mesh()
    # Typed `Any`: the wrong types are the point.
    bad_method: Any = 123
    no_mesh: Any = None
    bad_drop: Any = "x"
    with unchecked():
        with pytest.raises(TypeError, match=r"`MethodRunner.create\(method=\.\.\.\)`"):
            MethodRunner.create({}, bad_method, mesh=mesh, prng_key=KEY)
        with pytest.raises(TypeError, match=r"`MethodRunner.create\(mesh=\.\.\.\)`"):
            MethodRunner.create({}, _identity_method, mesh=no_mesh, prng_key=KEY)
        with pytest.raises(TypeError, match=r"create\(drop_module_outputs=\.\.\.\)"):
            MethodRunner.create(
                {},
                _identity_method,
                mesh=mesh,
                prng_key=KEY,
                drop_module_outputs=bad_drop,
            )
        runner = MethodRunner.create({}, _identity_method, mesh=mesh, prng_key=KEY)
        bads: list[Any] = ["8", 2.5, True]
        for bad in bads:
            with pytest.raises(
                TypeError, match=r"`run_batches\(max_in_flight=\.\.\.\)`"
            ):
                run_batches(runner, [np.ones(2)], max_in_flight=bad)  # at the call
    with pytest.raises(ValueError, match=r"`run_batches\(max_in_flight=0\)`"):
        run_batches(runner, [np.ones(2)], max_in_flight=0)


@pytest.mark.parametrize("bad", ["x", 16000.0, None, True])
def test_audio_sample_rate_must_be_an_int(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"`AudioSummary\(value, sample_rate=\.\.\.\)`"):
        AudioSummary(jnp.zeros(3), sample_rate=bad)
    with pytest.raises(ValueError, match="sample_rate must be positive"):
        AudioSummary(jnp.zeros(3), sample_rate=0).validate()
    assert AudioSummary(jnp.zeros(3), sample_rate=np.int64(8000)).sample_rate == 8000


@pytest.mark.parametrize("bad", [{}, {"a": 1.0}, None, Context.root()])
def test_add_child_needs_a_collection(bad: Any) -> None:
    with unchecked(), pytest.raises(TypeError, match=r"`add_child\('x', child\)`"):
        OutputCollection.empty().add_child("x", bad)


def test_typed_keys_are_refused_as_summaries_only() -> None:
    key = jax.random.key(0)
    with pytest.raises(TypeError, match=r"'summaries/k' is a typed PRNG key"):
        Context.root().add_summary("k", key)
    with pytest.raises(TypeError, match="typed PRNG key"):
        OutputCollection({"k": key}, {}, {})
    with pytest.raises(TypeError, match="typed PRNG key"):
        IterationSummaries(2, {"k": jax.random.split(key)})
    with pytest.raises(TypeError, match=r"a/k' is a typed PRNG key"):
        SummaryAccumulator().update({"a": {"k": key}})
    coll = Context.root().add_module_output("k", key).add_state_update("k", key)
    assert set(coll.collection.flatten("module_outputs")) == {"k"}


def test_callback_summary_fn_must_be_callable() -> None:
    with pytest.raises(TypeError, match=r"`CallbackSummary\(fn, \*args.*got int 3"):
        CallbackSummary(3)


def test_callback_summary_errors_name_the_path(tmp_path: Any) -> None:
    def broken(x: Any) -> Any:
        raise RuntimeError(f"cannot plot {np.shape(x)}")

    coll = OutputCollection.empty().add_child(
        "model",
        OutputCollection.empty().add_summary("plot", CallbackSummary(broken, 1)),
    )
    with (
        JsonlWriter(tmp_path / "s.jsonl") as writer,
        pytest.raises(ValueError, match=r"'model/plot' raised RuntimeError: canno"),
    ):
        writer.write(0, coll)


@pytest.mark.parametrize(
    ("length", "error", "match"),
    [
        (-1, ValueError, "length must be >= 0"),
        ("3", TypeError, "length must be an int.*got str '3'"),
        (2.0, TypeError, "length must be an int"),
        (True, TypeError, "length must be an int"),
    ],
)
def test_iteration_summaries_length(length: Any, error: type, match: str) -> None:
    with pytest.raises(
        error, match=r"`IterationSummaries\(length, stacked\)`.*" + match
    ):
        IterationSummaries(length, {"a": np.ones(3)})
    assert IterationSummaries(np.int64(3), {"a": np.ones(3)}).length == 3


@pytest.mark.parametrize("kind", [MinSummary, MaxSummary, SumSummary])
def test_python_numbers_become_arrays(kind: Any) -> None:
    s = kind(1)
    assert isinstance(s.value_, jax.Array)
    assert s.value_.shape == ()
    Context.root().add_summary("s", s)
    w = WeightedSummary(1, 2)
    assert isinstance(w.mean, jax.Array)
    assert isinstance(w.weight, jax.Array)
    # They pass through `jax.jit` as arrays, and accumulate.
    np.testing.assert_array_equal(
        eqx.filter_jit(lambda a: a.accumulate(a))(s).value(),
        kind(1).accumulate(kind(1)).value(),
    )


def test_writers_and_accumulators_name_themselves_for_a_bad_leaf(
    tmp_path: Any,
) -> None:
    # A bad leaf in the summaries passed to a writer or accumulator was reported as
    # `OutputCollection`'s, at a 'summaries/...' path the caller never wrote, with a
    # hint about `ctx.call` (found by a review helper).
    from eqxctx.writers import JsonlWriter

    writer = JsonlWriter(tmp_path / "s.jsonl")
    cases: list[tuple[Callable[[], object], str]] = [
        (
            lambda: writer.write(0, {"s": "hello"}),
            r"^`JsonlWriter.write`: the value at 's' has type str; leaves must be",
        ),
        (
            lambda: SummaryAccumulator().update({"x": {"y": "s"}}),
            r"^`SummaryAccumulator.update`: the value at 'x/y' has type str;",
        ),
        (
            lambda: writer.write(0, {"t": np.array(["a"])}),
            r"^`JsonlWriter.write`: the array at 't' has dtype <U1; leaves must be",
        ),
    ]
    for call, message in cases:
        with pytest.raises(TypeError, match=message) as info:
            call()
        assert "ctx.call" not in str(info.value)
    writer.close()
    assert (tmp_path / "s.jsonl").read_text() == ""


def test_summaries_passed_are_checked_as_the_callers(tmp_path: Any) -> None:
    # `freeze` is told who was passed the summaries: every error names the caller and
    # the path in what it was passed (the messages were once rewritten after the
    # fact, which left a non-str key's and a reserved child's naming
    # `OutputCollection` and 'summaries/...').
    from eqxctx.writers import fetch_summaries

    writer = JsonlWriter(tmp_path / "s.jsonl")
    key = jax.random.key(0)
    # Made by unflattening: not checked where they were made.
    unflattened = jax.tree_util.tree_map(
        lambda x: "text", IterationSummaries(2, {"s": np.ones(2)})
    )
    grown = jax.tree_util.tree_map(
        lambda x: "text", OutputCollection.empty().add_summary("a", 1.0)
    )
    leaf = "; leaves must be JAX or NumPy arrays, Python bool/int/float, or `Summary` "
    name = ". Names are non-empty strings without '/'; nest mappings instead "
    name += "(`{'a': {'b': x}}` is written as 'a/b')."
    reserved = "is also a per-iteration child of the scan's per-iteration summaries at"
    cases: list[tuple[Callable[[], object], type[Exception], str]] = [
        (
            lambda: writer.write(0, {"a": {"k": key}}),
            TypeError,
            "`JsonlWriter.write`: the summary at 'a/k' is a typed PRNG key "
            "(key<fry>); writers log numbers. Add it as a module output, or "
            "summarize `jax.random.key_data(key)`.",
        ),
        (
            lambda: SummaryAccumulator().update({"k": key}),
            TypeError,
            "`SummaryAccumulator.update`: the summary at 'k' is a typed PRNG key "
            "(key<fry>); writers log numbers. Add it as a module output, or "
            "summarize `jax.random.key_data(key)`.",
        ),
        (
            lambda: writer.write(0, {1: 2.0}),  # pyright: ignore[reportArgumentType]
            ValueError,
            f"`JsonlWriter.write`: invalid summary name 1 at the top level{name}",
        ),
        (
            lambda: fetch_summaries({"a": {2: 1.0}}),
            ValueError,
            f"`fetch_summaries`: invalid summary name 2 under 'a'{name}",
        ),
        (
            lambda: writer.write(0, {"train": grown}),
            TypeError,
            f"`JsonlWriter.write`: the value at 'train/a' has type str{leaf}objects.",
        ),
        (
            lambda: writer.write(0, {"a": {"loop": unflattened}}),
            TypeError,
            f"`JsonlWriter.write`: the value at 'a/loop/s' has type str{leaf}objects.",
        ),
        (
            lambda: writer.write(
                0, {"a": {"iter": IterationSummaries(2, {}), "iter1": {"s": 1.0}}}
            ),
            OutputConflictError,
            f"`JsonlWriter.write`: the entry at 'a/iter1' {reserved} 'a/iter'. "
            + PREFIX_HINT,
        ),
    ]
    for call, error, message in cases:
        with unchecked(), pytest.raises(error) as info:
            call()
        assert str(info.value) == message
    writer.close()
    assert (tmp_path / "s.jsonl").read_text() == ""
    # A collection's own keys keep their paths and `OutputCollection`'s messages.
    with unchecked(), pytest.raises(TypeError) as info:
        OutputCollection({1: 1.0}, {}, {})  # pyright: ignore[reportArgumentType]
    assert str(info.value) == "`OutputCollection`: key 1 at 'summaries' is not a str."


def test_an_add_error_notes_the_context_it_was_added_to() -> None:
    def layer(x: Any, ctx: Context) -> tuple[Any, Context]:
        return x, ctx.add_summary("loss", 1.0).add_summary("loss", 2.0)

    def encoder(x: Any, ctx: Context) -> tuple[Any, Context]:
        return ctx.call("layer", layer, x)

    with pytest.raises(OutputConflictError, match="already has an entry 'loss'") as e:
        Context.root().call("enc", encoder, 1.0)
    assert e.value.__notes__ == ["In context 'root/enc/layer'."]

    def bad_output(x: Any, ctx: Context) -> tuple[Any, Context]:
        return x, ctx.add_module_output("h", "text")

    with pytest.raises(TypeError, match="the value at 'module_outputs/h'") as e:
        Context.root().call("enc", bad_output, 1.0)
    assert e.value.__notes__ == ["In context 'root/enc'."]

    def body(c: Any, x: Any, ctx: Context) -> tuple[Any, None, Context]:
        return c, None, ctx.add_state_update("s", x).add_state_update("s", x)

    with pytest.raises(OutputConflictError) as e:
        scan_in_context(body, context=Context.root(), carry=0.0, xs=jnp.ones(2))
    assert "In context 'root/iter'." in e.value.__notes__  # (JAX adds its own)


def test_functional_args_must_be_a_tuple() -> None:
    def f(x: Any, ctx: Context) -> tuple[Any, Context]:
        return x * 2, ctx

    import inspect

    # As called without this suite's runtime type checks (which refuse arrays first).
    unchecked = inspect.unwrap(functional)
    for args in (jnp.array([3.0]), np.array([3.0]), 3.0, "ab"):
        with pytest.raises(TypeError, match=r"args=\(x,\)` for one argument"):
            unchecked(f, prng_key=None, is_training=False, args=args)
    out, _ = functional(f, prng_key=None, is_training=False, args=[jnp.array([3.0])])
    assert out.tolist() == [6.0]


def test_merging_what_is_not_a_collection_names_the_call() -> None:
    import inspect

    # As called without this suite's runtime type checks (which refuse it first).
    merge, replace = (
        inspect.unwrap(Context.merge),
        inspect.unwrap(Context.replace_collection),
    )
    coll_merge = inspect.unwrap(OutputCollection.merge)
    add_child = inspect.unwrap(OutputCollection.add_child)
    ctx = Context.root()
    for value in ({"x": 1.0}, None):
        with pytest.raises(TypeError, match=r"`Context.merge\(collection\)`: coll"):
            merge(ctx, value)
        with pytest.raises(TypeError, match=r"`OutputCollection.merge\(other\)`"):
            coll_merge(ctx.collection, value)
        with pytest.raises(TypeError, match=r"replace_collection\(collection\)`"):
            replace(ctx, value)
        with pytest.raises(TypeError, match=r"`add_child\('c', child\)`: child must"):
            add_child(ctx.collection, "c", value)


def test_context_constructor_checks_its_arguments() -> None:
    import inspect

    # As called without this suite's runtime type checks (which refuse some first).
    init = inspect.unwrap(Context.__init__)
    empty = OutputCollection.empty()

    def build(*args: Any) -> Context:
        ctx = object.__new__(Context)
        init(ctx, *args)
        return ctx

    cases: list[tuple[tuple[Any, ...], type[Exception], str]] = [
        (("root", None, False, empty), TypeError, r"got str 'root'"),
        (((), None, False, empty), TypeError, r"non-empty tuple of names"),
        (
            (("root", "Enc"), None, False, empty),
            ValueError,
            r"invalid child name 'Enc'",
        ),
        ((("root",), 3, False, empty), TypeError, r"`Context`"),
        ((("root",), None, 1, empty), TypeError, r"is_training must be a bool"),
        ((("root",), None, False, {}), TypeError, r"collection must be an `Output"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            build(*args)
    key = jax.random.PRNGKey(3)
    ctx = build(["root", "enc"], key, np.bool_(True), empty, 2)
    assert ctx.path == ("root", "enc")
    assert ctx.is_training is True
    assert ctx.summary_level == 2
    assert ctx.prng_key is key
    assert ctx == Context.root(prng_key=key, is_training=True, summary_level=2).child(
        "enc", prng_key=key
    )


def test_propagate_checks_its_length() -> None:
    import inspect

    from eqxctx import propagate_repeated_output_collections as propagate

    empty = OutputCollection.empty()
    # `length=True` is an int to the annotation; the rest as called without this
    # suite's runtime type checks.
    unchecked = inspect.unwrap(propagate)
    for length in (-1, True, 2.0, "2"):
        for merge in (False, True):
            with pytest.raises(ValueError, match=r"non-negative int, got "):
                unchecked(
                    empty,
                    child_name_prefix="iter",
                    merge_summaries=merge,
                    length=length,
                )
    stacked = OutputCollection({"x": jnp.arange(3.0)}, {}, {})
    got = unchecked(
        stacked, child_name_prefix="iter", merge_summaries=True, length=np.int64(3)
    )
    assert float(got.flatten("summaries")["iter/x"]) == 3.0
    with pytest.raises(ValueError, match=r"length=2 but the leaves have a leading"):
        propagate(stacked, child_name_prefix="iter", merge_summaries=False, length=2)

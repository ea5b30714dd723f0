"""No output is lost silently: the ledger's check (issue 37)."""

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import eqxctx
from eqxctx import Context, LostOutputError
from helpers import optimized_hlo


HERE = Path(__file__)
SOURCE = HERE.read_text().splitlines()


def line_of(marker: str) -> str:
    """`file:line` of the one line of this file that ends with `# marker`."""
    (n,) = [i + 1 for i, s in enumerate(SOURCE) if s.endswith(f"# {marker}")]
    return re.escape(f"{HERE}:{n}")


def run(fn: Callable[..., Any], x: Any = 1.0, *, jit: bool = False) -> Any:
    def go(x: Any) -> Any:
        return eqxctx.functional(fn, prng_key=None, is_training=False, args=(x,))

    return jax.jit(go)(jnp.asarray(x)) if jit else go(jnp.asarray(x))


# The three snippets, and their corrections.


def dropped_add(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    ctx.add_summary("loss", x)  # dropped-add
    return x, ctx


def kept_add(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    ctx = ctx.add_summary("loss", x)
    return x, ctx


def block(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    return 2 * x, ctx.add_summary("a", x)


def dropped_call(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    y, _ctx2 = ctx.call("block", block, x)  # dropped-call
    return y, ctx


def kept_call(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    y, ctx = ctx.call("block", block, x)
    return y, ctx


def body(h: jax.Array, x: jax.Array, ctx: Context) -> tuple[jax.Array, None, Context]:
    return h + x, None, ctx.add_summary("s", x)


def unmerged_scan(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    xs = jnp.arange(3.0)
    h, _, _coll = eqxctx.scan_in_context(body, context=ctx, carry=x, xs=xs)  # scan
    return h, ctx


def merged_scan(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    h, _, coll = eqxctx.scan_in_context(body, context=ctx, carry=x, xs=jnp.arange(3.0))
    return h, ctx.merge(coll)


def two_lines(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    first = ctx.add_summary("loss", x)  # first-line
    second = ctx.add_summary("loss", 2 * x)
    del first
    return x, second


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    ("fn", "marker", "what"),
    [
        (dropped_add, "dropped-add", "summary root/loss"),
        (dropped_call, "dropped-call", r"child \(ctx.call\) root/block"),
        (unmerged_scan, "scan", r"root/\['iter'\]: a combinator's collection"),
        (two_lines, "first-line", "summary root/loss"),
    ],
)
def test_a_lost_output_raises_naming_its_path_and_line(
    fn: Callable[..., Any], marker: str, what: str, jit: bool
) -> None:
    pattern = rf"`functional\(fn\)`.*{what}[^\n]*, at {line_of(marker)}.*ctx\.merge"
    with pytest.raises(LostOutputError, match=re.compile(pattern, re.S)):
        run(fn, jit=jit)


def test_the_corrected_code_runs_with_the_same_outputs() -> None:
    y, coll = run(kept_add, 3.0)
    assert float(y) == 3.0
    assert {k: float(v) for k, v in coll.flatten("summaries").items()} == {"loss": 3.0}
    y, coll = run(kept_call, 3.0, jit=True)
    assert float(y) == 6.0
    assert float(coll.flatten("summaries")["block/a"]) == 3.0
    h, coll = run(merged_scan, 1.0, jit=True)
    assert float(h) == 4.0  # 1 + 0 + 1 + 2
    got = {k: float(v) for k, v in coll.flatten("summaries").items()}
    assert got == {"iter0/s": 0.0, "iter1/s": 1.0, "iter2/s": 2.0}


def test_lost_output_error_is_a_value_error() -> None:
    assert issubclass(LostOutputError, ValueError)


# Inside combinator bodies and ctx.call: the body's own call raises, naming the body.


def _forget(x: jax.Array, ctx: Context) -> Context:
    ctx.add_summary("lost", x)  # in-body
    return ctx


BODIES: dict[str, Callable[[jax.Array, Context], tuple[Any, ...]]] = {
    "Context.call": lambda x, ctx: ctx.call("c", lambda x, c: (x, _forget(x, c)), x),
    "scan_in_context": lambda x, ctx: eqxctx.scan_in_context(
        lambda h, x, c: (h, None, _forget(x, c)), context=ctx, carry=x, xs=x[None]
    )[::2],
    "vmap_in_context": lambda x, ctx: eqxctx.vmap_in_context(
        lambda x, c: (x, _forget(x, c)), context=ctx, xs=x[None]
    ),
    "cond_in_context": lambda x, ctx: eqxctx.cond_in_context(
        x > 0, lambda x, c: (x, _forget(x, c)), lambda x, c: (x, c), x, context=ctx
    ),
    "while_in_context": lambda x, ctx: eqxctx.while_in_context(
        lambda v: v < 0, lambda v, c: (v, _forget(v, c)), x, context=ctx
    ),
    "fori_in_context": lambda x, ctx: eqxctx.fori_in_context(
        0, 2, lambda i, v, c: (v, _forget(v, c)), x, context=ctx
    ),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("where", sorted(BODIES))
def test_a_body_that_loses_an_output_raises(where: str, jit: bool) -> None:
    combinator = BODIES[where]

    def model(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        y, got = combinator(x, ctx)
        return y, ctx.merge(got) if isinstance(got, eqxctx.OutputCollection) else got

    pattern = rf"{re.escape(where)}.*fn.*summary .*lost, at {line_of('in-body')}"
    with pytest.raises(LostOutputError, match=re.compile(pattern, re.S)):
        run(model, 1.0, jit=jit)


def test_a_runner_method_that_loses_an_output_raises() -> None:
    mesh = jax.make_mesh((1,), ("data",))

    def method(model: Any, batch: jax.Array, ctx: Context) -> tuple[Any, Context]:
        ctx.add_summary("mean", jnp.mean(batch))  # runner
        return batch * 2, ctx

    runner = eqxctx.MethodRunner.create(
        {}, method, mesh=mesh, prng_key=jax.random.key(0)
    )
    pattern = rf"`MethodRunner`: method.*summary root/mean, at {line_of('runner')}"
    with pytest.raises(LostOutputError, match=re.compile(pattern, re.S)):
        runner(np.ones((2, 3), np.float32))

    def fixed(model: Any, batch: jax.Array, ctx: Context) -> tuple[Any, Context]:
        return batch * 2, ctx.add_summary("mean", jnp.mean(batch))

    runner = eqxctx.MethodRunner.create(
        {}, fixed, mesh=mesh, prng_key=jax.random.key(0)
    )
    _, out = runner(np.ones((2, 3), np.float32))
    assert float(out.summaries["mean"]) == 1.0


def test_value_and_grad_checks_its_function() -> None:
    def loss(w: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        ctx.add_summary("w", w)  # vag
        return jnp.sum(w**2), ctx

    with pytest.raises(LostOutputError, match=line_of("vag")):
        eqxctx.value_and_grad(loss)(jnp.ones(2), prng_key=None, is_training=True)


def test_discard_drops_outputs_on_purpose() -> None:
    def model(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        ctx.add_summary("tried", x).discard()
        h, _, coll = eqxctx.scan_in_context(body, context=ctx, carry=x, xs=x[None])
        ctx.merge(coll).discard()
        return h, ctx.add_summary("kept", x)

    _, coll = run(model, 2.0)
    assert {k: float(v) for k, v in coll.flatten("summaries").items()} == {"kept": 2.0}


def test_what_passes_through_a_transformation_is_checked_by_name() -> None:
    # A context rebuilt by `jax.jit` holds new objects: its names are checked.
    def model(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        ctx = ctx.add_summary("a", x)
        return x, jax.jit(lambda c: c.add_summary("b", 1.0))(ctx)

    _, coll = run(model)
    assert sorted(coll.flatten("summaries")) == ["a", "b"]

    def lossy(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        ctx.add_summary("a", x)  # transformed
        return x, jax.jit(lambda c: c.add_summary("b", 1.0))(ctx)

    with pytest.raises(LostOutputError, match=line_of("transformed")):
        run(lossy)


def test_nothing_is_reported_for_an_empty_child_or_collection() -> None:
    def model(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        ctx.call("empty", lambda x, c: (x, c), x)
        eqxctx.scan_in_context(lambda h, x, c: (h, x, c), context=ctx, carry=x, xs=x)
        return x, ctx

    y, coll = run(model, [1.0, 2.0])
    assert coll.flatten("summaries") == {}
    np.testing.assert_array_equal(y, [1.0, 2.0])


def test_a_dropped_child_loses_only_if_a_leaf_lies_below_it() -> None:
    # Found by tests/test_scope.py: a child holding only empty children lost nothing.
    def nested(leaf: bool) -> Callable[[jax.Array, Context], tuple[jax.Array, Context]]:
        def inner(x: jax.Array, c: Context) -> tuple[jax.Array, Context]:
            return x, c.add_summary("s", x.sum()) if leaf else c

        def model(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
            ctx.call(
                "a", lambda x, c: c.call("b", lambda x, c: c.call("c", inner, x), x), x
            )
            return x, ctx

        return model

    y, coll = run(nested(False), [1.0, 2.0])
    assert coll.flatten("summaries") == {}
    np.testing.assert_array_equal(y, [1.0, 2.0])
    with pytest.raises(LostOutputError, match="root/a"):
        run(nested(True), [1.0, 2.0])


def test_the_check_changes_no_program_and_no_trace_count() -> None:
    # With the check (`functional`) and without (a root context nobody checks).
    traces: list[int] = []

    def model(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        traces.append(1)
        y, ctx = ctx.call("block", block, x)
        h, _, coll = eqxctx.scan_in_context(body, context=ctx, carry=y, xs=x)
        return h, ctx.merge(coll)

    def checked(x: jax.Array) -> Any:
        return eqxctx.functional(model, prng_key=None, is_training=False, args=(x,))

    def unchecked(x: jax.Array) -> Any:
        y, ctx = model(x, Context.root())
        return y, ctx.collection.prune(lambda p: p.startswith("module_outputs/"))

    x = jnp.arange(3.0)
    assert optimized_hlo(checked, x) == optimized_hlo(unchecked, x)
    counts: list[int] = []
    for f in (checked, unchecked):
        traces.clear()
        jax.jit(lambda x, f=f: f(x))(x)
        counts.append(len(traces))
    assert counts == [1, 1]


# Random programs: an error exactly when an added entry is missing from the result.

Program = list[tuple[Any, ...]]


def programs(depth: int) -> st.SearchStrategy[Program]:
    op = st.tuples(
        st.just("add"), st.sampled_from(["summary", "output"]), st.booleans()
    )
    if depth:
        sub = programs(depth - 1)
        op = op | st.tuples(
            st.sampled_from(["call", "scan", "cond"]), sub, st.booleans()
        )
    return st.lists(op, max_size=3)


def _adds(program: Program) -> int:
    return sum(1 if op[0] == "add" else _adds(op[1]) for op in program)


def _kept(program: Program) -> int:
    """The leaves a body's returned context holds (its forgotten ops hold none)."""
    return sum(0 if op[2] else 1 if op[0] == "add" else _kept(op[1]) for op in program)


def _forgotten_loses(op: tuple[Any, ...]) -> bool:
    if op[0] == "add":
        return True
    if op[0] == "call":  # a child whose body kept a leaf, at any depth
        return _kept(op[1]) > 0
    return _adds(op[1]) > 0  # a combinator's collection holding a leaf


def loses(program: Program) -> bool:
    """The reference: a forgotten add or non-empty child, here or below."""
    return any(
        (op[2] and _forgotten_loses(op)) or (op[0] != "add" and loses(op[1]))
        for op in program
    )


def interpret(program: Program, x: jax.Array, ctx: Context) -> Context:
    for i, (kind, arg, forget) in enumerate(program):
        name = f"n{i}"
        if kind == "add":
            add = ctx.add_summary if arg == "summary" else ctx.add_module_output
            new = add(name, x + i)
        elif kind == "call":
            _, new = ctx.call(name, lambda x, c, p=arg: (x, interpret(p, x, c)), x)
        elif kind == "scan":
            _, _, coll = eqxctx.scan_in_context(
                lambda h, x, c, p=arg: (h, None, interpret(p, x, c)),
                context=ctx,
                carry=x,
                xs=jnp.stack([x, x]),
                child_name_prefix=name,
            )
            new = ctx.merge(coll)
        else:
            _, coll = eqxctx.cond_in_context(
                x > 0,
                lambda x, c, p=arg: (x, interpret(p, x, c)),
                lambda x, c, p=arg: (x, interpret(p, x, c)),
                x,
                context=ctx,
                child_name=name,
            )
            new = ctx.merge(coll)
        if not forget:
            ctx = new
    return ctx


@given(programs(2))
def test_random_programs_raise_exactly_when_an_entry_is_lost(program: Program) -> None:
    def model(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return x, interpret(program, x, ctx)

    if loses(program):
        with pytest.raises(LostOutputError):
            run(model)
    else:
        run(model)


def test_a_replaced_collection_is_checked_by_name() -> None:
    def model(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        ctx = ctx.add_summary("a", x)
        return x, ctx.replace_collection(jax.tree.map(lambda v: v + 1, ctx.collection))

    _, coll = run(model, 1.0)
    assert {k: float(v) for k, v in coll.flatten("summaries").items()} == {"a": 2.0}

    def lossy(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        ctx.add_summary("a", x)  # replaced
        return x, ctx.replace_collection(eqxctx.OutputCollection.empty())

    with pytest.raises(LostOutputError, match=line_of("replaced")):
        run(lossy)

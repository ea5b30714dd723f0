"""Python-loop references for scan_in_context / vmap_in_context, and a random body.

Not collected by pytest (no `test_` prefix); imported by the combinator tests.
"""

from collections.abc import Callable, Sequence
from typing import Any, Final, Literal

import jax
import jax.numpy as jnp
import numpy as np

from eqxctx import (
    Context,
    HistogramSummary,
    ImageSummary,
    MaxSummary,
    MinSummary,
    OutputCollection,
    Summary,
    SumSummary,
    WeightedSummary,
)


SUMMARY_VARIANTS = (
    "raw",
    "vec",
    "weighted",
    "min",
    "max",
    "sum",
    "image",
    "hist",
    "const",
    "int",
    "rand",
)
ARRAY_VARIANTS = ("raw", "vec", "rand")

KINDS: Final[tuple[Literal["summaries", "state_updates", "module_outputs"], ...]] = (
    "summaries",
    "state_updates",
    "module_outputs",
)

#: One output a body adds: (kind, name, variant).
Output = tuple[str, str, str]


def output_value(variant: str, h: jax.Array, x: jax.Array, key: Any) -> Any:
    """Return an output value of the given variant computed from `h` and `x`."""
    if variant == "raw":
        return jnp.mean(h)
    if variant == "vec":
        return h * 2.0
    if variant == "weighted":
        return WeightedSummary(jnp.mean(h), jnp.sum(jnp.abs(x)) + 0.5)
    if variant == "min":
        return MinSummary(h)
    if variant == "max":
        return MaxSummary(h)
    if variant == "sum":
        return SumSummary(h)
    if variant == "image":
        return ImageSummary(jnp.broadcast_to(jnp.tanh(h[0]), (1, 2, 2)))
    if variant == "hist":
        return HistogramSummary(h)
    if variant == "const":
        return 1.5
    if variant == "int":
        return jnp.asarray(jnp.round(h[0] * 10.0), jnp.int32)
    if variant == "rand":
        return jnp.zeros(()) if key is None else jax.random.uniform(key, (2,))
    raise AssertionError(variant)


def add_output(ctx: Context, kind: str, name: str, value: Any) -> Context:
    if kind == "summaries":
        return ctx.add_summary(name, value)
    if kind == "state_updates":
        return ctx.add_state_update(name, value)
    return ctx.add_module_output(name, value)


def make_body(
    outputs: Sequence[Output], *, with_sub: bool
) -> Callable[[Any, Any, Context], tuple[Any, Any, Context]]:
    """Return a scan body `(carry, x, ctx) -> (carry, y, ctx)` adding `outputs`.

    `carry` is `(h [w], count [])`; `x` is `{"a": [w], "b": []}`.
    """

    def body(carry: Any, x: Any, ctx: Context) -> tuple[Any, Any, Context]:
        h, count = carry
        h = h * 0.9 + x["a"] * x["b"]
        for kind, name, variant in outputs:
            ctx = add_output(
                ctx, kind, name, output_value(variant, h, x["a"], ctx.prng_key)
            )
        if with_sub:

            def sub(v: jax.Array, c: Context) -> tuple[jax.Array, Context]:
                return v, c.add_summary("s", v).add_module_output("o", v * 3.0)

            _, ctx = ctx.call("sub", sub, jnp.sum(h))
        return (h, count + 1), {"y": jnp.sum(h), "h": h}, ctx

    return body


def _accumulate(a: Any, b: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda u, v: u.accumulate(v) if isinstance(u, Summary) else u + v,
        a,
        b,
        is_leaf=lambda t: isinstance(t, Summary),
    )


def _stack(trees: list[Any]) -> Any:
    return jax.tree_util.tree_map(
        lambda *a: np.stack([np.asarray(v) for v in a]), *trees
    )


def _layout(
    colls: list[OutputCollection],
    order: Sequence[int],
    prefix: str,
    merge: bool,
) -> OutputCollection:
    """Build the expected collection from per-iteration collections (index order)."""
    ref = OutputCollection.empty()
    n = len(colls)
    merged: Any = {}
    if merge:
        for j, i in enumerate(order):
            merged = (
                colls[i].summaries
                if j == 0
                else _accumulate(merged, colls[i].summaries)
            )
    else:
        for i in range(n):
            ref = ref.add_child(
                f"{prefix}{i}", OutputCollection(colls[i].summaries, {}, {})
            )
    state = _stack([c.state_updates for c in colls]) if n else {}
    outputs = _stack([c.module_outputs for c in colls]) if n else {}
    return ref.add_child(prefix, OutputCollection(merged, state, outputs))


def reference_scan(
    fn: Callable[[Any, Any, Context], tuple[Any, Any, Context]],
    *,
    context: Context,
    carry: Any,
    xs: Any,
    n: int,
    reverse: bool = False,
    split_prng_key: bool = True,
    keys: Any = None,
    drop_output: Callable[[str], bool] | None = None,
    prefix: str = "iter",
    merge: bool = False,
) -> tuple[Any, Any, OutputCollection]:
    """A Python loop with `Context.child` giving `scan_in_context`'s results."""
    child_key = context.child(prefix).prng_key
    order = list(range(n))[::-1] if reverse else list(range(n))
    ys: list[Any] = [None] * n
    colls: list[Any] = [None] * n
    for i in order:
        if keys is not None:
            key = keys[i]
        elif child_key is None or not split_prng_key:
            key = child_key
        else:
            key = jax.random.fold_in(child_key, i)
        ctx_i = context.child(prefix, prng_key=key)
        x_i = jax.tree_util.tree_map(lambda a: a[i], xs)  # noqa: B023
        carry, ys[i], ctx_i = fn(carry, x_i, ctx_i)
        coll = ctx_i.collection
        colls[i] = coll.prune(drop_output) if drop_output is not None else coll
    stacked = _stack(ys) if n else None
    return carry, stacked, _layout(colls, order, prefix, merge)


def reference_vmap(
    fn: Callable[[Any, Context], tuple[Any, Context]],
    *,
    context: Context,
    xs: Any,
    in_axes: Any,
    n: int,
    split_prng_key: bool = True,
    drop_output: Callable[[str], bool] | None = None,
    prefix: str = "iter",
    merge: bool = False,
) -> tuple[Any, OutputCollection]:
    """A Python loop over examples giving `vmap_in_context`'s results.

    `in_axes` is a dict matching `xs`'s top-level keys (int or None per entry).
    """
    child_key = context.child(prefix).prng_key
    ys: list[Any] = []
    colls: list[OutputCollection] = []
    for i in range(n):
        if child_key is None or not split_prng_key:
            key = child_key
        else:
            key = jax.random.fold_in(child_key, i)
        x_i = {
            k: v if in_axes[k] is None else jnp.take(v, i, axis=in_axes[k])
            for k, v in xs.items()
        }
        y, ctx_i = fn(x_i, context.child(prefix, prng_key=key))
        ys.append(y)
        coll = ctx_i.collection
        colls.append(coll.prune(drop_output) if drop_output is not None else coll)
    stacked = _stack(ys) if n else None
    return stacked, _layout(colls, range(n), prefix, merge)


def assert_flat_close(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Assert two flattened collections have the same paths, kinds and values."""
    assert sorted(got) == sorted(want), what
    for path, w in want.items():
        g = got[path]
        if isinstance(w, Summary):
            assert type(g) is type(w), (what, path)
        gl, wl = jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(w)
        assert len(gl) == len(wl), (what, path)
        for a, b in zip(gl, wl, strict=True):
            np.testing.assert_allclose(
                np.asarray(a),
                np.asarray(b),
                rtol=2e-5,
                atol=1e-6,
                err_msg=f"{what} {path}",
            )


def assert_collections_close(got: OutputCollection, want: OutputCollection) -> None:
    for kind in KINDS:
        assert_flat_close(got.flatten(kind), want.flatten(kind), kind)

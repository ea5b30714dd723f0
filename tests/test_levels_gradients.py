"""Levels of gradient probes: `add_gradient_summary(..., level=)` and `_output`."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxctx
from eqxctx import Context, scan_in_context
from helpers import optimized_hlo


def _loss(w: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
    h = w * 3.0
    h, ctx = ctx.add_gradient_summary("cheap", h)  # level 0
    h, ctx = ctx.add_gradient_summary("full", h, jnp.max, level=1)
    h, ctx = ctx.add_gradient_output("ct", h, level=1)
    ctx = ctx.add_summary("fwd", jnp.sum(h), level=1)
    return jnp.sum(h**2), ctx


@pytest.mark.parametrize(
    ("summary_level", "summaries", "outputs"),
    [
        (None, {"cheap", "full", "fwd"}, {"ct"}),
        (1, {"cheap", "full", "fwd"}, {"ct"}),
        (0, {"cheap"}, set()),
        (-1, set(), set()),
    ],
)
def test_probes_keep_levels_at_or_below_summary_level(
    summary_level: int | None, summaries: set[str], outputs: set[str]
) -> None:
    w = jnp.arange(1.0, 5.0)
    grad_fn = eqxctx.value_and_grad(_loss, summary_level=summary_level)
    (loss, coll), grads = grad_fn(w, prng_key=None, is_training=True)
    flat = coll.flatten("summaries")
    assert set(flat) == summaries
    assert set(coll.flatten("module_outputs")) == outputs
    # The loss and gradients do not depend on the level; the kept values are right.
    np.testing.assert_allclose(loss, np.sum((3 * np.arange(1.0, 5.0)) ** 2))
    np.testing.assert_allclose(grads, 18 * np.arange(1.0, 5.0), rtol=1e-6)
    ct = 2 * 3 * np.arange(1.0, 5.0)  # d loss / d h
    if "cheap" in flat:
        np.testing.assert_allclose(flat["cheap"], np.sqrt(np.mean(ct**2)), rtol=1e-6)
    if "full" in flat:
        np.testing.assert_allclose(flat["full"], np.max(ct), rtol=1e-6)
    if outputs:
        np.testing.assert_allclose(coll.flatten("module_outputs")["ct"], ct)


def test_scan_iterations_drop_probes_above_the_level() -> None:
    def loss(ws: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        def body(h: Any, w: Any, ctx: Context) -> tuple[Any, None, Context]:
            h, ctx = ctx.add_gradient_summary("rms", h)
            h, ctx = ctx.add_gradient_summary("max", h, jnp.max, level=2)
            return jnp.tanh(h * w), None, ctx

        h, _, coll = scan_in_context(body, context=ctx, carry=jnp.ones(3), xs=ws)
        return jnp.sum(h), ctx.merge(coll)

    ws = jnp.arange(1.0, 4.0)
    for level, want in ((1, {"rms"}), (None, {"rms", "max"})):
        grad_fn = eqxctx.value_and_grad(loss, summary_level=level)
        (_, coll), _ = grad_fn(ws, prng_key=None, is_training=False)
        got = set(coll.flatten("summaries"))
        assert got == {f"iter{i}/{name}" for i in range(3) for name in want}


def _step(*, probe: bool, summary_level: int | None) -> Any:
    def spectrum(ct: jax.Array) -> Any:
        s = jnp.linalg.svd(ct, compute_uv=False)
        return eqxctx.HistogramSummary(s)

    def loss(w: jax.Array, x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        y = x @ w
        if probe:
            y, ctx = ctx.add_gradient_summary("spectrum", y, spectrum, level=1)
        return jnp.sum(jnp.tanh(y)), ctx

    grad_fn = eqxctx.value_and_grad(loss, summary_level=summary_level)
    return lambda w, x: grad_fn(w, x, prng_key=None, is_training=True)


def test_hlo_of_a_dropped_expensive_probe_equals_the_step_without_it() -> None:
    w = jnp.ones((16, 16), jnp.float32)
    x = jnp.ones((16, 16), jnp.float32)
    dropped = optimized_hlo(_step(probe=True, summary_level=0), w, x)
    without = optimized_hlo(_step(probe=False, summary_level=None), w, x)
    kept = optimized_hlo(_step(probe=True, summary_level=None), w, x)
    assert dropped == without
    assert kept != without  # the probe is expensive when kept
    (_, coll), _ = jax.jit(_step(probe=True, summary_level=0))(w, x)
    assert not coll.flatten("summaries")


def test_bad_levels_raise() -> None:
    # beartype (on the test suite) may answer first; without it, eqxctx's message.
    ctx = Context.root(summary_level=0)
    with pytest.raises(TypeError, match="level"):
        ctx.add_gradient_summary("g", jnp.ones(2), level=1.5)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="level"):
        ctx.add_gradient_output("g", jnp.ones(2), level="1")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="summary_level"):
        eqxctx.value_and_grad(_loss, summary_level="0")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"value_and_grad\(summary_level=\.\.\.\)"):
        eqxctx.value_and_grad(_loss, summary_level=True)
    with pytest.raises(TypeError, match=r"add_gradient_output\(level=\.\.\.\)"):
        ctx.add_gradient_output("g", jnp.ones(2), level=True)

"""Issue 37 A/B: `value_and_grad`'s trace+lower with the unused-probe check on and off.

One process, the two variants interleaved (each first in turn), the collector off
during each build; prints min and median over rounds of on/off. "off" restores the
shape pass as it was before the check (a diagnostic only): `jax.eval_shape` instead
of `jax.make_jaxpr`, no marks (`_gradients.mark` returns `x`) and no walk.

Rows: bench_gradients.py's model (a scan of L = 64 residual layers, width 256, one
probe per layer; and without probes), and a flat function with P probes at top
level (the walk and the marks at their largest share of a small trace).

    cd benchmarks && PYTHONPATH=../src:. ../.venv/bin/python ab_probes.py [rounds]
"""

import gc
import importlib
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import bench_gradients as bg
import jax
import jax.numpy as jnp

import eqxctx
from eqxctx import Context


_gradients = importlib.import_module("eqxctx._gradients")
_value_and_grad = importlib.import_module("eqxctx._value_and_grad")
MARK, CHECK = _gradients.mark, _value_and_grad.check_probes_used


def _eval_shape_pass(f: Callable[[], Any], return_shape: bool) -> Callable[[], Any]:
    del return_shape
    return lambda: (SimpleNamespace(jaxpr=None), jax.eval_shape(f))


# `_value_and_grad` as before the check: its `jax.make_jaxpr` is `jax.eval_shape`.
BEFORE = SimpleNamespace(**{k: getattr(jax, k) for k in dir(jax) if k[0] != "_"})
BEFORE.make_jaxpr = _eval_shape_pass


def set_check(on: bool) -> None:
    setattr(_gradients, "mark", MARK if on else (lambda x, key, site: x))  # noqa: B010
    setattr(_value_and_grad, "jax", jax if on else BEFORE)  # noqa: B010
    setattr(  # noqa: B010
        _value_and_grad, "check_probes_used", CHECK if on else (lambda jaxpr: None)
    )


def make_flat(probes: int) -> Callable[..., Any]:
    def loss(w: jax.Array, ctx: Context) -> Any:
        h = w
        for i in range(probes):
            h, ctx = ctx.add_gradient_summary(f"g{i}", jnp.sin(h))
        return jnp.sum(h), ctx

    def run(w: jax.Array) -> Any:
        return eqxctx.value_and_grad(loss)(w, prng_key=None, is_training=True)

    return run


def lower_time(make: Callable[[], Callable[..., Any]], args: Any, on: bool) -> float:
    set_check(on)
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn = make()
        jax.jit(lambda *a: fn(*a)).lower(*args)
        return time.perf_counter() - t0
    finally:
        gc.enable()
        set_check(True)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    key = jax.random.PRNGKey(0)
    ws = jax.random.normal(key, (bg.LAYERS, bg.WIDTH, bg.WIDTH)) / bg.WIDTH**0.5
    h = jax.random.normal(jax.random.PRNGKey(1), (bg.BATCH, bg.WIDTH))
    rows: dict[str, tuple[Callable[[], Callable[..., Any]], Any]] = {
        "scan, 1 probe per layer": (bg.make_ours, (ws, h)),
        "scan, no probes": (lambda: bg.make_ours(probe=False), (ws, h)),
        "flat, 100 probes": (lambda: make_flat(100), (jnp.ones(8),)),
    }
    print(f"jax {jax.__version__}, {rounds} rounds; trace+lower, check on / off")
    print("| row | on (ms, min) | off (ms, min) | on/off (min) | on/off (median) |")
    print("|---|--:|--:|--:|--:|")
    for name, (make, args) in rows.items():
        lower_time(make, args, True)  # warm-up (caches of both variants)
        lower_time(make, args, False)
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds):
            for on in (True, False) if r % 2 else (False, True):
                times[on].append(lower_time(make, args, on))
        ratios = sorted(a / b for a, b in zip(times[True], times[False], strict=True))
        on_min, off_min = min(times[True]), min(times[False])
        print(
            f"| {name} | {on_min * 1e3:.1f} | {off_min * 1e3:.1f} "
            f"| {on_min / off_min:.3f} | {ratios[len(ratios) // 2]:.3f} |"
        )


if __name__ == "__main__":
    main()

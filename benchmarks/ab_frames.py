"""Issue 36 A/B of context frames: min trace times (gc off) of bench_trace's rows and a
chain reading its key at every level; prints JSON. Run once per tree, alternating:

    cd benchmarks && PYTHONPATH=../src:. ../.venv/bin/python ab_frames.py 3
"""

import gc
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import bench_trace as bt
import jax
import jax.numpy as jnp

from eqxctx import Context, functional


Fn = Callable[..., Any]


def keys_chain(k: int) -> Fn:
    def node(x: jax.Array, ctx: Context, *, i: int) -> tuple[jax.Array, Context]:
        x = x + jax.random.normal(ctx.prng_key, x.shape)
        if i + 1 < k:
            x, ctx = ctx.call(f"c{i + 1}", node, x, i=i + 1)
        return x, ctx

    def model(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        return ctx.call("c0", node, x, i=0)

    def run(x: jax.Array, key: jax.Array) -> Any:
        return functional(model, prng_key=key, is_training=True, args=(x,))[0]

    return run


def trace_time(fn: Fn, args: tuple[Any, ...]) -> float:
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        jax.jit(fn).trace(*args)
        return time.perf_counter() - t0
    finally:
        gc.enable()


def main() -> None:
    rounds = int(sys.argv[1])
    args = (jnp.ones(bt.WIDTH, jnp.float32), jax.random.PRNGKey(0))
    cases: dict[
        str, tuple[Callable[[int, int], Fn], Callable[[int, int], Fn], int, int]
    ]
    cases = {
        "flat S=1 K=1000": (bt.make_flat_ours, bt.make_flat_hand, 1000, 1),
        "deep S=1 K=1000": (bt.make_deep_ours, bt.make_deep_hand, 1000, 1),
        "flat S=4 K=100": (bt.make_flat_ours, bt.make_flat_hand, 100, 4),
        "deep S=4 K=100": (bt.make_deep_ours, bt.make_deep_hand, 100, 4),
    }
    out: dict[str, tuple[float, float]] = {}
    trace_time(bt.make_flat_ours(10, 1), args)  # warm-up
    trace_time(bt.make_flat_hand(10, 1), args)
    for name, (ours, hand, k, s) in cases.items():
        o = min(trace_time(ours(k, s), args) for _ in range(rounds))
        h = min(trace_time(hand(k, s), args) for _ in range(rounds))
        out[name] = (o, h)
    for k in (10, 100):
        eqns = len(jax.make_jaxpr(keys_chain(k))(*args).jaxpr.eqns)
        best = min(trace_time(keys_chain(k), args) for _ in range(rounds))
        out[f"keys K={k}"] = (best, float(eqns))
    print(json.dumps(out))


if __name__ == "__main__":
    sys.setrecursionlimit(50000)
    threading.stack_size(512 * 1024 * 1024)
    thread = threading.Thread(target=main)
    thread.start()
    thread.join()

"""`scan_in_context` vs a hand-written `jax.lax.scan` returning the same values.

The body is one dense layer (`tanh(h @ w)`, width 256, batch 64, float32) that adds S
scalar summaries and one module output per layer; the hand-written scan returns the
same summaries and activations as stacked ys. For L in {4, 16, 64, 256} layers and
S in {1, 8}, each round measures, for both variants in turn (interleaved):

- trace+lower: `jax.jit(f).lower(...)` of a freshly built function (no cache hit);
- compile: `lowered.compile()`;
- run: one steady-state call of the compiled function (`block_until_ready`).

Figures are the minimum over rounds; ratios are scan_in_context / hand-written from
the same run. A second table compares trace+lower+compile of the per-iteration mode
(`merge_summaries=False`) with the merge mode at L = 256, S = 8. Usage:

    .venv/bin/python benchmarks/bench_scan.py [--quick]
"""

import argparse
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from eqxctx import Context, scan_in_context


WIDTH, BATCH = 256, 64
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+ = ", re.MULTILINE)


def _layer(h: jax.Array, w: jax.Array, s: int) -> tuple[jax.Array, list[jax.Array]]:
    h = jnp.tanh(h @ w)
    mean = jnp.mean(h)
    return h, [mean * (j + 1.0) for j in range(s)]


def make_ours(s: int, merge: bool = False) -> Callable[..., Any]:
    """Build a fresh scan_in_context function (fresh closures: no trace cache)."""

    def body(h: jax.Array, w: jax.Array, ctx: Context) -> Any:
        h, sums = _layer(h, w, s)
        for j, value in enumerate(sums):
            ctx = ctx.add_summary(f"s{j}", value)
        return h, None, ctx.add_module_output("h", h)

    def run(h: jax.Array, ws: jax.Array, key: jax.Array) -> Any:
        context = Context.root(prng_key=key)
        return scan_in_context(
            body, context=context, carry=h, xs=ws, merge_summaries=merge
        )

    return run


def make_hand(s: int) -> Callable[..., Any]:
    """Build a fresh hand-written scan returning the same stacked values."""

    def run(h: jax.Array, ws: jax.Array, key: jax.Array) -> Any:
        del key

        def f(h: jax.Array, w: jax.Array) -> Any:
            h, sums = _layer(h, w, s)
            return h, ({f"s{j}": v for j, v in enumerate(sums)}, h)

        return jax.lax.scan(f, h, ws)

    return run


def measure(
    make: Callable[[], Callable[..., Any]], args: tuple[Any, ...]
) -> dict[str, Any]:
    t0 = time.perf_counter()
    lowered = jax.jit(make()).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    jax.block_until_ready(compiled(*args))  # warm-up
    run = float("inf")
    for _ in range(5):
        t3 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        run = min(run, time.perf_counter() - t3)
    text = compiled.as_text() or ""
    return {
        "lower": t1 - t0,
        "compile": t2 - t1,
        "run": run,
        "hlo": len(_INSTRUCTION.findall(text)),
        "outputs": len(jax.tree_util.tree_leaves(lowered.out_info)),
    }


def _args(n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    key = jax.random.PRNGKey(0)
    h = jax.random.normal(key, (BATCH, WIDTH), jnp.float32)
    ws = jax.random.normal(key, (n, WIDTH, WIDTH), jnp.float32) / WIDTH**0.5
    return h, ws, key


def compare(
    variants: dict[str, Callable[[], Callable[..., Any]]],
    args: tuple[Any, ...],
    rounds: int,
) -> dict[str, dict[str, Any]]:
    best: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):
        for name, make in variants.items():  # interleaved
            m = measure(make, args)
            old = best.setdefault(name, m)
            for k in ("lower", "compile", "run"):
                old[k] = min(old[k], m[k])
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description="scan_in_context vs lax.scan")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    opts = parser.parse_args()
    layers = (4, 16) if opts.quick else (4, 16, 64, 256)
    rounds = 2 if opts.quick else 7
    measure(lambda: make_hand(1), _args(2))  # warm up JAX itself
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, min over {rounds} rounds"
    )
    print(
        "\n|   L |  S | trace+lower | compile |  run  | HLO instr. (ours/hand) "
        "| outputs (ours/hand) |"
    )
    print("|----:|---:|----------:|--------:|------:|:--:|:--:|")
    for n in layers:
        args = _args(n)
        for s in (1, 8):
            best = compare(
                {"ours": lambda s=s: make_ours(s), "hand": lambda s=s: make_hand(s)},
                args,
                rounds,
            )
            o, h = best["ours"], best["hand"]
            print(
                f"| {n:3d} | {s:2d} | {o['lower'] / h['lower']:9.2f}x "
                f"| {o['compile'] / h['compile']:6.2f}x | {o['run'] / h['run']:4.2f}x "
                f"| {o['hlo']}/{h['hlo']} | {o['outputs']}/{h['outputs']} |",
                flush=True,
            )
    n = 64 if opts.quick else 256
    best = compare(
        {"per_iteration": lambda: make_ours(8), "merge": lambda: make_ours(8, True)},
        _args(n),
        rounds,
    )
    p, m = best["per_iteration"], best["merge"]
    total_p = p["lower"] + p["compile"]
    total_m = m["lower"] + m["compile"]
    print(f"\nL={n}, S=8: trace+lower+compile per-iteration {total_p:.3f}s, merge "
          f"{total_m:.3f}s, ratio {total_p / total_m:.2f}x; outputs "
          f"{p['outputs']} vs {m['outputs']}")  # fmt: skip


if __name__ == "__main__":
    main()

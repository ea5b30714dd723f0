"""Gradient summaries (`eqxctx.value_and_grad`) vs hand-written equivalents.

The model is a scanned residual MLP (`h + tanh(h @ w)`, L = 64 layers, width 256,
batch 64, float32, loss `mean(h**2)`).

1. *Probes*: `eqxctx.value_and_grad` with one `ctx.add_gradient_summary` per layer
   (the RMS of the cotangent of the stream entering the layer) vs a hand-written
   `jax.value_and_grad` with respect to the weights and a zero perturbation `[L,
   batch, width]` added to each layer's input, whose gradient's per-layer RMS is taken
   after the backward pass. Both return the loss, the L RMS values and the weights'
   gradient.
2. *No probes*: `eqxctx.value_and_grad` of the same model without probes vs
   `eqx.filter_value_and_grad` of it under `functional`.

Each round builds every variant afresh, measuring trace+lower (`jax.jit(f).lower`
of a freshly built function) and compile, then times steady-state calls of all of
them interleaved (call A, call B, ... repeated). Run times are minima over every
call; trace and compile ratios are medians over rounds of the ratio of the two
variants built side by side (robust on a loaded machine); all ratios are ours /
hand-written, from one run. Usage:

    .venv/bin/python benchmarks/bench_gradients.py [--quick]
"""

import argparse
import re
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import eqxctx
from eqxctx import Context, scan_in_context


LAYERS, WIDTH, BATCH = 64, 256, 64
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+ = ", re.MULTILINE)


def _model(ws: jax.Array, h: jax.Array, ctx: Context, probe: bool) -> Any:
    def body(h: jax.Array, w: jax.Array, ctx: Context) -> Any:
        if probe:
            h, ctx = ctx.add_gradient_summary("stream", h)
        return h + jnp.tanh(h @ w), None, ctx

    h, _, coll = scan_in_context(body, context=ctx, carry=h, xs=ws)
    return jnp.mean(h**2), ctx.merge(coll)


def make_ours(probe: bool = True) -> Callable[..., Any]:
    """A fresh `eqxctx.value_and_grad` step (fresh closures: no trace cache)."""

    def loss(ws: jax.Array, h: jax.Array, ctx: Context) -> Any:
        return _model(ws, h, ctx, probe)

    def run(ws: jax.Array, h: jax.Array) -> Any:
        (value, coll), grads = eqxctx.value_and_grad(loss)(
            ws, h, prng_key=None, is_training=True
        )
        return value, coll, grads

    return run


def make_hand() -> Callable[..., Any]:
    """A fresh hand-written step: zero perturbations, RMS after the backward pass."""

    def loss(ws: jax.Array, perts: jax.Array, h: jax.Array) -> jax.Array:
        def f(h: jax.Array, wp: tuple[jax.Array, jax.Array]) -> Any:
            w, p = wp
            h = h + p
            return h + jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(f, h, (ws, perts))
        return jnp.mean(h**2)

    def run(ws: jax.Array, h: jax.Array) -> Any:
        perts = jnp.zeros((ws.shape[0], *h.shape), h.dtype)
        value, (gw, gp) = jax.value_and_grad(loss, argnums=(0, 1))(ws, perts, h)
        rms = jnp.sqrt(jnp.mean(jnp.square(gp), axis=(1, 2)))
        return value, rms, gw

    return run


def make_filter() -> Callable[..., Any]:
    """A fresh `eqx.filter_value_and_grad` step of the model without probes."""

    def plain(ws: jax.Array, h: jax.Array) -> jax.Array:
        return eqxctx.functional(
            lambda ws, h, ctx: _model(ws, h, ctx, False),
            prng_key=None,
            is_training=True,
            args=(ws, h),
        )[0]

    return eqx.filter_value_and_grad(plain)


def build(make: Callable[[], Callable[..., Any]], args: tuple[Any, ...]) -> Any:
    """Trace+lower and compile a fresh function; return the times and the program."""
    t0 = time.perf_counter()
    fn = make()
    lowered = jax.jit(lambda *a: fn(*a)).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    jax.block_until_ready(compiled(*args))  # warm-up
    text = compiled.as_text() or ""
    return compiled, {
        "lower": t1 - t0,
        "compile": t2 - t1,
        "run": float("inf"),
        "hlo": len(_INSTRUCTION.findall(text)),
        # The instructions without metadata: equal for the same program.
        "program": [
            re.sub(r", (metadata=\{[^}]*\}|stack_frame_id=\d+)", "", line)
            for line in text.splitlines()
            if _INSTRUCTION.match(line)
        ],
        "outputs": len(jax.tree_util.tree_leaves(lowered.out_info)),
    }


def compare(
    variants: dict[str, Callable[[], Callable[..., Any]]],
    args: tuple[Any, ...],
    rounds: int,
    calls: int,
) -> dict[str, dict[str, Any]]:
    """Per round: build every variant, then time `calls` calls of each, interleaved."""
    best: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):
        built = {name: build(make, args) for name, make in variants.items()}
        for _ in range(calls):
            for compiled, m in built.values():
                t = time.perf_counter()
                jax.block_until_ready(compiled(*args))
                m["run"] = min(m["run"], time.perf_counter() - t)
        for name, (_, m) in built.items():
            old = best.setdefault(name, {**m, "rounds": []})
            old["rounds"].append(m)
            for k in ("lower", "compile", "run"):
                old[k] = min(old[k], m[k])
    return best


def median_ratio(
    a: dict[str, Any], b: dict[str, Any], key: Callable[..., float]
) -> float:
    """The median over rounds of `key(a) / key(b)` (a and b built side by side)."""
    ratios = sorted(
        key(x) / key(y) for x, y in zip(a["rounds"], b["rounds"], strict=True)
    )
    return ratios[len(ratios) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description="gradient summaries vs by hand")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    opts = parser.parse_args()
    rounds = 2 if opts.quick else 11
    key = jax.random.PRNGKey(0)
    ws = jax.random.normal(key, (LAYERS, WIDTH, WIDTH), jnp.float32) / WIDTH**0.5
    h = jax.random.normal(jax.random.PRNGKey(1), (BATCH, WIDTH), jnp.float32)
    args = (ws, h)
    # Same values: the per-layer RMS and the weights' gradient.
    (_, coll, g1), (_, rms, g2) = make_ours()(*args), make_hand()(*args)
    got = jnp.array(
        [coll.flatten("summaries")[f"iter{i}/stream"] for i in range(LAYERS)]
    )
    assert jnp.allclose(got, rms, rtol=1e-4), (got, rms)
    assert jnp.allclose(g1, g2, rtol=1e-4, atol=1e-6)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, L={LAYERS}, "
        f"width={WIDTH}, batch={BATCH}, min over {rounds} rounds"
    )
    best = compare(
        {
            "ours": make_ours,
            "hand": make_hand,
            "ours_bare": lambda: make_ours(probe=False),
            "filter": make_filter,
        },
        args,
        rounds,
        calls=5 if opts.quick else 20,
    )
    print(
        "\n| comparison | trace+lower | compile | trace+lower+compile | run "
        "| HLO instr. | same program | outputs |"
    )
    print("|---|--:|--:|--:|--:|:--:|:--:|:--:|")
    total = lambda m: m["lower"] + m["compile"]
    for label, a, b in (
        ("probes: value_and_grad / perturbations", "ours", "hand"),
        ("no probes: value_and_grad / filter_value_and_grad", "ours_bare", "filter"),
    ):
        o, r = best[a], best[b]
        cells = [
            f"{median_ratio(o, r, lambda m, k=k: m[k]):.2f}x"
            for k in ("lower", "compile")
        ]
        cells.append(f"{median_ratio(o, r, total):.2f}x")
        print(
            f"| {label} | {' | '.join(cells)} | {o['run'] / r['run']:.3f}x "
            f"| {o['hlo']}/{r['hlo']} ({o['hlo'] / r['hlo'] - 1:+.1%}) "
            f"| {'yes' if o['program'] == r['program'] else 'no'} "
            f"| {o['outputs']}/{r['outputs']} |"
        )
    for name, m in best.items():
        print(
            f"{name}: lower {m['lower'] * 1e3:.1f} ms, compile "
            f"{m['compile'] * 1e3:.1f} ms, run {m['run'] * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()

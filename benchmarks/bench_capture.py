"""`eqxctx.capture` on an unmodified model vs a hand-written scan returning the same.

The model is a stack of L = 24 pre-norm transformer blocks (`eqx.nn.LayerNorm`,
`eqx.nn.MultiheadAttention`, `eqx.nn.MLP`; width 64, 4 heads, 32 tokens, float32),
stacked by `eqx.filter_vmap` and run by a `jax.lax.scan` the model's own `__call__`
writes: plain Equinox, no eqxctx.

1. *Forward*: `capture` with one tap at the stacked block (its output per layer and
   the RMS of it per layer) vs a hand-written `jax.lax.scan` over the same blocks
   whose body also returns the block's output and its RMS. `capture` takes its ref
   path here (`jax.ref` writes inside the model's scan); the row "sink path" forces
   the sink path (the private switch `eqxctx._capture._refs.USE_REFS`), as
   `capture` recorded before the ref path, and "jax.ref prototype" is the block
   wrapped by hand to write the same values into refs.
2. *Nothing selected*: `capture(..., taps=())` vs the bare model (same program?).
3. *Training step*: `capture_value_and_grad` with the same tap (ref path; "sink
   path" forced as above) vs `eqx.filter_value_and_grad` of the hand-written scan
   returning them as aux.
4. *Training step, nothing selected*: `capture_value_and_grad(..., taps=())` vs
   `eqx.filter_value_and_grad` of the bare model.

Each round builds every variant afresh (trace+lower of a fresh function, compile),
then times steady-state calls of all of them interleaved. Run times are minima over
every call; trace and compile ratios are medians over rounds of the ratio of the two
variants built side by side; HLO instructions are counted in the optimized module,
temp bytes are `compiled.memory_analysis().temp_size_in_bytes`; all ratios are ours /
hand-written, from one run. Usage:

    .venv/bin/python benchmarks/bench_capture.py [--quick]
"""

import argparse
import re
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.ref

import eqxctx


LAYERS, DIM, HEADS, SEQ = 24, 64, 4, 32
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+ = ", re.MULTILINE)


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(DIM), eqx.nn.LayerNorm(DIM)
        self.attn = eqx.nn.MultiheadAttention(HEADS, DIM, key=k1)
        self.mlp = eqx.nn.MLP(DIM, DIM, 4 * DIM, 1, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class Stack(eqx.Module):
    blocks: Block  # stacked [L, ...]

    def __call__(self, x: jax.Array) -> jax.Array:
        params, static = eqx.partition(self.blocks, eqx.is_array)
        body = lambda x, p: (eqx.combine(p, static)(x), None)
        return jax.lax.scan(body, x, params)[0]


def rms(y: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.mean(jnp.square(y)))


def hand_scan(model: Stack, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The scan written by hand to return each layer's output and its RMS."""
    params, static = eqx.partition(model.blocks, eqx.is_array)

    def body(x: jax.Array, p: Block) -> Any:
        y = eqx.combine(p, static)(x)
        return y, (y, rms(y))

    y, (outs, rmss) = jax.lax.scan(body, x, params)
    return y, outs, rmss


class RefTap(eqx.Module):
    """A block that also writes its output and RMS into `jax.ref` buffers."""

    block: Block
    layer: jax.Array  # stacked [L]: the layer index
    refs: tuple[Any, Any] = eqx.field(static=True)  # hidden from the model's scan

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.block(x)
        self.refs[0][self.layer] = y
        self.refs[1][self.layer] = rms(y)
        return y


def ref_scan(model: Stack, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A prototype (not what `capture` does): record through `jax.ref` writes."""
    refs = (
        jax.new_ref(jnp.zeros((LAYERS, SEQ, DIM))),
        jax.new_ref(jnp.zeros((LAYERS,))),
    )
    layer = jnp.arange(LAYERS)
    y = Stack(RefTap(model.blocks, layer, refs))(x)  # pyright: ignore[reportArgumentType]
    return y, jax.ref.freeze(refs[0]), jax.ref.freeze(refs[1])


TAP = eqxctx.Tap("blocks", output=True, summaries={"rms": rms})


def on_sinks(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with capture's sink path forced (the private switch, while tracing)."""

    def run(m: Stack, x: jax.Array) -> Any:
        from eqxctx._capture import _refs

        _refs.USE_REFS = False
        try:
            return fn(m, x)
        finally:
            _refs.USE_REFS = True

    return run


def forward(m: Stack, x: jax.Array) -> jax.Array:
    return m(x)


def loss(m: Stack, x: jax.Array) -> jax.Array:
    return jnp.mean(m(x) ** 2)


def hand_loss(m: Stack, x: jax.Array) -> Any:
    y, outs, rmss = hand_scan(m, x)
    return jnp.mean(y**2), (outs, rmss)


VARIANTS: dict[str, Callable[[], Callable[..., Any]]] = {
    "capture": lambda: lambda m, x: eqxctx.capture(forward, m, x, taps=TAP),
    "hand": lambda: lambda m, x: hand_scan(m, x),
    "sinks": lambda: on_sinks(lambda m, x: eqxctx.capture(forward, m, x, taps=TAP)),
    "ref": lambda: lambda m, x: ref_scan(m, x),
    "capture_none": lambda: lambda m, x: eqxctx.capture(forward, m, x, taps=())[0],
    "bare": lambda: lambda m, x: m(x),
    "step": lambda: lambda m, x: eqxctx.capture_value_and_grad(loss, m, x, taps=TAP),
    "step_sinks": lambda: on_sinks(
        lambda m, x: eqxctx.capture_value_and_grad(loss, m, x, taps=TAP)
    ),
    "hand_step": lambda: (
        lambda m, x: eqx.filter_value_and_grad(hand_loss, has_aux=True)(m, x)
    ),
    "step_none": lambda: (
        lambda m, x: eqxctx.capture_value_and_grad(loss, m, x, taps=())
    ),
    "bare_step": lambda: lambda m, x: eqx.filter_value_and_grad(loss)(m, x),
}


def build(make: Callable[[], Callable[..., Any]], args: tuple[Any, ...]) -> Any:
    """Trace+lower and compile a fresh function; return the times and the program."""
    params, static = eqx.partition(args, eqx.is_array)
    t0 = time.perf_counter()
    fn = make()
    jitted = jax.jit(lambda p: fn(*eqx.combine(p, static)))
    lowered = jitted.lower(params)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    jax.block_until_ready(compiled(params))  # warm-up
    text = compiled.as_text() or ""
    memory = compiled.memory_analysis()
    return (compiled, params), {
        "lower": t1 - t0,
        "compile": t2 - t1,
        "run": float("inf"),
        "hlo": len(_INSTRUCTION.findall(text)),
        "temp": getattr(memory, "temp_size_in_bytes", 0),
        "program": [
            re.sub(r", (metadata=\{[^}]*\}|stack_frame_id=\d+)", "", line)
            for line in text.splitlines()
            if _INSTRUCTION.match(line)
        ],
    }


def compare(
    variants: dict[str, tuple[Callable[[], Callable[..., Any]], Any]],
    rounds: int,
    calls: int,
) -> dict[str, Any]:
    best: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):
        built = {name: build(make, args) for name, (make, args) in variants.items()}
        for _ in range(calls):
            for (compiled, params), m in built.values():
                t = time.perf_counter()
                jax.block_until_ready(compiled(params))
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
    ratios = sorted(
        key(x) / key(y) for x, y in zip(a["rounds"], b["rounds"], strict=True)
    )
    return ratios[len(ratios) // 2]


def check(model: Stack, x: jax.Array) -> None:
    """The variants compute the same values."""
    y2, outs, rmss = hand_scan(model, x)
    for variant in ("capture", "sinks"):
        y, coll = VARIANTS[variant]()(model, x)
        assert jnp.allclose(y, y2, rtol=1e-5, atol=1e-5)
        got = coll.flatten("module_outputs")["blocks/layer/output"]
        assert jnp.allclose(got, outs, rtol=1e-5, atol=1e-5)
        sums = coll.flatten("summaries")
        got_rms = jnp.stack([sums[f"blocks/layer{i}/rms"] for i in range(LAYERS)])
        assert jnp.allclose(got_rms, rmss, rtol=1e-5)
    for a, b in zip(ref_scan(model, x), (y2, outs, rmss), strict=True):
        assert jnp.allclose(a, b, rtol=1e-5, atol=1e-5)
    (v2, _), g2 = VARIANTS["hand_step"]()(model, x)
    for variant in ("step", "step_sinks"):
        (v, coll), g = VARIANTS[variant]()(model, x)
        assert jnp.allclose(v, v2, rtol=1e-5)
        assert eqx.tree_equal(g, g2, rtol=1e-4, atol=1e-6)
        got = coll.flatten("module_outputs")["blocks/layer/output"]
        assert jnp.allclose(got, outs, rtol=1e-5, atol=1e-5)


def main() -> None:
    parser = argparse.ArgumentParser(description="capture vs a hand-written scan")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    opts = parser.parse_args()
    rounds = 2 if opts.quick else 5
    keys = jax.random.split(jax.random.key(0), LAYERS)
    model = Stack(eqx.filter_vmap(Block)(keys))
    x = jax.random.normal(jax.random.key(1), (SEQ, DIM), jnp.float32)
    check(model, x)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, L={LAYERS}, dim={DIM}, "
        f"heads={HEADS}, seq={SEQ}, min over {rounds} rounds"
    )
    variants = {name: (make, (model, x)) for name, make in VARIANTS.items()}
    best = compare(variants, rounds, calls=5 if opts.quick else 10)
    print(
        "\n| comparison | trace+lower | compile | run | HLO instr. | temp bytes "
        "| same program |"
    )
    print("|---|--:|--:|--:|--:|--:|:--:|")
    for label, a, b in (
        ("forward: capture / hand-written scan", "capture", "hand"),
        ("forward, sink path: capture / hand-written scan", "sinks", "hand"),
        ("forward: jax.ref prototype / hand-written scan", "ref", "hand"),
        ("nothing selected: capture / bare model", "capture_none", "bare"),
        ("training step: capture_value_and_grad / by hand", "step", "hand_step"),
        (
            "step, sink path: capture_value_and_grad / by hand",
            "step_sinks",
            "hand_step",
        ),
        (
            "step, nothing selected: ... / filter_value_and_grad",
            "step_none",
            "bare_step",
        ),
    ):
        ma, mb = best[a], best[b]
        lower = median_ratio(ma, mb, lambda m: m["lower"])
        comp = median_ratio(ma, mb, lambda m: m["compile"])
        same = "yes" if ma["program"] == mb["program"] else "no"
        temp = f"{ma['temp']}/{mb['temp']} ({ma['temp'] / max(mb['temp'], 1):.3f}x)"
        print(
            f"| {label} | {lower:.2f}x | {comp:.2f}x | {ma['run'] / mb['run']:.3f}x "
            f"| {ma['hlo']}/{mb['hlo']} ({ma['hlo'] / mb['hlo']:.3f}x) | {temp} "
            f"| {same} |"
        )


if __name__ == "__main__":
    main()

"""bench_capture.py's model and signals in Flax NNX: `nnx.capture` by `eqxctx.capture`.

The same stack as bench_capture.py (L = 24 pre-norm transformer blocks: LayerNorm,
4-head attention, MLP 64 -> 256 -> 64 with ReLU; width 64, 32 tokens, float32; no
attention biases, LayerNorm epsilon 1e-5, as Equinox's defaults) written in Flax NNX
the way its docs stack layers: `nnx.vmap` creates the stacked blocks, `nnx.scan`
runs them. The signals: each layer's full output and its RMS.

1. *NNX, sow*: NNX's documented way, the block edited to `self.sow` both values
   (a subclass of the plain block), run under `nnx.capture(..., nnx.Intermediate)`,
   vs a hand-written `nnx.scan` over the plain blocks returning both per layer.
2. *NNX, method_outputs*: the unmodified model under `nnx.capture(...,
   method_outputs=nnx.Intermediate)`, which records every method output of every
   submodule; the block outputs are kept and their RMS taken after the scan (XLA
   drops the rest), vs the same hand-written `nnx.scan`.
3. *eqxctx*: bench_capture.py's `capture` with its tap (ref path) vs its hand-written
   `jax.lax.scan`, built and timed in the same run, interleaved with the above.
4. *Nothing selected*: `nnx.capture(fn)` (no variable types) on the unmodified model vs
   the bare model; `eqxctx.capture(..., taps=())` vs the bare Equinox model.

NNX functions are jitted the functional way: `jax.jit` of `nnx.merge(graphdef, state)`
then the call, so both libraries go through the same `jax.jit(...).lower().compile()`
(bench_capture's `build`: trace+lower of a fresh function, compile, warm-up). Run
times are minima over interleaved calls; trace and compile ratios are medians over
rounds of the two variants built side by side; HLO instructions are counted in the
optimized module; temp bytes are `memory_analysis().temp_size_in_bytes`. Needs Flax
(`make .venv-bench`):

    .venv-bench/bin/python benchmarks/bench_capture_nnx.py [--quick | --rounds N]
"""

# Flax is only in .venv-bench; CI's pyright runs on .venv (pyproject's `venv`), where
# these rules would flag Flax's names (Unknown there). With Flax on pyright's path
# (e.g. `extraPaths` to .venv-bench's site-packages) the file checks clean, strict.
# pyright: reportMissingImports=false, reportUntypedBaseClass=false
# pyright: reportUntypedFunctionDecorator=false

import argparse
from collections.abc import Callable
from typing import Any

import bench_capture as bc
import equinox as eqx
import flax
import jax
import jax.numpy as jnp
from flax import nnx

import eqxctx


LAYERS, DIM, HEADS, SEQ = bc.LAYERS, bc.DIM, bc.HEADS, bc.SEQ
rms = bc.rms


class Block(nnx.Module):
    """bench_capture's `Block` in NNX: pre-norm attention and MLP, residuals."""

    def __init__(self, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(DIM, epsilon=1e-5, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            HEADS, DIM, use_bias=False, decode=False, keep_rngs=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(DIM, epsilon=1e-5, rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.norm1(x)
        x = x + self.attn(h)
        return x + self.down(jax.nn.relu(self.up(self.norm2(x))))


class SowBlock(Block):
    """The block edited as NNX's docs show: it sows its output and the RMS of it."""

    def __call__(self, x: jax.Array) -> jax.Array:
        y = super().__call__(x)
        self.sow(nnx.Intermediate, "output", y)
        self.sow(nnx.Intermediate, "rms", rms(y))
        return y


class Stack(nnx.Module):
    """L blocks created by `nnx.vmap` (stacked [L, ...]), run by `nnx.scan`."""

    def __init__(self, block: type[Block], rngs: nnx.Rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=0, out_axes=0)
        def create(rngs: nnx.Rngs) -> Block:
            return block(rngs)

        self.blocks = create(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        return body(x, self.blocks)


def hand_scan(model: Stack, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The `nnx.scan` written by hand to return each layer's output and its RMS."""

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def body(x: jax.Array, block: Block) -> tuple[jax.Array, Any]:
        y = block(x)
        return y, (y, rms(y))

    y, (outs, rmss) = body(x, model.blocks)
    return y, outs, rmss


def forward(model: Stack, x: jax.Array) -> jax.Array:
    return model(x)


def sown(model: Stack, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`nnx.capture` of the sowing model: the stacked outputs and RMS per layer."""
    y, state = nnx.capture(forward, nnx.Intermediate)(model, x)
    got = nnx.to_pure_dict(state)["blocks"]  # each value: a tuple, one per call
    (outs,), (rmss,) = got["output"], got["rms"]
    return y, outs, rmss


def method_outputs(
    model: Stack, x: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`nnx.capture` with `method_outputs` of the unmodified model; RMS afterwards."""
    y, state = nnx.capture(forward, nnx.Intermediate, method_outputs=nnx.Intermediate)(
        model, x
    )
    (outs,) = nnx.to_pure_dict(state)["blocks"]["__call__"]
    return y, outs, jax.vmap(rms)(outs)


def functional(
    fn: Callable[[Stack, jax.Array], Any], graphdef: Any
) -> Callable[[], Callable[..., Any]]:
    """A maker of `fn` on `(state, x)`: the module merged from its state inside."""
    return lambda: lambda state, x: fn(nnx.merge(graphdef, state), x)


def eqx_variants() -> dict[str, tuple[Callable[[], Callable[..., Any]], Any]]:
    keys = jax.random.split(jax.random.key(0), LAYERS)
    model = bc.Stack(eqx.filter_vmap(bc.Block)(keys))
    x = jax.random.normal(jax.random.key(1), (SEQ, DIM), jnp.float32)
    args = (model, x)
    return {
        "eqx_capture": (bc.VARIANTS["capture"], args),
        "eqx_hand": (bc.VARIANTS["hand"], args),
        "eqx_none": (bc.VARIANTS["capture_none"], args),
        "eqx_bare": (bc.VARIANTS["bare"], args),
    }


def nnx_variants() -> dict[str, tuple[Callable[[], Callable[..., Any]], Any]]:
    plain = Stack(Block, nnx.Rngs(0))
    sowing = Stack(SowBlock, nnx.Rngs(0))  # the same parameters
    x = jax.random.normal(jax.random.key(1), (SEQ, DIM), jnp.float32)
    graphdef, state = nnx.split(plain)
    sow_graphdef, sow_state = nnx.split(sowing)
    none = lambda m, x: nnx.capture(forward)(m, x)
    return {
        "nnx_sow": (functional(sown, sow_graphdef), (sow_state, x)),
        "nnx_methods": (functional(method_outputs, graphdef), (state, x)),
        "nnx_hand": (functional(hand_scan, graphdef), (state, x)),
        "nnx_none": (functional(none, graphdef), (state, x)),
        "nnx_bare": (functional(forward, graphdef), (state, x)),
    }


def check(variants: dict[str, tuple[Callable[[], Callable[..., Any]], Any]]) -> None:
    """Each capture equals its library's hand-written scan (jitted, like the runs)."""
    run = lambda name: eqx.filter_jit(variants[name][0]())(*variants[name][1])
    want = run("nnx_hand")
    for name in ("nnx_sow", "nnx_methods"):
        got = run(name)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape, (name, a.shape, b.shape)
            assert jnp.allclose(a, b, rtol=1e-5, atol=1e-5), name
    for name in ("nnx_none", "nnx_bare"):
        assert jnp.allclose(run(name), want[0], rtol=1e-5, atol=1e-5), name
    y, outs, rmss = run("eqx_hand")
    y2, coll = run("eqx_capture")
    assert jnp.allclose(y2, y, rtol=1e-5, atol=1e-5)
    got = coll.flatten("module_outputs")["blocks/layer/output"]
    assert jnp.allclose(got, outs, rtol=1e-5, atol=1e-5)
    sums = coll.flatten("summaries")
    got_rms = jnp.stack([sums[f"blocks/layer{i}/rms"] for i in range(LAYERS)])
    assert jnp.allclose(got_rms, rmss, rtol=1e-5)


def main() -> None:
    parser = argparse.ArgumentParser(description="nnx.capture beside eqxctx.capture")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--rounds", type=int, help="rounds (default 5, --quick 2)")
    opts = parser.parse_args()
    rounds = opts.rounds or (2 if opts.quick else 5)
    variants = {**eqx_variants(), **nnx_variants()}
    check(variants)
    print(
        f"jax {jax.__version__}, flax {flax.__version__}, eqxctx "
        f"{getattr(eqxctx, '__version__', '?')}, {jax.devices()[0].platform}, "
        f"L={LAYERS}, dim={DIM}, heads={HEADS}, seq={SEQ}, {rounds} rounds"
    )
    best = bc.compare(variants, rounds, calls=5 if opts.quick else 10)
    print(
        "\n| comparison | trace+lower | compile | run | HLO instr. | temp bytes "
        "| same program |"
    )
    print("|---|--:|--:|--:|--:|--:|:--:|")
    for label, a, b in (
        ("eqxctx: capture / hand-written jax.lax.scan", "eqx_capture", "eqx_hand"),
        (
            "NNX: nnx.capture, sow in block / hand-written nnx.scan",
            "nnx_sow",
            "nnx_hand",
        ),
        (
            "NNX: nnx.capture, method_outputs / hand-written nnx.scan",
            "nnx_methods",
            "nnx_hand",
        ),
        ("eqxctx, nothing selected: capture / bare model", "eqx_none", "eqx_bare"),
        ("NNX, nothing selected: nnx.capture / bare model", "nnx_none", "nnx_bare"),
        ("baselines: hand-written nnx.scan / jax.lax.scan", "nnx_hand", "eqx_hand"),
    ):
        ma, mb = best[a], best[b]
        lower = bc.median_ratio(ma, mb, lambda m: m["lower"])
        comp = bc.median_ratio(ma, mb, lambda m: m["compile"])
        same = "yes" if ma["program"] == mb["program"] else "no"
        temp = f"{ma['temp']}/{mb['temp']} ({ma['temp'] / max(mb['temp'], 1):.3f}x)"
        print(
            f"| {label} | {lower:.2f}x | {comp:.2f}x | {ma['run'] / mb['run']:.3f}x "
            f"| {ma['hlo']}/{mb['hlo']} ({ma['hlo'] / mb['hlo']:.3f}x) | {temp} "
            f"| {same} |"
        )


if __name__ == "__main__":
    main()

"""`cond_in_context` vs a hand-written `jax.lax.cond` returning the same values.

Each branch is one dense layer (`tanh(h @ w)` or `relu(h @ w)`, width 256, batch 64,
float32) that adds S summaries (`WeightedSummary`s of the mean, the same names in both
branches); the hand-written `jax.lax.cond` returns the same summary values. A second
variant ("fill") adds the summaries in one branch only, so the other fills identities.
For S in {1, 8} it measures, interleaved, the optimized HLO instruction count and one
steady-state run time per call (the minimum over 15 interleaved rounds of 200 calls
each, every variant compiled once), and checks that `fori_in_context` with static
bounds lowers to the same program as the equivalent `scan_in_context`. Usage:

    .venv/bin/python benchmarks/bench_control.py [--quick]
"""

import argparse
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from eqxctx import (
    Context,
    WeightedSummary,
    cond_in_context,
    fori_in_context,
    scan_in_context,
)


WIDTH, BATCH = 256, 64
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+ = ", re.MULTILINE)


def _sums(h: jax.Array, s: int) -> list[jax.Array]:
    mean = jnp.mean(h)
    return [mean * (j + 1.0) for j in range(s)]


def make_ours(s: int, fill: bool = False) -> Callable[..., Any]:
    def branch(act: Callable[[jax.Array], jax.Array], adds: bool) -> Any:
        def fn(h: jax.Array, w: jax.Array, ctx: Context) -> Any:
            h = act(h @ w)
            if adds:
                for j, v in enumerate(_sums(h, s)):
                    ctx = ctx.add_summary(f"s{j}", WeightedSummary(v, 1.0))
            return h, ctx

        return fn

    def run(p: jax.Array, h: jax.Array, w: jax.Array) -> Any:
        return cond_in_context(
            p,
            branch(jnp.tanh, True),
            branch(jax.nn.relu, not fill),
            h,
            w,
            context=Context.root(),
        )

    return run


def make_hand(s: int, fill: bool = False) -> Callable[..., Any]:
    def branch(act: Callable[[jax.Array], jax.Array], adds: bool) -> Any:
        def fn(h: jax.Array, w: jax.Array) -> Any:
            h = act(h @ w)
            sums = _sums(h, s) if adds else [jnp.zeros(())] * s
            weight = jnp.ones(()) if adds else jnp.zeros(())
            return h, {f"s{j}": WeightedSummary(v, weight) for j, v in enumerate(sums)}

        return fn

    def run(p: jax.Array, h: jax.Array, w: jax.Array) -> Any:
        return jax.lax.cond(
            p, branch(jnp.tanh, True), branch(jax.nn.relu, not fill), h, w
        )

    return run


def flat(make: Callable[[], Callable[..., Any]]) -> Callable[[], Callable[..., Any]]:
    """The same function returning a flat list of leaves (no output PyTree to build)."""

    def made() -> Callable[..., Any]:
        fn = make()
        return lambda *args: jax.tree_util.tree_leaves(fn(*args))

    return made


def _program(text: str) -> list[str]:
    """The instructions of an optimized HLO module, without names and metadata."""
    lines = [ln for ln in text.splitlines() if _INSTRUCTION.match(ln)]
    return [re.sub(r", metadata=\{.*\}", "", ln) for ln in lines]


CALLS = 200  # calls per timed round: single ~100 µs calls are too noisy to compare


def compile_variant(
    make: Callable[[], Callable[..., Any]], args: tuple[Any, ...]
) -> tuple[Callable[..., Any], int]:
    """The compiled function (warmed up) and its optimized HLO instruction count."""
    compiled = jax.jit(make()).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    return compiled, len(_INSTRUCTION.findall(compiled.as_text() or ""))


def time_calls(compiled: Callable[..., Any], args: tuple[Any, ...]) -> float:
    """Seconds per call, averaged over `CALLS` blocking calls."""
    t = time.perf_counter()
    for _ in range(CALLS):
        jax.block_until_ready(compiled(*args))
    return (time.perf_counter() - t) / CALLS


def fori_same_program() -> bool:
    def body(i: jax.Array, h: jax.Array, ctx: Context) -> Any:
        h = jnp.tanh(h + i.astype(h.dtype))
        return h, ctx.add_summary("m", jnp.mean(h)).add_module_output("h", h)

    def scan_body(h: jax.Array, i: jax.Array, ctx: Context) -> Any:
        h, ctx = body(i, h, ctx)
        return h, None, ctx

    def fori(h: jax.Array) -> Any:
        return fori_in_context(0, 8, body, h, context=Context.root())

    def scan(h: jax.Array) -> Any:
        c, _, coll = scan_in_context(
            scan_body, context=Context.root(), carry=h, xs=jnp.arange(8)
        )
        return c, coll

    h = jnp.zeros((BATCH, WIDTH))
    a = jax.jit(fori).lower(h).compile().as_text()
    b = jax.jit(scan).lower(h).compile().as_text()
    return _program(a or "") == _program(b or "")


def main() -> None:
    parser = argparse.ArgumentParser(description="cond_in_context vs lax.cond")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    opts = parser.parse_args()
    rounds = 2 if opts.quick else 15
    key = jax.random.PRNGKey(0)
    h = jax.random.normal(key, (BATCH, WIDTH), jnp.float32)
    w = jax.random.normal(key, (WIDTH, WIDTH), jnp.float32) / WIDTH**0.5
    args = (jnp.array(True), h, w)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, min over {rounds}")
    print(
        "\n| S | branches | run, PyTree outputs (ours/hand) | run, flat leaves "
        "(ours/hand) | HLO instructions (ours/hand) |"
    )
    print("|--:|:--|--:|--:|:--:|")
    variants = {
        "ours": make_ours,
        "hand": make_hand,
        "ours_flat": lambda s, fill: flat(lambda: make_ours(s, fill))(),
        "hand_flat": lambda s, fill: flat(lambda: make_hand(s, fill))(),
    }
    for s in (1, 8):
        for fill in (False, True):
            best = dict.fromkeys(variants, float("inf"))
            hlo: dict[str, int] = {}
            compiled: dict[str, Callable[..., Any]] = {}
            for name, make in variants.items():
                compiled[name], hlo[name] = compile_variant(
                    lambda m=make, s=s, f=fill: m(s, f), args
                )
            for _ in range(rounds):
                for name in variants:  # interleaved rounds of `CALLS` calls each
                    best[name] = min(best[name], time_calls(compiled[name], args))
            what = "one adds" if fill else "both add"
            print(
                f"| {s} | {what} | {best['ours'] / best['hand']:.2f}x "
                f"| {best['ours_flat'] / best['hand_flat']:.2f}x "
                f"| {hlo['ours']}/{hlo['hand']} |",
                flush=True,
            )
    print(f"\nfori_in_context(0, 8) == scan_in_context program: {fori_same_program()}")


if __name__ == "__main__":
    main()

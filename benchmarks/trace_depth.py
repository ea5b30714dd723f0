"""Trace time of `bench_trace.py`'s deep chains at small depths, with page faults.

A diagnostic for part 1's deep rows: for each depth K, the minimum over rounds of
`jax.jit(f).trace(x, key)` for ours, hand and scoped (`bench_trace`'s deep variants,
S summaries per child, each variant first in turn, the collector off during each
trace), ours/hand, our excess per level, and the minor page faults of each variant's
last trace (`resource.getrusage`). `--body` traces a function that runs the chain and
returns only `x` (no output paths to spell). Usage:

    .venv/bin/python benchmarks/trace_depth.py [--s 1] [--ks 10 20 30 40 60 100]
        [--rounds 7] [--body]

On CPython 3.11 to 3.13.x before the fix of python/cpython#142183, a thread's frames
live in 16 KiB chunks, and a chunk is unmapped as soon as the frame at its start
returns: a call depth that keeps crossing a chunk's start maps, faults in and unmaps
a chunk each time. The page faults show where a chain's calls reach that depth.
"""

import argparse
import gc
import resource
import sys
import threading
import time
from typing import Any

import bench_trace
import jax
import jax.numpy as jnp


VARIANTS = ("ours", "hand", "scoped")


def _make(variant: str, k: int, s: int, body: bool) -> bench_trace.Fn:
    ours, hand = bench_trace.SHAPES["deep"]
    make = {"ours": ours, "hand": hand, "scoped": bench_trace.SCOPED["deep"]}[variant]
    fn = make(k, s)
    if not body:
        return fn

    def run(x: jax.Array, key: jax.Array) -> Any:
        fn(x, key)
        return x

    return run


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(
        description="deep-chain trace time and page faults"
    )
    parser.add_argument("--s", type=int, default=1, help="summaries per child")
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 20, 30, 40, 60, 100])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--body", action="store_true", help="return x only")
    opts = parser.parse_args()
    args = (
        jnp.linspace(-1.0, 1.0, bench_trace.WIDTH, dtype=jnp.float32),
        jax.random.PRNGKey(0),
    )
    for variant in VARIANTS:  # warm up JAX's caches
        jax.jit(_make(variant, 10, opts.s, opts.body)).trace(*args)
    print(
        f"jax {jax.__version__}, Python {sys.version.split()[0]}, deep, S = {opts.s}"
        + (", body only" if opts.body else "")
    )
    print(
        "\n| K | ours ms | hand ms | scoped ms | ours/hand | excess per level µs "
        "| page faults (ours / hand / scoped) |"
    )
    print("|--:|--:|--:|--:|--:|--:|--:|")
    for k in opts.ks:
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        faults: dict[str, int] = {}
        for r in range(opts.rounds):
            for variant in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
                fn = _make(variant, k, opts.s, opts.body)
                gc.collect()
                gc.disable()
                before, start = _faults(), time.perf_counter()
                jax.jit(fn).trace(*args)
                times[variant].append(time.perf_counter() - start)
                faults[variant] = _faults() - before
                gc.enable()
        best = {v: min(t) for v, t in times.items()}
        print(
            f"| {k} | {best['ours'] * 1e3:.1f} | {best['hand'] * 1e3:.1f} "
            f"| {best['scoped'] * 1e3:.1f} | {best['ours'] / best['hand']:.2f}x "
            f"| {(best['ours'] - best['hand']) / k * 1e6:.0f} "
            f"| {faults['ours']} / {faults['hand']} / {faults['scoped']} |",
            flush=True,
        )


if __name__ == "__main__":
    sys.setrecursionlimit(100_000)
    threading.stack_size(512 * 1024 * 1024)  # as bench_trace: deep chains
    thread = threading.Thread(target=main)
    thread.start()
    thread.join()

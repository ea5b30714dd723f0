"""Trace time of `bench_trace.py`'s deep chains at small depths, with page faults.

A diagnostic for part 1's deep rows: for each depth K, the minimum over rounds of
`jax.jit(f).trace(x, key)` for ours, hand and scoped (`bench_trace`'s deep variants,
S summaries per child, each variant first in turn, the collector off during each
trace), ours/hand, our excess per level, and the minor page faults of each variant's
last trace (`resource.getrusage`). `--body` traces a function that runs the chain and
returns only `x` (no output paths to spell). `--keys` traces instead a chain whose
every level draws noise from its key (ours: `ctx.prng_key`; hand: the parent's key
`fold_in` the level's seed, passed down; scoped: hand in `jax.named_scope`s) and also
counts each jaxpr's equations. Usage:

    .venv/bin/python benchmarks/trace_depth.py [--s 1] [--ks 10 20 30 40 60 100]
        [--rounds 7] [--body | --keys] [--phases | --paths] [--chunk-cache]

On CPython 3.11 to 3.13.x before the fix of python/cpython#142183, a thread's frames
live in 16 KiB chunks, and a chunk is unmapped as soon as the frame at its start
returns: a call depth that keeps crossing a chunk's start maps, faults in and unmaps
a chunk each time. The page faults show where a chain's calls reach that depth.
`--chunk-cache` keeps one freed chunk, as the fix does (`chunk_cache.py`).
`--phases` adds a table that splits each trace where the traced function returns:
the body (our code and JAX's tracing of each operation) and after it (JAX's handling
of the output: flattening it, spelling its result paths, building the jaxpr).
`--paths` times instead only the spelling of the output's leaf paths
(`jax.tree_util.keystr` of every path of `tree_flatten_with_path`, as JAX does twice
at the end of each trace), outside any trace, for the three variants' outputs (the
same nested names) and for ours' paths rebuilt from fresh copies of their key strings
(the same characters in newly allocated objects).
"""

import argparse
import gc
import resource
import sys
import threading
import time
from typing import Any

import bench_trace
import chunk_cache
import jax
import jax.numpy as jnp

from eqxctx import Context, functional
from eqxctx._frame import child_seed


VARIANTS = ("ours", "hand", "scoped")


def _keys_ours(k: int) -> bench_trace.Fn:
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


def _keys_hand(k: int, scoped: bool) -> bench_trace.Fn:
    def node(x: jax.Array, key: jax.Array, i: int) -> jax.Array:
        key = jax.random.fold_in(key, child_seed(f"c{i}"))
        x = x + jax.random.normal(key, x.shape)
        if i + 1 < k:
            if scoped:
                with jax.named_scope(f"c{i + 1}"):
                    return node(x, key, i + 1)
            return node(x, key, i + 1)
        return x

    def run(x: jax.Array, key: jax.Array) -> Any:
        if scoped:
            with jax.named_scope("c0"):
                return node(x, key, 0)
        return node(x, key, 0)

    return run


def _make(
    variant: str, k: int, s: int, body: bool, keys: bool = False
) -> bench_trace.Fn:
    if keys:
        return (
            _keys_ours(k) if variant == "ours" else _keys_hand(k, variant == "scoped")
        )
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
    parser.add_argument("--keys", action="store_true", help="every level reads its key")
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also split each trace where the traced function returns",
    )
    parser.add_argument(
        "--paths",
        action="store_true",
        help="time only the spelling of the output's leaf paths",
    )
    parser.add_argument(
        "--chunk-cache",
        action="store_true",
        help="keep one freed frame chunk, as CPython's fix of #142183 does",
    )
    opts = parser.parse_args()
    if opts.chunk_cache:
        chunk_cache.install()
    if opts.body and opts.keys:
        parser.error("--body and --keys are exclusive")
    args = (
        jnp.linspace(-1.0, 1.0, bench_trace.WIDTH, dtype=jnp.float32),
        jax.random.PRNGKey(0),
    )
    if opts.paths:
        _paths(opts.ks, opts.s, opts.rounds, args)
        return
    for variant in VARIANTS:  # warm up JAX's caches
        jax.jit(_make(variant, 10, opts.s, opts.body, opts.keys)).trace(*args)
    print(
        f"jax {jax.__version__}, Python {sys.version.split()[0]}, deep, S = {opts.s}"
        + (", body only" if opts.body else "")
        + (", every level reads its key" if opts.keys else "")
        + (", one frame chunk kept (chunk_cache.py)" if opts.chunk_cache else "")
    )
    print(
        "\n| K | ours ms | hand ms | scoped ms | ours/hand | excess per level µs "
        "| page faults (ours / hand / scoped) | jaxpr equations (ours / hand) |"
    )
    print("|--:|--:|--:|--:|--:|--:|--:|--:|")
    phases: list[tuple[int, dict[str, list[float]], dict[str, list[float]]]] = []
    for k in opts.ks:
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        bodies: dict[str, list[float]] = {v: [] for v in VARIANTS}
        faults: dict[str, int] = {}
        for r in range(opts.rounds):
            for variant in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
                fn, returned = _marked(_make(variant, k, opts.s, opts.body, opts.keys))
                gc.collect()
                gc.disable()
                before, start = _faults(), time.perf_counter()
                jax.jit(fn).trace(*args)
                times[variant].append(time.perf_counter() - start)
                bodies[variant].append(returned[0] - start)
                faults[variant] = _faults() - before
                gc.enable()
        best = {v: min(t) for v, t in times.items()}
        if opts.phases:
            phases.append((k, bodies, times))
        eqns = [
            len(jax.make_jaxpr(_make(v, k, opts.s, opts.body, opts.keys))(*args).eqns)
            for v in ("ours", "hand")
        ]
        print(
            f"| {k} | {best['ours'] * 1e3:.1f} | {best['hand'] * 1e3:.1f} "
            f"| {best['scoped'] * 1e3:.1f} | {best['ours'] / best['hand']:.2f}x "
            f"| {(best['ours'] - best['hand']) / k * 1e6:.0f} "
            f"| {faults['ours']} / {faults['hand']} / {faults['scoped']} "
            f"| {eqns[0]} / {eqns[1]} |",
            flush=True,
        )
    if phases:
        _print_phases(phases)


def _paths(ks: list[int], s: int, rounds: int, args: tuple[Any, ...]) -> None:
    # JAX spells each output leaf's path at the end of a trace (`keystr`; O(depth)
    # characters per leaf, so O(K^2) in a deep chain). The same names in the three
    # variants: what differs is where their objects lie in memory.
    print(f"jax {jax.__version__}, Python {sys.version.split()[0]}, deep, S = {s}")
    print(
        "\n| K | spelling ms (ours / hand / scoped / ours, keys copied) "
        "| ours/hand | keys copied/hand | characters (ours / hand) |"
    )
    print("|--:|--:|--:|--:|--:|")
    names = (*VARIANTS, "copied")
    for k in ks:
        paths: dict[str, list[Any]] = {}
        for variant in VARIANTS:
            out = jax.eval_shape(_make(variant, k, s, body=False), *args)
            leaves = jax.tree_util.tree_flatten_with_path(out)[0]
            paths[variant] = [path for path, _ in leaves]
        paths["copied"] = [tuple(map(_copied, p)) for p in paths["ours"]]
        times: dict[str, list[float]] = {v: [] for v in names}
        chars = {v: sum(len(jax.tree_util.keystr(p)) for p in paths[v]) for v in names}
        for r in range(rounds):
            for variant in names[r % 4 :] + names[: r % 4]:
                gc.collect()
                gc.disable()
                start = time.perf_counter()
                for p in paths[variant]:
                    jax.tree_util.keystr(p)
                times[variant].append(time.perf_counter() - start)
                gc.enable()
        best = {v: min(t) for v, t in times.items()}
        print(
            f"| {k} | {' / '.join(f'{best[v] * 1e3:.1f}' for v in names)} "
            f"| {best['ours'] / best['hand']:.3f}x "
            f"| {best['copied'] / best['hand']:.3f}x "
            f"| {chars['ours']} / {chars['hand']} |",
            flush=True,
        )


def _copied(entry: Any) -> Any:
    """A `DictKey` rebuilt from a new copy of its string; other entries as they are.

    (A one-character string stays CPython's shared object.)
    """
    if isinstance(entry, jax.tree_util.DictKey) and isinstance(entry.key, str):
        return jax.tree_util.DictKey("".join(list(entry.key)))
    return entry


def _marked(fn: bench_trace.Fn) -> tuple[bench_trace.Fn, list[float]]:
    """`fn`, noting the time when it returns (before JAX handles its output)."""
    returned = [0.0]

    def run(x: jax.Array, key: jax.Array) -> Any:
        out = fn(x, key)
        returned[0] = time.perf_counter()
        return out

    return run, returned


def _print_phases(
    phases: list[tuple[int, dict[str, list[float]], dict[str, list[float]]]],
) -> None:
    # The body: from the call of `trace` until the traced function returns (our code
    # and JAX's tracing of each operation); after: JAX's handling of the output
    # (flattening it, spelling its result paths, building the jaxpr). Minima over
    # the rounds of each part separately.
    print(
        "\n| K | body ms (ours / hand / scoped) | its excess per level µs (over hand "
        "/ scoped) | after ms (ours / hand / scoped) | its excess ms (over hand / "
        "scoped) |"
    )
    print("|--:|--:|--:|--:|--:|")
    for k, bodies, times in phases:
        body = {v: min(b) for v, b in bodies.items()}
        after = {
            v: min(t - b for t, b in zip(times[v], bodies[v], strict=True))
            for v in times
        }
        print(
            f"| {k} | {' / '.join(f'{body[v] * 1e3:.1f}' for v in VARIANTS)} "
            f"| {(body['ours'] - body['hand']) / k * 1e6:.0f} / "
            f"{(body['ours'] - body['scoped']) / k * 1e6:.0f} "
            f"| {' / '.join(f'{after[v] * 1e3:.1f}' for v in VARIANTS)} "
            f"| {(after['ours'] - after['hand']) * 1e3:.1f} / "
            f"{(after['ours'] - after['scoped']) * 1e3:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    sys.setrecursionlimit(100_000)
    threading.stack_size(512 * 1024 * 1024)  # as bench_trace: deep chains
    thread = threading.Thread(target=main)
    thread.start()
    thread.join()

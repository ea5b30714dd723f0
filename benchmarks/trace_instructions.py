"""Instructions of one trace of `bench_trace.py`'s part 1 under callgrind (exact).

The part-1 rows of `bench_trace.py` time traces of 2 ms to several seconds on a shared
machine, where single rows move by tens of percent between runs; instruction counts
do not. One run counts one `jax.jit(fn).trace(x, key)` of a freshly built function
(`bench_trace`'s `make_{flat,deep}_{ours,hand}`; variant `scoped`: the hand-written
function with a `jax.named_scope` per child, `bench_trace.SCOPED`), with Python's
garbage collector on as in the benchmark (its collections are part of the count),
after a warm-up trace of the same shape at K = 10 and `gc.collect()`. The trace runs
inside `divmod`, and callgrind collects only there. Usage (one variant per run):

    PYTHONPATH=src valgrind --tool=callgrind --collect-atstart=no \\
        --toggle-collect=builtin_divmod --callgrind-out-file=/tmp/cg.trace \\
        .venv/bin/python benchmarks/trace_instructions.py deep ours 4 1000

then read the "Collected" count. `trace_instructions.py calls - S K` counts instead K
`ctx.call` children with S summaries and a module output each and no JAX operation
(eqxctx's own work per child: divide by K). The script also prints the garbage
collections by generation during the trace (to stderr). With `TRACE_GC=off` in the
environment the collector is disabled for the counted trace.

    .venv/bin/python benchmarks/trace_instructions.py table [--jobs 2]
        [--ks 100 1000 2000] [--shapes flat deep] [--s 1 4] [--gc off] [--out DIR]

runs that matrix of counts (ours, hand, scoped; one callgrind process each, `--jobs`
at a time; a count already in `--out` is reused, so an interrupted run resumes) and
prints part 1's table in instructions: the ratios, the excess of ours over hand and
over scoped, and its log-log slopes between consecutive K. Without the collector
(`--gc off`, the default) the excess is eqxctx's own work, exactly; the collector's
full collections walk the whole process heap, so where they fall depends on the heap
before the trace, not only on the trace.
"""

import argparse
import gc
import math
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import bench_trace
import jax
import jax.numpy as jnp
from runner_instructions import _Counted as Counted  # pyright: ignore[reportPrivateUsage]

from eqxctx import Context


def calls(s: int, k: int) -> None:
    """Count K `ctx.call` children (S summaries and a module output each) in a trace.

    No JAX operation but `ctx.call`'s named scope: every child adds the same
    input tracer, so the count is eqxctx's own work per child (divide by K).
    """
    names = [f"c{i}" for i in range(k)]

    def child(x: jax.Array, ctx: Context) -> tuple[jax.Array, Context]:
        for j in range(s):
            ctx = ctx.add_summary(f"s{j}", x)
        return x, ctx.add_module_output("h", x)

    def traced(x: jax.Array) -> jax.Array:
        ctx = Context.root(prng_key=jax.random.PRNGKey(0))
        for name in names[:50]:  # warm up (the child names' checks)
            x, ctx = ctx.call(name, child, x)
        box = [Context.root(prng_key=jax.random.PRNGKey(0))]

        def run(n: int) -> None:
            del n
            ctx = box[0]
            for name in names:
                _, ctx = ctx.call(name, child, x)
            box[0] = ctx

        divmod(Counted(run, 1), 1)
        return x

    jax.jit(traced).trace(jnp.ones(bench_trace.WIDTH))


VARIANTS = ("ours", "hand", "scoped")
_COLLECTED = re.compile(r"Collected : (\d+)")


def _count(out: Path, shape: str, variant: str, s: int, k: int, collector: str) -> int:
    """One callgrind count (cached in `out`)."""
    name = f"{shape}-{variant}-{s}-{k}-{collector}"
    if (done := out / f"{name}.count").exists():
        return int(done.read_text())
    here = Path(__file__).resolve().parent
    env = dict(os.environ, TRACE_GC=collector)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(here.parent / "src"), str(here), env.get("PYTHONPATH", "")]
    )
    command = [
        "valgrind",
        "--tool=callgrind",
        "--collect-atstart=no",
        "--toggle-collect=builtin_divmod",
        f"--callgrind-out-file={out / name}.callgrind",
        sys.executable,
        __file__,
        shape,
        variant,
        str(s),
        str(k),
    ]
    run = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    (out / f"{name}.log").write_text(run.stderr)
    (out / f"{name}.callgrind").unlink(missing_ok=True)
    match = _COLLECTED.search(run.stderr)
    assert match is not None, run.stderr[-2000:]
    done.write_text(match.group(1))
    return int(match.group(1))


def _slope(k1: int, e1: float, k2: int, e2: float) -> str:
    if e1 <= 0 or e2 <= 0:
        return "n/a"
    return f"{math.log(e2 / e1) / math.log(k2 / k1):.2f}"


def table(argv: list[str]) -> None:
    """Part 1's table in instructions (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="trace_instructions.py table")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--ks", type=int, nargs="+", default=[100, 1000, 2000])
    parser.add_argument("--shapes", nargs="+", default=["flat", "deep"])
    parser.add_argument("--s", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--gc", choices=("off", "on"), default="off")
    parser.add_argument("--out", type=Path, default=Path("/tmp/trace_instructions"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cases = [
        (shape, variant, s, k, args.gc)
        for shape in args.shapes
        for s in args.s
        for k in args.ks
        for variant in VARIANTS
    ]
    with ThreadPoolExecutor(args.jobs) as pool:
        found = pool.map(lambda case: _count(args.out, *case), cases)
        counts = dict(zip(cases, found, strict=True))
    print(
        "| shape | S | K | ours (M) | hand (M) | scoped (M) | ours/hand | ours/scoped "
        "| excess over hand (M) | its slope | excess over scoped (M) | its slope |\n"
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
    )
    for shape in args.shapes:
        for s in args.s:
            prev: tuple[int, int, int] | None = None
            for k in args.ks:
                ours, hand, scoped = (
                    counts[(shape, v, s, k, args.gc)] for v in VARIANTS
                )
                slopes = ("", "")
                if prev is not None:
                    slopes = (
                        _slope(prev[0], prev[1], k, ours - hand),
                        _slope(prev[0], prev[2], k, ours - scoped),
                    )
                print(
                    f"| {shape} | {s} | {k} | {ours / 1e6:,.1f} | {hand / 1e6:,.1f} "
                    f"| {scoped / 1e6:,.1f} | {ours / hand:.3f} | {ours / scoped:.3f} "
                    f"| {(ours - hand) / 1e6:,.1f} | {slopes[0]} "
                    f"| {(ours - scoped) / 1e6:,.1f} | {slopes[1]} |"
                )
                prev = (k, ours - hand, ours - scoped)


def main() -> None:
    if sys.argv[1] == "calls":
        calls(int(sys.argv[3]), int(sys.argv[4]))
        return
    shape, variant, s, k = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    make_ours, make_hand = bench_trace.SHAPES[shape]
    make = {
        "ours": make_ours,
        "hand": make_hand,
        # The hand-written function with `jax.named_scope` per child, as `ctx.call`.
        "scoped": bench_trace.SCOPED[shape],
    }[variant]
    args = (
        jnp.linspace(-1.0, 1.0, bench_trace.WIDTH, dtype=jnp.float32),
        jax.random.PRNGKey(0),
    )
    jax.jit(make(10, s)).trace(*args)  # warm up (JAX's caches)
    fn = make(k, s)
    collections = [0, 0, 0]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections[info["generation"]] += 1

    gc.collect()
    if os.environ.get("TRACE_GC") == "off":  # the count without the collector
        gc.disable()
    gc.callbacks.append(count)

    def trace(n: int) -> None:
        del n  # one trace
        jax.jit(fn).trace(*args)

    # `runner_instructions`' wrapper: runs `trace` where callgrind collects.
    divmod(Counted(trace, 1), 1)
    gc.callbacks.remove(count)
    print(
        f"{shape} {variant} S={s} K={k}: gc collections {collections}", file=sys.stderr
    )


if __name__ == "__main__" and sys.argv[1] == "table":
    table(sys.argv[2:])
elif __name__ == "__main__":
    # As in `bench_trace.py`: a deep chain recurses several Python frames per child.
    sys.setrecursionlimit(100_000)
    threading.stack_size(512 * 2**20)
    thread = threading.Thread(target=main)
    thread.start()
    thread.join()

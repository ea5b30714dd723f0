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
collections by generation during the trace (to stderr).
"""

import gc
import sys
import threading

import bench_trace
import jax
import jax.numpy as jnp
from runner_instructions import _Counted as Counted  # pyright: ignore[reportPrivateUsage]

from eqxctx import Context


def calls(s: int, k: int) -> None:
    """Count K `ctx.call` children (S summaries and a module output each) in a trace.

    No JAX operation but `ctx.call`'s `jax.named_scope`: every child adds the same
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


if __name__ == "__main__":
    # As in `bench_trace.py`: a deep chain recurses several Python frames per child.
    sys.setrecursionlimit(100_000)
    threading.stack_size(512 * 2**20)
    thread = threading.Thread(target=main)
    thread.start()
    thread.join()

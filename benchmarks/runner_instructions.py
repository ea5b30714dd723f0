"""Instructions per call of the runner and of `jax.jit`, under callgrind (exact counts).

On a shared machine a 1-2 µs difference on a ~17 µs call is below the timing noise;
instruction counts are not. The model, the step and the batch are `bench_runner.py`'s
(1 device, 10 parameter leaves, a batch placed with the runner's own sharding). Only
the N calls are counted: they run inside `divmod`, and callgrind collects only there.
Usage (one variant per run; ~5 minutes each under valgrind):

    PYTHONPATH=src valgrind --tool=callgrind --collect-atstart=no \\
        --toggle-collect=builtin_divmod --callgrind-out-file=/tmp/cg.runner \\
        .venv/bin/python benchmarks/runner_instructions.py runner 2000

then divide the "Collected" count by N. Variants: `runner` (`MethodRunner.__call__`),
`jitted` (the runner's jitted step alone, on the same leaves), `bare` (`jax.jit` of the
same step on `(model, key, batch)`), `stubbed` (`MethodRunner.__call__` with the jitted
step replaced by a function returning a stored result: the runner's own Python).
Every call blocks on its output.
"""

import gc
import sys
from collections.abc import Callable
from typing import Any

import bench_runner
import jax
import numpy as np


def _loops() -> dict[str, Callable[[int], None]]:
    s = bench_runner._setup(1, 10)  # pyright: ignore[reportPrivateUsage]
    runner, bare = s["runner"], s["bare"]
    batch = runner({"x": np.ones((8, 4), np.float32)})[1].input_batch
    params, key, step = runner.params, runner.prng_key, runner.step
    leaves, jitted = runner.param_leaves, step.jitted

    def run_runner(n: int) -> None:
        r = runner
        for _ in range(n):
            r, out = r(batch)
            out.output_batch.block_until_ready()

    def run_jitted(n: int) -> None:
        k = key
        for _ in range(n):
            k, (y, _, _), _ = jitted(leaves, k, batch, None)
            y.block_until_ready()

    def run_bare(n: int) -> None:
        k = key
        for _ in range(n):
            k, y, _ = bare(params, k, batch)
            y.block_until_ready()

    def run_stubbed(n: int) -> None:
        result = jax.block_until_ready(jitted(leaves, key, batch, None))

        def stub(*args: Any) -> Any:
            del args
            return result

        step.jitted = stub
        try:
            r = runner
            for _ in range(n):
                r, _ = r(batch)
        finally:
            step.jitted = jitted

    return {
        "runner": run_runner,
        "jitted": run_jitted,
        "bare": run_bare,
        "stubbed": run_stubbed,
    }


class _Counted:
    """`divmod(_Counted(loop, n), 1)` runs `loop(n)` where callgrind collects."""

    def __init__(self, loop: Callable[[int], None], n: int):
        self.loop, self.n = loop, n

    def __divmod__(self, other: int) -> tuple[int, int]:
        del other
        self.loop(self.n)
        return 0, 0


def main() -> None:
    variant, n = sys.argv[1], int(sys.argv[2])
    loop = _loops()[variant]
    loop(200)  # warm up (compile, caches)
    gc.disable()
    divmod(_Counted(loop, n), 1)


if __name__ == "__main__":
    main()

"""Issue 37: the share of one trace spent inside the lost-output check.

bench_trace's K = 1000 rows, each traced once with `Ledger.record` and
`Ledger.lost` (the check when a body returns) timed by `time.perf_counter` around every
call: an upper bound (the timer's own cost is inside), and a ratio within one
trace, so less sensitive to the machine's load than an A/B of two traces.

    cd benchmarks && PYTHONPATH=../src:. ../.venv/bin/python ledger_share.py
"""

import gc
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import bench_trace as bt
import jax
import jax.numpy as jnp

from eqxctx import _ledger


spent = [0.0, 0]


def timed(f: Callable[..., Any]) -> Callable[..., Any]:
    def g(*args: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*args)
        finally:
            spent[0] += time.perf_counter() - t
            spent[1] += 1

    return g


def main() -> None:
    _ledger.Ledger.record = timed(_ledger.Ledger.record)
    _ledger.Ledger.lost = timed(_ledger.Ledger.lost)
    args = (jnp.ones(bt.WIDTH, jnp.float32), jax.random.PRNGKey(0))
    for shape, make in (("flat", bt.make_flat_ours), ("deep", bt.make_deep_ours)):
        for s in (1, 4):
            spent[:] = [0.0, 0]
            gc.disable()
            t = time.perf_counter()
            jax.jit(make(1000, s)).trace(*args)
            total = time.perf_counter() - t
            gc.enable()
            print(
                f"{shape} S={s} K=1000: trace {total:.3f} s, in the ledger "
                f"{spent[0] * 1e3:.1f} ms over {spent[1]} calls "
                f"({spent[0] / total:.2%})"
            )


if __name__ == "__main__":
    sys.setrecursionlimit(50000)
    threading.stack_size(512 * 1024 * 1024)
    thread = threading.Thread(target=main)
    thread.start()
    thread.join()

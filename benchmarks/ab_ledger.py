"""Issue 37 A/B: bench_trace's K = 1000 rows with the lost-output check on and off.

One process, the two variants interleaved (each first in turn), the collector off
during each trace, min over rounds. "off" stubs out `Ledger.record` (a diagnostic
only: then nothing is recorded and no body has anything to check; a `Ledger` is
still made per body). Prints one line per row: on, off, on/off.

    cd benchmarks && PYTHONPATH=../src:. ../.venv/bin/python ab_ledger.py [N] [rows]

`N`: rounds (default 5); `rows`: a substring of the rows to run (e.g. "deep").
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


Fn = Callable[..., Any]
RECORD = _ledger.Ledger.record


def _no_record(self: _ledger.Ledger, what: str, arg: object, new: Any) -> None:
    del self, what, arg, new


def trace_time(fn: Fn, args: tuple[Any, ...], on: bool) -> float:
    _ledger.Ledger.record = RECORD if on else _no_record
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        jax.jit(fn).trace(*args)
        return time.perf_counter() - t0
    finally:
        gc.enable()
        _ledger.Ledger.record = RECORD


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    args = (jnp.ones(bt.WIDTH, jnp.float32), jax.random.PRNGKey(0))
    rows = {
        "flat S=1 K=1000": (bt.make_flat_ours, 1000, 1),
        "deep S=1 K=1000": (bt.make_deep_ours, 1000, 1),
        "flat S=4 K=1000": (bt.make_flat_ours, 1000, 4),
        "deep S=4 K=1000": (bt.make_deep_ours, 1000, 4),
    }
    trace_time(bt.make_flat_ours(10, 1), args, True)  # warm-up
    only = sys.argv[2] if len(sys.argv) > 2 else ""
    for name, (make, k, s) in rows.items():
        if only not in name:
            continue
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                times[on].append(trace_time(make(k, s), args, on))
        on_t, off_t = min(times[True]), min(times[False])
        print(f"{name}: on {on_t:.3f} s, off {off_t:.3f} s, on/off {on_t / off_t:.3f}")


if __name__ == "__main__":
    sys.setrecursionlimit(50000)
    threading.stack_size(512 * 1024 * 1024)
    thread = threading.Thread(target=main)
    thread.start()
    thread.join()

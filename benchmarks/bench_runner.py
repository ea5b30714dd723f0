"""MethodRunner vs the code it replaces: a bare `jax.jit` call, a hand-written loop.

1. Per call: `MethodRunner.__call__` vs `jax.jit` of the same step (split the key,
   run the method in a root context, return the new key, the output and the
   summaries) on the same PyTree (the model, the key, the batch), for models with 10,
   100 and 1000 parameter leaves, on 1 and 8 (simulated CPU) devices, for batches
   (a) placed with the runner's own sharding (a previous call's `input_batch`),
   (b) placed by the user as `NamedSharding(mesh, P("data"))` (equivalent, not equal,
   on an Explicit mesh), (c) NumPy (the `jax.jit` side places it with
   `jax.make_array_from_process_local_data`, as a hand-written loop would).
   *blocking*: every call waits for its result; *pipelined*: at most 16 calls in
   flight, chained through the key. *runner traces*: the runner's `trace_count`
   after the row, for batches (a)-(c) of one signature: 1.
2. `run_batches` over 200 batches vs the hand-written loop (place with
   `jax.make_array_from_process_local_data` if NumPy, call the `jax.jit`, at most 8
   in flight), for NumPy and device batches.
3. Padding: 1,000 rows in batches of 64 on 8 devices (the last batch has 40 rows):
   compilations (the runner's `trace_count`) and the largest difference from the
   unpadded NumPy result, with `pad_batches=True` and with `batch_sizes=(64,)`.

Variants of one row run interleaved, round after round; each figure is the median of
the rounds (the machine is shared and noisy), and ratios are taken in the same run;
the per-call table also gives the ratio of the minima over the rounds.
Usage:

    .venv/bin/python benchmarks/bench_runner.py [--quick] [--rounds N]
        [--only per_call|run_batches|padding] [--devices 1 8] [--leaves 10 100 1000]

(`--devices 1 --leaves 10 --only per_call`: the one-device, 10-leaf per-call rows.)

The 8-device figures come from a subprocess started with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`.
"""

import argparse
import collections
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


LEAVES = tuple(int(n) for n in os.environ.get("BENCH_LEAVES", "10,100,1000").split(","))
#: Interleaved rounds per row (medians are reported); `--rounds` or BENCH_ROUNDS.
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "9"))
# Pipelined loops keep at most this many calls in flight: XLA's CPU runtime can
# deadlock with many multi-device programs in flight.
WINDOW = 16


def _interleaved(
    variants: dict[str, Callable[[], Any]], rounds: int, per_round: int
) -> dict[str, float]:
    """µs per unit of work of each variant over interleaved rounds.

    `name`: the median over rounds; `name + " min"`: the minimum (the round least
    disturbed by other jobs on a shared machine).
    """
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn()  # warm up (compile)
    gc.disable()  # collections would land on whichever variant runs
    try:
        for _ in range(rounds):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) / per_round * 1e6)
    finally:
        gc.enable()
    out = {k: statistics.median(v) for k, v in times.items()}
    return out | {f"{k} min": min(v) for k, v in times.items()}


def _setup(devices: int, leaves: int) -> dict[str, Any]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import eqxctx

    class Model(eqx.Module):
        weights: tuple[jax.Array, ...]

        def predict(
            self, batch: dict[str, jax.Array], ctx: eqxctx.Context
        ) -> tuple[jax.Array, eqxctx.Context]:
            w = sum(self.weights, jnp.zeros(4, jnp.float32))
            y = batch["x"] * w
            return y, ctx.add_summary("mean", jnp.mean(y))

    def step(model: Model, key: jax.Array, batch: dict[str, jax.Array]) -> Any:
        new_key, iter_key = jax.random.split(key)
        ctx = eqxctx.Context.root(prng_key=iter_key)
        y, ctx = model.predict(batch, ctx)
        return new_key, y, ctx.collection.summaries

    mesh = jax.make_mesh((devices,), ("data",))  # Explicit axes (JAX's default)
    model = Model(tuple(jnp.full(4, i, jnp.float32) for i in range(leaves)))
    runner = eqxctx.MethodRunner.create(
        model, "predict", mesh=mesh, prng_key=jax.random.PRNGKey(0)
    )
    return {"runner": runner, "bare": jax.jit(step), "mesh": mesh}


def _runner_loop(runner: Any, batch: Any, calls: int, block: bool) -> Any:
    import jax

    pending: collections.deque[Any] = collections.deque()
    for _ in range(calls):
        runner, out = runner(batch)
        pending.append(out.output_batch)
        if block or len(pending) > WINDOW:
            jax.block_until_ready(pending.popleft())
    return jax.block_until_ready((runner.prng_key, *pending))


def _jit_loop(
    bare: Any,
    params: Any,
    key: Any,
    batches: list[Any],
    window: int,
    numpy: Any,
) -> Any:
    """Call `bare` on each batch, at most `window` in flight (0: block on each).

    NumPy batches are placed by hand, with the sharding `numpy`.
    """
    import jax

    block = window == 0
    pending: collections.deque[Any] = collections.deque()
    for batch in batches:
        if numpy is not None:
            batch = {"x": jax.make_array_from_process_local_data(numpy, batch["x"])}
        key, y, _ = bare(params, key, batch)
        pending.append(y)
        if block or len(pending) > window:
            jax.block_until_ready(pending.popleft())
    return jax.block_until_ready((key, *pending))


def _run_batches_loop(runner: Any, batches: list[Any]) -> Any:
    import jax

    import eqxctx

    out = None
    for out in eqxctx.run_batches(runner, batches, max_in_flight=8):  # noqa: B007
        pass
    return jax.block_until_ready(out)


def _per_call(devices: int, quick: bool) -> list[dict[str, Any]]:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    rows: list[dict[str, Any]] = []
    for n in LEAVES:
        s = _setup(devices, n)
        runner, bare, mesh = s["runner"], s["bare"], s["mesh"]
        host = {"x": np.ones((8 * devices, 4), np.float32)}
        own = runner(host)[1].input_batch
        sharding = NamedSharding(mesh, P("data"))
        user = {"x": jax.device_put(host["x"], sharding)}
        params, key = runner.params, runner.prng_key
        calls = (50 if quick else 200) if n < 1000 else (20 if quick else 100)
        rounds = 3 if quick else ROUNDS
        kinds = (("a) own", own), ("b) P('data')", user), ("c) NumPy", host))
        for kind, batch in kinds:
            numpy = sharding if kind.startswith("c") else None
            for mode, block in (("blocking", True), ("pipelined", False)):
                med = _interleaved(
                    {
                        "runner": functools.partial(
                            _runner_loop, runner, batch, calls, block
                        ),
                        "jax.jit": functools.partial(
                            _jit_loop,
                            bare,
                            params,
                            key,
                            [batch] * calls,
                            0 if block else WINDOW,
                            numpy,
                        ),
                    },
                    rounds,
                    calls,
                )
                rows.append(
                    {
                        "table": "per_call",
                        "devices": devices,
                        "leaves": n,
                        "batch": kind,
                        "mode": mode,
                        # All three batches are one signature: one trace in all.
                        "traces": runner.trace_count,
                        **med,
                    }
                )
    return rows


def _run_batches(devices: int, quick: bool) -> list[dict[str, Any]]:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    rows: list[dict[str, Any]] = []
    count = 50 if quick else 200
    for n in [n for n in LEAVES if n <= 100]:
        s = _setup(devices, n)
        runner, bare, mesh = s["runner"], s["bare"], s["mesh"]
        sharding = NamedSharding(mesh, P("data"))
        rng = np.random.default_rng(0)
        host = [
            {"x": rng.normal(size=(8 * devices, 4)).astype(np.float32)}
            for _ in range(count)
        ]
        placed = [{"x": jax.device_put(b["x"], sharding)} for b in host]
        params, key = runner.params, runner.prng_key
        for kind, batches in (("NumPy", host), ("device", placed)):
            numpy = sharding if kind == "NumPy" else None
            med = _interleaved(
                {
                    "run_batches": functools.partial(
                        _run_batches_loop, runner, batches
                    ),
                    "by hand": functools.partial(
                        _jit_loop, bare, params, key, batches, 8, numpy
                    ),
                },
                3 if quick else ROUNDS,
                count,
            )
            rows.append(
                {
                    "table": "run_batches",
                    "devices": devices,
                    "leaves": n,
                    "batch": kind,
                    "traces": runner.trace_count,
                    **med,
                }
            )
    return rows


def _padding(devices: int) -> list[dict[str, Any]]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import eqxctx

    class Linear(eqx.Module):
        w: jax.Array

        def predict(
            self, batch: dict[str, jax.Array], ctx: eqxctx.Context, *, mask: jax.Array
        ) -> tuple[jax.Array, eqxctx.Context]:
            y = batch["x"] @ self.w
            n = jnp.sum(mask.astype(jnp.float32))
            mean = jnp.sum(jnp.where(mask[:, None], y, 0.0)) / (n * y.shape[1])
            return y, ctx.add_summary("mean", eqxctx.WeightedSummary(mean, n))

    rng = np.random.default_rng(0)
    w = rng.normal(size=(4, 3)).astype(np.float32)
    x = rng.normal(size=(1000, 4)).astype(np.float32)
    batches = [{"x": x[i : i + 64]} for i in range(0, 1000, 64)]
    mesh = jax.make_mesh((devices,), ("data",))
    rows: list[dict[str, Any]] = []
    sizes: tuple[int, ...] | None
    for label, sizes in (("pad_batches=True", None), ("batch_sizes=(64,)", (64,))):
        runner = eqxctx.MethodRunner.create(
            Linear(jnp.asarray(w)),
            "predict",
            mesh=mesh,
            prng_key=jax.random.PRNGKey(0),
            pad_batches=True,
            batch_sizes=sizes,
            mask_kwarg="mask",
        )
        before = runner.trace_count
        acc = eqxctx.SummaryAccumulator()
        ys = []
        for out in eqxctx.run_batches(runner, batches):
            ys.append(np.asarray(out.output_batch))
            acc = acc.update(out.summaries)
        y = np.concatenate(ys)
        ref = x @ w
        rows.append(
            {
                "table": "padding",
                "devices": devices,
                "variant": label,
                "compilations": runner.trace_count - before,
                "rows": len(y),
                "max_abs_diff": float(np.abs(y - ref).max()),
                "mean_diff": abs(
                    float(acc.summaries()["mean"].value()) - float(ref.mean())
                ),
            }
        )
    return rows


def _measure(devices: int, quick: bool) -> list[dict[str, Any]]:
    rows = _per_call(devices, quick) + _run_batches(devices, quick)
    if devices > 1:
        rows += _padding(devices)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| devices | leaves | batch | mode | runner traces | runner µs | jax.jit µs "
        "| runner / jax.jit (medians) | (minima) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["table"] == "per_call":
            lines.append(
                f"| {r['devices']} | {r['leaves']} | {r['batch']} | {r['mode']} "
                f"| {r['traces']} | {r['runner']:.1f} | {r['jax.jit']:.1f} "
                f"| {r['runner'] / r['jax.jit']:.2f} "
                f"| {r['runner min'] / r['jax.jit min']:.2f} |"
            )
    lines += [
        "",
        "| devices | leaves | batches | runner traces | run_batches µs/batch "
        "| by hand µs/batch | run_batches / by hand |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["table"] == "run_batches":
            lines.append(
                f"| {r['devices']} | {r['leaves']} | {r['batch']} | {r['traces']} "
                f"| {r['run_batches']:.1f} | {r['by hand']:.1f} "
                f"| {r['run_batches'] / r['by hand']:.2f} |"
            )
    lines += [
        "",
        "| devices | padding | compilations | rows out | max abs diff vs NumPy "
        "| mean summary diff |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["table"] == "padding":
            lines.append(
                f"| {r['devices']} | {r['variant']} | {r['compilations']} "
                f"| {r['rows']} | {r['max_abs_diff']:.1e} | {r['mean_diff']:.1e} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="MethodRunner vs jax.jit and a hand-written loop."
    )
    parser.add_argument("--quick", action="store_true", help="fewer calls and rounds")
    parser.add_argument(
        "--devices", type=int, nargs="+", default=[1, 8], help="device counts (1 8)"
    )
    parser.add_argument(
        "--leaves", type=int, nargs="+", help="parameter leaf counts (10 100 1000)"
    )
    parser.add_argument("--child", type=int, help="(internal) measure in-process")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per row (9)")
    parser.add_argument(
        "--only", choices=["per_call", "run_batches", "padding"], help="one part"
    )
    args = parser.parse_args()
    if args.rounds is not None:
        os.environ["BENCH_ROUNDS"] = str(args.rounds)  # read by the subprocesses
    if args.leaves:
        os.environ["BENCH_LEAVES"] = ",".join(map(str, args.leaves))
    if args.child is not None:
        if args.only == "per_call":
            rows = _per_call(args.child, args.quick)
        elif args.only == "run_batches":
            rows = _run_batches(args.child, args.quick)
        elif args.only == "padding":
            rows = _padding(args.child)
        else:
            rows = _measure(args.child, args.quick)
        print(json.dumps(rows))
        return
    rows: list[dict[str, Any]] = []
    for devices in args.devices:
        env = dict(os.environ)
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={devices}"
        )
        env["JAX_PLATFORMS"] = "cpu"
        cmd = [sys.executable, __file__, f"--child={devices}"]
        if args.quick:
            cmd.append("--quick")
        if args.only:
            cmd.append(f"--only={args.only}")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    print(_table(rows))


if __name__ == "__main__":
    main()

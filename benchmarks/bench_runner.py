"""Per-call overhead of `MethodRunner.__call__` vs a bare `jax.jit` call.

Both run the same step (split the key, run the method in a root context, return the
new key, the output and the summaries) on the same PyTree (the model, the key and a
pre-sharded batch), for models with 10, 100 and 1000 parameter leaves, on 1 and 8
(simulated CPU) devices. `eqx.filter_jit` on the same step is shown for reference.

- blocking: every call waits for its result (`jax.block_until_ready`);
- pipelined: many calls chained through the key, one block at the end. A runner
  whose call blocked would show no gain here.

Each figure is the best of several interleaved rounds (µs per call); ratios are
runner / jax.jit from the same run. Usage:

    .venv/bin/python benchmarks/bench_runner.py [--quick]

The 8-device figures come from a subprocess started with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`.
"""

import argparse
import collections
import gc
import json
import os
import subprocess
import sys
import time
from typing import Any


LEAVES = (10, 100, 1000)
# Pipelined loops keep at most this many calls in flight (as `run_batches` does):
# XLA's CPU runtime can deadlock with many multi-device programs in flight.
WINDOW = 16


def _measure(devices: int, quick: bool) -> list[dict[str, Any]]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

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

    bare = jax.jit(step)
    filtered = eqx.filter_jit(step)
    mesh = jax.make_mesh((devices,), ("data",))
    calls = 200 if quick else 1000
    rounds = 3 if quick else 7
    rows: list[dict[str, Any]] = []
    for n in LEAVES:
        model = Model(tuple(jnp.full(4, i, jnp.float32) for i in range(n)))
        runner = eqxctx.MethodRunner.create(
            model, "predict", mesh=mesh, prng_key=jax.random.PRNGKey(0)
        )
        batch = {"x": np.ones((8 * devices, 4), np.float32)}
        placed = runner(batch)[1].input_batch
        params, key = runner.params, runner.prng_key

        def run_runner(block: bool, r: Any = runner, placed: Any = placed) -> Any:
            pending: collections.deque[Any] = collections.deque()
            for _ in range(calls):
                r, out = r(placed)
                pending.append(out.output_batch)
                if block or len(pending) > WINDOW:
                    jax.block_until_ready(pending.popleft())
            return jax.block_until_ready((r.prng_key, *pending))

        def run_jit(
            fn: Any,
            block: bool,
            k: Any = key,
            params: Any = params,
            placed: Any = placed,
        ) -> Any:
            pending: collections.deque[Any] = collections.deque()
            for _ in range(calls):
                k, y, _ = fn(params, k, placed)
                pending.append(y)
                if block or len(pending) > WINDOW:
                    jax.block_until_ready(pending.popleft())
            return jax.block_until_ready((k, *pending))

        variants = {
            "runner": run_runner,
            "jax.jit": lambda block: run_jit(bare, block),
            "filter_jit": lambda block: run_jit(filtered, block),
        }
        for mode, block in (("blocking", True), ("pipelined", False)):
            best = dict.fromkeys(variants, float("inf"))
            for fn in variants.values():
                fn(block)  # warm up (compile)
            gc.disable()  # collections would land on whichever variant runs
            for _ in range(rounds):
                for name, fn in variants.items():
                    t0 = time.perf_counter()
                    fn(block)
                    best[name] = min(best[name], (time.perf_counter() - t0) / calls)
            gc.enable()
            rows.append(
                {
                    "devices": devices,
                    "leaves": n,
                    "mode": mode,
                    **{k: v * 1e6 for k, v in best.items()},
                }
            )
    rows += _dispatch(runner_cls=eqxctx.MethodRunner, mesh=mesh, quick=quick)
    return rows


def _dispatch(runner_cls: Any, mesh: Any, quick: bool) -> list[dict[str, Any]]:
    """Time until a call returns vs until its result is ready, on a heavy method."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import eqxctx

    class Heavy(eqx.Module):
        w: jax.Array

        def predict(
            self, batch: dict[str, jax.Array], ctx: eqxctx.Context
        ) -> tuple[jax.Array, eqxctx.Context]:
            h = batch["x"]
            for _ in range(8):
                h = jnp.tanh(h @ self.w)
            return h, ctx

    def step(model: Heavy, key: jax.Array, batch: dict[str, jax.Array]) -> Any:
        new_key, iter_key = jax.random.split(key)
        y, _ = model.predict(batch, eqxctx.Context.root(prng_key=iter_key))
        return new_key, y

    devices = mesh.devices.size
    model = Heavy(jnp.eye(512, dtype=jnp.float32) * 0.5)
    runner = runner_cls.create(
        model, "predict", mesh=mesh, prng_key=jax.random.PRNGKey(0)
    )
    batch = runner({"x": np.ones((64 * devices, 512), np.float32)})[1].input_batch
    params, key = runner.params, runner.prng_key
    bare, filtered = jax.jit(step), eqx.filter_jit(step)
    calls = {
        "runner": lambda: runner(batch)[1].output_batch,
        "jax.jit": lambda: bare(params, key, batch)[1],
        "filter_jit": lambda: filtered(params, key, batch)[1],
    }
    rows: list[dict[str, Any]] = []
    for name, call in calls.items():
        jax.block_until_ready(call())  # compile
        returned, ready = [], []
        for _ in range(5 if quick else 20):
            t0 = time.perf_counter()
            y = call()
            t1 = time.perf_counter()
            jax.block_until_ready(y)
            t2 = time.perf_counter()
            returned.append(t1 - t0)
            ready.append(t2 - t0)
        rows.append(
            {
                "devices": devices,
                "variant": name,
                "returns": sorted(returned)[len(returned) // 2] * 1e6,
                "ready": sorted(ready)[len(ready) // 2] * 1e6,
            }
        )
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| devices | leaves | mode | runner µs | jax.jit µs | filter_jit µs "
        "| runner / jax.jit | filter_jit / jax.jit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "variant" in r:
            continue
        lines.append(
            f"| {r['devices']} | {r['leaves']} | {r['mode']} | {r['runner']:.1f} "
            f"| {r['jax.jit']:.1f} | {r['filter_jit']:.1f} "
            f"| {r['runner'] / r['jax.jit']:.2f} "
            f"| {r['filter_jit'] / r['jax.jit']:.2f} |"
        )
    lines += [
        "",
        "Dispatch (a method of ~8 matmuls 512x512; median µs): a call that does not",
        "block returns long before its result is ready.",
        "",
        "| devices | variant | call returns after µs | result ready after µs |",
        "|---|---|---|---|",
    ]
    for r in rows:
        if "variant" in r:
            lines.append(
                f"| {r['devices']} | {r['variant']} | {r['returns']:.0f} "
                f"| {r['ready']:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Per-call overhead of MethodRunner vs jax.jit."
    )
    parser.add_argument("--quick", action="store_true", help="fewer calls and rounds")
    parser.add_argument("--devices", type=int, help="(internal) measure in-process")
    args = parser.parse_args()
    if args.devices is not None:
        print(json.dumps(_measure(args.devices, args.quick)))
        return
    rows: list[dict[str, Any]] = []
    for devices in (1, 8):
        env = dict(os.environ)
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={devices}"
        )
        env["JAX_PLATFORMS"] = "cpu"
        cmd = [sys.executable, __file__, f"--devices={devices}"]
        if args.quick:
            cmd.append("--quick")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    print(_table(rows))


if __name__ == "__main__":
    main()

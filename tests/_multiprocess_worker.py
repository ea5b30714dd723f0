"""One process of the two-process MethodRunner test (run by test_multiprocess.py).

Usage: python _multiprocess_worker.py PORT PROCESS_ID OUT.npz

Each process has 4 CPU devices, joins a 2-process JAX runtime on 127.0.0.1:PORT with
gloo CPU collectives, feeds its host-local half of the batch to a `MethodRunner` on an
8-device mesh, and (process 0) saves the gathered global results to OUT.npz. Exit code
3 means the platform has no CPU collectives.
"""

import sys
from typing import Any

import numpy as np


GLOBAL_BATCH = 16
NO_COLLECTIVES = 3


def make_model() -> Any:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import eqxctx

    class Model(eqx.Module):
        w: jax.Array

        def predict(
            self, batch: dict[str, jax.Array], ctx: eqxctx.Context
        ) -> tuple[dict[str, jax.Array], eqxctx.Context]:
            y = batch["x"] @ self.w
            noise = jax.random.uniform(ctx.prng_key, (batch["x"].shape[0],))
            # The real rows only under `pad_batches=True` (issue 35 item 4).
            ctx = ctx.add_summary("y_sum", jnp.sum(y, where=ctx.row_where(y)))
            ctx = ctx.add_module_output("w_norm", jnp.sum(self.w * self.w))
            return {"y": y, "noise": noise}, ctx

    return Model(jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 10)


def make_batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(GLOBAL_BATCH, 4)).astype(np.float32)}


def run(batch: dict[str, np.ndarray], mesh: Any) -> dict[str, np.ndarray]:
    """Two runner calls; return the gathered results as flat NumPy arrays."""
    import jax

    import eqxctx

    runner = eqxctx.MethodRunner.create(
        make_model(),
        "predict",
        mesh=mesh,
        prng_key=jax.random.PRNGKey(42),
        drop_module_outputs=lambda path: False,
    )
    results: dict[str, np.ndarray] = {}
    for call in range(2):
        runner, out = runner(batch)
        host = eqxctx.to_host(out)
        results[f"y{call}"] = host.output_batch["y"]
        results[f"noise{call}"] = host.output_batch["noise"]
        results[f"x{call}"] = host.input_batch["x"]
        results[f"y_sum{call}"] = np.asarray(host.summaries["y_sum"])
        results[f"w_norm{call}"] = np.asarray(host.module_outputs["w_norm"])
        local = eqxctx.to_host(out.output_batch["y"], gather=False)
        results[f"local_y{call}"] = local
    results["key"] = eqxctx.to_host(runner.prng_key)
    # Padding: a batch that needs none runs as it is; in a multi-process run one that
    # would need padding is refused (each process holds a slice), in one process it
    # is padded.
    padded = eqxctx.MethodRunner.create(
        make_model(),
        "predict",
        mesh=mesh,
        prng_key=jax.random.PRNGKey(42),
        pad_batches=True,
    )
    results["padded_y"] = eqxctx.to_host(padded(batch)[1].output_batch["y"])
    ragged = {k: v[:-1] for k, v in batch.items()}
    try:
        padded(ragged)
        refused = False
    except ValueError as e:
        refused = "multi-process" in str(e)
    results["ragged_as_documented"] = np.asarray(refused == (jax.process_count() > 1))
    return results


def main() -> None:
    port, process_id, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception as e:  # any failure here means: no CPU collectives
        print(f"no CPU collectives: {e}", file=sys.stderr)
        sys.exit(NO_COLLECTIVES)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    assert jax.process_count() == 2
    assert jax.device_count() == 8
    mesh = jax.make_mesh((8,), ("data",))
    half = GLOBAL_BATCH // 2
    batch = {
        k: v[process_id * half : (process_id + 1) * half]
        for k, v in make_batch().items()
    }
    results: dict[str, Any] = run(batch, mesh)
    if process_id == 0:
        # Numeric arrays only (loaded without pickle). No `allow_pickle=` here: numpy
        # < 2.1 would store it as an array named "allow_pickle".
        np.savez(out_path, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()

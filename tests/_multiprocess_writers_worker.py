"""One process of the two-process writers test (run by test_writers_multiprocess.py).

Usage: python _multiprocess_writers_worker.py PORT PROCESS_ID LOGDIR

Each process has 4 CPU devices and joins a 2-process JAX runtime on 127.0.0.1:PORT
(gloo CPU collectives). Both run a `MethodRunner` on their half of the batch and
write its summaries (and the output batch, split over the processes) through one
`AsyncWriter(MultiWriter(JsonlWriter, TensorBoardWriter))` on the same LOGDIR: only
process 0 may write files. Exit code 3 means the platform has no CPU collectives.
"""

import sys
from typing import Any

import numpy as np


GLOBAL_BATCH = 16
STEPS = 3
NO_COLLECTIVES = 3


def make_batch(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"x": rng.normal(size=(GLOBAL_BATCH, 4)).astype(np.float32)}


def run_and_write(process_batch: Any, mesh: Any, logdir: str) -> None:
    """Run STEPS runner calls and write every step; `process_batch(step)` feeds."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import eqxctx
    from eqxctx.writers import AsyncWriter, JsonlWriter, MultiWriter, TensorBoardWriter

    class Model(eqx.Module):
        w: jax.Array

        def __call__(
            self, batch: dict[str, jax.Array], ctx: eqxctx.Context
        ) -> tuple[dict[str, jax.Array], eqxctx.Context]:
            y = batch["x"] @ self.w
            ctx = ctx.add_summary("y_sum", jnp.sum(y))
            ctx = ctx.add_summary("y_moments", eqxctx.MomentsSummary(y))
            hist = eqxctx.HistogramSummary(y, bins=8, range=(-4, 4))
            ctx = ctx.add_summary("y_hist", hist)
            return {"y": y}, ctx

    runner = eqxctx.MethodRunner.create(
        Model(jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 10),
        lambda m, b, ctx: m(b, ctx),
        mesh=mesh,
        prng_key=jax.random.PRNGKey(0),
    )
    writer = AsyncWriter(
        MultiWriter(JsonlWriter(f"{logdir}/s.jsonl"), TensorBoardWriter(logdir)),
        defer_fetch=True,
    )
    with writer:
        for step in range(STEPS):
            runner, out = runner(process_batch(step))
            # The output batch is split over the processes: fetching all-gathers.
            writer.write(
                step, {"train": out.summaries, "y_first": out.output_batch["y"]}
            )


def main() -> None:
    port, process_id, logdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
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
    mesh = jax.make_mesh((8,), ("data",))
    half = GLOBAL_BATCH // 2

    def process_batch(step: int) -> dict[str, np.ndarray]:
        rows = slice(process_id * half, (process_id + 1) * half)
        return {k: v[rows] for k, v in make_batch(step).items()}

    run_and_write(process_batch, mesh, logdir)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()

"""MethodRunner across two processes on loopback equals one process on the whole batch.

Two worker processes (tests/_multiprocess_worker.py), 4 CPU devices each, join one JAX
runtime through `jax.distributed.initialize` with gloo CPU collectives; each feeds its
host-local half of the batch. Bounded by a hard timeout.
"""

from pathlib import Path

import jax
import numpy as np
import pytest

import _multiprocess_worker as worker
from helpers import run_two_processes


WORKER = Path(__file__).with_name("_multiprocess_worker.py")
TIMEOUT_S = 120


def _run_two_processes(out_path: Path) -> None:
    run_two_processes(
        WORKER, out_path, no_collectives=worker.NO_COLLECTIVES, timeout_s=TIMEOUT_S
    )


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_two_processes_equal_one_process(tmp_path: Path) -> None:
    out_path = tmp_path / "two_processes.npz"
    _run_two_processes(out_path)
    two = dict(np.load(out_path))
    mesh = jax.make_mesh((8,), ("data",))
    one = worker.run(worker.make_batch(), mesh)
    assert two.keys() == one.keys()
    for name, value in one.items():
        if name.startswith("local_y"):
            # Each process's addressable part: process 0 holds the first half.
            np.testing.assert_allclose(two[name], value[: worker.GLOBAL_BATCH // 2])
        else:
            np.testing.assert_allclose(two[name], value, rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(two["x0"], worker.make_batch()["x"])
    np.testing.assert_allclose(two["padded_y"], two["y0"], rtol=1e-6)
    assert bool(two["ragged_as_documented"])

"""Writers in a two-process run: every process fetches, only process 0 writes.

Two worker processes (tests/_multiprocess_writers_worker.py), 4 CPU devices each,
write the same run to one folder; the result must be exactly one set of files with the
values of a one-process run on the whole batch.
"""

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import _multiprocess_writers_worker as worker
from helpers import run_two_processes
from tb_events import scalars


WORKER = Path(__file__).with_name("_multiprocess_writers_worker.py")
TIMEOUT_S = 120


def _run_two_processes(logdir: Path) -> None:
    run_two_processes(
        WORKER, logdir, no_collectives=worker.NO_COLLECTIVES, timeout_s=TIMEOUT_S
    )


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_two_processes_write_one_set_of_files(tmp_path: Path) -> None:
    two, one = tmp_path / "two", tmp_path / "one"
    _run_two_processes(two)
    worker.run_and_write(worker.make_batch, jax.make_mesh((8,), ("data",)), str(one))
    names = sorted(p.name for p in two.iterdir())
    assert len(names) == 2  # one JSONL file, one event file: process 0's
    assert names[0].startswith("events.out.tfevents.")
    assert names[1] == "s.jsonl"
    got, want = _lines(two / "s.jsonl"), _lines(one / "s.jsonl")
    assert [line["step"] for line in got] == list(range(worker.STEPS))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        assert g["train/y_hist"] == w["train/y_hist"]
        assert g["train/y_moments/count"] == worker.GLOBAL_BATCH * 3
        for key in g:
            if key != "train/y_hist":
                np.testing.assert_allclose(g[key], w[key], rtol=1e-6, err_msg=key)
    # The gathered output batch is the whole batch, in order.
    y = worker.make_batch(0)["x"] @ (np.arange(12, dtype=np.float32).reshape(4, 3) / 10)
    np.testing.assert_allclose(got[0]["y_first"], y, rtol=1e-6)
    tb_two, tb_one = scalars(str(two)), scalars(str(one))
    assert tb_two.keys() == tb_one.keys()
    for key, value in tb_one.items():
        np.testing.assert_allclose(tb_two[key], value, rtol=1e-6, err_msg=str(key))

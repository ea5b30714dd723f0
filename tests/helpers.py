"""Shared test helpers."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest


def tree_allclose(a: Any, b: Any, *, rtol: float = 1e-6, atol: float = 1e-6) -> bool:
    """Return whether two PyTrees have equal structure and allclose leaves."""
    return bool(eqx.tree_equal(a, b, typematch=False, rtol=rtol, atol=atol))


def optimized_hlo(fn: Any, *args: Any) -> str:
    """The optimized HLO of `jax.jit(fn)` on `args`, without names and source lines.

    The module's name holds the function's name, and metadata and the tables of
    source locations hold source lines; the program is the rest, so two functions
    that compile to one program give equal text.
    """
    text = jax.jit(fn).lower(*args).compile().as_text()
    assert text is not None
    text = re.sub(r"^HloModule \S+", "HloModule m", text)
    text = re.sub(r",? metadata=\{[^}]*\}", "", text)
    tables = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
    blocks = [b for b in text.split("\n\n") if not b.startswith(tables)]
    return "\n\n".join(blocks)


def to_numpy_dict(flat: dict[str, Any]) -> dict[str, np.ndarray]:
    """Turn flattened leaves into stacked NumPy arrays (a Summary: its fields)."""
    out: dict[str, np.ndarray] = {}
    for path, leaf in flat.items():
        leaves = jax.tree_util.tree_leaves(leaf)
        out[path] = np.stack([np.asarray(jnp.asarray(x)) for x in leaves])
    return out


def run_two_processes(
    worker: Path, out_path: Path, *, no_collectives: int, timeout_s: float = 120
) -> None:
    """Run `worker port rank out_path` as two JAX processes on loopback.

    Fails the test if they do not finish within `timeout_s` seconds or either exits
    non-zero (showing their output); skips it if a worker exits with
    `no_collectives` (a platform without CPU collectives).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The workers set their own device counts.
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(port), str(i), str(out_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs: list[str] = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.communicate()
        pytest.fail(f"the two worker processes did not finish in {timeout_s} s")
    codes = [p.returncode for p in procs]
    if no_collectives in codes:
        pytest.skip(f"this platform has no CPU collectives: {outputs}")
    assert codes == [0, 0], "\n\n".join(o[-3000:] for o in outputs)

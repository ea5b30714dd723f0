"""Shared test helpers."""

import contextlib
import hashlib
import os
import re
import socket
import subprocess
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest


@contextlib.contextmanager
def unchecked() -> Generator[None]:
    """Turn the suite's runtime type checks off, so eqxctx's own checks run."""
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)


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


def _flush(x: Any) -> Any:
    """`x` with float32 subnormals flushed to zero (sign kept), as a TPU does."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        return x
    zero = np.copysign(np.float32(0), x)
    return np.where(np.abs(x) < np.finfo(np.float32).tiny, zero, x)


def _eval_flushing(jaxpr: Any, consts: list[Any], args: list[Any]) -> list[Any]:
    from jax.extend.core import ClosedJaxpr, Literal

    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for v, x in [
        *zip(jaxpr.constvars, consts, strict=True),
        *zip(jaxpr.invars, args, strict=True),
    ]:
        env[v] = _flush(x)
    for eqn in jaxpr.eqns:
        ins = [_flush(read(v)) for v in eqn.invars]
        subs = [p for p in eqn.params.values() if isinstance(p, ClosedJaxpr)]
        if subs and eqn.primitive.name in ("jit", "pjit", "closed_call"):
            outs = _eval_flushing(subs[0].jaxpr, subs[0].consts, ins)
        elif eqn.primitive.name == "div" and ins[0].dtype == np.float32:
            # A TPU divides by multiplying with the reciprocal, which it flushes:
            # 1 / 2**127 is subnormal, so x / 2**127 is 0.
            with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
                reciprocal = _flush(np.float32(1) / ins[1])
                outs = [ins[0] * reciprocal]
        else:
            out = eqn.primitive.bind(*ins, **eqn.params)
            outs = list(out) if eqn.primitive.multiple_results else [out]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = _flush(x)
    return [read(v) for v in jaxpr.outvars]


def run_flushing_subnormals(fn: Any, *args: Any) -> Any:
    """`fn(*args)` op by op, as a TPU computes float32: subnormals flushed to zero.

    Emulates on the CPU what a TPU does and XLA's CPU backend does not always do:
    every float32 input and result of every operation below float32's smallest
    normal (1.2e-38) is flushed to zero, and `x / y` is `x * (1 / y)` with the
    reciprocal flushed (so dividing by a number above 2**126 gives 0).
    """
    closed = jax.make_jaxpr(fn)(*args)
    flat = jax.tree_util.tree_leaves(args)
    outs = _eval_flushing(closed.jaxpr, closed.consts, flat)
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(jax.eval_shape(fn, *args)), outs
    )


def child_seed(name: str) -> int:
    """AXLearn's seed of a child name: md5 of the name, mod `2**31 - 1`."""
    return int(hashlib.md5(name.encode("utf-8")).hexdigest(), 16) % (2**31 - 1)


def key_of(key: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """`fold_in` by each name's seed, from the root down (AXLearn's derivation)."""
    for name in names:
        key = jax.random.fold_in(key, child_seed(name))
    return key

"""Runs the code of docs/examples/scan_over_layers.md and checks its results."""

import pathlib
import re
from typing import Any

import equinox as eqx
import jax
import numpy as np

import eqxctx


PAGE = (
    pathlib.Path(__file__).parent.parent / "docs" / "examples" / "scan_over_layers.md"
)


def _run_page() -> dict[str, Any]:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)
    assert len(blocks) >= 4
    namespace: dict[str, Any] = {"__name__": "scan_over_layers"}
    exec(compile("\n".join(blocks), str(PAGE), "exec"), namespace)
    return namespace


def test_scan_over_layers_page() -> None:
    ns = _run_page()
    model, x, coll = ns["model"], ns["x"], ns["collection"]
    # Reference: a Python loop over the layers, each in its own child context.
    ctx = eqxctx.Context.root(prng_key=jax.random.PRNGKey(1), is_training=True)
    child_key = ctx.child("layer").prng_key
    params, static = eqx.partition(model.layers, eqx.is_array)
    h = x
    for i in range(4):
        layer = eqx.combine(jax.tree_util.tree_map(lambda a: a[i], params), static)  # noqa: B023
        layer_ctx = ctx.child("layer", prng_key=jax.random.fold_in(child_key, i))
        h, layer_ctx = layer(h, layer_ctx)
        want = layer_ctx.collection.flatten("summaries")
        got = coll.child(f"layer{i}").flatten("summaries")
        np.testing.assert_allclose(got["rms"], want["rms"], rtol=1e-5)
        np.testing.assert_allclose(got["mean"].value(), want["mean"].value(), rtol=1e-5)
        np.testing.assert_allclose(
            coll.flatten("module_outputs")["layer/activation"][i],
            layer_ctx.collection.flatten("module_outputs")["activation"],
            rtol=1e-5,
        )
    np.testing.assert_allclose(ns["y"], h, rtol=1e-5)
    assert ns["activations"].shape == (4, 2, 8)
    assert sorted(ns["summaries"]) == [
        f"layer{i}/{n}" for i in range(4) for n in ("mean", "rms")
    ]
    merged = ns["merged_collection"].flatten("summaries")
    assert sorted(merged) == ["layer/mean", "layer/rms"]
    means = [
        coll.child(f"layer{i}").flatten("summaries")["mean"].value() for i in range(4)
    ]
    np.testing.assert_allclose(merged["layer/mean"].value(), np.mean(means), rtol=1e-5)
    rms = [coll.child(f"layer{i}").flatten("summaries")["rms"] for i in range(4)]
    np.testing.assert_allclose(merged["layer/rms"], np.sum(rms), rtol=1e-5)

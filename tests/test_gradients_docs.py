"""Runs the code of docs/gradients.md and checks it against a `jax.vjp` reference."""

import pathlib
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest


PAGE = pathlib.Path(__file__).parent.parent / "docs" / "gradients.md"


def test_gradients_page() -> None:
    pytest.importorskip("optax")
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)
    assert len(blocks) == 2
    ns: dict[str, Any] = {"__name__": "gradients_page"}
    exec(compile("\n".join(blocks), str(PAGE), "exec"), ns)
    # Reference: the model before the step, unrolled, with a zero perturbation added
    # to the stream entering each layer.
    model = ns["Model"](num_layers=4, width=16, key=jax.random.PRNGKey(0))
    x, y = ns["x"], ns["y"]
    params, static = eqx.partition(model.blocks, eqx.is_array)

    def loss(perts: Any) -> Any:
        h = x
        for i in range(4):
            block = eqx.combine(jax.tree_util.tree_map(lambda a: a[i], params), static)  # noqa: B023
            h = h + perts[i]
            h = h + jnp.tanh(jax.vmap(block.linear)(h))
        return jnp.mean((h - y) ** 2)

    _, vjp = jax.vjp(loss, jnp.zeros((4, *x.shape)))
    cts = vjp(jnp.ones(()))[0]
    want = np.sqrt(np.mean(np.square(cts), axis=(1, 2)))
    np.testing.assert_allclose(ns["grad_rms"], want, rtol=1e-5)
    assert sorted(ns["summaries"]) == sorted(
        [f"model/layer{i}/stream_grad_rms" for i in range(4)]
        + [f"model/layer{i}/stream_rms" for i in range(4)]
    )

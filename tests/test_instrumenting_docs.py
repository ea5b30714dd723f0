"""Runs the code of docs/instrumenting.md against hand-written references (issue 38)."""

import inspect
import pathlib
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tb_events import scalars


PAGE = pathlib.Path(__file__).parent.parent / "docs" / "instrumenting.md"


def _run_page(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    pytest.importorskip("tensorboardX")
    monkeypatch.chdir(tmp_path)  # the page writes to runs/...
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)
    assert len(blocks) == 4
    ns: dict[str, Any] = {"__name__": "instrumenting_page"}
    exec(compile("\n".join(blocks), str(PAGE), "exec"), ns)
    return ns


def close(a: object, b: object) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(
    "scan" not in inspect.signature(eqx.nn.MLP.__init__).parameters,
    reason="the page uses eqx.nn.MLP(scan=True), from Equinox 0.13.5",
)
def test_instrumenting_page(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = _run_page(tmp_path, monkeypatch)

    # 1. The stock MLP: per-layer moments over the batch, in the TensorBoard file.
    mlp, x = ns["mlp"], ns["x"]
    first, hidden, last = mlp.layers
    layers = [
        first,
        *[jax.tree_util.tree_map(lambda a, i=i: a[i], hidden) for i in range(5)],
        last,
    ]
    names = ["layers_0", *(f"layers_1/layer{i}" for i in range(5)), "layers_2"]
    logged = scalars(str(tmp_path / "runs" / "mlp"))
    h = x
    for i, (layer, name) in enumerate(zip(layers, names, strict=True)):
        h = jax.vmap(layer)(h)
        close(logged[(0, f"{name}/moments/mean")], jnp.mean(h))
        close(logged[(0, f"{name}/moments/variance")], jnp.var(h))
        close(logged[(0, f"{name}/moments/max")], jnp.max(h))
        if i < len(layers) - 1:
            h = jax.nn.relu(h)
    assert len(logged) == 7 * 6

    # 2. The transformer: forward and gradient RMS per layer, against a Python loop
    # over the layers with zero perturbations added at each point (jax.grad).
    model, tokens, targets = ns["first"], ns["tokens"], ns["targets"]
    params, static = eqx.partition(model.blocks, eqx.is_array)
    blocks = [
        eqx.combine(jax.tree_util.tree_map(lambda a, i=i: a[i], params), static)
        for i in range(3)
    ]

    def loss(perts: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, list[Any]]]:
        x = jax.vmap(model.embed)(tokens)
        outs: dict[str, list[Any]] = {"attn": [], "block": []}
        for i, b in enumerate(blocks):
            h = jax.vmap(b.norm1)(x)
            a = b.attn(h, h, h) + perts["attn"][i]
            x = x + a
            x = x + jax.vmap(b.mlp)(jax.vmap(b.norm2)(x)) + perts["block"][i]
            outs["attn"].append(a)
            outs["block"].append(x)
        logp = jax.nn.log_softmax(jax.vmap(model.head)(x))
        value = -jnp.mean(jnp.take_along_axis(logp, targets[:, None], axis=1))
        return value, outs

    zeros = {k: jnp.zeros((3, 8, 16)) for k in ("attn", "block")}
    cts, outs = jax.grad(loss, has_aux=True)(zeros)
    value = loss(zeros)[0]
    logged = scalars(str(tmp_path / "runs" / "gpt"))
    close(logged[(0, "loss")], value)
    rms = ns["rms"]
    for i in range(3):
        for point, path in (("attn", "blocks/attn"), ("block", "blocks")):
            close(logged[(0, f"{path}/layer{i}/rms")], rms(outs[point][i]))
            close(logged[(0, f"{path}/layer{i}/grad_rms")], rms(cts[point][i]))
    assert {tag for step, tag in logged if step == 2} == {
        tag for step, tag in logged if step == 0
    }
    assert len({tag for _, tag in logged}) == 1 + 3 * 4
    # The step's gradients equal eqx.filter_value_and_grad's (the model moved by them).
    grads = eqx.filter_grad(ns["loss_fn"])(model, tokens, targets)
    want = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))
    after_one, _ = ns["train_step"](model, tokens, targets)
    assert eqx.tree_equal(after_one, want, rtol=1e-5, atol=1e-6)

    # 3. Activation patching: each layer's patched run equals the hand-patched loop.
    gpt, clean, corrupted = ns["gpt"], ns["clean"], ns["corrupted"]
    params, static = eqx.partition(gpt.blocks, eqx.is_array)
    blocks = [
        eqx.combine(jax.tree_util.tree_map(lambda a, i=i: a[i], params), static)
        for i in range(3)
    ]

    def forward(t: jax.Array, patch_at: int | None, cache: list[Any]) -> Any:
        x = jax.vmap(gpt.embed)(t)
        seen = []
        for i, b in enumerate(blocks):
            x = cache[i] if i == patch_at else b(x)
            seen.append(x)
        return jax.vmap(gpt.head)(x), seen

    clean_logits, clean_cache = forward(clean, None, [])
    corrupted_logits, _ = forward(corrupted, None, [])
    gap = jnp.sum((corrupted_logits - clean_logits) ** 2)
    assert float(gap) > 0
    for i in range(3):
        patched, _ = forward(corrupted, i, clean_cache)
        close(ns["recovered"][i], 1 - jnp.sum((patched - clean_logits) ** 2) / gap)
    close(ns["recovered"][-1], 1.0)

"""Plain Equinox models, written without eqxctx, that the capture tests instrument."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray


class Block(eqx.Module):
    """A pre-norm transformer block: attention and an MLP over tokens."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim: int, heads: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attn = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, 2 * dim, 1, key=k2)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.mlp)(h)


class GPT(eqx.Module):
    """Token embedding, `depth` blocks (stacked `[depth, ...]`, run by a scan)."""

    embed: eqx.nn.Embedding
    blocks: Block
    head: eqx.nn.Linear

    def __init__(
        self, vocab: int, dim: int, heads: int, depth: int, *, key: PRNGKeyArray
    ):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=k1)
        # Stacked `[depth, ...]` as `eqx.filter_vmap(Block)` would (other values):
        # built one by one, each depth costs no new compilation of the initialisers
        # (under vmap, every new depth compiled them again, seconds each).
        layers = [Block(dim, heads, key=k) for k in jax.random.split(k2, depth)]
        arrays = [eqx.filter(layer, eqx.is_array) for layer in layers]
        stacked = jax.tree.map(lambda *a: jnp.asarray(np.stack(a)), *arrays)
        self.blocks = eqx.combine(
            stacked, eqx.filter(layers[0], eqx.is_array, inverse=True)
        )
        self.head = eqx.nn.Linear(dim, vocab, key=k3)

    def __call__(self, tokens: Array) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(tokens)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def body(x: Array, layer: Block) -> tuple[Array, None]:
            return eqx.combine(layer, static)(x), None

        x, _ = jax.lax.scan(body, x, dynamic)
        return jax.vmap(self.head)(x)

    def layers(self) -> list[Block]:
        """The blocks one by one (the reference's Python loop)."""
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        depth = jax.tree_util.tree_leaves(dynamic)[0].shape[0]
        return [
            eqx.combine(jax.tree_util.tree_map(lambda a, i=i: a[i], dynamic), static)
            for i in range(depth)
        ]


def gpt_reference(
    model: GPT, tokens: Array, *, ablate_attn: int | None = None
) -> tuple[Array, list[dict[str, Array]]]:
    """The forward as a Python loop over layers, with each block's intermediates.

    `ablate_attn`: the layer whose attention output is zeroed (None: none).
    """
    x = jax.vmap(model.embed)(tokens)
    per_layer: list[dict[str, Array]] = []
    for i, block in enumerate(model.layers()):
        h = jax.vmap(block.norm1)(x)
        attn = block.attn(h, h, h)
        if i == ablate_attn:
            attn = jnp.zeros_like(attn)
        x = x + attn
        h = jax.vmap(block.norm2)(x)
        mlp = jax.vmap(block.mlp)(h)
        x = x + mlp
        per_layer.append({"attn": attn, "mlp": mlp, "block": x})
    return jax.vmap(model.head)(x), per_layer


def mlp_reference(mlp: eqx.nn.MLP, x: Array) -> list[Array]:
    """The outputs of an `eqx.nn.MLP`'s linear layers, one by one (ReLU)."""
    layers = mlp.layers
    if getattr(mlp, "scan", False):  # (Equinox >= 0.13.5)
        first, hidden, last = layers
        n = jax.tree_util.tree_leaves(hidden)[0].shape[0]
        layers = [
            first,
            *[jax.tree_util.tree_map(lambda a, i=i: a[i], hidden) for i in range(n)],
            last,
        ]
    outs: list[Array] = []
    h = x
    for i, layer in enumerate(layers):
        h = layer(h)
        outs.append(h)
        if i < len(layers) - 1:
            h = jax.nn.relu(h)
    return outs


def rms(y: Array) -> Array:
    """The root mean square of `y`, float32."""
    return jnp.sqrt(jnp.mean(jnp.square(y.astype(jnp.float32))))


def gpt_perturbed(
    model: GPT, tokens: Array, perts: dict[str, Array]
) -> Float[Array, "seq vocab"]:
    """The Python-loop forward with `perts[name][i]` added to layer i's `name` output.

    With zero perturbations it is the forward; `jax.vjp` with respect to `perts`
    gives the cotangent at each point's output, per layer (the gradient reference).
    """
    x = jax.vmap(model.embed)(tokens)
    for i, block in enumerate(model.layers()):
        h = jax.vmap(block.norm1)(x)
        x = x + block.attn(h, h, h) + perts["attn"][i]
        h = jax.vmap(block.norm2)(x)
        x = x + jax.vmap(block.mlp)(h) + perts["mlp"][i]
        x = x + perts["block"][i]
    return jax.vmap(model.head)(x)

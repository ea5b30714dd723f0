"""The model: an embedding, L residual blocks scanned with `scan_in_context`, a head."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqxctx


NUM_PIXELS = 64
NUM_CLASSES = 10
#: The logits' histogram: 40 buckets of width 1 over [-20, 20].
LOGIT_BINS = 40
LOGIT_RANGE = (-20.0, 20.0)


def weighted_mean(x: Float[Array, " batch"], weight: Float[Array, " batch"]) -> Array:
    """Return `sum(x * weight) / sum(weight)` (0 when all weights are 0)."""
    total = jnp.sum(weight)
    return jnp.sum(x * weight) / jnp.maximum(total, 1.0)


class Block(eqx.Module):
    """A pre-norm residual MLP block: `h + down(dropout(gelu(up(norm(h)))))`.

    Adds the summaries `activation_rms` (RMS of the block's output) and
    `update_ratio` (`|update| / |residual|` per example), both `WeightedSummary`s
    weighted by the batch's example weights, and the module output `hidden` (the
    block's output, `[batch, width]`). It probes the residual stream entering the
    block with `ctx.add_gradient_summary("stream_grad_rms", h)`: under
    `eqxctx.value_and_grad` (the training step) the RMS of the loss's gradient with
    respect to `h`; elsewhere (evaluation) nothing. In training it also adds
    `activations`, a
    `MomentsSummary` of the block's output (count, mean, variance, min, max,
    non-finite count, computed on the device; not in evaluation, whose padded
    batches would count their padding). Dropout draws from the context's key and is
    on only when `ctx.is_training`.

    Attributes:
        norm: layer norm over the width.
        up: `width -> 2 * width`.
        down: `2 * width -> width`.
        dropout: the drop probability, static.
    """

    norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    dropout: float = eqx.field(static=True)

    def __init__(self, width: int, *, dropout: float, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(width)
        self.up = eqx.nn.Linear(width, 2 * width, key=k1)
        self.down = eqx.nn.Linear(2 * width, width, key=k2)
        self.dropout = dropout

    def __call__(
        self,
        h: Float[Array, "batch width"],
        weight: Float[Array, " batch"],
        ctx: eqxctx.Context,
    ) -> tuple[Float[Array, "batch width"], eqxctx.Context]:
        """Return the block's output and the context with its outputs added."""
        h, ctx = ctx.add_gradient_summary("stream_grad_rms", h)
        u = jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.norm)(h)))
        if ctx.is_training and self.dropout > 0:
            keep = jax.random.bernoulli(ctx.prng_key, 1.0 - self.dropout, u.shape)
            u = jnp.where(keep, u / (1.0 - self.dropout), 0.0)
        update = jax.vmap(self.down)(u)
        out = h + update
        total = jnp.sum(weight)
        rms = jnp.sqrt(weighted_mean(jnp.mean(out**2, axis=-1), weight))
        ratio = jnp.linalg.norm(update, axis=-1) / (jnp.linalg.norm(h, axis=-1) + 1e-6)
        ctx = ctx.add_summary("activation_rms", eqxctx.WeightedSummary(rms, total))
        ratio_mean = weighted_mean(ratio, weight)
        ctx = ctx.add_summary("update_ratio", eqxctx.WeightedSummary(ratio_mean, total))
        if ctx.is_training:
            ctx = ctx.add_summary("activations", eqxctx.MomentsSummary(out))
        ctx = ctx.add_module_output("hidden", out)
        return out, ctx


class Classifier(eqx.Module):
    """Digits classifier: embedding, `num_layers` stacked `Block`s, classifier head.

    The blocks' parameters are stacked with `eqx.filter_vmap` (leading axis
    `num_layers`) and run with `eqxctx.scan_in_context` inside the child context
    `layers`, so their summaries land under `layers/iter0/...`,
    `layers/iter1/...` and their hidden states under `layers/iter/hidden`
    (`[num_layers, batch, width]`).

    Attributes:
        embed: `64 -> width`, the pixel embedding.
        blocks: a `Block` whose array leaves have a leading axis `num_layers`.
        head_norm: layer norm before the head.
        head: `width -> 10`, the logits.
    """

    embed: eqx.nn.Linear
    blocks: Block
    head_norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(
        self, *, num_layers: int, width: int, dropout: float, key: PRNGKeyArray
    ):
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        self.embed = eqx.nn.Linear(NUM_PIXELS, width, key=k_embed)
        make = lambda k: Block(width, dropout=dropout, key=k)
        self.blocks = eqx.filter_vmap(make)(jax.random.split(k_blocks, num_layers))
        self.head_norm = eqx.nn.LayerNorm(width)
        self.head = eqx.nn.Linear(width, NUM_CLASSES, key=k_head)

    def _layers(
        self,
        h: Float[Array, "batch width"],
        weight: Float[Array, " batch"],
        ctx: eqxctx.Context,
    ) -> tuple[Float[Array, "batch width"], eqxctx.Context]:
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def body(
            h: Float[Array, "batch width"], layer_params: Block, ctx_i: eqxctx.Context
        ) -> tuple[Float[Array, "batch width"], None, eqxctx.Context]:
            h, ctx_i = eqx.combine(layer_params, static)(h, weight, ctx_i)
            return h, None, ctx_i

        h, _, collection = eqxctx.scan_in_context(body, context=ctx, carry=h, xs=params)
        return h, ctx.merge(collection)

    def logits(
        self,
        images: Float[Array, "batch 64"],
        weight: Float[Array, " batch"],
        ctx: eqxctx.Context,
    ) -> tuple[Float[Array, "batch 10"], eqxctx.Context]:
        """Return the logits; the blocks' outputs go to the child context `layers`."""
        h = jax.vmap(self.embed)(images)
        h, ctx = ctx.call("layers", self._layers, h, weight)
        return jax.vmap(self.head)(jax.vmap(self.head_norm)(h)), ctx

    def evaluate(
        self, batch: dict[str, Array], ctx: eqxctx.Context
    ) -> tuple[dict[str, Array], eqxctx.Context]:
        """Return per-example losses and predictions; add `loss`/`accuracy` summaries.

        Args:
            batch: `{"image": float32[batch, 64], "label": int32[batch],
                "weight": float32[batch]}`; examples of weight 0 (padding) do not
                count.
            ctx: the context.

        Returns:
            `({"nll": float32[batch], "predictions": int32[batch]}, ctx)`: the
            cross-entropy and the predicted digit of each example. The weighted mean
            cross-entropy is the summary `loss` and the weighted accuracy the summary
            `accuracy` (both `WeightedSummary`s, weighted by the number of real
            examples). In training, `logits` is a `HistogramSummary` of the logits
            (`LOGIT_BINS` buckets over `LOGIT_RANGE`, counted on the device).
        """
        weight = batch["weight"]
        logits, ctx = self.logits(batch["image"], weight, ctx)
        labels: Int[Array, " batch"] = batch["label"]
        log_probs = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(log_probs, labels[:, None], axis=1)[:, 0]
        predictions = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        correct = (predictions == labels).astype(jnp.float32)
        total = jnp.sum(weight)
        loss = eqxctx.WeightedSummary(weighted_mean(nll, weight), total)
        ctx = ctx.add_summary("loss", loss)
        accuracy = eqxctx.WeightedSummary(weighted_mean(correct, weight), total)
        ctx = ctx.add_summary("accuracy", accuracy)
        if ctx.is_training:
            hist = eqxctx.HistogramSummary(logits, bins=LOGIT_BINS, range=LOGIT_RANGE)
            ctx = ctx.add_summary("logits", hist)
        return {"nll": nll, "predictions": predictions}, ctx

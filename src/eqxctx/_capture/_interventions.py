"""Interventions: what a hook point does to its output before it flows on."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Int


class Intervention(eqx.Module):
    """A change applied to a hook point's output, per call (per layer of a stack).

    Make one with `replace_with`, `zero_ablate`, `mean_ablate`, `add_vector` or
    `apply_function`, and pass it as `Tap(..., intervene=...)`. Except for
    `apply_function`, the output must be one array.

    Attributes:
        kind: `"replace"`, `"add"`, `"mean"` or `"apply"`, static.
        value: the replacement or the added vector (traced), or None. With
            `per_layer=True` its leading axes are the stack's (`[L, ...]` for a
            scanned stack of L layers): each layer gets its slice.
        per_layer: whether `value` holds one slice per layer, static.
        axis: the axes `"mean"` averages over, static.
        fn: `"apply"`'s function `fn(y, layer) -> y`, static.
    """

    kind: str = eqx.field(static=True)
    value: Array | None
    per_layer: bool = eqx.field(static=True)
    axis: int | tuple[int, ...] | None = eqx.field(static=True)
    fn: Callable[[Any, Int[Array, ""]], Any] | None = eqx.field(static=True)

    def __call__(self, y: Any, layer: Int[Array, ""]) -> Any:
        """Return the changed output; `layer` is the flat layer index (0 if none)."""
        if self.kind == "apply":
            assert self.fn is not None
            return self.fn(y, layer)
        if not isinstance(y, jax.Array):
            raise TypeError(
                f"`eqxctx.{self.kind}` interventions need a point whose output is "
                f"one array; got {type(y).__name__}. Use `eqxctx.apply_function`."
            )
        if self.kind == "mean":
            return jnp.broadcast_to(jnp.mean(y, axis=self.axis, keepdims=True), y.shape)
        assert self.value is not None
        value = self.value.astype(y.dtype)
        if self.kind == "add":
            return y + value
        return jnp.broadcast_to(value, y.shape)


def replace_with(value: ArrayLike, *, per_layer: bool = False) -> Intervention:
    """Replace the point's output with `value` (broadcast to the output's shape).

    Args:
        value: the new output (cast to the output's dtype); with `per_layer=True`,
            stacked with the stack's leading axes (`[L, *output]`), as `capture`
            returns a stacked point's output: caching it and patching it back gives
            bit-identical results.
        per_layer: whether `value` holds one slice per layer.

    Returns:
        An `Intervention`.
    """
    return Intervention("replace", jnp.asarray(value), per_layer, None, None)


def zero_ablate() -> Intervention:
    """Replace the point's output with zeros (zero-ablation)."""
    return Intervention("replace", jnp.zeros(()), False, None, None)


def mean_ablate(axis: int | tuple[int, ...] | None = None) -> Intervention:
    """Replace the point's output with its mean over `axis` (mean-ablation).

    Args:
        axis: the axes of the output (as the module returns it, per call) to
            average over, e.g. `0` for the sequence positions of a `[T, D]`
            output; None averages over all. To ablate with a mean taken over a
            data set, compute it with `capture` and use `replace_with`.
    """
    return Intervention("mean", None, False, axis, None)


def add_vector(vector: ArrayLike, *, per_layer: bool = False) -> Intervention:
    """Add `vector` to the point's output (broadcast; activation steering).

    Args:
        vector: added to the output (cast to its dtype); with `per_layer=True`,
            stacked with the stack's leading axes (`[L, ...]`).
        per_layer: whether `vector` holds one slice per layer.
    """
    return Intervention("add", jnp.asarray(vector), per_layer, None, None)


def apply_function(fn: Callable[[Any, Int[Array, ""]], Any]) -> Intervention:
    """Replace the point's output `y` with `fn(y, layer)`.

    Args:
        fn: `fn(y, layer) -> y'` with the same structure, shapes and dtypes; `layer`
            is the int32 index of the layer in a stacked point (flattened over
            nested stacks), 0 for a point that is not stacked. Static: use a
            function defined once (not a new lambda per step) to keep `jax.jit`'s
            cache.
    """
    return Intervention("apply", None, False, None, fn)

"""`Tap` (what to do at selected points) and the wrapper module that does it.

A selected point's module is replaced (`eqx.tree_at`) by a `Tapped` module that calls
it, applies the tap's intervention and records. On the ref path (`_refs`) it writes
its records into `jax.ref` buffers at its layer index. On the sink path, recording
works inside every transformation the user wrote (a `jax.lax.scan` over a
`filter_vmap`-stacked stack, `jax.vmap`, `jax.checkpoint`): the wrapper holds zero
*sink* arrays, stacked like the wrapped
module's arrays, and passes its output through `_emit`, a `jax.custom_vjp` identity
whose backward pass returns the recorded values (computed in the forward pass) as the
sinks' cotangents; `capture` differentiates with respect to the sinks with zero output
cotangents, and XLA removes everything but the recorded values (the mechanism of the
gradient probes, `_gradients.py`). A `jax.vmap` inside the function that maps the
input but not the model would add the examples' cotangents up: `_claim`
(`jax.custom_batching.custom_vmap`) reads the sinks' next axis as that vmap's axis
instead, so each example fills its own slice.

Shape pass: the wrapper holds one float32 *marker* instead of sinks, shaped like the
leading axes the point's arrays share; where it is called, the axes the marker lost
are the stack's axes, and `_probe` (also a `custom_vmap`) sees the vmaps around it.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jaxtyping import Array, ArrayLike

from eqxctx._context import Context
from eqxctx._gradients import rms
from eqxctx._sinks import to_sink
from eqxctx._summary import Summary, is_array_leaf

from ._interventions import Intervention, apply_function
from ._points import Selection, leaf_suffix
from ._refs import Buffers, tag


class Tap(eqx.Module):
    """What `capture` does at the hook points a selection names.

    Attributes:
        at: the selection: a point's name (`"blocks.attn"`) or a glob over names
            (`"layers[*]"`, `*` matching any characters and `?` one; brackets are
            literal), a module type (`eqx.nn.Linear`), an `eqx.tree_at`-style
            `where(model) -> node or nodes`, or a list of these.
        output: record each point's output as the module output `"output"`; of
            an output that is a PyTree (`(y, aux)`), each array leaf as
            `"output_{path}"` (`output_0`, `output_1_sq` for `aux["sq"]`).
        summaries: `{name: fn}` with `fn(output) -> array or Summary`, computed on
            the device where the point runs (e.g. `{"moments": eqxctx.MomentsSummary}`
            or `{"rms": lambda y: jnp.sqrt(jnp.mean(y**2))}`). Names are summary
            names (non-empty, no `/`).
        intervene: an `Intervention` (`replace_with`, `zero_ablate`, `mean_ablate`,
            `add_vector`, `apply_function`) or a function `fn(output, layer) -> output`,
            applied before recording.
        layers: the flat layer indices of a stacked point where `intervene` acts
            (None: all); `0 <= i < L` (`capture` raises otherwise), and only with
            `intervene`.
        gradient_summaries: `{name: fn}` with `fn(cotangent) -> array or Summary`,
            the backward pass's statistics of the point's output: `cotangent` is the
            gradient of the loss with respect to the output (one floating-point
            array, shaped like it); `None` for `fn` is the float32 root mean square
            (as in `Context.add_gradient_summary`). Only `capture_value_and_grad`
            fills these in; names must differ from `summaries`'.
        gradient_output: record the cotangent itself as the module output
            `"gradient"` (only under `capture_value_and_grad`).

    Raises:
        TypeError: for `layers` that are not ints, or an `intervene` that is not
            an `Intervention` or a function.
        ValueError: for `layers` without `intervene`, or a name given both as a
            summary and as a gradient summary.
    """

    # The intervention's arrays are traced under `eqx.filter_jit`; the rest is static.
    at: Selection = eqx.field(static=True)
    output: bool = eqx.field(static=True)
    summaries: tuple[tuple[str, Callable[[Any], Any]], ...] = eqx.field(static=True)
    intervene: Intervention | None
    layers: tuple[int, ...] | None = eqx.field(static=True)
    gradient_summaries: tuple[tuple[str, Callable[[Any], Any]], ...] = eqx.field(
        static=True
    )
    gradient_output: bool = eqx.field(static=True)

    def __init__(
        self,
        at: Selection,
        *,
        output: bool = False,
        summaries: Mapping[str, Callable[[Any], Any]] | None = None,
        intervene: Intervention | Callable[[Any, Array], Any] | None = None,
        layers: Sequence[int] | None = None,
        gradient_summaries: Mapping[str, Callable[[Any], Any] | None] | None = None,
        gradient_output: bool = False,
    ):
        for flag, value in (("output", output), ("gradient_output", gradient_output)):
            if not isinstance(value, bool):  # pyright: ignore[reportUnnecessaryIsInstance]
                raise TypeError(
                    f"`eqxctx.Tap({flag}=...)`: expected a bool, got {value!r}."
                )
        pairs = _named_functions(summaries or {}, "summaries", "the output")
        grad_pairs = _named_functions(
            {k: rms if f is None else f for k, f in (gradient_summaries or {}).items()},
            "gradient_summaries",
            "the cotangent",
        )
        both = {n for n, _ in pairs} & {n for n, _ in grad_pairs}
        if both:
            raise ValueError(
                f"`eqxctx.Tap`: the names {sorted(both)} are both `summaries` and "
                "`gradient_summaries`; forward and backward summaries of a point "
                "share one level of the collection, so give them different names."
            )
        if intervene is not None and not isinstance(intervene, Intervention):
            if not callable(intervene):
                raise TypeError(
                    "`eqxctx.Tap(intervene=...)`: expected an Intervention or a "
                    f"function `fn(output, layer)`, got {intervene!r}."
                )
            intervene = apply_function(intervene)
        if layers is not None and intervene is None:
            raise ValueError(
                "`eqxctx.Tap`: `layers` selects the layers where `intervene` acts; "
                "it needs `intervene` (records are kept for every layer)."
            )
        if isinstance(at, list):  # hashable, for `eqx.filter_jit`'s static arguments
            at = tuple(at)
        self.at = at
        self.output = output
        self.summaries = pairs
        self.intervene = intervene
        given: list[object] = [] if layers is None else [*layers]  # checked here
        if isinstance(layers, str) or not all(
            isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in given
        ):
            raise TypeError(
                "`eqxctx.Tap`: `layers` must be a sequence of ints (flat layer "
                f"indices of the stack), got {layers!r}."
            )
        self.layers = None if layers is None else tuple(int(i) for i in layers)
        self.gradient_summaries = grad_pairs
        self.gradient_output = gradient_output

    @property
    def records(self) -> bool:
        """Whether the tap records anything (forward or backward)."""
        return self.output or bool(self.summaries) or self.gradients

    @property
    def gradients(self) -> bool:
        """Whether the tap records anything in the backward pass."""
        return self.gradient_output or bool(self.gradient_summaries)


def _named_functions(
    fns: Mapping[str, Any], field: str, of: str
) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    pairs = tuple(fns.items())
    for name, fn in pairs:
        if not isinstance(name, str) or not name or "/" in name:  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ValueError(
                f"`eqxctx.Tap({field}=...)`: invalid summary name {name!r}; "
                "names are non-empty strings without '/'."
            )
        if not callable(fn):
            raise TypeError(
                f"`eqxctx.Tap({field}=...)`: {name!r}: expected a function of "
                f"{of}, got {fn!r}."
            )
    return pairs


@dataclasses.dataclass
class Call:
    """What the shape pass saw at one call of a point (static)."""

    depth: int  # stack axes: leading axes the marker lost
    log: dict[int, tuple[int, bool]]  # the vmaps around it (see `_probe`)
    records: jax.ShapeDtypeStruct | Any  # the spec of `records(output)`
    gradients: Any  # the spec of `gradient_records(output)`
    carrier: bool  # the output has a floating-point array leaf

    @property
    def vmaps(self) -> tuple[int, ...]:
        """The sizes of the vmaps around the call that do not map the model."""
        levels = sorted(self.log, reverse=True)  # outermost first
        return tuple(self.log[k][0] for k in levels if not self.log[k][1])


class Recorder:
    """The shape pass's notes, by point name (plain Python, static values only)."""

    def __init__(self, markers: dict[str, tuple[int, ...]]) -> None:
        self.markers = markers  # the marker's shape in the model, by point
        self.calls: dict[str, list[Call]] = {}


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A wrapper's static configuration (compared by identity)."""

    name: str
    tap: Tap
    recorder: Recorder | None  # set in the shape pass
    vmapped: bool = False  # claim one vmap level in the recording pass
    treedef: Any = None  # of the flat records, recording pass
    buffers: Buffers | None = None  # the ref path's buffers (see `_refs`)


def records(tap: Tap, y: Any, name: str) -> dict[str, Any]:
    """The values `tap` records for output `y` (a dict of PyTrees)."""
    out: dict[str, Any] = {}
    if tap.output and eqx.is_array(y):
        out["output"] = y
    elif tap.output:  # a PyTree: each array leaf, named by its path in `y`
        for key_path, leaf in jax.tree_util.tree_leaves_with_path(y):
            if eqx.is_array(leaf):
                out[f"output_{leaf_suffix(key_path)}"] = leaf
    out.update(_summaries(tap.summaries, y, name))
    return out


def gradient_records(tap: Tap, ct: Any, name: str) -> dict[str, Any]:
    """The values `tap` records for the cotangent `ct` of a point's output."""
    if not tap.gradients:
        return {}
    if not eqx.is_inexact_array(ct):
        raise TypeError(
            f"`eqxctx.capture_value_and_grad`: the hook point {name!r} returns "
            f"{type(ct).__name__}; gradient taps need a point whose output is one "
            "floating-point array (select the module that computes it)."
        )
    out: dict[str, Any] = {"gradient": ct} if tap.gradient_output else {}
    out.update(_summaries(tap.gradient_summaries, ct, name))
    return out


def _summaries(
    fns: tuple[tuple[str, Callable[[Any], Any]], ...], y: Any, name: str
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, fn in fns:
        value = fn(y)
        if not isinstance(value, Summary):
            if not is_array_leaf(value):
                raise TypeError(
                    f"`eqxctx.capture`: the summary {key!r} at {name!r} returned "
                    f"{type(value).__name__}; return an array or a `Summary`."
                )
            value = jnp.asarray(value)
        out[f"summary:{key}"] = value
    return out


def _carrier_index(leaves: list[Any]) -> int | None:
    for i, leaf in enumerate(leaves):
        if eqx.is_inexact_array(leaf):
            return i
    return None


@jax.custom_vjp
def _emit(carrier: Array, sinks: tuple[Array, ...], values: tuple[Array, ...]) -> Array:
    del sinks, values
    return carrier


def _emit_fwd(
    carrier: Array, sinks: tuple[Array, ...], values: tuple[Array, ...]
) -> tuple[Array, tuple[Array, ...]]:
    del sinks
    return carrier, values


def _emit_bwd(
    values: tuple[ArrayLike, ...], ct: Array
) -> tuple[Array, tuple[Array, ...], None]:
    # A constant record (the call count) comes back as a NumPy residual. The
    # records' own cotangent is a symbolic zero (None): the model's backward pass
    # gets nothing to add, and a loss of the records differentiates through them.
    return ct, tuple(jnp.asarray(v) for v in values), None


_emit.defvjp(_emit_fwd, _emit_bwd)


@custom_vmap
def _claim(sinks: tuple[Array, ...], carrier: Array) -> tuple[Array, ...]:
    del carrier
    return tuple(s[0] for s in sinks)


@_claim.def_vmap
def _claim_rule(
    axis_size: int,
    in_batched: Any,
    sinks: tuple[Array, ...],
    carrier: Array,
) -> tuple[tuple[Array, ...], Any]:
    del axis_size, carrier
    # The sinks' leading axis is this vmap's: each example reads (and, transposed,
    # writes) its own slice.
    if any(in_batched[0]):
        return jax.vmap(lambda s: tuple(x[0] for x in s))(sinks), in_batched[0]
    return sinks, tuple(True for _ in sinks)


def _probe(marker: Array, carrier: Array, log: dict[int, tuple[int, bool]]) -> None:
    """Note `{level: (axis size, maps the model)}` of the vmaps around this call.

    Level 0 is the innermost. A rule fires when its vmap batches the call, which for
    a call in a loop body is when the loop is batched (after the body was traced,
    perhaps more than once): the log is read after the shape pass.
    """

    def make(level: int) -> Callable[[Array, Array], Array]:
        @custom_vmap
        def probe(marker: Array, carrier: Array) -> Array:
            del marker
            return carrier

        @probe.def_vmap
        def rule(
            axis_size: int, in_batched: Any, marker: Array, carrier: Array
        ) -> tuple[Array, bool]:
            log[level] = (axis_size, bool(in_batched[0]))
            make(level + 1)(marker[0] if in_batched[0] else marker, carrier)
            return carrier, in_batched[1]

        return probe

    make(0)(marker, carrier)


def _gradient_probe(
    y: Array, sinks: tuple[Array, ...], fn: Callable[[Array], list[Array]]
) -> Array:
    """`y`, whose backward pass emits `fn(cotangent)` as the cotangents of `sinks`."""

    @jax.custom_vjp
    def identity(y: Array, sinks: tuple[Array, ...]) -> Array:
        del sinks
        return y

    def fwd(y: Array, sinks: tuple[Array, ...]) -> tuple[Array, None]:
        del sinks
        return y, None

    def bwd(_: None, ct: Array) -> tuple[Array, tuple[Array, ...]]:
        values = fn(ct)
        return ct, tuple(
            to_sink(v, s.dtype) for v, s in zip(values, sinks, strict=True)
        )

    identity.defvjp(fwd, bwd)
    return identity(y, sinks)


def split_context(out: Any) -> tuple[Any, Any]:
    """Split a module's `(y, ctx)` result (it threads a context); else `(out, None)`."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Context):
        return out[0], out[1]
    return out, None


class Tapped(eqx.Module):
    """The module put in place of a selected point: calls it, intervenes, records.

    A module that threads a context (`module(x, ctx) -> (y, ctx)`) is handled: its
    output is `y`, and its context passes through untouched.

    Attributes:
        module: the wrapped module (unchanged).
        sinks: the marker (shape pass) or the zero sinks of the records, then the
            number of calls, stacked `[*stack, *vmaps, *leaf]`.
        gradient_sinks: the zero sinks of the gradient records, stacked alike.
        intervention: the tap's intervention, its arrays stacked like the sinks.
        layer: the flat layer index, int32 `[*stack]`, where an intervention needs it.
        plan: static configuration.
    """

    module: Any
    sinks: tuple[Array, ...]
    gradient_sinks: tuple[Array, ...]
    intervention: Intervention | None
    layer: Array | None
    plan: Plan = eqx.field(static=True)

    def __getattr__(self, name: str) -> Any:
        # Code that reads the wrapped module's fields (`mlp.layers[1].weight`) keeps
        # working; only `__call__` is a hook point call.
        if name.startswith("__") or name in ("module", "sinks", "plan"):
            raise AttributeError(name)
        return getattr(self.module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        y, ctx = split_context(self.module(*args, **kwargs))
        y = self._run(y)
        return y if ctx is None else (y, ctx)

    def _run(self, y: Any) -> Any:
        plan = self.plan
        tap = plan.tap
        if plan.recorder is not None:
            return self._shapes(y)
        if self.intervention is not None:
            layer = jnp.zeros((), jnp.int32) if self.layer is None else self.layer
            intervention = self.intervention
            if (
                plan.vmapped
                and intervention.per_layer
                and intervention.value is not None
            ):
                # A per-layer value as `capture` returns it: `[*stack, vmap, ...]`.
                leaves = jax.tree_util.tree_leaves(y)
                carrier = leaves[_carrier_index(leaves) or 0]
                (value,) = _claim((intervention.value,), jax.lax.stop_gradient(carrier))
                intervention = eqx.tree_at(lambda t: t.value, intervention, value)
            new = intervention(y, layer)
            if tap.layers is not None:
                keep = jnp.isin(layer, jnp.asarray(tap.layers, jnp.int32))
                new = jax.tree.map(lambda a, b: jnp.where(keep, a, b), new, y)
            y = new
        if plan.buffers is not None:  # the ref path: write where it runs
            values = jax.tree_util.tree_leaves(records(tap, y, plan.name))
            plan.buffers.write(values, self.layer)
            return y
        if not self.sinks:
            return y
        values = jax.tree_util.tree_leaves(records(tap, y, plan.name))
        values = [
            to_sink(v, s.dtype) for v, s in zip(values, self.sinks[:-1], strict=True)
        ]
        values.append(jnp.ones((), self.sinks[-1].dtype))  # the number of calls
        leaves, treedef = jax.tree_util.tree_flatten(y)
        i = _carrier_index(leaves)
        assert i is not None  # checked in the shape pass
        sinks = (*self.sinks, *self.gradient_sinks)
        if plan.vmapped:
            sinks = _claim(sinks, jax.lax.stop_gradient(leaves[i]))
        sinks, gradient_sinks = sinks[: len(self.sinks)], sinks[len(self.sinks) :]
        leaves[i] = _emit(leaves[i], sinks, tuple(values))
        if gradient_sinks:  # the output is one array (checked in the shape pass)

            def fn(ct: Array) -> list[Array]:
                return jax.tree_util.tree_leaves(gradient_records(tap, ct, plan.name))

            leaves[i] = _gradient_probe(leaves[i], gradient_sinks, fn)
        return treedef.unflatten(leaves)

    def _shapes(self, y: Any) -> Any:
        plan = self.plan
        assert plan.recorder is not None
        (marker,) = self.sinks
        full = plan.recorder.markers[plan.name]
        depth = len(full) - marker.ndim
        if depth < 0 or tuple(marker.shape) != full[depth:]:
            raise ValueError(
                f"`eqxctx.capture`: the point {plan.name!r} is called with its arrays "
                "mapped over an axis that is not their leading axis (shape "
                f"{full} in the model, {tuple(marker.shape)} where it runs); capture "
                "supports stacks mapped over leading axes (`jax.lax.scan`, "
                "`jax.vmap` with `in_axes=0`)."
            )
        log: dict[int, tuple[int, bool]] = {}
        leaves, treedef = jax.tree_util.tree_flatten(y)
        i = _carrier_index(leaves)
        if i is not None:
            _probe(marker, leaves[i], log)
            leaves[i] = tag(leaves[i], plan.name)  # (found by `_refs.enclosing`)
            y = treedef.unflatten(leaves)
        spec = eqx.filter_eval_shape(lambda y: records(plan.tap, y, plan.name), y)
        grad_spec = eqx.filter_eval_shape(
            lambda y: gradient_records(plan.tap, y, plan.name), y
        )
        plan.recorder.calls.setdefault(plan.name, []).append(
            Call(depth, log, spec, grad_spec, i is not None)
        )
        return y

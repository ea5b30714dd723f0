"""One capture session: the chosen points, the shape pass, the sinks, the layout."""

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqxctx._collection import OutputCollection
from eqxctx._iterations import IterationSummaries
from eqxctx._leaves import validate_child_name
from eqxctx._propagate import propagate_repeated_output_collections
from eqxctx._sinks import from_sink, sink_layout

from ._interventions import Intervention
from ._points import HookPoint, get_node, select
from ._refs import Buffers, available, enclosing, has_checkpoint, once_per_layer
from ._tap import Call, Plan, Recorder, Tap, Tapped


R = TypeVar("R")
_CALLS_MESSAGE = (
    "`eqxctx.capture`: a hook point that records did not run exactly once (per "
    "layer of its stack, per example of a `jax.vmap` inside fn). It runs 0 times in "
    "a `jax.lax.cond` branch not taken (and, where capture records through sinks, "
    "if its output does not reach fn's floating-point result: an unused value, a "
    "result computed through `argmax`), and more "
    "than once in a loop or `jax.vmap` that does not map the model's arrays (a "
    "generation loop: call `capture` inside the loop instead)."
)


def _marker_shape(model: object, point: HookPoint) -> tuple[int, ...]:
    """The leading shape shared by the arrays of the point (or its nearest parent)."""
    for n in range(len(point.key_path), -1, -1):
        node = get_node(model, point.key_path[:n])
        leaves = jax.tree_util.tree_leaves(node)
        shapes = [np.shape(x) for x in leaves if eqx.is_array(x)]
        if shapes:
            dims = zip(*shapes, strict=False)  # up to the lowest rank
            same = itertools.takewhile(lambda d: len(set(d)) == 1, dims)
            return tuple(d[0] for d in same)
    return ()


def _wrap(model: R, wrappers: dict[HookPoint, Callable[[Any], Tapped]]) -> R:
    """Return `model` with each point's module wrapped (deepest points first)."""
    for point in sorted(wrappers, key=lambda p: -len(p.key_path)):
        make = wrappers[point]
        model = eqx.tree_at(
            lambda m, kp=point.key_path: get_node(m, kp),
            model,
            replace_fn=make,
        )
    return model


def _one_call(point: HookPoint, tap: Tap, calls: list[Call]) -> Call:
    if not calls:
        raise ValueError(
            f"`eqxctx.capture`: the hook point {point.name!r} was selected but fn "
            "never called it. Select a point fn calls (only `__call__` is a hook "
            "point call; a method such as `model.encode` calls no point of its own)."
        )
    if tap.records and len(calls) > 1:
        raise ValueError(
            f"`eqxctx.capture`: the hook point {point.name!r} is called {len(calls)} "
            "times in fn, and capture records one call per point (per layer of a "
            "stack). Select the modules at its call sites, or record a parent "
            "module's output instead."
        )
    first = calls[0]
    for c in calls[1:]:
        if (c.depth, c.vmaps) != (first.depth, first.vmaps):
            raise ValueError(
                f"`eqxctx.capture`: the hook point {point.name!r} is called both "
                "inside and outside a stack or vmap; select one call site."
            )
    if tap.records and not first.carrier:
        raise TypeError(
            f"`eqxctx.capture`: the output of the hook point {point.name!r} has no "
            "floating-point array, through which capture carries what it records."
        )
    if tap.records and len(first.vmaps) > 1:
        raise ValueError(
            f"`eqxctx.capture`: the hook point {point.name!r} runs inside "
            f"{len(first.vmaps)} nested `jax.vmap`s that do not map the model; "
            "capture handles one. Call `capture` inside the outer vmap."
        )
    return first


def _prepare(
    intervention: Intervention | None,
    prefix: tuple[int, ...],
    vmaps: tuple[int, ...],
    name: str,
) -> Intervention | None:
    """Stack an intervention's arrays like the point's (the user's scan slices them)."""
    if intervention is None or intervention.value is None:
        return intervention
    value = intervention.value
    if intervention.per_layer:
        lead = (*prefix, *vmaps)
        if not lead or tuple(value.shape[: len(lead)]) != lead:
            raise ValueError(
                f"`eqxctx.capture`: the per-layer intervention at {name!r} has shape "
                f"{tuple(value.shape)}; the point is stacked with leading axes "
                f"{lead} (its layers, then the examples of a `jax.vmap` inside fn), "
                "which the value must start with, as `capture` returns its output."
            )
        if len(vmaps) > 1:
            raise ValueError(
                f"`eqxctx.capture`: the hook point {name!r} runs inside "
                f"{len(vmaps)} nested `jax.vmap`s that do not map the model; a "
                "per-layer intervention handles one."
            )
        return intervention
    if prefix:
        value = jnp.broadcast_to(value, (*prefix, *value.shape))
    return eqx.tree_at(lambda i: i.value, intervention, value)


class Session:
    """One capture: the chosen points, what the shape pass found, the sinks."""

    def __init__(
        self,
        fn: Callable[..., Any],
        model: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tap_list: list[Tap],
        child_name_prefix: str,
        where: str,
    ) -> None:
        validate_child_name(child_name_prefix, where=f"{where}(child_name_prefix=...)")
        self.child_name_prefix = child_name_prefix
        chosen: dict[str, tuple[HookPoint, Tap]] = {}
        for tap in tap_list:
            for point in select(model, tap.at, where=where):
                if point.name in chosen:
                    raise ValueError(
                        f"`{where}`: the hook point {point.name!r} is selected by "
                        "two taps; give each point one tap."
                    )
                chosen[point.name] = (point, tap)
        self.chosen = chosen
        # The sinks of the recording pass: (records + calls, gradient records).
        self.sinks: dict[str, tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]] = {}
        self.refs = False  # whether the ref path may record (see `_refs`)
        self.once: dict[str, bool] = {}
        if not chosen:
            return

        # The shape pass: where each point runs (stack axes, vmaps), what it records.
        markers = {n: _marker_shape(model, p) for n, (p, _) in chosen.items()}
        recorder = Recorder(markers)

        def shape_wrapper(name: str, tap: Tap) -> Callable[[Any], Tapped]:
            marker = jnp.zeros(markers[name], jnp.float32)
            plan = Plan(name, tap, recorder)
            return lambda module: Tapped(module, (marker,), (), None, None, plan)

        shaped = _wrap(model, {p: shape_wrapper(n, t) for n, (p, t) in chosen.items()})
        jaxpr, _, _ = eqx.filter_make_jaxpr(lambda m, a, k: fn(m, *a, **k))(
            shaped, args, kwargs
        )
        self.found = found = {
            n: _one_call(p, t, recorder.calls.get(n, []))
            for n, (p, t) in chosen.items()
        }
        self.prefixes = {n: markers[n][: found[n].depth] for n in chosen}
        for name, (_, tap) in chosen.items():
            n = math.prod(self.prefixes[name])  # 1 if not stacked
            bad = [i for i in tap.layers or () if not 0 <= i < n]
            if bad:
                stacked = "" if self.prefixes[name] else "is not stacked, so it "
                raise ValueError(
                    f"`{where}`: `Tap(layers=...)` at {name!r} holds the index "
                    f"{bad[0]}, but the point {stacked}has {n} layer(s); use indices "
                    f"0 <= i < {n}."
                )
        for name, (_, tap) in chosen.items():
            if tap.records:
                call = found[name]
                lead = (*self.prefixes[name], *call.vmaps)

                def zeros(spec: Any, lead: tuple[int, ...] = lead) -> list[jax.Array]:
                    layouts = [
                        sink_layout(s.shape, s.dtype)
                        for s in jax.tree_util.tree_leaves(spec)
                    ]
                    return [jnp.zeros((*lead, *shape), d) for shape, d in layouts]

                forward = [*zeros(call.records), jnp.zeros(lead, jnp.float32)]
                self.sinks[name] = (tuple(forward), tuple(zeros(call.gradients)))
        # The ref path's rule (see `_refs`), less what only `capture` can see.
        self.refs = (
            available()
            and not self.gradients
            and not any(found[n].log for n in self.sinks)
            and not has_checkpoint(jaxpr)
            and all(
                jnp.issubdtype(s.dtype, jnp.inexact)
                for n in self.sinks
                for s in jax.tree_util.tree_leaves(found[n].records)
            )
        )
        chains = enclosing(jaxpr) if self.refs else {}
        self.once = {  # runs once per layer by construction (no run-time count)
            n: once_per_layer(chains.get(n, []), len(self.prefixes[n]))
            for n in self.sinks
        }

    @property
    def gradients(self) -> bool:
        """Whether a tap records in the backward pass."""
        return any(t.gradients for _, t in self.chosen.values())

    def buffers(self) -> dict[str, Buffers]:
        """New zero ref buffers for the recording points (the ref path)."""
        out: dict[str, Buffers] = {}
        for name in self.sinks:
            prefix = self.prefixes[name]
            specs = jax.tree_util.tree_leaves(self.found[name].records)
            n = math.prod(prefix) if prefix else None
            out[name] = Buffers.make(n, specs, counted=not self.once[name])
        return out

    def wrap(
        self,
        model: R,
        sinks: dict[str, Any],
        buffers: dict[str, Buffers] | None = None,
    ) -> R:
        """Return `model` with the chosen points wrapped for the recording pass.

        Records go to `sinks` (the sink path) or, where given, to `buffers` (the
        ref path).
        """
        buffers = buffers or {}

        def make(name: str, tap: Tap) -> Callable[[Any], Tapped]:
            prefix = self.prefixes[name]
            vmaps = self.found[name].vmaps
            intervention = _prepare(tap.intervene, prefix, vmaps, name)
            layer = None
            if (intervention is not None or name in buffers) and prefix:
                layer = jnp.arange(math.prod(prefix), dtype=jnp.int32).reshape(prefix)
            plan = Plan(name, tap, None, vmapped=bool(vmaps), buffers=buffers.get(name))
            forward, backward = sinks.get(name, ((), ()))
            return lambda m: Tapped(m, forward, backward, intervention, layer, plan)

        return _wrap(model, {p: make(n, t) for n, (p, t) in self.chosen.items()})

    def collection(self, cts: dict[str, Any]) -> OutputCollection:
        """The collection, from the sinks' cotangents (the sink path)."""
        records: dict[
            str, tuple[list[jax.Array], list[jax.Array], jax.Array | None]
        ] = {}
        for n in self.sinks:
            (*values, calls), gradients = cts[n]
            call = self.found[n]
            records[n] = (
                _decode(call.records, values),
                _decode(call.gradients, gradients),
                calls,
            )
        return self._collection(records)

    def read(
        self, buffers: dict[str, Buffers]
    ) -> dict[str, tuple[list[jax.Array], jax.Array | None]]:
        """The ref buffers' final values: each point's records and call counts."""
        return {n: b.read(self.prefixes[n]) for n, b in buffers.items()}

    def ref_collection(
        self, reads: dict[str, tuple[list[jax.Array], jax.Array | None]]
    ) -> OutputCollection:
        """The collection, from the ref buffers' final values (the ref path)."""
        return self._collection({n: (v, [], c) for n, (v, c) in reads.items()})

    def _collection(
        self,
        records: dict[str, tuple[list[jax.Array], list[jax.Array], jax.Array | None]],
    ) -> OutputCollection:
        """The collection from each point's (records, gradient records, calls)."""
        entries: dict[str, OutputCollection] = {}
        for n in self.sinks:
            values, gradients, calls = records[n]
            entries[self.chosen[n][0].path] = _entries(
                n,
                self.found[n],
                self.prefixes[n],
                values,
                gradients,
                calls,
                self.child_name_prefix,
            )
        return _nest(entries)


def _entries(
    name: str,
    call: Call,
    prefix: tuple[int, ...],
    values: list[jax.Array],
    gradients: list[jax.Array],
    calls: jax.Array | None,
    child_name_prefix: str,
) -> OutputCollection:
    """One point's collection, from its records (flat leaves) and call counts."""
    recorded: dict[str, Any] = {
        **_unflatten(call.records, values),
        **_unflatten(call.gradients, gradients),
    }
    if calls is not None:  # (None: the point runs once per layer by construction)
        message = _CALLS_MESSAGE + f" Point: {name!r}."
        recorded = eqx.error_if(recorded, calls != 1, message)
    outputs = {k: v for k, v in recorded.items() if not k.startswith("summary:")}
    summaries = {
        k.removeprefix("summary:"): v
        for k, v in recorded.items()
        if k.startswith("summary:")
    }
    depth = len(prefix)
    if call.vmaps and summaries:
        ndims = tuple(np.ndim(x) - depth for x in jax.tree_util.tree_leaves(summaries))
        entry = IterationSummaries(call.vmaps[0], summaries, ndims)
        merged = OutputCollection({"v": entry}, {}, {}).merge_iterations()
        summaries = dict(merged.summaries["v"].items())
    if depth == 0:
        return OutputCollection(summaries, {}, outputs)
    n = math.prod(prefix)

    def flat(x: jax.Array) -> jax.Array:
        return jnp.reshape(x, (n, *jnp.shape(x)[depth:]))

    stacked = OutputCollection(
        jax.tree_util.tree_map(flat, summaries),
        {},
        jax.tree_util.tree_map(flat, outputs),
    )
    return propagate_repeated_output_collections(
        stacked, child_name_prefix=child_name_prefix, merge_summaries=False, length=n
    )


def _decode(spec: Any, values: Sequence[jax.Array]) -> list[jax.Array]:
    specs = jax.tree_util.tree_leaves(spec)
    return [from_sink(v, s.dtype) for v, s in zip(values, specs, strict=True)]


def _unflatten(spec: Any, values: Sequence[jax.Array]) -> dict[str, Any]:
    return jax.tree_util.tree_structure(spec).unflatten(values)


def _nest(entries: dict[str, OutputCollection]) -> OutputCollection:
    """Put each point's collection at its path; parents and children share levels."""
    tree: dict[str, Any] = {}
    for path, coll in entries.items():
        node = tree
        for part in path.split("/"):
            node = node.setdefault(part, {})
        node[""] = coll

    def build(node: dict[str, Any]) -> OutputCollection:
        coll: OutputCollection = node.get("", OutputCollection.empty())
        for key, child in node.items():
            if key:
                coll = coll.add_child(key, build(child))
        return coll

    return build(tree)

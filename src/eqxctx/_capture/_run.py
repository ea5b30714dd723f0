"""`capture`: run a function of a model with taps at its hook points."""

import contextlib
import math
from collections.abc import Callable, Generator, Sequence
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
from ._tap import Call, Plan, Recorder, Tap, Tapped


R = TypeVar("R")
M = TypeVar("M")
_WHILE_MESSAGE = (
    "`{where}`: fn runs a `jax.lax.while_loop` (or a `fori_loop` with traced "
    "bounds) through which a recording point's output flows; capture carries its "
    "records out through a backward pass, which JAX cannot take through a while "
    "loop. Call `capture` inside the loop body (on the model, per iteration), or "
    "use a `jax.lax.scan` with a fixed length. Interventions alone need no "
    "backward pass and work in loops."
)
_CALLS_MESSAGE = (
    "`eqxctx.capture`: a hook point that records did not run exactly once (per "
    "layer of its stack, per example of a `jax.vmap` inside fn). It runs 0 times if "
    "its output does not reach fn's floating-point result (an unused value, a "
    "`jax.lax.cond` branch not taken, a result computed through `argmax`), and more "
    "than once in a loop or `jax.vmap` that does not map the model's arrays (a "
    "generation loop: call `capture` inside the loop instead)."
)


def _taps(taps: object) -> list[Tap]:
    if isinstance(taps, Tap):
        return [taps]
    if isinstance(taps, Sequence) and all(isinstance(t, Tap) for t in taps):
        return list(taps)
    raise TypeError(
        "`eqxctx.capture(taps=...)`: expected a Tap or a sequence of Taps, got "
        f"{taps!r}."
    )


def _marker_shape(model: object, point: HookPoint) -> tuple[int, ...]:
    """The leading shape shared by the arrays of the point (or its nearest parent)."""
    for n in range(len(point.key_path), -1, -1):
        leaves = [
            x
            for x in jax.tree_util.tree_leaves(get_node(model, point.key_path[:n]))
            if eqx.is_array(x)
        ]
        if leaves:
            shapes = [tuple(np.shape(x)) for x in leaves]
            common: list[int] = []
            for dims in zip(*shapes, strict=False):
                if len(set(dims)) != 1:
                    break
                common.append(dims[0])
            return tuple(common)
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


class _Session:
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
        eqx.filter_eval_shape(lambda m, a, k: fn(m, *a, **k), shaped, args, kwargs)
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

    @property
    def gradients(self) -> bool:
        """Whether a tap records in the backward pass."""
        return any(t.gradients for _, t in self.chosen.values())

    def wrap(self, model: R, sinks: dict[str, Any]) -> R:
        """Return `model` with the chosen points wrapped for the recording pass."""

        def make(name: str, tap: Tap) -> Callable[[Any], Tapped]:
            prefix = self.prefixes[name]
            vmaps = self.found[name].vmaps
            intervention = _prepare(tap.intervene, prefix, vmaps, name)
            layer = None
            if intervention is not None and prefix:
                layer = jnp.arange(math.prod(prefix), dtype=jnp.int32).reshape(prefix)
            plan = Plan(name, tap, None, vmapped=bool(vmaps))
            forward, backward = sinks.get(name, ((), ()))
            return lambda m: Tapped(m, forward, backward, intervention, layer, plan)

        return _wrap(model, {p: make(n, t) for n, (p, t) in self.chosen.items()})

    def collection(self, cts: dict[str, Any]) -> OutputCollection:
        """The collection, from the sinks' cotangents."""
        entries = {
            self.chosen[n][0].path: _entries(
                n, self.found[n], self.prefixes[n], cts[n], self.child_name_prefix
            )
            for n in self.sinks
        }
        return _nest(entries)


def capture(
    fn: Callable[..., R],
    model: Any,
    *args: Any,
    taps: Tap | Sequence[Tap],
    child_name_prefix: str = "layer",
    **kwargs: Any,
) -> tuple[R, OutputCollection]:
    """Run `fn(model, *args, **kwargs)` with taps at hook points of `model`.

    The model needs no change: each selected hook point (an `eqx.Module` node, see
    `hook_points`) is replaced, for this call only, by a wrapper that calls it,
    applies the tap's intervention, and records its output and summaries on the
    device. `fn` may be any function of the model (a forward, a loss) and may use
    `jax.lax.scan` over stacked layers (`eqx.filter_vmap` + `jax.lax.scan`,
    `eqx.nn.MLP(scan=True)`), `jax.vmap` over examples, `jax.checkpoint` and
    `jax.lax.cond`. `capture` itself works under `jax.jit`, `jax.grad` (of a loss
    returned with the collection as auxiliary data), `jax.vmap` and `jax.lax.scan`.

    Layout: a point's entries go under its `HookPoint.path`: the module output
    `"output"` and the tap's summaries. A point whose arrays are stacked `[L, ...]`
    (it runs once per layer inside the user's scan) gives, as `scan_in_context`
    does, module outputs stacked `[L, ...]` in child `child_name_prefix` and
    per-layer summaries in children `{child_name_prefix}{i}` (nested stacks are
    flattened, layer-major). A point inside a `jax.vmap` in `fn` that maps the input
    but not the model keeps its module outputs per example (`[..., B, ...]`) and
    merges its summaries over the examples (`Summary.accumulate`, `+` for arrays),
    as `vmap_in_context(merge_summaries=True)` does. Entries record the output
    after the intervention; an output that is a PyTree records each array leaf
    (see `Tap.output`). Recorded values are differentiable: a loss of them, under
    `jax.grad` of a function that calls `capture`, gets the model's gradients.

    Branches and loops: a recording point in a `jax.lax.cond` branch records when
    the branch runs and raises `EquinoxRuntimeError` when it does not (never
    zeros); one in a loop that does not map the model's arrays (a `fori_loop`
    with fixed bounds, a generation loop) raises at run time as well; a point
    whose output flows through a `jax.lax.while_loop` cannot record (`ValueError`:
    JAX has no backward pass through while loops). Interventions need no
    recording and work in every branch and loop. Modules that thread a context
    (`module(x, ctx) -> (y, ctx)`) record and change `y`; the context passes
    through, and the returned collection merges into it (`ctx.merge`).

    `fn` is traced twice: once abstractly (`eqx.filter_eval_shape`: which points
    run where, and the shapes of what they record), once for real. Recording
    differentiates `fn` with respect to zero "sink" arrays put in the wrappers (see
    `docs/instrumenting.md`); XLA keeps only the recorded values. With no tap
    selecting a point, `fn(model, ...)` runs unchanged.

    Args:
        fn: `fn(model, *args, **kwargs) -> out`; `out` any PyTree. Recording needs
            the recorded points to reach a floating-point array of `out`.
        model: the model (any PyTree of modules); it is not changed.
        *args: passed to `fn` after the model.
        taps: a `Tap` or a sequence of `Tap`s; a point selected by two raises.
        child_name_prefix: the per-layer children's prefix for stacked points.
        **kwargs: passed to `fn`.

    Returns:
        `(out, collection)`: `fn`'s result (with the interventions applied) and an
        `OutputCollection` with the entries described above; merge it into a
        context with `ctx.merge(collection)`.

    Raises:
        ValueError: a selection that matches no point (listing the points); a point
            selected by two taps, never called, or recorded at two call sites; a
            per-layer intervention value without the stack's leading axes;
            `Tap(layers=...)` past the point's number of layers; a
            recording point whose output flows through a `jax.lax.while_loop`.
        TypeError: bad taps; a recorded point whose output has no floating-point
            array; a summary function returning something other than an array or
            `Summary`.
        EquinoxRuntimeError: at run time (under `eqx.filter_jit` or eagerly), a
            recording point that did not run exactly once per layer (per example).

    References:
        Flax NNX `nnx.capture`; TransformerLens `run_with_cache`; `jax.custom_vjp`.

    Examples:
        >>> mlp = eqx.nn.MLP(2, 1, 8, 2, key=jax.random.key(0))
        >>> tap = Tap("layers[1]", output=True)
        >>> y, coll = capture(lambda m, x: m(x), mlp, jnp.ones(2), taps=tap)
        >>> coll.flatten("module_outputs")["layers_1/output"].shape
        (8,)
    """
    session = _Session(
        fn, model, args, kwargs, _taps(taps), child_name_prefix, "eqxctx.capture"
    )
    if session.gradients:
        raise ValueError(
            "`eqxctx.capture`: a tap asks for gradients (`gradient_summaries` or "
            "`gradient_output`), which need a backward pass of a loss; use "
            "`eqxctx.capture_value_and_grad(loss_fn, model, ...)`."
        )
    if not session.chosen:
        return fn(model, *args, **kwargs), OutputCollection.empty()
    if not session.sinks:
        return fn(session.wrap(model, {}), *args, **kwargs), OutputCollection.empty()
    static_box: list[Any] = []

    def differentiable(sinks: dict[str, Any]) -> tuple[Any, Any]:
        out = fn(session.wrap(model, sinks), *args, **kwargs)
        diff, rest = eqx.partition(out, eqx.is_inexact_array)
        arrays, static = eqx.partition(rest, eqx.is_array)
        static_box.append(static)
        return diff, arrays

    with _loops("eqxctx.capture"):
        diff, vjp_fn, arrays = jax.vjp(differentiable, session.sinks, has_aux=True)
        (cts,) = vjp_fn(jax.tree_util.tree_map(jnp.zeros_like, diff))
    out = eqx.combine(diff, arrays, static_box[-1])
    return out, session.collection(cts)


def capture_value_and_grad(
    fn: Callable[..., Any],
    model: M,
    *args: Any,
    taps: Tap | Sequence[Tap],
    child_name_prefix: str = "layer",
    **kwargs: Any,
) -> tuple[tuple[jax.Array, OutputCollection], M]:
    """Return `fn`'s loss, what the taps record, and the gradients, in one call.

    The capture form of `eqxctx.value_and_grad` for a model you did not write:
    `fn(model, *args, **kwargs) -> loss` (a scalar floating-point array) runs with
    `taps` as in `capture`, and is differentiated with respect to the model's
    floating-point arrays (filter semantics: the gradients equal
    `eqx.filter_value_and_grad(fn)(model, *args, **kwargs)`'s, and other leaves get
    None). Besides the forward records (`output`, `summaries`), a tap's
    `gradient_summaries` and `gradient_output` are filled in from the backward
    pass: the cotangent `d loss / d y` of each selected point's output `y` (after
    its intervention), per layer of a scanned stack (children
    `{child_name_prefix}{i}`, or `[L, ...]` stacked module outputs), with the
    layout `Context.add_gradient_summary` / `add_gradient_output` give under
    `eqxctx.value_and_grad`. A point inside a `jax.vmap` in `fn` that does not map
    the model (examples) gets the cotangent of each example's output, and its
    gradient summaries merge over the examples (`Summary.accumulate`, `+` for
    arrays) as its forward summaries do.

    Args:
        fn: `fn(model, *args, **kwargs) -> loss`, a scalar floating-point array.
        model: the model (any PyTree of modules); it is not changed.
        *args: passed to `fn` after the model (not differentiated).
        taps: a `Tap` or a sequence of `Tap`s (see `capture`).
        child_name_prefix: the per-layer children's prefix for stacked points.
        **kwargs: passed to `fn`.

    Returns:
        `((loss, collection), grads)`: `grads` has the model's structure.

    Raises:
        ValueError: as `capture`.
        TypeError: as `capture`; a loss that is not a floating-point scalar
            (JAX's message, from `eqx.filter_value_and_grad`); a gradient tap at
            a point whose output is not one floating-point array.
        EquinoxRuntimeError: as `capture`.

    References:
        `eqxctx.value_and_grad`; `eqx.filter_value_and_grad`; TransformerLens's
        backward hooks.

    Examples:
        >>> mlp = eqx.nn.MLP(2, 1, 8, 2, key=jax.random.key(0))
        >>> tap = Tap("layers[1]", gradient_summaries={"grad_rms": None})
        >>> loss = lambda m, x: jnp.sum(m(x))
        >>> (v, coll), g = capture_value_and_grad(loss, mlp, jnp.ones(2), taps=tap)
        >>> coll.flatten("summaries")["layers_1/grad_rms"].dtype
        dtype('float32')
    """
    where = "eqxctx.capture_value_and_grad"
    session = _Session(fn, model, args, kwargs, _taps(taps), child_name_prefix, where)

    def loss_fn(inputs: tuple[M, dict[str, Any]]) -> jax.Array:
        m, sinks = inputs
        loss = fn(session.wrap(m, sinks) if session.chosen else m, *args, **kwargs)
        _check_loss(loss, where)
        return loss

    with _loops(where) if session.sinks else contextlib.nullcontext():
        loss, (grads, cts) = eqx.filter_value_and_grad(loss_fn)(
            (model, session.sinks if session.chosen else {})
        )
    if not session.sinks:
        return (loss, OutputCollection.empty()), grads
    return (loss, session.collection(cts)), grads


def _check_loss(loss: object, where: str) -> None:
    if not isinstance(loss, jax.Array) or not eqx.is_inexact_array(loss) or loss.shape:
        raise TypeError(
            f"`{where}`: fn must return a scalar floating-point loss, got "
            f"{getattr(loss, 'shape', type(loss).__name__)} "
            f"{getattr(loss, 'dtype', '')}; reduce it, e.g. with `jnp.mean`."
        )


@contextlib.contextmanager
def _loops(where: str) -> Generator[None]:
    """Turn JAX's error for a backward pass through a while loop into capture's."""
    try:
        yield
    except ValueError as e:
        if "while_loop" not in str(e):
            raise
        raise ValueError(_WHILE_MESSAGE.format(where=where)) from e


def _entries(
    name: str,
    call: Call,
    prefix: tuple[int, ...],
    cts: tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]],
    child_name_prefix: str,
) -> OutputCollection:
    """One point's collection, from its sinks' cotangents."""
    (*values, calls), gradients = cts
    recorded: dict[str, Any] = {
        **_unflatten(call.records, values),
        **_unflatten(call.gradients, gradients),
    }
    recorded = eqx.error_if(recorded, calls != 1, _CALLS_MESSAGE + f" Point: {name!r}.")
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


def _unflatten(spec: Any, values: Sequence[jax.Array]) -> dict[str, Any]:
    specs, treedef = jax.tree_util.tree_flatten(spec)
    return treedef.unflatten(
        [from_sink(v, s.dtype) for v, s in zip(values, specs, strict=True)]
    )


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

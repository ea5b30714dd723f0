"""Backward-pass summaries: gradient probes, their sinks, and `value_and_grad`.

A probe (`ctx.add_gradient_summary` / `ctx.add_gradient_output`) is an identity
whose `jax.custom_vjp` backward returns `fn(cotangent)` as the cotangent of a zero
*sink*: an extra input that `value_and_grad` creates, differentiates with respect
to, and hands to the probe through the context. The sinks' gradients are the
summaries. A first `jax.eval_shape` pass, in which every probe adds a
`PendingGradient` placeholder to the collection, finds the probes, their enclosing
scans and vmaps, and the shapes of their sinks. `scan_in_context` and
`vmap_in_context` slice the stacked sinks of the probes inside them per iteration,
as they slice `xs`; after the backward pass every placeholder is replaced by its
sink's gradient (folded over merged scans and vmaps with the summaries' own
`accumulate`). Outside `value_and_grad` a probe returns `x` itself and records
nothing.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree

from ._collection import OutputCollection
from ._context import (
    Context,
    check_is_training,
    check_path,
    check_prng_key,
    check_returns_context,
    gradient_root,
    gradient_state,
)
from ._errors import OutputConflictError
from ._leaves import validate_leaf_name
from ._repeat import fold_stacked
from ._summary import Summary, accumulate_leaf, is_array_leaf
from ._typing import TreeDef


GradKind: TypeAlias = Literal["summaries", "module_outputs"]
#: A probe's address: (context path, kind, name).
SinkKey: TypeAlias = tuple[Any, ...]
_ADDERS = {
    "summaries": "Context.add_gradient_summary",
    "module_outputs": "Context.add_gradient_output",
}


@dataclasses.dataclass(frozen=True)
class Level:
    """One scan or vmap around a probe (static): its iterations' path and layout."""

    path: tuple[Any, ...]
    length: int
    merged: bool
    reverse: bool


@dataclasses.dataclass(frozen=True)
class Probe:
    """What the shape pass learns about one probe (static)."""

    kind: str
    levels: tuple[Any, ...]  # `Level`s, outermost first
    treedef: TreeDef  # of `fn`'s output
    leaves: tuple[Any, ...]  # `jax.ShapeDtypeStruct` of each output leaf

    def sink(self) -> PyTree[Array]:
        """Zeros shaped `[*lengths, *leaf]` per output leaf, in a floating dtype."""
        lengths = tuple(level.length for level in self.levels)
        return self.treedef.unflatten(
            [jnp.zeros((*lengths, *s.shape), _sink_dtype(s.dtype)) for s in self.leaves]
        )


def _sink_dtype(dtype: Any) -> Any:
    """Integer and bool outputs travel as float32 (exact below 2**24)."""
    if jnp.issubdtype(dtype, jnp.floating):
        return dtype
    return jnp.float32


class GradientState:
    """What a context carries under `value_and_grad`: the mode, levels and sinks.

    A PyTree: the sinks are its children, the mode (`"shapes"` during the shape
    pass, `"live"` after) and the enclosing levels are static.
    """

    __slots__ = ("levels", "mode", "sinks")
    mode: str
    levels: tuple[Any, ...]
    sinks: dict[Any, Any]

    def __init__(self, mode: str, levels: tuple[Any, ...], sinks: dict[Any, Any]):
        self.mode = mode
        self.levels = levels
        self.sinks = sinks


jax.tree_util.register_pytree_node(
    GradientState,
    lambda s: ((s.sinks,), (s.mode, s.levels)),
    lambda aux, children: GradientState(aux[0], aux[1], children[0]),
)


class PendingGradient(Summary):
    """A gradient probe's place in a collection until `value_and_grad` fills it.

    Attributes:
        inner: zeros shaped like `fn`'s output (an array or a `Summary`), traced.
        key: the probe's address `(path, kind, name)`, static.
        probe: the probe's description, static.
    """

    inner: Any
    key: Any = eqx.field(static=True)
    probe: Any = eqx.field(static=True)

    def value(self) -> Any:
        """Raise: the value exists only after the backward pass."""
        raise TypeError(
            f"The gradient summary at {'/'.join((*self.key[0], self.key[2]))!r} is "
            "filled in by `eqxctx.value_and_grad` after the backward pass; it cannot "
            "be read inside the function being differentiated."
        )

    def validate(self) -> None:
        """Validate the inner summary."""
        if isinstance(self.inner, Summary):
            self.inner.validate()

    def accumulate(self, other: "PendingGradient") -> "PendingGradient":
        """Accumulate the placeholders (their values are replaced later)."""
        return PendingGradient(
            accumulate_leaf(self.inner, other.inner), self.key, self.probe
        )


def _is_pending(x: object) -> bool:
    return isinstance(x, PendingGradient)


def rms(cotangent: Array) -> Array:
    """The root mean square of `cotangent`, a float32 scalar (0 for no elements)."""
    ct = jnp.asarray(cotangent, jnp.float32)
    if ct.size == 0:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(jnp.mean(jnp.square(ct)))


def _identity(cotangent: Array) -> Array:
    return cotangent


def _check_probe_input(x: Any, where: str, path: str) -> None:
    dtype = getattr(x, "dtype", None)
    if not isinstance(x, (jax.Array, np.ndarray)) or dtype is None:
        raise TypeError(
            f"`{where}`: {path!r}: expected a floating-point array to probe, got "
            f"{type(x).__name__}. Probe one array at a time."
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"`{where}`: {path!r}: the array has dtype {dtype}; only floating-point "
            "arrays have cotangents. Probe a floating-point value (e.g. the "
            "activations, not integer ids or masks)."
        )


def _output_spec(
    fn: Callable[[Array], Any], x: Array, where: str, path: str
) -> tuple[TreeDef, tuple[Any, ...]]:
    """Return the treedef and leaf specs of `fn(cotangent)` (checked, abstractly)."""

    def checked(ct: Array) -> Any:
        out = fn(ct)
        if isinstance(out, Summary):
            return out
        if isinstance(out, (bool, int, float)) or (
            is_array_leaf(out) and not isinstance(out, np.generic | bool)
        ):
            return jnp.asarray(out)
        raise TypeError(
            f"`{where}`: {path!r}: fn returned {type(out).__name__}; it must return "
            "an array or a `Summary` (e.g. `WeightedSummary(mean, weight)`)."
        )

    spec = jax.eval_shape(checked, jax.ShapeDtypeStruct(jnp.shape(x), x.dtype))
    leaves, treedef = jax.tree_util.tree_flatten(spec)
    for s in leaves:
        if jnp.issubdtype(s.dtype, jnp.complexfloating):
            raise TypeError(
                f"`{where}`: {path!r}: fn returned a complex array; return real "
                "values (e.g. `jnp.abs`)."
            )
    return treedef, tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in leaves)


def add_probe(
    ctx: Context,
    kind: GradKind,
    name: str,
    x: Any,
    fn: Any,  # checked here, with a message naming the path
) -> tuple[Any, Context]:
    """`ctx.add_gradient_summary` / `add_gradient_output` (see their docstrings)."""
    where = _ADDERS[kind]
    validate_leaf_name(name, where=where)
    path = "/".join((*ctx.path, name))
    _check_probe_input(x, where, path)
    if fn is None:
        fn = rms if kind == "summaries" else _identity
    elif not callable(fn):
        raise TypeError(f"`{where}`: {path!r}: fn must be callable, got {fn!r}.")
    state: GradientState | None = gradient_state(ctx)
    if state is None:
        return x, ctx  # not under `value_and_grad`: an exact identity
    treedef, leaves = _output_spec(fn, x, where, path)
    key = (ctx.path, kind, name)
    probe = Probe(kind, state.levels, treedef, leaves)
    zeros = treedef.unflatten([jnp.zeros(s.shape, s.dtype) for s in leaves])
    pending = PendingGradient(zeros, key, probe)
    try:
        if kind == "summaries":
            ctx = ctx.add_summary(name, pending)
        else:
            ctx = ctx.add_module_output(name, pending)
    except OutputConflictError as e:
        raise OutputConflictError(
            f"`{where}`: {path!r}: {e} Forward and gradient {kind} share names."
        ) from None
    sink = state.sinks.get(key)
    if sink is not None:
        x = _probe(x, sink, fn)
    return x, ctx


def _probe(x: Array, sink: PyTree[Array], fn: Callable[[Array], Any]) -> Array:
    """`x`, whose backward pass emits `fn(cotangent)` as `sink`'s cotangent."""
    sink_leaves, treedef = jax.tree_util.tree_flatten(sink)

    @jax.custom_vjp
    def identity(x: Array, sink: PyTree[Array]) -> Array:
        del sink
        return x

    def fwd(x: Array, sink: PyTree[Array]) -> tuple[Array, None]:
        del sink
        return x, None

    def bwd(_: None, ct: Array) -> tuple[Array, PyTree[Array]]:
        out = jax.tree_util.tree_leaves(fn(ct))
        cast = [
            jnp.asarray(o).astype(s.dtype)
            for o, s in zip(out, sink_leaves, strict=True)
        ]
        return ct, treedef.unflatten(cast)

    identity.defvjp(fwd, bwd)
    return identity(x, sink)


class Iterations:
    """How a scan or vmap hands gradient sinks to its iterations.

    `sinks` are the stacked sinks of the probes inside (to slice like `xs`);
    `state(sinks_i)` is iteration i's `GradientState`.
    """

    __slots__ = ("level", "parent", "sinks")

    def __init__(self, parent: GradientState, level: Level):
        self.parent = parent
        self.level = level
        n = len(level.path)
        self.sinks = {
            k: v for k, v in parent.sinks.items() if tuple(k[0][:n]) == level.path
        }

    def state(self, sinks: dict[Any, Any]) -> GradientState:
        """Return the gradient state of one iteration, given its slice of `sinks`."""
        return GradientState(
            self.parent.mode, (*self.parent.levels, self.level), dict(sinks)
        )


def enter_iterations(
    context: Context, prefix: str, *, length: int, merged: bool, reverse: bool
) -> Iterations | None:
    """Return the `Iterations` of a scan or vmap in `context`, or None (no probes)."""
    state: GradientState | None = gradient_state(context)
    if state is None:
        return None
    level = Level((*context.path, prefix), length, merged, reverse)
    return Iterations(state, level)


def _lay_out(grad: PyTree[Array], probe: Probe, pending: PendingGradient) -> Any:
    """Turn a sink's gradient `[*lengths, ...]` into the placeholder's layout."""
    leaves = jax.tree_util.tree_leaves(grad)
    leaves = [
        g.astype(s.dtype) if g.dtype != s.dtype else g
        for g, s in zip(leaves, probe.leaves, strict=True)
    ]
    tree = probe.treedef.unflatten(leaves)
    if probe.kind == "summaries":
        remaining = list(probe.levels)
        for idx in reversed(range(len(remaining))):
            level: Level = remaining[idx]
            if not level.merged:
                continue
            last = len(remaining) - 1  # move the axis behind the deeper ones
            tree = jax.tree_util.tree_map(
                functools.partial(_to_back, pos=idx, last=last, flip=level.reverse),
                tree,
            )
            fold = functools.partial(_fold, length=level.length)
            for _ in range(last):
                fold = jax.vmap(fold)
            tree = fold(tree)
            del remaining[idx]
    want = jax.tree_util.tree_leaves(pending.inner)
    got = jax.tree_util.tree_leaves(tree)
    shapes = [jnp.shape(a) for a in got], [jnp.shape(a) for a in want]
    if shapes[0] != shapes[1]:
        key = pending.key
        raise ValueError(
            f"`eqxctx.value_and_grad`: the gradient probe at "
            f"{'/'.join((*key[0], key[2]))!r} has shapes {shapes[1]} in the "
            f"collection but its cotangent gives {shapes[0]}. Probes inside a "
            "`jax.vmap` or `jax.lax.scan` of your own are not supported: use "
            "`vmap_in_context` / `scan_in_context`."
        )
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(tree),
        [a.astype(w.dtype) for a, w in zip(got, want, strict=True)],
    )


def _fold(tree: Any, length: int) -> Any:
    return fold_stacked({"_": tree}, length)["_"]


def _to_back(a: Array, *, pos: int, last: int, flip: bool) -> Array:
    a = jnp.moveaxis(a, pos, last)
    return jnp.flip(a, last) if flip else a


def _probes(collection: OutputCollection) -> dict[Any, Probe]:
    found: dict[Any, Probe] = {}
    for leaf in jax.tree_util.tree_leaves(collection, is_leaf=_is_pending):
        if isinstance(leaf, PendingGradient):
            found[leaf.key] = leaf.probe
    return found


def _fill(
    collection: OutputCollection, grads: dict[Any, Any], probes: dict[Any, Probe]
) -> OutputCollection:
    def fill(leaf: Any) -> Any:
        if not isinstance(leaf, PendingGradient):
            return leaf
        if leaf.key not in grads:
            raise ValueError(
                "`eqxctx.value_and_grad`: fn added the gradient probe at "
                f"{'/'.join((*leaf.key[0], leaf.key[2]))!r} in its second trace "
                "but not in its first; fn must add the same outputs every time it "
                "is traced."
            )
        return _lay_out(grads[leaf.key], probes[leaf.key], leaf)

    return jax.tree_util.tree_map(fill, collection, is_leaf=_is_pending)


def _check_loss(loss: Any, where: str) -> None:
    shape = getattr(loss, "shape", None)
    dtype = getattr(loss, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"{where} must return `(loss, ctx)` with a scalar floating-point loss, "
            f"got a loss of type {type(loss).__name__}."
        )
    if tuple(shape) != ():
        raise ValueError(
            f"{where} must return a scalar loss (shape ()), got shape "
            f"{tuple(shape)}. Reduce it, e.g. with `jnp.mean`."
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{where} must return a floating-point loss, got dtype {dtype}."
        )


def _is_int(a: object) -> bool:
    return isinstance(a, (int, np.integer)) and not isinstance(a, (bool, np.bool_))


def _positions(argnums: object) -> tuple[int, ...]:
    if _is_int(argnums):
        return (int(argnums),)  # pyright: ignore[reportArgumentType]
    if isinstance(argnums, Sequence) and all(_is_int(a) for a in argnums):
        return tuple(int(a) for a in argnums)
    raise TypeError(
        "`eqxctx.value_and_grad(argnums=...)`: expected an int or a sequence of "
        f"ints, got {argnums!r}."
    )


def value_and_grad(
    fn: Callable[..., tuple[Any, Context]], *, argnums: int | Sequence[int] = 0
) -> Callable[..., tuple[tuple[Array, OutputCollection], Any]]:
    """Return a function giving `fn`'s loss, its collection and its gradients.

    `fn(*args, ctx, **kwargs) -> (loss, ctx)` runs in a root context (named
    `"root"`). The returned function,
    `(*args, prng_key, is_training, **kwargs) -> ((loss, collection), grads)`,
    differentiates the scalar `loss` with respect to the floating-point array
    leaves of `args[argnums]` (filter semantics: the other leaves get None in
    `grads`, as with `eqx.filter_value_and_grad`, whose gradients these equal), and
    fills in the backward-pass summaries and outputs of `ctx.add_gradient_summary`
    and `ctx.add_gradient_output`: `collection` holds every kind of output (none is
    dropped, unlike `functional`'s default), forward and backward.

    `fn` is traced twice: once abstractly (`jax.eval_shape`: nothing is computed)
    to find the probes and the shapes of their sinks, once for real.

    Args:
        fn: the loss function, `fn(*args, ctx, **kwargs) -> (loss, ctx)`; `loss` a
            scalar floating-point array.
        argnums: the position (or positions) in `args` to differentiate, static.

    Returns:
        A function `(*args, prng_key, is_training, **kwargs)` returning
        `((loss, collection), grads)`; `grads` has `args[argnums]`'s structure (a
        tuple of them for a sequence of positions). `prng_key` is the root key (raw
        or typed) or None; `is_training` a bool.

    Raises:
        TypeError: `fn` is not callable, `argnums` is not an int or a sequence of
            ints; at call time, a bad `prng_key` / `is_training`, a loss that is
            not a floating-point array, `fn` not returning `(loss, ctx)`, and the
            probes' own errors (naming their paths).
        ValueError: at call time, a non-scalar loss, an `argnums` out of range.

    References:
        `eqx.filter_value_and_grad`; `jax.custom_vjp`; Flax's `perturb`.

    Examples:
        >>> def loss(w, ctx):
        ...     h, ctx = ctx.add_gradient_summary("h", w * 3.0)
        ...     return jnp.sum(h**2), ctx
        >>> (v, coll), g = value_and_grad(loss)(
        ...     jnp.ones(4), prng_key=None, is_training=True
        ... )
        >>> float(v), float(g[0]), float(coll.flatten("summaries")["h"])
        (36.0, 18.0, 6.0)
    """
    if not callable(fn):
        raise TypeError(
            f"`eqxctx.value_and_grad(fn)`: fn must be callable, got {fn!r}."
        )
    single = _is_int(argnums)
    positions = _positions(argnums)
    where = "`eqxctx.value_and_grad(fn)`: fn"

    def wrapper(
        *args: Any, prng_key: Any, is_training: Any, **kwargs: Any
    ) -> tuple[tuple[Array, OutputCollection], Any]:
        key = check_prng_key(prng_key, "eqxctx.value_and_grad")
        training = check_is_training(is_training, "eqxctx.value_and_grad")
        for p in positions:
            if not -len(args) <= p < len(args):
                raise ValueError(
                    f"`eqxctx.value_and_grad(argnums={argnums!r})`: position {p} is "
                    f"out of range for {len(args)} positional argument(s)."
                )
        diff = tuple(args[p] for p in positions)

        def run(
            diff: tuple[Any, ...], state: GradientState, shape_only: bool
        ) -> tuple[Array, OutputCollection]:
            full = list(args)
            for p, d in zip(positions, diff, strict=True):
                full[p] = d
            ctx = gradient_root(key, training, shape_only=shape_only, gradients=state)
            out, out_ctx = check_returns_context(fn(*full, ctx, **kwargs), where)
            check_path(out_ctx, ctx, where)
            _check_loss(out, where)
            return out, out_ctx.collection

        # The shape pass: which probes exist, and their sinks' shapes.
        shapes = jax.eval_shape(
            lambda: run(diff, GradientState("shapes", (), {}), True)[1]
        )
        probes = _probes(shapes)
        sinks = {k: p.sink() for k, p in probes.items()}

        def loss_fn(
            inputs: tuple[tuple[Any, ...], dict[Any, Any]],
        ) -> tuple[Array, OutputCollection]:
            d, s = inputs
            return run(d, GradientState("live", (), s), False)

        (loss, coll), (grads, sink_grads) = eqx.filter_value_and_grad(
            loss_fn, has_aux=True
        )((diff, sinks))
        coll = _fill(coll, sink_grads, probes) if probes else coll
        return (loss, coll), grads[0] if single else grads

    return wrapper

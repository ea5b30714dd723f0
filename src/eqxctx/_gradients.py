"""Backward-pass summaries: gradient probes and their sinks.

This module is the context's side (the probes, the state a context carries, what
scans and vmaps slice); `_value_and_grad.py` is the transformation that fills them.
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
import json
from collections.abc import Callable
from typing import (
    Any,
    Literal,
    NoReturn,
    Protocol,
    TypeAlias,
    TypeVar,
    runtime_checkable,
)

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, PyTree

from ._errors import OutputConflictError
from ._leaves import ContextLike, drops, validate_leaf_name
from ._sinks import sink_layout, to_sink
from ._sites import call_site
from ._summary import Summary, accumulate_leaf, is_array_leaf
from ._typing import ArrayTree, Names, TreeDef


GradKind: TypeAlias = Literal["summaries", "module_outputs"]
#: A probe's address: (context path, kind, name).
ProbeKey: TypeAlias = tuple[Names, str, str]
#: The stacked sinks of the probes, by address: PyTrees of float arrays.
Sinks: TypeAlias = dict[ProbeKey, ArrayTree]
ADDERS = {
    "summaries": "Context.add_gradient_summary",
    "module_outputs": "Context.add_gradient_output",
}


@dataclasses.dataclass(frozen=True)
class Level:
    """One scan or vmap around a probe (static): its iterations' path and layout."""

    path: Names
    length: int
    merged: bool
    reverse: bool


@dataclasses.dataclass(frozen=True)
class Probe:
    """What the shape pass learns about one probe (static)."""

    kind: str
    levels: tuple[Level, ...]  # outermost first
    treedef: TreeDef  # of `fn`'s output
    leaves: tuple[jax.ShapeDtypeStruct, ...]  # of each output leaf

    def sink(self) -> PyTree[Array]:
        """Zeros shaped `[*lengths, *leaf]` per output leaf, in a floating dtype."""
        lengths = tuple(level.length for level in self.levels)
        return self.treedef.unflatten(
            [jnp.zeros(*_layout(lengths, s)) for s in self.leaves]
        )


def _layout(
    lengths: tuple[int, ...], s: jax.ShapeDtypeStruct
) -> tuple[tuple[int, ...], jnp.dtype]:
    shape, dtype = sink_layout(s.shape, s.dtype)
    return (*lengths, *shape), dtype


class GradientState:
    """What a context carries under `value_and_grad`: the mode, levels and sinks.

    A PyTree: the sinks are its children, the mode (`"shapes"` during the shape
    pass, `"live"` after) and the enclosing levels are static.
    """

    __slots__ = ("levels", "mode", "sinks")
    mode: str
    levels: tuple[Level, ...]
    sinks: Sinks

    def __init__(self, mode: str, levels: tuple[Level, ...], sinks: Sinks):
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

    inner: ArrayTree
    key: ProbeKey = eqx.field(static=True)
    probe: Probe = eqx.field(static=True)

    def value(self) -> ArrayTree:
        """Raise: the value exists only after the backward pass."""
        raise self._unreadable()

    def _unreadable(self, *_: object) -> TypeError:
        return TypeError(
            f"The gradient summary at {'/'.join((*self.key[0], self.key[2]))!r} is "
            "filled in by `eqxctx.value_and_grad` after the backward pass; it cannot "
            "be read inside the function being differentiated."
        )

    def _refuse(self, *_: object) -> NoReturn:
        """Raise `value()`'s error: for arithmetic, `jnp.asarray`, `float`, ..."""
        raise self._unreadable()

    # Reading the placeholder as a number inside the differentiated function (JAX
    # reads `__jax_array__`, NumPy `__array__`) raises `value()`'s error, not
    # JAX's or Python's, which name neither the probe nor the cause.
    __jax_array__ = __array__ = _refuse
    __float__ = __int__ = __complex__ = __index__ = _refuse
    __getitem__ = _refuse
    __neg__ = __pos__ = __abs__ = __invert__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = _refuse
    __mod__ = __rmod__ = __pow__ = __rpow__ = __matmul__ = __rmatmul__ = _refuse
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = _refuse

    def validate(self) -> None:
        """Validate the inner summary."""
        if isinstance(self.inner, Summary):
            self.inner.validate()

    def accumulate(self, other: "PendingGradient") -> "PendingGradient":
        """Accumulate the placeholders (their values are replaced later)."""
        return PendingGradient(
            accumulate_leaf(self.inner, other.inner), self.key, self.probe
        )


def is_pending(x: object) -> bool:
    return isinstance(x, PendingGradient)


def rms(cotangent: Array) -> Array:
    """The root mean square of `cotangent`, a float32 scalar (0 for no elements)."""
    ct = jnp.asarray(cotangent, jnp.float32)
    if ct.size == 0:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(jnp.mean(jnp.square(ct)))


def _identity(cotangent: Array) -> Array:
    return cotangent


def _output_spec(
    fn: Callable[[Array], ArrayTree], x: Array, where: str, path: str
) -> tuple[TreeDef, tuple[jax.ShapeDtypeStruct, ...]]:
    """Return the treedef and leaf specs of `fn(cotangent)` (checked, abstractly)."""

    def checked(ct: Array) -> ArrayTree:
        out = fn(ct)
        if isinstance(out, Summary):
            return out
        if is_array_leaf(out):  # an array, a NumPy scalar or a Python number
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


def check_probe_input(x: object, where: str, path: str) -> None:
    """Raise `TypeError` unless `x` is a floating-point array (`path` names it)."""
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


def probe_fn(kind: GradKind, fn: object, where: str, path: str) -> Callable[..., Any]:
    """`fn`, or the kind's default (`rms` for summaries, the cotangent for outputs)."""
    if fn is None:
        return rms if kind == "summaries" else _identity
    if not callable(fn):
        raise TypeError(f"`{where}`: {path!r}: fn must be callable, got {fn!r}.")
    return fn


def pending(
    state: GradientState,
    key: ProbeKey,
    fn: Callable[[Array], ArrayTree],
    x: Array,
    where: str,
) -> PendingGradient:
    """The placeholder a probe adds: zeros shaped as `fn(cotangent)`, to be filled."""
    path = "/".join((*key[0], key[2]))
    treedef, leaves = _output_spec(fn, x, where, path)
    probe = Probe(key[1], state.levels, treedef, leaves)
    zeros = treedef.unflatten([jnp.zeros(s.shape, s.dtype) for s in leaves])
    return PendingGradient(zeros, key, probe)


def probe(
    x: Array, sink: PyTree[Array] | None, fn: Callable[[Array], ArrayTree]
) -> Array:
    """`x`, whose backward pass emits `fn(cotangent)` as `sink`'s cotangent (if any)."""
    return x if sink is None else _probe(x, sink, fn)


def _probe(x: Array, sink: PyTree[Array], fn: Callable[[Array], ArrayTree]) -> Array:
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
        cast = [to_sink(o, s.dtype) for o, s in zip(out, sink_leaves, strict=True)]
        return ct, treedef.unflatten(cast)

    identity.defvjp(fwd, bwd)
    return identity(x, sink)


@runtime_checkable
class ProbeContext(ContextLike, Protocol):
    """What a probe uses of a `Context` (which imports this module)."""

    def add_summary(self, name: str, value: Any, level: int = 0) -> Any:
        """Return a new context with summary `name` added."""
        ...

    def add_module_output(self, name: str, value: Any, level: int = 0) -> Any:
        """Return a new context with module output `name` added."""
        ...


C = TypeVar("C", bound=ProbeContext)


def add_probe(
    ctx: C,
    state: GradientState | None,
    kind: GradKind,
    name: str,
    x: ArrayTree,  # checked here, with a message naming the path
    fn: object,  # checked here, with a message naming the path
    level: object,  # checked by `drops`, with a message
) -> tuple[ArrayTree, C]:
    """`ctx.add_gradient_summary` / `add_gradient_output`, given `ctx`'s `state`."""
    where = ADDERS[kind]
    validate_leaf_name(name, where=where)
    path = "/".join((*ctx.path, name))
    check_probe_input(x, where, path)
    # A probe above the summary level is dropped: no sink, no custom_vjp, nothing
    # in the backward pass (the default, level 0 with no level set, costs a compare).
    if (type(level) is not int or level or ctx.summary_level is not None) and drops(
        ctx, name, level, where
    ):
        return x, ctx
    fn = probe_fn(kind, fn, where, path)
    if state is None:
        return x, ctx  # not under `value_and_grad`: an exact identity
    key = (ctx.path, kind, name)
    placeholder = pending(state, key, fn, x, where)
    try:
        if kind == "summaries":
            ctx = ctx.add_summary(name, placeholder)
        else:
            ctx = ctx.add_module_output(name, placeholder)
    except OutputConflictError as e:
        raise OutputConflictError(
            f"`{where}`: {path!r}: {e} Forward and gradient {kind} share names."
        ) from None
    if state.mode == "shapes":
        code, line = call_site(1)
        site = "?" if code is None else f"{code.co_filename}:{line}"
        return mark(x, key, site), ctx
    return probe(x, state.sinks.get(key), fn), ctx


# The shape pass marks each probe's output so that `value_and_grad` can tell, from
# the jaxpr, whether it reaches the loss: `checkpoint_name` is an identity eqn (its
# output a new variable) whose `name` names the probe and the line that added it.
# It only matters to `jax.checkpoint` policies that save names, which never name it.
_MARK = "eqxctx_probe"


def mark(x: Array, key: ProbeKey, site: str) -> Array:
    """`x`, through an identity eqn naming the probe `key` and `site` (file:line).

    Shape pass only: the real pass never calls it, so no program holds a mark.
    """
    return checkpoint_name(x, json.dumps([_MARK, list(key[0]), key[1], key[2], site]))


def read_mark(name: object) -> tuple[ProbeKey, str] | None:
    """The probe key and site of a mark's name, or None for another name."""
    if not isinstance(name, str) or not name.startswith(f'["{_MARK}"'):
        return None
    _, path, kind, leaf, site = json.loads(name)
    return (tuple(path), kind, leaf), site


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

    def state(self, sinks: Sinks) -> GradientState:
        """Return the gradient state of one iteration, given its slice of `sinks`."""
        return GradientState(
            self.parent.mode, (*self.parent.levels, self.level), dict(sinks)
        )


def enter_iterations(
    state: "GradientState | None",
    path: Names,
    prefix: str,
    *,
    length: int,
    merged: bool,
    reverse: bool,
) -> Iterations | None:
    """Return the `Iterations` of a scan or vmap at `path`, or None (no probes)."""
    if state is None:
        return None
    level = Level((*path, prefix), length, merged, reverse)
    return Iterations(state, level)

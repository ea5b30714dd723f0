"""`eqxctx.value_and_grad`: the shape pass, the sinks, and filling in the probes.

See `_gradients.py` for the probes themselves and the mechanism.
"""

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Concatenate, Literal, TypeAlias, TypeVar, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Var
from jaxtyping import Array, PyTree

from ._bodies import check_lost, gradient_root
from ._checks import (
    check_is_training,
    check_path,
    check_prng_key,
    check_summary_level,
    note_missing_key,
)
from ._collection import OutputCollection
from ._context import Context, check_returns_context
from ._errors import LostOutputError
from ._gradients import (
    GradientState,
    Level,
    PendingGradient,
    Probe,
    ProbeKey,
    is_pending,
    read_mark,
)
from ._repeat import fold_stacked
from ._sinks import from_sink
from ._typing import ArrayTree, Leaf, PRNGKey


def _lay_out(grad: PyTree[Array], probe: Probe, pending: PendingGradient) -> ArrayTree:
    """Turn a sink's gradient `[*lengths, ...]` into the placeholder's layout."""
    leaves = jax.tree_util.tree_leaves(grad)
    leaves = [from_sink(g, s.dtype) for g, s in zip(leaves, probe.leaves, strict=True)]
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


def _fold(tree: ArrayTree, length: int) -> ArrayTree:
    return fold_stacked({"_": tree}, length)["_"]


def _to_back(a: Array, *, pos: int, last: int, flip: bool) -> Array:
    a = jnp.moveaxis(a, pos, last)
    return jnp.flip(a, last) if flip else a


def _probes(collection: OutputCollection) -> dict[ProbeKey, Probe]:
    found: dict[ProbeKey, Probe] = {}
    for leaf in jax.tree_util.tree_leaves(collection, is_leaf=is_pending):
        if isinstance(leaf, PendingGradient):
            found[leaf.key] = leaf.probe
    return found


def _fill(
    collection: OutputCollection,
    grads: dict[ProbeKey, ArrayTree],
    probes: dict[ProbeKey, Probe],
) -> OutputCollection:
    def fill(leaf: Leaf) -> Leaf:
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

    return jax.tree_util.tree_map(fill, collection, is_leaf=is_pending)


def _sub_jaxprs(params: dict[str, Any]) -> Iterator[Jaxpr]:
    """The jaxprs an eqn holds (scan, cond, jit, checkpoint, custom_vjp/jvp, ...)."""
    for value in params.values():
        for p in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(p, ClosedJaxpr):
                yield p.jaxpr
            elif isinstance(p, Jaxpr):
                yield p


#: Primitives whose inner jaxprs' outputs are the eqn's outputs, one for one.
_CALLS = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "remat2",
        "checkpoint",
        "cond",
        "custom_jvp_call",
        "custom_vjp_call",
    }
)


def _reach(
    jaxpr: Jaxpr,
    live_out: Sequence[bool],
    marks: dict[tuple[ProbeKey, str], bool],
    done: set[tuple[int, tuple[bool, ...]]],
) -> None:
    """Record in `marks` whether each probe mark in `jaxpr` reads its value's cotangent.

    A backwards liveness walk: an eqn is live if one of its outputs is. The jaxpr
    of a call (`jax.jit`, a remat, a `cond` branch, a custom-derivative function)
    is walked with the liveness of the call's outputs, output for output; a loop's
    body (scan, while) with all its outputs live if the loop is (none if not),
    conservatively. A mark is unused (False) when its output reaches no live
    output while its input does, through another path (`_, ctx = probe(h)`, then
    `h` used): the probe reads 0 where the cotangent of `h` is not. A mark whose
    input is dead too reads the true cotangent, 0 (a branch ignoring `h`). A probe
    traced more than once (a branch factory's, in each branch) is unused if one of
    its marks is: when that copy runs, the probe reads 0.
    """
    key = (id(jaxpr), tuple(live_out))
    if key in done:
        return
    done.add(key)
    live = {
        v
        for v, on in zip(jaxpr.outvars, live_out, strict=True)
        if on and isinstance(v, Var)
    }
    dead: list[tuple[tuple[ProbeKey, str], list[Var]]] = []
    for eqn in reversed(jaxpr.eqns):
        used = any(v in live for v in eqn.outvars)
        found = read_mark(eqn.params.get("name"))
        if found is not None:
            marks.setdefault(found, True)
            if not used:
                dead.append((found, [v for v in eqn.invars if isinstance(v, Var)]))
        if used:
            live.update(v for v in eqn.invars if isinstance(v, Var))
        if found is None:
            per_output = [v in live for v in eqn.outvars]
            for sub in _sub_jaxprs(eqn.params):
                if eqn.primitive.name in _CALLS and len(sub.outvars) == len(per_output):
                    _reach(sub, per_output, marks, done)  # output for output
                else:  # a loop's body: its outputs feed its next iteration too
                    _reach(sub, [used] * len(sub.outvars), marks, done)
    # A dead mark whose input reaches the loss another way: the probe reads 0 where
    # the cotangent of its input is not 0. (Input dead too: 0 is the cotangent.)
    for found, inputs in dead:
        if any(v in live for v in inputs):
            marks[found] = False


_KIND = {"summaries": "gradient summary", "module_outputs": "gradient output"}
_ADDER = {"summaries": "add_gradient_summary", "module_outputs": "add_gradient_output"}


def check_probes_used(jaxpr: Jaxpr) -> None:
    """Raise `LostOutputError` for probes whose output never reaches the loss.

    `jaxpr` is the shape pass's: its first output is the loss.
    """
    marks: dict[tuple[ProbeKey, str], bool] = {}
    _reach(jaxpr, [i == 0 for i in range(len(jaxpr.outvars))], marks, set())
    unused = sorted(found for found, used in marks.items() if not used)
    if not unused:
        return
    lines = [
        f"  - {_KIND[key[1]]} {'/'.join((*key[0], key[2]))}, at {site}"
        for key, site in unused[:8]
    ]
    if len(unused) > 8:
        lines.append(f"  ... and {len(unused) - 8} more")
    (_, kind, name), _ = unused[0]
    raise LostOutputError(
        "`eqxctx.value_and_grad(fn)`: fn does not use the value that these "
        "gradient probes return, so no cotangent reaches them and their values "
        "would read 0 silently:\n" + "\n".join(lines) + "\nA probe is an identity "
        "whose backward pass records the cotangent of the value it returns: use "
        f"that value on the way to the loss (`h, ctx = ctx.{_ADDER[kind]}"
        f'("{name}", h)`, then compute with the new `h`). A probe of a value that '
        "does not reach the loss records zeros: remove it, or give it a `level` "
        "above the `summary_level` to switch it off."
    )


def _check_loss(loss: object, where: str) -> None:
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


A0 = TypeVar("A0")
A1 = TypeVar("A1")
G = TypeVar("G")

#: What `value_and_grad` returns: `(*args, prng_key, is_training, **kwargs) ->
#: ((loss, collection), grads)`, `grads` of type `G`.
ValueAndGrad: TypeAlias = Callable[..., tuple[tuple[Array, OutputCollection], G]]


# Typed per position, for static type checkers: the gradients of an argument have
# its type (the filter semantics put None at its non-differentiable leaves, as
# `eqx.filter_grad` does). Other `argnums` give `Any`.
@overload
def value_and_grad(
    fn: Callable[Concatenate[A0, ...], tuple[object, Context]],
    *,
    argnums: Literal[0] = 0,
    summary_level: int | None = None,
) -> ValueAndGrad[A0]: ...
@overload
def value_and_grad(
    fn: Callable[Concatenate[Any, A1, ...], tuple[object, Context]],
    *,
    argnums: Literal[1],
    summary_level: int | None = None,
) -> ValueAndGrad[A1]: ...
@overload
def value_and_grad(
    fn: Callable[Concatenate[A0, A1, ...], tuple[object, Context]],
    *,
    argnums: tuple[Literal[0], Literal[1]],
    summary_level: int | None = None,
) -> ValueAndGrad[tuple[A0, A1]]: ...
@overload
def value_and_grad(
    fn: Callable[..., tuple[object, Context]],
    *,
    argnums: int | Sequence[int],
    summary_level: int | None = None,
) -> ValueAndGrad[ArrayTree]: ...
def value_and_grad(
    fn: Callable[..., tuple[object, Context]],
    *,
    argnums: int | Sequence[int] = 0,
    summary_level: int | None = None,
) -> ValueAndGrad[ArrayTree]:
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

    `fn` is traced twice: once abstractly (`jax.make_jaxpr`: nothing is computed)
    to find the probes, the shapes of their sinks and whether each probe's
    returned value reaches the loss, once for real.

    Args:
        fn: the loss function, `fn(*args, ctx, **kwargs) -> (loss, ctx)`; `loss` a
            scalar floating-point array.
        argnums: the position (or positions) in `args` to differentiate, static.
        summary_level: the root context's summary level (static, as in
            `functional`): summaries, module outputs and gradient probes added with
            `level > summary_level` are dropped, so XLA removes their computation,
            forward and backward. None (the default) keeps every level.

    Returns:
        A function `(*args, prng_key, is_training, **kwargs)` returning
        `((loss, collection), grads)`; `grads` has `args[argnums]`'s structure (a
        tuple of them for a sequence of positions). `prng_key` is the root key (raw
        or typed) or None; `is_training` a bool. For static type checkers `grads`
        has the type of `fn`'s parameter at `argnums` (`0`, `1` or `(0, 1)`;
        `Any` for other positions).

    Raises:
        TypeError: `fn` is not callable, `argnums` is not an int or a sequence of
            ints, `summary_level` is neither None nor an int; at call time, a
            bad `prng_key` / `is_training`, a loss that is not a floating-point
            array, `fn` not returning `(loss, ctx)`, and the probes' own errors
            (naming their paths).
        ValueError: at call time, a non-scalar loss, an `argnums` out of range or
            naming one argument twice (`(0, -2)` with two arguments).
        LostOutputError: at call time (a `ValueError`), an output `fn` added but
            did not return (as `functional`), or a gradient probe whose returned
            value never reaches the loss (`_, ctx = ctx.add_gradient_summary("g",
            h)`, then `h` used: it would read 0), naming its path, kind and line.

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
    level = check_summary_level(summary_level, "eqxctx.value_and_grad")
    where = "`eqxctx.value_and_grad(fn)`: fn"

    def wrapper(
        *args: ArrayTree,
        prng_key: PRNGKey | None,
        is_training: object,
        **kwargs: object,
    ) -> tuple[tuple[Array, OutputCollection], ArrayTree]:
        key = check_prng_key(prng_key, "eqxctx.value_and_grad")
        training = check_is_training(is_training, "eqxctx.value_and_grad")
        for p in positions:
            if not -len(args) <= p < len(args):
                raise ValueError(
                    f"`eqxctx.value_and_grad(argnums={argnums!r})`: position {p} is "
                    f"out of range for {len(args)} positional argument(s)."
                )
        normalized = [p % len(args) for p in positions]
        if len(set(normalized)) != len(normalized):
            raise ValueError(
                f"`eqxctx.value_and_grad(argnums={argnums!r})`: these name one "
                f"positional argument twice (positions {normalized} of "
                f"{len(args)}); name each argument once."
            )
        diff = tuple(args[p] for p in positions)

        def run(
            diff: tuple[ArrayTree, ...], state: GradientState, shape_only: bool
        ) -> tuple[Array, OutputCollection]:
            full = list(args)
            for p, d in zip(positions, diff, strict=True):
                full[p] = d
            ctx = gradient_root(
                key,
                training,
                shape_only=shape_only,
                gradients=state,
                summary_level=level,
            )
            try:
                result = fn(*full, ctx, **kwargs)
            except TypeError as e:
                note_missing_key(e, ctx, "`eqxctx.value_and_grad(fn)`")
                raise
            out, out_ctx = check_returns_context(result, where)
            check_path(out_ctx, ctx, where)
            check_lost(out_ctx, ctx, where)
            _check_loss(out, where)
            return out, out_ctx.collection

        # The shape pass: which probes exist, their sinks' shapes, and (from the
        # jaxpr, as costly as `jax.eval_shape`) whether each one's value is used.
        jaxpr, shapes = jax.make_jaxpr(
            lambda: run(diff, GradientState("shapes", (), {}), True),
            return_shape=True,
        )()
        probes = _probes(shapes[1])
        if probes:
            check_probes_used(jaxpr.jaxpr)
        sinks = {k: p.sink() for k, p in probes.items()}

        def loss_fn(
            inputs: tuple[tuple[ArrayTree, ...], dict[ProbeKey, ArrayTree]],
        ) -> tuple[Array, OutputCollection]:
            d, s = inputs
            return run(d, GradientState("live", (), s), False)

        (loss, coll), (grads, sink_grads) = eqx.filter_value_and_grad(
            loss_fn, has_aux=True
        )((diff, sinks))
        coll = _fill(coll, sink_grads, probes) if probes else coll
        return (loss, coll), grads[0] if single else grads

    return wrapper

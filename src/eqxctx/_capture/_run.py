"""`capture` and `capture_value_and_grad`: run a function of a model with taps."""

import contextlib
from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp

from eqxctx._bodies import note_result
from eqxctx._collection import OutputCollection
from eqxctx._context import Context

from ._refs import transformed
from ._session import Session
from ._tap import Tap


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


def _taps(taps: object) -> list[Tap]:
    if isinstance(taps, Tap):
        return [taps]
    if isinstance(taps, Sequence) and all(isinstance(t, Tap) for t in taps):
        return list(taps)
    raise TypeError(
        "`eqxctx.capture(taps=...)`: expected a Tap or a sequence of Taps, got "
        f"{taps!r}."
    )


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
    with fixed bounds, a generation loop) raises at run time as well.
    Interventions need no recording and work in every branch and loop. Modules
    that thread a context (`module(x, ctx) -> (y, ctx)`) record and change `y`;
    the context passes through, and the returned collection merges into it
    (`ctx.merge`). When `args` or `kwargs` hold a context, the collection is
    checked as a combinator's: the calling body must return it merged
    (`LostOutputError` otherwise, naming the line of the `capture` call;
    `ctx.discard()` drops it on purpose), and outputs the model adds to that
    context are checked as usual.

    `fn` is traced twice: once abstractly (`eqx.filter_make_jaxpr`: which points
    run where, and the shapes of what they record), once for real. Records leave
    `fn` through `jax.ref` writes inside its scans (the ref path) or as the
    cotangents of zero "sink" arrays in a backward pass (the sink path), chosen
    by one rule before the recording pass: refs unless `capture`'s inputs are
    differentiated or vmapped, a recording point runs under a `jax.vmap` inside
    `fn`, or `fn` holds a `jax.checkpoint` (`docs/instrumenting.md`, "refs or
    sinks"). On the sink path a point whose output does not reach `fn`'s
    floating-point result raises, and one whose output flows through a
    `jax.lax.while_loop` cannot record (`ValueError`). With no tap selecting a
    point, `fn(model, ...)` runs unchanged.

    Args:
        fn: `fn(model, *args, **kwargs) -> out`; `out` any PyTree. On the sink
            path, the recorded points must reach a floating-point array of `out`.
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
            `Tap(layers=...)` past the point's number of layers; on the sink
            path, a recording point whose output flows through a
            `jax.lax.while_loop`.
        TypeError: bad taps; a recorded point whose output has no floating-point
            array; a summary function returning something other than an array or
            `Summary`.
        EquinoxRuntimeError: at run time (under `eqx.filter_jit` or eagerly), a
            recording point that did not run exactly once per layer (per example).
        LostOutputError: when the body that called `capture` with a context
            returns (`functional`, a scan body, ...), if the collection never
            reached the context it returns.

    References:
        Flax NNX `nnx.capture`; TransformerLens `run_with_cache`; `jax.new_ref`;
        `jax.custom_vjp`.

    Examples:
        >>> mlp = eqx.nn.MLP(2, 1, 8, 2, key=jax.random.key(0))
        >>> tap = Tap("layers[1]", output=True)
        >>> y, coll = capture(lambda m, x: m(x), mlp, jnp.ones(2), taps=tap)
        >>> coll.flatten("module_outputs")["layers_1/output"].shape
        (8,)
    """
    session = Session(
        fn, model, args, kwargs, _taps(taps), child_name_prefix, "eqxctx.capture"
    )
    if session.gradients:
        raise ValueError(
            "`eqxctx.capture`: a tap asks for gradients (`gradient_summaries` or "
            "`gradient_output`), which need a backward pass of a loss; use "
            "`eqxctx.capture_value_and_grad(loss_fn, model, ...)`."
        )
    if not session.sinks:  # (with no point chosen, `wrap` returns `model`)
        return fn(session.wrap(model, {}), *args, **kwargs), OutputCollection.empty()
    if session.refs and not transformed((model, args, kwargs)):
        buffers = session.buffers()
        out = fn(session.wrap(model, {}, buffers), *args, **kwargs)
        collection = session.ref_collection(session.read(buffers))
        return out, _noted(collection, args, kwargs)
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
    return out, _noted(session.collection(cts), args, kwargs)


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
    arrays) as its forward summaries do. Forward records take `capture`'s ref path
    by its rule, unless a tap records in the backward pass (then every record
    leaves through sinks).

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
        LostOutputError: as `capture`.
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
    session = Session(fn, model, args, kwargs, _taps(taps), child_name_prefix, where)

    if session.refs and not transformed((model, args, kwargs)):
        # The ref path: the buffers are made inside the differentiated function
        # (JAX refuses a differentiated value written into a ref made outside it),
        # and the records leave it as auxiliary data, differentiable as in `capture`.
        def ref_loss(m: M) -> tuple[jax.Array, Any]:
            buffers = session.buffers()
            loss = fn(session.wrap(m, {}, buffers), *args, **kwargs)
            _check_loss(loss, where)
            return loss, session.read(buffers)

        vg = eqx.filter_value_and_grad(ref_loss, has_aux=True)
        (loss, reads), grads = vg(model)
        return (loss, _noted(session.ref_collection(reads), args, kwargs)), grads

    def loss_fn(inputs: tuple[M, dict[str, Any]]) -> jax.Array:
        m, sinks = inputs
        loss = fn(session.wrap(m, sinks), *args, **kwargs)
        _check_loss(loss, where)
        return loss

    with _loops(where) if session.sinks else contextlib.nullcontext():
        loss, (grads, cts) = eqx.filter_value_and_grad(loss_fn)((model, session.sinks))
    if not session.sinks:
        return (loss, OutputCollection.empty()), grads
    return (loss, _noted(session.collection(cts), args, kwargs)), grads


def _noted(
    collection: OutputCollection, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> OutputCollection:
    """Note `collection` on the ledger of the context `fn` was given, if any.

    Issue 37: like a combinator's, capture's collection must then reach the body's
    returned context (`ctx.merge(collection)`), or a `LostOutputError` names it.
    """
    for leaf in jax.tree_util.tree_leaves(
        (args, kwargs), is_leaf=lambda x: isinstance(x, Context)
    ):
        if isinstance(leaf, Context):
            note_result(leaf, collection)
            break
    return collection


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

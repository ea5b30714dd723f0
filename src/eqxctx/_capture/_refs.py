"""Forward records through `jax.ref` writes, and the rule that chooses them.

On the *ref path*, `capture` makes one `jax.new_ref` buffer per recorded leaf of a
point, shaped `[n, *leaf]` for a stack of `n` layers (`[*leaf]` unstacked), plus an
int32 call counter, and each wrapper writes its records at its flat layer index from
inside the user's scan. The values leave the scan in place, in one loop: no residual
and no transposed loop, as on the sink path (`_tap._emit`). A frozen buffer is an
ordinary array, and JAX differentiates through the writes.

JAX refuses refs in some places (jax 0.8 to 0.10): a batched value written into a
ref made outside `jax.vmap` (a vmap over examples inside fn); any ref write under
`jax.checkpoint` when the program is differentiated; and, on some versions, a ref
under a `jax.vmap` or `jax.grad` of `capture` itself (`jax.lax.cond` transposes,
indexed writes under vmap). So the rule, decided before the recording pass, is:
refs when `jax.new_ref` exists, no input of `capture` is differentiated or vmapped
(`transformed`), no recording point runs under a `jax.vmap` inside fn (the shape
pass's log), fn has no `jax.checkpoint` (`has_checkpoint`), every record is a
floating-point array (JAX cannot differentiate a write into an integer or bool ref
at an index, and capture cannot always see a differentiation) and no tap records in
the backward pass; sinks otherwise. `capture_value_and_grad` makes its buffers
inside the function it differentiates: JAX refuses a differentiated value written
into a ref made outside.

A point that records must run exactly once per layer; a call counter and a run-time
check (`eqx.error_if`) make sure of it. Where the shape pass's jaxpr shows that the
point's one call sits under nothing but the scans over its stack (`enclosing`: the
primitives around a `checkpoint_name` tag on its output), it runs once per layer by
construction, and the ref path keeps neither, as a hand-written scan would not.
"""

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import jax.ref
from jax.ad_checkpoint import checkpoint_name
from jax.custom_batching import custom_vmap
from jaxtyping import Array


#: A private switch for the tests: False forces the sink path everywhere.
USE_REFS = True


def available() -> bool:
    """Whether this JAX has `jax.new_ref` (jax 0.8 does; checked, not assumed)."""
    return USE_REFS and hasattr(jax, "new_ref") and hasattr(jax, "ref")


@dataclasses.dataclass(frozen=True, eq=False)
class Buffers:
    """One point's ref buffers (static in its wrapper, compared by identity)."""

    values: tuple[Any, ...]  # `jax.Ref`s, `[n, *leaf]` or `[*leaf]`
    calls: Any  # an int32 `jax.Ref`, `[n]` or `[]`; None: runs once by construction

    @classmethod
    def make(cls, n: int | None, specs: list[Any], counted: bool) -> "Buffers":
        """Zero buffers for records of `specs` (leaves with shape and dtype)."""
        lead = () if n is None else (n,)
        values = tuple(
            jax.new_ref(jnp.zeros((*lead, *s.shape), s.dtype)) for s in specs
        )
        # float32, as the sink path's counts: JAX cannot differentiate a program
        # that writes into an integer ref at an index (jax 0.10).
        calls = jax.new_ref(jnp.zeros(lead, jnp.float32)) if counted else None
        return cls(values, calls)

    def write(self, values: list[Array], layer: Array | None) -> None:
        """Write one call's records (at flat layer `layer` of a stack)."""
        for ref, value in zip(self.values, values, strict=True):
            if layer is None:
                ref[...] = value
            else:
                ref[layer] = value
        if self.calls is not None:
            index = () if layer is None else layer
            jax.ref.addupdate(self.calls, index, jnp.ones((), jnp.float32))

    def read(self, prefix: tuple[int, ...]) -> tuple[list[Array], Array | None]:
        """The records and the call counts, stacked `[*prefix, *leaf]`."""

        def shaped(ref: Any) -> Array:
            value = jax.ref.freeze(ref)
            return jnp.reshape(value, (*prefix, *value.shape[1 if prefix else 0 :]))

        calls = None if self.calls is None else shaped(self.calls)
        return [shaped(r) for r in self.values], calls


def _numeric(x: object) -> bool:
    if not isinstance(x, jax.core.Tracer):
        return False
    dtype = jnp.dtype(x.dtype)
    return bool(jnp.issubdtype(dtype, jnp.number) or dtype == jnp.bool_)


def transformed(tree: Any) -> bool:
    """Whether an array of `tree` is differentiated or vmapped where this runs.

    A `jax.custom_jvp` and a `custom_vmap` identity of the tree's traced arrays note
    when their rule runs, which JAX does as it binds them (under `jax.jit` alone
    neither runs, and the unused identities compile away). Values fn closes over
    are not seen (see `docs/instrumenting.md`).
    """
    leaves = tuple(x for x in jax.tree_util.tree_leaves(tree) if _numeric(x))
    if not leaves:
        return False
    seen: list[str] = []

    @jax.custom_jvp
    def differentiated(xs: tuple[Array, ...]) -> tuple[Array, ...]:
        return xs

    @differentiated.defjvp
    def _jvp(primals: Any, tangents: Any) -> Any:
        seen.append("jvp")
        return primals[0], tangents[0]

    @custom_vmap
    def vmapped(xs: tuple[Array, ...]) -> tuple[Array, ...]:
        return xs

    @vmapped.def_vmap
    def _rule(axis_size: int, in_batched: Any, xs: tuple[Array, ...]) -> Any:
        del axis_size
        seen.append("vmap")
        return xs, in_batched[0]

    inexact = tuple(x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact))
    if inexact:
        differentiated(inexact)
    vmapped(jax.lax.stop_gradient(leaves))  # (custom_vmap has no JVP rule)
    return bool(seen)


_REMAT = frozenset({"remat2", "checkpoint", "remat"})


def _jaxprs(value: Any) -> Iterator[Any]:
    """The jaxprs in an equation's parameter (a jaxpr, a closed one, a tuple)."""
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _jaxprs(v)
    elif hasattr(value, "eqns"):
        yield value
    elif hasattr(getattr(value, "jaxpr", None), "eqns"):
        yield value.jaxpr


def has_checkpoint(jaxpr: Any) -> bool:
    """Whether `jaxpr` (a `jax.make_jaxpr` result or its `.jaxpr`) holds a remat."""
    for inner in _jaxprs(jaxpr):
        for eqn in inner.eqns:
            if eqn.primitive.name in _REMAT:
                return True
            if any(has_checkpoint(v) for v in eqn.params.values()):
                return True
    return False


_TAG = "eqxctx.capture:"
# Primitives that call their body once, where they run.
_ONCE = frozenset(
    {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"}
)


def tag(x: Array, name: str) -> Array:
    """`x`, tagged in a jaxpr as the output of the point `name` (shape pass)."""
    return checkpoint_name(x, _TAG + name)


def enclosing(jaxpr: Any, around: tuple[str, ...] = ()) -> dict[str, list[Any]]:
    """`{point: [the primitives around each tagged call, outermost first]}`."""
    out: dict[str, list[Any]] = {}
    for inner in _jaxprs(jaxpr):
        for eqn in inner.eqns:
            name = eqn.params.get("name")
            if isinstance(name, str) and name.startswith(_TAG):
                out.setdefault(name.removeprefix(_TAG), []).append(around)
            for v in eqn.params.values():
                for k, chains in enclosing(v, (*around, eqn.primitive.name)).items():
                    out.setdefault(k, []).extend(chains)
    return out


def once_per_layer(chains: list[Any], depth: int) -> bool:
    """Whether one call under `chains` runs once per layer of a `depth`-deep stack.

    True when the call sits under `depth` scans (those over the stack, which the
    shape pass saw slice the point's arrays) and nothing else that repeats or
    skips it (a `cond`, a `while`, another scan, an unknown higher-order primitive).
    """
    if len(chains) != 1:
        return False
    kept = [p for p in chains[0] if p not in _ONCE]
    return kept == ["scan"] * depth

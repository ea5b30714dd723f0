"""The identity of the current JAX trace, for what eqxctx keeps per trace.

A child's frame keeps its traced key only for the trace it was made under
(`_context._derive_key`), and a level's log takes tracers in place only under the
trace it was made under (`_mapping._insert`): nothing eqxctx keeps holds a tracer
past its trace (`jax.checking_leaks`).
"""

import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp


try:
    from jax.extend.core import get_opaque_trace_state as _opaque_trace_state
except ImportError:  # JAX < 0.9 has it only in `jax.core`
    from jax.core import get_opaque_trace_state as _opaque_trace_state


def current_trace_public() -> object:
    """The current JAX trace, opaquely: `==` tells whether two reads saw the same."""
    return _opaque_trace_state(convention="eqxctx")


def _current_trace_getter() -> Callable[[], object]:
    """`current_trace_public`, or the same identity read directly where possible.

    JAX's opaque state is a new object per call (about 0.5 µs); the weak reference
    it wraps is the trace's own (about 0.1 µs, no allocation: a child's frame keeps
    one). JAX-private, so it is checked here and any difference falls back.
    """
    try:
        from jax._src import core

        trace_ctx = core.trace_ctx

        def read() -> object:
            return trace_ctx.trace._weakref

        outer = read()
        inner: list[object] = []

        def same_as_public() -> bool:  # JAX's opaque state wraps exactly this
            return getattr(current_trace_public(), "_trace_ref", None) is read()

        def probe(x: jax.Array) -> jax.Array:
            inner.extend((read(), read(), same_as_public()))
            return x

        # (Abstract: importing eqxctx must not start a JAX backend.)
        jax.make_jaxpr(probe)(jax.ShapeDtypeStruct((), jnp.float32))
        if not (
            isinstance(outer, weakref.ref)
            and same_as_public()
            and len(inner) == 3
            and inner[0] is inner[1]
            and inner[0] != outer
            and inner[2] is True
            and read() is outer
        ):
            return current_trace_public
    except Exception:  # any change in JAX's internals: the public function
        return current_trace_public
    return read


#: `current_trace()`: the current JAX trace's identity, compared with `==` (callers
#: look it up on this module, so that tests can swap in `current_trace_public`).
current_trace: Callable[[], object] = _current_trace_getter()

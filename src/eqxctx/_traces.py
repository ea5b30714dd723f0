"""The identity of the current JAX trace, for the traced keys a context keeps.

A child's frame keeps a key it derived as a tracer only for the trace it was made
under (`_context._derive_key`), so no tracer outlives its trace (`jax.checking_leaks`)
and a deep chain of children reading their keys folds once per level, not once per
ancestor per read. JAX's public opaque trace state is the identity (compared with
`==`); it costs about half a microsecond per read.
"""

try:
    from jax.extend.core import get_opaque_trace_state as _opaque_trace_state
except ImportError:  # JAX < 0.9 has it only in `jax.core`
    from jax.core import get_opaque_trace_state as _opaque_trace_state


def current_trace() -> object:
    """The current JAX trace, opaquely: `==` tells whether two reads saw the same."""
    return _opaque_trace_state(convention="eqxctx")

"""Named scopes for children: `jax.named_scope`'s op names at a constant cost.

`Context.call` and the combinators run their bodies in a named scope, so op names
show the model tree (`c0/c1/tanh`). `jax.named_scope(name)` appends one entry to
JAX's name stack by copying it, and lowering concatenates stacks per equation, so in
a chain of D children each scope and each equation costs O(D). `child_scope(name)`
gives the same op names with a stack that does not grow with eqxctx's nesting: a run
of eqxctx scopes entered under one JAX trace is kept as two entries, the first scope
and the rest joined (`"c0"`, `"c1/c2/c3"`), which JAX prints as it prints the four.

Why only that run:
- A transformation wraps the entry after it, also when JAX puts it in front of a
  stack recorded earlier (`jvp(c0)/c1/c2`, not `jvp(c0/c1/c2)`): the first stays alone.
- A trace that records names relative to the stack it started under (partial
  evaluation, linearization: `current_name_stack()[len(prefix):]`) must find every
  scope entered under it in entries of its own: an entry joins only entries made
  under the same current trace.
- A scope that is not eqxctx's (a user's `jax.named_scope`) keeps its own entry.

The entries are JAX's own `Scope`s; the stacks eqxctx makes are a subclass of JAX's
(equal to JAX's stack of the same entries, and pickled as one) that also notes the
trace it was made under and whether it already holds the run's joined entry. A run
goes on only from such a stack made under the current trace: any stack JAX makes
(a user's scope, a transformation, a slice) starts a new one.

This needs JAX's private `source_info_util` and current trace; where they are missing
or behave otherwise than checked below, `child_scope` is `jax.named_scope`.
"""

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import jax


ScopeFactory = Callable[[str], AbstractContextManager[object]]


def _joining_scope() -> ScopeFactory | None:
    """The joining context manager, or None if JAX is not as expected."""
    try:
        from jax._src import core, source_info_util as siu

        state = siu._source_info_context  # pyright: ignore[reportPrivateUsage]
        trace_ctx = core.trace_ctx
        Scope, Transform, NameStack = siu.Scope, siu.Transform, siu.NameStack
        extend = siu.ExtendNameStackContextManager

        class _RunStack(NameStack):
            """A name stack made by eqxctx: its trace, and whether it is joining.

            `joined`: its last entry already joins scopes (the run's second one).
            """

            __slots__ = ("joined", "trace")
            joined: bool
            trace: "weakref.ref[Any]"

            # Equal to JAX's own stack of the same entries, and pickled as one.
            def __eq__(self, other: object) -> bool:
                return isinstance(other, NameStack) and self.stack == other.stack

            __hash__ = NameStack.__hash__

            def __reduce__(self) -> tuple[type, tuple[Any]]:
                return NameStack, (self.stack,)

        set_joined = _RunStack.__dict__["joined"].__set__
        set_trace = _RunStack.__dict__["trace"].__set__

        class _JoiningScope:
            __slots__ = ("name", "prev")

            def __init__(self, name: str) -> None:
                self.name = name

            def __enter__(self) -> object:
                prev = self.prev = state.context
                name_stack = prev.name_stack
                stack = name_stack.stack
                trace = trace_ctx.trace._weakref
                if type(name_stack) is _RunStack and name_stack.trace is trace:
                    if name_stack.joined:
                        last = f"{stack[-1].name}/{self.name}"
                        new = _RunStack((*stack[:-1], Scope(last)))
                    else:
                        new = _RunStack((*stack, Scope(self.name)))
                    set_joined(new, True)
                else:  # the first scope of a run stays alone
                    new = _RunStack((*stack, Scope(self.name)))
                    set_joined(new, False)
                set_trace(new, trace)
                state.context = prev.replace(name_stack=new)
                return new

            def __exit__(self, *exc: object) -> None:
                state.context = self.prev

        # Only where JAX's own scope is the plain stack extension, prints a joined
        # entry as the entries it joins (transformations included), and has a
        # current trace with a weak reference.
        if type(jax.named_scope("probe")) is not extend:
            return None
        for head in [(), (Scope("user"),), (Transform("jvp"),)]:
            nested = NameStack((*head, Scope("a"), Scope("b"), Scope("c")))
            joined = _RunStack((*head, Scope("a"), Scope("b/c")))
            if (
                str(joined) != str(nested)
                or str(nested + joined) != f"{nested}/{nested}"
            ):
                return None
        with _JoiningScope("a"), _JoiningScope("b"), _JoiningScope("c"):
            inner = siu.current_name_stack()
        if inner.stack[-2:] != (Scope("a"), Scope("b/c")) or inner != NameStack(
            inner.stack
        ):
            return None
    except Exception:  # any change in JAX's internals: fall back to its public scope
        return None
    return _JoiningScope


child_scope: ScopeFactory = _joining_scope() or jax.named_scope
"""`child_scope(name)`: a context manager with `jax.named_scope(name)`'s op names."""

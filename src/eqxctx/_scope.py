"""Named scopes for children: `jax.named_scope`'s op names at a constant cost.

`Context.call` and the combinators run their bodies in a named scope, so op names
show the model tree (`c0/c1/tanh`). `jax.named_scope(name)` appends one entry to
JAX's name stack by copying it, and lowering concatenates stacks per equation, so in
a chain of D children each scope and each equation costs O(D). `child_scope(name)`
gives the same op names with a stack that does not grow with eqxctx's nesting: a run
of eqxctx scopes is kept as two entries, the first scope and the rest joined
(`"c0"`, `"c1/c2/c3"`), which JAX prints as it prints the four. The first stays
alone because a transformation wraps the entry after it, also when JAX puts the
transformation in front of a stack recorded earlier (`jvp(c0)/c1/c2`, not
`jvp(c0/c1/c2)`), and a scope that is not eqxctx's (a user's `jax.named_scope`)
keeps its own entry.

This needs JAX's private `source_info_util`; where that is missing or behaves
otherwise than checked below, `child_scope` is `jax.named_scope`.
"""

from collections.abc import Callable
from contextlib import AbstractContextManager

import jax


ScopeFactory = Callable[[str], AbstractContextManager[object]]


def _joining_scope() -> ScopeFactory | None:
    """The joining context manager, or None if JAX's name stack is not as expected."""
    try:
        from jax._src import source_info_util as siu

        state = siu._source_info_context  # pyright: ignore[reportPrivateUsage]
        Scope, Transform, NameStack = siu.Scope, siu.Transform, siu.NameStack
        extend = siu.ExtendNameStackContextManager
    except (ImportError, AttributeError):
        return None

    class _ChildScope(Scope):
        """A name-stack entry made by eqxctx: later eqxctx scopes may join it."""

        __slots__ = ()

    class _JoiningScope:
        __slots__ = ("name", "prev")

        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> None:
            prev = self.prev = state.context
            stack = prev.name_stack.stack
            if (
                len(stack) > 1
                and type(stack[-1]) is _ChildScope
                and type(stack[-2]) is _ChildScope
            ):
                last = stack[-1]
                stack = (*stack[:-1], _ChildScope(f"{last.name}/{self.name}"))
            else:
                stack = (*stack, _ChildScope(self.name))
            state.context = prev.replace(name_stack=NameStack(stack))

        def __exit__(self, *exc: object) -> None:
            state.context = self.prev

    # Only where JAX's own scope is the plain stack extension, and prints a joined
    # entry as the entries it joins, transformations included.
    try:
        if type(jax.named_scope("probe")) is not extend:
            return None
        for head in [(), (Scope("user"),), (Transform("jvp"),)]:
            nested = NameStack((*head, Scope("a"), Scope("b"), Scope("c")))
            joined = NameStack((*head, _ChildScope("a"), _ChildScope("b/c")))
            if str(joined) != str(nested):
                return None
        with _JoiningScope("a"), _JoiningScope("b"), _JoiningScope("c"):
            inner = siu.current_name_stack()
        if inner.stack[-2:] != (Scope("a"), Scope("b/c")):
            return None
    except Exception:  # any change in JAX's internals: fall back to its public scope
        return None
    return _JoiningScope


child_scope: ScopeFactory = _joining_scope() or jax.named_scope
"""`child_scope(name)`: a context manager with `jax.named_scope(name)`'s op names."""

"""One carry rule for every loop: scan_in_context, while_in_context, fori_in_context.

Found in issue 36 (the carry check written once): the while loop promoted a weakly
typed carry where `jax.lax.while_loop` refuses to, and named a Python scalar whose
shape the body changed by a dtype it never had.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from eqxctx import Context, fori_in_context, scan_in_context, while_in_context


def _scan(init: Any, body: Callable[[Any], Any]) -> Any:
    return scan_in_context(
        lambda c, x, ctx: (body(c), None, ctx),
        context=Context.root(),
        carry=init,
        xs=None,
        length=2,
    )


def _while(init: Any, body: Callable[[Any], Any]) -> Any:
    return while_in_context(
        lambda v: jnp.all(v < 3),
        lambda v, ctx: (body(v), ctx),
        init,
        context=Context.root(),
    )


def _fori(init: Any, body: Callable[[Any], Any]) -> Any:
    return jax.jit(
        lambda n: fori_in_context(
            0, n, lambda i, v, ctx: (body(v), ctx), init, context=Context.root()
        )
    )(2)


_LOOPS = {
    "scan": (
        _scan,
        lambda init, body: jax.lax.scan(
            lambda c, x: (body(c), None), init, None, length=2
        ),
    ),
    "while": (
        _while,
        lambda init, body: jax.lax.while_loop(lambda v: jnp.all(v < 3), body, init),
    ),
    "fori": (
        _fori,
        lambda init, body: jax.jit(
            lambda n: jax.lax.fori_loop(0, n, lambda i, v: body(v), init)
        )(2),
    ),
}


@pytest.mark.parametrize("loop", sorted(_LOOPS))
def test_weak_carry_without_a_promotion_path_raises_jaxs_error(loop: str) -> None:
    # Strict promotion (conftest): a Python float cannot become an int32, in JAX's
    # loops and in eqxctx's alike.
    ours, reference = _LOOPS[loop]
    promotion = "no available implicit dtype promotion path"
    with pytest.raises(ValueError, match=promotion):
        reference(0.0, lambda v: jnp.int32(3))
    with pytest.raises(ValueError, match=promotion):
        ours(0.0, lambda v: jnp.int32(3))


@pytest.mark.parametrize("loop", sorted(_LOOPS))
def test_weak_carry_that_changes_shape_is_named_as_given(loop: str) -> None:
    ours, reference = _LOOPS[loop]
    body = lambda v: jnp.zeros(3, jnp.bfloat16)
    with pytest.raises(TypeError, match="shapes do not match"):
        reference(0.0, body)
    with pytest.raises(
        TypeError,
        match=r"went in as a weakly typed float32\[\] \(e\.g\. a Python scalar\) but "
        r"(the body|body_fn) returned bfloat16\[3\].*never its shape",
    ):
        ours(0.0, body)

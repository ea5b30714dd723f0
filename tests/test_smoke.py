import jax

import eqxctx


def test_import() -> None:
    assert eqxctx.Context.root(prng_key=jax.random.PRNGKey(0)).path == ("root",)

import contextlib
import io
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

import eqxctx


README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_example_runs_and_prints_its_outputs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1
    scope: dict[str, object] = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], str(README), "exec"), scope)
    coll = scope["coll"]
    y = scope["y"]
    assert isinstance(coll, eqxctx.OutputCollection)
    assert isinstance(y, jax.Array)
    flat = coll.flatten("summaries")
    assert sorted(flat) == ["block/rms", "loss"]
    np.testing.assert_allclose(flat["block/rms"], jnp.sqrt(jnp.mean(y**2)), rtol=1e-6)
    np.testing.assert_allclose(flat["loss"].value(), jnp.mean(y), rtol=1e-6)
    np.testing.assert_allclose(coll.flatten("module_outputs")["block/hidden"], y)
    assert "block/rms" in out.getvalue()

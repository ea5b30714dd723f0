import contextlib
import io
import pathlib
import re
import tomllib

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


ROOT = README.parent


def _block(text: str, fence: str) -> list[str]:
    """The lines of the first ```{fence} block of `text`."""
    return re.findall(rf"```{fence}\n(.*?)```", text, flags=re.S)[0].splitlines()


def test_readme_shows_what_the_demo_prints() -> None:
    # Issue 35 item 19: the `done in N s` line the demo prints was missing. The
    # demo's page shows its whole console output (its test checks each line's
    # form, `test_demo.py`); the README shows it from the results on.
    shown = _block(README.read_text(), "text")
    console = _block((ROOT / "docs" / "demo.md").read_text(), "console")
    start = console.index(shown[0])
    assert shown[0].startswith("test accuracy:")
    assert shown == console[start:]
    assert re.fullmatch(r"done in \d+\.\d s", shown[-1])


def test_readme_points_at_the_docs_targets() -> None:
    # Issue 35 item 19: `mkdocs serve` after `make test` is a Makefile target.
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.M))
    assert {"docs", "serve-docs"} <= targets
    phony = re.search(r"^\.PHONY:(.*)$", makefile, flags=re.M)
    assert phony is not None
    assert {"docs", "serve-docs"} <= set(phony.group(1).split())
    readme = README.read_text()
    assert "`make serve-docs`" in readme
    assert "`make docs`" in readme
    assert "mkdocs serve" not in readme


def test_runtime_dependencies_are_imported_by_the_library() -> None:
    # Issue 35 item 19: beartype was a runtime dependency that nothing in src/
    # imports (the test suite's runtime checks use it: the `test` extra and group).
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = [
        re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower()  # pyright: ignore[reportOptionalMemberAccess]
        for d in project["project"]["dependencies"]
    ]
    source = "\n".join(p.read_text() for p in (ROOT / "src").rglob("*.py"))
    for name in names:
        if name == "jaxlib":  # jax's backend, pinned beside it; jax imports it
            continue
        assert re.search(rf"^\s*(import|from) {name}\b", source, flags=re.M), name
    assert "beartype" not in names
    for tests in (
        project["project"]["optional-dependencies"]["test"],
        project["dependency-groups"]["test"],
    ):
        assert any(d.startswith("beartype") for d in tests)

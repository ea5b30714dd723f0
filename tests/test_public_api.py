import inspect
import pathlib
import types

import eqxctx


DOCS = pathlib.Path(__file__).parent.parent / "docs" / "api"


def public_names() -> list[str]:
    return sorted(
        name
        for name, obj in vars(eqxctx).items()
        if not name.startswith("_") and not isinstance(obj, types.ModuleType)
    )


def test_every_public_name_is_documented() -> None:
    text = "\n".join(p.read_text() for p in DOCS.glob("*.md"))
    missing = [n for n in public_names() if f"::: eqxctx.{n}" not in text]
    assert not missing, f"not in docs/api/*.md: {missing}"


def test_every_public_name_has_a_docstring() -> None:
    for name in public_names():
        doc = inspect.getdoc(getattr(eqxctx, name))
        assert doc, name
        assert len(doc) > 40, name


def test_core_names_are_exported() -> None:
    for name in ("Context", "OutputCollection", "OutputConflictError", "functional"):
        assert name in public_names()


def test_branch_and_loop_names_are_exported() -> None:
    for name in (
        "cond_in_context",
        "switch_in_context",
        "while_in_context",
        "fori_in_context",
    ):
        assert name in public_names()


def test_importing_eqxctx_starts_no_jax_backend() -> None:
    # Programs set device flags (XLA_FLAGS, `jax.config`) after their imports; the
    # import-time checks of JAX's internals (`_scope.py`, `_context.py`) trace
    # abstractly and must not start a backend.
    import os
    import subprocess
    import sys

    code = (
        "import eqxctx, eqxctx.writers, eqxctx.testing\n"
        "from jax._src import xla_bridge\n"
        "print(sorted(xla_bridge._backends))\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # also on an accelerator host
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


SRC = pathlib.Path(__file__).parent.parent / "src" / "eqxctx"


def test_no_module_uses_jax_private_internals() -> None:
    # issue 36: JAX's private modules change without notice; public fallbacks exist.
    offenders = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "jax._src" in line or "source_info_util" in line
    ]
    assert not offenders, "\n".join(offenders)

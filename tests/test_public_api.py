import inspect
import pathlib
import re
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
    for name in (
        "Context",
        "OutputCollection",
        "OutputConflictError",
        "LostOutputError",
        "functional",
    ):
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


def _imports_of(path: pathlib.Path) -> set[str]:
    """The eqxctx modules `path` imports, wherever the import statement sits."""
    import ast

    package = ["eqxctx", *path.relative_to(SRC).with_suffix("").parts]
    if package[-1] == "__init__":
        package.pop()
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("eqxctx."))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[
                    : len(package) - node.level + (path.stem == "__init__")
                ]
                base = ".".join([*parent, *([base] if base else [])])
            if base == "eqxctx" or base.startswith("eqxctx."):
                # `from . import _x` imports the module `_x`.
                found.update(
                    f"{base}.{a.name}"
                    if (SRC.parent / base.replace(".", "/") / a.name).exists()
                    or (SRC.parent / f"{base.replace('.', '/')}/{a.name}.py").exists()
                    else base
                    for a in node.names
                )
    return found


def test_no_import_circle() -> None:
    # issue 36: every import counts, at module level, inside functions and under
    # `if TYPE_CHECKING:` alike (a type named across two modules ties them as much
    # as a call does). A package's `__init__` re-exporting its modules is not a
    # circle: a module importing its own package's `__init__` is left out.
    modules = {
        ".".join(["eqxctx", *p.relative_to(SRC).with_suffix("").parts]).removesuffix(
            ".__init__"
        ): p
        for p in SRC.rglob("*.py")
    }
    graph = {
        name: {
            m
            for m in _imports_of(path)
            if m in modules and not name.startswith(m + ".")
        }
        - {name}
        for name, path in modules.items()
    }
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycles.append([*trail[trail.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*trail, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _layers() -> dict[str, int]:
    """Each module's layer (its index) in `docs/architecture.md`'s module map."""
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    block = text.split("```")[1]
    layers: dict[str, int] = {}
    layer = -1
    for line in block.splitlines():
        if line and not line.startswith(" "):
            layer += 1
        for name in re.findall(r"(?:writers/)?_?[a-z_]+(?:\.py|/)", line):
            module = name.removesuffix(".py").removesuffix("/").replace("/", ".")
            layers[f"eqxctx.{module}"] = layer
    return layers


def test_modules_import_only_from_their_layer_or_above() -> None:
    # issue 36: docs/architecture.md's module map is the layering; a module imports
    # only from its own layer or the ones listed before it.
    layers = _layers()

    def layer_of(module: str) -> int | None:
        while module not in layers and "." in module:
            module = module.rsplit(".", 1)[0]
        return layers.get(module)

    unmapped, wrong = [], []
    for path in sorted(SRC.rglob("*.py")):
        name = ".".join(["eqxctx", *path.relative_to(SRC).with_suffix("").parts])
        if name.endswith("__init__") and name.count(".") <= 2:
            continue  # a package re-exports its modules
        mine = layer_of(name)
        if mine is None:
            unmapped.append(name)
            continue
        for dep in _imports_of(path):
            theirs = layer_of(dep)
            if theirs is not None and theirs > mine:
                wrong.append(f"{name} imports {dep}")
    assert not unmapped, f"not in docs/architecture.md's module map: {unmapped}"
    assert not wrong, "\n".join(wrong)


def test_no_module_over_500_lines() -> None:
    # issue 36: one job per module, none over ~500 lines (docstrings included).
    long = {
        str(path.relative_to(SRC)): n
        for path in SRC.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 500
    }
    assert not long, long

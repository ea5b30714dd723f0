"""Hook points: the `eqx.Module` nodes of a model, named by their path; selections."""

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import equinox as eqx
import jax


#: What selects hook points: an exact name or a glob (`"blocks.*"`), a module type,
#: an `eqx.tree_at`-style `where(model) -> node | sequence of nodes`, or a sequence
#: of these (their union).
Selection: TypeAlias = (
    str | type | Callable[[Any], Any] | Sequence["str | type | Callable[[Any], Any]"]
)
KeyPath: TypeAlias = tuple[Any, ...]
_UNSAFE = re.compile(r"[^a-z0-9_]")


@dataclasses.dataclass(frozen=True)
class HookPoint:
    """One `eqx.Module` node of a model: where `capture` can record and intervene.

    Attributes:
        name: the node's path from the model, spelled as Python would reach it
            (`"blocks.attn"`, `"layers[2]"`, `"heads['q']"`); the model itself is not
            a hook point.
        path: where its entries go in the returned `OutputCollection`, child names
            joined by `/`: each attribute is a child (lower-cased; characters outside
            `[a-z0-9_]` become `_`), a sequence index or mapping key is appended to
            the name before it with `_` (`"layers[2].attn"` -> `"layers_2/attn"`).
        module_type: the node's class.
        key_path: the JAX key path of the node (for `eqx.tree_at`).
    """

    name: str
    path: str
    module_type: type
    key_path: KeyPath = dataclasses.field(repr=False)


def _component(key: Any) -> tuple[str, bool]:
    """Return a key's text and whether it starts a new child (an attribute)."""
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name, True
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx), False
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key), False
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key), False
    raise TypeError(f"unsupported key {key!r} in a model's PyTree path")


def collection_path(key_path: KeyPath) -> str:
    """Return the collection path of a node's key path (see `HookPoint.path`)."""
    parts: list[str] = []
    for key in key_path:
        text, new_child = _component(key)
        text = _UNSAFE.sub("_", text.lower())
        if new_child or not parts:
            if not text or not text[0].isalpha():
                text = f"m_{text}"
            parts.append(text)
        else:
            parts[-1] = f"{parts[-1]}_{text}"
    return "/".join(parts)


def leaf_suffix(key_path: KeyPath) -> str:
    """Return a leaf's key path as one name part (`(1, "sq")` -> `"1_sq"`)."""
    return "_".join(_UNSAFE.sub("_", _component(k)[0].lower()) for k in key_path)


def _name(key_path: KeyPath) -> str:
    return jax.tree_util.keystr(key_path).removeprefix(".")


def _walk(node: object, prefix: KeyPath, out: list[tuple[KeyPath, object]]) -> None:
    children, _ = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node and isinstance(x, eqx.Module)
    )
    for kp, child in children:
        if isinstance(child, eqx.Module):
            out.append(((*prefix, *kp), child))
            _walk(child, (*prefix, *kp), out)


def module_nodes(model: object) -> list[tuple[KeyPath, object]]:
    """Return every `eqx.Module` node under `model` (not `model`), parents first."""
    out: list[tuple[KeyPath, object]] = []
    _walk(model, (), out)
    return out


def hook_points(model: object) -> dict[str, HookPoint]:
    """Return the hook points of `model`, by name, in PyTree order (parents first).

    Every `eqx.Module` node below `model` is a hook point (`capture` can record its
    output and intervene on it); a node in a static field is not.

    Args:
        model: any PyTree, usually an `eqx.Module`; it is not changed.

    Returns:
        `{name: HookPoint}`; `HookPoint.path` is where `capture` puts its entries.

    Raises:
        TypeError: if a node sits under a PyTree whose keys cannot be named.
        ValueError: if two points map to one collection path (`"a.B"` and `"a.b"`).

    Examples:
        >>> mlp = eqx.nn.MLP(2, 1, 4, 2, key=jax.random.key(0))
        >>> {k: p.path for k, p in hook_points(mlp).items()}
        {'layers[0]': 'layers_0', 'layers[1]': 'layers_1', 'layers[2]': 'layers_2'}
    """
    points: dict[str, HookPoint] = {}
    paths: dict[str, str] = {}
    for key_path, node in module_nodes(model):
        name = _name(key_path)
        path = collection_path(key_path)
        if path in paths:
            raise ValueError(
                f"`eqxctx.hook_points`: the points {paths[path]!r} and {name!r} both "
                f"map to the collection path {path!r}; rename one of the fields."
            )
        paths[path] = name
        points[name] = HookPoint(name, path, type(node), key_path)
    return points


def _glob(pattern: str) -> re.Pattern[str]:
    """`*` matches any run of characters, `?` one; everything else is literal."""
    out = "".join(
        ".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern
    )
    return re.compile(out)


def _listing(points: dict[str, HookPoint]) -> str:
    shown = [f"{n} ({p.module_type.__name__})" for n, p in points.items()]
    more = f", ... ({len(shown) - 40} more)" if len(shown) > 40 else ""
    return ", ".join(shown[:40]) + more


def select(
    model: object, selection: Selection, *, where: str = "eqxctx.capture"
) -> list[HookPoint]:
    """Return the hook points of `model` that `selection` names (PyTree order).

    Raises:
        ValueError: if `selection` is empty or a part of it matches no point (the
            message lists the points).
        TypeError: if a part is not a string, a type or a callable.
    """
    points = hook_points(model)
    parts: list[object]
    if isinstance(selection, (str, type)) or callable(selection):
        parts = [selection]
    elif isinstance(selection, Sequence):  # pyright: ignore[reportUnnecessaryIsInstance]
        parts = list(selection)
    else:
        raise TypeError(
            f"`{where}`: a selection is a name or glob, a module type, a "
            f"`where(model)` function or a list of these; got {selection!r}."
        )
    if not parts:
        raise ValueError(
            f"`{where}`: an empty selection matches no hook point. The points are: "
            f"{_listing(points) or '(none: the model has no eqx.Module)'}."
        )
    nodes = dict(module_nodes(model))
    chosen: set[str] = set()
    for part in parts:
        found = _match(part, points, nodes, model, where)
        if not found:
            raise ValueError(
                f"`{where}`: the selection {part!r} matches no hook point. The points "
                f"are: {_listing(points) or '(none: the model has no eqx.Module)'}."
            )
        chosen.update(found)
    return [p for n, p in points.items() if n in chosen]


def _match(
    part: object,
    points: dict[str, HookPoint],
    nodes: dict[KeyPath, object],
    model: object,
    where: str,
) -> list[str]:
    if isinstance(part, str):
        if part in points:
            return [part]
        pattern = _glob(part)
        return [n for n in points if pattern.fullmatch(n)]
    if isinstance(part, type):
        return [n for n, p in points.items() if issubclass(p.module_type, part)]
    if callable(part):
        picked = part(model)
        targets = list(picked) if isinstance(picked, (list, tuple)) else [picked]
        ids = {id(t) for t in targets}
        return [n for n, p in points.items() if id(nodes[p.key_path]) in ids]
    raise TypeError(
        f"`{where}`: a selection is a name or glob, a module type, a `where(model)` "
        f"function or a list of these; got {part!r}."
    )


def get_node(model: object, key_path: KeyPath) -> Any:
    """Return the node of `model` at `key_path`."""
    node: Any = model
    for key in key_path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            node = getattr(node, key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            node = node[key.idx]
        elif isinstance(key, jax.tree_util.DictKey):
            node = node[key.key]
        else:
            raise TypeError(
                f"`eqxctx.capture`: cannot reach the node at {_name(key_path)!r} "
                f"through the key {key!r}; select a point above it."
            )
    return node

"""Structure reconciliation of branch outputs, and summary identities.

The branches of a `cond_in_context` / `switch_in_context` may add different outputs;
`jax.lax.switch` needs one structure. The result is the union: an entry present in
every branch (same kind, shape, dtype) is selected from the branch taken; a summary
missing from some branches is filled there with its kind's identity
(`Summary.identity`); anything else that is missing, or that differs between
branches, raises `ValueError` naming the path and the branches.

Trees here are plain nested dicts of *specs*: leaves with `.shape` and `.dtype`
(`jax.ShapeDtypeStruct`s from `jax.eval_shape`, or tracers), `Summary` objects with
such leaves, and `_Entry` for an `IterationSummaries`.
"""

from collections.abc import Mapping
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from ._collection import OutputCollection
from ._gradients import is_pending
from ._iterations import IterationSummaries
from ._leaves import KINDS
from ._mapping import Entry
from ._summary import Summary
from ._typing import ArrayTree, DType, Leaf, Tree, TreeDef


#: A spec tree (see above): a dict, a leaf spec, an `_Entry` or `_MISSING`.
Spec: TypeAlias = Any


class _Entry:
    """The spec of an `IterationSummaries`: length, outer axes, stacked tree, order."""

    __slots__ = ("length", "outer", "reverse", "stacked")

    def __init__(
        self, length: int, outer: int, stacked: dict[str, Spec], reverse: bool
    ):
        self.length = length
        self.outer = outer
        self.stacked = stacked
        self.reverse = reverse


def _dtype(x: object) -> DType:
    dtype = getattr(x, "dtype", None)
    return jnp.result_type(x) if dtype is None else dtype


# The `(shape, dtype)` pairs are a `tuple[Any, ...]`: beartype would sample them.
def _signature(leaf: Leaf) -> tuple[str, TreeDef, tuple[Any, ...]]:
    """Kind, structure, shapes and dtypes of a leaf (weak types ignored)."""
    leaves, treedef = jax.tree_util.tree_flatten(leaf)
    if is_pending(leaf):
        kind = "gradient probe"
    else:
        kind = type(leaf).__name__ if isinstance(leaf, Summary) else "array"
    return (
        kind,
        treedef,
        tuple((tuple(np.shape(x)), _dtype(x)) for x in leaves),
    )


def _describe(leaf: Leaf) -> str:
    kind, _, arrays = _signature(leaf)
    shapes = ", ".join(f"{dtype}{list(shape)}" for shape, dtype in arrays)
    return f"{kind}({shapes})"


def _spec_of(value: Entry) -> Spec:
    """Turn a collection level into a spec tree (dicts, leaves and `_Entry`s)."""
    if isinstance(value, IterationSummaries):
        leaves = jax.tree_util.tree_leaves(value.stacked)
        outers = {np.ndim(x) - n for x, n in zip(leaves, value.ndims, strict=True)}
        return _Entry(
            value.length,
            min(outers, default=0),
            _spec_of(value.stacked),
            value.reverse,
        )
    if isinstance(value, Mapping):
        return {k: _spec_of(v) for k, v in value.items()}
    return value


def has_identity(leaf: Leaf) -> bool:
    """Whether `leaf` (a spec) is a `Summary` whose kind has an identity."""
    if not isinstance(leaf, Summary):
        return False
    out = jax.eval_shape(lambda: identity_of(leaf))
    return out is not None


def identity_of(spec: Leaf) -> Leaf:
    """Return the identity of a `Summary` spec (None if none), or zeros for an array."""
    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(np.shape(s), _dtype(s)), spec)
    if not isinstance(spec, Summary):
        return zeros
    ident = zeros.identity()
    if ident is None:
        return None
    return _cast(ident, spec)


def _cast(tree: ArrayTree, like: ArrayTree) -> ArrayTree:
    leaves, treedef = jax.tree_util.tree_flatten(like)
    got = jax.tree_util.tree_leaves(tree)
    return treedef.unflatten(
        [jnp.asarray(x).astype(_dtype(s)) for x, s in zip(got, leaves, strict=True)]
    )


#: What one entry of each kind is called in messages.
_NOUNS = {
    "summaries": "summary",
    "module_outputs": "module output",
    "state_updates": "state update",
}
_PROBE = "a gradient probe (add_gradient_summary/add_gradient_output)"


def _article(word: str) -> str:
    return f"an {word}" if word[0].lower() in "aeiou" else f"a {word}"


def _unfillable(kind: str, spec: Spec, path: str) -> tuple[str, str] | None:
    """Return `(path, what)` of the first entry that has no identity, else None."""
    if isinstance(spec, _Entry):
        return _unfillable(kind, spec.stacked, path)
    if isinstance(spec, dict):
        for k, v in spec.items():
            found = _unfillable(kind, v, f"{path}/{k}")
            if found is not None:
                return found
        return None
    if is_pending(spec):
        return path, _PROBE
    if kind != "summaries":
        return path, _article(_NOUNS[kind])
    if not isinstance(spec, Summary):
        return path, "a raw-array summary"
    if not has_identity(spec):
        return path, f"{_article(type(spec).__name__)} (a kind without an identity)"
    return None


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def kinds_with_identity() -> list[str]:
    """The names of eqxctx's public summary kinds that define `Summary.identity`."""
    return sorted(
        {
            c.__name__
            for c in _subclasses(Summary)
            if c.__module__.startswith("eqxctx.")
            and not c.__name__.startswith("_")
            and getattr(c, "identity", None) is not Summary.identity
        }
    )


def _union(
    kind: str,
    specs: list[Any],  # of `Spec`s: beartype would sample a list's items
    path: str,
    names: tuple[str, ...],
    where: str,
) -> Spec:
    """Return the union spec of one entry over the branches (`_MISSING` if absent)."""
    present = [i for i, s in enumerate(specs) if s is not _MISSING]
    given = [specs[i] for i in present]
    first = given[0]
    missing = [names[i] for i, s in enumerate(specs) if s is _MISSING]
    if missing:
        bad = _unfillable(kind, first, path)
        if bad is not None:
            at, what = bad
            has = ", ".join(names[i] for i in present)
            if what == _PROBE:
                fix = (
                    "A gradient probe has no value to fill in for a branch that does "
                    "not add it: add it in every branch, or before the branch."
                )
            else:
                fix = (
                    "Only summaries whose kind has an identity "
                    f"({', '.join(kinds_with_identity())}, or a kind of your own "
                    "that defines `Summary.identity`) can be missing from a branch: "
                    "wrap it in such a kind (e.g. `WeightedSummary(x, 1)` for a mean) "
                    "or add it in every branch."
                )
            raise ValueError(
                f"{where}: {what} at {at!r} is added in {has} but not in "
                f"{', '.join(missing)}. {fix}"
            )
    shapes = {type(s) for s in given}
    if len(shapes) > 1 or (
        not isinstance(first, (dict, _Entry))
        and len({_signature(s) for s in given}) > 1
    ):
        listing = "; ".join(f"{names[i]}: {_what(specs[i])}" for i in present)
        raise ValueError(
            f"{where}: the {_NOUNS[kind]} at {path!r} differs between branches "
            f"({listing}). An entry added "
            "in several branches needs the same kind, shape and dtype in each: cast "
            "or reshape it, or give the entries different names."
        )
    if isinstance(first, dict):
        keys: dict[str, None] = {}
        for s in given:
            keys.update(dict.fromkeys(s))
        return {
            k: _union(
                kind,
                [s.get(k, _MISSING) if s is not _MISSING else _MISSING for s in specs],
                f"{path}/{k}",
                names,
                where,
            )
            for k in keys
        }
    if isinstance(first, _Entry):
        lengths = {s.length for s in given}
        if len(lengths) > 1:
            raise ValueError(
                f"{where}: {path!r} holds per-iteration summaries of different lengths "
                f"{sorted(lengths)} in different branches; scan the same number of "
                "iterations in every branch, or use another child name."
            )
        if len({s.reverse for s in given}) > 1:
            raise ValueError(
                f"{where}: {path} holds per-iteration summaries of a scan run forward "
                "in some branches and in reverse in others; their merged views would "
                "differ. Scan in the same direction in every branch, or use another "
                "child name."
            )
        stacked = _union(
            kind,
            [s.stacked if s is not _MISSING else _MISSING for s in specs],
            path + "{i}",
            names,
            where,
        )
        return _Entry(first.length, first.outer, stacked, first.reverse)
    return first


def _what(spec: Spec) -> str:
    if isinstance(spec, dict):
        return "a child"
    if isinstance(spec, _Entry):
        return f"per-iteration summaries of {spec.length} iterations"
    return _describe(spec)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Spec = _Missing()


def union_collections(
    colls: list[OutputCollection], names: tuple[str, ...], path: str, where: str
) -> dict[str, Spec]:
    """Return `{kind: union spec}` of the branches' collections, or raise.

    `path` is the construct's context path (`root/.../cond`), for the messages.
    """
    out: dict[str, Spec] = {}
    for kind in KINDS:
        specs = [_spec_of(getattr(c, kind)) for c in colls]
        out[kind] = _union(kind, specs, path, names, where)
    return out


def _fill(spec: Spec, value: Entry) -> Entry:
    """Return `value` laid out as `spec`, with identities where it lacks entries."""
    if isinstance(spec, _Entry):
        stacked = _fill(spec.stacked, _MISSING if value is _MISSING else value.stacked)
        leaves = jax.tree_util.tree_leaves(stacked)
        ndims = tuple(np.ndim(x) - spec.outer for x in leaves)
        return IterationSummaries(spec.length, stacked, ndims, spec.reverse)
    if isinstance(spec, dict):
        got: Tree = {} if value is _MISSING else value
        return {k: _fill(v, got.get(k, _MISSING)) for k, v in spec.items()}
    if value is _MISSING:
        return identity_of(spec)
    return _cast(value, spec)


def fill_collection(spec: dict[str, Spec], coll: OutputCollection) -> OutputCollection:
    """Return `coll` in the union layout `spec` (from `union_collections`)."""
    return OutputCollection(*(_fill(spec[kind], getattr(coll, kind)) for kind in KINDS))

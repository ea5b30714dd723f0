"""`Frozen`: a PyTree of hashable leaves compared by value, for static arguments.

Follows `eqx.filter_jit`'s treatment of non-array leaves (static, hashed), with the
leaves' types compared too.
"""

import dataclasses

import jax

from ._typing import ArrayTree


class Frozen:
    """A PyTree of hashable leaves, hashed and compared by value (a static arg)."""

    __slots__ = ("_hash", "leaves", "treedef", "types")

    def __init__(self, tree: ArrayTree, *, what: str):
        leaves, treedef = jax.tree.flatten(tree)
        self.leaves = tuple(leaves)
        self.treedef = treedef
        # `2 == 2.0 == True`: compare types too (of the leaves and of the values in
        # the treedef, such as `eqx.field(static=True)` fields), or runners of
        # models that differ only there would share one compiled program (and its
        # output dtypes).
        self.types = _value_types(tree)
        try:
            self._hash = hash((treedef, self.leaves, self.types))
        except TypeError as e:
            raise TypeError(
                f"`MethodRunner`: {what} has a non-array leaf that is not hashable "
                f"({e}). Non-array leaves are static (as in `eqx.filter_jit`) and "
                "must be hashable; turn it into an array or a tuple."
            ) from None

    def tree(self) -> ArrayTree:
        return self.treedef.unflatten(self.leaves)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, Frozen)
            and self._hash == other._hash
            and self.treedef == other.treedef
            and self.types == other.types
            and self.leaves == other.leaves
        )


def _value_types(x: object) -> object:
    """The types of everything `x` holds, nested like it (for `Frozen`'s equality).

    Walks dataclasses (so `eqx.Module`s, including their `eqx.field(static=True)`
    fields, which a treedef compares only with `==`), tuples, lists and dicts.
    """
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (
            type(x),
            tuple(
                (f.name, _value_types(getattr(x, f.name, None)))
                for f in dataclasses.fields(x)
            ),
        )
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_value_types(v) for v in x))
    if isinstance(x, dict):
        return (dict, tuple((k, _value_types(v)) for k, v in x.items()))
    return type(x)

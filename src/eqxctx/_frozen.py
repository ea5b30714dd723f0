"""`Frozen`: a PyTree of hashable leaves compared by value, for static arguments.

Follows `eqx.filter_jit`'s treatment of non-array leaves (static, hashed), with the
leaves' types compared too.
"""

import dataclasses
from typing import Any, NoReturn, TypeVar

import equinox as eqx
import jax

from ._typing import ArrayTree


T = TypeVar("T")


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


def refuse_assignment(cls: type[T]) -> type[T]:
    """Make every assignment and deletion of an attribute raise `FrozenInstanceError`.

    For frozen dataclasses with `slots=True`: on Python 3.11 their generated
    `__setattr__` refers to the class before `slots=True` rebuilt it, so assigning an
    attribute that is not a field raised `TypeError: super(type, obj): ...` instead
    (a CPython 3.11 bug). The dataclass's own `__init__` and `dataclasses.replace`
    set fields with `object.__setattr__`, so they are unaffected.
    """

    def refuse(self: object, name: str, value: object = None) -> NoReturn:
        del self, value
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def refuse_delete(self: object, name: str) -> NoReturn:
        del self
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    type.__setattr__(cls, "__setattr__", refuse)
    type.__setattr__(cls, "__delattr__", refuse_delete)
    return cls


class TreeEquality:
    """Equality as `eqx.Module`'s: `eqx.tree_equal` of two instances; unhashable.

    The base of eqxctx's PyTree classes that are not `eqx.Module`s (`Context`,
    `OutputCollection`, `SummaryAccumulator`, `MethodRunner`): `a == b` is
    `eqx.tree_equal(a, b)` (a `bool`, or a traced boolean array inside a trace), and
    `hash()` raises `TypeError`, as for a Module with array fields.
    """

    __slots__ = ()

    def __eq__(self, other: object) -> Any:  # `bool | Array` (`eqx.tree_equal`)
        if not isinstance(other, TreeEquality):
            return NotImplemented
        return eqx.tree_equal(self, other)

    __hash__ = None  # pyright: ignore[reportAssignmentType]

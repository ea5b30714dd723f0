"""A context's frame: its path, key and flags, with children's derived on read.

Keys follow AXLearn's `InvocationContext` (`axlearn/common/module.py`): a child's key
is `jax.random.fold_in(parent_key, child_seed(name))`.
"""

import functools
import hashlib
from typing import Any

import jax

from ._checks import check_is_training, check_prng_key, check_summary_level
from ._ledger import Ledger
from ._rows import RowMask, check_row_mask
from ._typing import MaybeKey, Names, PRNGKey


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


#: The default of an argument not given. `Any`: it stands in for other types.
UNSET: Any = _Unset()
#: The `key` of a child's frame whose key is `fold_in(parent's key, seed(name))`.
DERIVED: Any = _Unset()


@functools.lru_cache(maxsize=4096)
def child_seed(name: str) -> int:
    """Return AXLearn's seed of a child name: md5 of the name, mod `2**31 - 1`."""
    return int(hashlib.md5(name.encode("utf-8")).hexdigest(), 16) % (2**31 - 1)


def fold_in_name(prng_key: PRNGKey | None, name: str) -> PRNGKey | None:
    """Return `jax.random.fold_in(prng_key, child_seed(name))`, or None for None."""
    if prng_key is None:
        return None
    return jax.random.fold_in(prng_key, child_seed(name))


class Frame:
    """Everything of a context but its collection; never written after construction.

    Shared by the contexts that adds make from it. A child's frame (`child_frame`)
    holds its parent's frame and its name instead of a path (`path` None) and a key
    (`key` `DERIVED`), so making a child is O(1) whatever the depth; `path_of` and
    `key_of` derive them on each read.
    """

    __slots__ = (
        "gradients",
        "is_training",
        "key",
        "ledger",
        "name",
        "path",
        "row_mask",
        "shape_only",
        "summary_level",
        "up",
    )

    def __init__(
        self,
        path: Names | None,
        key: MaybeKey,  # also batched: a context unflattened by `jax.vmap`
        is_training: bool,
        shape_only: bool,
        summary_level: int | None,
        gradients: Any,  # a `GradientState` under `value_and_grad`, else None
        up: "Frame | None" = None,
        name: str | None = None,
        *,
        row_mask: RowMask | None = None,
        ledger: "Ledger | None" = None,
    ) -> None:
        self.path = path
        self.key = key
        self.is_training = is_training
        # True inside eqxctx's own shape-only passes (`jax.eval_shape` of a scan
        # body): nested scans then skip their own shape pass.
        self.shape_only = shape_only
        self.summary_level = summary_level
        self.gradients = gradients
        self.up = up
        self.name = name
        self.row_mask = row_mask
        # The adds to check when the body handed this frame's context returns.
        self.ledger = ledger


def child_frame(
    parent: Frame, name: str, is_training: bool, ledger: "Ledger | None" = None
) -> Frame:
    """The frame of `parent`'s child `name` (O(1): its path and key are read later)."""
    return Frame(
        None,
        None if parent.key is None else DERIVED,
        is_training,
        parent.shape_only,
        parent.summary_level,
        parent.gradients,
        parent,
        name,
        row_mask=parent.row_mask,
        ledger=ledger,
    )


def keyed_frame(
    parent: Frame,
    path: Names,
    key: MaybeKey,
    is_training: bool,
    shape_only: bool,
    gradients: Any,
    ledger: "Ledger | None" = None,
) -> Frame:
    """A frame at `path` with its own `key`, inheriting `parent`'s level and mask."""
    return Frame(
        path,
        key,
        is_training,
        shape_only,
        parent.summary_level,
        gradients,
        row_mask=parent.row_mask,
        ledger=ledger,
    )


def root_frame(
    path: Names,
    prng_key: object,
    is_training: object,
    summary_level: object,
    row_mask: object,
    method: str = ".root",
) -> Frame:
    """A root's frame from checked arguments (errors name `Context{method}`)."""
    where = f"Context{method}"
    key = check_prng_key(prng_key, where)
    training = check_is_training(is_training, where)
    level = check_summary_level(summary_level, where)
    mask = check_row_mask(row_mask, where)
    return Frame(path, key, training, False, level, None, row_mask=mask)


def key_of(frame: Frame) -> MaybeKey:
    """The frame's key, folded in from the nearest ancestor whose key is known."""
    names: list[str] = []
    while (key := frame.key) is DERIVED:
        assert frame.up is not None  # (a child's frame has both)
        assert frame.name is not None
        names.append(frame.name)
        frame = frame.up
    for name in reversed(names):
        key = fold_in_name(key, name)
    return key


def path_of(frame: Frame) -> tuple[str, ...]:
    """The frame's path: its ancestors' names up to one with a path."""
    names: list[str] = []
    while frame.path is None:
        assert frame.up is not None  # (a child's frame has both)
        assert frame.name is not None
        names.append(frame.name)
        frame = frame.up
    return (*frame.path, *reversed(names))

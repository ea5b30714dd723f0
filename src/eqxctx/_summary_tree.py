"""The summaries a writer or an accumulator takes, as one checked mapping."""

from collections.abc import Mapping

import jax

from ._collection import OutputCollection
from ._iterations import IterationSummaries, freeze
from ._leaves import all_plain_arrays, check_summary_name
from ._mapping import FrozenMapping
from ._typing import Leaf, SummaryTree, Tree, TreeDef


def summary_tree(summaries: object, *, where: str) -> FrozenMapping:
    """Return the summaries to write or accumulate, as one checked mapping.

    Accepts an `OutputCollection` (its summaries) or a nested mapping of summaries
    and `OutputCollection`s (each contributes its summaries under its key, so
    `{"train": coll, "eval": coll2}` gives `train/...` and `eval/...`).

    Raises:
        TypeError: for anything else, or a leaf that is not a summary leaf (naming
            its path).
        ValueError: if a name is empty, not a string or contains "/" (naming where).
        OutputConflictError: if an entry is also a reserved per-iteration child.
    """
    return summary_tree_flat(summaries, where=where)[0]


def summary_tree_flat(
    summaries: object, *, where: str
) -> tuple[FrozenMapping, list[Leaf], TreeDef]:
    """`summary_tree`, with the tree's leaves and structure (flattened once)."""
    # Whether `tree.checked` can be trusted: a collection's levels, or a mapping
    # just frozen here. A `FrozenMapping` passed as it is is checked by its leaves
    # (its `inserted` and `updated` add values unchecked: their callers check them)
    # and, if it holds plain mappings (made by unflattening, as
    # `jax.tree_util.tree_map` does), rebuilt.
    trusted = True
    if isinstance(summaries, OutputCollection):
        tree = summaries.summaries
    elif isinstance(summaries, FrozenMapping) and not any(
        isinstance(value, OutputCollection) for _, value in summaries.items_list()
    ):
        tree, trusted = summaries, False
    elif isinstance(summaries, Mapping):
        tree = freeze(_summaries_of(summaries), "", where)
    else:
        # (A `Context`, from a later layer: its collection is what to pass.)
        hint = (
            "; pass its collection (`ctx.collection`)"
            if isinstance(getattr(summaries, "collection", None), OutputCollection)
            else ""
        )
        raise TypeError(
            f"`{where}`: summaries must be an `OutputCollection` or a nested mapping "
            f"of summaries, got {type(summaries).__name__}{hint}."
        )
    # The names depend only on the structure: checked once per treedef (writers and
    # accumulators see the same structure every step).
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    known, hashable = _known_structure(treedef)
    if not (trusted and tree.checked):
        # A known structure passed every check but the leaves'; arrays of numeric
        # dtypes are valid leaves wherever they are. Else each leaf is checked by
        # its path.
        if known and all_plain_arrays(leaves):
            tree.mark_checked()
        elif trusted:  # a collection's summaries: its own paths
            freeze(tree, "summaries")
        else:
            # Rebuilt: its plain mappings frozen, its collections' summaries taken
            # (another structure, flattened again).
            tree = freeze(_summaries_of(tree), "", where)
            leaves, treedef = jax.tree_util.tree_flatten(tree)
            known, hashable = _known_structure(treedef)
    if not known:
        check_summary_names(tree, "", where=where)
        if hashable and len(_NAMES_CHECKED) < 1024:
            _NAMES_CHECKED.add(treedef)
    return tree, leaves, treedef


_NAMES_CHECKED: set[TreeDef] = set()


def _known_structure(treedef: TreeDef) -> tuple[bool, bool]:
    """Whether `treedef` passed every check before, and whether it is hashable."""
    try:
        return treedef in _NAMES_CHECKED, True
    except TypeError:  # a node with unhashable aux data: check every time
        return False, False


def _summaries_of(tree: Tree) -> Tree:
    return {
        key: value.summaries
        if isinstance(value, OutputCollection)
        else _summaries_of(value)
        if isinstance(value, Mapping) and not isinstance(value, FrozenMapping)
        else value
        for key, value in tree.items()
    }


def check_summary_names(tree: SummaryTree, prefix: str, *, where: str) -> None:
    """Check every name once (a per-iteration entry's names once, not per iteration)."""
    for key, value in tree.items():
        path = prefix + check_summary_name(key, prefix, where=where)
        if isinstance(value, IterationSummaries):
            check_summary_names(value.stacked, f"{path}{{i}}/", where=where)
        elif isinstance(value, Mapping):
            check_summary_names(value, f"{path}/", where=where)

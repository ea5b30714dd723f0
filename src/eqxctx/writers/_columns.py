"""A fetched `SummaryBuffer`'s rows as `HostValues`, read column-wise (issue 39).

Every row of one structure shares its recipe (`_read.py`): it is replayed once over
the structure's `[n, ...]` columns (`Recipe.replay_rows`), so that a kind whose
`host_value` is elementwise is validated and read once per buffer; what is left per
row is indexing the columns, and the writers' formatting. Rows are read one by one
(`prefetched_rows`) where a structure has no recipe yet or a row fails.
"""

import jax

from eqxctx._typing import TreeDef

from ._buffer import BufferRows
from ._fetch import Started
from ._host import HostValues
from ._read import Flat, Prefetched, known_recipe, recipe_key


def buffer_values(fetched: BufferRows, *, where: str) -> list[HostValues] | None:
    """Each row's `HostValues` (in the buffer's order), or None: read row by row.

    None where a structure has no recipe yet (its first read records it), is read
    in full every time (e.g. a `CallbackSummary`), or holds a row that fails a
    check (the row-by-row read raises, naming the path). Each row equals
    `host_values` of that row alone.
    """
    out: list[HostValues | None] = [None] * len(fetched.steps)
    for k, layout in enumerate(fetched.layouts):
        positions, columns = fetched.columns(k)
        if not positions:
            continue
        first = [
            c[0, ...] if a else c for c, a in zip(columns, layout.arrays, strict=True)
        ]
        tree = layout.treedef.unflatten(first)
        key = recipe_key(jax.tree_util.tree_structure(tree), first, tree)
        recipe = known_recipe(key)
        if recipe is None:
            return None
        rows = recipe.replay_rows(columns, layout.arrays, len(positions))
        if rows is None:
            return None
        for i, values in zip(positions, rows, strict=True):
            out[i] = values
    return [values for values in out if values is not None]


def prefetched_rows(fetched: BufferRows) -> list[tuple[int, Prefetched]]:
    """Each step of a fetched buffer as `(step, Prefetched)`, to read one by one.

    The steps of one structure share its flattening and recipe key, found once.
    """
    flats: dict[int, tuple[object, TreeDef, object]] = {}
    out: list[tuple[int, Prefetched]] = []
    for step, leaves, layout in fetched.rows:
        known = flats.get(id(layout))
        if known is None:
            tree = layout.treedef.unflatten(leaves)
            treedef = jax.tree_util.tree_structure(tree)
            key = recipe_key(treedef, leaves, tree)
            known = flats[id(layout)] = (tree, treedef, key)
        flat = Flat(known[0], leaves, known[1], known[2])
        out.append((step, Prefetched(flat, Started(leaves, [], None, None, False))))
    return out

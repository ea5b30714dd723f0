"""The step shared by `scan_in_context` and `vmap_in_context`: lay out repeated outputs.

Follows AXLearn's `propagate_repeated_output_collections` (`axlearn/common/module.py`),
except that per-iteration summaries stay stacked in one `IterationSummaries` entry
instead of being sliced into `N` children inside the compiled program.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ._collection import OutputCollection, validate_child_name
from ._iterations import IterationSummaries
from ._repeat import fold_stacked
from ._typing import SummaryTree


def _leading_length(repeated: OutputCollection) -> int | None:
    """Return the common leading axis of all leaves, or None if there is no leaf.

    Raises:
        ValueError: if two leaves disagree, naming both paths.
    """
    found: tuple[str, int] | None = None
    for kind in ("summaries", "state_updates", "module_outputs"):
        tree = getattr(repeated, kind)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            where = f"{kind}{jax.tree_util.keystr(path)}"
            shape = jnp.shape(leaf)
            if not shape:
                raise ValueError(
                    "`propagate_repeated_output_collections`: every leaf needs a "
                    f"leading axis N, but {where} has shape ()."
                )
            if found is None:
                found = (where, shape[0])
            elif found[1] != shape[0]:
                raise ValueError(
                    "`propagate_repeated_output_collections`: leaves disagree on the "
                    f"leading axis N: {found[0]} has {found[1]}, {where} has "
                    f"shape {shape}."
                )
    return None if found is None else found[1]


def assemble(
    repeated: OutputCollection,
    *,
    prefix: str,
    length: int,
    merged_summaries: SummaryTree | None,
    reverse: bool = False,
) -> OutputCollection:
    """Lay out stacked per-iteration outputs under `prefix` (no checks).

    With `merged_summaries` None, the stacked summaries of `repeated` become one
    `IterationSummaries(length, ..., reverse=reverse)` entry; otherwise
    `merged_summaries` (an already accumulated tree) becomes child `prefix`'s
    summaries.
    """
    if merged_summaries is None:
        summaries: SummaryTree | IterationSummaries = IterationSummaries(
            length, repeated.summaries, reverse=reverse
        )
    else:
        summaries = merged_summaries
    return OutputCollection(
        {prefix: summaries},
        {prefix: repeated.state_updates},
        {prefix: repeated.module_outputs},
    )


def _check_length(length: object) -> int:
    if (
        isinstance(length, bool)
        or not isinstance(length, (int, np.integer))
        or length < 0
    ):
        raise ValueError(
            "`propagate_repeated_output_collections`: length must be None (inferred "
            f"from the leaves) or a non-negative int, got {length!r}."
        )
    return int(length)


def propagate_repeated_output_collections(
    repeated: OutputCollection,
    *,
    child_name_prefix: str,
    merge_summaries: bool,
    length: int | None = None,
) -> OutputCollection:
    """Lay out the stacked outputs of N repeated calls as children of a collection.

    The shared step of `scan_in_context` and `vmap_in_context`, after AXLearn's
    `propagate_repeated_output_collections` (`axlearn/common/module.py`). It is pure:
    it returns a new collection (merge it with `ctx.merge(...)`); `repeated` is
    unchanged.

    - Module outputs and state updates go, stacked `[N, ...]`, to child
      `child_name_prefix`.
    - With `merge_summaries=False`, iteration i's summaries form child
      `{child_name_prefix}{i}`. They stay stacked in one `IterationSummaries` entry
      (no per-iteration slicing in the compiled program); `flatten`, `child` and
      `materialize` expand it.
    - With `merge_summaries=True`, summaries are accumulated over the N iterations in
      index order (`Summary.accumulate`, `+` for raw arrays) into child
      `child_name_prefix`; N == 0 gives that child no summaries, N == 1 no
      accumulation.

    Args:
        repeated: the per-iteration collection stacked along a new leading axis N
            (what a body returns through `jax.lax.scan` or `jax.vmap`).
        child_name_prefix: the children's prefix, matching `^[a-z][a-z0-9_]*$`.
        merge_summaries: accumulate summaries instead of per-iteration children.
        length: N, static; inferred from the leaves when None.

    Returns:
        A new collection holding only the children described above.

    Raises:
        ValueError: for an invalid prefix, leaves without a common leading axis (the
            message names them), a `length` that is not a non-negative int or
            disagrees with them, or a collection with no leaf and no `length`.

    Examples:
        >>> rep = OutputCollection({"loss": jnp.array([1.0, 2.0])}, {}, {})
        >>> coll = propagate_repeated_output_collections(
        ...     rep, child_name_prefix="iter", merge_summaries=False
        ... )
        >>> {k: float(v) for k, v in coll.flatten("summaries").items()}
        {'iter0/loss': 1.0, 'iter1/loss': 2.0}
    """
    validate_child_name(
        child_name_prefix,
        where="propagate_repeated_output_collections(child_name_prefix=...)",
    )
    if length is not None:
        length = _check_length(length)
    found = _leading_length(repeated)
    if length is None:
        if found is None:
            raise ValueError(
                "`propagate_repeated_output_collections`: the collection has no leaf "
                "to infer the number of iterations from; pass `length=`."
            )
        length = found
    elif found is not None and found != length:
        raise ValueError(
            f"`propagate_repeated_output_collections`: length={length} but the "
            f"leaves have a leading axis of {found}."
        )
    merged = fold_stacked(repeated.summaries, length) if merge_summaries else None
    return assemble(
        repeated, prefix=child_name_prefix, length=length, merged_summaries=merged
    )

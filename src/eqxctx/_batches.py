"""Loops over batches: `run_batches` and `SummaryAccumulator`.

Follow AXLearn's `InferenceRunner.run` and `MetricAccumulator`
(`axlearn/common/inference.py`, `axlearn/common/metrics.py`).
"""

import collections
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, NoReturn, TypeAlias

import jax
import numpy as np
from jaxtyping import PyTree

from ._checks import check_positive_int_or_none, is_jax_array_type
from ._collection import OutputCollection
from ._expand import flatten_into, materialize_tree
from ._frozen import TreeEquality
from ._iterations import check_iterations, freeze
from ._mapping import FrozenMapping
from ._repeat import accumulate_trees
from ._runner import MethodRunner
from ._summary import Summary, accumulate_leaf
from ._summary_tree import summary_tree_flat
from ._typing import Batch, Children, Leaf, OutputT, SummaryTree, TreeDef


#: What `SummaryAccumulator.update` accepts: an `OutputCollection` or a nested
#: mapping of summaries (and of `OutputCollection`s).
Summaries: TypeAlias = OutputCollection | SummaryTree


def run_batches(
    runner: MethodRunner[Any, OutputT],
    batches: Iterable[Batch],
    *,
    progress: bool = False,
    max_in_flight: int | None = 8,
    **kwargs: PyTree,
) -> Iterator[MethodRunner.Output[OutputT]]:
    """Run `runner` on each batch in turn; yield each batch's output.

    AXLearn's `InferenceRunner.run`: the runner's key advances after every batch.
    Calls do not block, so the next batch is prepared while earlier ones compute (give
    each batch its own arrays: see `MethodRunner` on reusing NumPy buffers); only
    when `max_in_flight` batches are still computing does the loop wait for the
    oldest. (Without a bound, XLA's CPU runtime can deadlock with many multi-device
    programs in flight, as on simulated CPU devices; the bound also caps the memory
    held by pending outputs.)

    Args:
        runner: the runner; its successor is used for the next batch.
        batches: an iterable of input batches (see `MethodRunner.__call__`).
        progress: show a `tqdm` progress bar (needs the `tqdm` package).
        max_in_flight: the most batches computing at once (None: no bound).
        **kwargs: keyword arguments of the method, for every batch.

    Returns:
        An iterator yielding one `MethodRunner.Output` per batch, computed as it is
        iterated.

    Raises:
        ImportError: if `progress=True` and `tqdm` is not installed (at the call).
        ValueError: if `max_in_flight` is not positive (at the call).
        TypeError: if `max_in_flight` is neither an int nor None (at the call).
    """
    check_positive_int_or_none(max_in_flight, "run_batches", "max_in_flight")
    if max_in_flight is not None and max_in_flight < 1:
        raise ValueError(
            f"`run_batches(max_in_flight={max_in_flight})`: pass a positive number "
            "or None."
        )
    if progress:
        try:
            from tqdm.auto import tqdm
        except ImportError as e:  # pragma: no cover - tqdm is in the demo extra
            raise ImportError(
                "`run_batches(progress=True)` needs tqdm: `pip install tqdm` (or "
                "`pip install eqxctx[demo]`)."
            ) from e
        batches = tqdm(batches, desc="batches", unit="batch")
    # Arguments are checked above, at the call; the loop runs when iterated.
    return _run(runner, batches, max_in_flight, kwargs)


def _run(
    runner: MethodRunner[Any, OutputT],
    batches: Iterable[Batch],
    max_in_flight: int | None,
    kwargs: dict[str, PyTree],
) -> Iterator[MethodRunner.Output[OutputT]]:
    # The runner's own path (`Step.call`), threading only the key: the successor
    # runners are never seen, so they are not built.
    call, params, key = runner.step.call, runner.param_leaves, runner.prng_key
    # Each step's new key is one array, ready when that step's program has run: the
    # bound waits on it (one method call, where `jax.block_until_ready` of the
    # outputs walks their tree; ~1 µs per batch).
    pending: collections.deque[Any] = collections.deque()
    push, pop = pending.append, pending.popleft
    bound = max_in_flight if max_in_flight is not None else 0
    for batch in batches:
        key, output = call(params, key, batch, kwargs)
        if bound:
            push(key)
            if len(pending) > bound:
                pop().block_until_ready()
        yield output


def _nest(flat: dict[str, Leaf]) -> FrozenMapping:
    out: dict[str, Any] = {}
    for path, leaf in flat.items():
        *parents, name = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = leaf
    return freeze(out, "summaries")


def _kind(x: Leaf) -> str:
    return type(x).__name__ if isinstance(x, Summary) else "a raw value"


def _accumulate(path: str, a: Leaf, b: Leaf) -> Leaf:
    """`accumulate_leaf(a, b)`, with errors that name `path`."""
    where = "`SummaryAccumulator.update`"
    if isinstance(a, Summary) or isinstance(b, Summary):
        if type(a) is not type(b):
            raise TypeError(
                f"{where}: the summary at {path!r} was {_kind(a)} and is now "
                f"{_kind(b)}; log the same kind at a path in every batch."
            )
        try:
            return accumulate_leaf(a, b)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"{where}: cannot accumulate the {type(a).__name__} at {path!r} "
                f"with the new one ({e}); shapes and dtypes must stay the same."
            ) from e
    if np.shape(a) != np.shape(b):
        raise ValueError(
            f"{where}: the summary at {path!r} had shape {np.shape(a)} and now has "
            f"shape {np.shape(b)}; raw arrays are added, so keep their shape."
        )
    return accumulate_leaf(a, b)


def _plain(tree: Mapping[str, Any]) -> dict[str, Any]:
    """`tree` with every mapping in it a new `dict` (leaves as they are)."""
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


def _flat(tree: SummaryTree) -> dict[str, Leaf]:
    out: dict[str, Leaf] = {}
    flatten_into(out.__setitem__, tree, "", "/")
    return out


class _ShapeChanged(Exception):
    """Raised while tracing `_step` when a leaf's shape differs between the trees."""


@functools.lru_cache(maxsize=64)
def _step(treedef: TreeDef) -> Callable[..., list[Leaf]]:
    """The jitted accumulation of two trees of `treedef`, over their leaves.

    One jitted call per update: per-iteration summaries are accumulated in their
    stacked form (vectorized over the iterations), whatever their number. Taking
    leaves rather than trees keeps the per-call flattening in C++; the result's
    structure comes back as a static output. Shapes are compared when tracing (once
    per shapes, not on every call): `_ShapeChanged` if one differs.
    """

    def step(a: list[Leaf], b: list[Leaf]) -> list[Leaf]:
        if any(np.shape(x) != np.shape(y) for x, y in zip(a, b, strict=True)):
            raise _ShapeChanged
        out = accumulate_trees(treedef.unflatten(a), treedef.unflatten(b))
        return jax.tree_util.tree_leaves(out)

    return jax.jit(step)


class _Flat(NamedTuple):
    """An accumulated tree's leaves and structure, and the step that made them."""

    leaves: list[Leaf]
    treedef: TreeDef
    step: Callable[..., list[Leaf]] | None  # None: leaves not known to be JAX arrays


def _accumulate_same_layout(
    a: _Flat, leaves_b: list[Leaf], treedef_b: TreeDef
) -> tuple[FrozenMapping, _Flat] | None:
    """Accumulate in one jitted step if both have one layout, else return None.

    Returns the accumulated tree and its `_Flat`.
    """
    treedef = a.treedef
    if treedef != treedef_b:
        return None
    # Only JAX arrays: NumPy and Python values are added as they are, on the host
    # (a jitted step would turn int64 into int32 and `True + True` into `True`).
    step = a.step
    if step is not None:
        # After a step: its outputs are JAX arrays, and a shape that changes makes
        # the step's trace raise (once: the fallback's result has no step).
        for x in leaves_b:
            if not is_jax_array_type(type(x)):
                return None
    else:
        for x, y in zip(a.leaves, leaves_b, strict=True):
            if (
                not (is_jax_array_type(type(x)) and is_jax_array_type(type(y)))
                or x.shape != y.shape
            ):
                return None
        step = _step(treedef)
    try:
        out = step(a.leaves, leaves_b)
    except _ShapeChanged:
        return None
    if len(out) != treedef.num_leaves:  # pragma: no cover - a kind changed shape
        raise ValueError("`SummaryAccumulator`: accumulation changed the structure.")
    return treedef.unflatten(out), _Flat(out, treedef, step)


class SummaryAccumulator(TreeEquality):
    """Accumulates summaries across batches (AXLearn's `MetricAccumulator`).

    Pure: `update` returns a new accumulator and leaves `self` unchanged; the NumPy
    arrays it is given are copied (a buffer refilled for the next batch does not
    change what was accumulated), JAX arrays kept as they are. Leaves with
    the same path are combined with their `Summary.accumulate` (a `WeightedSummary`
    gives the weighted mean, `MinSummary` the minimum, ...), raw arrays with `+`.
    Per-iteration summaries of a scan (`IterationSummaries`) are accumulated in
    their stacked form, iteration by iteration, in one jitted step per update; they
    are expanded into their `iter{i}` paths only when read. Values stay on the
    device until read.

    Attributes:
        accumulated: the accumulated summaries as a read-only nested mapping
            (per-iteration entries stacked), or None before the first update.

    Examples:
        >>> from eqxctx import WeightedSummary
        >>> acc = SummaryAccumulator()
        >>> acc = acc.update({"loss": WeightedSummary(1.0, 1.0)})
        >>> acc = acc.update({"loss": WeightedSummary(4.0, 2.0)})
        >>> float(acc.summaries()["loss"].value())
        3.0
    """

    # A frozen class registered as a PyTree (below), as `OutputCollection` is, not an
    # `eqx.Module`: Equinox builds a `BoundMethod` module on every method access
    # (`acc.update`), which cost as much as the rest of an update's Python.
    __slots__ = ("_flat_accumulated", "accumulated")
    accumulated: FrozenMapping | None
    # `accumulated`'s leaves and structure, when the update that made it had them.
    _flat_accumulated: _Flat | None

    def __init__(self, accumulated: FrozenMapping | None = None):
        _set_accumulated(self, accumulated)
        _set_flat(self, None)

    @classmethod
    def _of(cls, accumulated: FrozenMapping, flat: _Flat) -> "SummaryAccumulator":
        acc = cls(accumulated)
        _set_flat(acc, flat)
        return acc

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field '{name}'")

    def __repr__(self) -> str:
        return f"SummaryAccumulator(accumulated={self.accumulated!r})"

    def __reduce__(self) -> tuple[object, ...]:
        return (SummaryAccumulator, (self.accumulated,))

    @property
    def flat(self) -> dict[str, Leaf] | None:
        """The accumulated summaries as `{"a/b/name": leaf}`, or None before any."""
        return None if self.accumulated is None else _flat(self.accumulated)

    def update(self, summaries: Summaries) -> "SummaryAccumulator":
        """Return a new accumulator that also holds `summaries`.

        Args:
            summaries: an `OutputCollection` or a nested summary mapping, e.g.
                `MethodRunner.Output.summaries`.

        Raises:
            ValueError: if the summary paths differ from those already accumulated
                (the message lists the missing and the extra paths), if a raw
                array's shape differs from the accumulated one, if a name is invalid
                or two entries get the same path (see `eqxctx.writers`), if a
                `Summary` cannot be accumulated with the last one (naming the path),
                or if a scan's stacked arrays no longer have its iterations on
                their iteration axis (sliced or indexed), naming the path.
            TypeError: if a leaf is not a valid summary leaf, or its kind differs
                from the accumulated one (a `Summary` of another class, or a raw
                array where a `Summary` was), naming the path.
        """
        tree, leaves, treedef = summary_tree_flat(
            summaries, where="SummaryAccumulator.update"
        )
        if any(isinstance(x, np.ndarray) for x in leaves):
            # The caller's host buffers (refilled for the next batch, say): copied,
            # so that what is accumulated does not change with them.
            leaves = [x.copy() if isinstance(x, np.ndarray) else x for x in leaves]
            tree = treedef.unflatten(leaves)
        if self.accumulated is None:
            # Kept stacked without being read: its entries' shapes checked here
            # (later updates check them in the step's trace or the path-by-path
            # walk).
            check_iterations(tree, "")
            return SummaryAccumulator._of(tree, _Flat(leaves, treedef, None))
        flat_mine = self._flat_accumulated
        if flat_mine is None:  # made by `SummaryAccumulator(...)` or unflattening
            flat_mine = _Flat(*jax.tree_util.tree_flatten(self.accumulated), None)
        same = _accumulate_same_layout(flat_mine, leaves, treedef)
        if same is not None:
            return SummaryAccumulator._of(*same)
        # Another layout: accumulate path by path, with errors naming the path.
        mine, flat = _flat(self.accumulated), _flat(tree)
        if flat.keys() != mine.keys():
            missing = sorted(mine.keys() - flat.keys())
            extra = sorted(flat.keys() - mine.keys())
            raise ValueError(
                "`SummaryAccumulator.update`: the summaries have other paths than "
                f"the accumulated ones (missing: {missing}; extra: {extra}). "
                "Accumulate the summaries of one method in one accumulator."
            )
        return SummaryAccumulator(
            _nest({k: _accumulate(k, v, flat[k]) for k, v in mine.items()})
        )

    def summaries(self) -> dict[str, Any]:
        """Return the accumulated summaries as nested `dict`s ({} before any).

        Per-iteration summaries appear as `{prefix}{i}` children (AXLearn's layout),
        with NumPy values. A new `dict` on each call (as AXLearn's
        `MetricAccumulator.summaries()`): it is the caller's to change, and maps with
        `jax.tree.map` against other dicts of the same structure.
        """
        if self.accumulated is None:
            return {}
        return _plain(materialize_tree(self.accumulated))

    def flatten(self) -> dict[str, Leaf]:
        """Return the accumulated summaries as a new `{"a/b/name": leaf}` dict.

        ({} before any.)
        """
        return self.flat or {}


_set_accumulated = SummaryAccumulator.__dict__["accumulated"].__set__
_set_flat = SummaryAccumulator.__dict__["_flat_accumulated"].__set__
_ACCUMULATED = jax.tree_util.GetAttrKey("accumulated")


def _accumulator_flatten_with_keys(
    acc: SummaryAccumulator,
) -> tuple[list[tuple[Any, FrozenMapping | None]], None]:
    return [(_ACCUMULATED, acc.accumulated)], None


def _accumulator_flatten(
    acc: SummaryAccumulator,
) -> tuple[tuple[FrozenMapping | None], None]:
    return (acc.accumulated,), None


def _accumulator_unflatten(_: None, children: Children) -> SummaryAccumulator:
    return SummaryAccumulator(children[0])


jax.tree_util.register_pytree_with_keys(
    SummaryAccumulator,
    _accumulator_flatten_with_keys,
    _accumulator_unflatten,
    _accumulator_flatten,
)

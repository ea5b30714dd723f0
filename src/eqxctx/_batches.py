"""Loops over batches: `run_batches` and `SummaryAccumulator`.

Follow AXLearn's `InferenceRunner.run` and `MetricAccumulator`
(`axlearn/common/inference.py`, `axlearn/common/metrics.py`).
"""

import collections
from collections.abc import Iterable, Iterator
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ._runner import MethodRunner
from ._summary import Summary, accumulate_leaf
from .writers._base import flatten_summaries


def run_batches(
    runner: MethodRunner,
    batches: Iterable[Any],
    *,
    progress: bool = False,
    max_in_flight: int | None = 8,
    **kwargs: Any,
) -> Iterator[MethodRunner.Output]:
    """Run `runner` on each batch in turn; yield each batch's output.

    AXLearn's `InferenceRunner.run`: the runner's key advances after every batch.
    Calls do not block, so the next batch is prepared while earlier ones compute; only
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

    Yields:
        One `MethodRunner.Output` per batch.

    Raises:
        ImportError: if `progress=True` and `tqdm` is not installed.
        ValueError: if `max_in_flight` is not positive.
    """
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
    # The runner's own path (`Step.call`), threading only the key: the successor
    # runners are never seen, so they are not built.
    step, params, key = runner.step, runner.param_leaves, runner.prng_key
    call = step.call
    pending: collections.deque[Any] = collections.deque()
    for batch in batches:
        key, output = call(params, key, batch, kwargs)
        if max_in_flight is not None:
            pending.append(output.output_batch)
            if len(pending) > max_in_flight:
                jax.block_until_ready(pending.popleft())
        yield output


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, leaf in flat.items():
        *parents, name = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = leaf
    return out


def _kind(x: Any) -> str:
    return type(x).__name__ if isinstance(x, Summary) else "a raw value"


def _accumulate(path: str, a: Any, b: Any) -> Any:
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


class SummaryAccumulator(eqx.Module):
    """Accumulates summaries across batches (AXLearn's `MetricAccumulator`).

    Pure: `update` returns a new accumulator and leaves `self` unchanged. Leaves with
    the same path are combined with their `Summary.accumulate` (a `WeightedSummary`
    gives the weighted mean, `MinSummary` the minimum, ...), raw arrays with `+`.
    Per-iteration summaries of a scan (`IterationSummaries`) are expanded into their
    `iter{i}` paths. Values stay on the device until read.

    Attributes:
        flat: the accumulated summaries as `{"a/b/name": leaf}`, or None before the
            first update.

    Examples:
        >>> from eqxctx import WeightedSummary
        >>> acc = SummaryAccumulator()
        >>> acc = acc.update({"loss": WeightedSummary(1.0, 1.0)})
        >>> acc = acc.update({"loss": WeightedSummary(4.0, 2.0)})
        >>> float(acc.summaries()["loss"].value())
        3.0
    """

    flat: dict[str, Any] | None = None

    def update(self, summaries: dict[str, Any]) -> "SummaryAccumulator":
        """Return a new accumulator that also holds `summaries`.

        Args:
            summaries: a nested summary mapping, e.g. `MethodRunner.Output.summaries`.

        Raises:
            ValueError: if the summary paths differ from those already accumulated
                (the message lists the missing and the extra paths), if a raw
                array's shape differs from the accumulated one, if a name is invalid
                or two entries get the same path (see `eqxctx.writers`), or if a
                `Summary` cannot be accumulated with the last one (naming the path).
            TypeError: if a leaf's kind differs from the accumulated one (a `Summary`
                of another class, or a raw array where a `Summary` was), naming the
                path.
        """
        flat = flatten_summaries(summaries, where="SummaryAccumulator.update")
        if self.flat is None:
            return SummaryAccumulator(flat)
        if flat.keys() != self.flat.keys():
            missing = sorted(self.flat.keys() - flat.keys())
            extra = sorted(flat.keys() - self.flat.keys())
            raise ValueError(
                "`SummaryAccumulator.update`: the summaries have other paths than "
                f"the accumulated ones (missing: {missing}; extra: {extra}). "
                "Accumulate the summaries of one method in one accumulator."
            )
        return SummaryAccumulator(
            {k: _accumulate(k, v, flat[k]) for k, v in self.flat.items()}
        )

    def summaries(self) -> dict[str, Any]:
        """Return the accumulated summaries as a nested mapping ({} before any)."""
        return _nest(self.flat or {})

    def flatten(self) -> dict[str, Any]:
        """Return the accumulated summaries as `{"a/b/name": leaf}` ({} before any)."""
        return dict(self.flat or {})

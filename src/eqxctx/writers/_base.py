"""The writer interface and the shared step: flatten, validate and fetch summaries."""

import abc
import dataclasses
import operator
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, SupportsIndex, TypeAlias, TypeVar

import jax
import numpy as np

from eqxctx._collection import IterationSummaries, OutputCollection
from eqxctx._statistics import HistogramSummary, MomentsSummary
from eqxctx._summary import (
    AudioSummary,
    ImageSummary,
    MaxSummary,
    MinSummary,
    Summary,
    SumSummary,
    WeightedSummary,
    leaf_value,
)
from eqxctx._transfer import to_host


#: What `write` accepts: an `OutputCollection` (its summaries are written) or a
#: nested mapping of summaries, e.g. `collection.summaries` or `{"train": ...}`.
Summaries: TypeAlias = OutputCollection | Mapping[str, Any]

#: A step number: a Python or NumPy integer (anything with `__index__`).
Step: TypeAlias = SupportsIndex


def _check_name(key: object, prefix: str, *, where: str) -> str:
    if not isinstance(key, str) or not key or "/" in key:
        at = f"under {prefix.rstrip('/')!r}" if prefix else "at the top level"
        raise ValueError(
            f"`{where}`: invalid summary name {key!r} {at}. Names are non-empty "
            "strings without '/'; nest mappings instead (`{'a': {'b': x}}` is "
            "written as 'a/b')."
        )
    return key


def _walk(
    tree: Mapping[Any, Any], prefix: str, *, where: str
) -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        path = prefix + _check_name(key, prefix, where=where)
        if isinstance(value, IterationSummaries):
            for i in range(value.length):
                yield from _walk(value.iteration(i), f"{path}{i}/", where=where)
        elif isinstance(value, Mapping):
            yield from _walk(value, f"{path}/", where=where)
        else:
            yield path, value


def _collision(path: str, *, where: str) -> ValueError:
    return ValueError(
        f"`{where}`: two summaries have the path {path!r} (per-iteration children "
        "are written as 'name{i}/...', and a `CallbackSummary` returning a mapping "
        "as 'path/key'); rename one of them so that no value is lost."
    )


def _summaries_of(tree: Mapping[str, Any]) -> dict[str, Any]:
    """`tree` with each `OutputCollection` in it replaced by its summaries.

    So `write(step, {"train": train_coll, "eval": eval_coll})` writes
    `train/...` and `eval/...`.
    """
    return {
        key: value.summaries
        if isinstance(value, OutputCollection)
        else _summaries_of(value)
        if isinstance(value, Mapping)
        else value
        for key, value in tree.items()
    }


def flatten_summaries(summaries: object, *, where: str) -> dict[str, Any]:
    """Return `{path: leaf}` with "/"-joined paths; per-iteration children expanded.

    Raises:
        TypeError: if `summaries` is neither an `OutputCollection` nor a mapping (of
            summaries and `OutputCollection`s, whose summaries are written under
            their key), or a leaf is not a valid summary leaf (naming its path).
        ValueError: if a name is empty, not a string or contains "/", or if two
            entries get the same path (e.g. `{"a/b": 1}` and `{"a": {"b": 2}}`, or
            a per-iteration child `iter0` next to a scan's `iter`); the message
            names the path. No value is ever dropped silently.
    """
    if isinstance(summaries, OutputCollection):
        tree = summaries.summaries
    elif isinstance(summaries, Mapping):
        # Validates the leaves (TypeError naming the path).
        tree = OutputCollection(_summaries_of(summaries), {}, {}).summaries
    else:
        raise TypeError(
            f"`{where}`: summaries must be an `OutputCollection` or a nested mapping "
            f"of summaries, got {type(summaries).__name__}."
        )
    out: dict[str, Any] = {}
    for path, leaf in _walk(tree, "", where=where):
        if path in out:
            raise _collision(path, where=where)
        out[path] = leaf
    return out


#: The largest step: TensorBoard (and W&B) store steps as int64.
MAX_STEP = 2**63 - 1

#: A value ready to write: a NumPy array, or (kept whole, with NumPy fields) an
#: `ImageSummary`, `AudioSummary` or `HistogramSummary`.
HostValue: TypeAlias = np.ndarray | ImageSummary | AudioSummary | HistogramSummary

_MEDIA = (ImageSummary, AudioSummary, HistogramSummary)


def check_step(step: object, *, where: str) -> int:
    """Return `step` as an `int`, or raise naming `where`.

    Raises:
        TypeError: if `step` is not an integer (a `bool` is not one).
        ValueError: if `step` is negative or above `2**63 - 1` (int64, as
            TensorBoard's event files store it).
    """
    if isinstance(step, bool):
        raise TypeError(f"`{where}`: step must be an int, got a bool ({step}).")
    try:
        value = operator.index(step)  # pyright: ignore[reportArgumentType]
    except TypeError:
        raise TypeError(
            f"`{where}`: step must be an int (e.g. the training step), got "
            f"{type(step).__name__} {step!r}."
        ) from None
    if value < 0:
        raise ValueError(f"`{where}`: step must be >= 0, got {value}.")
    if value > MAX_STEP:
        raise ValueError(
            f"`{where}`: step must be at most 2**63 - 1 (an int64), got {value}."
        )
    return value


def _expand(path: str, value: Any, *, where: str) -> Iterator[tuple[str, Any]]:
    """Yield `(path, value)`; a mapping (a `CallbackSummary` result) is expanded."""
    if isinstance(value, Mapping):
        for key, sub in value.items():
            name = _check_name(key, f"{path}/", where=where)
            yield from _expand(f"{path}/{name}", sub, where=where)
    else:
        yield path, value


def _numeric(path: str, value: Any, *, where: str) -> np.ndarray:
    arr = np.asarray(value)
    if not (arr.dtype == np.bool_ or jax.numpy.issubdtype(arr.dtype, np.number)):
        raise TypeError(
            f"`{where}`: the summary at {path!r} has dtype {arr.dtype}; writers "
            "accept bool, integer and floating values."
        )
    if jax.numpy.issubdtype(arr.dtype, np.complexfloating):
        raise TypeError(
            f"`{where}`: the summary at {path!r} is complex ({arr.dtype}); write "
            "its real and imaginary parts (or its absolute value) instead."
        )
    return arr


def fetch_summaries(summaries: object, *, where: str) -> dict[str, HostValue]:
    """Flatten, validate and fetch summaries to the host: `{path: HostValue}`.

    Every process of a multi-process run must call this with the same summaries: it
    fetches with `eqxctx.to_host`, which all-gathers arrays split over processes (a
    collective). Each `Summary` is `validate()`d first (also in a plain mapping).
    Then each leaf becomes what writers write, under its "/"-joined path:
    `ImageSummary`, `AudioSummary` and `HistogramSummary` stay whole (with NumPy
    fields); other summaries become their `value()` as NumPy arrays, a mapping value
    (a `MomentsSummary`, a `CallbackSummary` returning a dict) expanded into
    `path/key` entries. A `CallbackSummary`'s function runs here, on NumPy copies
    of its arguments (as AXLearn's writer does).

    Args:
        summaries: an `OutputCollection` (its summaries) or a nested mapping of
            summary leaves and `OutputCollection`s.
        where: the caller, for error messages (e.g. `"JsonlWriter.write"`).

    Returns:
        `{path: value}` in the summaries' order.

    Raises:
        TypeError: for a leaf that is not a summary leaf or a non-numeric or complex
            value (the message names the path).
        ValueError: for an invalid name, two values with the same path, or a
            summary that fails `validate()` (e.g. an empty image batch); the message
            names the path.
    """
    # One fetch of the summary trees first (module outputs and state updates stay on
    # the device), so that per-iteration views index NumPy arrays on the host.
    trees = _summary_trees(summaries)
    flat = flatten_summaries(_in_order(to_host(trees), trees), where=where)
    out: dict[str, HostValue] = {}
    for path, leaf in flat.items():
        if isinstance(leaf, Summary):
            try:
                leaf.validate()
            except ValueError as e:
                raise ValueError(f"`{where}`: the summary at {path!r}: {e}") from e
        if isinstance(leaf, _MEDIA):
            field = leaf.counts if isinstance(leaf, HistogramSummary) else leaf.value_
            _numeric(path, field, where=where)
            items: Iterator[tuple[str, Any]] = iter([(path, leaf)])
        else:
            items = _expand(path, _host_value(leaf), where=where)
        for sub, value in items:
            if sub in out:
                raise _collision(sub, where=where)
            if not isinstance(value, _MEDIA):
                value = _numeric(sub, value, where=where)
            out[sub] = value
    return out


def _summary_trees(summaries: object) -> object:
    """`summaries` with each `OutputCollection` replaced by its summaries mapping."""
    if isinstance(summaries, OutputCollection):
        return summaries.summaries
    if isinstance(summaries, Mapping):
        return {k: _summary_trees(v) for k, v in summaries.items()}
    return summaries


def _in_order(host: Any, like: Any) -> Any:
    """`host` with its mappings in the key order of `like` (`to_host` sorts keys)."""
    if isinstance(like, Mapping) and isinstance(host, Mapping):
        return {k: _in_order(host[k], v) for k, v in like.items()}
    return host


def _host_value(leaf: Any) -> Any:
    """What a writer writes for a fetched leaf (NumPy fields): its `value()`.

    The built-in kinds are read on the host (NumPy), without a device round trip; a
    `CallbackSummary` runs its function on the NumPy arguments.
    """
    if isinstance(leaf, WeightedSummary):
        return leaf.mean
    if isinstance(leaf, (MinSummary, MaxSummary, SumSummary)):
        return leaf.value_
    if isinstance(leaf, MomentsSummary):
        count = np.asarray(leaf.count)
        m2 = np.asarray(leaf.m2)
        return {
            "count": count,
            "mean": np.asarray(leaf.mean),
            "variance": m2 / np.maximum(count, 1).astype(m2.dtype),
            "min": np.asarray(leaf.min_),
            "max": np.asarray(leaf.max_),
            "nonfinite": np.asarray(leaf.nonfinite),
        }
    return leaf_value(leaf)


@dataclasses.dataclass(frozen=True)
class HostSummaries:
    """One step's summaries on the host, ready to write (`AbstractWriter.fetch`).

    Attributes:
        step: the step, an int in `[0, 2**63)`.
        values: `{path: value}` from `fetch_summaries`: NumPy arrays, and
            `ImageSummary` / `AudioSummary` / `HistogramSummary` objects with NumPy
            fields.
    """

    step: int
    values: Mapping[str, HostValue]


def is_writing_process() -> bool:
    """Return whether this process writes files: process 0 (`jax.process_index()`)."""
    return jax.process_index() == 0


_W = TypeVar("_W", bound="AbstractWriter")


class AbstractWriter(abc.ABC):
    """A summary writer: `write(step, summaries)`, `flush()`, `close()`.

    Writers are context managers (`with JsonlWriter(path) as w: ...` closes `w`) and
    work from any training loop: pass the summaries of an `OutputCollection` (from
    `eqxctx.functional`, a `MethodRunner` output or a `SummaryAccumulator`) after
    each step. They read each leaf's `Summary.value()` (raw arrays as they are) on
    the host.

    A write has two halves. `fetch` (on every process: it may be a collective)
    checks the step, validates the summaries, fetches them with `eqxctx.to_host` and
    runs the writer's own `check`; `write_host` (only on process 0) writes the files.
    `write` runs both; `AsyncWriter` runs `write_host` on a background thread. A new
    writer implements `write_host`, `flush` and `close` (and `check`, to refuse
    what it cannot write before anything is written).
    """

    def write(self, step: Step, summaries: Summaries) -> None:
        """Write the summaries of one step (files only on process 0).

        Every process of a multi-process run must call `write` with the same
        summaries (see `fetch`); only process 0 writes.

        Args:
            step: the step number, an int in `[0, 2**63)`.
            summaries: an `OutputCollection` (its `summaries` are written) or a nested
                mapping of summary leaves and `OutputCollection`s (`{"train": coll}`
                writes `train/...`).

        Raises:
            TypeError: for a non-integer step, a leaf that is not a summary leaf, or
                a non-numeric value (the message names its path).
            ValueError: for a step out of range, an invalid summary (naming its
                path), a value this writer cannot write (see `check`) or a write
                after `close()`.
            eqxctx.OutputConflictError: for two paths that this writer would write
                under one name (TensorBoard's tag sanitizing).
        """
        host = self.fetch(step, summaries)
        if is_writing_process():
            self.write_host(host)

    def fetch(self, step: Step, summaries: Summaries) -> HostSummaries:
        """Check, validate and fetch one step's summaries to the host; write nothing.

        Runs on every process (`eqxctx.to_host` all-gathers arrays split over
        processes). Raises as `write` does.
        """
        where = f"{type(self).__name__}.write"
        checked = check_step(step, where=where)
        host = HostSummaries(checked, fetch_summaries(summaries, where=where))
        self.check(host)
        return host

    def check(self, host: HostSummaries) -> None:  # noqa: B027 - optional hook
        """Raise if `host` cannot be written (e.g. the writer is closed).

        Called by `fetch` on every process, before anything is written.
        """

    @abc.abstractmethod
    def write_host(self, host: HostSummaries) -> None:
        """Write one fetched step (called on process 0 only)."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Write buffered data to disk."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and close; closing twice is allowed, writing after it is not."""

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

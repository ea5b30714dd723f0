"""The writer interface: `AbstractWriter`, `HostSummaries` and the step checks."""

import abc
import dataclasses
import functools
import operator
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, SupportsIndex, TypeAlias, TypeVar

import jax

from ._buffer import BufferRows, SummaryBuffer, buffer_rows, emptied, start_fetch
from ._columns import buffer_values, prefetched_rows
from ._host import HostValue
from ._read import Prefetched, Summaries, host_values


#: A step number: a Python or NumPy integer (anything with `__index__`).
Step: TypeAlias = SupportsIndex


#: The largest step: TensorBoard (and W&B) store steps as int64.
MAX_STEP = 2**63 - 1


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


@dataclasses.dataclass(frozen=True)
class HostSummaries:
    """One step's summaries on the host, ready to write (`AbstractWriter.fetch`).

    Attributes:
        step: the step, an int in `[0, 2**63)`.
        values: `{path: value}` as `fetch_summaries` returns it (a read-only
            mapping): NumPy arrays and host records (`Histogram`, `Image`,
            `Audio`).
    """

    step: int
    values: Mapping[str, HostValue]


def is_writing_process() -> bool:
    """Return whether this process writes files: process 0 (`jax.process_index()`)."""
    return jax.process_index() == 0


_W = TypeVar("_W", bound="AbstractWriter")


class AbstractWriter(abc.ABC):
    """A summary writer: `write(step, summaries)`, `flush()`, `close()`.

    Writers are context managers (`with JsonlWriter(path) as w: ...` closes `w`):
    pass the summaries of an `OutputCollection` after each step. A write has two
    halves: `fetch` (on every process: it may be a collective) checks the step,
    validates and fetches the summaries (`fetch_summaries`) and runs the writer's
    `check`; `write_host` (on process 0) writes the files. `AsyncWriter` runs
    `write_host` on a background thread. A new writer implements `write_host`,
    `flush` and `close` (and `check`, to refuse what it cannot write before
    anything is written).
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

    def write_buffer(self, buffer: SummaryBuffer) -> SummaryBuffer:
        """Write every step held in `buffer` (files only on process 0); empty it.

        Fetches the buffer with one transfer per width of raw bits, checks every
        step, then writes them in the order they were added, each as `write` would.
        Passing the same buffer again (e.g. from a `finally` block after an
        interrupted call) writes only the steps not written yet. Every process
        must call it (see `write`).

        Args:
            buffer: a `SummaryBuffer` returned by a step (not a tracer).

        Returns:
            The buffer emptied (`SummaryBuffer.cleared`): carry it into the next
            step.

        Raises:
            TypeError: if `buffer` is not a concrete `SummaryBuffer`; and as `write`.
            ValueError: as `write`; for a buffer batched by `jax.vmap` (its
                arrays' shapes are not the buffer's); and, after writing the steps
                it held, if steps were added to the full buffer (lost; write it
                every `buffer.size` steps).
        """
        where = f"{type(self).__name__}.write_buffer"
        fetch = start_fetch(buffer, where=where)
        fetched = buffer_rows(fetch)
        done, token = self._buffer_done, buffer.marks
        skip = done[1] if done is not None and done[0] is token else 0
        hosts = buffer_hosts(self, fetched)
        if is_writing_process():
            for k in range(skip, len(hosts)):
                self._write_row(hosts[k], (token, k))
                self._buffer_done = (token, k + 1)
        self._buffer_done = (token, len(hosts))
        check_lost(fetched, where=where)
        return emptied(buffer, fetch)

    #: `(buffer.marks, steps written)` of the last buffer `write_buffer` wrote.
    _buffer_done: tuple[object, int] | None = None

    def _write_row(self, host: HostSummaries, row: tuple[object, int]) -> None:
        """Write row `row` (`(buffer.marks, index)`) of a buffer: `write_host`.

        `MultiWriter` skips its writers that wrote the row before an interruption.
        """
        del row
        self.write_host(host)

    def fetch(self, step: Step, summaries: Summaries) -> HostSummaries:
        """Check, validate and fetch one step's summaries to the host; write nothing.

        Runs on every process (`eqxctx.to_host` all-gathers arrays split over
        processes). Raises as `write` does.
        """
        return fetch_host(self, step, summaries)

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
        """Close the writer; an error of `close` never replaces the block's own.

        Leaving the block by an exception, an error of `close` (e.g. an
        `AsyncWriter`'s background error) is added to that exception as a note,
        and the block's exception propagates.
        """
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:
            exc.add_note(
                f"Closing {type(self).__name__} as the block was left then raised "
                f"{type(e).__name__}: {e}"
            )


def buffer_hosts(writer: AbstractWriter, fetched: BufferRows) -> list[HostSummaries]:
    """Each step of a fetched buffer, fetched by `writer` (`AbstractWriter.fetch`).

    Raises as `AbstractWriter.write` does.
    """
    if type(writer).fetch is not AbstractWriter.fetch:
        rows = [
            (step, layout.treedef.unflatten(leaves))
            for step, leaves, layout in fetched.rows
        ]
        return [
            _row_host(writer.fetch, step, tree, i)
            for i, (step, tree) in enumerate(rows)
        ]
    where = f"{type(writer).__name__}.write"
    columns = buffer_values(fetched, where=where)
    if columns is None:  # a structure without a recipe yet, or a row that fails
        fetch = functools.partial(fetch_host, writer)
        return [
            _row_host(fetch, step, prefetched, i)
            for i, (step, prefetched) in enumerate(prefetched_rows(fetched))
        ]

    def checked(step: int, values: Any) -> HostSummaries:
        host = HostSummaries(check_step(step, where=where), values)
        writer.check(host)
        return host

    return [
        _row_host(checked, step, values, i)
        for i, (step, values) in enumerate(zip(fetched.steps, columns, strict=True))
    ]


def _row_host(
    fetch: Callable[[int, Any], HostSummaries], step: int, summaries: Any, i: int
) -> HostSummaries:
    """`fetch(step, summaries)` of a buffer's row `i`; an error gets a note."""
    try:
        return fetch(step, summaries)
    except Exception as e:
        wrapped = (
            " The buffer stores steps as int32 without `jax_enable_x64`: a step of "
            "2**31 or more wraps around to a negative one."
            if step < 0 and not jax.config.jax_enable_x64  # pyright: ignore[reportAttributeAccessIssue]
            else ""
        )
        e.add_note(
            f"Raised by `write_buffer` reading the buffer's row {i} (step {step}); "
            f"this call wrote none of the buffer's steps.{wrapped}"
        )
        raise


def check_lost(fetched: BufferRows, *, where: str) -> None:
    """Raise if steps were added to the full buffer (after its steps are written).

    Raises:
        ValueError: naming the number of steps lost.
    """
    if fetched.lost:
        last = fetched.steps[-1]
        raise ValueError(
            f"`{where}`: {fetched.lost} step(s) were added to the full buffer of "
            f"{len(fetched.steps)} rows and lost (each overwrote the last row, which "
            f"holds step {last}). Write the buffer every `buffer.size` steps: `if "
            "(step + 1) % buffer.size == 0: buffer = writer.write_buffer(buffer)`."
        )


#: The name of an `AsyncWriter`'s background thread (a check there runs after later
#: calls may have logged; see `WandbWriter.check`).
BACKGROUND_THREAD = "eqxctx-AsyncWriter"


def fetch_host(
    writer: AbstractWriter, step: Step, summaries: Summaries | Prefetched
) -> HostSummaries:
    """`AbstractWriter.fetch` of `writer`, also of `Prefetched` summaries."""
    where = f"{type(writer).__name__}.write"
    checked = check_step(step, where=where)
    host = HostSummaries(checked, host_values(summaries, where=where))
    writer.check(host)
    return host

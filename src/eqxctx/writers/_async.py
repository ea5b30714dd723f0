"""AsyncWriter (file I/O on a background thread) and MultiWriter (fan-out)."""

import atexit
import dataclasses
import functools
import queue
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias, cast

import jax
import numpy as np

from eqxctx._collection import OutputCollection
from eqxctx._iterations import IterationSummaries
from eqxctx._mapping import FrozenMapping
from eqxctx._summary import Summary

from ._base import (
    AbstractWriter,
    HostSummaries,
    Prefetched,
    Step,
    Summaries,
    buffer_hosts,
    check_lost,
    check_positive_int,
    check_step,
    fetch_host,
    is_writing_process,
    prefetch,
)
from ._buffer import BufferFetch, SummaryBuffer, buffer_rows, start_fetch


_FLUSH = "flush"
_STOP = "stop"
_WRITE = "write"
_FETCH = "fetch"
_BUFFER = "buffer"

#: `(kind, item)` on the queue: a `HostSummaries` to write, `(step, summary trees)`
#: to fetch, or None. The item is untyped: its type follows the kind, which pyright
#: does not narrow through the unpacked tuple.
_Job: TypeAlias = tuple[str, Any]


def _copy_numpy(x: object) -> object:
    return x.copy() if isinstance(x, np.ndarray) else x


_KEEP, _COPY, _FIELDS, _STACKED, _COLLECTION, _FROZEN, _MAPPING = range(7)


@functools.cache
def _is_flat(cls: type) -> bool:
    """Whether a summary's field of type `cls` needs no copy (no NumPy array in it).

    JAX arrays and numbers: kept. NumPy arrays and containers (a
    `CallbackSummary`'s `args`, a `HistogramSummary`'s static edges): copied by a
    `tree_map` where a leaf is a NumPy array.
    """
    return not issubclass(cls, (np.ndarray, tuple, list, dict, Mapping))


@functools.cache
def _kind(cls: type) -> int:
    """How `_owned` treats a value of type `cls` (one check per type)."""
    if issubclass(cls, OutputCollection):
        return _COLLECTION
    if issubclass(cls, FrozenMapping):
        return _FROZEN
    if issubclass(cls, Mapping):
        return _MAPPING
    if issubclass(cls, np.ndarray):
        return _COPY
    if issubclass(cls, IterationSummaries):
        return _STACKED
    if issubclass(cls, Summary):
        return _FIELDS
    return _KEEP  # JAX arrays, Python and NumPy scalars: immutable


def _owned(summaries: object) -> object:
    """The summary trees of `summaries`, which the caller can no longer change.

    `summaries` itself where nothing in it can change; otherwise, like
    `summary_trees` (an `OutputCollection` becomes its summaries mapping), with
    each caller-owned mutable part copied: mappings (a new `dict`, in the same key
    order; a read-only `FrozenMapping` is rebuilt only where a leaf below it is
    copied), NumPy arrays (`ndarray.copy()`), and the containers and NumPy arrays
    of a summary (a `CallbackSummary`'s `args` and `kwargs`). JAX arrays are
    immutable and kept as they are (no device copy, no transfer), as are Python and
    NumPy scalars and the summaries without a NumPy array or container field.
    """
    kind = _kind(type(summaries))
    if kind == _KEEP:
        return summaries
    if kind == _FIELDS:  # copied only where a leaf is a NumPy array
        # `object.__getattribute__`: Equinox's own attribute lookup costs ~0.4 µs.
        fields = object.__getattribute__(summaries, "__dict__").values()
        if all(_is_flat(type(f)) for f in fields):
            return summaries
        return jax.tree_util.tree_map(_copy_numpy, summaries)
    if kind == _MAPPING:
        mapping = cast(Mapping[object, object], summaries)
        return {k: _owned(v) for k, v in mapping.items()}
    if kind == _FROZEN:
        frozen = cast(FrozenMapping, summaries)
        new: list[tuple[str, object]] = []
        changed = False
        for k, v in frozen.items():
            owned = v if _kind(type(v)) == _KEEP else _owned(v)
            changed = changed or owned is not v
            new.append((k, owned))
        # Copies of its leaves: checked where `summaries` was.
        return FrozenMapping(new, checked=frozen.checked) if changed else summaries
    if kind == _COLLECTION:  # read-only: kept if nothing is copied
        levels = cast(OutputCollection, summaries).summaries
        trees = _owned(levels)
        return summaries if trees is levels else trees
    if kind == _COPY:
        return cast(np.ndarray, summaries).copy()
    # _STACKED: a read-only stacked mapping
    entry = cast(IterationSummaries, summaries)
    stacked = _owned(entry.stacked)
    if stacked is entry.stacked:
        return summaries
    return dataclasses.replace(entry, stacked=stacked)


def _snapshot(summaries: Summaries) -> Summaries:
    """`summaries`, with what the caller can change after `write` copied (`_owned`)."""
    return cast(Summaries, _owned(summaries))


class AsyncWriter(AbstractWriter):
    """Write through another writer on a background thread, so `write` never waits.

    A write has two halves (`AbstractWriter`): `fetch` (check the step, validate the
    summaries, copy them to the host) and `write_host` (PNG and WAV encoding,
    protobuf, disk). `AsyncWriter` runs `write_host` on a background thread, and by
    default never makes the calling thread wait for the device:

    - in a one-process run (the default, `background_fetch=True`), `fetch` runs on
      the background thread too: `write` checks the step and queues the
      summaries' device arrays, so the calling thread pays a queue `put` (~10 µs)
      instead of the fetch (which waits for the step that computes the summaries,
      then ~0.3 ms for the demo's 39 values on CPU). An invalid summary (a
      `TypeError` or `ValueError` of `fetch`) is then raised by the next `write`,
      `flush` or `close`, like a background write error. A `CallbackSummary`'s
      function runs on the background thread.
    - with several processes (the fetch may be a collective, `eqxctx.to_host`
      all-gathering arrays split over processes, which every process must run in
      program order) or `background_fetch=False`, `fetch` runs on the calling
      thread, by default one step late (`defer_fetch=True`): step n is fetched when
      step n + 1 is written (or at `flush`/`close`), so a training loop that
      dispatches step n + 1 before writing step n does not wait for the device,
      as the fetched arrays are ready. An invalid summary of step n is then raised
      by the call that fetches it (the next `write`, `flush` or `close`), with a
      note naming step n; step n is not written, and the step passed to that
      `write` is kept. With `defer_fetch=False` each `write` fetches its own step
      (waiting for it), and raises for an invalid summary itself.

    What is written is what the summaries held when `write` was called, whatever
    the caller does to its own mappings and NumPy arrays afterwards: `write` takes
    new mappings (in the same order) and copies of the NumPy arrays in them (also
    a summary's NumPy fields, and the `args` and `kwargs` containers of a
    `CallbackSummary`). JAX arrays are immutable and kept as they are (no device
    copy, no transfer), as are numbers and an `OutputCollection` (read-only)
    without NumPy arrays. The training thread pays under 1 µs per leaf (~10 µs
    for the demo's summaries on CPU). Other objects inside are not copied.

    Steps are written in order. The queue holds at most `max_pending` steps; a
    `write` that finds it full waits for the thread (memory stays bounded). With a
    background fetch the queued steps are device arrays: up to `max_pending` steps
    of summaries stay alive in device memory until the thread has fetched them (do
    not donate them to a later step: a deleted array fails the fetch; a
    `SummaryBuffer`, written with `write_buffer`, may be donated). An error in
    the background thread is raised by the next `write`, `flush` or `close` (the
    exception itself, with a note naming the step); steps after the failed one are
    not written, and later calls raise `ValueError` (close the writer). With
    several processes, `write`, `flush` and `close` still fetch after a failure
    (the fetch is a collective that the other processes run too) and raise after
    it. `close` writes everything pending, then closes the wrapped writer; a writer
    left open is closed when the interpreter exits (`atexit`), and an error of
    `close` when a `with` block is left by an exception is added to that exception
    as a note.

    Follows clu's `AsyncWriter` (`clu/metric_writers/async_writer.py`), which also
    writes on a thread pool and re-raises its errors on the next call.

    Args:
        writer: the writer to run in the background (e.g. a `MultiWriter` of a
            `JsonlWriter` and a `TensorBoardWriter`); `AsyncWriter` owns it and
            closes it.
        max_pending: the most steps waiting for the thread (>= 1).
        defer_fetch: where the calling thread fetches (several processes, or
            `background_fetch=False`), fetch each step at the next write, one step
            late (default True). In one process, a step's copies to the host start
            at its own write and run during the next step (where the wrapped
            writer's `fetch` is `AbstractWriter.fetch`, as for the writers here and
            `MultiWriter`).
        background_fetch: in a one-process run, fetch on the background thread
            (default True; errors in the summaries then surface at the next call).
            False: fetch on the calling thread (see `defer_fetch`).

    Raises:
        TypeError: if `max_pending` is not an int.
        ValueError: if `max_pending` is less than 1.

    Examples:
        >>> import pathlib, tempfile
        >>> from eqxctx.writers import JsonlWriter
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "s.jsonl"
        >>> with AsyncWriter(JsonlWriter(path)) as writer:
        ...     for step in range(3):
        ...         writer.write(step, {"loss": 1.0 / (step + 1)})
        >>> len(path.read_text().splitlines())
        3
    """

    def __init__(
        self,
        writer: AbstractWriter,
        *,
        max_pending: object = 8,  # an int, checked here with a message naming it
        defer_fetch: bool = True,
        background_fetch: bool = True,
    ):
        self.max_pending = check_positive_int(
            max_pending,
            where="AsyncWriter(writer, max_pending=...)",
            name="max_pending",
            meaning="the most steps waiting for the background thread",
        )
        self.writer = writer
        self.defer_fetch = defer_fetch
        self.background_fetch = background_fetch
        self._queue: queue.Queue[_Job] = queue.Queue(self.max_pending)
        self._deferred: tuple[int, Summaries | Prefetched] | None = None
        self._error: BaseException | None = None
        self._error_step: int | None = None
        self._error_kind: str | None = None
        self._reported = False
        self._closed = False
        self._thread = threading.Thread(
            target=self._work, name="eqxctx-AsyncWriter", daemon=True
        )
        self._thread.start()
        # Registered per writer, so that it runs before the exit handlers of what
        # the wrapped writer started before it (a W&B run's, JAX's).
        atexit.register(self._close_at_exit)

    def _work(self) -> None:
        while True:
            kind, item = self._queue.get()
            try:
                if kind == _STOP:
                    return
                if self._error is not None:
                    continue  # after a failure nothing more is written
                if kind == _FLUSH:
                    self.writer.flush()
                elif kind == _FETCH:
                    step, trees = item
                    self.writer.write_host(self.writer.fetch(step, trees))
                elif kind == _BUFFER:
                    self._write_fetched(item)
                else:
                    self.writer.write_host(item)
            except BaseException as e:  # surfaced on the next call
                self._error = e
                self._error_kind = kind
                self._error_step = (
                    None
                    if item is None or kind == _BUFFER
                    else item[0]
                    if kind == _FETCH
                    else item.step
                )
            finally:
                # Not kept while waiting for the next job: the last step's host
                # arrays (views of JAX buffers) would be freed on this thread when
                # the interpreter shuts down, which aborted it.
                kind = item = None
                self._queue.task_done()

    def _raise_if_failed(self, where: str) -> None:
        if self._error is None:
            return
        what = (
            f"step {self._error_step}"
            if self._error_step is not None
            else "a buffer of steps (write_buffer)"
            if self._error_kind == _BUFFER
            else "flush"
        )
        inner = type(self.writer).__name__
        if self._reported:
            raise ValueError(
                f"`{where}`: the background thread failed at {what} ({inner}: "
                f"{self._error!r}), raised before; close this writer."
            )
        self._reported = True
        self._error.add_note(
            f"Raised by eqxctx's AsyncWriter: its background thread failed writing "
            f"{what} with {inner}; later steps were not written."
        )
        raise self._error

    def _submit(self, host: HostSummaries) -> None:
        if is_writing_process():
            self._queue.put((_WRITE, host))  # waits while the queue is full

    def _fetch_deferred(self) -> None:
        pending, self._deferred = self._deferred, None
        self._fetch_pending(pending)

    def _fetch_pending(
        self, pending: tuple[int, Summaries | Prefetched] | None
    ) -> None:
        """Fetch and queue a deferred step; an error raised names that step."""
        if pending is None:
            return
        step, trees = pending
        try:
            if type(trees) is Prefetched:  # the writer's fetch is AbstractWriter's
                host = fetch_host(self.writer, step, trees)
            else:
                host = self.writer.fetch(step, cast(Summaries, trees))
        except Exception as e:
            e.add_note(
                f"Raised by eqxctx's AsyncWriter(defer_fetch=True) fetching step "
                f"{step}, one step late: step {step} is not written; the step "
                "passed to this call, if any, is kept."
            )
            raise
        self._submit(host)

    def write(self, step: Step, summaries: Summaries) -> None:
        """Queue one step: its device arrays (background fetch) or its fetched values.

        Raises as `AbstractWriter.write` does, plus the error of a failed background
        write (see the class). With a background fetch or `defer_fetch`, the step is
        checked now and the summaries when they are fetched, so an invalid summary
        raises at a later call (with `defer_fetch`, with a note naming its step).
        The mappings and NumPy arrays of `summaries` are copied now (see the class).
        """
        where = "AsyncWriter.write"
        several = jax.process_count() > 1
        if not several:
            self._raise_if_failed(where)
        if self._closed:
            raise ValueError(f"`{where}`: the writer is closed.")
        checked = check_step(step, where=where)
        # What the caller may change after this call (mappings, NumPy arrays) is
        # copied now; JAX arrays are immutable and kept.
        trees = _snapshot(summaries)
        if self.background_fetch and jax.process_count() == 1:
            self._queue.put((_FETCH, (checked, trees)))  # the thread fetches
        elif self.defer_fetch:
            # Stored before the previous step is fetched: an error in that one
            # (raised here, naming its step) does not lose this one.
            if type(self.writer).fetch is AbstractWriter.fetch:
                # Its copies to the host start now and end during the next step.
                trees = prefetch(trees)
            previous, self._deferred = self._deferred, (checked, trees)
            self._fetch_pending(previous)
        else:
            self._submit(self.writer.fetch(checked, trees))
        if several:
            # After the fetch, a collective that every process runs in step: a
            # failure on process 0 leaves the others waiting for none.
            self._raise_if_failed(where)

    def write_buffer(self, buffer: SummaryBuffer) -> SummaryBuffer:
        """Queue every step held in `buffer`; return it emptied, without waiting.

        In one process the calling thread starts the buffer's copy to the host (one
        jitted copy on the device, one transfer per width of raw bits) and queues
        it: the background thread waits for the device, checks the steps and
        writes them. So the buffer may be donated to the next step at once, and
        an invalid summary (or steps lost to a full buffer) is raised by the next
        `write`, `write_buffer`, `flush` or `close`, like a background write error.
        With several processes the buffer is fetched here (a collective) and its
        steps are checked here. A step deferred by `defer_fetch` is queued first,
        so steps stay in order. Passing the same buffer again queues nothing.

        Raises:
            TypeError: if `buffer` is not a concrete `SummaryBuffer`.
            ValueError: for a closed writer; with several processes, as
                `AbstractWriter.write_buffer`.
            BaseException: the error of a failed background write, if any.
        """
        where = "AsyncWriter.write_buffer"
        several = jax.process_count() > 1
        if not several:
            self._raise_if_failed(where)
        if self._closed:
            raise ValueError(f"`{where}`: the writer is closed.")
        fetch = start_fetch(buffer, where=where)  # (checks the buffer)
        done, token = self._buffer_done, buffer.count
        if done is not None and done[0] is token:
            return buffer.cleared()  # queued before (e.g. an interrupted call)
        self._fetch_deferred()  # the steps before the buffer's
        if several:
            fetched = buffer_rows(fetch)
            for host in buffer_hosts(self.writer, fetched):
                self._submit(host)
            self._buffer_done = (token, len(fetched.rows))
            check_lost(fetched, where=where)
            self._raise_if_failed(where)
        else:
            self._queue.put((_BUFFER, fetch))
            self._buffer_done = (token, 0)
        return buffer.cleared()

    def _write_fetched(self, fetch: BufferFetch) -> None:
        """Write a buffer queued by `write_buffer` (on the background thread)."""
        fetched = buffer_rows(fetch)
        for host in buffer_hosts(self.writer, fetched):
            self.writer.write_host(host)
        check_lost(fetched, where="AsyncWriter.write_buffer")

    def fetch(self, step: Step, summaries: Summaries) -> HostSummaries:
        """Fetch with the wrapped writer (`AbstractWriter.fetch`)."""
        return self.writer.fetch(step, summaries)

    def check(self, host: HostSummaries) -> None:
        """Check with the wrapped writer; refuse a closed or failed writer."""
        self._raise_if_failed("AsyncWriter.write")
        if self._closed:
            raise ValueError("`AsyncWriter.write`: the writer is closed.")
        self.writer.check(host)

    def write_host(self, host: HostSummaries) -> None:
        """Queue a fetched step for the background thread.

        `host` is written as it is when the thread reaches it: a `MultiWriter`
        around this writer hands it the caller's NumPy arrays, uncopied (wrap the
        `MultiWriter` in the `AsyncWriter` instead: `write` copies them).
        """
        self._submit(host)

    def flush(self) -> None:
        """Write everything pending (fetching a deferred step), then flush.

        Raises:
            BaseException: the error of a failed background write, if any.
        """
        if jax.process_count() == 1:
            self._raise_if_failed("AsyncWriter.flush")
        if self._closed:
            return
        self._fetch_deferred()  # (a collective: before raising on process 0)
        self._raise_if_failed("AsyncWriter.flush")
        self._queue.put((_FLUSH, None))
        self._queue.join()
        self._raise_if_failed("AsyncWriter.flush")

    def _close_at_exit(self) -> None:
        """`close` as the interpreter exits, for a writer left open.

        An error is printed (`sys.excepthook`'s format). With several processes
        a step deferred by `defer_fetch` is dropped: its fetch is a collective,
        which the other processes may no longer run.
        """
        if jax.process_count() > 1:
            self._deferred = None
        try:
            self.close()
        except Exception as e:
            traceback.print_exception(e)

    def close(self) -> None:
        """Write everything pending, stop the thread and close the wrapped writer.

        Closing twice is allowed. Raises a background error not raised before (with
        a note naming the wrapped writer's `close` error, if that raised too).
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        try:
            # Several processes: fetched even after a failure (a collective that
            # the other processes run too); its step is not written.
            if self._error is None or jax.process_count() > 1:
                self._fetch_deferred()
        finally:
            self._queue.put((_STOP, None))
            self._thread.join()
            try:
                self.writer.close()
            except BaseException as e:
                if self._error is None or self._reported:
                    raise
                # Steps were lost in the background: that error is raised below.
                self._error.add_note(
                    f"Closing {type(self.writer).__name__} then raised {e!r}."
                )
        if not self._reported:
            self._raise_if_failed("AsyncWriter.close")


class MultiWriter(AbstractWriter):
    """Write every step to several writers: fetch once, check all, write each.

    `write` fetches the summaries once, runs every writer's `check` (so a value one
    of them refuses writes nothing anywhere), then each writer's `write_host` in
    order. Writing, `flush` and `close` reach every writer: a writer that raises
    does not stop the ones after it, and the first error is raised once all of them
    have been called (each later error as a note on it).

    Args:
        *writers: the writers, e.g. `MultiWriter(JsonlWriter(path),
            TensorBoardWriter(logdir))`; `MultiWriter` owns and closes them.

    Raises:
        ValueError: if no writer is given.
    """

    def __init__(self, *writers: AbstractWriter):
        if not writers:
            raise ValueError("`MultiWriter(*writers)`: pass at least one writer.")
        self.writers = writers

    def check(self, host: HostSummaries) -> None:
        """Run every writer's `check`."""
        for writer in self.writers:
            writer.check(host)

    def write_host(self, host: HostSummaries) -> None:
        """Write the fetched step with every writer, in order.

        Raises:
            Exception: the first error a writer raised, after every writer was
                called.
        """
        self._each("write_host", lambda writer: writer.write_host(host))

    def flush(self) -> None:
        """Flush every writer; raise the first error after flushing all."""
        self._each("flush", lambda writer: writer.flush())

    def close(self) -> None:
        """Close every writer; raise the first error after closing all."""
        self._each("close", lambda writer: writer.close())

    def _each(self, name: str, call: Callable[[AbstractWriter], None]) -> None:
        """`call(writer)` for every writer; then raise the first error, if any."""
        error: BaseException | None = None
        for writer in self.writers:
            try:
                call(writer)
            except BaseException as e:
                if error is None:
                    error = e
                else:
                    error.add_note(
                        f"`MultiWriter.{name}`: {type(writer).__name__}.{name} also "
                        f"raised {type(e).__name__}: {e}"
                    )
        if error is not None:
            raise error

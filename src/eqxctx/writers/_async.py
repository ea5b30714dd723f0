"""AsyncWriter: fetch, formatting and file I/O on a background thread."""

import atexit
import dataclasses
import functools
import queue
import threading
import traceback
from collections.abc import Mapping
from typing import Any, TypeAlias, cast

import jax
import numpy as np

from eqxctx._checks import check_positive_int
from eqxctx._collection import OutputCollection
from eqxctx._iterations import IterationSummaries
from eqxctx._mapping import FrozenMapping
from eqxctx._summary import Summary

from ._base import (
    BACKGROUND_THREAD,
    AbstractWriter,
    HostSummaries,
    Step,
    buffer_hosts,
    check_lost,
    check_step,
    fetch_host,
    is_writing_process,
)
from ._buffer import SummaryBuffer, buffer_rows, emptied, start_fetch
from ._read import Prefetched, Summaries, prefetch


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
    """How `_snapshot` treats a value of type `cls` (one check per type)."""
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


def _snapshot(summaries: object) -> Any:
    """The summary trees of `summaries`, which the caller can no longer change.

    `summaries` itself where nothing in it can change; otherwise as `summary_trees`
    lays them out, with each mutable part copied: mappings (a new `dict` in the
    same order; a `FrozenMapping` rebuilt only where a leaf below it is copied),
    NumPy arrays, and a summary's containers and NumPy arrays. JAX arrays, numbers
    and summaries without such fields are kept.
    """
    kind = _kind(type(summaries))
    if kind == _KEEP:
        return summaries
    if kind == _FIELDS:  # copied only where a leaf is a NumPy array
        # `object.__getattribute__`: faster than Equinox's attribute lookup.
        fields = object.__getattribute__(summaries, "__dict__").values()
        if all(_is_flat(type(f)) for f in fields):
            return summaries
        return jax.tree_util.tree_map(_copy_numpy, summaries)
    if kind == _MAPPING:
        mapping = cast(Mapping[object, object], summaries)
        return {k: _snapshot(v) for k, v in mapping.items()}
    if kind == _FROZEN:
        frozen = cast(FrozenMapping, summaries)
        new: list[tuple[str, object]] = []
        changed = False
        for k, v in frozen.items():
            owned = v if _kind(type(v)) == _KEEP else _snapshot(v)
            changed = changed or owned is not v
            new.append((k, owned))
        # Copies of its leaves: checked where `summaries` was.
        return FrozenMapping(new, checked=frozen.checked) if changed else summaries
    if kind == _COLLECTION:  # read-only: kept if nothing is copied
        levels = cast(OutputCollection, summaries).summaries
        trees = _snapshot(levels)
        return summaries if trees is levels else trees
    if kind == _COPY:
        return cast(np.ndarray, summaries).copy()
    # _STACKED: a read-only stacked mapping
    entry = cast(IterationSummaries, summaries)
    stacked = _snapshot(entry.stacked)
    if stacked is entry.stacked:
        return summaries
    return dataclasses.replace(entry, stacked=stacked)


class AsyncWriter(AbstractWriter):
    """Write through another writer on a background thread, so `write` never waits.

    A write has two halves (`AbstractWriter`): `fetch` (check the step, validate
    and copy the summaries to the host) and `write_host` (encoding, disk).
    `AsyncWriter` runs `write_host` on a background thread and, by default, never
    makes the calling thread wait for the device:

    - one process, `background_fetch=True` (the default): `fetch` runs on the
      thread too; `write` checks the step and queues the device arrays. An invalid
      summary (a `TypeError` or `ValueError` of `fetch`) is raised by the next
      `write`, `flush` or `close`, like a background write error. A
      `CallbackSummary`'s function runs on the thread.
    - several processes (the fetch may be a collective that every process runs in
      program order) or `background_fetch=False`: `fetch` runs on the calling
      thread, with `defer_fetch=True` one step late: step n is fetched when step
      n + 1 is written (or at `flush`/`close`), when its arrays are ready. An
      invalid summary of step n is raised by that call, with a note naming step n;
      step n is not written and the step passed to that call is kept. With
      `defer_fetch=False` each `write` fetches (and checks) its own step.

    What is written is what the summaries held when `write` was called: `write`
    copies their mappings (in the same order) and NumPy arrays (also a summary's
    NumPy fields and a `CallbackSummary`'s `args` and `kwargs`). JAX arrays are
    immutable and kept (no device copy); other objects inside are not copied.

    Steps are written in order. At most `max_pending` steps wait for the thread; a
    `write` that finds the queue full waits. With a background fetch the queued
    steps are device arrays, alive until fetched (do not donate them to a later
    step; a `SummaryBuffer` written with `write_buffer` may be donated). An error
    on the thread is raised by the next `write`, `flush` or `close` (with a note
    naming the step); later steps are not written and later calls raise
    `ValueError`. With several processes, calls still fetch after a failure (a
    collective) and raise after it. `close` writes everything pending, then
    closes the wrapped writer; a writer left open is closed at interpreter exit
    (`atexit`).

    Follows clu's `AsyncWriter` (`clu/metric_writers/async_writer.py`), which also
    writes on a thread pool and re-raises its errors on the next call.

    Args:
        writer: the writer to run in the background (e.g. a `MultiWriter`);
            `AsyncWriter` owns and closes it.
        max_pending: the most steps waiting for the thread, an int >= 1.
        defer_fetch: where the calling thread fetches, fetch each step at the next
            write (default True). In one process its copies to the host start at
            its own write (where the wrapped writer's `fetch` is
            `AbstractWriter.fetch`).
        background_fetch: in a one-process run, fetch on the background thread
            (default True); False: on the calling thread (see `defer_fetch`).

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
        self._error_at = ""  # what failed: "step 3", "flush", ...
        self._reported = False
        self._closed = False
        self._thread = threading.Thread(
            target=self._work, name=BACKGROUND_THREAD, daemon=True
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
                    self.writer.write_host(self.writer.fetch(*item))
                elif kind == _BUFFER:
                    fetched = buffer_rows(item)
                    for host in buffer_hosts(self.writer, fetched):
                        self.writer.write_host(host)
                    check_lost(fetched, where="AsyncWriter.write_buffer")
                else:
                    self.writer.write_host(item)
            except BaseException as e:  # surfaced on the next call
                self._error = e
                self._error_at = (
                    "flush"
                    if kind == _FLUSH
                    else "a buffer of steps (write_buffer)"
                    if kind == _BUFFER
                    else f"step {item[0] if kind == _FETCH else item.step}"
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
        inner = type(self.writer).__name__
        if self._reported:
            raise ValueError(
                f"`{where}`: the background thread failed at {self._error_at} "
                f"({inner}: {self._error!r}), raised before; close this writer."
            )
        self._reported = True
        self._error.add_note(
            f"Raised by eqxctx's AsyncWriter: its background thread failed writing "
            f"{self._error_at} with {inner}; later steps were not written."
        )
        raise self._error

    def _begin(self, where: str) -> bool:
        """Refuse a closed or (one process) failed writer; whether several processes.

        With several processes a failure is raised after the call's fetch, a
        collective: a failure on process 0 leaves the others waiting for none.
        """
        several = jax.process_count() > 1
        if not several:
            self._raise_if_failed(where)
        if self._closed:
            raise ValueError(f"`{where}`: the writer is closed.")
        return several

    def _submit(self, host: HostSummaries) -> None:
        if is_writing_process():
            self._queue.put((_WRITE, host))  # waits while the queue is full

    def _fetch_deferred(
        self, new: tuple[int, Summaries | Prefetched] | None = None
    ) -> None:
        """Fetch and queue the deferred step (deferring `new`); errors name it."""
        # `new` is stored first: an error in the deferred step does not lose it.
        pending, self._deferred = self._deferred, new
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
        write. With a background fetch or `defer_fetch`, the summaries are checked
        when they are fetched, so an invalid summary raises at a later call. The
        mappings and NumPy arrays of `summaries` are copied now (see the class).
        """
        where = "AsyncWriter.write"
        several = self._begin(where)
        checked = check_step(step, where=where)
        trees = _snapshot(summaries)
        if self.background_fetch and not several:
            self._queue.put((_FETCH, (checked, trees)))  # the thread fetches
        elif self.defer_fetch:
            if type(self.writer).fetch is AbstractWriter.fetch:
                trees = prefetch(trees)  # copies start now, end during the next step
            self._fetch_deferred((checked, trees))
        else:
            self._submit(self.writer.fetch(checked, trees))
        if several:
            self._raise_if_failed(where)

    def write_buffer(self, buffer: SummaryBuffer) -> SummaryBuffer:
        """Queue every step held in `buffer`; return it emptied, without waiting.

        In one process the calling thread starts the buffer's copy to the host (one
        jitted copy on the device, one transfer per width of raw bits) and queues
        it; the background thread waits for it, checks the steps and writes them.
        The buffer may be donated to the next step at once; an invalid summary (or
        steps lost to a full buffer) is raised by the next call, like a background
        write error. With several processes the buffer is fetched and its steps
        checked here (a collective). A step deferred by `defer_fetch` is queued
        first. Passing the same buffer again queues nothing.

        Raises:
            TypeError: if `buffer` is not a concrete `SummaryBuffer`.
            ValueError: for a closed writer or a buffer batched by `jax.vmap`;
                with several processes, as `AbstractWriter.write_buffer`.
            BaseException: the error of a failed background write, if any.
        """
        where = "AsyncWriter.write_buffer"
        several = self._begin(where)
        fetch = start_fetch(buffer, where=where)  # (checks the buffer)
        done, token = self._buffer_done, buffer.marks
        if done is not None and done[0] is token:
            return buffer.cleared()  # queued before (e.g. an interrupted call)
        self._fetch_deferred()  # the steps before the buffer's
        if several:
            fetched = buffer_rows(fetch)
            for host in buffer_hosts(self.writer, fetched):
                self._submit(host)
            self._buffer_done = (token, len(fetched.steps))
            check_lost(fetched, where=where)
            self._raise_if_failed(where)
        else:
            self._queue.put((_BUFFER, fetch))
            self._buffer_done = (token, 0)
        return emptied(buffer, fetch)

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
        """Queue a fetched step for the background thread, as it is (uncopied).

        A `MultiWriter` around this writer hands it the caller's NumPy arrays; wrap
        the `MultiWriter` in the `AsyncWriter` instead (`write` copies them).
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
        """`close` as the interpreter exits; an error is printed.

        With several processes a deferred step is dropped: its fetch is a
        collective that the other processes may no longer run.
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

"""AsyncWriter (file I/O on a background thread) and MultiWriter (fan-out)."""

import queue
import threading
from typing import Any, TypeAlias

import jax

from ._base import (
    AbstractWriter,
    HostSummaries,
    Step,
    Summaries,
    check_step,
    is_writing_process,
    summary_trees,
)


_FLUSH = "flush"
_STOP = "stop"
_WRITE = "write"
_FETCH = "fetch"

#: `(kind, item)` on the queue: a `HostSummaries` to write, `(step, summary trees)`
#: to fetch, or None. The item is untyped: its type follows the kind, which pyright
#: does not narrow through the unpacked tuple.
_Job: TypeAlias = tuple[str, Any]


class AsyncWriter(AbstractWriter):
    """Write through another writer on a background thread, so `write` never waits.

    A write has two halves (`AbstractWriter`): `fetch` (check the step, validate the
    summaries, copy them to the host) and `write_host` (PNG and WAV encoding,
    protobuf, disk). `AsyncWriter` runs `write_host` on a background thread, and
    `fetch`:

    - on the calling thread (the default): `write` validates the summaries and
      copies them to the host, so an invalid summary is raised by that `write`. The
      fetch may be a collective (`eqxctx.to_host` all-gathers arrays split over
      processes) that every process must run in program order. With
      `defer_fetch=True`, step n is fetched when step n + 1 is written (or at
      `flush`/`close`): a training loop that dispatches step n + 1 before writing
      step n never waits for the device, as the fetched arrays are ready.
    - with `background_fetch=True`, in a one-process run, on the background thread
      too: `write` checks the step and queues the summaries' device arrays
      (a new mapping of them: the caller may change its own afterwards), so the
      calling thread pays a queue `put` (~10 µs) instead of the fetch (~0.3 ms for
      the demo's 35 values on CPU, more while a step runs beside it). An invalid
      summary (a `TypeError` or `ValueError` of `fetch`) is then raised by the next
      `write`, `flush` or `close`, like a background write error. A
      `CallbackSummary`'s function runs on the background thread. In a
      multi-process run the fetch stays on the calling thread.

    Steps are written in order. The queue holds at most `max_pending` steps; a
    `write` that finds it full waits for the thread (memory stays bounded). With a
    background fetch the queued steps are device arrays: up to `max_pending` steps
    of summaries stay alive in device memory until the thread has fetched them (do
    not donate them to a later step: a deleted array fails the fetch). An error in
    the background thread is raised by the next `write`, `flush` or `close` (the
    exception itself, with a note naming the step); steps after the failed one are
    not written, and later calls raise `ValueError` (close the writer). `close`
    writes everything pending, then closes the wrapped writer.

    Follows clu's `AsyncWriter` (`clu/metric_writers/async_writer.py`), which also
    writes on a thread pool and re-raises its errors on the next call.

    Args:
        writer: the writer to run in the background (e.g. a `MultiWriter` of a
            `JsonlWriter` and a `TensorBoardWriter`); `AsyncWriter` owns it and
            closes it.
        max_pending: the most steps waiting for the thread (>= 1).
        defer_fetch: where the calling thread fetches (the default; several
            processes), fetch each step at the next write, one step late.
        background_fetch: in a one-process run, fetch on the background thread
            (errors in the summaries then surface at the next call).

    Raises:
        ValueError: if `max_pending` is less than 1.

    Examples:
        >>> import pathlib, tempfile
        >>> from eqxctx.writers import JsonlWriter
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "s.jsonl"
        >>> with AsyncWriter(JsonlWriter(path), defer_fetch=True) as writer:
        ...     for step in range(3):
        ...         writer.write(step, {"loss": 1.0 / (step + 1)})
        >>> len(path.read_text().splitlines())
        3
    """

    def __init__(
        self,
        writer: AbstractWriter,
        *,
        max_pending: int = 8,
        defer_fetch: bool = False,
        background_fetch: bool = False,
    ):
        if isinstance(max_pending, bool) or max_pending < 1:
            raise ValueError(
                f"`AsyncWriter(max_pending={max_pending!r})`: pass a positive int."
            )
        self.writer = writer
        self.max_pending = max_pending
        self.defer_fetch = defer_fetch
        self.background_fetch = background_fetch
        self._queue: queue.Queue[_Job] = queue.Queue(max_pending)
        self._deferred: tuple[int, Summaries] | None = None
        self._error: BaseException | None = None
        self._error_step: int | None = None
        self._reported = False
        self._closed = False
        self._thread = threading.Thread(
            target=self._work, name="eqxctx-AsyncWriter", daemon=True
        )
        self._thread.start()

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
                else:
                    self.writer.write_host(item)
            except BaseException as e:  # surfaced on the next call
                self._error = e
                self._error_step = (
                    None if item is None else item[0] if kind == _FETCH else item.step
                )
            finally:
                self._queue.task_done()

    def _raise_if_failed(self, where: str) -> None:
        if self._error is None:
            return
        what = f"step {self._error_step}" if self._error_step is not None else "flush"
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
        if self._deferred is not None:
            step, summaries = self._deferred
            self._deferred = None
            self._submit(self.writer.fetch(step, summaries))

    def write(self, step: Step, summaries: Summaries) -> None:
        """Queue one step: its device arrays (background fetch) or its fetched values.

        Raises as `AbstractWriter.write` does, plus the error of a failed background
        write (see the class). With a background fetch or `defer_fetch`, the step is
        checked now and the summaries when they are fetched, so an invalid summary
        raises at a later call.
        """
        where = "AsyncWriter.write"
        self._raise_if_failed(where)
        if self._closed:
            raise ValueError(f"`{where}`: the writer is closed.")
        checked = check_step(step, where=where)
        if self.background_fetch and jax.process_count() == 1:
            # The thread fetches (the queue holds the device arrays); a new
            # mapping, so that the caller may change its own after this call.
            self._queue.put((_FETCH, (checked, summary_trees(summaries))))
        elif self.defer_fetch:
            self._fetch_deferred()
            self._deferred = (checked, summaries)
        else:
            self._submit(self.writer.fetch(checked, summaries))

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
        """Queue a fetched step for the background thread."""
        self._submit(host)

    def flush(self) -> None:
        """Write everything pending (fetching a deferred step), then flush.

        Raises:
            BaseException: the error of a failed background write, if any.
        """
        self._raise_if_failed("AsyncWriter.flush")
        if self._closed:
            return
        self._fetch_deferred()
        self._queue.put((_FLUSH, None))
        self._queue.join()
        self._raise_if_failed("AsyncWriter.flush")

    def close(self) -> None:
        """Write everything pending, stop the thread and close the wrapped writer.

        Closing twice is allowed. Raises a background error not raised before.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._error is None:
                self._fetch_deferred()
        finally:
            self._queue.put((_STOP, None))
            self._thread.join()
            self.writer.close()
        if not self._reported:
            self._raise_if_failed("AsyncWriter.close")


class MultiWriter(AbstractWriter):
    """Write every step to several writers: fetch once, check all, write each.

    `write` fetches the summaries once, runs every writer's `check` (so a value one
    of them refuses writes nothing anywhere), then each writer's `write_host` in
    order. `flush` and `close` reach every writer (`close` closes all of them even if
    one raises, then raises the first error).

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
        """Write the fetched step with every writer, in order."""
        for writer in self.writers:
            writer.write_host(host)

    def flush(self) -> None:
        """Flush every writer."""
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        """Close every writer; raise the first error after closing all."""
        error: BaseException | None = None
        for writer in self.writers:
            try:
                writer.close()
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error

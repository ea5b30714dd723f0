"""AsyncWriter (file I/O on a background thread) and MultiWriter (fan-out)."""

import queue
import threading

from ._base import (
    AbstractWriter,
    HostSummaries,
    Step,
    Summaries,
    check_step,
    is_writing_process,
)


_FLUSH = "flush"
_STOP = "stop"


class AsyncWriter(AbstractWriter):
    """Write through another writer on a background thread, so `write` never waits.

    `write(step, summaries)` validates and fetches the summaries on the calling thread
    (`AbstractWriter.fetch`: every process takes part, so multi-process runs stay in
    step) and queues the file I/O (`write_host`: PNG and WAV encoding, protobuf,
    disk) for a background thread. With `defer_fetch=True`, step n is fetched when
    step n + 1 is written (or at `flush`/`close`): a training loop that dispatches
    step n + 1 before writing step n then never waits for the device, as the fetched
    arrays are ready. Steps are written in order.

    The queue holds at most `max_pending` fetched steps; a `write` that finds it full
    waits for the thread (memory stays bounded). An error in the background thread is
    raised by the next `write`, `flush` or `close` (the exception itself, with a note
    naming the step); steps after the failed one are not written, and later calls
    raise `ValueError` (close the writer). `close` writes everything pending, then
    closes the wrapped writer.

    Follows clu's `AsyncWriter` (`clu/metric_writers/async_writer.py`), which also
    writes on a thread pool and re-raises its errors on the next call.

    Args:
        writer: the writer to run in the background (e.g. a `MultiWriter` of a
            `JsonlWriter` and a `TensorBoardWriter`); `AsyncWriter` owns it and
            closes it.
        max_pending: the most fetched steps waiting for the thread (>= 1).
        defer_fetch: fetch each step at the next write, one step late.

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
        self, writer: AbstractWriter, *, max_pending: int = 8, defer_fetch: bool = False
    ):
        if isinstance(max_pending, bool) or max_pending < 1:
            raise ValueError(
                f"`AsyncWriter(max_pending={max_pending!r})`: pass a positive int."
            )
        self.writer = writer
        self.max_pending = max_pending
        self.defer_fetch = defer_fetch
        self._queue: queue.Queue[tuple[str, HostSummaries | None]] = queue.Queue(
            max_pending
        )
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
            kind, host = self._queue.get()
            try:
                if kind == _STOP:
                    return
                if self._error is not None:
                    continue  # after a failure nothing more is written
                if kind == _FLUSH:
                    self.writer.flush()
                elif host is not None:
                    self.writer.write_host(host)
            except BaseException as e:  # surfaced on the next call
                self._error = e
                self._error_step = None if host is None else host.step
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
            self._queue.put(("write", host))  # waits while the queue is full

    def _fetch_deferred(self) -> None:
        if self._deferred is not None:
            step, summaries = self._deferred
            self._deferred = None
            self._submit(self.writer.fetch(step, summaries))

    def write(self, step: Step, summaries: Summaries) -> None:
        """Fetch one step (now, or at the next write with `defer_fetch`) and queue it.

        Raises as `AbstractWriter.write` does, plus the error of a failed background
        write (see the class). With `defer_fetch`, the step is checked now and the
        summaries when they are fetched, so an invalid summary raises at the next
        call.
        """
        where = "AsyncWriter.write"
        self._raise_if_failed(where)
        if self._closed:
            raise ValueError(f"`{where}`: the writer is closed.")
        checked = check_step(step, where=where)
        if self.defer_fetch:
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

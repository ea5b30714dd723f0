"""MultiWriter: one fetch, every writer's check, then each writer's write."""

from collections.abc import Callable

from ._base import AbstractWriter, HostSummaries


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
        self._each("write_host", lambda _, writer: writer.write_host(host))

    def _write_row(self, host: HostSummaries, row: tuple[object, int]) -> None:
        """Write a buffer's row with every writer that has not written it yet.

        A `write_buffer` interrupted in one writer's `write_host` (Ctrl-C) is
        called again with the same buffer: the writers that wrote that row
        then are skipped, so that each writes every step once.
        """
        last = self._row
        wrote = (
            last[2]
            if last is not None and last[0] is row[0] and last[1] == row[1]
            else set()
        )
        self._row = (row[0], row[1], wrote)

        def write(i: int, writer: AbstractWriter) -> None:
            if i not in wrote:
                writer._write_row(host, row)  # (a MultiWriter's skips its own)
                wrote.add(i)

        self._each("write_host", write)

    #: `(buffer.marks, row, writers that wrote it)`: the row `_write_row` wrote last.
    _row: tuple[object, int, set[int]] | None = None

    def flush(self) -> None:
        """Flush every writer; raise the first error after flushing all."""
        self._each("flush", lambda _, writer: writer.flush())

    def close(self) -> None:
        """Close every writer; raise the first error after closing all."""
        self._each("close", lambda _, writer: writer.close())

    def _each(self, name: str, call: Callable[[int, AbstractWriter], None]) -> None:
        """`call(i, writer)` for every writer; then raise the first error, if any."""
        error: BaseException | None = None
        for i, writer in enumerate(self.writers):
            try:
                call(i, writer)
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

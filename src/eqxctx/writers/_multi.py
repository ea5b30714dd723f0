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

"""JsonlWriter: summaries as JSON lines, one object per step."""

import json
import os
from typing import IO, Any, Literal

import numpy as np

from ._base import (
    AbstractWriter,
    Step,
    Summaries,
    check_step,
    flatten_summaries,
    host_values,
)


def json_value(arr: np.ndarray) -> Any:
    """Return `arr` as a Python number (rank 0) or nested lists of numbers.

    Booleans become 0/1. Floating values of at most 32 bits are written with the
    shortest decimal that reads back as the same float32 (`0.1`, not
    `0.10000000149011612`); float64 values are written exactly.
    """
    kind = arr.dtype.kind
    if kind == "b":
        return arr.astype(np.int64).tolist()
    if kind in "iu":
        return arr.tolist()
    if arr.dtype.itemsize <= 4:
        if arr.ndim == 0:
            return float(str(np.float32(arr)))
        # str(np.float32) is the shortest repr that round-trips through float32.
        short = [float(str(v)) for v in arr.astype(np.float32).ravel()]
        return np.asarray(short, dtype=np.float64).reshape(arr.shape).tolist()
    return arr.astype(np.float64).tolist()


class JsonlWriter(AbstractWriter):
    """Write summaries as JSON lines: one JSON object per `write(step, summaries)`.

    Each line is `{"step": step, path: value, ...}` with the "/"-joined paths of
    `OutputCollection.flatten("summaries")` (per-iteration children of a scan appear
    as `.../iter0/...`, `.../iter1/...`). A value is the leaf's `Summary.value()` (raw
    arrays as they are): a number for a shape-`()` value, nested lists of numbers
    (shape preserved) otherwise. Booleans become 0/1; NaN and infinities are written
    as `NaN` / `Infinity` / `-Infinity`, as Python's `json` module does (and reads
    back). Every leaf is written, including images and audio (as nested lists).
    Each line is flushed as it is written, so the file can be read during training.

    Read it back with `[json.loads(line) for line in open(path)]` or
    `pandas.read_json(path, lines=True)`.

    Args:
        path: the file to write (`str` or `os.PathLike`); missing parent folders are
            created.
        mode: `"a"` appends to an existing file (the default), `"w"` truncates it,
            `"x"` refuses to open an existing file (`FileExistsError`).

    Raises:
        OSError: if the file cannot be opened (e.g. `PermissionError`).
        ValueError: for a `mode` other than `"a"`, `"w"`, `"x"`.

    Examples:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "summaries.jsonl"
        >>> with JsonlWriter(path) as writer:
        ...     writer.write(3, {"loss": 0.5, "layer": {"rms": np.array([1.0, 2.0])}})
        >>> print(path.read_text(), end="")
        {"step": 3, "loss": 0.5, "layer/rms": [1.0, 2.0]}
    """

    def __init__(
        self, path: str | os.PathLike[str], *, mode: Literal["a", "w", "x"] = "a"
    ):
        if mode not in ("a", "w", "x"):
            raise ValueError(
                f"`JsonlWriter(mode=...)`: expected 'a', 'w' or 'x', got {mode!r}."
            )
        self.path = os.fspath(path)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._file: IO[str] | None = open(self.path, mode, encoding="utf-8")  # noqa: SIM115

    def write(self, step: Step, summaries: Summaries) -> None:
        """Append one line `{"step": step, path: value, ...}` and flush it.

        Args:
            step: the step number, a non-negative `int`.
            summaries: an `OutputCollection` (its `summaries` are written) or a nested
                mapping of summary leaves (arrays of any rank and a numeric dtype,
                Python numbers, `Summary` objects, `IterationSummaries`) and
                `OutputCollection`s (`{"train": coll}` writes `train/...`). JAX arrays
                are fetched to the host.

        Raises:
            TypeError: for a non-integer step, a leaf that is not a summary leaf, or
                a non-numeric value (the message names its path).
            ValueError: for a negative step, a summary named `"step"` at the top
                level, or a write after `close()`.
        """
        where = "JsonlWriter.write"
        step = check_step(step, where=where)
        if self._file is None:
            raise ValueError(f"`{where}`: the writer for {self.path!r} is closed.")
        values = host_values(flatten_summaries(summaries, where=where), where=where)
        if "step" in values:
            raise ValueError(
                f"`{where}`: a summary path is 'step', which would clash with the "
                "step number; nest it under a child (e.g. `{'train': summaries}`)."
            )
        record: dict[str, Any] = {"step": step}
        record.update((path, json_value(arr)) for path, arr in values.items())
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def flush(self) -> None:
        """Flush the file (lines are already flushed as they are written)."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Close the file; closing twice is allowed."""
        if self._file is not None:
            self._file.close()
            self._file = None

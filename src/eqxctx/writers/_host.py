"""HostValues: one step's `{path: value}` on the host, per-iteration rows kept whole."""

from collections.abc import Iterator, Mapping
from typing import TypeAlias

import numpy as np

from eqxctx._statistics import HistogramSummary
from eqxctx._summary import AudioSummary, ImageSummary


#: A value ready to write: a NumPy array, or (kept whole, with NumPy fields) an
#: `ImageSummary`, `AudioSummary` or `HistogramSummary`.
HostValue: TypeAlias = np.ndarray | ImageSummary | AudioSummary | HistogramSummary


class Rows:
    """The raw per-iteration summaries of one scan or vmap entry, on the host.

    Stands for the entries `paths[j]: columns[j % U][j // U]` (U columns, the
    iteration axis first), in that order: iteration-major, as `flatten` lists them.
    """

    __slots__ = ("columns", "paths")

    def __init__(self, paths: tuple[str, ...], columns: list[np.ndarray]):
        self.paths = paths
        self.columns = columns

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield `(path, value)`: each row as a NumPy array (0-d for scalars)."""
        flat = (v for row in zip(*self.columns, strict=True) for v in row)
        for path, value in zip(self.paths, flat, strict=True):
            yield path, value if type(value) is np.ndarray else np.asarray(value)


#: A part of `HostValues`: a `{path: value}` dict, or `Rows`.
Part: TypeAlias = dict[str, HostValue] | Rows


class HostValues(Mapping[str, HostValue]):
    """A read-only `{path: value}` mapping; per-iteration rows stay stacked until read.

    `fetch_summaries` returns its values as a dict; writers receive this mapping in
    `HostSummaries.values`, which holds the rows of a scan's raw per-iteration
    summaries as stacked NumPy arrays (`parts`), so that a writer can format them
    together (`JsonlWriter`) and the dict of per-iteration values is only built when
    a writer reads it.
    """

    __slots__ = ("_dict", "_keys", "_parts")

    # `list[Part]`: beartype samples a list's items with `random`, which hypothesis
    # forbids inside strategies; host values are made by writers, never in one.
    def __init__(self, parts: list[Part]):
        self._parts = parts
        self._dict: dict[str, HostValue] | None = None
        self._keys: frozenset[str] | None = None

    @property
    def parts(self) -> list[Part]:
        """The parts, in order: dicts of single values and `Rows`."""
        return self._parts

    def _full(self) -> dict[str, HostValue]:
        full = self._dict
        if full is None:
            full = {}
            for part in self._parts:
                full.update(part.items())
            self._dict = full
        return full

    def __getitem__(self, key: str) -> HostValue:
        return self._full()[key]

    def items(self) -> Iterator[tuple[str, HostValue]]:  # pyright: ignore[reportIncompatibleMethodOverride]
        """Yield `(path, value)` in order, part by part (no dict is built)."""
        if self._dict is not None:
            yield from self._dict.items()
            return
        for part in self._parts:
            yield from part.items()

    def __iter__(self) -> Iterator[str]:
        for part in self._parts:
            yield from (part.paths if isinstance(part, Rows) else part)

    def __len__(self) -> int:
        return sum(
            len(part.paths if isinstance(part, Rows) else part) for part in self._parts
        )

    def __contains__(self, key: object) -> bool:
        if self._dict is not None:
            return key in self._dict
        for part in self._parts:
            if isinstance(part, Rows):
                # Row paths are `{prefix}{i}/...`: a name without "/" (a writer's
                # `"step" in values`) is never one, and is not searched for.
                if isinstance(key, str) and "/" in key and key in part.paths:
                    return True
            elif key in part:
                return True
        return False

    def __repr__(self) -> str:
        return f"HostValues({self._full()!r})"

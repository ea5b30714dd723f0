"""The writer interface and the shared step: flatten summaries, fetch their values."""

import abc
import operator
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, SupportsIndex, TypeAlias, TypeVar

import jax
import numpy as np

from eqxctx._collection import OutputCollection, check_summary_name, summary_tree
from eqxctx._iterations import flatten_into
from eqxctx._summary import leaf_value


#: What `write` accepts: an `OutputCollection` (its summaries are written) or a
#: nested mapping of summaries, e.g. `collection.summaries` or `{"train": ...}`.
Summaries: TypeAlias = OutputCollection | Mapping[str, Any]

#: A step number: a Python or NumPy integer (anything with `__index__`).
Step: TypeAlias = SupportsIndex


def _collision(path: str, *, where: str) -> ValueError:
    return ValueError(
        f"`{where}`: two summaries have the path {path!r} (per-iteration children "
        "are written as 'name{i}/...', and a `CallbackSummary` returning a mapping "
        "as 'path/key'); rename one of them so that no value is lost."
    )


def flatten_summaries(summaries: object, *, where: str) -> dict[str, Any]:
    """Return `{path: leaf}` with "/"-joined paths; per-iteration children expanded.

    Each stacked array is fetched to the host once and indexed there.

    Raises:
        TypeError: if `summaries` is neither an `OutputCollection` nor a mapping (of
            summaries and `OutputCollection`s, whose summaries are written under
            their key), or a leaf is not a valid summary leaf (naming its path).
        ValueError: if a name is empty, not a string or contains "/", or if two
            entries get the same path (e.g. `{"a/b": 1}` and `{"a": {"b": 2}}`, or
            a per-iteration child `iter0` next to a scan's `iter`); the message
            names the path. No value is ever dropped silently.
    """
    tree = summary_tree(summaries, where=where)
    out: dict[str, Any] = {}

    def put(path: str, leaf: Any) -> None:
        if path in out:
            raise _collision(path, where=where)
        out[path] = leaf

    flatten_into(put, tree, "", "/")
    return out


def check_step(step: object, *, where: str) -> int:
    """Return `step` as an `int`, or raise naming `where`.

    Raises:
        TypeError: if `step` is not an integer (a `bool` is not one).
        ValueError: if `step` is negative.
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
    return value


def _expand(path: str, value: Any, *, where: str) -> Iterator[tuple[str, Any]]:
    """Yield `(path, value)`; a mapping (a `CallbackSummary` result) is expanded."""
    if isinstance(value, Mapping):
        for key, sub in value.items():
            name = check_summary_name(key, f"{path}/", where=where)
            yield from _expand(f"{path}/{name}", sub, where=where)
    else:
        yield path, value


def host_values(flat: Mapping[str, Any], *, where: str) -> dict[str, np.ndarray]:
    """Return `{path: numpy array}` of each leaf's `leaf_value`, fetched at once.

    `CallbackSummary` functions run here, on the host. A value that is a mapping is
    expanded into `path/key` entries.

    Raises:
        TypeError: if a value is not numeric (bool, integer or floating); the message
            names the path.
        ValueError: if an expanded `path/key` is the path of another summary, or a
            key is not a valid name (the message names the path).
        RuntimeError: if a value is a JAX array that this process cannot read (a
            multi-host array); fetch it with `eqxctx.to_host` first.
    """
    values: dict[str, Any] = {}
    for path, leaf in flat.items():
        for sub, value in _expand(path, leaf_value(leaf), where=where):
            if sub in values:
                raise _collision(sub, where=where)
            values[sub] = value
    try:
        fetched = jax.device_get(values)
    except RuntimeError as e:
        raise RuntimeError(
            f"`{where}`: could not fetch the summaries to this host ({e}). For arrays "
            "sharded across processes, write `eqxctx.to_host(summaries)` instead."
        ) from e
    out: dict[str, np.ndarray] = {}
    for path in values:  # `device_get` sorts the keys; keep the summaries' order.
        arr = np.asarray(fetched[path])
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
        out[path] = arr
    return out


_W = TypeVar("_W", bound="AbstractWriter")


class AbstractWriter(abc.ABC):
    """A summary writer: `write(step, summaries)`, `flush()`, `close()`.

    Writers are context managers (`with JsonlWriter(path) as w: ...` closes `w`) and
    work from any training loop: pass the summaries of an `OutputCollection` (from
    `eqxctx.functional`, a `MethodRunner` output or a `SummaryAccumulator`) after
    each step. They read each leaf's `Summary.value()` (raw arrays as they are) on
    the host.
    """

    @abc.abstractmethod
    def write(self, step: Step, summaries: Summaries) -> None:
        """Write the summaries of one step."""

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

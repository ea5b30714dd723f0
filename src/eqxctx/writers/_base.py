"""The writer interface and the shared step: flatten summaries, fetch their values."""

import abc
import functools
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
        if type(leaf) in _HOST_SCALARS:  # per-iteration views: no checks to make
            values[path] = leaf
            continue
        value = leaf_value(leaf)
        if isinstance(value, Mapping):
            for sub, v in _expand(path, value, where=where):
                if sub in values:
                    raise _collision(sub, where=where)
                values[sub] = v
        elif path in values:
            raise _collision(path, where=where)
        else:
            values[path] = value
    # Fetch the device arrays at once; host values (NumPy, Python numbers, the
    # per-iteration views) need no transfer.
    on_device = [
        path
        for path, v in values.items()
        if type(v) not in _HOST_SCALARS and isinstance(v, jax.Array)
    ]
    try:
        fetched = jax.device_get([values[path] for path in on_device])
    except RuntimeError as e:
        raise RuntimeError(
            f"`{where}`: could not fetch the summaries to this host ({e}). For arrays "
            "sharded across processes, write `eqxctx.to_host(summaries)` instead."
        ) from e
    values.update(zip(on_device, fetched, strict=True))
    out: dict[str, np.ndarray] = {}
    for path, value in values.items():
        arr = value if type(value) is np.ndarray else np.asarray(value)
        problem = _dtype_problem(arr.dtype)
        if problem is not None:
            raise TypeError(f"`{where}`: the summary at {path!r} {problem}")
        out[path] = arr
    return out


_HOST_SCALARS = frozenset(
    {np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64}
    | {np.uint8, np.uint16, np.uint32, np.uint64, np.bool_}
)


@functools.cache
def _dtype_problem(dtype: np.dtype[Any]) -> str | None:
    """Why writers refuse values of `dtype`, or None (cached: one check per dtype)."""
    if not (dtype == np.bool_ or jax.numpy.issubdtype(dtype, np.number)):
        return f"has dtype {dtype}; writers accept bool, integer and floating values."
    if jax.numpy.issubdtype(dtype, np.complexfloating):
        return (
            f"is complex ({dtype}); write its real and imaginary parts (or its "
            "absolute value) instead."
        )
    return None


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

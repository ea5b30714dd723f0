"""SummaryBuffer: the summaries of up to N steps, stacked on the device.

A training step adds its summaries as one row of its buffer (the way a scan stacks
its per-iteration summaries), inside the jitted step; a writer fetches the whole
buffer with one transfer per width of raw bits (`_fetch.start_owned`) and writes
each row as the step it was. Each structure of summaries (a summary level's step
and another level's) has its own rows; which structure and which step each row
holds is recorded on the device too, so the rows are written in the order they
were added.

A structure's rows are packed: one `[N, K]` array per dtype, `K` the total size of
that dtype's leaves, so that a step's summaries are a handful of the jitted step's
inputs and outputs, each written by one concatenation and one dynamic-update-slice
(`_layout.py`). The host reads each leaf's `[N, ...]` column as a NumPy view of its
packed array.
"""

from collections.abc import Hashable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jaxtyping import Array, ArrayLike, Int

from eqxctx._checks import check_positive_int
from eqxctx._summary_tree import summary_tree
from eqxctx._transfer import to_host

from ._fetch import Started, finish, start_owned
from ._layout import (
    Layout,
    is_stacked,
    layout_of,
    like_trees,
    packed_row,
    replicated,
    shapes,
    step_dtype,
    zeros,
)


class SummaryBuffer(eqx.Module):
    """The summaries of up to `size` steps, stacked on the device.

    A functional value, like an optimizer state: create it once, carry it through
    the jitted training step (in the train state, or as an argument that the step
    returns), add each step's summaries there with `add`, and hand it to a writer's
    `write_buffer` every `size` steps and once at the end. The writer fetches the
    whole buffer in one transfer per width of raw bits and writes each step as
    `writer.write(step, summaries)` would have: the same JSON lines, TensorBoard
    events and W&B rows. `write_buffer` returns the buffer emptied (the same
    arrays: donating the buffer to the step updates them in place).

    ```python
    buffer = SummaryBuffer.create(32)
    with AsyncWriter(JsonlWriter(path)) as writer:
        try:
            for step in range(num_steps):
                state, buffer = train_step(state, buffer, batch, step)
                if (step + 1) % buffer.size == 0:
                    buffer = writer.write_buffer(buffer)
        finally:  # also on an exception or Ctrl-C: every step added is written
            buffer = writer.write_buffer(buffer)
    ```

    where `train_step` (under `jax.jit` / `eqx.filter_jit`) ends with
    `buffer = buffer.add(step, {"train": collection})`. Pass the step as an array
    (`jnp.asarray(step)`, or a counter in the train state): `eqx.filter_jit` makes a
    Python int static and would compile the step once per value.

    Each structure of summaries has its own rows, so steps of different summary
    levels (a cheap step and a full one) share a buffer; the rows keep the order
    in which steps were added. A structure first added inside a jitted step
    changes the buffer's structure, so that step is traced once more;
    `create(size, like)` reserves the rows of known structures up front. Python
    numbers among the summaries are stored as arrays, as `jax.jit` returns them
    (a float as float32). A structure's rows are packed into one `[size, K]`
    array per dtype (`K`: the number of elements of that dtype in one step's
    summaries; bfloat16, 8-bit float and other unusual leaves one `[size,
    *shape]` array each), so the jitted step gets a few more inputs and outputs,
    not one per summary leaf, each updated by one dynamic-update-slice. Memory:
    `size` times the bytes of one step's summaries per structure, plus the
    bookkeeping (`marks`: `2 * (size + 1)` int32, int64 with `jax_enable_x64`).
    Under Explicit mesh axes (summaries of a batch sharded over a mesh) the rows
    are replicated on that mesh.

    Adding to a full buffer overwrites its last row; the writer then writes what
    the buffer holds and raises a `ValueError` saying how many steps were lost.
    A buffer donated to a step that fails at run time (an `eqx.error_if`) is
    deleted by JAX with the steps it held: the `finally` above cannot write them.

    Attributes:
        size: the number of rows N (steps the buffer holds), static.
        layouts: the structures of summaries the buffer has rows for, static.
        packed: per structure, its arrays: one `[size, K]` array per dtype
            (each row: the step's leaves of that dtype raveled and concatenated,
            in the order of the summaries' leaves), traced.
        rows: per structure, its array leaves stacked `[size, *shape]` (a
            property: slices of `packed`).
        marks: `int32[2, size + 1]` (int64 with `jax_enable_x64`): column `i <
            size` holds row `i`'s step and structure (index into `layouts`),
            `marks[0, size]` the count; read them as `steps`, `slots` and
            `count`. One array, so that the bookkeeping is one input and output
            of the step (its short axis first: a TPU pads the last axis to 128).
        steps: `int32[size]` (int64 with `jax_enable_x64`), each row's step
            (a property: a slice of `marks`).
        slots: `int32[size]`, the structure of each row (a property).
        count: `int32[]`, the number of steps added since the buffer was created
            or emptied (rows `0 .. min(count, size) - 1` hold steps; a property).
    """

    size: int = eqx.field(static=True)
    layouts: tuple[Layout, ...] = eqx.field(static=True)
    packed: tuple[tuple[Array, ...], ...]
    marks: Int[Array, "2 size_plus_1"]

    @classmethod
    def create(cls, size: object, *like: object) -> "SummaryBuffer":
        """Return an empty buffer of `size` rows, with rows for the structures `like`.

        Args:
            size: the number of steps held, an int >= 1.
            *like: summaries (as `add` takes them) whose structures get rows now:
                e.g. `jax.eval_shape` of the step's summaries (abstract leaves are
                fine). A structure not given gets its rows at its first `add`.

        Raises:
            TypeError: if `size` is not an int.
            ValueError: if `size` is less than 1.

        Examples:
            >>> buffer = SummaryBuffer.create(4)
            >>> buffer = buffer.add(0, {"loss": jnp.float32(0.5)})
            >>> buffer.rows[0][0].shape, int(buffer.count)
            ((4,), 1)
        """
        n = check_positive_int(
            size,
            where="SummaryBuffer.create(size)",
            name="size",
            meaning="the steps the buffer holds",
        )
        layouts: list[Layout] = []
        for summaries in like:
            layout = layout_of(like_trees(summaries), "SummaryBuffer.create(like)")[0]
            if layout not in layouts:
                layouts.append(layout)
        return cls(
            n,
            tuple(layouts),
            tuple(zeros(layout, n) for layout in layouts),
            jnp.zeros((2, n + 1), step_dtype()),
        )

    def add(self, step: ArrayLike, summaries: object) -> "SummaryBuffer":
        """Return the buffer with one more step: `summaries` as the next row.

        Inside a jitted step or outside; `self` is unchanged. The row is written
        with `jax.lax.dynamic_update_index_in_dim` (in place when the buffer is
        donated).

        Args:
            step: the step number, an integer scalar (an array, traced or not, or
                a Python int), below 2**31 unless `jax_enable_x64` is on (the
                buffer stores it as int32; a larger one wraps around).
            summaries: what `AbstractWriter.write` takes: an `OutputCollection`
                (its summaries) or a nested mapping of summaries and
                `OutputCollection`s (`{"train": collection}`).

        Returns:
            A new `SummaryBuffer`; a structure not seen before gets its rows (and
            the buffer a new structure, `layouts`).

        Raises:
            TypeError: for a step that is not an integer scalar, or summaries that
                are not summaries (naming the leaf's path).
            ValueError: for an invalid summary name (naming it), or a Python int
                step above what the buffer stores.
        """
        where = "SummaryBuffer.add"
        if isinstance(step, int) and not isinstance(step, bool):
            stored = np.dtype(step_dtype())
            most = int(np.iinfo(stored).max)
            if step > most:  # (JAX would raise an OverflowError naming no step)
                raise ValueError(
                    f"`{where}(step, summaries)`: step {step} is above {most}, the "
                    f"largest the buffer stores ({stored}); turn on "
                    "`jax_enable_x64` for int64 steps."
                )
        step_array = jnp.asarray(step)
        if step_array.ndim != 0 or not jnp.issubdtype(step_array.dtype, jnp.integer):
            raise TypeError(
                f"`{where}(step, summaries)`: step must be an integer scalar, got "
                f"{step_array.dtype}{list(step_array.shape)}."
            )
        layout, leaves = layout_of(summary_tree(summaries, where=where), where)
        layouts, packed = self.layouts, self.packed
        if layout in layouts:
            k = layouts.index(layout)
        else:
            k = len(layouts)
            layouts += (layout,)
            packed += (zeros(layout, self.size),)
        marks = self.marks
        count = marks[0, self.size]
        i = jnp.minimum(count, self.size - 1)
        arrays = [x for x in leaves if is_stacked(x)]
        update = jax.lax.dynamic_update_index_in_dim
        row = tuple(
            update(*replicated([p, packed_row(pack, arrays)]), i, 0)
            for p, pack in zip(packed[k], layout.packs, strict=True)
        )
        dtype = marks.dtype
        mark = jnp.stack([step_array.astype(dtype), jnp.asarray(k, dtype)])
        marks, mark = replicated([marks, mark])
        marks = update(marks, mark, i, 1)  # row i's step and structure
        counted = (count + 1).reshape(1, 1)
        marks = jax.lax.dynamic_update_slice(marks, counted, (0, self.size))
        return SummaryBuffer(
            self.size, layouts, (*packed[:k], row, *packed[k + 1 :]), marks
        )

    @property
    def rows(self) -> tuple[tuple[Array, ...], ...]:
        """Per structure, its array leaves stacked `[size, *shape]` (read only).

        Slices of `packed`, in the order of the structure's array leaves.
        """
        return tuple(
            tuple(layout.unpack(arrays, self.size))
            for layout, arrays in zip(self.layouts, self.packed, strict=True)
        )

    @property
    def steps(self) -> Int[Array, " size"]:
        """Each row's step (`int32[size]`, int64 with `jax_enable_x64`)."""
        return self.marks[0, : self.size]

    @property
    def slots(self) -> Int[Array, " size"]:
        """Each row's structure, an index into `layouts` (`int32[size]`)."""
        return self.marks[1, : self.size].astype(jnp.int32)

    @property
    def count(self) -> Int[Array, ""]:
        """The number of steps added since the buffer was created or emptied."""
        return self.marks[0, self.size].astype(jnp.int32)

    def cleared(self) -> "SummaryBuffer":
        """Return the buffer emptied (`count` 0), with the same row arrays."""
        return _with_marks(self, jnp.zeros_like(self.marks))


def _with_marks(buffer: SummaryBuffer, marks: Array) -> SummaryBuffer:
    """`buffer` with other `marks` (the same row arrays)."""
    # Rebuilt from its leaves: `write_buffer` empties the buffer on the training
    # thread every `size` steps, and a Module's `__init__` is slower than an
    # unflatten.
    leaves, treedef = jax.tree_util.tree_flatten(buffer)
    assert leaves[-1] is buffer.marks  # the last field
    return jax.tree_util.tree_unflatten(treedef, [*leaves[:-1], marks])


class BufferFetch(NamedTuple):
    """A buffer whose copy to the host has started (`start_fetch`).

    Attributes:
        layouts: the buffer's structures.
        size: its number of rows.
        started: the fetch of `[marks, *packed]`, or None where
            `host` holds them already (several processes).
        host: the fetched arrays, or None.
        zero: the emptied buffer's marks (zeros made by the copy), or None.
    """

    layouts: tuple[Layout, ...]
    size: int
    started: Started | None
    host: list[Any] | None
    zero: Array | None = None


def _arrays(buffer: SummaryBuffer, where: str) -> list[jax.Array]:
    arrays = [buffer.marks]
    arrays += [x for packed in buffer.packed for x in packed]
    for x in arrays:
        if isinstance(x, Tracer):
            raise TypeError(
                f"`{where}`: the buffer holds tracers: write it outside the jitted "
                "step (return it from the step, then pass it to `write_buffer`)."
            )
    if any(x.is_deleted() for x in arrays):
        raise ValueError(
            f"`{where}`: the buffer's arrays were deleted: it was donated to a jitted "
            "step (`donate_argnums`) and this is the buffer passed in, not the one "
            "the step returned. If that step failed (e.g. an `eqx.error_if` or "
            "`jax_debug_nans` at run time), the steps the buffer held are lost with "
            "it: do not donate the buffer where they matter."
        )
    want = [(2, buffer.size + 1)]
    want += [
        shape for layout in buffer.layouts for shape in shapes(layout, buffer.size)
    ]
    for x, shape in zip(arrays, want, strict=True):
        if x.shape != shape:
            raise ValueError(
                f"`{where}`: the buffer's arrays have shape {x.shape}, expected "
                f"{shape}: a buffer returned by `jax.vmap` (or stacked) holds one "
                "buffer per batch entry. Add the summaries outside the vmap (merge "
                "them there), or write each buffer: "
                "`jax.tree.map(lambda x: x[i], buffer)`."
            )
    return arrays


# `buffer: object`: checked here, with a message naming `where`.
def start_fetch(buffer: object, *, where: str) -> BufferFetch:
    """Start copying `buffer` to the host; the buffer may be donated after this.

    One process: one jitted copy of the buffer into one flat array per width of
    raw bits (and a copy of each array of another dtype), whose transfers start
    here and are read by `buffer_rows`. Several processes: fetched here with
    `eqxctx.to_host` (a collective).

    Raises:
        TypeError: if `buffer` is not a `SummaryBuffer` or holds tracers.
        ValueError: if its arrays do not have the buffer's shapes (a buffer
            batched by `jax.vmap`) or were deleted (donated).
    """
    if not isinstance(buffer, SummaryBuffer):
        raise TypeError(
            f"`{where}`: expected a `SummaryBuffer` (from `SummaryBuffer.create`), "
            f"got {type(buffer).__name__}."
        )
    arrays = _arrays(buffer, where)
    if jax.process_count() > 1:
        return BufferFetch(buffer.layouts, buffer.size, None, list(to_host(arrays)))
    signature: Hashable = (
        buffer.size,
        buffer.layouts,
        tuple(x.sharding for x in arrays),
    )
    started, zeros = start_owned(arrays, signature, zeros=(0,))  # 0: the marks
    return BufferFetch(
        buffer.layouts, buffer.size, started, None, zeros[0] if zeros else None
    )


def emptied(buffer: SummaryBuffer, fetch: BufferFetch) -> SummaryBuffer:
    """`buffer.cleared()`, with the zero marks made by its fetch where there are.

    (The calling thread then dispatches nothing but the buffer's copy.)
    """
    return buffer.cleared() if fetch.zero is None else _with_marks(buffer, fetch.zero)


class BufferRows(NamedTuple):
    """A fetched buffer: the steps it holds, in the added order, as NumPy columns.

    Attributes:
        steps: each row's step.
        slots: each row's structure (an index into `layouts`).
        layouts: the buffer's structures.
        tables: per structure, its array leaves `[size, ...]` (NumPy views of
            its packed arrays; row `i` of a structure's table is meaningful
            where `slots[i]` is that structure).
        lost: the number of steps added after the buffer was full.
    """

    steps: list[int]
    slots: list[int]
    layouts: tuple[Layout, ...]
    tables: list[list[np.ndarray]]
    lost: int

    @property
    def rows(self) -> list[tuple[int, list[Any], Layout]]:
        """`(step, leaves, layout)` per row: the leaves of its summaries (views).

        `layout.treedef.unflatten(leaves)` is the row's summaries.
        """
        return [
            (
                step,
                self.layouts[k].row_leaves([x[i, ...] for x in self.tables[k]]),
                self.layouts[k],
            )
            for i, (step, k) in enumerate(zip(self.steps, self.slots, strict=True))
        ]

    def columns(self, k: int) -> tuple[list[int], list[Any]]:
        """The rows of structure `k`: their positions and its leaves' columns.

        Each leaf as `layout.leaves` lists it: an array leaf stacked `[n, ...]`
        over the `n` rows (a view where they are the first `n`), a static leaf as
        it is (`Layout.arrays` says which).
        """
        positions = [i for i, s in enumerate(self.slots) if s == k]
        n = len(positions)
        if positions == list(range(n)):
            arrays = [x[:n] for x in self.tables[k]]
        else:
            index = np.asarray(positions)
            arrays = [x[index] for x in self.tables[k]]
        return positions, self.layouts[k].row_leaves(arrays)


def buffer_rows(fetch: BufferFetch) -> BufferRows:
    """Read a started fetch (waiting for the device): the steps it holds.

    Raises:
        Exception: what `jax.device_get` raises (e.g. for a deleted array).
    """
    host = fetch.host if fetch.started is None else finish(fetch.started)
    assert host is not None
    marks = np.asarray(host[0])
    count = int(marks[0, fetch.size])
    steps, slots = marks[0, : fetch.size], marks[1, : fetch.size]
    tables: list[list[np.ndarray]] = []
    start = 1
    for layout in fetch.layouts:
        stop = start + len(layout.packs)
        host_arrays = [np.asarray(x) for x in host[start:stop]]
        tables.append(layout.unpack(host_arrays, fetch.size))
        start = stop
    n = min(count, fetch.size)
    return BufferRows(
        steps[:n].tolist(), slots[:n].tolist(), fetch.layouts, tables, count - n
    )

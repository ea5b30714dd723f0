"""A buffer's rows are read column-wise: each summary once per buffer, not per row.

`write_buffer` replays a structure's recipe over the `[n, ...]` columns of its rows
(issue 39): a kind whose `host_value` is elementwise (`rowwise_host_value`) is
validated and read once per buffer, other kinds once per row. The reference is the
per-row read of the same rows (`prefetched_rows`, each row's recipe replayed) and
the same summaries written step by step.
"""

import collections
import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqxctx
import eqxctx.writers._jsonl as writers_jsonl
import eqxctx.writers._read as writers_read
from eqxctx.writers import (
    AsyncWriter,
    Histogram,
    JsonlWriter,
    SummaryBuffer,
    TensorBoardWriter,
)
from eqxctx.writers._buffer import buffer_rows, start_fetch
from eqxctx.writers._columns import buffer_values, prefetched_rows
from eqxctx.writers._host import HostValues, Rows
from tb_events import read_events


_CALLS: collections.Counter[str] = collections.Counter()


class _Doubled(eqxctx.Summary):
    """A user's kind whose `host_value` is elementwise (`rowwise_host_value`)."""

    x: jax.Array
    rowwise_host_value: ClassVar[bool] = True

    def value(self) -> jax.Array:
        return self.x * 2

    def accumulate(self, other: Any) -> "_Doubled":
        return _Doubled(self.x + other.x)

    def validate(self) -> None:
        _CALLS["validate"] += 1
        if not isinstance(self.x, Tracer) and bool((self.x > 100).any()):
            raise ValueError("x must be at most 100")

    def host_value(self) -> dict[str, np.ndarray]:
        _CALLS["host_value"] += 1
        x = np.asarray(self.x)
        return {"twice": x * np.float32(2), "negated": -x}


class _Buckets(eqxctx.Summary):
    """A user's kind read row by row: a `Histogram` record."""

    counts: jax.Array

    def value(self) -> jax.Array:
        return self.counts

    def accumulate(self, other: Any) -> "_Buckets":
        return _Buckets(self.counts + other.counts)

    def host_value(self) -> Histogram:
        _CALLS["buckets"] += 1
        counts = np.asarray(self.counts).astype(np.int64)
        return Histogram(counts, (0.0, 1.0, 2.0, 3.0))


def _summaries(
    i: jax.Array, vector_mean: bool = False, level: int | None = None
) -> dict[str, Any]:
    x = i.astype(jnp.float32)
    v = jnp.cos(x + jnp.arange(3.0, dtype=jnp.float32))
    ctx = eqxctx.Context.root(summary_level=level)
    ctx = ctx.add_summary("doubled", _Doubled(v * 10.0 + x), level=1)
    ctx = ctx.add_summary(
        "buckets", _Buckets(jnp.abs(v * 4).astype(jnp.int32)), level=1
    )
    mean = v if vector_mean else v[0]  # a vector mean with a scalar weight
    ctx = ctx.add_summary("loss", eqxctx.WeightedSummary(mean, x + 1.0))
    ctx = ctx.add_summary("moments", eqxctx.MomentsSummary(v * x))
    ctx = ctx.add_summary("raw", v[1])
    ctx = ctx.add_summary("count", i * 2)
    ctx = ctx.add_summary("flag", v[2] > 0)
    ctx = ctx.add_summary("const", 0.25)  # a Python number: static in the buffer
    ctx = ctx.add_summary("min", eqxctx.MinSummary(v))
    ctx = ctx.add_summary("sum", eqxctx.SumSummary(v.sum()))
    ctx = ctx.add_summary("hist", eqxctx.HistogramSummary(v, bins=4, range=(-1, 1)))
    image = jnp.abs(jnp.sin(x + jnp.arange(2 * 3 * 4.0))).reshape(2, 3, 4)
    ctx = ctx.add_summary("image", eqxctx.ImageSummary(image))
    audio = jnp.sin(x + jnp.arange(8.0)) * 0.5
    ctx = ctx.add_summary("audio", eqxctx.AudioSummary(audio, sample_rate=8000))

    def body(c: jax.Array, y: jax.Array, ctx: eqxctx.Context) -> Any:
        ctx = ctx.add_summary("y", _Doubled(y * x))
        ctx = ctx.add_summary("w", eqxctx.WeightedSummary(y, jnp.abs(y)))
        ctx = ctx.add_summary("vec", y * jnp.arange(2.0))  # rows `[n, 3, 2]`
        return c + y, None, ctx

    _, _, scanned = eqxctx.scan_in_context(
        body, context=ctx, carry=x, xs=v, child_name_prefix="layer"
    )
    return {"train": ctx.merge(scanned).collection}


@jax.jit
def _step(buffer: SummaryBuffer, i: jax.Array) -> Any:
    summaries = _summaries(i)
    return buffer.add(i, summaries), summaries


@jax.jit
def _vector_step(buffer: SummaryBuffer, i: jax.Array) -> Any:
    summaries = _summaries(i, vector_mean=True)
    return buffer.add(i, summaries), summaries


def _same_values(got: HostValues, want: HostValues) -> None:
    assert len(got.parts) == len(want.parts)
    for g, w in zip(got.parts, want.parts, strict=True):
        assert type(g) is type(w)
        if isinstance(g, Rows) and isinstance(w, Rows):
            assert g.paths == w.paths
            pairs = list(zip(g.columns, w.columns, strict=True))
        else:
            assert isinstance(g, dict)
            assert isinstance(w, dict)
            assert list(g) == list(w)
            pairs = list(zip(g.values(), w.values(), strict=True))
        for a, b in pairs:
            la, ta = jax.tree_util.tree_flatten(a)
            lb, tb = jax.tree_util.tree_flatten(b)
            assert type(a) is type(b)
            assert ta == tb
            for p, q in zip(la, lb, strict=True):
                assert type(p) is np.ndarray
                assert type(q) is np.ndarray
                assert (p.dtype, p.shape) == (q.dtype, q.shape)
                assert p.tobytes() == q.tobytes()


def _buffer(
    step_fn: Any, steps: Sequence[int], size: int
) -> tuple[SummaryBuffer, list[Any]]:
    buffer = SummaryBuffer.create(size)
    outs = []
    for step in steps:
        buffer, out = step_fn(buffer, jnp.int32(step))
        outs.append(out)
    return buffer, outs


def test_columns_equal_rows_read_one_by_one() -> None:
    writers_read._RECIPES.clear()  # pyright: ignore[reportPrivateUsage]
    buffer, _ = _buffer(_step, range(5), 8)  # a partial buffer
    fetched = buffer_rows(start_fetch(buffer, where="test"))
    assert buffer_values(fetched, where="test") is None  # no recipe yet
    want = [
        writers_read.host_values(rows, where="test")
        for _, rows in prefetched_rows(fetched)
    ]
    got = buffer_values(fetched, where="test")
    assert got is not None
    assert len(got) == len(want) == 5
    for g, w in zip(got, want, strict=True):
        assert g.layout is want[-1].layout is not None  # the recipe (writers' caches)
        _same_values(g, w)
    assert want[0].layout is None  # (read in full: it made the recipe)


def test_a_buffer_reads_a_rowwise_kind_once(tmp_path: Path) -> None:
    # issue 39 (the buffer's host work): each row replayed every summary's read.
    size = 8
    writers_read._RECIPES.clear()  # pyright: ignore[reportPrivateUsage]
    first, outs = _buffer(_step, range(size), size)
    second, more = _buffer(_step, range(size, 2 * size), size)
    with JsonlWriter(tmp_path / "s.jsonl") as reference:
        for step, out in enumerate(outs + more):
            reference.write(step, out)
    with JsonlWriter(tmp_path / "b.jsonl") as writer:
        writer.write_buffer(first)  # read row by row: the recipe is made
        _CALLS.clear()
        writer.write_buffer(second)
    # 2 `_Doubled` entries (one of them a scan's stacked rows), each read once for
    # the 8 rows and validated twice (its check, its read); the `_Buckets` record
    # once per row.
    assert dict(_CALLS) == {"validate": 4, "host_value": 2, "buckets": size}
    got = (tmp_path / "b.jsonl").read_bytes()
    assert got == (tmp_path / "s.jsonl").read_bytes()
    assert len(got.splitlines()) == 2 * size


def test_a_stacked_check_that_refuses_is_made_row_by_row(tmp_path: Path) -> None:
    # A `WeightedSummary` of a vector mean and a scalar weight: stacked, the
    # weights `[n]` and means `[n, 3]` fail `validate()`; each row passes.
    writers_read._RECIPES.clear()  # pyright: ignore[reportPrivateUsage]
    buffers = [_buffer(_vector_step, range(k, k + 4), 4) for k in (0, 4)]
    with JsonlWriter(tmp_path / "s.jsonl") as reference:
        for step, out in enumerate(buffers[0][1] + buffers[1][1]):
            reference.write(step, out)
    with JsonlWriter(tmp_path / "b.jsonl") as writer:
        for buffer, _ in buffers:
            writer.write_buffer(buffer)
    assert (tmp_path / "b.jsonl").read_bytes() == (tmp_path / "s.jsonl").read_bytes()


def test_an_invalid_row_raises_as_its_step_would(tmp_path: Path) -> None:
    writers_read._RECIPES.clear()  # pyright: ignore[reportPrivateUsage]
    good, _ = _buffer(_step, range(4), 4)
    bad, outs = _buffer(_step, [4, 5, 95, 7], 4)  # step 95: `_Doubled` x > 100
    message = r"the summary at 'train/doubled': x must be at most 100"
    with (
        JsonlWriter(tmp_path / "s.jsonl") as reference,
        pytest.raises(ValueError, match=message) as want,
    ):
        reference.write(95, outs[2])
    with JsonlWriter(tmp_path / "b.jsonl") as writer:
        writer.write_buffer(good)
        with pytest.raises(ValueError, match=message) as got:
            writer.write_buffer(bad)
    assert str(got.value) == str(want.value)
    # Nothing of the invalid buffer is written: the steps are checked first.
    assert len((tmp_path / "b.jsonl").read_bytes().splitlines()) == 4


def _events(logdir: Path) -> list[tuple[int, str, bytes]]:
    """Every summary value as (step, tag, serialized value): no wall times."""
    return [
        (event.step, value.tag, value.SerializeToString())  # pyright: ignore[reportAttributeAccessIssue]
        for event in read_events(str(logdir))
        if event.HasField("summary")
        for value in event.summary.value
    ]


def test_buffered_tensorboard_events_equal_step_by_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    writers_read._RECIPES.clear()  # pyright: ignore[reportPrivateUsage]
    buffers = [_buffer(_step, range(k, k + 5), 5) for k in (0, 5, 10)]
    with TensorBoardWriter(tmp_path / "s") as reference:
        for step, out in enumerate(o for _, outs in buffers for o in outs):
            reference.write(step, out)
    with TensorBoardWriter(tmp_path / "b") as writer:
        for buffer, _ in buffers:  # the first read row by row, then column-wise
            writer.write_buffer(buffer)
    got, want = _events(tmp_path / "b"), _events(tmp_path / "s")
    assert got == want
    assert sorted({step for step, _, _ in got}) == list(range(15))


def test_a_buffer_reads_each_histogram_once(monkeypatch: pytest.MonkeyPatch) -> None:
    writers_read._RECIPES.clear()  # pyright: ignore[reportPrivateUsage]
    first, _ = _buffer(_step, range(4), 4)
    second, _ = _buffer(_step, range(4, 8), 4)
    with JsonlWriter(os.devnull) as writer:
        writer.write_buffer(first)
        calls: list[tuple[int, ...]] = []
        real = eqxctx.HistogramSummary.host_value

        def counting(self: eqxctx.HistogramSummary) -> Any:
            calls.append(np.shape(self.counts_low))
            return real(self)

        monkeypatch.setattr(eqxctx.HistogramSummary, "host_value", counting)
        writer.write_buffer(second)
    assert calls == [(4, 4)]  # the 4 rows' 4 buckets, read once


def test_jsonl_formats_a_buffers_rows_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # issue 39: each row's line converted every value alone.
    writers_read._RECIPES.clear()  # pyright: ignore[reportPrivateUsage]
    first, outs = _buffer(_step, range(6), 6)
    second, more = _buffer(_step, range(6, 12), 6)
    blocks: list[int] = []
    real = writers_jsonl._block_values  # pyright: ignore[reportPrivateUsage]

    def counting(block: Any) -> Any:
        blocks.append(block.n)
        return real(block)

    monkeypatch.setattr(writers_jsonl, "_block_values", counting)
    with JsonlWriter(tmp_path / "s.jsonl") as reference:
        for step, out in enumerate(outs + more):
            reference.write(step, out)
    with JsonlWriter(tmp_path / "b.jsonl") as writer:
        writer.write_buffer(first)  # row by row (the recipe is made)
        writer.write_buffer(second)
    assert blocks == [6]  # the second buffer's 6 rows, converted once
    assert (tmp_path / "b.jsonl").read_bytes() == (tmp_path / "s.jsonl").read_bytes()


@functools.cache
def _level_step(level: int) -> Any:
    @jax.jit
    def step(buffer: SummaryBuffer, i: jax.Array) -> Any:
        summaries = _summaries(i, level=level)
        return buffer.add(i, summaries), summaries

    return step


def test_alternating_levels_are_read_column_wise(tmp_path: Path) -> None:
    # A cheap step (level 0) and a full step (level 1) alternate: each structure's
    # rows are every other row of the buffer. 16 steps: 6, 6 and a partial 4.
    writers_read._RECIPES.clear()  # pyright: ignore[reportPrivateUsage]
    buffer = SummaryBuffer.create(6)
    buffers: list[SummaryBuffer] = []
    with JsonlWriter(tmp_path / "s.jsonl") as reference:
        for step in range(16):
            buffer, out = _level_step(step % 2)(buffer, jnp.int32(step))
            reference.write(step, out)
            if (step + 1) % 6 == 0 or step == 15:
                buffers.append(buffer)
                buffer = SummaryBuffer.create(6)
    with JsonlWriter(tmp_path / "b.jsonl") as writer:
        writer.write_buffer(buffers[0])  # row by row: the recipes are made
        for later in buffers[1:]:
            fetched = buffer_rows(start_fetch(later, where="test"))
            assert fetched.slots == [0, 1] * (len(fetched.steps) // 2)
            assert buffer_values(fetched, where="test") is not None
            writer.write_buffer(later)
    got = (tmp_path / "b.jsonl").read_bytes()
    assert got == (tmp_path / "s.jsonl").read_bytes()
    lines = got.decode().splitlines()
    assert len(lines) == 16
    assert '"train/doubled/twice"' in lines[1]
    assert '"train/doubled/twice"' not in lines[0]


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (simulated) devices")
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_buffer_of_summaries_sharded_over_a_mesh(
    tmp_path: Path, axis_type: AxisType
) -> None:
    # Under `jax.make_mesh`'s default (Explicit axes) a per-example summary sharded
    # over "data" beside replicated scalars made a row of mixed shardings, which
    # `jnp.concatenate` refused. The file equals writing each step.
    mesh = jax.make_mesh((2,), ("data",), axis_types=(axis_type,))

    def summaries(x: jax.Array) -> dict[str, Any]:
        return {
            "loss": jnp.mean(x),
            "per_example": 2 * x,
            "moments": eqxctx.MomentsSummary(x),
        }

    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
        like = jax.eval_shape(summaries, x)
        buffer = SummaryBuffer.create(4, {"train": like})
        add = jax.jit(lambda b, x, i: b.add(i, {"train": summaries(x)}))
        expected = JsonlWriter(tmp_path / "steps.jsonl")
        for i in range(3):
            buffer = add(buffer, x + i, jnp.int32(i))
            expected.write(i, {"train": jax.jit(summaries)(x + i)})
        expected.close()
        with AsyncWriter(JsonlWriter(tmp_path / "buffer.jsonl")) as writer:
            buffer = writer.write_buffer(buffer)
    got = (tmp_path / "buffer.jsonl").read_bytes()
    assert got == (tmp_path / "steps.jsonl").read_bytes()
    assert got.count(b"\n") == 3
    assert b'"train/per_example":[2.0,4.0,6.0' in got

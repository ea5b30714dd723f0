"""TensorBoardWriter makes a buffer's rows column-wise (`_tb_rows.block_rows`).

The reference is `TensorBoardWriter.write` of each step alone: every event parsed
back from the event file (its step and summary values; no wall time) must equal
it, for every summary kind and dtype, partial buffers and alternating levels.
"""

import functools
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxctx
import eqxctx.writers._read as writers_read
import eqxctx.writers._tensorboard as writers_tensorboard
from eqxctx.writers import Histogram, SummaryBuffer, TensorBoardWriter
from tb_events import read_events


pytest.importorskip("tensorboardX")


class _BatchBuckets(eqxctx.Summary):
    """A user's elementwise kind: `Histogram` counts `[2, 3]` per row (added)."""

    counts: jax.Array
    rowwise_host_value: ClassVar[bool] = True

    def value(self) -> jax.Array:
        return self.counts

    def accumulate(self, other: Any) -> "_BatchBuckets":
        return _BatchBuckets(self.counts + other.counts)

    def host_value(self) -> Histogram:
        counts = np.asarray(self.counts).astype(np.int64)
        return Histogram(counts, (-np.inf, 0.0, 1.0, np.inf))


def _summaries(i: jax.Array, level: int) -> dict[str, Any]:
    """Every kind; raw scalars of each dtype; at level 0 only a histogram that
    counts nothing (NaN only) in every third row: no summary at all there."""
    x = i.astype(jnp.float32)
    v = jnp.sin(x + jnp.arange(6.0, dtype=jnp.float32)) * 3.0
    ctx = eqxctx.Context.root(summary_level=level)
    # Default buckets, open at +-inf: values beyond 1e20 land in the open ones.
    far = jnp.where(i % 3 == 1, jnp.nan, v * 1e21)
    ctx = ctx.add_summary("hist", eqxctx.HistogramSummary(far), level=0)
    counts = jnp.abs(v).reshape(2, 3).astype(jnp.int32) * (i % 2)
    image = jnp.abs(jnp.sin(x + jnp.arange(2 * 3 * 4.0))).reshape(2, 3, 4)
    audio = jnp.sin(x + jnp.arange(8.0)) * 0.5
    for name, value in {
        "loss": eqxctx.WeightedSummary(v[0], x + 1.0),
        "f16": v[1].astype(jnp.float16),
        "bf16": v[2].astype(jnp.bfloat16),
        "u8": (i * 7).astype(jnp.uint8),
        "big": jnp.int32(2**31 - 1) - i,  # rounded to float32
        "flag": v[3] > 0,
        "nan": jnp.where(i % 3 == 0, jnp.nan, jnp.inf * v[4]),
        "const": 0.25,  # stacked in the buffer (a Python number)
        "moments": eqxctx.MomentsSummary(v * x),
        "ranged": eqxctx.HistogramSummary(v, bins=5, range=(-2.0, 2.0)),
        "batched": _BatchBuckets(counts),  # nothing counted in even rows
        "vector": v[:4],  # a histogram per row
        "image": eqxctx.ImageSummary(image),
        "audio": eqxctx.AudioSummary(audio, sample_rate=8000),
    }.items():
        ctx = ctx.add_summary(name, value, level=1)

    def body(c: jax.Array, y: jax.Array, ctx: eqxctx.Context) -> Any:
        ctx = ctx.add_summary("y", y * x, level=1)
        ctx = ctx.add_summary("n", (y > 0).astype(jnp.int32), level=1)
        ctx = ctx.add_summary("w", eqxctx.WeightedSummary(y, jnp.abs(y)), level=1)
        return c + y, None, ctx

    _, _, scanned = eqxctx.scan_in_context(
        body, context=ctx, carry=x, xs=v[:3], child_name_prefix="layer"
    )

    def vectors(c: jax.Array, y: jax.Array, ctx: eqxctx.Context) -> Any:
        vec = y * jnp.arange(2.0)  # rows `[n, 3, 2]`
        return c, None, ctx.add_summary("vec", vec, level=1)

    _, _, rows = eqxctx.scan_in_context(
        vectors, context=ctx, carry=x, xs=v[3:], child_name_prefix="block"
    )
    return {"train": ctx.merge(scanned).merge(rows).collection}


@functools.cache
def _step(level: int) -> Any:
    @jax.jit
    def step(buffer: SummaryBuffer, i: jax.Array) -> Any:
        summaries = _summaries(i, level)
        return buffer.add(i, summaries), summaries

    return step


def _events(logdir: Path) -> list[tuple[int, bool, list[bytes]]]:
    """Each event after the file's first: (step, has a summary, its values)."""
    return [
        (
            event.step,
            event.HasField("summary"),
            [v.SerializeToString() for v in event.summary.value],  # pyright: ignore[reportAttributeAccessIssue]
        )
        for event in read_events(str(logdir))[1:]
    ]


@pytest.mark.parametrize("levels", [(1,), (0, 1)])
def test_buffer_rows_made_together_equal_step_by_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, levels: tuple[int, ...]
) -> None:
    writers_read._RECIPES.clear()  # pyright: ignore[reportPrivateUsage]
    blocks: list[int] = []
    real = writers_tensorboard.block_rows

    def counting(block: Any, *args: Any) -> Any:
        blocks.append(block.n)
        return real(block, *args)

    monkeypatch.setattr(writers_tensorboard, "block_rows", counting)
    size, steps = 6, 16  # 6, 6 and a partial buffer of 4
    buffers: list[SummaryBuffer] = []
    buffer = SummaryBuffer.create(size)
    with TensorBoardWriter(tmp_path / "s") as reference:
        for step in range(steps):
            level = levels[step % len(levels)]
            buffer, out = _step(level)(buffer, jnp.int32(step))
            reference.write(step, out)
            if (step + 1) % size == 0 or step == steps - 1:
                buffers.append(buffer)
                buffer = SummaryBuffer.create(size)
    with TensorBoardWriter(tmp_path / "b") as writer:
        for full in buffers:  # the first row by row (the recipes are made)
            writer.write_buffer(full)
    # Each structure's rows of each later buffer made once.
    per = [size, steps - 2 * size]
    assert blocks == (per if len(levels) == 1 else [n // 2 for n in per for _ in "ab"])
    got, want = _events(tmp_path / "b"), _events(tmp_path / "s")
    assert got == want
    assert [step for step, _, _ in got] == list(range(steps))
    # Level 0 rows (even steps) hold only the histogram, empty in every third row.
    empty = [step for step, has, _ in got if not has]
    assert empty == ([4, 10] if len(levels) == 2 else [])


def test_a_buffer_flushes_once_at_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writers_read._RECIPES.clear()  # pyright: ignore[reportPrivateUsage]
    buffers = []
    for start in (0, 12):
        buffer = SummaryBuffer.create(12)
        for step in range(start, start + 12):
            buffer, _ = _step(1)(buffer, jnp.int32(step))
        buffers.append(buffer)
    flushes: list[int] = []
    with TensorBoardWriter(tmp_path, max_queue=5, flush_secs=3600) as writer:
        real = writer.flush
        monkeypatch.setattr(writer, "flush", lambda: flushes.append(0) or real())
        writer.write_buffer(buffers[0])  # row by row (the recipe is made)
        assert len(flushes) == 2  # after steps 5 and 10, as `write` would
        writer.write_buffer(buffers[1])  # column-wise
        assert len(flushes) == 3  # 14 events pending: one flush, at its end
    assert len(read_events(str(tmp_path))) == 1 + 24

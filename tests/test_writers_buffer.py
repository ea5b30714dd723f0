"""SummaryBuffer: steps stacked on the device, written as if written one by one.

The reference is the same jitted step returning its summaries, written with
`write(step, summaries)` after each step (issue 39).
"""

import functools
import inspect
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxctx
from eqxctx.writers import (
    AbstractWriter,
    AsyncWriter,
    HostSummaries,
    JsonlWriter,
    MultiWriter,
    SummaryBuffer,
    TensorBoardWriter,
)
from tb_events import read_events


def _log(x: jax.Array) -> np.ndarray:
    return np.round(np.asarray(x) * 1000.0) / 1000.0


def _summaries(i: jax.Array, level: int | None) -> eqxctx.OutputCollection:
    """One step's summaries: every kind, a scan's per-iteration children, a level."""
    x = i.astype(jnp.float32)
    v = jnp.sin(x + jnp.arange(6.0, dtype=jnp.float32))
    ctx = eqxctx.Context.root(summary_level=level)
    ctx = ctx.add_summary("loss", eqxctx.WeightedSummary(v[0], jnp.float32(2.0) + x))
    ctx = ctx.add_summary("raw", v * 3.0)
    ctx = ctx.add_summary("count", i * 2)
    ctx = ctx.add_summary("flag", v[1] > 0)
    ctx = ctx.add_summary("const", 0.25)  # a Python number: static
    ctx = ctx.add_summary("min", eqxctx.MinSummary(v))
    ctx = ctx.add_summary("max", eqxctx.MaxSummary(v[2]))
    ctx = ctx.add_summary("sum", eqxctx.SumSummary(v.sum()))
    ctx = ctx.add_summary("moments", eqxctx.MomentsSummary(v * x), level=1)
    ctx = ctx.add_summary(
        "hist", eqxctx.HistogramSummary(v * 2.0, bins=5, range=(-2.0, 2.0)), level=1
    )
    image = jnp.abs(jnp.sin(x + jnp.arange(2 * 3 * 4.0))).reshape(2, 3, 4)
    ctx = ctx.add_summary("image", eqxctx.ImageSummary(image), level=1)
    audio = jnp.sin(x + jnp.arange(8.0)) * 0.5
    ctx = ctx.add_summary(
        "audio", eqxctx.AudioSummary(audio, sample_rate=8000), level=1
    )
    ctx = ctx.add_summary("callback", eqxctx.CallbackSummary(_log, v[3]), level=1)

    def body(c: jax.Array, y: jax.Array, ctx: eqxctx.Context) -> Any:
        ctx = ctx.add_summary("y", y * x)
        ctx = ctx.add_summary("w", eqxctx.WeightedSummary(y, jnp.float32(1.0)))
        return c + y, None, ctx

    _, _, scanned = eqxctx.scan_in_context(
        body, context=ctx, carry=jnp.float32(0.0), xs=v[:3], child_name_prefix="layer"
    )
    return ctx.merge(scanned).collection


@functools.cache
def _make_step(level: int | None) -> Callable[..., Any]:
    @eqx.filter_jit
    def step(buffer: SummaryBuffer, i: jax.Array) -> Any:
        collection = _summaries(i, level)
        return buffer.add(i, {"train": collection}), {"train": collection}

    return step


def _levels(step: int) -> int | None:
    return None


def _run(
    writer: AbstractWriter,
    reference: AbstractWriter | None,
    *,
    size: int,
    steps: int,
    level: Callable[[int], int | None] = _levels,
) -> None:
    """Run `steps` steps, writing the buffer every `size` steps and at the end."""
    fns: dict[int | None, Callable[..., Any]] = {}
    buffer = SummaryBuffer.create(size)
    with writer:
        try:
            for step in range(steps):
                lv = level(step)
                fn = fns.get(lv) or fns.setdefault(lv, _make_step(lv))
                buffer, out = fn(buffer, jnp.int32(step))
                if reference is not None:
                    reference.write(step, out)
                if (step + 1) % size == 0:
                    buffer = writer.write_buffer(buffer)
        finally:
            buffer = writer.write_buffer(buffer)
    if reference is not None:
        reference.close()


def _alternate(step: int) -> int:
    return step % 2  # a cheap step (level 0) and a full step (level 1)


@pytest.mark.parametrize(
    ("size", "level"), [(1, _alternate), (7, _alternate), (32, _levels)]
)
def test_buffered_jsonl_equals_step_by_step(
    tmp_path: Path, size: int, level: Callable[[int], int | None]
) -> None:
    steps = 40  # a partial buffer at the end for 7 and 32
    _run(
        JsonlWriter(tmp_path / "b.jsonl"),
        JsonlWriter(tmp_path / "s.jsonl"),
        size=size,
        steps=steps,
        level=level,
    )
    got = (tmp_path / "b.jsonl").read_bytes()
    want = (tmp_path / "s.jsonl").read_bytes()
    assert got == want
    assert len(got.splitlines()) == steps
    if level is _alternate:  # the full step's summaries in odd lines only
        lines = got.decode().splitlines()
        assert '"train/hist"' in lines[1]
        assert '"train/hist"' not in lines[0]


def _events(logdir: Path) -> list[tuple[int, str, bytes]]:
    """Every summary value as (step, tag, serialized value): no wall times."""
    return [
        (event.step, value.tag, value.SerializeToString())  # pyright: ignore[reportAttributeAccessIssue]
        for event in read_events(str(logdir))
        if event.HasField("summary")
        for value in event.summary.value
    ]


def test_buffered_tensorboard_equals_step_by_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    (tmp_path / "b").mkdir()
    (tmp_path / "s").mkdir()
    _run(
        TensorBoardWriter(tmp_path / "b"),
        TensorBoardWriter(tmp_path / "s"),
        size=7,
        steps=10,
        level=_alternate,
    )
    got, want = _events(tmp_path / "b"), _events(tmp_path / "s")
    assert got == want
    assert sorted({step for step, _, _ in got}) == list(range(10))


def test_buffered_wandb_equals_step_by_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb", reason="needs eqxctx's `wandb` extra")
    from eqxctx.writers import WandbWriter
    from wandb_records import history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        folder = tmp_path / var.lower()
        folder.mkdir()
        monkeypatch.setenv(var, str(folder))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)

    def writer() -> Any:
        return WandbWriter(
            project="eqxctx-test",
            mode="offline",
            dir=str(tmp_path),
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )

    # One run at a time (W&B keeps one run per process).
    reference = writer()
    want_file = Path(reference.run.settings.sync_file)
    _run(JsonlWriter(os.devnull), reference, size=7, steps=9, level=_alternate)
    buffered = writer()
    got_file = Path(buffered.run.settings.sync_file)
    _run(buffered, None, size=7, steps=9, level=_alternate)
    got, want = history(got_file), history(want_file)
    drop = {"_timestamp", "_runtime"}

    def rows(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # Media files are named by the run: compare their content's digests.
        return [{k: v for k, v in r.items() if k not in drop} for r in rs]

    assert [r["_step"] for r in got] == list(range(9))
    assert _without_paths(rows(got)) == _without_paths(rows(want))


def _without_paths(rows: object) -> object:
    if isinstance(rows, dict):
        return {k: _without_paths(v) for k, v in rows.items() if k != "path"}
    if isinstance(rows, list):
        return [_without_paths(v) for v in rows]
    return rows


class _Stop(Exception):
    pass


@pytest.mark.parametrize("interrupt", [_Stop, KeyboardInterrupt])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_interrupted_loop_leaves_exactly_its_steps(
    tmp_path: Path, interrupt: type[BaseException], asynchronous: bool
) -> None:
    step_fn = _make_step(None)
    for k in (0, 5, 7, 13):
        path = tmp_path / f"{k}.jsonl"
        jsonl = JsonlWriter(path)
        writer = AsyncWriter(jsonl) if asynchronous else jsonl
        buffer = SummaryBuffer.create(7)
        raised = False
        with writer:
            try:
                for step in range(20):
                    if step == k:
                        raise interrupt
                    buffer, _ = step_fn(buffer, jnp.int32(step))
                    if (step + 1) % buffer.size == 0:
                        buffer = writer.write_buffer(buffer)
            except interrupt:
                raised = True
            finally:
                buffer = writer.write_buffer(buffer)
        assert raised
        lines = path.read_text().splitlines()
        assert [int(line.split(",")[0].split(":")[1]) for line in lines] == list(
            range(k)
        )


class _Flaky(JsonlWriter):
    """Raises KeyboardInterrupt at its `fail_at`-th write, once."""

    fail_at = 3

    def write_host(self, host: HostSummaries) -> None:
        self.fail_at -= 1
        if self.fail_at == 0:
            raise KeyboardInterrupt
        super().write_host(host)


def test_a_write_interrupted_midway_resumes_without_writing_twice(
    tmp_path: Path,
) -> None:
    step_fn = _make_step(None)
    buffer = SummaryBuffer.create(8)
    for step in range(5):
        buffer, _ = step_fn(buffer, jnp.int32(step))
    with _Flaky(tmp_path / "s.jsonl") as writer:
        with pytest.raises(KeyboardInterrupt):
            writer.write_buffer(buffer)
        assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 2
        empty = writer.write_buffer(buffer)  # the `finally` of the loop
        writer.write_buffer(buffer)  # once more: nothing
        assert int(empty.count) == 0
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    assert [line.split(",")[0] for line in lines] == [f'{{"step":{s}' for s in range(5)]


@pytest.mark.parametrize("nested", [False, True])
def test_an_interrupted_multiwriter_resumes_each_writer_where_it_stopped(
    tmp_path: Path, nested: bool
) -> None:
    # A new-user review: Ctrl-C in one writer's write of step 2 (`MultiWriter`
    # calls every writer, so the others wrote step 2) and the same buffer written
    # again wrote step 2 twice into the others' files.
    buffer = SummaryBuffer.create(8)
    for step in range(5):
        buffer = buffer.add(step, {"x": jnp.float32(step) / 4})
    names = ["a", "b", "c"] if nested else ["a", "b"]
    flaky = _Flaky(tmp_path / "a.jsonl")
    others = [JsonlWriter(tmp_path / f"{name}.jsonl") for name in names[1:]]
    if nested:  # the flaky writer second in an inner MultiWriter
        writer = MultiWriter(MultiWriter(others[0], flaky), others[1])
    else:
        writer = MultiWriter(flaky, *others)
    with writer:
        with pytest.raises(KeyboardInterrupt):
            writer.write_buffer(buffer)
        writer.write_buffer(buffer)  # the `finally` of the loop
    want = [{"step": s, "x": s / 4} for s in range(5)]
    for name in names:
        lines = (tmp_path / f"{name}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == want, name


def test_async_buffer_writes_the_same_files_with_a_donated_buffer(
    tmp_path: Path,
) -> None:
    @jax.jit
    def step(buffer: SummaryBuffer, i: jax.Array) -> Any:
        collection = _summaries(i, 0)
        return buffer.add(i, collection), collection

    donating = jax.jit(step, donate_argnums=0)
    buffer = SummaryBuffer.create(
        4, jax.eval_shape(step, SummaryBuffer.create(4), 0)[1]
    )
    reference = JsonlWriter(tmp_path / "s.jsonl")
    with AsyncWriter(MultiWriter(JsonlWriter(tmp_path / "b.jsonl"))) as writer:
        for i in range(10):
            buffer, out = donating(buffer, jnp.int32(i))
            reference.write(i, out)
            if (i + 1) % 4 == 0:
                before = buffer.packed[0][0]
                buffer = writer.write_buffer(buffer)
                assert buffer.packed[0][0] is before  # the same arrays, emptied
        buffer = writer.write_buffer(buffer)
    reference.close()
    assert (tmp_path / "b.jsonl").read_bytes() == (tmp_path / "s.jsonl").read_bytes()
    assert donating._cache_size() == 1  # pyright: ignore[reportAttributeAccessIssue]


@pytest.mark.parametrize("prefetch", ["started", "refused"])
def test_one_transfer_per_width_for_a_whole_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefetch: str
) -> None:
    # Count the JAX arrays that `jax.device_get` reads (through the array type's
    # `__array__`); implicit reads (`numpy.asarray` of a JAX array) are refused
    # by the transfer guard where they are transfers (not on the CPU: zero-copy).
    fetched: list[tuple[str, tuple[int, ...]]] = []
    array_type = type(jnp.zeros(1))
    real = array_type.__array__

    def counting(self: jax.Array, *args: Any, **kwargs: Any) -> Any:
        fetched.append((str(self.dtype), tuple(self.shape)))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(array_type, "__array__", counting)
    if prefetch == "refused":
        # As a TPU's transfer guard refuses `copy_to_host_async` (found on a TPU,
        # issue 39): the buffer's copies are still read in one transfer per width.
        prefetch_of = array_type.copy_to_host_async

        def refuse(self: jax.Array) -> None:
            # (`jax.device_get` starts its own copies: allowed, as explicit ones are)
            frame = inspect.currentframe()
            caller = None if frame is None else frame.f_back
            if caller is not None and caller.f_globals["__name__"].startswith("eqxctx"):
                raise RuntimeError("device-to-host transfer refused")
            prefetch_of(self)

        monkeypatch.setattr(array_type, "copy_to_host_async", refuse)
    step_fn = _make_step(None)
    buffer = SummaryBuffer.create(32)
    with JsonlWriter(tmp_path / "s.jsonl") as writer:
        for n in (32, 5):
            for step in range(n):
                buffer, _ = step_fn(buffer, jnp.int32(step))
            jax.block_until_ready(buffer)
            fetched.clear()
            with jax.transfer_guard_device_to_host("disallow"):
                buffer = writer.write_buffer(buffer)
            # Every leaf is 32-bit (float32, int32) or bool: two transfers for the
            # 32 (or 5) steps. A step has 78 32-bit values (loss 2, raw 6, count 1,
            # const 1, min 6, max 1, sum 1, moments 8 (its two counts as two words
            # each), hist 10 (5 counts, two words each), image 24, audio 8,
            # callback 1, the scan's 3 x 3) and one bool; with the marks (the 32
            # steps and slots, the count and a spare word): 32 * 78 + 66.
            assert sorted(fetched) == [("bool", (32,)), ("uint32", (32 * 78 + 66,))]
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 37


def test_a_full_buffer_writes_its_rows_then_says_how_many_were_lost(
    tmp_path: Path,
) -> None:
    step_fn = _make_step(None)
    buffer = SummaryBuffer.create(4)
    for step in range(6):
        buffer, _ = step_fn(buffer, jnp.int32(step))
    with (
        JsonlWriter(tmp_path / "s.jsonl") as writer,
        pytest.raises(ValueError, match=r"2 step\(s\) were added to the full"),
    ):
        writer.write_buffer(buffer)
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        f'{{"step":{s}' for s in (0, 1, 2, 5)
    ]


def test_buffer_errors() -> None:
    with pytest.raises(TypeError, match=r"size must be an int >= 1"):
        SummaryBuffer.create(2.0)
    with pytest.raises(ValueError, match=r"size must be an int >= 1.*got 0"):
        SummaryBuffer.create(0)
    buffer = SummaryBuffer.create(2)
    with pytest.raises(TypeError, match=r"step must be an integer scalar"):
        buffer.add(jnp.float32(1.0), {"x": jnp.float32(1.0)})
    with pytest.raises(TypeError, match=r"'x'"):
        buffer.add(0, {"x": "text"})
    ctx = eqxctx.Context.root().add_summary("x", jnp.float32(1.0))
    with pytest.raises(TypeError, match=r"got Context; pass its collection"):
        buffer.add(0, ctx)  # a new-user review: the message did not say what to pass
    with JsonlWriter(os.devnull) as writer:
        with pytest.raises(TypeError, match=r"SummaryBuffer"):
            writer.write_buffer({"x": 1.0})  # pyright: ignore[reportArgumentType]

        @jax.jit
        def inside(b: SummaryBuffer) -> SummaryBuffer:
            return writer.write_buffer(b.add(0, {"x": jnp.float32(1.0)}))

        with pytest.raises(TypeError, match=r"outside the jitted step"):
            inside(buffer)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_buffer_batched_by_vmap_is_refused_then_written_entry_by_entry(
    tmp_path: Path, asynchronous: bool
) -> None:
    # A new-user review: a buffer returned by `jax.vmap` (one buffer per batch
    # entry) raised NumPy's "index 4 is out of bounds for axis 1 with size 2".
    def summaries(i: jax.Array) -> dict[str, Any]:
        return {"v": i.astype(jnp.float32) + jnp.arange(3.0, dtype=jnp.float32)}

    empty = SummaryBuffer.create(4, jax.eval_shape(summaries, jnp.int32(0)))
    batched = jax.vmap(lambda i: empty.add(i, summaries(i)))(jnp.arange(3))
    path = tmp_path / "s.jsonl"
    jsonl = JsonlWriter(path)
    with AsyncWriter(jsonl) if asynchronous else jsonl as writer:
        with pytest.raises(ValueError, match=r"shape \(3, 2, 5\), expected \(2, 5\)"):
            writer.write_buffer(batched)
        for j in range(3):
            writer.write_buffer(jax.tree.map(lambda x, j=j: x[j], batched))
    want = [{"step": j, "v": [j + 0.0, j + 1.0, j + 2.0]} for j in range(3)]
    assert [json.loads(line) for line in path.read_text().splitlines()] == want


@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_invalid_row_is_named_by_its_step(
    tmp_path: Path, asynchronous: bool
) -> None:
    # A new-user review: the error named the summary's path but not which of the
    # buffer's steps held it.
    @jax.jit
    def step_fn(buffer: SummaryBuffer, i: jax.Array) -> SummaryBuffer:
        weight = jnp.where(i == 13, -1.0, 1.0)
        return buffer.add(i, {"w": eqxctx.WeightedSummary(jnp.float32(1.0), weight)})

    buffer = SummaryBuffer.create(5)
    for step in range(5):
        buffer = step_fn(buffer, jnp.int32(10 + step))
    path = tmp_path / "s.jsonl"
    jsonl = JsonlWriter(path)
    writer = AsyncWriter(jsonl) if asynchronous else jsonl

    def write() -> None:
        try:
            writer.write_buffer(buffer)
        finally:
            writer.close()  # (an AsyncWriter raises here)

    with pytest.raises(ValueError, match="weights must not be negative") as info:
        write()
    assert any("row 3 (step 13)" in note for note in info.value.__notes__)
    assert path.read_text() == ""  # every step is checked before any is written


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_buffer_deleted_by_a_failed_donating_step_is_refused_at_once(
    tmp_path: Path, asynchronous: bool
) -> None:
    # A new-user review: a donating step failing at run time deletes the buffer
    # it was given (and the steps it held); `write_buffer` in the loop's `finally`
    # raised "Array has been deleted with shape=int32[2,9]" (an AsyncWriter only
    # at `close`).
    def step_fn(buffer: SummaryBuffer, i: jax.Array) -> SummaryBuffer:
        x = eqx.error_if(i.astype(jnp.float32), i == 2, "failed at step 2")
        return buffer.add(i, {"x": x})

    donating = jax.jit(step_fn, donate_argnums=0)
    buffer = SummaryBuffer.create(8, {"x": jax.ShapeDtypeStruct((), jnp.float32)})
    buffer = donating(buffer, jnp.int32(0))
    buffer = donating(buffer, jnp.int32(1))
    with pytest.raises(Exception, match="failed at step 2"):  # (a TPU's: at the sync)
        jax.block_until_ready(donating(buffer, jnp.int32(2)))
    assert buffer.marks.is_deleted()  # JAX's donation, not eqxctx's
    jsonl = JsonlWriter(tmp_path / "s.jsonl")
    with (
        AsyncWriter(jsonl) if asynchronous else jsonl as writer,
        pytest.raises(ValueError, match="the buffer's arrays were deleted"),
    ):
        writer.write_buffer(buffer)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_summaries_of_a_batch_sharded_over_a_mesh(
    tmp_path: Path, axis_type: str, asynchronous: bool
) -> None:
    # A new-user review: under Explicit mesh axes (`jax.make_mesh`'s default on
    # new JAX), `add` raised JAX's ShardingTypeError ("dynamic_update_slice
    # operand sharding must be equal to update sharding"): a row made from a
    # sharded batch, the buffer's zeros on one device.
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("b",), axis_types=(getattr(AxisType, axis_type),))
    x = jax.device_put(jnp.arange(2.0 * n), NamedSharding(mesh, PartitionSpec("b")))

    @jax.jit
    def step_fn(buffer: SummaryBuffer, i: jax.Array, x: jax.Array) -> Any:
        per = jnp.sin(x * i.astype(jnp.float32))
        summaries = {
            "per": per,
            "mean": per.mean(),
            "moments": eqxctx.MomentsSummary(per),
            "hist": eqxctx.HistogramSummary(per, bins=4, range=(-1.0, 1.0)),
            "half": per.astype(jnp.bfloat16),  # (an array of its own)
        }
        return buffer.add(i, summaries), summaries

    buffer = SummaryBuffer.create(3)
    jsonl = JsonlWriter(tmp_path / "b.jsonl")
    with (
        AsyncWriter(jsonl) if asynchronous else jsonl as writer,
        JsonlWriter(tmp_path / "s.jsonl") as reference,
    ):
        for i in range(7):
            buffer, summaries = step_fn(buffer, jnp.int32(i), x)
            reference.write(i, summaries)
            if (i + 1) % 3 == 0:
                buffer = writer.write_buffer(buffer)
        buffer = writer.write_buffer(buffer)
    got = (tmp_path / "b.jsonl").read_text()
    assert got == (tmp_path / "s.jsonl").read_text()
    assert len(got.splitlines()) == 7


def test_a_step_that_wraps_around_in_int32_says_so() -> None:
    # A new-user review: a uint32 step counter past 2**31 was refused as "step must
    # be >= 0, got -1294967296", without saying where the negative step came from.
    buffer = SummaryBuffer.create(2).add(jnp.uint32(3_000_000_000), {"x": 1.0})
    with (
        JsonlWriter(os.devnull) as writer,
        pytest.raises(ValueError, match="got -1294967296") as info,
    ):
        writer.write_buffer(buffer)
    assert any("a step of 2**31 or more wraps" in n for n in info.value.__notes__)


def test_a_python_int_step_above_int32_is_refused_by_add() -> None:
    # A new-user review: JAX's OverflowError named no step and no fix.
    buffer = SummaryBuffer.create(2)
    with pytest.raises(ValueError, match="step 2147483648 is above 2147483647"):
        buffer.add(2**31, {"x": 1.0})
    got = buffer.add(2**31 - 1, {"x": 1.0})  # the largest int32 is taken
    assert int(got.count) == 1
    assert int(got.steps[0]) == 2**31 - 1


def test_the_buffer_holds_n_times_one_steps_summaries() -> None:
    one = {"a": jnp.zeros((3,), jnp.float32), "b": eqxctx.MaxSummary(jnp.int32(1))}
    buffer = SummaryBuffer.create(32, one)
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(buffer.rows))
    assert nbytes == 32 * (3 * 4 + 4)
    assert [x.shape for x in buffer.packed[0]] == [(32, 3), (32, 1)]
    assert len(jax.tree_util.tree_leaves(buffer)) == 3  # two dtypes, the marks
    assert buffer.marks.shape == (2, 32 + 1)  # each row's step, structure; count
    assert buffer.marks.nbytes == 2 * (32 + 1) * 4


@eqx.filter_jit
def _scalar_step(buffer: SummaryBuffer, i: jax.Array) -> Any:
    """Scalars only (as the demo's step): a weighted mean, moments, a scan's rows."""
    x = i.astype(jnp.float32)
    ctx = eqxctx.Context.root()
    ctx = ctx.add_summary("loss", eqxctx.WeightedSummary(jnp.sin(x), x + 1.0))
    ctx = ctx.add_summary("m", eqxctx.MomentsSummary(jnp.cos(x + jnp.arange(4.0))))

    def body(c: jax.Array, y: jax.Array, ctx: eqxctx.Context) -> Any:
        return c + y, None, ctx.add_summary("y", jnp.tanh(y * x))

    _, _, scanned = eqxctx.scan_in_context(
        body, context=ctx, carry=x, xs=jnp.arange(3.0), child_name_prefix="layer"
    )
    collection = ctx.merge(scanned).collection
    return buffer.add(i, {"train": collection}), {"train": collection}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_write_buffer_dispatches_only_the_buffers_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    # issue 39 (the calling thread's work): the emptied buffer's count was a
    # device computation of its own (`jnp.zeros`); it is an output of the copy.
    zeros: list[object] = []
    real = jnp.zeros

    def counting(*args: Any, **kwargs: Any) -> Any:
        zeros.append(args)
        return real(*args, **kwargs)

    writer: AbstractWriter = JsonlWriter(tmp_path / "s.jsonl")
    if asynchronous:
        writer = AsyncWriter(writer)
    buffer = SummaryBuffer.create(4)
    with writer:
        for step in range(12):
            buffer, _ = _scalar_step(buffer, jnp.int32(step))
            if step == 7:  # the copy's program is made (traced) at the first write
                monkeypatch.setattr(jnp, "zeros", counting)
            if (step + 1) % 4 == 0:
                buffer = writer.write_buffer(buffer)
                assert int(buffer.count) == 0
    assert zeros == []
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        f'{{"step":{s}' for s in range(12)
    ]


def _dtypes(tree: object) -> set[np.dtype[Any]]:
    return {jnp.asarray(x).dtype for x in jax.tree_util.tree_leaves(tree)}


def _count(jaxpr: Any, name: str) -> int:
    """The equations of primitive `name` in `jaxpr` and the jaxprs inside it."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == name
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += _count(inner, name)
    return total


def test_the_step_passes_one_array_per_dtype_per_structure() -> None:
    # issue 39 (pack): each summary leaf was one more donated input, output and
    # dynamic-update-slice of the step (22 buffers for the demo's 19 leaves).
    step = jax.jit(_make_step(None), donate_argnums=0)
    buffer = SummaryBuffer.create(8)
    buffer, out = step(buffer, jnp.int32(0))  # the structure's rows made
    dtypes = _dtypes(out)  # float32, int32, uint32 (counts' words) and bool
    assert len(dtypes) == 4
    assert len(jax.tree_util.tree_leaves(out)) == 25  # (28 buffers before)
    # one array per dtype, then the marks (each row's step and structure, the count)
    assert len(jax.tree_util.tree_leaves(buffer)) == 4 + 1
    lowered = step.lower(buffer, jnp.int32(1))
    args, _ = jax.tree_util.tree_flatten(lowered.args_info)
    assert len(args) == 4 + 1 + 1  # the buffer's arrays and the step
    assert sum(a.donated for a in args) == 4 + 1
    assert len(jax.tree_util.tree_leaves(lowered.out_info[0])) == 4 + 1
    # One dynamic-update-slice per packed array, two of the marks (the row's
    # step and structure, the count); the summaries' own: the scan's rows.
    name = "dynamic_update_slice"
    buffered = _count(jax.make_jaxpr(step)(buffer, jnp.int32(1)).jaxpr, name)
    plain = _count(jax.make_jaxpr(lambda i: _summaries(i, None))(1).jaxpr, name)
    assert buffered - plain == 4 + 2


def test_levels_get_one_array_per_dtype_each() -> None:
    # issue 39 (pack): a structure's rows are one `[size, K]` array per dtype.
    buffer = SummaryBuffer.create(4)
    for step in range(4):
        buffer, _ = _make_step(step % 2)(buffer, jnp.int32(step))
    cheap = {"train": _summaries(jnp.int32(0), 0)}
    full = {"train": _summaries(jnp.int32(0), 1)}
    assert len(buffer.layouts) == 2
    assert [len(p) for p in buffer.packed] == [len(_dtypes(cheap)), len(_dtypes(full))]
    assert len(jax.tree_util.tree_leaves(buffer)) == len(_dtypes(cheap)) + 4 + 1


_KINDS = (
    np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.float16, jnp.bfloat16,
    np.int32, np.uint32, np.float32, np.complex64, jnp.float8_e4m3fn,
)  # fmt: skip


def _mixed(i: jax.Array, level: int) -> dict[str, Any]:
    """Leaves of every dtype and shape: scalars, vectors, zero-size, 3-d, numbers."""
    x = i.astype(jnp.float32)
    out: dict[str, Any] = {}
    for k, dtype in enumerate(_KINDS):
        values = jnp.sin(x * 3.7 + k + jnp.arange(6.0)) * 50.0
        if dtype == np.bool_:
            values = values > 0
        out[f"v{k}"] = values.astype(dtype).reshape(1, 2, 3)
        out[f"s{k}"] = values[0].astype(dtype)
    out["empty"] = jnp.zeros((0, 3), jnp.float32)
    out["number"] = 7
    out["fraction"] = 0.5
    out["yes"] = True
    if level:
        out["extra"] = eqxctx.MaxSummary(
            jnp.arange(3, dtype=jnp.int16) + i.astype(jnp.int16)
        )
    return out


def test_packed_rows_read_back_every_dtype_bit_for_bit() -> None:
    # issue 39 (pack): each dtype's leaves share an array; read back as columns.
    from eqxctx.writers._buffer import buffer_rows, start_fetch

    steps = [0, 1, 2, 3, 4]
    buffer = SummaryBuffer.create(8)
    outs = []
    for s in steps:  # alternating structures, a partial buffer
        summaries = _mixed(jnp.int32(s), s % 2)
        buffer = buffer.add(s, summaries)
        leaves = jax.tree_util.tree_leaves(summaries)
        outs.append([np.asarray(jnp.asarray(x)) for x in leaves])
    # bfloat16 and float8 leaves (v, s) alone; the other dtypes packed: per
    # structure 10 dtypes (the full one's int16 leaf joins them) and 4 leaves.
    assert [len(p) for p in buffer.packed] == [10 + 4, 10 + 4]
    assert len(jax.tree_util.tree_leaves(buffer)) == 2 * (10 + 4) + 1
    fetched = buffer_rows(start_fetch(buffer, where="test"))
    assert fetched.steps == steps
    assert fetched.slots == [0, 1, 0, 1, 0]
    for (step, leaves, _), want in zip(fetched.rows, outs, strict=True):
        assert len(leaves) == len(want)
        for got, w in zip(leaves, want, strict=True):  # (numbers: JAX's dtype)
            assert type(got) is np.ndarray
            assert (got.dtype, got.shape) == (w.dtype, w.shape)
            assert got.tobytes() == w.tobytes(), step
    for k in range(2):
        positions, columns = fetched.columns(k)
        stacked = [
            np.stack([outs[i][j] for i in positions]) for j in range(len(columns))
        ]
        for got, want in zip(columns, stacked, strict=True):
            assert got.shape == want.shape
            assert np.asarray(got).tobytes() == want.tobytes()
        # `rows`: the same columns on the device, `[size, ...]`
        on_device = buffer.rows[k]
        assert len(on_device) == len(columns)
        for got, want in zip(on_device, fetched.tables[k], strict=True):
            assert np.asarray(got).tobytes() == want.tobytes()


@pytest.mark.cpu_only(
    reason="XLA:TPU (v5e, jax 0.10.2) fails to compile this x64 buffer's complex128 "
    "column (RET_CHECK in its emulated-precision emitters: f64[4,1] vs c128[4,1])"
)
def test_packed_rows_hold_64_bit_dtypes() -> None:
    # issue 39 (pack): with `jax_enable_x64`, 64-bit leaves (and int64 steps).
    from eqxctx.writers._buffer import buffer_rows, start_fetch

    with jax.enable_x64(True):
        rows = [
            {
                "i": jnp.asarray([s, -(2**40) - s], jnp.int64),
                "j": jnp.asarray(-s, jnp.int64),
                "u": jnp.asarray(2**63 + s, jnp.uint64),
                "f": jnp.asarray([np.pi * s, 1e300], jnp.float64),
                "c": jnp.asarray(1j * s + 0.1, jnp.complex128),
            }
            for s in range(3)
        ]
        buffer = SummaryBuffer.create(4)
        for s, summaries in enumerate(rows):
            buffer = buffer.add(2**40 + s, summaries)
        assert len(jax.tree_util.tree_leaves(buffer)) == 4 + 1  # (5 leaves)
        fetched = buffer_rows(start_fetch(buffer, where="test"))
    assert fetched.steps == [2**40, 2**40 + 1, 2**40 + 2]
    for (_, leaves, _), want in zip(fetched.rows, rows, strict=True):
        for got, w in zip(leaves, jax.tree_util.tree_leaves(want), strict=True):
            w = np.asarray(w)
            assert (got.dtype, got.shape) == (w.dtype, w.shape)
            assert got.tobytes() == w.tobytes()

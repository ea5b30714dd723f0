"""WandbWriter, in W&B's offline mode (no account, no network), read back."""

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

import eqxctx
from eqxctx.writers import (
    AsyncWriter,
    JsonlWriter,
    MultiWriter,
    TensorBoardWriter,
    WandbWriter,
)


wandb = pytest.importorskip("wandb", reason="needs eqxctx's `wandb` extra")

from eqxctx.writers._tensorboard import wav_bytes  # noqa: E402
from eqxctx.writers._wandb import MAX_BUCKETS, histogram_buckets  # noqa: E402
from wandb_records import history, history_so_far  # noqa: E402


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """W&B's offline mode with every folder it uses under `tmp_path`."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        folder = tmp_path / var.lower()
        folder.mkdir()
        monkeypatch.setenv(var, str(folder))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


def _writer(tmp_path: Path) -> WandbWriter:
    return WandbWriter(
        project="eqxctx-test",
        mode="offline",
        dir=str(tmp_path),
        settings=wandb.Settings(console="off", x_disable_stats=True),
    )


def _rows(writer: WandbWriter) -> tuple[list[dict[str, Any]], Path]:
    """Close `writer` and read its offline run back: (rows, the run's files)."""
    sync_file = Path(writer.run.settings.sync_file)
    files = Path(writer.run.settings.files_dir)
    writer.close()
    return history(sync_file), files


def test_wandb_every_summary_kind(offline: Path) -> None:
    gray = np.linspace(0.0, 1.0, 2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    rgb = np.zeros((1, 5, 6, 3), dtype=np.uint8)
    rgb[..., 0] = 255
    audio = np.stack([np.linspace(-1.0, 1.0, 50), np.zeros(50)], axis=1)
    values = np.asarray([0.5, 1.5, 1.7, 3.0, 9.0, np.nan], np.float32)
    summaries = {
        "scalar": jnp.float32(1.5),
        "weighted": eqxctx.WeightedSummary(jnp.float32(2.0), jnp.float32(4.0)),
        "min": eqxctx.MinSummary(jnp.int32(-3)),
        "flag": True,
        "nan": jnp.float32(jnp.nan),
        "gray": eqxctx.ImageSummary(gray),
        "rgb": eqxctx.ImageSummary(rgb),
        "audio": eqxctx.AudioSummary(audio, sample_rate=8000),
        "ranged": eqxctx.HistogramSummary(values, bins=4, range=(0, 4)),
        "empty": eqxctx.HistogramSummary(jnp.full(3, jnp.nan), bins=2, range=(0, 1)),
        "raw": np.arange(5.0),
        "moments": eqxctx.MomentsSummary(values[:5]),
        "moments_nan": eqxctx.MomentsSummary(values),
    }
    writer = _writer(offline)
    writer.write(3, {"train": summaries})
    writer.write(4, {"train": {"scalar": 2.5}})
    (row, row4), files = _rows(writer)
    assert row["_step"] == 3
    assert row4["_step"] == 4
    assert row4["train/scalar"] == 2.5
    train = {k[len("train/") :]: v for k, v in row.items() if k.startswith("train/")}
    assert train["scalar"] == 1.5
    assert train["weighted"] == 2.0
    assert train["min"] == -3
    assert train["flag"] == 1
    assert np.isnan(train["nan"])
    # Histograms: counts and edges as made on the device (the non-empty span).
    counts, edges = np.histogram(values[np.isfinite(values)], bins=4, range=(0, 4))
    assert train["ranged"]["_type"] == "histogram"
    assert train["ranged"]["values"] == counts.tolist()
    np.testing.assert_allclose(train["ranged"]["bins"], edges)
    assert "empty" not in train  # nothing counted: skipped, as in TensorBoard
    assert sum(train["raw"]["values"]) == 5
    assert len(train["raw"]["values"]) == 64
    # MomentsSummary as numbers.
    finite = values[:5].astype(np.float64)
    assert train["moments/count"] == 5
    assert train["moments/nonfinite"] == 0
    assert train["moments_nan/nonfinite"] == 1
    assert np.isnan(train["moments_nan/mean"])
    np.testing.assert_allclose(train["moments/mean"], finite.mean(), rtol=1e-6)
    np.testing.assert_allclose(train["moments/variance"], finite.var(), rtol=1e-5)
    assert train["moments/min"] == 0.5
    assert train["moments/max"] == 9.0
    # Images: one per batch entry, converted like TensorBoard's.
    assert train["gray"]["_type"] == "images/separated"
    assert train["gray"]["count"] == 2
    assert (train["gray"]["width"], train["gray"]["height"]) == (4, 3)
    pixels = [
        np.asarray(Image.open(files / name)) for name in train["gray"]["filenames"]
    ]
    expected = np.round(gray * 255).astype(np.uint8)
    for got, want in zip(pixels, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    (red,) = train["rgb"]["filenames"]
    np.testing.assert_array_equal(np.asarray(Image.open(files / red)), rgb[0])
    # Audio: the 16-bit WAV that TensorBoard writes.
    assert train["audio"]["_type"] == "audio-file"
    wav = (files / train["audio"]["path"]).read_bytes()
    assert wav == wav_bytes(audio, 8000)


def test_wandb_histogram_of_many_buckets_merges_them_exactly() -> None:
    x = jnp.linspace(-1.0, 1.0, 2000)
    hist = eqxctx.HistogramSummary(x, bins=1000, range=(-1, 1))
    buckets = histogram_buckets(np.asarray(hist.counts), hist.edges)
    assert buckets is not None
    counts, edges = buckets
    assert len(counts) <= MAX_BUCKETS
    assert len(edges) == len(counts) + 1
    assert counts.sum() == 2000
    # Merged in pairs: each bucket holds what its two buckets held.
    np.testing.assert_array_equal(counts, np.asarray(hist.counts).reshape(-1, 2).sum(1))
    np.testing.assert_allclose(edges, np.asarray(hist.edges)[::2])
    # TensorFlow's default buckets (1,550, infinite outer edges) fit as well.
    wide = eqxctx.HistogramSummary(np.asarray([-1e30, 0.0, 1e30], np.float32))
    buckets = histogram_buckets(np.asarray(wide.counts), wide.edges)
    assert buckets is not None
    assert buckets[0].sum() == 3
    assert np.isfinite(buckets[1]).all()


def test_wandb_equals_jsonl_through_async_multiwriter(offline: Path) -> None:
    path = offline / "s.jsonl"
    writer = _writer(offline)
    sync_file = Path(writer.run.settings.sync_file)
    with AsyncWriter(MultiWriter(JsonlWriter(path), writer), defer_fetch=True) as w:
        for step in range(5):
            w.write(step, {"loss": jnp.float32(1.0 / (step + 1)), "n": step})
    rows = history(sync_file)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["_step"] for r in rows] == [line["step"] for line in lines]
    for row, line in zip(rows, lines, strict=True):
        assert row["n"] == line["n"]
        np.testing.assert_allclose(row["loss"], line["loss"], rtol=1e-7)


def test_wandb_errors(offline: Path) -> None:
    writer = _writer(offline)
    writer.write(5, {"x": 1.0})
    writer.write(5, {"y": 1.0})  # the same step again is fine
    with pytest.raises(ValueError, match="lower than step 5"):
        writer.write(4, {"x": 1.0})
    with pytest.raises(ValueError, match="reserves"):
        writer.write(6, {"_step": 1.0})
    with pytest.raises(ValueError, match="not both"):
        WandbWriter(writer.run, project="p")
    writer.close()
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.write(7, {"x": 1.0})


def test_wandb_refuses_a_step_lower_than_the_runs(offline: Path) -> None:
    # A train and an eval writer on one run: W&B drops the eval of step 2 logged
    # after step 3, so the eval writer refuses it.
    run = wandb.init(project="eqxctx-test", mode="offline", dir=str(offline))
    train, evaluation = WandbWriter(run), WandbWriter(run)
    for step in range(4):
        train.write(step, {"train": {"loss": float(step)}})
    with pytest.raises(ValueError, match="step 2 is lower than step 3"):
        evaluation.write(2, {"eval": {"acc": 0.9}})
    evaluation.write(3, {"eval": {"acc": 0.9}})  # the run's current step is fine
    sync_file = Path(run.settings.sync_file)
    run.finish()
    rows = history(sync_file)
    assert [row["_step"] for row in rows] == [0, 1, 2, 3]
    assert rows[3]["eval/acc"] == pytest.approx(0.9)
    assert all("eval/acc" not in row for row in rows[:3])


def test_wandb_records_a_step_once_written(offline: Path, tmp_path: Path) -> None:
    # TensorBoard refuses step 10 after W&B's check: nothing is written, so step 1
    # may follow.
    writer = _writer(offline)
    sync_file = Path(writer.run.settings.sync_file)
    with MultiWriter(writer, TensorBoardWriter(tmp_path / "tb")) as w:
        w.write(0, {"x": 1.0})
        with pytest.raises(eqxctx.OutputConflictError, match="'a b'"):
            w.write(10, {"a b": 1.0, "a_b": 2.0})
        w.write(1, {"x": 2.0})
    assert [(row["_step"], row["x"]) for row in history(sync_file)] == [
        (0, 1.0),
        (1, 2.0),
    ]


def test_wandb_skips_a_lower_step_checked_before(
    offline: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # `AsyncWriter` checks step n before step n - 1 is logged: `write_host` does not
    # log a step that became lower than the run's, with a logged warning (W&B
    # would drop it), and the writer goes on.
    writer = _writer(offline)
    later, earlier = writer.fetch(5, {"x": 1.0}), writer.fetch(4, {"x": 2.0})
    writer.write_host(later)
    with caplog.at_level("WARNING", logger="eqxctx.writers"):
        writer.write_host(earlier)
    assert "step 4 was not logged: step 5" in caplog.text
    again = writer.fetch(6, {"y": 4.0})  # checked before step 6 is committed
    writer.write(6, {"x": 3.0})
    writer.flush()
    with caplog.at_level("WARNING", logger="eqxctx.writers"):
        writer.write_host(again)
    assert "step 6 was not logged: step 6 was logged to this W&B run first and " in (
        caplog.text
    )
    rows, _ = _rows(writer)
    assert [(row["_step"], row["x"]) for row in rows] == [(5, 1.0), (6, 3.0)]
    assert "y" not in rows[1]


@pytest.mark.parametrize("waits_in", ["write_host", "fetch"])
def test_wandb_train_writer_goes_on_after_an_eval_step(
    offline: Path, caplog: pytest.LogCaptureFixture, waits_in: str
) -> None:
    # A train `AsyncWriter` and an eval writer on one run: an eval step logged
    # while train steps wait in the queue skips those lower train steps (with a
    # warning) and never stops the train writer. "fetch": the background thread
    # had not yet fetched (and checked) step 1 when the eval step was logged, as
    # happened under load (the full suite, this session): the check raised.
    run = wandb.init(project="eqxctx-test", mode="offline", dir=str(offline))
    gate = threading.Event()

    class Slow(WandbWriter):
        def write_host(self, host: Any) -> None:
            if waits_in == "write_host":
                gate.wait()
            super().write_host(host)

        def fetch(self, step: Any, summaries: Any) -> Any:
            if waits_in == "fetch":
                gate.wait()
            return super().fetch(step, summaries)

    train, evaluation = AsyncWriter(Slow(run)), WandbWriter(run)
    for step in range(1, 4):
        train.write(step, {"loss": float(step)})
    evaluation.write(2, {"acc": 0.5})  # the run has logged no step yet

    with caplog.at_level("WARNING", logger="eqxctx.writers"):
        gate.set()
        train.flush()
    assert "step 1 was not logged: step 2" in caplog.text
    for step in range(4, 6):
        train.write(step, {"loss": float(step)})
    train.close()
    sync_file = Path(run.settings.sync_file)
    run.finish()
    logged = [(row["_step"], "acc" in row) for row in history(sync_file)]
    assert logged == [(2, True), (3, False), (4, False), (5, False)]


def _user_run(offline: Path) -> Any:
    """A run made by the user; its file is written out every 0.1 s while it runs."""
    settings = wandb.Settings(
        console="off", x_disable_stats=True, x_transaction_log_flush_interval=0.1
    )
    return wandb.init(
        project="eqxctx-test", mode="offline", dir=str(offline), settings=settings
    )


@pytest.mark.parametrize("end", ["flush", "close", "async flush"])
def test_wandb_flush_and_close_commit_the_last_step(offline: Path, end: str) -> None:
    # Issue 35 item 5: W&B keeps a step open until a higher step is logged or it is
    # committed, so after `flush()` or `close()` on a user's run the last step was
    # not in the run's file (3 steps written, 2 there).
    run = _user_run(offline)
    sync_file = Path(run.settings.sync_file)
    writer: Any = WandbWriter(run)
    if end == "async flush":
        # The calling thread's fetch, so that the refusal below is raised by the
        # `write` itself (by default the background thread's error is raised by the
        # next call).
        writer = AsyncWriter(writer, background_fetch=False, defer_fetch=False)
    for step in range(3):
        writer.write(step, {"x": float(step)})
    writer.close() if end == "close" else writer.flush()
    rows = history_so_far(sync_file, rows=3)  # the run is still open
    assert [(row["_step"], row["x"]) for row in rows] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    if end != "close":
        # Committed: W&B would drop more values for step 2, so they are refused.
        with pytest.raises(ValueError, match="step 2 was committed"):
            writer.write(2, {"y": 1.0})
        writer.write(3, {"x": 3.0})
        writer.flush()
        writer.flush()  # nothing more to commit
        writer.close()
    run.log({"after": 1.0})  # the user's next row
    run.finish()
    rows = history(sync_file)
    steps = [0, 1, 2, 3, 4] if end != "close" else [0, 1, 2, 3]
    assert [row["_step"] for row in rows] == steps
    assert "y" not in rows[2]
    assert rows[-1]["after"] == 1.0
    assert all("after" not in row for row in rows[:-1])


def test_wandb_close_after_the_user_finished_the_run(offline: Path) -> None:
    run = _user_run(offline)
    sync_file = Path(run.settings.sync_file)
    writer = WandbWriter(run)
    writer.write(0, {"x": 1.0})
    run.finish()  # commits the step
    writer.flush()
    writer.close()
    assert [row["x"] for row in history(sync_file)] == [1.0]


def test_wandb_given_run_stays_open(offline: Path) -> None:
    run = wandb.init(project="eqxctx-test", mode="offline", dir=str(offline))
    writer = WandbWriter(run)
    writer.write(0, {"x": 1.0})
    writer.close()
    run.log({"after": 2.0}, step=1)  # still open
    sync_file = Path(run.settings.sync_file)
    run.finish()
    assert [row.get("x", row.get("after")) for row in history(sync_file)] == [1.0, 2.0]


def test_wandb_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"eqxctx\[wandb\]"):
        WandbWriter(project="p")


def test_wav_bytes_is_what_wandb_stores() -> None:
    # The reference for the audio check above: a 16-bit WAV, TensorFlow's scaling.
    audio = np.asarray([0.0, 0.5, -1.0], np.float32)
    wav = io.BytesIO(wav_bytes(audio, 16000))
    assert wav.getvalue()[:4] == b"RIFF"


UNCLOSED = """
import subprocess
import sys
from eqxctx.writers import AsyncWriter, JsonlWriter, MultiWriter, WandbWriter
inner = MultiWriter(JsonlWriter(sys.argv[1]), WandbWriter(project="eqxctx-test"))
w = AsyncWriter(inner)
for step in range(6):
    w.write(step, {"x": float(step)})
"""


def test_an_unclosed_async_wandb_writer_is_closed_before_wandb_exits(
    offline: Path,
) -> None:
    # The writer's exit handler is registered after `wandb.init`'s, so it runs
    # first: every step is written, and W&B's connection is still there.
    path = offline / "s.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", UNCLOSED, str(path)],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},  # also on an accelerator host
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == list(range(6))

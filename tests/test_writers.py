import io
import json
import os
import re
import subprocess
import sys
import wave
from pathlib import Path
from typing import Any

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from PIL import Image

import eqxctx
from eqxctx.writers import JsonlWriter, TensorBoardWriter, fetch_summaries
from tb_events import scalars, summary_values


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def write_both(tmp_path: Path, step: int, summaries: Any) -> dict[str, Any]:
    with JsonlWriter(tmp_path / "s.jsonl") as jw, TensorBoardWriter(tmp_path) as tw:
        jw.write(step, summaries)
        tw.write(step, summaries)
    (line,) = read_jsonl(tmp_path / "s.jsonl")
    return line


# -- JSON lines ------------------------------------------------------------------


def test_jsonl_every_summary_kind(tmp_path: Path) -> None:
    image = np.linspace(0.0, 1.0, 2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    audio = np.linspace(-1.0, 1.0, 6, dtype=np.float32)
    summaries = {
        "raw": jnp.asarray(1.5, dtype=jnp.float32),
        "py_int": 3,
        "py_float": 0.25,
        "py_bool": True,
        "weighted": eqxctx.WeightedSummary(jnp.float32(2.0), jnp.float32(4.0)),
        "min": eqxctx.MinSummary(jnp.asarray([1, -2], dtype=jnp.int32)),
        "max": eqxctx.MaxSummary(jnp.float32(7.0)),
        "sum": eqxctx.SumSummary(jnp.float32(8.0)),
        "image": eqxctx.ImageSummary(image),
        "audio": eqxctx.AudioSummary(audio, sample_rate=8000),
        "histogram": eqxctx.HistogramSummary(np.arange(4.0), bins=4, range=(0, 8)),
        "moments": eqxctx.MomentsSummary(jnp.asarray([1.0, 3.0], jnp.float32)),
        "callback": eqxctx.CallbackSummary(lambda x, y: x * y, np.float32(3.0), y=2.0),
        "callback_tree": eqxctx.CallbackSummary(
            lambda x: {"double": x * 2, "neg": -x}, np.int32(5)
        ),
    }
    with JsonlWriter(tmp_path / "s.jsonl") as w:
        w.write(7, summaries)
    (line,) = read_jsonl(tmp_path / "s.jsonl")
    # float32 values: the shortest decimals that read back as the same float32.
    np.testing.assert_array_equal(np.asarray(line.pop("image"), np.float32), image)
    np.testing.assert_array_equal(np.asarray(line.pop("audio"), np.float32), audio)
    assert line["callback_tree/double"] == 10
    assert line == {
        "step": 7,
        "raw": 1.5,
        "py_int": 3,
        "py_float": 0.25,
        "py_bool": 1,
        "weighted": 2.0,
        "min": [1, -2],
        "max": 7.0,
        "sum": 8.0,
        # The non-empty bucket span: [0, 2), [2, 4) of 4 buckets over [0, 8].
        "histogram": {"edges": [0.0, 2.0, 4.0], "counts": [2, 2]},
        "moments/count": 2,
        "moments/mean": 2.0,
        "moments/variance": 1.0,
        "moments/min": 1.0,
        "moments/max": 3.0,
        "moments/nonfinite": 0,
        "callback": 6.0,
        "callback_tree/double": 10,
        "callback_tree/neg": -5,
    }
    # Keys in the summaries' order, "step" first.
    assert list(line) == ["step", *[k for k in line if k != "step"]]


def test_jsonl_nested_paths_collection_and_scan(tmp_path: Path) -> None:
    def body(carry: Any, x: Any, ctx: eqxctx.Context) -> Any:
        ctx = ctx.add_summary("x", x * 2.0)
        ctx = ctx.add_summary("w", eqxctx.WeightedSummary(x, 1.0))
        return carry + x, None, ctx

    ctx = eqxctx.Context.root()
    ctx = ctx.add_summary("top", jnp.float32(1.0))
    child = eqxctx.Context.root().add_summary("deep", jnp.float32(2.0))
    ctx = ctx.replace_collection(
        ctx.collection.add_child(
            "a", eqxctx.OutputCollection.empty().add_child("b", child.collection)
        )
    )
    xs = jnp.asarray([1.0, 2.0, 3.0], dtype=jnp.float32)
    _, _, coll = jax.jit(
        lambda xs: eqxctx.scan_in_context(
            body, context=eqxctx.Context.root(), carry=jnp.float32(0.0), xs=xs
        )
    )(xs)
    ctx = ctx.merge(coll)
    path = tmp_path / "s.jsonl"
    with JsonlWriter(path) as w:
        w.write(0, ctx.collection)  # an OutputCollection
        w.write(1, {"train": ctx.collection.summaries})  # a nested mapping
        w.write(2, {"train": ctx.collection, "eval": {"top": 5.0}})  # of collections
    first, second, third = read_jsonl(path)
    expected = {
        "top": 1.0,
        "a/b/deep": 2.0,
        "iter0/x": 2.0,
        "iter0/w": 1.0,
        "iter1/x": 4.0,
        "iter1/w": 2.0,
        "iter2/x": 6.0,
        "iter2/w": 3.0,
    }
    assert first == {"step": 0, **expected}
    assert second == {"step": 1, **{f"train/{k}": v for k, v in expected.items()}}
    assert third == {
        "step": 2,
        **{f"train/{k}": v for k, v in expected.items()},
        "eval/top": 5.0,
    }


@pytest.mark.parametrize("rank", [0, 1, 2, 3, 4])
@pytest.mark.parametrize(
    "dtype", [np.float32, np.float64, np.int32, np.uint8, np.bool_, jnp.bfloat16]
)
def test_jsonl_arrays_of_each_rank(tmp_path: Path, rank: int, dtype: Any) -> None:
    shape = (2, 3, 1, 2)[:rank]
    rng = np.random.default_rng(rank)
    arr = (rng.normal(size=shape) * 50).astype(dtype)
    with JsonlWriter(tmp_path / "s.jsonl") as w:
        w.write(0, {"x": jnp.asarray(arr), "np": arr})
    (line,) = read_jsonl(tmp_path / "s.jsonl")
    # JAX without x64 holds float64 as float32.
    for key, ref in (("x", np.asarray(jnp.asarray(arr))), ("np", arr)):
        got = np.asarray(line[key])
        assert got.shape == shape
        if dtype == np.bool_:
            np.testing.assert_array_equal(got, ref.astype(np.int64))
        else:
            # Floats read back exactly in their own precision.
            np.testing.assert_array_equal(got.astype(ref.dtype), ref)
    if rank == 0:
        assert isinstance(line["x"], (int, float))


def test_jsonl_float32_is_short_and_exact(tmp_path: Path) -> None:
    # issue 36: orjson's text; NaN and infinities are JSON's null (RFC 8259), which
    # every JSON reader takes (Python's json, pandas, orjson, jq, JavaScript).
    x = np.float32(0.1)
    with JsonlWriter(tmp_path / "s.jsonl") as w:
        w.write(0, {"x": x, "nan": np.float32(np.nan), "inf": -np.inf})
        w.write(1, {"x": 2.5, "nan": 1.0, "inf": np.float32(np.inf)})
    text = (tmp_path / "s.jsonl").read_text()
    assert text.splitlines()[0] == '{"step":0,"x":0.1,"nan":null,"inf":null}'
    first, second = read_jsonl(tmp_path / "s.jsonl")
    assert first == {"step": 0, "x": 0.1, "nan": None, "inf": None}
    assert second == {"step": 1, "x": 2.5, "nan": 1.0, "inf": None}
    assert np.float32(first["x"]) == x
    import pandas  # the test group installs it

    frame = pandas.read_json(tmp_path / "s.jsonl", lines=True, precise_float=True)
    assert frame["step"].tolist() == [0, 1]
    np.testing.assert_array_equal(frame["x"], [0.1, 2.5])
    np.testing.assert_array_equal(frame["nan"], [np.nan, 1.0])
    assert frame["inf"].isna().all()


def test_jsonl_appends_one_line_per_write(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "s.jsonl"  # missing parent folders are made
    with JsonlWriter(path) as w:
        for step in range(3):
            w.write(np.int64(step), {"loss": float(step)})
            assert len(read_jsonl(path)) == step + 1  # flushed as written
    with JsonlWriter(path) as w:
        w.write(3, {"loss": 3.0})
    assert [line["loss"] for line in read_jsonl(path)] == [0.0, 1.0, 2.0, 3.0]
    with JsonlWriter(path, mode="w") as w:
        w.write(9, {"loss": 9.0})
    assert read_jsonl(path) == [{"step": 9, "loss": 9.0}]
    with pytest.raises(FileExistsError):
        JsonlWriter(path, mode="x")


def test_jsonl_errors(tmp_path: Path) -> None:
    w = JsonlWriter(tmp_path / "s.jsonl")
    with pytest.raises(TypeError, match="step"):  # beartype's or ours
        w.write(1.5, {})  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="step must be an int"):
        w.write(True, {})
    with pytest.raises(ValueError, match="step must be >= 0"):
        w.write(-1, {})
    with pytest.raises(ValueError, match="'step'"):
        w.write(0, {"step": 1.0})
    with pytest.raises(TypeError, match=r"'bad/c'.*complex"):
        w.write(0, {"bad": {"c": np.asarray(1j)}})
    with pytest.raises(TypeError, match=r"'s'.*dtype <U1"):
        w.write(0, {"s": eqxctx.CallbackSummary(lambda: np.asarray("a"))})
    with pytest.raises(TypeError, match="summaries"):  # beartype's or ours
        w.write(0, [1.0])  # pyright: ignore[reportArgumentType]
    with pytest.raises(
        TypeError, match=r"^`JsonlWriter.write`: the value at 'x' has type str"
    ):
        w.write(0, {"x": "text"})
    with pytest.raises((ValueError, TypeError), match="mode"):  # beartype's or ours
        JsonlWriter(tmp_path / "t.jsonl", mode="r")  # pyright: ignore[reportArgumentType]
    w.close()
    w.close()  # closing twice is fine
    with pytest.raises(ValueError, match="closed"):
        w.write(0, {"x": 1.0})
    assert (tmp_path / "s.jsonl").read_text() == ""  # nothing half-written


@pytest.mark.parametrize(
    ("summaries", "message"),
    [
        # A flat name with "/" would collide with a nested one: both are refused.
        ({"a/b": 1, "a": {"b": 2}}, r"invalid summary name 'a/b' at the top level"),
        ({"a": {"": 1}}, r"invalid summary name '' under 'a'"),
        ({"a": {"x/y": 1}}, r"invalid summary name 'x/y' under 'a'"),
        # A callback's mapping is expanded into path/key: it may not hit a sibling.
        (
            {"a": eqxctx.CallbackSummary(lambda: {"b": 1.0}), "a/b": 5.0},
            r"invalid summary name 'a/b'",
        ),
        (
            {"a": eqxctx.CallbackSummary(lambda: {"b": {"c": 1.0}, "s/t": 2.0})},
            r"invalid summary name 's/t' under 'a'",
        ),
    ],
)
def test_writers_never_drop_a_value(
    tmp_path: Path, summaries: dict[str, Any], message: str
) -> None:
    for writer in (
        JsonlWriter(tmp_path / "s.jsonl"),
        TensorBoardWriter(tmp_path / "tb"),
    ):
        with writer, pytest.raises(ValueError, match=message):
            writer.write(0, summaries)
    assert (tmp_path / "s.jsonl").read_text() == ""


def test_writers_report_colliding_paths(tmp_path: Path) -> None:
    # A scan's `iter` entry stands for children iter0, iter1: a user child `iter0`
    # (raw mapping) or a callback mapping at `iter0` gets the same paths.
    stacked = eqxctx.IterationSummaries(2, {"loss": jnp.arange(2.0)})
    child = {"iter": stacked, "iter0": {"loss": 9.0}}
    callback = {"iter": stacked, "iter0": eqxctx.CallbackSummary(lambda: {"loss": 9.0})}
    for summaries in (child, callback):
        for writer in (
            JsonlWriter(tmp_path / "s.jsonl"),
            TensorBoardWriter(tmp_path / "tb"),
        ):
            # The collection refuses the layout (`iter0` is reserved by `iter`), or
            # the writer finds the colliding path: either way nothing is written.
            with writer, pytest.raises(ValueError, match="iter0"):
                writer.write(0, summaries)
    assert (tmp_path / "s.jsonl").read_text() == ""
    with pytest.raises(ValueError, match="iter0"):
        eqxctx.SummaryAccumulator().update(child)
    with pytest.raises(ValueError, match="invalid summary name 'a/b'"):
        eqxctx.SummaryAccumulator().update({"a/b": 1.0, "a": {"b": 2.0}})
    # Without a collision every value is written.
    with JsonlWriter(tmp_path / "ok.jsonl") as w:
        w.write(1, {"iter": stacked, "iter2": {"loss": 9.0}})
    assert read_jsonl(tmp_path / "ok.jsonl") == [
        {"step": 1, "iter0/loss": 0.0, "iter1/loss": 1.0, "iter2/loss": 9.0}
    ]


FULL_DISK = r"""
import errno, resource, sys
import numpy as np
from eqxctx.writers import AsyncWriter, JsonlWriter

path, mode, limit, wrap = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
w = JsonlWriter(path, mode=mode)
if wrap == "async":
    w = AsyncWriter(w)
# A file-size limit stands in for a full disk: write() fails with EFBIG (Python
# ignores SIGXFSZ) after writing what fits.
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
written = 0
try:
    for step in range(100):
        w.write(step, {"x": np.arange(12.0) + step})
        w.flush()
        written += 1
except OSError as e:
    assert e.errno == errno.EFBIG, e
    print("raised", type(e).__name__, e.errno)
print("written", written)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
with open(path, "rb") as f, open(path + ".at_failure", "wb") as g:
    g.write(f.read())
if wrap == "direct":  # room again: the writer goes on after the failed line
    w.write(1000, {"x": np.arange(12.0)})
    w.close()
"""


@pytest.mark.parametrize(
    ("mode", "wrap"), [("a", "direct"), ("w", "direct"), ("a", "async")]
)
def test_jsonl_full_disk_leaves_only_whole_lines(
    tmp_path: Path, mode: str, wrap: str
) -> None:
    # Issue 35 item 7: a full disk (here a file-size limit) left a half-written
    # last line.
    path = tmp_path / "s.jsonl"
    path.write_text('{"step": -1}\n')
    limit = 350  # bytes: the old line, 4 whole lines, part of a fifth
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(path), mode, str(limit), wrap],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},  # also on an accelerator host
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "raised OSError 27" in done.stdout  # EFBIG reached the caller
    written = int(done.stdout.split("written ")[1])
    assert 3 <= written <= 5
    old = [-1] if mode == "a" else []
    again = [1000] if wrap == "direct" else []
    # Right after the failure, and at the end (the writer went on or was closed).
    for file, steps in [
        (tmp_path / "s.jsonl.at_failure", old + list(range(written))),
        (path, old + list(range(written)) + again),
    ]:
        data = file.read_bytes()
        assert data.endswith(b"\n")
        assert b"\0" not in data  # no hole where a line was cut
        lines = [json.loads(line) for line in data.decode().splitlines()]
        assert [line["step"] for line in lines] == steps
        for line in lines[len(old) :]:
            step = line["step"] if line["step"] != 1000 else 0
            assert line["x"] == (np.arange(12.0) + step).tolist()


def test_jsonl_unwritable_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError):  # noqa: PT011
        JsonlWriter(blocker / "s.jsonl")


# -- TensorBoard -----------------------------------------------------------------


def test_tensorboard_every_summary_kind(tmp_path: Path) -> None:
    gray = np.linspace(0.0, 1.0, 2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    rgb = np.full((1, 5, 6, 3), 255, dtype=np.uint8)
    audio = np.stack([np.linspace(-1.0, 1.0, 50), np.zeros(50)], axis=1)
    hist = np.asarray([[0.0, 1.0], [2.0, np.nan]], dtype=np.float32)
    summaries = {
        "scalar": jnp.float32(1.5),
        "weighted": eqxctx.WeightedSummary(jnp.float32(2.0), jnp.float32(4.0)),
        "min": eqxctx.MinSummary(jnp.int32(-3)),
        "flag": True,
        "gray": eqxctx.ImageSummary(gray),
        "rgb": eqxctx.ImageSummary(rgb),
        "audio": eqxctx.AudioSummary(audio, sample_rate=8000),
        "hist": eqxctx.HistogramSummary(hist),
        "hist_scalar": eqxctx.HistogramSummary(jnp.float32(4.0)),
        "all_nan": eqxctx.HistogramSummary(np.full(3, np.nan)),
        "ranged": eqxctx.HistogramSummary(hist, bins=4, range=(-2, 6)),
        "moments": eqxctx.MomentsSummary(hist),
        "vector": jnp.arange(5, dtype=jnp.float32),
        "callback": eqxctx.CallbackSummary(lambda: {"a": 1.0, "b": np.ones(2)}),
    }
    line = write_both(tmp_path, 4, summaries)
    values = {v.tag: v for _, v in summary_values(str(tmp_path))}
    kinds = {tag: v.WhichOneof("value") for tag, v in values.items()}
    moments = ("count", "mean", "variance", "min", "max", "nonfinite")
    assert kinds == {
        "scalar": "simple_value",
        "weighted": "simple_value",
        "min": "simple_value",
        "flag": "simple_value",
        "gray": "tensor",
        "rgb": "tensor",
        "audio": "audio",
        "hist": "histo",
        "hist_scalar": "histo",
        "ranged": "histo",
        **{f"moments/{k}": "simple_value" for k in moments},
        "vector": "histo",
        "callback/a": "simple_value",
        "callback/b": "histo",
    }
    # Tags equal the JSONL keys (all_nan counted nothing: JSONL only).
    assert set(line) - {"step"} == {*kinds, "all_nan"}
    assert line["all_nan"] == {"edges": [], "counts": []}
    assert {s for s, _ in summary_values(str(tmp_path))} == {4}
    got = scalars(str(tmp_path))
    for k in ("mean", "variance", "min", "max"):  # NaN is written as it is
        assert np.isnan(got.pop((4, f"moments/{k}")))
    assert got == {
        (4, "scalar"): 1.5,
        (4, "weighted"): 2.0,
        (4, "min"): -3.0,
        (4, "flag"): 1.0,
        (4, "callback/a"): 1.0,
        (4, "moments/count"): 4.0,
        (4, "moments/nonfinite"): 1.0,
    }
    # Images: TensorBoard's image format, one PNG per batch entry.
    for tag, expected in (("gray", gray), ("rgb", rgb)):
        w, h, *pngs = values[tag].tensor.string_val
        assert values[tag].metadata.plugin_data.plugin_name == "images"
        assert (int(w), int(h), len(pngs)) == (
            expected.shape[2],
            expected.shape[1],
            len(expected),
        )
        for png, image in zip(pngs, expected, strict=True):
            want = image if image.dtype == np.uint8 else np.round(image * 255)
            decoded = np.asarray(Image.open(io.BytesIO(png)))
            np.testing.assert_array_equal(decoded, want.astype(np.uint8))
    # Audio: 16-bit WAV at the summary's sample rate, scaled by 32768 (TF).
    au = values["audio"].audio
    assert (au.sample_rate, au.num_channels, au.length_frames) == (8000, 2, 50)
    with wave.open(io.BytesIO(au.encoded_audio_string)) as wav:
        assert wav.getframerate() == 8000
        frames = np.frombuffer(wav.readframes(50), dtype="<i2").reshape(50, 2)
    expected = np.clip(np.round(audio * 32768), -32768, 32767)
    np.testing.assert_array_equal(frames, expected)
    # Histograms from on-device counts: the non-empty span of the buckets.
    h = values["ranged"].histo
    assert (h.min, h.max, h.num) == (0.0, 4.0, 3.0)
    assert (list(h.bucket_limit), list(h.bucket)) == ([2.0, 4.0], [2.0, 1.0])
    h = values["hist"].histo  # TF's default buckets: 0.0, 1.0, 2.0 counted
    assert (h.num, sum(h.bucket), h.min) == (3, 3, 0.0)
    assert 2.0 < h.max <= 2.2
    # A raw array: its finite values in TF's buckets, exact min/max/sum.
    v = values["vector"].histo
    assert (sum(v.bucket), v.num, v.min, v.max, v.sum) == (5, 5, 0.0, 4.0, 10.0)
    assert values["hist_scalar"].histo.num == 1


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_tensorboard_arrays_of_each_rank(tmp_path: Path, rank: int) -> None:
    arr = np.arange(np.prod((2, 3, 4)[:rank]), dtype=np.float32).reshape(
        (2, 3, 4)[:rank]
    )
    write_both(tmp_path, 0, {"a": {"x": arr}})
    ((step, value),) = summary_values(str(tmp_path))
    assert (step, value.tag) == (0, "a/x")
    if rank == 0:
        assert value.simple_value == float(arr)
    else:
        assert (value.histo.num, value.histo.sum) == (arr.size, float(arr.sum()))


def test_int16_audio_is_written_as_its_pcm_samples(tmp_path: Path) -> None:
    # int16 PCM (as read from a WAV file) is written unchanged, not saturated by
    # the [-1, 1] float scale.
    pcm = np.asarray([[0, -32768], [32767, 1], [-2, 12345]], dtype=np.int16)
    ctx = eqxctx.Context.root().add_summary("au", eqxctx.AudioSummary(jnp.asarray(pcm)))
    line = write_both(tmp_path, 1, ctx.collection.summaries)
    assert line["au"] == pcm.tolist()
    ((_, value),) = summary_values(str(tmp_path))
    assert value.audio.num_channels == 2
    with wave.open(io.BytesIO(value.audio.encoded_audio_string)) as wav:
        frames = np.frombuffer(wav.readframes(3), dtype="<i2").reshape(3, 2)
    np.testing.assert_array_equal(frames, pcm)


def test_tensorboard_mono_audio_and_clipping(tmp_path: Path) -> None:
    audio = np.asarray([0.0, 0.5, 2.0, -3.0], dtype=np.float32)
    write_both(tmp_path, 1, {"au": eqxctx.AudioSummary(audio)})
    ((_, value),) = summary_values(str(tmp_path))
    assert (value.audio.sample_rate, value.audio.num_channels) == (16000, 1)
    with wave.open(io.BytesIO(value.audio.encoded_audio_string)) as wav:
        frames = np.frombuffer(wav.readframes(4), dtype="<i2")
    np.testing.assert_array_equal(frames, [0, 16384, 32767, -32768])  # TF's scale


def test_tensorboard_scalars_equal_jsonl_over_steps(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    lines = []
    with JsonlWriter(tmp_path / "s.jsonl") as jw, TensorBoardWriter(tmp_path) as tw:
        for step in range(5):
            summaries = {
                "train": {"loss": jnp.float32(rng.normal())},
                "iter": eqxctx.IterationSummaries(
                    3, {"rms": jnp.asarray(rng.normal(size=3), dtype=jnp.float32)}
                ),
            }
            jw.write(step, summaries)
            tw.write(step, summaries)
    for line in read_jsonl(tmp_path / "s.jsonl"):
        lines.extend(
            ((line["step"], k), np.float32(v)) for k, v in line.items() if k != "step"
        )
    assert len(lines) == 5 * 4
    assert scalars(str(tmp_path)) == dict(lines)


def test_tensorboard_errors_and_close(tmp_path: Path) -> None:
    w = TensorBoardWriter(tmp_path)
    with pytest.raises(ValueError, match="step must be >= 0"):
        w.write(-2, {})
    w.flush()
    path = w.path
    assert path is not None
    assert Path(path).parent == tmp_path
    w.close()
    w.close()
    assert w.path == path  # the file written, for reading it back
    assert Path(path).exists()
    with pytest.raises(ValueError, match="closed"):
        w.write(0, {"x": 1.0})


def test_tensorboard_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ImportError, match=r"eqxctx\[tensorboard\]"):
        TensorBoardWriter(os.devnull)


nested = st.recursive(
    hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=0, max_dims=3, max_side=3),
        elements=st.floats(-1e6, 1e6, width=32),
    ),
    lambda children: st.dictionaries(
        st.from_regex(r"[a-z]{1,3}", fullmatch=True), children, min_size=1, max_size=3
    ),
    max_leaves=6,
)


@given(
    tree=st.dictionaries(
        st.from_regex(r"[a-z]{1,3}", fullmatch=True), nested, min_size=1, max_size=3
    )
)
def test_writers_agree_with_flatten(
    tmp_path_factory: pytest.TempPathFactory, tree: dict[str, Any]
) -> None:
    tmp = tmp_path_factory.mktemp("w")
    line = write_both(tmp, 2, tree)
    flat = eqxctx.OutputCollection(tree, {}, {}).flatten("summaries")
    assert list(line) == ["step", *flat]
    for key, arr in flat.items():
        np.testing.assert_array_equal(np.asarray(line[key], dtype=np.float32), arr)
    expected = {(2, k): float(v) for k, v in flat.items() if v.ndim == 0}
    assert scalars(str(tmp)) == expected
    histos = {
        v.tag for _, v in summary_values(str(tmp)) if v.WhichOneof("value") == "histo"
    }
    assert histos == {k for k, v in flat.items() if v.ndim > 0 and v.size > 0}


# -- TensorBoard: no lost data, checks before writing ------------------------------


def test_tensorboard_writers_on_one_logdir_keep_all_events(tmp_path: Path) -> None:
    # tensorboardX named files by the second and truncated each other's.
    writers = [TensorBoardWriter(tmp_path) for _ in range(4)]
    for step in range(100):
        for k, w in enumerate(writers):
            w.write(step, {f"w{k}": float(step)})
    for w in writers:
        w.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 4
    assert all(name.startswith("events.out.tfevents.") for name in files)
    got = scalars(str(tmp_path))
    assert len(got) == 400
    assert got == {(s, f"w{k}"): float(s) for s in range(100) for k in range(4)}


@pytest.mark.parametrize(
    ("a", "b"), [("a b", "a_b"), ("loss(train)", "loss[train]"), ("a:b", "a=b")]
)
def test_tensorboard_tag_collisions_raise(tmp_path: Path, a: str, b: str) -> None:
    with TensorBoardWriter(tmp_path) as w:
        with pytest.raises(eqxctx.OutputConflictError) as info:
            w.write(0, {a: 1.0, b: 2.0})
        assert repr(a) in str(info.value)
        assert repr(b) in str(info.value)
        w.write(1, {a: 1.0})  # alone it is fine (sanitized)
    assert list(scalars(str(tmp_path))) == [(1, re.sub(r"[^-/\w.]", "_", a))]


def test_tensorboard_tag_collisions_across_writes_raise(tmp_path: Path) -> None:
    with TensorBoardWriter(tmp_path) as w:
        w.write(0, {"eval": {"top 1": 0.9}})
        with pytest.raises(eqxctx.OutputConflictError) as info:
            w.write(0, {"eval": {"top_1": 0.1}})  # another call site, same tag
        assert "'eval/top 1'" in str(info.value)
        assert "'eval/top_1'" in str(info.value)
        for step in range(1, 4):  # the same path again is fine (replayed reads too)
            w.write(step, {"eval": {"top 1": jnp.float32(step)}})
        with pytest.raises(eqxctx.OutputConflictError, match="'eval/top_1'"):
            w.write(4, {"eval": {"top_1": jnp.float32(4.0)}})
    assert scalars(str(tmp_path)) == {
        (0, "eval/top_1"): pytest.approx(0.9),
        **{(step, "eval/top_1"): float(step) for step in range(1, 4)},
    }


@pytest.mark.parametrize(
    ("leaf", "message"),
    [
        (eqxctx.ImageSummary(np.zeros((0, 2, 2))), r"no image or no pixel"),
        (eqxctx.ImageSummary(np.zeros((2, 0, 2, 3))), r"no image or no pixel"),
        (eqxctx.ImageSummary(np.zeros(4)), r"rank 1"),
        (eqxctx.AudioSummary(np.zeros((8, 0))), r"no channel"),
        (eqxctx.AudioSummary(np.zeros(8), sample_rate=0), r"sample_rate must be"),
        (
            eqxctx.AudioSummary(np.zeros(8), sample_rate=2**40),
            r"too high for a WAV file.*sample_rate <= 2147483647",
        ),
        (
            eqxctx.AudioSummary(np.zeros((8, 2)), sample_rate=2**30),
            r"2 channel\(s\) is too high.*sample_rate <= 1073741823",
        ),
        # Integer samples other than int16 PCM have no scale to assume.
        (eqxctx.AudioSummary(np.zeros(8, np.int32)), r"int16 PCM.*dtype int32"),
        (eqxctx.AudioSummary(np.zeros(8, np.uint8)), r"int16 PCM.*dtype uint8"),
        (eqxctx.AudioSummary(np.zeros(8, bool)), r"int16 PCM.*dtype bool"),
    ],
)
def test_writers_validate_media_before_writing(
    tmp_path: Path, leaf: Any, message: str
) -> None:
    for writer in (JsonlWriter(tmp_path / "s.jsonl"), TensorBoardWriter(tmp_path)):
        # From a plain mapping: the writer validates, naming the path.
        with writer, pytest.raises(ValueError, match=rf"'media/x': .*{message}"):
            writer.write(0, {"ok": 1.0, "media": {"x": leaf}})
    assert (tmp_path / "s.jsonl").read_text() == ""
    assert scalars(str(tmp_path)) == {}
    # From a collection: refused where it is added.
    with pytest.raises(ValueError, match=message):
        eqxctx.Context.root().add_summary("x", leaf)


@pytest.mark.parametrize("channels", [1, 2])
def test_audio_sample_rate_up_to_the_wav_header_limit(
    tmp_path: Path, channels: int
) -> None:
    # The WAV header stores sample_rate * channels * 2 (bytes per second) as a
    # uint32: the highest valid rate is written and read back exactly.
    rate = (2**32 - 1) // (2 * channels)
    audio = np.linspace(-1, 1, 10).reshape(5, 2)[:, :channels]
    with TensorBoardWriter(tmp_path) as w:
        w.write(0, {"au": eqxctx.AudioSummary(audio, sample_rate=rate)})
        with pytest.raises(ValueError, match=r"'au': .*too high for a WAV file"):
            w.write(1, {"au": eqxctx.AudioSummary(audio, sample_rate=rate + 1)})
    [(step, value)] = summary_values(str(tmp_path))
    # The proto's sample_rate is a float32 (TensorBoard's); the header is exact.
    assert (step, value.audio.sample_rate, value.audio.num_channels) == (
        0,
        float(np.float32(rate)),
        channels,
    )
    with wave.open(io.BytesIO(value.audio.encoded_audio_string)) as wav:
        assert (wav.getframerate(), wav.getnchannels()) == (rate, channels)
        frames = np.frombuffer(wav.readframes(5), dtype="<i2").reshape(5, channels)
    expected = np.clip(np.round(audio * 32768), -32768, 32767)
    np.testing.assert_array_equal(frames, expected)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_queue": 0}, ValueError, r"max_queue must be an int >= 1.*got 0"),
        ({"max_queue": 1.5}, TypeError, r"max_queue must be an int >= 1.*float 1.5"),
        ({"max_queue": True}, TypeError, r"max_queue must be an int >= 1.*bool"),
        ({"flush_secs": -1}, ValueError, r"flush_secs must be a number .* got -1"),
        ({"flush_secs": float("nan")}, ValueError, r"flush_secs must be .* got nan"),
        ({"flush_secs": "10"}, TypeError, r"flush_secs must be a number.*str '10'"),
    ],
)
def test_tensorboard_writer_checks_its_arguments(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=r"^`TensorBoardWriter\(logdir, .*" + message):
        TensorBoardWriter(tmp_path, **kwargs)
    assert os.listdir(tmp_path) == []  # refused before the event file is made
    # The limits themselves are accepted (flush_secs=0 flushes at every write).
    with TensorBoardWriter(tmp_path, max_queue=1, flush_secs=0) as w:
        w.write(0, {"x": 1.0})
        w.write(1, {"x": 2.0})
        assert scalars(str(tmp_path)) == {(0, "x"): 1.0, (1, "x"): 2.0}


def test_writers_check_the_step_range(tmp_path: Path) -> None:
    for writer in (JsonlWriter(tmp_path / "s.jsonl"), TensorBoardWriter(tmp_path)):
        with writer:
            with pytest.raises(ValueError, match=r"at most 2\*\*63 - 1"):
                writer.write(2**63, {"x": 1.0})
            writer.write(np.int64(2**63 - 1), {"x": 1.0})
    assert read_jsonl(tmp_path / "s.jsonl") == [{"step": 2**63 - 1, "x": 1.0}]
    assert scalars(str(tmp_path)) == {(2**63 - 1, "x"): 1.0}


def test_callback_summaries_get_numpy_arrays(tmp_path: Path) -> None:
    seen: list[type] = []

    def fn(x: Any, *, y: Any) -> Any:
        seen.extend([type(x), type(y)])
        return np.sum(x) + y

    def f(x: jax.Array) -> eqxctx.OutputCollection:
        callback = eqxctx.CallbackSummary(fn, x, y=x[0])
        return eqxctx.OutputCollection.empty().add_summary("cb", callback)

    line = write_both(tmp_path, 0, jax.jit(f)(jnp.arange(3.0)))
    assert line["cb"] == 3.0
    assert seen == [np.ndarray, np.ndarray] * 2  # once per writer


def test_tensorboard_non_finite_scalars_are_silent(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with TensorBoardWriter(tmp_path) as w:
        w.write(
            0, {"nan": np.float32(np.nan), "inf": np.inf, "v": np.array([np.nan, 1])}
        )
    out, err = capfd.readouterr()
    assert "NaN" not in out + err + caplog.text
    got = scalars(str(tmp_path))
    assert np.isnan(got[(0, "nan")])
    assert got[(0, "inf")] == np.inf


# -- the JSON lines writer's float32 conversion -------------------------------------


_EDGE_FLOAT32 = [
    0.1,
    1 / 3,
    2.5,
    2.0**25,
    2.0**-130,
    1e-12,
    9.999999e-13,
    16777215.0,
    16777216.0,
    123456.79,
    3.4028235e38,
    -0.0,
    0.0,
    1.0,
    -7.25e-5,
]


def _shortest(v: np.floating[Any]) -> float | None:
    """NumPy's shortest decimal of a float32 (None for NaN and infinities)."""
    return float(str(np.float32(v))) if np.isfinite(v) else None


@given(
    hnp.arrays(
        np.float32,
        st.integers(0, 64),
        elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
    )
)
def test_jsonl_float32_is_numpys_shortest_decimal(values: np.ndarray) -> None:
    # issue 36: orjson writes float32 arrays and scalars with their shortest
    # decimal, the one NumPy's `str` gives (`0.1`, not `0.10000000149011612`).
    from eqxctx.writers._base import HostSummaries
    from eqxctx.writers._jsonl import json_line

    powers = np.float32(10.0) ** np.arange(-45, 39, dtype=np.float32)
    edges = [np.asarray(_EDGE_FLOAT32, np.float32), powers, -powers * 1.5]
    values = np.concatenate([values, *edges, np.nextafter(powers, 0)])
    scalars = {f"s{i}": np.asarray(v) for i, v in enumerate(values)}
    line = json_line(HostSummaries(0, {"all": values, **scalars}))
    want = [_shortest(v) for v in values]
    got = json.loads(line)
    assert got == {"step": 0, "all": want, **dict(zip(scalars, want, strict=True))}


def test_jsonl_float32_near_one_is_shortest() -> None:
    from eqxctx.writers._base import HostSummaries
    from eqxctx.writers._jsonl import json_line

    bits = np.arange(0x3F800000 - 20_000, 0x3F800000 + 20_000, dtype=np.uint32)
    values = bits.view(np.float32)
    got = json.loads(json_line(HostSummaries(0, {"v": values})))["v"]
    assert got == [float(str(v)) for v in values]


def test_jsonl_per_iteration_floats_are_shortest(tmp_path: Path) -> None:
    def body(c: jax.Array, x: jax.Array, ctx: eqxctx.Context) -> Any:
        return c, None, ctx.add_summary("v", x / 10).add_summary("n", jnp.int32(7))

    _, _, coll = eqxctx.scan_in_context(
        body, context=eqxctx.Context.root(), carry=jnp.zeros(()), xs=jnp.arange(4.0)
    )
    path = tmp_path / "s.jsonl"
    with JsonlWriter(path) as writer:
        writer.write(0, coll)
    record = json.loads(path.read_text())
    assert record == {
        "step": 0,
        **{f"iter{i}/v": float(str(np.float32(i) / np.float32(10))) for i in range(4)},
        **{f"iter{i}/n": 7 for i in range(4)},
    }
    assert '"iter1/v":0.1,' in path.read_text()


def test_fetch_checks_built_in_kinds_read_from_their_fields() -> None:
    # The fast path for WeightedSummary/Min/Max/Sum/Moments gives `value()` and
    # keeps `validate`'s check (a WeightedSummary built without its checks).
    bad = jax.tree.unflatten(
        jax.tree.structure(eqxctx.WeightedSummary(1.0, 1.0)),
        [np.zeros(3, np.float32), np.ones(2, np.float32)],
    )
    with pytest.raises(ValueError, match=r"fetch_summaries.*'w'.*weight has shape"):
        fetch_summaries({"w": bad})
    values = fetch_summaries(
        {
            "w": eqxctx.WeightedSummary(jnp.float32(2.0), jnp.float32(3.0)),
            "s": eqxctx.SumSummary(jnp.arange(3)),
            "m": eqxctx.MomentsSummary(jnp.asarray([1.0, 3.0])),
        }
    )
    np.testing.assert_array_equal(values["w"], 2.0)
    np.testing.assert_array_equal(values["s"], [0, 1, 2])
    np.testing.assert_array_equal(values["m/variance"], 1.0)
    np.testing.assert_array_equal(values["m/count"], 2)


def _json_value_per_value(arr: np.ndarray) -> Any:
    """The value read back, per value: `str(np.float32(v))`'s decimal, None if
    not finite; bools as 0/1; float64 exact."""
    if arr.dtype.kind == "b":
        return arr.astype(np.int64).tolist()
    if arr.dtype.kind in "iu":
        return arr.tolist()
    if arr.dtype.itemsize <= 4:
        short = [_shortest(v) for v in arr.astype(np.float32).ravel()]
    else:
        short = [float(v) if np.isfinite(v) else None for v in arr.ravel()]
    if arr.ndim == 0:
        return short[0]
    return np.asarray(short, dtype=object).reshape(arr.shape).tolist()


@given(
    bits32=hnp.arrays(np.uint32, st.integers(0, 40)),
    bits16=hnp.arrays(np.uint16, st.integers(0, 40)),
    rows=st.integers(1, 4),
)
def test_jsonl_text_matches_per_value_conversion_on_bit_patterns(
    bits32: np.ndarray, bits16: np.ndarray, rows: int
) -> None:
    # Random bit patterns (subnormals, NaN payloads, -0.0, powers of two, ...), as
    # 0-d values (converted together) and as arrays, in every float dtype.
    from eqxctx.writers._base import HostSummaries
    from eqxctx.writers._jsonl import json_line

    f32 = bits32.view(np.float32)
    values: dict[str, np.ndarray] = {
        "f32": f32,
        "f32_2d": np.resize(f32, (rows, f32.size)),
        "f16": bits16.view(np.float16),
        "bf16": bits16.view(jnp.bfloat16),
        "f64": f32.astype(np.float64),
        "i": bits32.astype(np.int64),
    }
    for i, v in enumerate(f32):
        values[f"s{i}"] = np.asarray(v)
    for i, v in enumerate(bits16.view(np.float16)):
        values[f"h{i}"] = np.asarray(v)
        values[f"b{i}"] = np.asarray(bits16[i : i + 1].view(jnp.bfloat16)[0])
    got = json.loads(json_line(HostSummaries(7, values)))
    want = {"step": 7, **{p: _json_value_per_value(v) for p, v in values.items()}}
    assert got == want


# -- per-iteration rows: formatted from their stacked arrays ------------------------


def _dict_line(step: int, summaries: Any) -> bytes:
    """The JSON line through the per-value path: `json_line` of a plain dict."""
    from eqxctx.writers._base import HostSummaries
    from eqxctx.writers._jsonl import json_line

    return json_line(HostSummaries(step, fetch_summaries(summaries)))


@given(
    bits=hnp.arrays(np.uint32, st.integers(1, 40)),
    ints=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=4),
)
def test_jsonl_rows_text_equals_per_value_text(
    bits: np.ndarray, ints: list[int]
) -> None:
    # Every float32 bit pattern (NaN, infinities, -0.0, subnormals), float16, float64,
    # int and bool rows, rows of vectors, next to plain values and a later scan.
    f32 = bits.view(np.float32)
    n = f32.size

    def body(c: jax.Array, x: Any, ctx: eqxctx.Context) -> Any:
        f, i = x
        ctx = ctx.add_summary("f", f).add_summary("h", f.astype(jnp.float16))
        ctx = ctx.add_summary("d", i.astype(jnp.float32) * 0.5)
        ctx = ctx.add_summary("i", i).add_summary("b", f > 0)
        return c, None, ctx.add_summary("vec", jnp.stack([f, -f]))

    ints_arr = jnp.asarray(np.resize(np.asarray(ints, np.int32), n))
    root = eqxctx.Context.root().add_summary("before", jnp.float32(0.25))
    _, _, coll = eqxctx.scan_in_context(
        body, context=root, carry=jnp.zeros(()), xs=(jnp.asarray(f32), ints_arr)
    )
    summaries = {"a": coll, "z": {"last": np.float64(1 / 3)}, "b": coll}
    from eqxctx.writers._base import HostSummaries
    from eqxctx.writers._jsonl import json_line
    from eqxctx.writers._read import host_values

    host = HostSummaries(3, host_values(summaries, where="test"))
    assert json_line(host) == _dict_line(3, summaries)
    # The mapping writers read equals `fetch_summaries`'s dict, in order.
    want = fetch_summaries(summaries)
    assert list(host.values) == list(want)
    assert len(host.values) == len(want)
    for path, value in want.items():
        assert path in host.values
        got = host.values[path]
        assert type(got) is type(value)
        np.testing.assert_array_equal(got, value)
    assert "step" not in host.values


def test_rows_never_share_a_path_with_another_entry() -> None:
    # A plain mapping can put `iter1` (or a second scan whose rows spell the same
    # paths) next to a scan's rows: refused, naming the path; nothing is dropped.
    def body(c: jax.Array, x: jax.Array, ctx: eqxctx.Context) -> Any:
        return c, None, ctx.add_summary("v", x)

    def scan(n: int) -> Any:
        root = eqxctx.Context.root()
        _, _, coll = eqxctx.scan_in_context(
            body, context=root, carry=jnp.zeros(()), xs=jnp.arange(float(n))
        )
        return coll.summaries["iter"]

    cases = [
        {"iter1": {"v": 1.0}, "iter": scan(3)},
        {"iter": scan(3), "iter1": {"v": 1.0}},
        {"iter": scan(12), "iter1": scan(1)},  # both spell 'iter10/v'
    ]
    for case in cases:
        with pytest.raises(ValueError, match=r"iter1"):
            fetch_summaries({"a": case})


def _reference_values(coll: eqxctx.OutputCollection, name: str) -> dict[str, Any]:
    """`{path: NumPy value}` from the per-iteration views (`flatten`), no writer."""
    out: dict[str, Any] = {}
    for path, leaf in coll.flatten("summaries").items():
        path = f"{name}/{path}"
        if isinstance(leaf, eqxctx.MomentsSummary):
            count = np.asarray(leaf.count)
            m2 = np.asarray(leaf.m2)
            out[f"{path}/count"] = count
            out[f"{path}/mean"] = np.asarray(leaf.mean)
            out[f"{path}/variance"] = m2 / np.maximum(count, 1).astype(m2.dtype)
            out[f"{path}/min"] = np.asarray(leaf.min_)
            out[f"{path}/max"] = np.asarray(leaf.max_)
            out[f"{path}/nonfinite"] = np.asarray(leaf.nonfinite)
        elif isinstance(leaf, eqxctx.Summary):
            out[path] = np.asarray(leaf.value())
        else:
            out[path] = np.asarray(leaf)
    return out


def _built_in_kinds_body(c: jax.Array, x: Any, ctx: eqxctx.Context) -> Any:
    v, w = x
    ctx = ctx.add_summary("w", eqxctx.WeightedSummary(v.mean(), w))
    ctx = ctx.add_summary("wv", eqxctx.WeightedSummary(v, w * jnp.ones_like(v)))
    ctx = ctx.add_summary("m", eqxctx.MomentsSummary(v))
    ctx = ctx.add_summary("lo", eqxctx.MinSummary(v.min()))
    ctx = ctx.add_summary("hi", eqxctx.MaxSummary(v))
    ctx = ctx.add_summary("n", eqxctx.SumSummary(jnp.int32(3)))
    return c + v.sum(), None, ctx.add_summary("raw", v[0])


@pytest.mark.parametrize("mapped", [False, True])
def test_built_in_kinds_in_rows_equal_per_iteration_values(mapped: bool) -> None:
    # Built-in summaries of a per-iteration entry are read from their stacked
    # fields (one `Rows` part); the values, paths and order equal the per-iteration
    # views, also under an outer `vmap` (the iteration axis is not the first).
    v = jax.random.normal(jax.random.PRNGKey(0), (5, 3), jnp.float32)
    w = jnp.asarray([0.0, 1.0, 2.5, 3.0, 0.5], jnp.float32)

    def run(v: jax.Array, w: jax.Array) -> eqxctx.OutputCollection:
        _, _, coll = eqxctx.scan_in_context(
            _built_in_kinds_body,
            context=eqxctx.Context.root(),
            carry=jnp.zeros(()),
            xs=(v, w),
        )
        return coll

    coll = jax.vmap(run)(jnp.stack([v, -v]), jnp.stack([w, w])) if mapped else run(v, w)
    from eqxctx.writers._base import HostSummaries
    from eqxctx.writers._host import Rows
    from eqxctx.writers._jsonl import json_line
    from eqxctx.writers._read import host_values

    host = host_values({"train": coll}, where="test")
    assert [type(part) for part in host.parts] == [Rows]
    want = _reference_values(coll, "train")
    assert list(host) == list(want)
    for path, value in want.items():
        got = host[path]
        assert type(got) is np.ndarray
        assert got.dtype == value.dtype, path
        assert got.shape == value.shape, path
        np.testing.assert_array_equal(got, value, err_msg=path)
    record = HostSummaries(2, host)
    assert json_line(record) == json_line(HostSummaries(2, dict(host.items())))


def test_negative_weight_in_rows_names_its_iteration() -> None:
    # The stacked read refuses the entry; the per-iteration read raises naming
    # the iteration, as before.
    v = jnp.ones((3, 2), jnp.float32)
    w = np.asarray([1.0, -2.0, 1.0], np.float32)
    _, _, coll = eqxctx.scan_in_context(
        _built_in_kinds_body,
        context=eqxctx.Context.root(),
        carry=jnp.zeros(()),
        xs=(v, w),
    )
    with pytest.raises(ValueError, match=r"'train/iter1/w'.*must not be negative"):
        fetch_summaries({"train": coll})


def test_bfloat16_rows_are_written_as_float32_shortest_decimals() -> None:
    # bfloat16 has NumPy kind "V": rows of it (raw, or a built-in summary's field)
    # are written as the per-value path writes them (found by a break-test).
    def body(c: jax.Array, x: jax.Array, ctx: eqxctx.Context) -> Any:
        v = (x + 0.1).astype(jnp.bfloat16)
        ctx = ctx.add_summary("w", eqxctx.WeightedSummary(v, 1.0))
        ctx = ctx.add_summary("raw", v)
        return c, None, ctx.add_summary("lo", eqxctx.MinSummary(v))

    _, _, coll = eqxctx.scan_in_context(
        body, context=eqxctx.Context.root(), carry=jnp.zeros(()), xs=jnp.arange(3.0)
    )
    from eqxctx.writers._base import HostSummaries
    from eqxctx.writers._jsonl import json_line
    from eqxctx.writers._read import host_values

    host = HostSummaries(1, host_values({"t": coll}, where="test"))
    line = json_line(host)
    assert line == _dict_line(1, {"t": coll})
    assert b'"t/iter0/w":0.100097656' in line


def test_a_refused_column_in_rows_names_its_own_path() -> None:
    # A complex raw value next to a built-in summary in one scan entry: the error
    # names the complex value's path (found by a break-test).
    def body(c: jax.Array, x: jax.Array, ctx: eqxctx.Context) -> Any:
        ctx = ctx.add_summary("a", eqxctx.WeightedSummary(x, 1.0))
        return c, None, ctx.add_summary("z", x.astype(jnp.complex64))

    _, _, coll = eqxctx.scan_in_context(
        body, context=eqxctx.Context.root(), carry=jnp.zeros(()), xs=jnp.arange(3.0)
    )
    with pytest.raises(TypeError, match=r"'train/iter0/z' is complex"):
        fetch_summaries({"train": coll})


def test_media_returned_by_a_callback_are_checked_before_anything_is_written(
    tmp_path: Path,
) -> None:
    from eqxctx.writers import MultiWriter

    bad_image = eqxctx.ImageSummary(np.zeros((2, 2), np.float32))  # rank 2
    bad_audio = eqxctx.AudioSummary(np.zeros(4, np.float32), sample_rate=8000)
    object.__setattr__(bad_audio, "sample_rate", 0)  # as if built without checks
    for name, bad, message in (
        ("img", bad_image, r"'cb/img'.*expected shape \[batch, height, width\]"),
        ("a", bad_audio, r"'cb/a'.*sample_rate must be positive"),
    ):
        jsonl = tmp_path / f"{name}.jsonl"
        w = MultiWriter(JsonlWriter(jsonl), TensorBoardWriter(tmp_path / name))
        with pytest.raises(ValueError, match=message):
            w.write(
                0,
                {"cb": eqxctx.CallbackSummary(lambda bad=bad, name=name: {name: bad})},
            )
        w.write(1, {"x": 1.0})
        w.close()
        assert [
            json.loads(line)["step"] for line in jsonl.read_text().splitlines()
        ] == [1]
    good = eqxctx.ImageSummary(np.ones((1, 2, 2, 3), np.uint8))
    with JsonlWriter(tmp_path / "good.jsonl") as w:
        w.write(0, {"cb": eqxctx.CallbackSummary(lambda: {"img": good})})


# Found by a new-user review (issue 36): a resumed job whose process id repeats
# (PID 1 in a container) found two files of its suffix and failed to open.
def test_tensorboard_writer_beside_an_earlier_run_with_the_same_pid(
    tmp_path: Path,
) -> None:
    logdir = str(tmp_path)
    first = TensorBoardWriter(logdir)
    first.write(0, {"a": jnp.float32(1.0)})
    first.close()
    # The earlier run's file, renamed as if written by this process id earlier.
    (old,) = tmp_path.glob("events.out.tfevents.*")
    pid = os.getpid()
    for k in range(4):
        old_copy = tmp_path / f"events.out.tfevents.1.host.{pid}.{k}"
        old_copy.write_bytes(old.read_bytes())
    with TensorBoardWriter(logdir) as writer:
        writer.write(1, {"a": jnp.float32(2.0)})
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 6
    assert scalars(logdir)[(1, "a")] == 2.0


# Found by a new-user review (issue 36): orjson refuses arrays that are not in
# native byte order, and the write failed with no path.
def test_jsonl_writes_arrays_of_either_byte_order(tmp_path: Path) -> None:
    values = np.array([0.1, -2.5, 3e38], np.float32)
    ints = np.array([1, -(2**40)], np.int64)
    with JsonlWriter(tmp_path / "s.jsonl") as writer:
        writer.write(
            0, {"big": values.astype(">f4"), "ints": ints.astype(">i8"), "x": 1.0}
        )
    (line,) = (tmp_path / "s.jsonl").read_text().splitlines()
    record = json.loads(line)
    np.testing.assert_array_equal(np.asarray(record["big"], np.float32), values)
    assert record["ints"] == ints.tolist()

"""TensorBoardWriter: summaries as TensorBoard event files (tensorboardX's protos)."""

import functools
import glob
import io
import itertools
import os
import re
import struct
import time
import uuid
import wave
import zlib
from collections.abc import Mapping
from typing import Any, TypeAlias

import numpy as np

from eqxctx._checks import check_positive_int
from eqxctx._errors import OutputConflictError
from eqxctx._records import Audio, Histogram, Image
from eqxctx._statistics import tensorflow_edges

from ._base import AbstractWriter, HostSummaries, is_writing_process
from ._columns import RowBlock
from ._host import HostValue, HostValues, Rows
from ._jsonl import nonempty_span
from ._tb_rows import DBL_MAX, block_rows, bucket_centers, center_sums


_MISSING = (
    "`TensorBoardWriter` needs the tensorboardX package, which is not installed. "
    "Install eqxctx's `tensorboard` extra: `pip install 'eqxctx[tensorboard]'` (or "
    "`pip install tensorboardX`), or write JSON lines with `eqxctx.writers."
    "JsonlWriter`, which needs nothing else."
)

#: tensorboardX's `_clean_tag`: characters other than these become "_".
_INVALID_TAG_CHARACTERS = re.compile(r"[^-/\w.]")
_DT_STRING = 7  # tensorflow/core/framework/types.proto

#: A tensorboardX protobuf message (`Event`, `Summary.Value`, `HistogramProto`).
#: `Any`: tensorboardX is optional and imported by the writer, so its classes (typed
#: in `typings/tensorboardX`) cannot be named in annotations read at run time.
Proto: TypeAlias = Any


@functools.lru_cache(maxsize=65536)  # the same paths every step
def tag_of(path: str) -> str:
    """Return the TensorBoard tag of a summary path (tensorboardX's `_clean_tag`)."""
    return _INVALID_TAG_CHARACTERS.sub("_", path).lstrip("/")


# The tags of a layout's row paths, by the identity of the paths tuple (one cached
# object per layout, see `_expand._row_paths`); each entry holds its tuple, so
# the id stays its own.
_TAGS: dict[int, tuple[tuple[str, ...], list[str]]] = {}


def _tags(paths: tuple[str, ...]) -> list[str]:
    entry = _TAGS.get(id(paths))
    if entry is not None and entry[0] is paths:
        return entry[1]
    tags = [tag_of(path) for path in paths]
    if len(_TAGS) < 256:
        _TAGS[id(paths)] = (paths, tags)
    return tags


def images_nhwc(images: np.ndarray) -> np.ndarray:
    """Return `uint8[batch, height, width, channels]` from an `ImageSummary` value."""
    if images.ndim == 3:
        images = images[..., None]
    if images.dtype == np.uint8:
        return images
    if images.dtype == np.bool_:
        return images.astype(np.uint8) * np.uint8(255)
    if np.issubdtype(images.dtype, np.integer):
        return np.clip(images, 0, 255).astype(np.uint8)
    floats = np.nan_to_num(images.astype(np.float32), nan=0.0)
    scaled = np.clip(floats, 0.0, 1.0) * np.float32(255.0)
    return np.round(scaled).astype(np.uint8)


def png_bytes(image: np.ndarray) -> bytes:
    """Encode `uint8[height, width, channels]` (1, 3 or 4 channels) as a PNG."""
    height, width, channels = image.shape
    color_type = {1: 0, 3: 2, 4: 6}[channels]  # gray, RGB, RGBA

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    rows = image.reshape(height, width * channels)
    raw = np.concatenate([np.zeros((height, 1), np.uint8), rows], axis=1)  # filter 0
    header = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw.tobytes()))
        + chunk(b"IEND", b"")
    )


def wav_bytes(audio: np.ndarray, sample_rate: int) -> bytes:
    """Encode `audio` (`[time]` or `[time, channels]`) as 16-bit WAV.

    `int16` samples are written as they are. Floating values in [-1, 1] are scaled
    like TensorFlow's `tf.audio.encode_wav`: `round(x * 32768)` clipped to
    `[-32768, 32767]` (NaN as 0).
    """
    if audio.ndim == 1:
        audio = audio[:, None]
    if audio.dtype == np.int16:
        pcm = audio
    else:
        samples = np.nan_to_num(
            audio.astype(np.float64), nan=0.0, posinf=1.0, neginf=-1.0
        )
        pcm = np.clip(np.round(samples * 32768.0), -32768, 32767)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(audio.shape[1])
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm.astype("<i2").tobytes())
    return buffer.getvalue()


#: Each writer's file name ends with `.{pid}.{k}.{random}`: tensorboardX names files
#: by the second and host and opens them "wb", so two writers of one process in one
#: second truncated each other's file.
_WRITERS = itertools.count()


def _events_writer(logdir: str) -> tuple[Proto, str]:
    """A tensorboardX `EventsWriter` on a new file of its own, and the file's path."""
    from tensorboardX.event_file_writer import EventsWriter

    os.makedirs(logdir, exist_ok=True)
    # The process id and a counter keep this process's writers apart; a random part
    # keeps a resumed job (a container's process id repeats) off its earlier files.
    suffix = f".{os.getpid()}.{next(_WRITERS)}.{uuid.uuid4().hex[:8]}"
    writer = EventsWriter(os.path.join(logdir, "events"), suffix)
    (path,) = glob.glob(
        os.path.join(glob.escape(logdir), f"events.out.tfevents.*{suffix}")
    )
    return writer, path


class TensorBoardWriter(AbstractWriter):
    """Write summaries as TensorBoard event files (with tensorboardX's protos).

    The tags are the keys that `JsonlWriter` writes ("/"-joined paths of
    `OutputCollection.flatten("summaries")`, with `.../iter0/...` for the iterations
    of a scan), and every leaf is written as its `Summary.value()`:

    - `ImageSummary` (`[batch, height, width]` or `[batch, height, width,
      channels]`): one PNG per batch entry under one tag, in TensorBoard's image
      format (`tf.summary.image`; a slider picks the entry). Floating values are
      clipped to [0, 1]; `uint8` values are used as they are.
    - `AudioSummary` (`[time]` or `[time, channels]`, in [-1, 1]): audio at its
      `sample_rate`, encoded as 16-bit WAV scaled like TensorFlow's
      `tf.audio.encode_wav` (`x * 32768`, clipped to the int16 range).
    - `HistogramSummary`: a histogram of its counts over the buckets from the first
      to the last non-empty one (`num` is exact; `sum` and `sum_squares` are
      estimated from the bucket centers). One with no count is skipped.
    - `MomentsSummary`: the scalars `path/count`, `path/mean`, `path/variance`,
      `path/min`, `path/max`, `path/nonfinite`.
    - any other value of shape `()` (a raw array, a Python number, a
      `WeightedSummary`'s mean, a `MinSummary`, ...): a scalar (stored as float32;
      NaN and infinities are written as they are, without a message).
    - any other value of higher rank: a histogram of its finite values in
      TensorFlow's default buckets (exact `min`, `max`, `num`, `sum`); one with no
      finite value is skipped.

    Tags are used as they are when they contain only letters, digits and `-_./`
    (always true for eqxctx child names); other characters become `_`, as
    tensorboardX does. Two paths that get one tag raise `OutputConflictError`, in one
    write or in two writes of the same writer (each tag keeps the first path written
    under it).

    Each writer writes one event file of its own with tensorboardX's `EventsWriter`,
    `events.out.tfevents.{time}.{host}.{pid}.{k}.{random}` (`k` counts the writers
    made by the process; 8 random hex digits keep a resumed job whose process id
    repeats off its earlier files): several writers on one `logdir` (even in the
    same second) keep all their events.
    In a multi-process run, create the writer and call `write` on every process
    (after `jax.distributed.initialize`): only process 0 creates and writes a file.

    tensorboardX is imported when the writer is made; install it with eqxctx's
    `tensorboard` extra. Follows AXLearn's `SummaryWriter`
    (`axlearn/common/summary_writer.py`), which writes the same kinds through
    `tf.summary`.

    Args:
        logdir: the folder for the event file (created if missing).
        max_queue: events buffered before they are written to disk, an int >= 1.
        flush_secs: the longest time (seconds, a number >= 0) between a write and
            the next flush, checked at each write. (A `write_buffer` whose steps
            are read column-wise flushes once for all its steps of one structure,
            after the last of them, where `write` would flush every `max_queue`
            steps.)

    Raises:
        TypeError: if `max_queue` is not an int or `flush_secs` not a number.
        ValueError: if `max_queue` is less than 1 or `flush_secs` negative (or NaN).
        ImportError: if tensorboardX is not installed (the message names the
            `tensorboard` extra).
        OSError: if the folder or the file cannot be created.
    """

    def __init__(
        self,
        logdir: str | os.PathLike[str],
        *,
        max_queue: object = 10,  # an int, checked here with a message naming it
        flush_secs: object = 120,  # a number, checked here
    ):
        where = "TensorBoardWriter(logdir, max_queue=..., flush_secs=...)"
        queue_size = check_positive_int(
            max_queue,
            where=where,
            name="max_queue",
            meaning="the events buffered before they are written to disk",
        )
        if isinstance(flush_secs, bool) or not isinstance(
            flush_secs, (int, float, np.integer, np.floating)
        ):
            raise TypeError(
                f"`{where}`: flush_secs must be a number of seconds >= 0, got "
                f"{type(flush_secs).__name__} {flush_secs!r}."
            )
        if not flush_secs >= 0:  # also NaN
            raise ValueError(
                f"`{where}`: flush_secs must be a number of seconds >= 0 (0 flushes "
                f"at every write), got {flush_secs}."
            )
        try:
            import tensorboardX  # pyright: ignore[reportUnusedImport]  # noqa: F401
            from tensorboardX.proto import event_pb2, summary_pb2, tensor_pb2
        except ImportError as e:
            raise ImportError(_MISSING) from e
        self.logdir = os.fspath(logdir)
        self._event_pb2 = event_pb2
        self._summary_pb2 = summary_pb2
        self._tensor_pb2 = tensor_pb2
        self._max_queue = queue_size
        self._flush_secs = float(flush_secs)
        self._pending = 0
        self._last_flush = time.monotonic()
        self._closed = False
        # The path behind each tag so far, and the layouts (`HostValues.layout`)
        # whose paths are all in it: a replayed write is checked by one lookup.
        self._tag_paths: dict[str, str] = {}
        self._layouts: set[object] = set()
        self._file: Proto | None = None  # tensorboardX's `EventsWriter`
        self._path: str | None = None
        if is_writing_process():
            self._file, self._path = _events_writer(self.logdir)

    @property
    def path(self) -> str | None:
        """The event file's path (None on processes other than 0), also once closed."""
        return self._path

    def check(self, host: HostSummaries) -> None:
        """Refuse a closed writer and two paths that get one tag.

        Raises:
            ValueError: after `close()`.
            eqxctx.OutputConflictError: if two summary paths get the same tag after
                sanitizing (e.g. `"a b"` and `"a_b"`), in this write or one with a
                path this writer has accepted before; the message names both.
        """
        where = "TensorBoardWriter.write"
        if self._closed:
            raise ValueError(f"`{where}`: the writer for {self.logdir!r} is closed.")
        values = host.values
        layout = values.layout if isinstance(values, HostValues) else None
        if layout is not None and layout in self._layouts:
            return
        known = self._tag_paths
        seen: dict[str, str] = {}
        for path in values:
            tag = tag_of(path)
            other = seen.get(tag)
            before = other is None
            if before:
                other = known.get(tag, path)
            if other != path:
                written = " (in an earlier write)" if before else ""
                raise OutputConflictError(
                    f"`{where}`: the summaries {other!r}{written} and {path!r} both "
                    f"get the TensorBoard tag {tag!r} (characters other than "
                    "letters, digits and -_./ become '_'); rename one of them so "
                    "that no value is lost."
                )
            seen[tag] = path
        known.update(seen)
        if layout is not None and len(self._layouts) < 256:
            self._layouts.add(layout)

    def write_host(self, host: HostSummaries) -> None:
        """Write one step as one event with every value.

        A row of a buffer read column-wise (`HostValues.row`) is a copy of its
        `Summary`, made with all the block's rows (`_tb_rows.block_rows`: the
        same event), and a flush it makes due waits for the block's last row.
        """
        if self._file is None:
            return
        event = self._event_pb2.Event(wall_time=time.time(), step=host.step)
        values = host.values
        row = values.row if type(values) is HostValues else None
        block, i = row if row is not None else (None, 0)
        if isinstance(block, RowBlock):
            rows = block.cache.get(block_rows)
            if rows is None:
                rows = block.cache[block_rows] = block_rows(
                    block, self._summary_pb2.Summary, _tags, self._add_values
                )
            if rows[i].value:  # (an event without values has no summary)
                event.summary.CopyFrom(rows[i])
        else:
            # Values are added in place (`add`): a message passed to a constructor
            # would be copied.
            out = event.summary.value
            parts = values.parts if isinstance(values, HostValues) else None
            if parts is not None and any(isinstance(part, Rows) for part in parts):
                for part in parts:
                    self._add_values(out, part)
            else:
                self._add_values(out, values)
        self._file.write_event(event)
        self._pending += 1
        if isinstance(block, RowBlock) and i < block.n - 1:
            return  # the block's rows are written together: one flush at its end
        elapsed = time.monotonic() - self._last_flush
        if self._pending >= self._max_queue or elapsed >= self._flush_secs:
            self.flush()

    def _add_values(self, out: Proto, part: Mapping[str, HostValue] | Rows) -> None:
        """Add the `Summary.Value`s of a part of a step's values to `out`, in order."""
        add = out.add
        if isinstance(part, Rows) and all(c.ndim == 1 for c in part.columns):
            # Rows of scalars: every value converted at once (float64 holds every
            # value of these dtypes exactly, as `float(value)` does).
            floats = np.stack(part.columns, axis=1).astype(np.float64).reshape(-1)
            for tag, f in zip(_tags(part.paths), floats.tolist(), strict=True):
                add(tag=tag, simple_value=f)
            return
        for path, value in part.items():
            if type(value) is np.ndarray and not value.ndim:
                # Most values: a scalar, without `_value`'s media checks (each an
                # ABC `isinstance`, ~1 µs).
                add(tag=tag_of(path), simple_value=float(value))
                continue
            proto = self._value(tag_of(path), value)
            if proto is not None:
                out.append(proto)

    def _value(self, tag: str, value: HostValue) -> Proto | None:
        summary = self._summary_pb2.Summary
        if isinstance(value, Image):
            return self._images(tag, value.images)
        if isinstance(value, Audio):
            audio = value.samples
            proto = summary.Audio(
                sample_rate=float(value.sample_rate),
                num_channels=1 if audio.ndim == 1 else audio.shape[1],
                length_frames=audio.shape[0],
                encoded_audio_string=wav_bytes(audio, value.sample_rate),
                content_type="audio/wav",
            )
            return summary.Value(tag=tag, audio=proto)
        if isinstance(value, Histogram):
            histo = self._histogram(np.asarray(value.counts), value.edges, None)
        elif value.ndim > 0:
            finite = value.astype(np.float64).ravel()
            finite = finite[np.isfinite(finite)]
            edges = tensorflow_edges()
            histo = self._histogram(np.histogram(finite, edges)[0], edges, finite)
        else:
            return summary.Value(tag=tag, simple_value=float(value))
        return None if histo is None else summary.Value(tag=tag, histo=histo)

    def _images(self, tag: str, images: np.ndarray) -> Proto:
        """TensorBoard's image format: a string tensor `[width, height, *pngs]`."""
        nhwc = images_nhwc(images)
        _, height, width, _ = nhwc.shape
        strings = [str(width).encode(), str(height).encode()]
        strings += [png_bytes(image) for image in nhwc]
        tensor = self._tensor_pb2.TensorProto(
            dtype=_DT_STRING,
            tensor_shape={"dim": [{"size": len(strings)}]},
            string_val=strings,
        )
        plugin = self._summary_pb2.SummaryMetadata.PluginData(plugin_name="images")
        metadata = self._summary_pb2.SummaryMetadata(plugin_data=plugin)
        return self._summary_pb2.Summary.Value(
            tag=tag, metadata=metadata, tensor=tensor
        )

    def _histogram(
        self, counts: np.ndarray, edges: tuple[float, ...], values: np.ndarray | None
    ) -> Proto | None:
        """A `HistogramProto` of the non-empty bucket span (None if no count).

        TensorBoard's format: `bucket_limit[i]` is bucket i's right edge; `min`
        and `max` are the outer edges. Infinite edges are written as ±DBL_MAX, as
        TensorFlow does.
        """
        counts = counts.reshape(-1, counts.shape[-1]).sum(axis=0)
        first, stop = nonempty_span(counts)
        if first == stop:
            return None
        span = np.clip(np.asarray(edges[first : stop + 1]), -DBL_MAX, DBL_MAX)
        kept = counts[first:stop].astype(np.float64)
        if values is None:  # as `_tb_rows.histogram_rows` makes a buffer's rows
            low, high = float(span[0]), float(span[-1])
            num, total, squares = center_sums(kept, bucket_centers(span))
        else:
            low, high = float(values.min()), float(values.max())
            num, total = float(kept.sum()), float(values.sum())
            squares = float(values @ values)
        return self._summary_pb2.HistogramProto(
            min=low,
            max=high,
            num=num,
            sum=total,
            sum_squares=squares,
            bucket_limit=span[1:].tolist(),
            bucket=kept.tolist(),
        )

    def flush(self) -> None:
        """Write buffered events to disk."""
        if self._file is not None:
            self._file.flush()
        self._pending = 0
        self._last_flush = time.monotonic()

    def close(self) -> None:
        """Flush and close the event file; closing twice is allowed."""
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None

"""TensorBoardWriter: summaries as TensorBoard event files, through tensorboardX."""

import io
import os
import wave
from typing import Any

import numpy as np

from eqxctx._statistics import HistogramSummary
from eqxctx._summary import AudioSummary, ImageSummary

from ._base import (
    AbstractWriter,
    Step,
    Summaries,
    check_step,
    flatten_summaries,
    host_values,
)


_MISSING = (
    "`TensorBoardWriter` needs the tensorboardX package, which is not installed. "
    "Install eqxctx's `tensorboard` extra: `pip install 'eqxctx[tensorboard]'` (or "
    "`pip install tensorboardX`), or write JSON lines with `eqxctx.writers."
    "JsonlWriter`, which needs nothing else."
)


def _images_nhwc(images: np.ndarray) -> np.ndarray:
    """Return `uint8[batch, height, width, channels]` from an `ImageSummary` value."""
    if images.ndim == 3:
        images = images[..., None]
    if images.dtype == np.uint8:
        return images
    if images.dtype == np.bool_:
        return images.astype(np.uint8) * np.uint8(255)
    if np.issubdtype(images.dtype, np.integer):
        return np.clip(images, 0, 255).astype(np.uint8)
    scaled = np.clip(images.astype(np.float32), 0.0, 1.0) * np.float32(255.0)
    return np.round(scaled).astype(np.uint8)


def wav_bytes(audio: np.ndarray, sample_rate: int) -> bytes:
    """Encode `audio` (`[time]` or `[time, channels]`, in [-1, 1]) as 16-bit WAV.

    Values outside [-1, 1] are clipped.
    """
    if audio.ndim == 1:
        audio = audio[:, None]
    pcm = np.round(np.clip(audio.astype(np.float64), -1.0, 1.0) * 32767.0)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(audio.shape[1])
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm.astype("<i2").tobytes())
    return buffer.getvalue()


class TensorBoardWriter(AbstractWriter):
    """Write summaries as TensorBoard event files (tensorboardX's `SummaryWriter`).

    The tags are the keys that `JsonlWriter` writes ("/"-joined paths of
    `OutputCollection.flatten("summaries")`, with `.../iter0/...` for the iterations
    of a scan), and every leaf is written as its `Summary.value()`:

    - `ImageSummary` (`[batch, height, width]` or `[batch, height, width,
      channels]`): an image grid (`add_images`). Floating values are clipped to
      [0, 1]; `uint8` values are used as they are.
    - `AudioSummary` (`[time]` or `[time, channels]`, in [-1, 1]): audio at its
      `sample_rate`, encoded as 16-bit WAV (values outside [-1, 1] are clipped).
    - `HistogramSummary` (any shape): a histogram of all its finite values.
    - any other value of shape `()` (a raw array, a Python number, a
      `WeightedSummary`'s mean, a `MinSummary`, ...): a scalar (stored as float32).
    - any other value of higher rank: a histogram of its finite values.

    A histogram with no finite value is skipped. Tags are used as they are when they
    contain only letters, digits and `-_./` (always true for eqxctx child names);
    tensorboardX replaces other characters with `_`.

    tensorboardX is imported when the writer is made; install it with eqxctx's
    `tensorboard` extra. Follows AXLearn's `SummaryWriter`
    (`axlearn/common/summary_writer.py`), which writes the same kinds through
    `tf.summary`.

    Args:
        logdir: the folder for the event files (created if missing).
        max_queue: events buffered before a write to disk.
        flush_secs: seconds between automatic flushes.

    Raises:
        ImportError: if tensorboardX is not installed (the message names the
            `tensorboard` extra).
    """

    def __init__(
        self,
        logdir: str | os.PathLike[str],
        *,
        max_queue: int = 10,
        flush_secs: int = 120,
    ):
        try:
            import tensorboardX
            from tensorboardX.proto import summary_pb2
        except ImportError as e:
            raise ImportError(_MISSING) from e
        self.logdir = os.fspath(logdir)
        self._proto = summary_pb2
        self._writer: Any = tensorboardX.SummaryWriter(
            logdir=self.logdir, max_queue=max_queue, flush_secs=flush_secs
        )

    def write(self, step: Step, summaries: Summaries) -> None:
        """Write the summaries of one step as TensorBoard events.

        Args:
            step: the step number (`global_step`), a non-negative `int`.
            summaries: an `OutputCollection` (its `summaries` are written) or a nested
                mapping of summary leaves and `OutputCollection`s (`{"train": coll}`
                writes `train/...`). JAX arrays are fetched to the host.

        Raises:
            TypeError: for a non-integer step, a leaf that is not a summary leaf, or
                a non-numeric value (the message names its path).
            ValueError: for a negative step or a write after `close()`.
        """
        where = "TensorBoardWriter.write"
        step = check_step(step, where=where)
        if self._writer is None:
            raise ValueError(f"`{where}`: the writer for {self.logdir!r} is closed.")
        flat = flatten_summaries(summaries, where=where)
        values = host_values(flat, where=where)
        for tag, value in values.items():
            self._write_one(tag, flat.get(tag), value, step)

    def _write_one(self, tag: str, leaf: Any, value: np.ndarray, step: int) -> None:
        if isinstance(leaf, ImageSummary):
            images = _images_nhwc(value)
            self._writer.add_images(tag, images, step, dataformats="NHWC")
        elif isinstance(leaf, AudioSummary):
            self._write_audio(tag, value, leaf.sample_rate, step)
        elif isinstance(leaf, HistogramSummary) or value.ndim > 0:
            finite = value.astype(np.float64).ravel()
            finite = finite[np.isfinite(finite)]
            if finite.size:
                self._writer.add_histogram(tag, finite, step)
        else:
            self._writer.add_scalar(tag, float(value), step)

    def _write_audio(
        self, tag: str, audio: np.ndarray, sample_rate: int, step: int
    ) -> None:
        # tensorboardX's `add_audio` needs the soundfile package; WAV is in stdlib.
        summary = self._proto.Summary
        proto = summary.Audio(
            sample_rate=float(sample_rate),
            num_channels=1 if audio.ndim == 1 else audio.shape[1],
            length_frames=audio.shape[0],
            encoded_audio_string=wav_bytes(audio, sample_rate),
            content_type="audio/wav",
        )
        event = summary(value=[summary.Value(tag=tag, audio=proto)])
        self._writer.file_writer.add_summary(event, step)

    def flush(self) -> None:
        """Write pending events to disk."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; closing twice is allowed."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

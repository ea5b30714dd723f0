"""WandbWriter: summaries as a Weights & Biases run (the `wandb` extra)."""

import logging
import math
import os
import shutil
import tempfile
import threading
import time
import weakref
from typing import Any, TypeAlias

import numpy as np

from eqxctx._records import Audio, Histogram, Image

from ._base import (
    BACKGROUND_THREAD,
    AbstractWriter,
    HostSummaries,
    is_writing_process,
)
from ._host import HostValue
from ._jsonl import nonempty_span
from ._tensorboard import images_nhwc, wav_bytes


#: A W&B run: `wandb.init()`'s result, or any object with its `log` and `finish`
#: (duck-typed; `Any`: wandb is optional, imported by the writer).
Run: TypeAlias = Any


_MISSING = (
    "`WandbWriter` needs the wandb package, which is not installed. Install "
    "eqxctx's `wandb` extra: `pip install 'eqxctx[wandb]'` (or `pip install "
    "wandb`), or write JSON lines with `eqxctx.writers.JsonlWriter`, which needs "
    "nothing else."
)

#: W&B's limit on the buckets of one histogram (`wandb.Histogram.MAX_LENGTH`).
MAX_BUCKETS = 512
#: The buckets of a histogram of a raw array (`wandb.Histogram`'s default).
RAW_BUCKETS = 64
_DBL_MAX = float(np.finfo(np.float64).max)

#: Where a step that is not logged is reported (from a writer's background thread,
#: where a warning turned into an error by a filter would stop the writer).
_LOGGER = logging.getLogger("eqxctx.writers")


class _RunLog:
    """What the `WandbWriter`s on one run share: its highest logged step and a lock.

    (W&B's own `run.step` asks its service process: ~0.5 ms per read.)
    """

    __slots__ = ("committed", "lock", "step", "time")

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held around the order check, log and record
        self.step: int | None = None
        #: Whether `step` was committed (by `flush`/`close`): W&B takes no more
        #: values for it.
        self.committed = False
        #: When `step` was last logged (`time.time()`): its row's `_timestamp`.
        self.time = 0.0


#: Each run's `_RunLog`, made by the first `WandbWriter` on it.
_RUN_LOGS: weakref.WeakKeyDictionary[Run, _RunLog] = weakref.WeakKeyDictionary()
_RUN_LOGS_LOCK = threading.Lock()


def _run_log(run: Run) -> _RunLog:
    """The `_RunLog` of `run`; a writer's own for a run with no weak references."""
    with _RUN_LOGS_LOCK:
        try:
            log = _RUN_LOGS.get(run)
            if log is None:
                log = _RUN_LOGS[run] = _RunLog()
        except TypeError:  # a stand-in for a run that has no weak references
            return _RunLog()
    return log


def histogram_buckets(
    counts: np.ndarray, edges: tuple[float, ...] | np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """Return `(counts, edges)` for W&B: the non-empty span, at most 512 buckets.

    Stacked counts (`[..., bins]`) are added. The buckets from the first to the
    last non-empty one are kept; more than `MAX_BUCKETS` of them are merged in
    groups of `ceil(n / MAX_BUCKETS)` adjacent buckets (counts added: the total
    stays exact). Infinite outer edges become ±DBL_MAX, as in TensorBoard. None if
    nothing was counted.
    """
    counts = np.asarray(counts)
    counts = counts.reshape(-1, counts.shape[-1]).sum(axis=0)
    first, stop = nonempty_span(counts)
    if first == stop:
        return None
    kept = counts[first:stop]
    span = np.clip(np.asarray(edges[first : stop + 1], np.float64), -_DBL_MAX, _DBL_MAX)
    group = math.ceil(kept.size / MAX_BUCKETS)
    if group > 1:
        padded = np.zeros(math.ceil(kept.size / group) * group, kept.dtype)
        padded[: kept.size] = kept
        kept = padded.reshape(-1, group).sum(axis=1)
        span = np.append(span[:-1:group], span[-1])
    return kept, span


class WandbWriter(AbstractWriter):
    """Write summaries to a Weights & Biases run (`wandb.Run.log`).

    Each `write(step, summaries)` is one `run.log({path: value, ...}, step=step)`
    with the "/"-joined paths that `JsonlWriter` writes (W&B groups them into
    sections by their first part):

    - a value of shape `()` (a raw array, a number, a `WeightedSummary`'s mean, a
      `MinSummary`, ...): a number (a Python `int` for integer and boolean values,
      a `float` otherwise; NaN and infinities as they are).
    - `MomentsSummary`: the numbers `path/count`, `path/mean`, `path/variance`,
      `path/min`, `path/max`, `path/nonfinite`.
    - `HistogramSummary`: a `wandb.Histogram` of its counts and edges
      (`np_histogram=`), over the buckets from the first to the last non-empty one;
      beyond W&B's 512 buckets, adjacent buckets are merged (counts added). One
      with no count is skipped.
    - any other value of higher rank: a `wandb.Histogram` of its finite values in 64
      buckets (W&B's default); one with no finite value is skipped.
    - `ImageSummary`: a list of `wandb.Image`s, one per batch entry, converted to
      `uint8` as `TensorBoardWriter` does (floating values clipped to [0, 1]).
    - `AudioSummary`: a `wandb.Audio` of a 16-bit WAV file encoded as
      `TensorBoardWriter` does (scaled like TensorFlow's `tf.audio.encode_wav`), at
      its sample rate.

    W&B keeps the row of the last step logged open (a later `write` of the same
    step, by this writer or another `WandbWriter` on the run, e.g. a train and an
    eval writer, adds to it) until a higher step is logged or the row is
    committed: `flush()` and `close()` commit it, so that every step written is in
    the run (its files, the server) without waiting for the next one; `close` of a
    run the writer started finishes it, which commits too.

    W&B drops a step lower than one already logged (with a warning), and values of
    a committed step; this writer refuses them instead (`ValueError`): a step lower
    than one logged by this writer or by another `WandbWriter` on the same run, or
    equal to one committed by `flush()`/`close()` of one of them. A step that
    became lower than the run's after that check, while it waited in an
    `AsyncWriter`'s queue, is not logged, with a warning on the `eqxctx.writers`
    logger. Steps that other code logs with `run.log` are not seen. It also refuses
    paths starting with "_", which W&B reserves (`_step`, `_runtime`, ...).

    In a multi-process run, create the writer and call `write` on every process
    (after `jax.distributed.initialize`): only process 0 starts a run and logs.

    wandb is imported when the writer is made; install it with eqxctx's `wandb`
    extra. Offline runs (`mode="offline"`, or `WANDB_MODE=offline`) need no account
    and no network; `wandb sync` uploads them later.

    Args:
        run: a run to log to (from `wandb.init`); `close` commits its last step
            and leaves it open. None (the default) starts one with
            `wandb.init(**init_kwargs)` on process 0, which `close` finishes.
        **init_kwargs: passed to `wandb.init` (e.g. `project=`, `name=`, `config=`,
            `mode="offline"`, `dir=`); only without `run`.

    Raises:
        ImportError: if wandb is not installed (the message names the `wandb`
            extra).
        ValueError: if both `run` and `init_kwargs` are given.
    """

    # `init_kwargs: Any`: `wandb.init`'s own arguments, typed and checked by wandb.
    def __init__(self, run: Run = None, **init_kwargs: Any):
        try:
            import wandb
        except ImportError as e:
            raise ImportError(_MISSING) from e
        if run is not None and init_kwargs:
            raise ValueError(
                "`WandbWriter(run, **init_kwargs)`: pass a run or the arguments of "
                f"`wandb.init` ({sorted(init_kwargs)}), not both."
            )
        self._wandb = wandb
        self._owns_run = run is None
        self._closed = False
        self._media_dir: str | None = None
        self.run: Run = None
        if is_writing_process():
            self.run = wandb.init(**init_kwargs) if run is None else run
        self._log = _run_log(self.run)

    def check(self, host: HostSummaries) -> None:
        """Refuse a closed writer, a step lower than the run's last and W&B's keys.

        Raises:
            ValueError: after `close()`, for a step lower than one logged to the run
                before by this writer or another `WandbWriter` on it, or equal to
                one committed by `flush()`/`close()` (W&B would drop it; checked on
                process 0, which logs), or for a path starting with "_". On an
                `AsyncWriter`'s background thread (`background_fetch=True`) the
                order is not checked here: another writer on the run may have
                logged a higher step after this one was queued, and `write_host`
                skips such a step with a warning.
        """
        where = "WandbWriter.write"
        if self._closed:
            raise ValueError(f"`{where}`: the writer is closed.")
        if threading.current_thread().name != BACKGROUND_THREAD:
            self._check_order(host.step, where=where)
        for path in host.values:
            if path.startswith("_"):
                raise ValueError(
                    f"`{where}`: the summary path {path!r} starts with '_', which W&B "
                    "reserves for its own keys (`_step`, `_runtime`); rename it."
                )

    def _check_order(self, step: int, *, where: str) -> None:
        """Refuse a step lower than the run's last, or equal to a committed one."""
        log = self._log
        last = log.step
        if last is None:
            return
        if step < last:
            raise ValueError(
                f"`{where}`: step {step} is lower than step {last}, logged to this "
                "W&B run before (by this writer or another `WandbWriter` on the "
                "run); W&B keeps steps in increasing order (it would drop this one). "
                "Write steps in order, or start another run."
            )
        if step == last and log.committed:
            raise ValueError(
                f"`{where}`: step {step} was committed to this W&B run by `flush()` "
                "or `close()` of a `WandbWriter` on it; W&B takes no more values "
                "for a committed step (it would drop them). Write a step's values "
                "before flushing, or write them at a higher step."
            )

    def write_host(self, host: HostSummaries) -> None:
        """Log one step: `run.log({path: value, ...}, step=step)`.

        The step counts as logged (for `check`) once `run.log` returns. A step
        that `check` accepted but that is lower than one logged to the run since
        (another `WandbWriter` on the run logged a higher step while this one
        waited in an `AsyncWriter`'s queue) is not logged, as W&B itself drops it,
        with a warning on the `eqxctx.writers` logger: the writer goes on with the
        next step.
        """
        if self.run is None:
            return
        record: dict[str, object] = {}
        for path, value in host.values.items():
            converted = self._value(path, host.step, value)
            if converted is not None:
                record[path] = converted
        log = self._log
        with log.lock:  # the order check, the log and the record, together
            last = log.step
            if last is not None and (
                host.step < last or (host.step == last and log.committed)
            ):
                _LOGGER.warning(
                    "`WandbWriter`: step %d was not logged: step %d was logged to "
                    "this W&B run first%s (by another `WandbWriter` on it, while "
                    "this step waited in an `AsyncWriter`'s queue); W&B keeps steps "
                    "in increasing order.",
                    host.step,
                    last,
                    " and committed" if host.step == last else "",
                )
                return
            log.time = time.time()
            self.run.log(record, step=host.step)
            log.step = host.step
            log.committed = False

    def _value(self, path: str, step: int, value: HostValue) -> object:
        wandb = self._wandb
        if isinstance(value, Image):
            nhwc = images_nhwc(value.images)
            return [
                wandb.Image(image[..., 0] if image.shape[-1] == 1 else image)
                for image in nhwc
            ]
        if isinstance(value, Audio):
            return wandb.Audio(
                self._wav_file(path, step, value.samples, value.sample_rate),
                sample_rate=value.sample_rate,
            )
        if isinstance(value, Histogram):
            buckets = histogram_buckets(np.asarray(value.counts), value.edges)
            if buckets is None:
                return None
            return wandb.Histogram(np_histogram=buckets)
        if value.ndim > 0:
            finite = value.astype(np.float64).ravel()
            finite = finite[np.isfinite(finite)]
            if not finite.size:
                return None
            return wandb.Histogram(np_histogram=np.histogram(finite, RAW_BUCKETS))
        if value.dtype.kind in "biu":
            return int(value)
        return float(value)

    def _wav_file(
        self, path: str, step: int, audio: np.ndarray, sample_rate: int
    ) -> str:
        """Write `audio` as a WAV file for `wandb.Audio` (which copies it)."""
        if self._media_dir is None:
            self._media_dir = tempfile.mkdtemp(prefix="eqxctx-wandb-")
        name = f"{path.replace('/', '.')}.{step}.wav"
        file = os.path.join(self._media_dir, name)
        with open(file, "wb") as f:
            f.write(wav_bytes(audio, sample_rate))
        return file

    def flush(self) -> None:
        """Commit the run's last step (`run.log(..., commit=True)`).

        W&B keeps the row of the last step logged open until a higher step is
        logged or it is committed; once committed, it goes to the run's files (and
        the server) with the others. Its `_timestamp` stays the time it was last
        logged. Nothing to do if it is committed already, or the run is finished
        (which committed it). The run then takes no more values for that step:
        `write` refuses it.
        """
        run = self.run
        # W&B's own test for a finished run (`wandb.Run` has no public one).
        if run is None or getattr(run, "_is_finished", False):
            return
        log = self._log
        with log.lock:
            if log.step is None or log.committed:
                return
            run.log({"_timestamp": log.time}, step=log.step, commit=True)
            log.committed = True

    def close(self) -> None:
        """Commit the last step and, if this writer started the run, finish it.

        A run passed in stays open. Closing twice is allowed.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self.run is not None and self._owns_run:
                self.run.finish()
            else:
                self.flush()
        finally:
            if self._media_dir is not None:
                shutil.rmtree(self._media_dir, ignore_errors=True)
                self._media_dir = None

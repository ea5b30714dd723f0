"""Writing summaries every step: AsyncWriter vs a synchronous writer vs no writing.

The loop is the demo's training step (`eqxctx.demo`: 4 scanned residual blocks, Adam;
per step 2 weighted scalars, per layer 3 weighted scalars and a `MomentsSummary` (6
values), and a `HistogramSummary` of the logits: 39 values), by default at the
demo's size (width 64, batch 64) and at width 256, batch 256 (`--sizes WIDTHxBATCH
...` for others). Each round (7, `--rounds`) runs 100 steps per variant (`--quick`:
30 steps x 2 rounds), interleaved, and times the whole loop including the final
`block_until_ready` and the writers' `close` (so nothing is left unwritten):

- none: the steps only;
- async: `AsyncWriter(MultiWriter(JsonlWriter, TensorBoardWriter),
  background_fetch=True)`, which in one process fetches on its background thread;
- async, calling-thread fetch: the same with `defer_fetch=True` (the default
  `background_fetch=False`; what every process of a multi-process run does);
- sync: `MultiWriter(JsonlWriter, TensorBoardWriter)` writing on the training thread.

Ratios are variant / none, each the minimum over the rounds, from one run; with
them the CPU time per step (the median over the rounds) of the whole process and of
the training thread alone (`time.thread_time`), which says where a writer's work
runs and how much of the machine the step leaves free. Unless `--loop-only`, a second
table gives what one write costs at the demo's size, by part: the fetch on the
calling thread, and each writer's `write_host` (the background thread's work in
`AsyncWriter`); a third the host bytes that one write fetches for a 1M-element
float32 tensor as a raw array and as `HistogramSummary`s (the counts only), with the
device time (the minimum of 7 calls). Usage:

    .venv/bin/python benchmarks/bench_writers.py [--quick] [--rounds N]
        [--sizes WIDTHxBATCH ...] [--loop-only]
"""

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqxctx
import eqxctx.writers._fetch as fetch_module
from eqxctx.demo._data import load_digits_split, split_sizes, train_batches
from eqxctx.demo._model import Classifier
from eqxctx.demo._train import make_train_step
from eqxctx.writers import (
    AbstractWriter,
    AsyncWriter,
    JsonlWriter,
    MultiWriter,
    TensorBoardWriter,
    fetch_summaries,
)


def _writers(logdir: str) -> AbstractWriter:
    return MultiWriter(JsonlWriter(f"{logdir}/s.jsonl"), TensorBoardWriter(logdir))


#: (width, batch size) of the default `--sizes`: the demo's, and a larger model. The
#: per-part table is at the first (the demo's), whatever `--sizes` says.
CONFIGS = ((64, 64), (256, 256))

VARIANTS: dict[str, Callable[[str], AbstractWriter | None]] = {
    "none": lambda logdir: None,
    "async": lambda logdir: AsyncWriter(_writers(logdir), background_fetch=True),
    "async, calling-thread fetch (`defer_fetch`)": lambda logdir: AsyncWriter(
        _writers(logdir), background_fetch=False, defer_fetch=True
    ),
    "sync": _writers,
}


class Times(NamedTuple):
    """One loop: wall, process CPU and training-thread CPU time (seconds)."""

    wall: float
    process: float
    thread: float


def make_loop(
    steps: int, width: int, batch_size: int
) -> Callable[[AbstractWriter | None], Times]:
    """Return `loop(writer) -> Times` running `steps` demo training steps."""
    train, _ = load_digits_split(seed=0)
    key = jax.random.PRNGKey(0)
    model = Classifier(num_layers=4, width=width, dropout=0.1, key=key)
    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    step_fn = make_train_step(optimizer)
    batches = train_batches(train, batch_size=batch_size, seed=0)
    data = [next(batches) for _ in range(steps)]
    key = jax.random.PRNGKey(1)

    def loop(writer: AbstractWriter | None) -> Times:
        m, s = model, opt_state
        start = time.perf_counter(), time.process_time(), time.thread_time()
        for step, batch in enumerate(data):
            m, s, summaries = step_fn(m, s, batch, jax.random.fold_in(key, step))
            if writer is not None:
                writer.write(step, {"train": summaries})
        jax.block_until_ready(m)
        if writer is not None:
            writer.close()
        end = time.perf_counter(), time.process_time(), time.thread_time()
        return Times(*(b - a for a, b in zip(start, end, strict=True)))

    loop(None)  # compile
    return loop


def bench_loop(steps: int, rounds: int, width: int, batch: int) -> dict[str, Times]:
    """Per variant: the minimum wall time, the median CPU times (seconds)."""
    loop = make_loop(steps, width, batch)
    with tempfile.TemporaryDirectory() as logdir:
        loop(_writers(logdir))  # warm up the writers' own compilations
        loop(_writers(logdir))
    times: dict[str, list[Times]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, make in VARIANTS.items():
            with tempfile.TemporaryDirectory() as logdir:
                times[name].append(loop(make(logdir)))
    return {
        name: Times(
            min(t.wall for t in ts),
            statistics.median(t.process for t in ts),
            statistics.median(t.thread for t in ts),
        )
        for name, ts in times.items()
    }


def fetched_bytes(summaries: dict[str, Any]) -> int:
    """Bytes of the NumPy arrays that one write fetches (`fetch_summaries`)."""
    values = fetch_summaries(summaries, where="bench")
    total = 0
    for value in values.values():
        leaves = jax.tree_util.tree_leaves(value)
        total += sum(np.asarray(leaf).nbytes for leaf in leaves)
    return total


def bench_histogram(size: int) -> list[tuple[str, int, float]]:
    x = jax.random.normal(jax.random.PRNGKey(0), (size,), jnp.float32)
    cases: dict[str, Callable[[jax.Array], Any]] = {
        "raw array": lambda x: x,
        "HistogramSummary(x, bins=30, range=(-5, 5))": lambda x: (
            eqxctx.HistogramSummary(x, bins=30, range=(-5.0, 5.0))
        ),
        "HistogramSummary(x) (TF's 1,550 buckets)": eqxctx.HistogramSummary,
        "MomentsSummary(x)": eqxctx.MomentsSummary,
    }
    rows = []
    for name, make in cases.items():
        fn = jax.jit(make)
        out = jax.block_until_ready(fn(x))
        best = float("inf")
        for _ in range(7):  # the minimum: this machine is shared and noisy
            start = time.perf_counter()
            jax.block_until_ready(fn(x))
            best = min(best, time.perf_counter() - start)
        device_ms = best * 1e3
        rows.append((name, fetched_bytes({"x": out}), device_ms))
    return rows


def bench_components(width: int, batch_size: int) -> list[tuple[str, float]]:
    """CPU microseconds per write of the demo's summaries, by part (min of 7 x 200).

    CPU time of the thread that runs the part (`time.thread_time`), alone (no step
    running beside it). The fetch reads arrays that were never read before (as in a
    training loop), with one transfer per width of raw bits
    (`eqxctx.writers._fetch`) and, for comparison, one per array (as before it);
    `AsyncWriter.write` is what the training thread pays with the background fetch.
    The TensorBoard write is timed with tensorboardX's checksums in C (the `crc32c`
    package, when installed) and in its own pure Python.
    """
    import tensorboardX.crc32c as tbx_crc  # the `tensorboard` extra
    import tensorboardX.record_writer as tbx_record

    train, _ = load_digits_split(seed=0)
    key = jax.random.PRNGKey(0)
    model = Classifier(num_layers=4, width=width, dropout=0.1, key=key)
    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    step_fn = make_train_step(optimizer)
    batch = next(train_batches(train, batch_size=batch_size, seed=0))
    rounds, n = 7, 200
    outs = [
        {"train": step_fn(model, opt_state, batch, jax.random.fold_in(key, i))[2]}
        for i in range(3 * rounds * (n + 3) + 60)
    ]
    jax.block_until_ready(outs)
    fresh = iter(outs)

    def interleaved(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                start = time.thread_time()
                for _ in range(n):
                    fn()
                times[name].append((time.thread_time() - start) / n)
        return {name: min(ts) * 1e6 for name, ts in times.items()}

    def best(fn: Callable[[], object]) -> float:
        return interleaved({"": fn})[""]

    with tempfile.TemporaryDirectory() as logdir:
        jsonl = JsonlWriter(f"{logdir}/s.jsonl")
        tb = TensorBoardWriter(logdir)
        for _ in range(20):
            jsonl.fetch(0, next(fresh))
        saved_size = fetch_module.MAX_BATCHED_SIZE

        def fetch_with(max_size: int) -> Callable[[], object]:
            def run() -> object:
                if max_size != fetch_module.MAX_BATCHED_SIZE:  # a new round
                    fetch_module.MAX_BATCHED_SIZE = max_size
                    fetch_module._plans.clear()  # pyright: ignore[reportPrivateUsage]
                    for _ in range(3):
                        jsonl.fetch(0, next(fresh))
                return jsonl.fetch(0, next(fresh))

            return run

        try:  # interleaved rounds: batched, then array by array (-1: no batching)
            fetches = interleaved(
                {
                    "fetch, one transfer per width": fetch_with(saved_size),
                    "fetch, one transfer per array (before)": fetch_with(-1),
                }
            )
        finally:
            fetch_module.MAX_BATCHED_SIZE = saved_size
            fetch_module._plans.clear()  # pyright: ignore[reportPrivateUsage]
        rows = list(fetches.items())
        with AsyncWriter(
            MultiWriter(JsonlWriter(f"{logdir}/a.jsonl")), background_fetch=True
        ) as writer:
            for _ in range(20):
                writer.write(0, next(fresh))
            rows.append(
                (
                    "`AsyncWriter.write`, background fetch (training thread)",
                    best(lambda: writer.write(0, next(fresh))),
                )
            )
        host = jsonl.fetch(0, outs[0])
        rows.append(("JSONL write_host", best(lambda: jsonl.write_host(host))))
        native = tbx_record.crc32c is not tbx_crc._crc32c  # pyright: ignore[reportPrivateUsage]
        label = "crc32c package" if native else "pure Python (no crc32c package)"
        rows.append(
            (f"TensorBoard write_host, {label}", best(lambda: tb.write_host(host)))
        )
        if native:
            saved = tbx_record.crc32c
            tbx_record.crc32c = tbx_crc._crc32c  # pyright: ignore[reportPrivateUsage]
            try:
                rows.append(
                    (
                        "TensorBoard write_host, pure-Python CRC",
                        best(lambda: tb.write_host(host)),
                    )
                )
            finally:
                tbx_record.crc32c = saved
        jsonl.close()
        tb.close()
    return rows


def _size(text: str) -> tuple[int, int]:
    """An argparse `type` for `WIDTHxBATCH`, e.g. `1024x1024`."""
    width, sep, batch = text.lower().partition("x")
    try:
        size = int(width), int(batch)
    except ValueError:
        size = None
    if not sep or size is None or min(size) < 1:
        raise argparse.ArgumentTypeError(
            f"expected WIDTHxBATCH, positive integers (e.g. 1024x1024), got {text!r}"
        )
    return size


def _positive(text: str) -> int:
    """An argparse `type` for an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(
        description="AsyncWriter vs a synchronous writer vs no writing, every step"
    )
    parser.add_argument(
        "--quick", action="store_true", help="30 steps x 2 rounds (default 100 x 7)"
    )
    parser.add_argument(
        "--rounds",
        type=_positive,
        metavar="N",
        help="interleaved rounds (default 7; 2 if --quick)",
    )
    default_sizes = " ".join(f"{w}x{b}" for w, b in CONFIGS)
    parser.add_argument(
        "--sizes",
        type=_size,
        nargs="+",
        default=list(CONFIGS),
        metavar="WIDTHxBATCH",
        help=f"model width and batch size of each loop (default {default_sizes})",
    )
    parser.add_argument(
        "--loop-only",
        action="store_true",
        help="only the loop table (no per-part and histogram tables)",
    )
    args = parser.parse_args()
    num_train, _ = split_sizes()
    for width, batch in args.sizes:
        if batch > num_train:
            parser.error(
                f"argument --sizes: batch {batch} (in {width}x{batch}) is larger than "
                f"the training split ({num_train} examples); use at most {num_train}"
            )
    steps, rounds = (30, 2) if args.quick else (100, 7)
    if args.rounds is not None:
        rounds = args.rounds
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, {steps} steps x {rounds}"
    )
    print(
        "\n| model | writer | loop (ms/step) | ratio to none "
        "| CPU ms/step: process | training thread |"
    )
    print("|---|---|--:|--:|--:|--:|")
    for width, batch in args.sizes:
        best = bench_loop(steps, rounds, width, batch)
        for name, t in best.items():
            ratio = t.wall / best["none"].wall
            label = f"width {width}, batch {batch}"
            ms = [x / steps * 1e3 for x in t]
            print(
                f"| {label} | {name} | {ms[0]:.2f} | {ratio:.3f}x | {ms[1]:.2f} "
                f"| {ms[2]:.2f} |",
                flush=True,
            )
    if args.loop_only:
        return
    width, batch = CONFIGS[0]
    print(f"\n| one write of the demo's summaries (width {width}) | CPU µs |")
    print("|---|--:|")
    for name, us in bench_components(width, batch):
        print(f"| {name} | {us:.0f} |")
    header = "| summary of a 1M-element float32 tensor | bytes per write | device ms |"
    print(f"\n{header}")
    print("|---|--:|--:|")
    for name, nbytes, ms in bench_histogram(1_000_000):
        print(f"| {name} | {nbytes:,} | {ms:.1f} |")


if __name__ == "__main__":
    main()

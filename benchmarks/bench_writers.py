"""Writing summaries every step: through a `SummaryBuffer`, step by step, or not at all.

The loop is the demo's training step (`eqxctx.demo`'s `Classifier`: 4 scanned residual
blocks; per step 2 weighted scalars, per block 3 weighted scalars and a
`MomentsSummary` (6 values), and a `HistogramSummary` of the logits: 39 values) with
Adam written out here, on random data, so that the script needs only eqxctx's own
dependencies (jax, equinox, numpy, orjson; tensorboardX for `--tensorboard`). The
batches, keys and step numbers are put on the device before the loops. Sizes: the
demo's (width 64, batch 64) and width 1024, batch 1024 on an accelerator; on a CPU,
where a width-1024 step takes seconds, width 256, batch 256 (`--sizes WIDTHxBATCH
...` for others). Each round (5, `--rounds`) runs 256 steps per variant (`--quick`:
64 steps x 2 rounds), the variants interleaved, each round in a new order, and times
the whole loop including the final `block_until_ready` and the writer's `close`
(nothing is left unwritten):

- none: the step only (its summaries are returned and dropped);
- sync: `JsonlWriter.write` after each step, on the training thread;
- async: `AsyncWriter(JsonlWriter).write` after each step, `AsyncWriter`'s defaults;
- buffer, never written: the step adding its summaries to a `SummaryBuffer` (below)
  that is never written (its last row overwritten): the buffer's cost in the step;
- buffer, async: the step adds its summaries to a `SummaryBuffer` of N = 32 rows (a
  step argument it returns), written by `AsyncWriter(JsonlWriter).write_buffer`
  every 32 steps and once after the loop;
- buffer, sync: the same written by `JsonlWriter.write_buffer`.

Ratios are variant / none, each the minimum wall time over the rounds, from one run;
beside them the CPU time per step (the mean over the rounds) of the whole process
and of the training thread alone (`time.thread_time` around the loop), which says
where a writer's work runs, and the wall time the training thread spent in the
step's and the writer's calls (the median over the rounds: its CPU time and its waits
for the GIL, on a precise clock). The header gives the thread CPU clock's step: where
it is coarse (10 ms on a host counting CPU time in scheduler ticks) the CPU columns
are sampled, and only means over long loops (`--steps`, `--rounds`) are exact to a
few percent. A second table gives the buffer's device memory, from
XLA's `memory_analysis()` of a program taking the buffer's arrays, against N times
that of one step's summaries. A third gives the host work of one `write_buffer` of
N steps (the mean thread CPU of 21 calls, 2,000 on a coarse clock, the writer
alone): all of it
(`JsonlWriter.write_buffer`, on the calling thread), and the calling thread's part
with `AsyncWriter` (the rest runs on its thread); with `--tensorboard` also all of
`TensorBoardWriter.write_buffer`'s. A fourth gives the buffer inside the
step: its arrays (each one more input and output of the step; a structure's rows are
packed into one array per dtype), the optimized HLO instructions of the step with the
buffer and of the step returning its summaries, and the time per call of a donating
step that only makes one step's summaries and adds them to the buffer against one
returning them (the minimum of 7 x 256 calls: mostly dispatch). Usage:

    python benchmarks/bench_writers.py [--quick] [--rounds N] [--steps N]
        [--sizes WIDTHxBATCH ...] [--tensorboard] [--out FILE.md]
"""

import argparse
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqxctx
from eqxctx.demo._model import NUM_CLASSES, NUM_PIXELS, Classifier, weighted_mean
from eqxctx.writers import (
    AbstractWriter,
    AsyncWriter,
    JsonlWriter,
    MultiWriter,
    SummaryBuffer,
)


#: The buffer's rows: steps written per `write_buffer`.
N = 32
#: (width, batch size) of the default `--sizes`, on an accelerator and on a CPU.
SIZES = {"accelerator": ((64, 64), (1024, 1024)), "cpu": ((64, 64), (256, 256))}


class Adam(NamedTuple):
    """Adam's state (as `optax.adam`'s, written out: no dependency on optax)."""

    steps: jax.Array
    mu: Any
    nu: Any


def _adam_init(params: Any) -> Adam:
    zeros = jax.tree.map(jnp.zeros_like, params)
    return Adam(jnp.zeros((), jnp.int32), zeros, zeros)


def _adam_update(
    grads: Any, state: Adam, lr: float = 3e-3, b1: float = 0.9, b2: float = 0.999
) -> tuple[Any, Adam]:
    count = state.steps + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
    t = count.astype(jnp.float32)
    scale = lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
    updates = jax.tree.map(lambda m, v: -scale * m / (jnp.sqrt(v) + 1e-8), mu, nu)
    return updates, Adam(count, mu, nu)


def _loss(
    model: Classifier, batch: dict[str, jax.Array], ctx: eqxctx.Context
) -> tuple[jax.Array, eqxctx.Context]:
    outputs, ctx = model.evaluate(batch, ctx)
    return weighted_mean(outputs["nll"], batch["weight"]), ctx


def _train_step(
    model: Classifier, opt: Adam, batch: dict[str, jax.Array], key: jax.Array
) -> tuple[Classifier, Adam, Any]:
    """The demo's training step (`eqxctx.demo._train`), Adam written out."""
    grad_fn = eqxctx.value_and_grad(_loss)
    (_, collection), grads = grad_fn(model, batch, prng_key=key, is_training=True)
    updates, opt = _adam_update(grads, opt)
    return eqx.apply_updates(model, updates), opt, collection.summaries


@eqx.filter_jit
def plain_step(
    model: Classifier, opt: Adam, batch: dict[str, jax.Array], key: jax.Array
) -> tuple[Classifier, Adam, Any]:
    """The step returning `{"train": summaries}`' summaries (written or dropped)."""
    return _train_step(model, opt, batch, key)


@eqx.filter_jit
def buffered_step(
    model: Classifier,
    opt: Adam,
    buffer: SummaryBuffer,
    batch: dict[str, jax.Array],
    key: jax.Array,
    step: jax.Array,
) -> tuple[Classifier, Adam, SummaryBuffer]:
    """The step adding `{"train": summaries}` to `buffer` as step `step`."""
    model, opt, summaries = _train_step(model, opt, batch, key)
    return model, opt, buffer.add(step, {"train": summaries})


class Times(NamedTuple):
    """One loop: wall, process CPU and training-thread CPU time, and the wall time
    the training thread spent in the step's and the writer's calls (seconds)."""

    wall: float
    process: float
    thread: float
    calls: float


def clock_tick(increments: int = 20, limit: float = 0.5) -> float:
    """The smallest step of `time.thread_time` seen (seconds).

    About 1 µs where the kernel reads the thread's CPU clock; 10 ms on a host that
    counts CPU time in scheduler ticks (the TPU machine's gVisor), where a short
    interval reads 0 or a whole tick.
    """
    seen: list[float] = []
    last = time.thread_time()
    end = time.perf_counter() + limit
    while len(seen) < increments and time.perf_counter() < end:
        now = time.thread_time()
        if now != last:
            seen.append(now - last)
            last = now
    return min(seen, default=limit)


#: name -> (buffered?, the writer of a log directory, or None: no writing).
Variant = tuple[bool, Callable[[str], AbstractWriter] | None]


def variants(tensorboard: bool) -> dict[str, Variant]:
    def files(logdir: str) -> AbstractWriter:
        jsonl = JsonlWriter(f"{logdir}/s.jsonl")
        if not tensorboard:
            return jsonl
        from eqxctx.writers import TensorBoardWriter

        return MultiWriter(jsonl, TensorBoardWriter(logdir))

    return {
        "none": (False, None),
        f"buffer N = {N}, never written": (True, None),
        "sync, every step": (False, files),
        "async (defaults), every step": (False, lambda d: AsyncWriter(files(d))),
        f"buffer N = {N}, async (defaults)": (True, lambda d: AsyncWriter(files(d))),
        f"buffer N = {N}, sync": (True, files),
    }


class Setup(NamedTuple):
    """One size's model, optimizer state and per-step inputs (on the device)."""

    model: Classifier
    opt: Adam
    batches: list[dict[str, jax.Array]]
    keys: list[jax.Array]
    steps: list[jax.Array]
    like: Any


def make_setup(steps: int, width: int, batch_size: int) -> Setup:
    model = Classifier(
        num_layers=4, width=width, dropout=0.1, key=jax.random.PRNGKey(0)
    )
    opt = _adam_init(eqx.filter(model, eqx.is_array))
    rng = np.random.default_rng(0)
    batches = [
        jax.device_put(
            {
                "image": rng.random((batch_size, NUM_PIXELS), np.float32),
                "label": rng.integers(0, NUM_CLASSES, batch_size).astype(np.int32),
                "weight": np.ones(batch_size, np.float32),
            }
        )
        for _ in range(steps)
    ]
    base = jax.random.PRNGKey(1)
    keys = [jax.random.fold_in(base, i) for i in range(steps)]
    numbers = [jnp.int32(i) for i in range(steps)]
    like = eqx.filter_eval_shape(_train_step, model, opt, batches[0], keys[0])[2]
    jax.block_until_ready((batches, keys, numbers))
    return Setup(model, opt, batches, keys, numbers, like)


def run_loop(setup: Setup, variant: Variant, logdir: str, steps: int) -> Times:
    """Run `steps` steps writing as `variant` says; time it all."""
    buffered, make = variant
    writer = None if make is None else make(logdir)
    m, s = setup.model, setup.opt
    buffer = SummaryBuffer.create(N, {"train": setup.like})
    data = list(zip(setup.batches, setup.keys, setup.steps, strict=True))[:steps]
    calls = 0.0  # the training thread's wall time in the step's and writer's calls
    clock = time.perf_counter
    start = time.perf_counter(), time.process_time(), time.thread_time()
    if buffered and writer is None:  # the step's own cost: the rows overwritten
        for batch, key, number in data:
            t = clock()
            m, s, buffer = buffered_step(m, s, buffer, batch, key, number)
            calls += clock() - t
    elif buffered:
        assert writer is not None
        for i, (batch, key, number) in enumerate(data):
            t = clock()
            m, s, buffer = buffered_step(m, s, buffer, batch, key, number)
            if (i + 1) % N == 0:
                buffer = writer.write_buffer(buffer)
            calls += clock() - t
        buffer = writer.write_buffer(buffer)
    elif writer is None:
        for batch, key, _ in data:
            t = clock()
            m, s, _ = plain_step(m, s, batch, key)
            calls += clock() - t
    else:
        for i, (batch, key, _) in enumerate(data):
            t = clock()
            m, s, summaries = plain_step(m, s, batch, key)
            writer.write(i, {"train": summaries})
            calls += clock() - t
    jax.block_until_ready(m)
    if writer is not None:
        writer.close()
    end = time.perf_counter(), time.process_time(), time.thread_time()
    wall, process, thread = (b - a for a, b in zip(start, end, strict=True))
    return Times(wall, process, thread, calls)


def bench_loop(
    setup: Setup, all_variants: dict[str, Variant], steps: int, rounds: int
) -> dict[str, Times]:
    """Per variant: the minimum wall time, the mean CPU times, the median time in
    calls (seconds)."""
    names = list(all_variants)
    with tempfile.TemporaryDirectory() as logdir:
        for name in names:  # compile the steps and the writers' own programs
            run_loop(setup, all_variants[name], f"{logdir}/{names.index(name)}", 2)
    times: dict[str, list[Times]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            with tempfile.TemporaryDirectory() as logdir:
                times[name].append(run_loop(setup, all_variants[name], logdir, steps))
    return {  # CPU clocks may count in ticks (`clock_tick`): means, not medians
        name: Times(
            min(t.wall for t in ts),
            statistics.mean(t.process for t in ts),
            statistics.mean(t.thread for t in ts),
            statistics.median(t.calls for t in ts),
        )
        for name, ts in times.items()
    }


def bench_host(
    setup: Setup, repeats: int, tensorboard: bool = False
) -> tuple[float, ...]:
    """One `write_buffer` of N steps: its thread CPU (seconds, the mean of `repeats`).

    `(JsonlWriter's, all the host work on the calling thread; AsyncWriter's, the
    calling thread's part: starting the buffer's copy and queueing it)`, and with
    `tensorboard` `TensorBoardWriter`'s (all its host work). The same full buffer
    is written each time, with a new `marks` array (a buffer not written before).
    """
    m, s = setup.model, setup.opt
    buffer = SummaryBuffer.create(N, {"train": setup.like})
    for batch, key, number in list(
        zip(setup.batches, setup.keys, setup.steps, strict=True)
    )[:N]:
        m, s, buffer = buffered_step(m, s, buffer, batch, key, number)
    jax.block_until_ready(buffer)

    def full() -> SummaryBuffer:  # the buffer, as not written yet
        return eqx.tree_at(lambda b: b.marks, buffer, buffer.marks.at[N, 0].set(N))

    with tempfile.TemporaryDirectory() as logdir:
        writers: list[AbstractWriter] = [
            JsonlWriter(f"{logdir}/sync.jsonl"),
            AsyncWriter(JsonlWriter(f"{logdir}/async.jsonl")),
        ]
        if tensorboard:
            from eqxctx.writers import TensorBoardWriter

            writers.append(TensorBoardWriter(f"{logdir}/tb"))
        times: list[list[float]] = [[] for _ in writers]
        for k, writer in enumerate(writers):
            for r in range(repeats + 2):  # two to warm up
                again = full()
                start = time.thread_time()
                writer.write_buffer(again)
                if r >= 2:
                    times[k].append(time.thread_time() - start)
                writer.flush()
            writer.close()
    return tuple(statistics.mean(t) for t in times)


def device_bytes(arrays: list[Any]) -> int | None:
    """XLA's argument bytes of a program taking `arrays` (`memory_analysis()`)."""
    fn = jax.jit(lambda *xs: None, keep_unused=True)
    analysis = fn.lower(*arrays).compile().memory_analysis()
    if analysis is None:
        return None
    return int(analysis.argument_size_in_bytes)


def bench_memory(setup: Setup) -> tuple[int | None, int | None, int, int]:
    """`(buffer, one step's summaries)` from `memory_analysis()`; the same in nbytes.

    The buffer's arrays: its packed rows and its bookkeeping (each row's step
    and structure, the count); one step's summaries: the arrays `plain_step`
    returns as summaries (`jax.eval_shape`'s).
    """
    buffer = SummaryBuffer.create(N, {"train": setup.like})
    leaves = jax.tree_util.tree_leaves(buffer)
    one = [jnp.zeros(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(setup.like)]
    return (
        device_bytes(leaves),
        device_bytes(one),
        sum(x.nbytes for x in leaves),
        sum(x.nbytes for x in one),
    )


_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+ = ", re.MULTILINE)


def _instructions(fn: Any, *args: Any) -> int:
    """The instructions of `fn`'s optimized HLO (an `eqx.filter_jit` function)."""
    return len(_INSTRUCTION.findall(fn.lower(*args).compile().compiled.as_text()))


class StepCost(NamedTuple):
    """The buffer inside the step (`bench_step`)."""

    arrays: int
    leaves: int
    hlo_buffered: int
    hlo_plain: int
    add: float
    give: float


def bench_step(setup: Setup, calls: int = 256, rounds: int = 7) -> StepCost:
    """The buffer's arrays and HLO in the step, and the host cost of a step's add.

    `add`: seconds per call of a donating `jax.jit` step that makes one step's
    summaries (constants of the step number) and adds them to the buffer, the
    minimum over `rounds` of `calls` calls; `give`: the same step returning the
    summaries instead (what `plain_step` does). Each array of the buffer is one
    more input and output to dispatch.
    """
    like = {"train": setup.like}

    def summaries(i: jax.Array) -> Any:
        return jax.tree.map(lambda s: jnp.full(s.shape, i, s.dtype), like)

    add = jax.jit(lambda b, i: b.add(i, summaries(i)), donate_argnums=0)
    give = jax.jit(summaries)
    numbers = setup.steps[:1] * calls
    times: list[list[float]] = [[], []]
    for _ in range(rounds):
        buffer = add(SummaryBuffer.create(N, like), numbers[0])
        jax.block_until_ready(buffer)
        start = time.perf_counter()
        for i in numbers:
            buffer = add(buffer, i)
        jax.block_until_ready(buffer)
        times[0].append(time.perf_counter() - start)
        out = give(numbers[0])
        start = time.perf_counter()
        for i in numbers:
            out = give(i)
        jax.block_until_ready(out)
        times[1].append(time.perf_counter() - start)
    buffer = SummaryBuffer.create(N, like)
    m, o, b, k, n = setup.model, setup.opt, setup.batches[0], setup.keys[0], numbers[0]
    return StepCost(
        len(jax.tree_util.tree_leaves(buffer)),
        len(jax.tree_util.tree_leaves(like)),
        _instructions(buffered_step, m, o, buffer, b, k, n),
        _instructions(plain_step, m, o, b, k),
        min(times[0]) / calls,
        min(times[1]) / calls,
    )


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
        description="Summaries written through a SummaryBuffer, step by step, or not"
    )
    parser.add_argument(
        "--quick", action="store_true", help="64 steps x 2 rounds (default 256 x 5)"
    )
    parser.add_argument("--rounds", type=_positive, metavar="N", help="rounds")
    parser.add_argument("--steps", type=_positive, metavar="N", help="steps a loop")
    parser.add_argument(
        "--sizes",
        type=_size,
        nargs="+",
        metavar="WIDTHxBATCH",
        help="model width and batch size of each loop (default: 64x64 1024x1024; "
        "on a CPU 64x64 256x256)",
    )
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="write TensorBoard events beside the JSONL file (needs tensorboardX)",
    )
    parser.add_argument("--out", metavar="FILE.md", help="also write the tables here")
    args = parser.parse_args()
    steps, rounds = (64, 2) if args.quick else (256, 5)
    steps = args.steps or steps
    rounds = args.rounds or rounds
    device = jax.devices()[0]
    platform = "cpu" if device.platform == "cpu" else "accelerator"
    sizes = args.sizes or SIZES[platform]
    lines: list[str] = []

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    writer = (
        "`MultiWriter(JsonlWriter, TensorBoardWriter)`"
        if args.tensorboard
        else ("`JsonlWriter`")
    )
    tick = clock_tick()
    repeats = 21 if tick < 1e-4 else 2000  # a coarse clock needs many calls
    emit(
        f"jax {jax.__version__}, {device.platform} ({device.device_kind}), "
        f"{steps} steps x {rounds} rounds, writer {writer}, N = {N}; "
        f"thread CPU clock step {tick * 1e3:.4g} ms\n"
    )
    emit(
        "| model | writing | loop (ms/step) | ratio to none "
        "| CPU ms/step: process | training thread | training thread in calls "
        "(wall) |"
    )
    emit("|---|---|--:|--:|--:|--:|--:|")
    memory: list[tuple[str, tuple[int | None, int | None, int, int]]] = []
    host: list[tuple[str, tuple[float, ...]]] = []
    step_costs: list[tuple[str, StepCost]] = []
    all_variants = variants(args.tensorboard)
    for width, batch in sizes:
        setup = make_setup(steps, width, batch)
        best = bench_loop(setup, all_variants, steps, rounds)
        label = f"width {width}, batch {batch}"
        for name, t in best.items():
            ms = [x / steps * 1e3 for x in t]
            emit(
                f"| {label} | {name} | {ms[0]:.2f} | {t.wall / best['none'].wall:.3f}x "
                f"| {ms[1]:.2f} | {ms[2]:.2f} | {ms[3]:.2f} |"
            )
        memory.append((label, bench_memory(setup)))
        host.append((label, bench_host(setup, repeats, args.tensorboard)))
        step_costs.append((label, bench_step(setup)))
    emit(
        f"\n| model | buffer, `memory_analysis()` | {N} x one step's summaries, "
        "`memory_analysis()` | ratio | buffer, nbytes | "
        f"{N} x one step's, nbytes |"
    )
    emit("|---|--:|--:|--:|--:|--:|")
    for label, (buffer, one, buffer_nbytes, one_nbytes) in memory:
        if buffer is None or one is None:  # not every backend reports it
            xla = ["n/a"] * 3
        else:
            xla = [f"{buffer:,}", f"{N * one:,}", f"{buffer / (N * one):.3f}"]
        emit(
            f"| {label} | {' | '.join(xla)} | {buffer_nbytes:,} | {N * one_nbytes:,} |"
        )
    tb = " `TensorBoardWriter` (all its host work) |" if args.tensorboard else ""
    emit(
        f"\n| model | one `write_buffer` of {N} steps, thread CPU (ms): "
        "`JsonlWriter` (all its host work) | `AsyncWriter(JsonlWriter)` (the "
        f"calling thread) |{tb}"
    )
    emit("|---|--:|--:|" + "--:|" * bool(tb))
    for label, ms in host:
        emit(f"| {label} | " + " | ".join(f"{t * 1e3:.2f}" for t in ms) + " |")
    emit(
        "\n| model | buffer's arrays (summary leaves) | HLO instructions: step with "
        "the buffer | step returning its summaries | a step only adding one step's "
        "summaries (µs per call) | only returning them | ratio |"
    )
    emit("|---|--:|--:|--:|--:|--:|--:|")
    for label, c in step_costs:
        emit(
            f"| {label} | {c.arrays} ({c.leaves}) | {c.hlo_buffered:,} "
            f"| {c.hlo_plain:,} | {c.add * 1e6:.1f} | {c.give * 1e6:.1f} "
            f"| {c.add / c.give:.3f}x |"
        )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""The demo end to end, A/B in one run: two source trees of eqxctx.

Issue 36: the writers' recipe engine (a structure's first read recorded and replayed)
saved ~270 µs per write on the writer's thread; it is kept only if the demo's training
loop (its step time, not one write's time) differs by more than 2% without it. `--a`
and `--b` are `src` folders (e.g. one from `git archive <commit> src`); each round runs
the demo once per tree, in a fresh process with the tree first on `PYTHONPATH`, in
alternating order; reported: the training loop's time per step from step 40 on
(compiles done; the writes on `AsyncWriter`'s thread included), median and minimum,
and the process's CPU time per step over the same steps (less sensitive to a loaded
machine).

    mkdir /tmp/a && git archive <commit> src | tar -x -C /tmp/a
    .venv/bin/python benchmarks/bench_demo.py --a /tmp/a/src --b src --rounds 5
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile


CHILD = """
import sys, time
WARMUP = 40
argv = sys.argv[1:]
import eqxctx.demo._run as run_module
import eqxctx.demo._train as train_module
make_step, calls = train_module.make_buffered_train_step, []
def counting_maker(*args, **kwargs):
    step = make_step(*args, **kwargs)
    def counted(*a, **k):
        calls.append((time.perf_counter(), time.process_time()))
        return step(*a, **k)
    return counted
train_module.make_buffered_train_step = counting_maker
real, box = run_module.train, {}
def timed(*args, **kwargs):
    out = real(*args, **kwargs)
    # From the step after the first buffer's write to the loop's end: the
    # steady state (compiles done), writes on the writer's thread included.
    n = len(calls) - WARMUP
    box["train"] = (time.perf_counter() - calls[WARMUP][0]) / n
    box["cpu"] = (time.process_time() - calls[WARMUP][1]) / n
    return out
run_module.train = timed
from eqxctx.demo._cli import main
start = time.perf_counter()
main(argv)
print("RESULT", box["train"], box["cpu"], time.perf_counter() - start)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--a", required=True, help="a src folder (A)")
    parser.add_argument("--b", required=True, help="a src folder (B)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    trees = {"A": os.path.abspath(args.a), "B": os.path.abspath(args.b)}
    variants = tuple(trees)
    times: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as logdir:
        for r in range(args.rounds):
            for variant in variants if r % 2 == 0 else variants[::-1]:
                argv = ["--steps", str(args.steps), "--no-plot", "--logdir", logdir]
                done = subprocess.run(
                    [sys.executable, "-c", CHILD, *argv],
                    env={**os.environ, "PYTHONPATH": trees[variant]},
                    capture_output=True,
                    text=True,
                    check=True,
                )
                line = next(x for x in done.stdout.splitlines() if x[:6] == "RESULT")
                train, cpu, total = map(float, line.split()[1:])
                times[variant].append((train, cpu, total))
                print(
                    variant,
                    f"{1e3 * train:.3f} ms/step, CPU {1e3 * cpu:.3f} ms/step, "
                    f"run {total:.2f} s",
                    flush=True,
                )

    def median(variant: str, k: int) -> float:
        return statistics.median(row[k] for row in times[variant])

    print(
        "\n| tree | loop ms/step: median | min | ratio | CPU ms/step: median | ratio |"
    )
    print("|---|--:|--:|--:|--:|--:|")
    for v in variants:
        wall, cpu = median(v, 0), median(v, 1)
        print(
            f"| {v} | {1e3 * wall:.3f} | {1e3 * min(r[0] for r in times[v]):.3f} | "
            f"{wall / median(variants[0], 0):.3f}x | {1e3 * cpu:.3f} | "
            f"{cpu / median(variants[0], 1):.3f}x |"
        )


if __name__ == "__main__":
    main()

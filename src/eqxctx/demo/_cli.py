"""The command line of `python -m eqxctx.demo`: flags, devices, run folder, report.

The device count must be set before JAX starts a backend. `python -m eqxctx.demo`
imports `eqxctx` (and so `jax`) before this module runs, but JAX creates its CPU
client lazily, on the first use of a device; so `use_cpu_devices` still works here,
as long as nothing has touched a device yet. Everything that computes is imported
after it.
"""

import argparse
import contextlib
import datetime
import importlib.util
import os
import re
import sys
import time
from collections.abc import Callable, Sequence

import jax


PROG = "python -m eqxctx.demo"


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse `type` for integers >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_seed = _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    """Return the demo's argument parser."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Train a scanned residual Equinox model on scikit-learn's 8x8 digits with "
            "eqxctx, evaluate it with a sharded MethodRunner, and write its summaries "
            "(JSON lines, TensorBoard, a PNG plot) to a new run folder."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--steps", type=_positive_int, default=300, help="training steps")
    add("--layers", type=_positive_int, default=4, help="residual blocks")
    add("--width", type=_positive_int, default=64, help="hidden width")
    add(
        "--batch-size",
        type=_positive_int,
        default=64,
        help="examples per batch; must divide over --devices",
    )
    add(
        "--seed",
        type=_seed,
        default=0,
        help="seed (>= 0) of the split, the init and dropout",
    )
    add(
        "--devices",
        type=_positive_int,
        default=8,
        help="simulated CPU devices for evaluation (sets XLA_FLAGS before JAX starts)",
    )
    add(
        "--logdir",
        default="runs",
        help="parent folder; each run writes into a new timestamped subfolder",
    )
    add("--no-plot", action="store_true", help="do not write the PNG plot")
    add(
        "--keep-hidden",
        action="store_true",
        help="keep the per-layer hidden states of the test set (module outputs) and "
        "save them to hidden_states.npz",
    )
    return parser


def use_cpu_devices(count: int) -> None:
    """Make JAX's CPU backend have `count` devices, overriding `XLA_FLAGS`.

    Replaces any `--xla_force_host_platform_device_count` in `XLA_FLAGS` and sets
    `jax_num_cpu_devices`; both take effect only if no JAX backend has started yet.
    """
    flag = "--xla_force_host_platform_device_count"
    flags = re.sub(rf"{flag}=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{flag}={count}"])
    # RuntimeError: a backend already started; the caller checks the device count.
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", count)


#: The modules that the demo needs beyond eqxctx: its `demo` extra.
DEMO_MODULES = ("optax", "sklearn", "tqdm", "matplotlib")


def missing_modules(names: Sequence[str] = DEMO_MODULES) -> list[str]:
    """Return the names of `names` that cannot be imported (found without importing)."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def make_run_dir(parent: str) -> str:
    """Create and return a new folder `parent/YYYYmmdd-HHMMSS[-k]`; never reuse one.

    Raises:
        NotADirectoryError: if `parent` exists and is not a folder.
        OSError: if `parent` or the run folder cannot be created.
    """
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise NotADirectoryError(f"{parent!r} exists and is not a directory")
    os.makedirs(parent, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for k in range(1000):
        path = os.path.join(parent, stamp if k == 0 else f"{stamp}-{k}")
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"too many runs named {stamp}-* in {parent!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo with command-line arguments `argv` (default: `sys.argv[1:]`).

    Returns:
        The exit status, 0 on success. Usage errors (an unwritable `--logdir`,
        `--devices 0`, a batch size that does not divide over the devices or is
        larger than the training set) exit with status 2 and argparse's usage line
        and one line of error. Without the `demo` extra it prints which extra to
        install and exits with status 1; neither leaves a run folder.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    missing = missing_modules()
    if missing:
        print(
            f"{PROG}: error: the demo needs eqxctx's `demo` extra (missing: "
            f"{', '.join(missing)}); install it with: pip install 'eqxctx[demo]'",
            file=sys.stderr,
        )
        return 1
    from eqxctx.demo._data import split_sizes

    num_train, _ = split_sizes()
    if args.batch_size > num_train:
        parser.error(
            f"argument --batch-size: {args.batch_size} is larger than the training "
            f"set ({num_train} examples); use at most {num_train}"
        )
    if args.batch_size % args.devices:
        parser.error(
            f"argument --batch-size: {args.batch_size} does not divide over "
            f"{args.devices} devices; use a multiple of {args.devices}"
        )
    use_cpu_devices(args.devices)
    devices = jax.devices()
    if devices[0].platform == "cpu" and len(devices) != args.devices:
        print(
            f"{PROG}: error: JAX started with {len(devices)} CPU devices, not "
            f"--devices {args.devices}: a JAX backend started before the flag was set",
            file=sys.stderr,
        )
        return 1
    if args.batch_size % len(devices):
        parser.error(
            f"argument --batch-size: {args.batch_size} does not divide over the "
            f"{len(devices)} {devices[0].platform} devices"
        )
    if os.path.exists(args.logdir) and not os.path.isdir(args.logdir):
        parser.error(
            f"argument --logdir: {args.logdir!r} exists and is not a directory; pass "
            "a folder (each run writes into a new subfolder of it)"
        )
    try:
        run_dir = make_run_dir(args.logdir)
    except OSError as e:
        parser.error(
            f"argument --logdir: cannot create a run folder in {args.logdir!r}: "
            f"{e.strerror or e}"
        )
    from eqxctx.demo._run import run

    start = time.perf_counter()
    try:
        run(args, run_dir)
    except BaseException:
        # Leave no empty run folder behind (a failure before anything was written).
        with contextlib.suppress(OSError):
            os.rmdir(run_dir)
        raise
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0

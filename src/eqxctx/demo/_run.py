"""One run of the demo: data, model, training, evaluation, logs, plot and report."""

import argparse
import math
import os
import sys
from typing import Any

import jax
import numpy as np

from eqxctx.demo._data import load_digits_split
from eqxctx.demo._model import Classifier
from eqxctx.demo._train import Evaluation, History, evaluate, train
from eqxctx.writers import (
    AbstractWriter,
    AsyncWriter,
    JsonlWriter,
    MultiWriter,
    TensorBoardWriter,
)


LEARNING_RATE = 3e-3
DROPOUT = 0.1


def _open_writers(run_dir: str) -> tuple[list[AbstractWriter], str]:
    writers: list[AbstractWriter] = [
        JsonlWriter(os.path.join(run_dir, "summaries.jsonl"), mode="x")
    ]
    try:
        writers.append(TensorBoardWriter(run_dir))
        note = f"events.out.tfevents.*  (TensorBoard: tensorboard --logdir {run_dir})"
    except ImportError:
        note = "(no TensorBoard files: pip install 'eqxctx[tensorboard]' for them)"
    return writers, note


def _progress_bar(steps: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=steps, desc="training", unit="step", dynamic_ncols=True)


def report(
    args: argparse.Namespace,
    history: History,
    result: Evaluation,
    files: list[str],
    run_dir: str,
) -> str:
    """Return the table that the demo prints."""
    s = result.summaries
    lines = [
        "",
        f"test accuracy: {s['accuracy']:.4f}",
        f"test loss:     {s['loss']:.4f}",
        f"train loss:    {history.scalars['train/loss'][-1]:.4f} (last batch)",
        f"evaluated on:  {result.num_devices} {jax.devices()[0].platform} devices",
        "",
        "layer   activation RMS   |update| / |residual|   (test set)",
    ]
    for layer in range(args.layers):
        rms = s[f"layers/iter{layer}/activation_rms"]
        ratio = s[f"layers/iter{layer}/update_ratio"]
        lines.append(f"{layer:>5}   {rms:>14.3f}   {ratio:>21.3f}")
    lines += [
        "",
        "layer   activations:  mean     std      min      max   grad RMS"
        "   (last training batch)",
    ]
    for layer in range(args.layers):
        prefix = f"train/layers/iter{layer}/activations/"
        m = {
            k: history.scalars[prefix + k][-1]
            for k in ("mean", "variance", "min", "max")
        }
        grad = history.scalars[f"train/layers/iter{layer}/stream_grad_rms"][-1]
        lines.append(
            f"{layer:>5}   {m['mean']:>17.3f} {math.sqrt(m['variance']):>7.3f} "
            f"{m['min']:>8.3f} {m['max']:>8.3f} {grad:>10.2e}"
        )
    lines += ["", f"logs: {run_dir}"]
    lines += [f"  {f}" for f in files]
    return "\n".join(lines)


def run(args: argparse.Namespace, run_dir: str) -> Evaluation:
    """Train, evaluate, write the logs and the plot into `run_dir`, print the table."""
    train_split, test_split = load_digits_split(seed=args.seed)
    key = jax.random.PRNGKey(args.seed)
    model = Classifier(
        num_layers=args.layers, width=args.width, dropout=DROPOUT, key=key
    )
    print(
        f"eqxctx demo: digits {train_split.images.shape[0]} train / "
        f"{test_split.images.shape[0]} test, {args.layers} layers x width "
        f"{args.width}, {args.steps} steps of {args.batch_size}",
        file=sys.stderr,
    )
    file_writers, tb_note = _open_writers(run_dir)
    bar = _progress_bar(args.steps)

    def progress(step: int, loss: float, accuracy: float) -> None:
        bar.set_postfix(loss=f"{loss:.4f}", accuracy=f"{accuracy:.3f}", refresh=False)
        bar.update(1)

    history = History(progress)
    # Fetching and file I/O on a background thread; `train` hands it a buffer of
    # steps every 32 steps.
    writer = AsyncWriter(MultiWriter(*file_writers, history))
    try:
        model = train(
            model,
            train_split,
            steps=args.steps,
            batch_size=args.batch_size,
            seed=args.seed,
            learning_rate=LEARNING_RATE,
            writer=writer,
        )
        writer.flush()
        bar.close()
        result = evaluate(
            model,
            test_split,
            batch_size=args.batch_size,
            seed=args.seed,
            keep_hidden=args.keep_hidden,
        )
        writer.write(args.steps, {"test": result.raw})
    finally:
        bar.close()
        writer.close()
    files = [
        f"summaries.jsonl        (steps 0-{args.steps - 1}: train/...; step "
        f"{args.steps}: test/...)",
        tb_note,
    ]
    if not args.no_plot:
        from eqxctx.demo._plot import plot_history

        plot_history(history, os.path.join(run_dir, "summaries.png"))
        files.append("summaries.png          (per-layer summaries over the steps)")
    if args.keep_hidden:
        path = os.path.join(run_dir, "hidden_states.npz")
        arrays: dict[str, Any] = {k: v for k, v in result.hidden.items()}
        np.savez(path, **arrays)
        shapes = ", ".join(f"{k} {v.shape}" for k, v in result.hidden.items())
        files.append(f"hidden_states.npz      (module outputs: {shapes})")
    print(report(args, history, result, files, run_dir))
    return result

"""The plot: training loss/accuracy and per-layer summaries over steps (a PNG)."""

import os
import re

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from eqxctx.demo._train import History


_LAYER = re.compile(r"^train/layers/iter(\d+)/(\w+)$")


def layer_series(history: History, name: str) -> dict[int, list[float]]:
    """Return `{layer: [value per step]}` of the per-layer summary `name`."""
    out: dict[int, list[float]] = {}
    for path, values in history.scalars.items():
        match = _LAYER.match(path)
        if match and match.group(2) == name:
            out[int(match.group(1))] = values
    return dict(sorted(out.items()))


def plot_history(history: History, path: str | os.PathLike[str]) -> None:
    """Save a PNG with four panels: loss/accuracy, activation RMS, update ratio, grads.

    The fourth panel is the gradient RMS of the residual stream entering each block
    (log scale).

    Uses matplotlib's object API with the Agg canvas (no pyplot, no display).
    """
    fig = Figure(figsize=(18, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_rms, ax_ratio, ax_grad = fig.subplots(1, 4)
    steps = history.steps
    ax_loss.plot(steps, history.scalars["train/loss"], color="tab:blue", lw=1)
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss (log)", color="tab:blue")
    ax_acc = ax_loss.twinx()
    ax_acc.plot(steps, history.scalars["train/accuracy"], color="tab:orange", lw=1)
    ax_acc.set_ylabel("accuracy", color="tab:orange")
    ax_loss.set_title("training loss and accuracy (per batch)")
    panels = [
        (ax_rms, "activation_rms", "activation RMS after each block"),
        (ax_ratio, "update_ratio", "|update| / |residual| per block"),
        (ax_grad, "stream_grad_rms", "gradient RMS of the stream into each block"),
    ]
    for ax, name, title in panels:
        series = layer_series(history, name)
        for layer, values in series.items():
            color = (0.1, 0.25 + 0.6 * layer / max(len(series) - 1, 1), 0.6)
            ax.plot(steps, values, lw=1, color=color, label=f"layer {layer}")
        ax.set_title(title)
        ax.legend(fontsize="small", ncols=2)
    ax_grad.set_yscale("log")
    for ax in (ax_loss, ax_rms, ax_ratio, ax_grad):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.savefig(os.fspath(path), dpi=100)

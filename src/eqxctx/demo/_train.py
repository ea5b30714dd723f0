"""Training (optax Adam under `eqx.filter_jit`) and evaluation (a `MethodRunner`)."""

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, PRNGKeyArray

import eqxctx
from eqxctx.demo._data import Batch, Split, eval_batches, train_batches
from eqxctx.demo._model import Classifier, weighted_mean
from eqxctx.writers import (
    AbstractWriter,
    HostSummaries,
    HostValue,
    SummaryBuffer,
    fetch_summaries,
)


TrainStep = Callable[
    [Classifier, optax.OptState, Batch, PRNGKeyArray],
    tuple[Classifier, optax.OptState, Mapping[str, Any]],
]
BufferedTrainStep = Callable[
    [Classifier, optax.OptState, SummaryBuffer, Batch, PRNGKeyArray, Array],
    tuple[Classifier, optax.OptState, SummaryBuffer],
]

#: The training steps whose summaries the demo's `SummaryBuffer` holds: written
#: (fetched in one transfer) every 32 steps.
LOG_EVERY = 32


def loss_fn(
    model: Classifier, batch: dict[str, Any], ctx: eqxctx.Context
) -> tuple[Array, eqxctx.Context]:
    """Return the weighted mean cross-entropy of `batch` (NumPy or JAX arrays)."""
    outputs, ctx = model.evaluate(batch, ctx)
    return weighted_mean(outputs["nll"], jnp.asarray(batch["weight"])), ctx


def make_train_step(optimizer: optax.GradientTransformation) -> TrainStep:
    """Return the jitted training step of `optimizer`.

    The step is `(model, opt_state, batch, key) -> (model, opt_state, summaries)`.
    The loss runs under `eqxctx.value_and_grad` in training mode (dropout on, keys
    from `key`), whose gradients equal `eqx.filter_value_and_grad`'s and whose
    collection also holds the backward-pass summaries (`stream_grad_rms` per layer);
    the summaries are those of the root context (nested mapping, with the per-layer
    ones as `layers/iter{i}/...`).
    """
    return eqx.filter_jit(functools.partial(_train_step, optimizer))


def _train_step(
    optimizer: optax.GradientTransformation,
    model: Classifier,
    opt_state: optax.OptState,
    batch: dict[str, Any],  # NumPy arrays, or their tracers (`Batch` when called)
    key: PRNGKeyArray,
) -> tuple[Classifier, optax.OptState, Mapping[str, Any]]:
    grad_fn = eqxctx.value_and_grad(loss_fn)
    (_, collection), grads = grad_fn(model, batch, prng_key=key, is_training=True)
    summaries = collection.summaries
    params = eqx.filter(model, eqx.is_array)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, summaries


def make_buffered_train_step(
    optimizer: optax.GradientTransformation,
) -> BufferedTrainStep:
    """Return the jitted training step of `optimizer` that logs into a buffer.

    The step is `(model, opt_state, buffer, batch, key, step) -> (model, opt_state,
    buffer)`: `make_train_step`'s, whose summaries `{"train": summaries}` are added
    to the `SummaryBuffer` as step `step` (an int32 scalar array) instead of being
    returned.
    """

    @eqx.filter_jit
    def step(
        model: Classifier,
        opt_state: optax.OptState,
        buffer: SummaryBuffer,
        batch: dict[str, Any],  # (traced: tracers, not NumPy arrays)
        key: PRNGKeyArray,
        step: Array,
    ) -> tuple[Classifier, optax.OptState, SummaryBuffer]:
        model, opt_state, summaries = _train_step(
            optimizer, model, opt_state, batch, key
        )
        return model, opt_state, buffer.add(step, {"train": summaries})

    return step


class History(AbstractWriter):
    """A writer that keeps the scalar summaries in memory: `{path: [value per step]}`.

    It runs beside the file writers (in the same `MultiWriter`, on `AsyncWriter`'s
    thread) and calls `progress(step, loss, accuracy)` for each training step.

    Attributes:
        steps: the steps written, in order.
        scalars: `{path: [value per step]}` of the shape-`()` values.
    """

    def __init__(self, progress: Callable[[int, float, float], None] | None = None):
        self.steps: list[int] = []
        self.scalars: dict[str, list[float]] = {}
        self._progress = progress

    def write_host(self, host: HostSummaries) -> None:
        """Record the scalars of one step; report the training loss and accuracy."""
        values = scalar_values(host.values)
        if "train/loss" not in values:
            return  # the test line
        self.steps.append(host.step)
        for path, value in values.items():
            self.scalars.setdefault(path, []).append(value)
        if self._progress is not None:
            self._progress(host.step, values["train/loss"], values["train/accuracy"])

    def flush(self) -> None:
        """Nothing to flush."""

    def close(self) -> None:
        """Nothing to close."""


def scalar_values(values: Mapping[str, HostValue]) -> dict[str, float]:
    """Return the scalars (NumPy arrays of shape `()`) of fetched values as floats."""
    return {
        path: float(v)
        for path, v in values.items()
        if isinstance(v, np.ndarray) and v.ndim == 0
    }


def train(
    model: Classifier,
    data: Split,
    *,
    steps: int,
    batch_size: int,
    seed: int,
    learning_rate: float,
    writer: AbstractWriter,
) -> Classifier:
    """Train `model` for `steps` Adam steps; write `{"train": summaries}` each step.

    Every step's summaries are added to a `SummaryBuffer` on the device, which
    `writer.write_buffer` writes every `LOG_EVERY` steps (one transfer each) and
    once at the end, also when the loop is interrupted (an exception, Ctrl-C): the
    files hold every step that ran, once.

    Returns:
        The trained model.
    """
    schedule = optax.cosine_decay_schedule(learning_rate, steps, alpha=0.05)
    optimizer = optax.adam(schedule)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    step_fn = make_buffered_train_step(optimizer)
    key = jax.random.fold_in(jax.random.PRNGKey(seed), 1)
    batches = train_batches(data, batch_size=batch_size, seed=seed)
    batch = next(batches)
    # The rows of the step's summaries, reserved now (traced, not compiled): the
    # step then compiles once.
    like = eqx.filter_eval_shape(
        functools.partial(_train_step, optimizer), model, opt_state, batch, key
    )[2]
    buffer = SummaryBuffer.create(LOG_EVERY, {"train": like})
    try:
        for step in range(steps):
            if step:
                batch = next(batches)
            model, opt_state, buffer = step_fn(
                model,
                opt_state,
                buffer,
                batch,
                jax.random.fold_in(key, step),
                jnp.int32(step),
            )
            if (step + 1) % buffer.size == 0:
                buffer = writer.write_buffer(buffer)
    finally:
        buffer = writer.write_buffer(buffer)
    return model


@dataclasses.dataclass
class Evaluation:
    """What `evaluate` found on the test set.

    Attributes:
        summaries: `{path: value}` of the accumulated summaries (e.g. `accuracy`,
            `layers/iter0/activation_rms`), as floats.
        predictions: `int32[n]`, the predicted digit of each test example.
        hidden: `{path: float32[layers, n, width]}` module outputs (the blocks'
            hidden states), only when asked for; else empty.
        num_devices: the size of the mesh the runner ran on.
        raw: the accumulated summaries as a nested mapping (for the writers).
    """

    summaries: dict[str, float]
    predictions: np.ndarray
    hidden: dict[str, np.ndarray]
    num_devices: int
    raw: Mapping[str, Any]


def evaluate(
    model: Classifier, data: Split, *, batch_size: int, seed: int, keep_hidden: bool
) -> Evaluation:
    """Run `model.evaluate` over `data` with a `MethodRunner` on all local devices.

    Batches are host-local NumPy arrays (the last one padded with weight-0 examples)
    split over a one-axis mesh `("data",)` of every device; the summaries are
    accumulated across batches with `SummaryAccumulator` (weighted means), and the
    per-layer hidden states are kept only if `keep_hidden`.
    """
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("data",))
    drop: Callable[[str], bool] = (
        (lambda path: False) if keep_hidden else (lambda path: True)
    )
    runner = eqxctx.MethodRunner.create(
        model,
        "evaluate",
        mesh=mesh,
        prng_key=jax.random.PRNGKey(seed),
        drop_module_outputs=drop,
    )
    accumulator = eqxctx.SummaryAccumulator()
    predictions: list[np.ndarray] = []
    hidden: dict[str, list[np.ndarray]] = {}
    batches = eval_batches(data, batch_size=batch_size)
    for out in eqxctx.run_batches(runner, batches):
        accumulator = accumulator.update(out.summaries)
        host = eqxctx.to_host((out.output_batch["predictions"], out.module_outputs))
        predictions.append(host[0])
        outputs = eqxctx.OutputCollection({}, {}, host[1]).flatten("module_outputs")
        for path, value in outputs.items():
            hidden.setdefault(path, []).append(value)
    n = len(data.labels)
    raw = accumulator.summaries()
    values = fetch_summaries(raw, where="evaluate")
    return Evaluation(
        summaries=scalar_values(values),
        predictions=np.concatenate(predictions)[:n],
        # [layers, batch, width] per batch -> [layers, n, width].
        hidden={k: np.concatenate(v, axis=1)[:, :n] for k, v in hidden.items()},
        num_devices=len(devices),
        raw=raw,
    )

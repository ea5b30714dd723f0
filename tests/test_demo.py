import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matplotlib.image import imread

import eqxctx
from eqxctx.demo._cli import main, make_run_dir, use_cpu_devices
from eqxctx.demo._data import Split, eval_batches, load_digits_split, train_batches
from eqxctx.demo._model import Classifier
from eqxctx.demo._train import evaluate
from tb_events import scalars, summary_values


def run_demo(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # On the CPU also on an accelerator host, whose JAX still warns at import.
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONWARNINGS": "ignore:Transparent hugepages:UserWarning",
    }
    # conftest asks for 8 devices in XLA_FLAGS (on the CPU; here also elsewhere):
    # --devices must override it.
    flag = "--xla_force_host_platform_device_count=8"
    if "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}"
    assert "xla_force_host_platform_device_count=8" in env["XLA_FLAGS"]
    return subprocess.run(
        [sys.executable, "-m", "eqxctx.demo", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    cwd = tmp_path_factory.mktemp("demo")
    args = ("--steps", "30", "--layers", "2", "--devices", "2", "--keep-hidden")
    proc = run_demo(*args, "--logdir", "logs", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = (cwd / "logs").iterdir()
    return proc, run_dir


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_demo_prints_the_table(demo_run: tuple[Any, Path]) -> None:
    proc, run_dir = demo_run
    out = proc.stdout
    match = re.search(r"^test accuracy: (0\.\d{4})$", out, re.MULTILINE)
    assert match, out
    assert float(match.group(1)) > 0.8  # 30 steps; the default run reaches >= 0.95
    assert "evaluated on:  2 cpu devices" in out  # --devices overrode XLA_FLAGS
    assert re.search(r"^\s+0\s+\d+\.\d{3}\s+\d+\.\d{3}$", out, re.MULTILINE)
    assert re.search(r"^\s+1\s+\d+\.\d{3}\s+\d+\.\d{3}$", out, re.MULTILINE)
    # The on-device moments of the blocks' outputs (last training batch).
    assert "layer   activations:  mean     std      min      max" in out
    number = r"\s+-?\d+\.\d{3}"
    assert "max   grad RMS" in out
    assert re.search(rf"^\s+1{number * 4}\s+\d\.\d\de[-+]\d\d$", out, re.MULTILINE)
    assert f"logs: {Path('logs') / run_dir.name}" in out
    # The last line, as docs/demo.md and the README show it (issue 35 item 19).
    assert re.fullmatch(r"done in \d+\.\d s", out.splitlines()[-1]), out


MOMENTS = ("count", "mean", "variance", "min", "max", "nonfinite")


def test_demo_jsonl(demo_run: tuple[Any, Path]) -> None:
    proc, run_dir = demo_run
    lines = read_jsonl(run_dir / "summaries.jsonl")
    assert [line["step"] for line in lines] == list(range(31))
    train, test = lines[:30], lines[30]
    for line in train:
        for layer in (0, 1):
            for name in ("activation_rms", "update_ratio", "stream_grad_rms"):
                value = line[f"train/layers/iter{layer}/{name}"]
                assert isinstance(value, float)
                assert value > 0
            # The on-device moments of each block's output: batch x width values.
            moments = {
                k: line[f"train/layers/iter{layer}/activations/{k}"] for k in MOMENTS
            }
            assert moments["count"] == 64 * 64
            assert moments["nonfinite"] == 0
            assert moments["min"] < moments["mean"] < moments["max"]
            assert moments["variance"] > 0
        # The on-device histogram of the logits: the non-empty buckets of width 1.
        logits = line.pop("train/logits")
        edges, counts = logits["edges"], logits["counts"]
        assert len(edges) == len(counts) + 1
        assert np.allclose(np.diff(edges), 1.0)
        assert -20 <= edges[0] < edges[-1] <= 20
        assert sum(counts) == 64 * 10  # every logit is within [-20, 20]
        assert all(isinstance(v, (int, float)) for v in line.values())
    assert not any("iter2" in key for key in train[0])
    losses = [line["train/loss"] for line in train]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    assert losses[0] > 1.5  # about log(10) at the start
    # The test line holds the accumulated evaluation summaries, as printed.
    accuracy = re.search(r"test accuracy: (\S+)", proc.stdout)
    assert accuracy
    assert f"{test['test/accuracy']:.4f}" == accuracy.group(1)
    # Training-only summaries (moments, logits) are not in the test line.
    assert set(test) == {"step"} | {
        "test/" + k.removeprefix("train/")
        for k in train[0]
        if k != "step" and "/activations/" not in k and "stream_grad_rms" not in k
    }
    # issue 36: pandas reads the file too (one row per step, one column per path).
    import pandas  # the test group installs it

    frame = pandas.read_json(
        run_dir / "summaries.jsonl", lines=True, precise_float=True
    )
    assert frame["step"].tolist() == list(range(31))
    np.testing.assert_array_equal(frame["train/loss"][:30], losses)


def test_demo_tensorboard_equals_jsonl(demo_run: tuple[Any, Path]) -> None:
    _, run_dir = demo_run
    lines = read_jsonl(run_dir / "summaries.jsonl")
    expected = {
        (line["step"], key): np.float32(value)
        for line in lines
        for key, value in line.items()
        if key != "step" and key != "train/logits"
    }
    assert len(expected) == 30 * (6 + 2 + 2 * 6) + 6  # + 2 gradient RMS
    assert scalars(str(run_dir)) == expected
    histos = {
        step: value.histo
        for step, value in summary_values(str(run_dir))
        if value.tag == "train/logits"
    }
    assert sorted(histos) == list(range(30))
    for line in lines[:30]:
        h, want = histos[line["step"]], line["train/logits"]
        assert list(h.bucket) == want["counts"]
        assert [h.min, *h.bucket_limit] == want["edges"]


def test_demo_plot_and_hidden_states(demo_run: tuple[Any, Path]) -> None:
    _, run_dir = demo_run
    png = run_dir / "summaries.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(png)
    assert image.ndim == 3
    assert image.shape[0] > 100
    assert image.shape[1] > 300
    with np.load(run_dir / "hidden_states.npz") as hidden:
        states = hidden["layers/iter/hidden"]
    _, test = load_digits_split(seed=0)
    assert states.shape == (2, len(test.labels), 64)
    assert np.isfinite(states).all()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--devices", "0"], "argument --devices: must be at least 1, got 0"),
        (["--batch-size", "60"], "argument --batch-size: 60 does not divide over 8"),
        (
            ["--batch-size", "1440"],
            "argument --batch-size: 1440 is larger than the training set (1438 exam",
        ),
        (["--steps", "x"], "argument --steps: expected an integer, got 'x'"),
        (["--logdir", "blocker/runs"], "argument --logdir: cannot create a run folder"),
        (["--seed", "-3"], "argument --seed: must be at least 0, got -3"),
        (["--seed=-3", "--logdir", "logs"], "argument --seed: must be at least 0"),
        (["--logdir", "blocker"], "argument --logdir: 'blocker' exists and is not a d"),
    ],
)
def test_demo_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "blocker").write_text("a file, not a folder")
    proc = run_demo(*args, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("usage: python -m eqxctx.demo")
    assert lines[-1].startswith(f"python -m eqxctx.demo: error: {message}")
    assert not lines[-2].startswith("python -m eqxctx.demo: error")  # one line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker"]  # no run folder


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write")
def test_demo_read_only_logdir(tmp_path: Path) -> None:
    logdir = tmp_path / "ro"
    logdir.mkdir(mode=0o500)
    proc = run_demo("--logdir", str(logdir), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("Permission denied")


def test_demo_without_its_extra_says_what_to_install(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "optax", None)  # as if not installed
    assert main(["--logdir", str(tmp_path / "logs")]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == (
        "python -m eqxctx.demo: error: the demo needs eqxctx's `demo` extra "
        "(missing: optax); install it with: pip install 'eqxctx[demo]'"
    )
    assert list(tmp_path.iterdir()) == []  # no run folder, not even --logdir


def test_train_batches_refuse_a_batch_larger_than_the_split() -> None:
    train, _ = load_digits_split(seed=0)
    with pytest.raises(ValueError, match="larger than the 1438 examples"):
        next(train_batches(train, batch_size=1439, seed=0))


def test_make_run_dir_refuses_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        make_run_dir(str(blocker))
    assert blocker.read_text() == ""


def test_run_folders_are_never_reused(tmp_path: Path) -> None:
    (tmp_path / "existing").mkdir()
    made = [make_run_dir(str(tmp_path)) for _ in range(3)]
    assert len(set(made)) == 3  # same second: suffixes -1, -2
    assert all(Path(p).parent == tmp_path and not any(Path(p).iterdir()) for p in made)


def test_use_cpu_devices_replaces_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = "--xla_foo=1 --xla_force_host_platform_device_count=8 --xla_bar"
    monkeypatch.setenv("XLA_FLAGS", flags)
    calls: list[tuple[str, object]] = []
    # Record instead of changing this test process's JAX configuration.
    monkeypatch.setattr(jax.config, "update", lambda k, v: calls.append((k, v)))
    use_cpu_devices(3)
    assert os.environ["XLA_FLAGS"] == (
        "--xla_foo=1 --xla_bar --xla_force_host_platform_device_count=3"
    )
    assert calls == [("jax_num_cpu_devices", 3)]


def test_data_split_and_batches() -> None:
    train, test = load_digits_split(seed=0)
    assert (len(train.labels), len(test.labels)) == (1438, 359)
    assert train.images.dtype == np.float32
    assert train.images.max() == 1.0
    again, _ = load_digits_split(seed=0)
    np.testing.assert_array_equal(again.labels, train.labels)
    other, _ = load_digits_split(seed=1)
    assert not np.array_equal(other.labels, train.labels)
    batches = list(eval_batches(test, batch_size=64))
    assert len(batches) == 6
    assert all(b["image"].shape == (64, 64) for b in batches)
    weights = np.concatenate([b["weight"] for b in batches])
    np.testing.assert_array_equal(weights, np.arange(6 * 64) < 359)
    labels = np.concatenate([b["label"] for b in batches])[:359]
    np.testing.assert_array_equal(labels, test.labels)
    small = Split(train.images[:10], np.arange(10, dtype=np.int32))  # ids as labels
    stream = train_batches(small, batch_size=4, seed=0)
    for _ in range(3):  # epochs of 10 // 4 = 2 batches, no example twice in one
        epoch = np.concatenate([next(stream)["label"] for _ in range(2)])
        assert len(set(epoch.tolist())) == 8


# -- the model, in process (with the jaxtyping/beartype hook) ------------------------


def _small_model(num_layers: int = 3, width: int = 8) -> Classifier:
    return Classifier(
        num_layers=num_layers, width=width, dropout=0.5, key=jax.random.PRNGKey(0)
    )


def _batch(n: int = 6) -> dict[str, jax.Array]:
    train, _ = load_digits_split(seed=0)
    weight = np.ones(n, dtype=np.float32)
    weight[-2:] = 0.0  # two padding examples
    return {
        "image": jnp.asarray(train.images[:n]),
        "label": jnp.asarray(train.labels[:n]),
        "weight": jnp.asarray(weight),
    }


def test_model_scan_equals_a_python_loop_over_layers() -> None:
    model, batch = _small_model(), _batch()
    out, coll = eqxctx.functional(
        model.evaluate,
        prng_key=jax.random.PRNGKey(1),
        is_training=False,
        args=(batch,),
        drop_output_collections=(),
    )
    # Reference: slice each layer's parameters and loop in Python.
    params, static = eqx.partition(model.blocks, eqx.is_array)
    w = np.asarray(batch["weight"])
    h = jax.vmap(model.embed)(batch["image"])
    summaries = coll.flatten("summaries")
    hidden = coll.flatten("module_outputs")["layers/iter/hidden"]
    assert hidden.shape == (3, 6, 8)
    for i in range(3):
        block = eqx.combine(jax.tree.map(lambda p, i=i: p[i], params), static)
        new_h, _ = block(h, batch["weight"], eqxctx.Context.root())
        np.testing.assert_allclose(hidden[i], new_h, rtol=1e-5, atol=1e-6)
        update = np.asarray(new_h - h)
        rms = np.sqrt(np.sum(np.mean(np.asarray(new_h) ** 2, -1) * w) / w.sum())
        ratio = np.linalg.norm(update, axis=-1) / (np.linalg.norm(h, axis=-1) + 1e-6)
        s_rms = summaries[f"layers/iter{i}/activation_rms"]
        s_ratio = summaries[f"layers/iter{i}/update_ratio"]
        np.testing.assert_allclose(s_rms.value(), rms, rtol=1e-5)
        np.testing.assert_allclose(
            s_ratio.value(), np.sum(ratio * w) / w.sum(), rtol=1e-5
        )
        assert float(s_rms.weight) == 4.0
        h = new_h
    logits = jax.vmap(model.head)(jax.vmap(model.head_norm)(h))
    labels = np.asarray(batch["label"])
    log_probs = np.asarray(jax.nn.log_softmax(logits))
    nll = -log_probs[np.arange(6), labels]
    np.testing.assert_allclose(out["nll"], nll, rtol=1e-5)
    np.testing.assert_array_equal(out["predictions"], np.argmax(logits, -1))
    np.testing.assert_allclose(
        summaries["loss"].value(), np.sum(nll * w) / 4, rtol=1e-5
    )
    correct = np.asarray(out["predictions"]) == labels
    np.testing.assert_allclose(summaries["accuracy"].value(), np.sum(correct * w) / 4)


def test_model_dropout_uses_the_context_keys_only_in_training() -> None:
    model, batch = _small_model(), _batch()

    # Compiled once per mode (called eagerly, each call compiled its scan again).
    @functools.partial(jax.jit, static_argnums=1)
    def run(key: jax.Array, training: bool) -> Any:
        _, coll = eqxctx.functional(
            model.evaluate,
            prng_key=key,
            is_training=training,
            args=(batch,),
            drop_output_collections=(),
        )
        return coll.module_outputs

    def hidden(key: int, training: bool) -> np.ndarray:
        outputs = run(jax.random.PRNGKey(key), training)
        return np.asarray(outputs["layers"]["iter"]["hidden"])

    np.testing.assert_array_equal(hidden(1, False), hidden(2, False))
    np.testing.assert_array_equal(hidden(1, True), hidden(1, True))
    assert not np.allclose(hidden(1, True), hidden(2, True))
    assert not np.allclose(hidden(1, True), hidden(1, False))


def test_evaluate_with_the_runner_matches_numpy() -> None:
    model = _small_model(num_layers=2)
    _, test = load_digits_split(seed=0)
    data = Split(test.images[:40], test.labels[:40])  # 3 batches of 16, padded
    result = evaluate(model, data, batch_size=16, seed=0, keep_hidden=True)
    assert result.num_devices == len(jax.devices())
    # Reference: one unpadded call, on one device.
    batch = {
        "image": jnp.asarray(data.images),
        "label": jnp.asarray(data.labels),
        "weight": jnp.ones(40, dtype=jnp.float32),
    }
    out, coll = eqxctx.functional(
        model.evaluate,
        prng_key=None,
        is_training=False,
        args=(batch,),
        drop_output_collections=(),
    )
    np.testing.assert_array_equal(result.predictions, out["predictions"])
    accuracy = np.mean(np.asarray(out["predictions"]) == data.labels)
    assert result.summaries["accuracy"] == pytest.approx(accuracy, rel=1e-6)
    assert result.summaries["loss"] == pytest.approx(
        float(np.mean(out["nll"])), rel=1e-5
    )
    expected_hidden = coll.flatten("module_outputs")["layers/iter/hidden"]
    np.testing.assert_allclose(
        result.hidden["layers/iter/hidden"], expected_hidden, rtol=1e-5, atol=1e-6
    )
    assert set(result.summaries) == {
        "loss",
        "accuracy",
        *(
            f"layers/iter{i}/{n}"
            for i in (0, 1)
            for n in ("activation_rms", "update_ratio")
        ),
    }


def test_training_loss_gradient_summaries_equal_a_perturbation_reference() -> None:
    from eqxctx.demo._model import weighted_mean
    from eqxctx.demo._train import loss_fn

    model, batch = _small_model(), _batch()
    (loss, coll), grads = eqxctx.value_and_grad(loss_fn)(
        model, batch, prng_key=jax.random.PRNGKey(1), is_training=False
    )
    # The same gradients as `eqx.filter_value_and_grad` under `functional`.
    want_loss, want = eqx.filter_value_and_grad(
        lambda m: eqxctx.functional(
            loss_fn, prng_key=jax.random.PRNGKey(1), is_training=False, args=(m, batch)
        )[0]
    )(model)
    assert float(loss) == float(want_loss)
    assert bool(eqx.tree_equal(grads, want))
    # Reference: d loss / d (a zero perturbation of the stream entering block i).
    params, static = eqx.partition(model.blocks, eqx.is_array)

    def perturbed(perts: Any) -> Any:
        h = jax.vmap(model.embed)(batch["image"])
        for i in range(3):
            block = eqx.combine(jax.tree.map(lambda p, i=i: p[i], params), static)
            h, _ = block(h + perts[i], batch["weight"], eqxctx.Context.root())
        logits = jax.vmap(model.head)(jax.vmap(model.head_norm)(h))
        log_probs = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(log_probs, batch["label"][:, None], axis=1)[:, 0]
        return weighted_mean(nll, batch["weight"])

    cts = jax.grad(perturbed)(jnp.zeros((3, 6, 8)))
    summaries = coll.flatten("summaries")
    for i in range(3):
        np.testing.assert_allclose(
            summaries[f"layers/iter{i}/stream_grad_rms"],
            np.sqrt(np.mean(np.asarray(cts[i]) ** 2)),
            rtol=1e-5,
        )


def test_training_through_the_buffer_writes_what_step_by_step_writing_does(
    tmp_path: Path,
) -> None:
    # issue 39: the demo logs every step through a `SummaryBuffer`.
    import optax

    from eqxctx.demo._train import LOG_EVERY, make_train_step, train
    from eqxctx.writers import AsyncWriter, JsonlWriter

    split, _ = load_digits_split(seed=0)
    model = Classifier(num_layers=1, width=16, dropout=0.1, key=jax.random.key(0))
    steps = LOG_EVERY + 3  # a full buffer and a partial one
    # optax's Adam raises its decay to an int32 power: standard promotion.
    with (
        jax.numpy_dtype_promotion("standard"),
        AsyncWriter(JsonlWriter(tmp_path / "b.jsonl")) as writer,
    ):
        train(
            model,
            split,
            steps=steps,
            batch_size=16,
            seed=0,
            learning_rate=3e-3,
            writer=writer,
        )
    # The reference: the same steps, each step's summaries written as it returns.
    schedule = optax.cosine_decay_schedule(3e-3, steps, alpha=0.05)
    optimizer = optax.adam(schedule)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    step_fn = make_train_step(optimizer)
    key = jax.random.fold_in(jax.random.PRNGKey(0), 1)
    batches = train_batches(split, batch_size=16, seed=0)
    with (
        jax.numpy_dtype_promotion("standard"),
        JsonlWriter(tmp_path / "s.jsonl") as reference,
    ):
        for step in range(steps):
            model, opt_state, summaries = step_fn(
                model, opt_state, next(batches), jax.random.fold_in(key, step)
            )
            reference.write(step, {"train": summaries})
    got = (tmp_path / "b.jsonl").read_bytes()
    assert got == (tmp_path / "s.jsonl").read_bytes()
    assert len(got.splitlines()) == steps

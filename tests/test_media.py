"""ImageSummary, AudioSummary and CallbackSummary (`_media.py`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxctx import (
    AudioSummary,
    CallbackSummary,
    HistogramSummary,
    ImageSummary,
    OutputCollection,
)


def test_media_summaries_keep_first() -> None:
    first = ImageSummary(jnp.zeros((1, 2, 2, 3)))
    second = ImageSummary(jnp.ones((1, 2, 2, 3)))
    assert first.accumulate(second) is first
    audio = AudioSummary(jnp.zeros(8), sample_rate=8000)
    assert audio.accumulate(AudioSummary(jnp.ones(8), sample_rate=8000)) is audio
    with pytest.raises(ValueError, match="sample_rate=8000 with one with sample_rate"):
        audio.accumulate(AudioSummary(jnp.ones(8)))
    assert audio.sample_rate == 8000
    assert AudioSummary(jnp.zeros(8)).sample_rate == 16000
    # Histograms add counts (tests/test_statistics.py).
    hist = HistogramSummary(jnp.arange(4.0), bins=2, range=(0, 4))
    np.testing.assert_array_equal(hist.accumulate(hist).value(), [4, 4])


@pytest.mark.parametrize(
    ("shape", "ok"),
    [
        ((2, 4, 4), True),
        ((2, 4, 4, 1), True),
        ((2, 4, 4, 3), True),
        ((2, 4, 4, 4), True),
        ((2, 4, 4, 2), False),
        ((4, 4), False),
        ((1, 2, 4, 4, 3), False),
    ],
)
def test_image_validate(shape: tuple[int, ...], ok: bool) -> None:
    s = ImageSummary(jnp.zeros(shape))
    if ok:
        s.validate()
    else:
        with pytest.raises(ValueError, match="ImageSummary"):
            s.validate()


def test_audio_validate() -> None:
    AudioSummary(jnp.zeros((8, 2))).validate()
    with pytest.raises(ValueError, match="sample_rate must be positive"):
        AudioSummary(jnp.zeros(8), sample_rate=0).validate()
    with pytest.raises(ValueError, match=r"\[time\] or \[time, channels\]"):
        AudioSummary(jnp.zeros((1, 2, 3))).validate()


def test_callback_summary_runs_on_host_after_jit() -> None:
    def describe(x: jax.Array, *, scale: float) -> str:
        return f"max={float(np.max(np.asarray(x)) * scale):.1f}"

    def f(x: jax.Array) -> OutputCollection:
        return OutputCollection.empty().add_summary(
            "text", CallbackSummary(describe, x, scale=2.0)
        )

    coll = jax.jit(f)(jnp.arange(3.0))
    summary = coll.flatten("summaries")["text"]
    assert isinstance(summary, CallbackSummary)
    assert summary.value() == "max=4.0"
    assert summary.accumulate(summary) is summary

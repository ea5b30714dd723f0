"""SummaryAccumulator and run_batches (`_batches.py`)."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eqxctx import ImageSummary, OutputCollection, SummaryAccumulator, WeightedSummary
from eqxctx.writers import fetch_summaries


# From test_host_cost.py: found in a tester round.
def test_accumulating_host_values_is_exact() -> None:
    acc = SummaryAccumulator()
    for _ in range(2):
        acc = acc.update({"n": np.int64(2**40), "x": np.float64(0.1), "p": True})
    flat = acc.flatten()
    assert flat["n"] == 2**41
    assert flat["n"].dtype == np.int64  # pyright: ignore[reportAttributeAccessIssue]
    assert flat["x"] == np.float64(0.1) + np.float64(0.1)
    assert flat["p"] == 2
    assert SummaryAccumulator().update({"n": 2**31}).update({"n": 1}).flatten()[
        "n"
    ] == (2**31 + 1)


# From test_host_cost.py: found in a tester round.
def test_accumulating_copies_the_callers_numpy_arrays() -> None:
    # A host buffer refilled for every batch: each update counts what it held then.
    buf = np.zeros(2, np.float32)
    image = np.zeros((1, 2, 2, 1), np.uint8)
    acc = SummaryAccumulator()
    kept = []
    for values in ([1.0, 2.0], [10.0, 20.0], [100.0, 200.0]):
        buf[:] = values
        image[:] = int(values[0]) % 256
        summaries = {"x": buf, "w": WeightedSummary(buf, 2.0), "i": ImageSummary(image)}
        acc = acc.update(summaries)
        kept.append(acc)
    np.testing.assert_array_equal(acc.flatten()["x"], [111.0, 222.0])
    weighted = acc.flatten()["w"]
    assert isinstance(weighted, WeightedSummary)
    np.testing.assert_allclose(weighted.value(), [37.0, 74.0])
    # The first image is kept (media summaries are not averaged), as it was.
    first = acc.flatten()["i"]
    assert isinstance(first, ImageSummary)
    assert int(np.asarray(first.value()).max()) == 1
    buf[:] = -1.0
    np.testing.assert_array_equal(kept[0].flatten()["x"], [1.0, 2.0])
    # JAX arrays are immutable: kept as they are, not copied.
    y = jnp.arange(2.0)
    assert SummaryAccumulator().update({"y": y}).flatten()["y"] is y


# From test_host_cost.py: found in a tester round.
def test_a_rebuilt_structure_is_the_one_remembered() -> None:
    # A FrozenMapping holding plain mappings (and collections) is rebuilt into
    # another structure: the rebuilt one is checked, returned and remembered, every
    # time (the raw one once was, and the next such input then skipped the rebuild).
    base = OutputCollection.empty().add_summary("loss", jnp.float32(1))
    inner = (
        OutputCollection.empty()
        .add_summary("s", jnp.float32(1))
        .add_state_update("u", jnp.float32(10))
    )

    def raw() -> Any:
        return jax.tree_util.tree_map(lambda _: {"c": inner}, base.summaries)

    for _ in range(2):
        acc = SummaryAccumulator().update(raw()).update(raw())
        assert acc.flatten() == {"loss/c/s": 2.0}
        level = type(base.summaries)  # (the class of every collection level)
        assert isinstance(acc.accumulated, level)
        assert isinstance(acc.accumulated["loss"], level)
        np.testing.assert_array_equal(fetch_summaries(raw())["loss/c/s"], 1.0)

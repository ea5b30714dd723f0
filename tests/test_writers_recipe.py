"""A write's read is replayed for a structure seen before; it equals the full read.

`eqxctx.writers._read.host_values` reads the first write of a structure in full and
records a `Recipe`; later writes of that structure replay it. The reference here is
the full read itself (recipes switched off), on the same values.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eqxctx
import eqxctx.writers._read as writers_read
from eqxctx.writers import HostSummaries, JsonlWriter, fetch_summaries
from eqxctx.writers._jsonl import json_line


def _scan_collection(xs: jax.Array) -> eqxctx.OutputCollection:
    def body(c: jax.Array, x: jax.Array, ctx: eqxctx.Context) -> Any:
        ctx = ctx.add_summary("raw", x * 2.0)
        ctx = ctx.add_summary("w", eqxctx.WeightedSummary(x, jnp.abs(x) + 1.0))
        ctx = ctx.add_summary("mx", eqxctx.MaxSummary(x))
        ctx = ctx.add_summary("positive", x > 0)
        ctx = ctx.add_summary(
            "n", eqxctx.SumSummary(jnp.round(x * 100).astype(jnp.int32))
        )
        ctx = ctx.add_summary("m", eqxctx.MomentsSummary(jnp.stack([x, -x, 2 * x])))
        return c + x, None, ctx

    return eqxctx.scan_in_context(
        body, context=eqxctx.Context.root(), carry=jnp.float32(0), xs=xs
    )[2]


def _summaries(seed: int) -> dict[str, Any]:
    """Every kind a recipe replays, with values that depend on `seed`."""
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    return {
        "raw": f(),
        "vector": f(3),
        "py_float": float(rng.normal()),
        "py_int": int(rng.integers(-5, 5)),
        "np_scalar": np.float32(rng.normal()),
        "np_array": rng.normal(size=(2,)).astype(np.float32),
        "weighted": eqxctx.WeightedSummary(f(), jnp.float32(rng.uniform(0, 3))),
        "min": eqxctx.MinSummary(jnp.asarray(rng.integers(-9, 9, 2), jnp.int32)),
        "sum": eqxctx.SumSummary(f()),
        "tiny": f() * 1e-30,
        "flag": jnp.asarray(rng.integers(0, 2), bool),
        "moments": eqxctx.MomentsSummary(f(5)),
        "histogram": eqxctx.HistogramSummary(f(50), bins=4, range=(-2.0, 2.0)),
        "image": eqxctx.ImageSummary(jnp.abs(f(2, 3, 4)) / 4.0),
        "audio": eqxctx.AudioSummary(jnp.tanh(f(6)), sample_rate=8000),
        "scan": _scan_collection(f(4)),
    }


def _leaves_equal(a: object, b: object) -> bool:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(
        type(x) is type(y)
        and np.asarray(x).dtype == np.asarray(y).dtype
        and np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
        for x, y in zip(la, lb, strict=True)
    )


@pytest.fixture
def full_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each full read (its `where`); replays are not recorded."""
    calls: list[str] = []
    real = writers_read._read  # pyright: ignore[reportPrivateUsage]

    def counting(*args: Any, where: str, **kwargs: Any) -> Any:
        calls.append(where)
        return real(*args, where=where, **kwargs)

    monkeypatch.setattr(writers_read, "_read", counting)
    writers_read._RECIPES.clear()  # pyright: ignore[reportPrivateUsage]
    return calls


def _without_recipes(fn: Callable[[], Any]) -> Any:
    saved = writers_read.make_recipe
    writers_read.make_recipe = lambda *args: None
    try:
        writers_read._RECIPES.clear()  # pyright: ignore[reportPrivateUsage]
        return fn()
    finally:
        writers_read.make_recipe = saved
        writers_read._RECIPES.clear()  # pyright: ignore[reportPrivateUsage]


def _line(tree: Any) -> bytes:
    values = writers_read.host_values(tree, where="test")
    return json_line(HostSummaries(7, values))


@settings(max_examples=10, deadline=None)
@given(seeds=st.lists(st.integers(0, 2**31 - 1), min_size=2, max_size=4))
def test_replayed_reads_equal_full_reads(seeds: list[int]) -> None:
    trees = [_summaries(seed) for seed in seeds]
    want = _without_recipes(lambda: [fetch_summaries(t) for t in trees])
    want_lines = _without_recipes(lambda: [_line(t) for t in trees])
    writers_read._RECIPES.clear()  # pyright: ignore[reportPrivateUsage]
    got_lines = [_line(t) for t in trees]  # JSON lines from the replayed layout
    assert got_lines == want_lines
    writers_read._RECIPES.clear()  # pyright: ignore[reportPrivateUsage]
    got = [fetch_summaries(t) for t in trees]
    assert len(writers_read._RECIPES) == 1  # pyright: ignore[reportPrivateUsage]
    (recipe,) = writers_read._RECIPES.values()  # pyright: ignore[reportPrivateUsage]
    assert recipe is not None  # every kind here is replayed
    for g, w in zip(got, want, strict=True):
        assert list(g) == list(w)  # the same paths in the same order
        for path in w:
            assert _leaves_equal(g[path], w[path]), path


def test_a_structure_is_read_in_full_once(
    full_reads: list[str], tmp_path: Path
) -> None:
    with JsonlWriter(tmp_path / "s.jsonl") as writer:
        for step in range(4):
            writer.write(step, _summaries(step))
    assert full_reads == ["JsonlWriter.write"]  # then three replays
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    assert len(lines) == 4

    def full() -> None:
        for step in range(4):
            with JsonlWriter(tmp_path / f"{step}.jsonl") as w:
                w.write(step, _summaries(step))

    _without_recipes(full)
    for step in range(4):  # byte for byte the text of a full read
        assert lines[step] == (tmp_path / f"{step}.jsonl").read_text().strip()


def test_a_negative_weight_in_a_replay_raises_naming_its_path(
    full_reads: list[str],
) -> None:
    def tree(weight: float) -> dict[str, Any]:
        return {"loss": eqxctx.WeightedSummary(jnp.float32(1.0), jnp.float32(weight))}

    fetch_summaries(tree(2.0))
    fetch_summaries(tree(3.0))
    assert len(full_reads) == 1
    with pytest.raises(ValueError, match=r"'loss'.*must not be negative"):
        fetch_summaries(tree(-1.0))


def test_a_negative_weight_in_replayed_rows_names_its_iteration(
    full_reads: list[str],
) -> None:
    xs = jnp.arange(4.0)
    fetch_summaries(_scan_collection(xs))
    fetch_summaries(_scan_collection(xs + 1))
    assert len(full_reads) == 1
    stacked = {"w": eqxctx.WeightedSummary(xs, jnp.asarray([1.0, 1.0, -2.0, 1.0]))}
    like = {"w": eqxctx.WeightedSummary(xs, jnp.ones(4))}
    ok = eqxctx.OutputCollection({"iter": eqxctx.IterationSummaries(4, like)}, {}, {})
    bad = eqxctx.OutputCollection(
        {"iter": eqxctx.IterationSummaries(4, stacked)}, {}, {}
    )
    fetch_summaries(ok)
    fetch_summaries(ok)
    with pytest.raises(ValueError, match=r"'iter2/w'.*must not be negative"):
        fetch_summaries(bad)


def test_media_are_still_validated_after_a_replay(full_reads: list[str]) -> None:
    audio = jnp.zeros(8)
    fetch_summaries({"a": eqxctx.AudioSummary(audio, sample_rate=8000)})
    fetch_summaries({"a": eqxctx.AudioSummary(audio + 1, sample_rate=8000)})
    assert len(full_reads) == 1
    # The sample rate is static: another rate is another structure, read in full.
    with pytest.raises(ValueError, match=r"'a'.*sample_rate"):
        fetch_summaries({"a": eqxctx.AudioSummary(audio, sample_rate=0)})


def test_callback_summaries_run_at_every_write(full_reads: list[str]) -> None:
    calls: list[float] = []

    def fn(x: np.ndarray) -> np.ndarray:
        calls.append(float(x))
        return x  # its argument itself: still run at every write

    for step in range(3):
        out = fetch_summaries({"c": eqxctx.CallbackSummary(fn, jnp.float32(step))})
        assert float(np.asarray(out["c"])) == step
    assert calls == [0.0, 1.0, 2.0]
    assert len(full_reads) == 3  # a function's result is never replayed


def test_one_array_in_two_places_then_two_arrays(full_reads: list[str]) -> None:
    # Values go by position: a recipe made when one array filled two places (or
    # the full read, where the leaves were one object) gives each place its own.
    for a, b in [(1.0, 1.0), (2.0, 2.0), (3.0, -3.0), (4.0, 4.0)]:
        x = jnp.float32(a)
        y = x if a == b else jnp.float32(b)
        out = fetch_summaries({"a": x, "b": y, "c": jnp.float32(-a)})
        assert {k: float(np.asarray(v)) for k, v in out.items()} == {
            "a": a,
            "b": b,
            "c": -a,
        }


def test_one_host_array_in_two_places_is_replayed(full_reads: list[str]) -> None:
    # Issue 39 item 3 (a scan collection read in full at every write on a TPU): one
    # fetched array in two places (a scan's input forwarded to two outputs, fetched
    # alone on a TPU, where `numpy.asarray` of a JAX array returns its cached
    # NumPy copy; here a NumPy array passed twice) gave one object twice, and no
    # recipe was made. It is read in full once, then replayed, and each place
    # keeps its own value when the arrays differ.
    for a, b in [(1.0, 1.0), (2.0, 2.0), (3.0, -3.0), (4.0, 4.0)]:
        x = np.full(3, a, np.float32)
        y = x if a == b else np.full(3, b, np.float32)
        out = fetch_summaries({"a": x, "b": y, "c": np.float32(-a)})
        np.testing.assert_array_equal(np.asarray(out["a"]), np.full(3, a))
        np.testing.assert_array_equal(np.asarray(out["b"]), np.full(3, b))
    assert len(full_reads) == 1


def test_a_new_shape_or_dtype_is_a_new_structure(full_reads: list[str]) -> None:
    for x in (jnp.zeros(2), jnp.ones(2), jnp.zeros(3), jnp.zeros(3, jnp.int32)):
        out = fetch_summaries({"x": x})
        got = np.asarray(out["x"])
        np.testing.assert_array_equal(got, np.asarray(x))
        assert got.dtype == x.dtype
    assert len(full_reads) == 3  # (2,) float32 twice, (3,) float32, (3,) int32


# -- found by a break-test of the replay -------------------------------------------


def test_mapping_order_is_part_of_the_structure(full_reads: list[str]) -> None:
    # A treedef sorts a mapping's keys; the written order is the insertion order.
    for step, order in enumerate(["ab", "ba", "ab", "ba"]):
        out = fetch_summaries({k: jnp.float32(step) for k in order})
        assert list(out) == list(order)
    assert len(full_reads) == 2


def test_a_python_int_beyond_int64_is_refused_in_a_replay() -> None:
    fetch_summaries({"x": 1})
    fetch_summaries({"x": 2})
    with pytest.raises(TypeError, match=r"'x' has dtype object"):
        fetch_summaries({"x": 2**70})


def test_histogram_edges_keep_no_negative_zero(tmp_path: Path) -> None:
    # -0.0 and 0.0 edges compare equal (JAX's caches, the writers'): one spelling.
    x = jnp.asarray([-0.5, 0.5, 2.0])
    h = eqxctx.HistogramSummary(x, edges=[-1.0, -0.0, 1.0, 5.0])
    assert h.edges == (-1.0, 0.0, 1.0, 5.0)
    assert str(h.edges[1]) == "0.0"
    with JsonlWriter(tmp_path / "s.jsonl") as writer:
        writer.write(0, {"h": eqxctx.HistogramSummary(x, edges=[-1.0, 0.0, 1.0, 5.0])})
        writer.write(1, {"h": h})
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    assert [line.split('"h":')[1] for line in lines] == [
        '{"edges":[-1.0,0.0,1.0,5.0],"counts":[1,1,1]}}'
    ] * 2


def test_a_numpy_subclass_changing_dtype_is_read_in_full() -> None:
    fetch_summaries({"x": np.ma.masked_array([1.0, 2.0])})
    fetch_summaries({"x": np.ma.masked_array([3.0, 4.0])})
    with pytest.raises(TypeError, match=r"'x' is complex"):
        fetch_summaries({"x": np.ma.masked_array([1 + 2j])})

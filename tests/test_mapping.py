"""The read-only, persistent mapping of every collection level (`_mapping.py`).

Levels are reached as users reach them: `coll.summaries` (and the other kinds), made
by adds or by unflattening (`jax.jit`, `jax.tree_util.tree_map`).
"""

import gc
import sys
import threading
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxctx import Context, IterationSummaries, OutputCollection, SummaryAccumulator
from eqxctx.writers import fetch_summaries


def _flatten_one_level(tree: Any) -> tuple[Any, Any]:
    # Public from JAX 0.9; before, the default registry's (the function registered).
    one_level = getattr(jax.tree_util, "flatten_one_level", None)
    if one_level is None:
        return jax.tree_util.default_registry.flatten_one_level(tree)
    return one_level(tree)


# From test_host_cost.py (issue 36 item "tests mirror modules").
def test_mappings_are_read_only() -> None:
    child = OutputCollection.empty().add_summary("acc", 1.0)
    coll = OutputCollection.empty().add_summary("loss", 1.0).add_child("enc", child)
    with pytest.raises(TypeError):
        coll.summaries["x"] = 1  # pyright: ignore[reportIndexIssue]
    with pytest.raises(TypeError):
        coll.summaries["enc"]["acc"] = 2
    with pytest.raises(TypeError):
        del coll.module_outputs["enc"]  # pyright: ignore[reportIndexIssue]
    with pytest.raises(AttributeError):
        coll.summaries.update({"x": 1})  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(AttributeError):
        coll.summaries = {}  # pyright: ignore[reportAttributeAccessIssue]
    entry = IterationSummaries(2, {"x": jnp.zeros(2)})
    with pytest.raises(TypeError):
        entry.stacked["y"] = 1  # pyright: ignore[reportIndexIssue]
    # Flattening one level hands out no container a level keeps (a level made by
    # unflattening, here the output of `jax.jit`, and one made by adds).
    for level in (jax.jit(lambda c: c)(coll).summaries, coll.summaries):
        children, _ = _flatten_one_level(level)
        if isinstance(children, list):
            children.clear()
        assert level["loss"] == 1.0
        assert len(level) == 2


# From test_host_cost.py: the shared empty mapping of the earlier log design.
def test_the_shared_empty_mapping_keeps_nothing_alive() -> None:
    big = jnp.zeros(1000, jnp.float32)  # (a NumPy array would be copied where added)
    ref = weakref.ref(big)
    coll = OutputCollection.empty().add_summary("x", big)
    ctx = Context.root().add_module_output("y", big).call("c", lambda c: (None, c))[1]
    assert coll.flatten("summaries")["x"] is big
    del big, coll, ctx
    gc.collect()
    assert ref() is None  # nothing shared holds on to the first value added to it
    first = OutputCollection.empty().add_summary("a", 1.0)
    second = OutputCollection.empty().add_summary("b", 2.0)
    assert first.flatten("summaries") == {"a": 1.0}
    assert second.flatten("summaries") == {"b": 2.0}
    assert OutputCollection.empty().flatten("summaries") == {}


# From test_host_cost.py (a tester round).
def test_iterating_a_mapping_never_sees_later_entries() -> None:
    ctx = (
        Context.root().add_summary("loss", jnp.ones(3)).add_summary("acc", jnp.ones(3))
    )
    for k, v in ctx.collection.summaries.items():
        ctx = ctx.add_summary(k + "_mean", jnp.mean(v))
    assert list(ctx.collection.summaries) == ["loss", "acc", "loss_mean", "acc_mean"]
    ctx = Context.root().add_summary("loss", 1.0)
    for k in ctx.collection.summaries:  # terminates: sees only "loss"
        ctx = ctx.add_summary(k + "_x", 2.0)
    assert list(ctx.collection.summaries) == ["loss", "loss_x"]


# From test_host_cost.py.
def test_values_inserted_into_a_level_are_checked_where_they_are_written() -> None:
    # `inserted` / `updated` leave checking to their callers (an add checks first);
    # a level grown by them directly is not trusted by writers and accumulators.
    coll = OutputCollection({"x": 1.0}, {}, {})
    for bad, message in (
        ("hello", r"the value at 's' has type str"),
        (jax.random.key(0), r"the summary at 's' is a typed PRNG key"),
        (np.array(["t"]), r"the array at 's' has dtype <U1"),
    ):  # (at the path in what was passed, by the function it was passed to)
        grown = coll.summaries.updated([("s", bad)])
        with pytest.raises(
            TypeError, match=rf"^`SummaryAccumulator.update`: {message}"
        ):
            SummaryAccumulator().update(grown)
        with pytest.raises(TypeError, match=rf"^`fetch_summaries`: {message}"):
            fetch_summaries(grown)
    assert fetch_summaries(coll.summaries.inserted("s", 2.0)) == {"x": 1.0, "s": 2.0}


# From test_host_cost.py.
def test_inserted_and_updated_refuse_a_key_already_present() -> None:
    # A level holds each key once: growing it by a present key (or a key twice) would
    # give a mapping whose length disagrees with its keys.
    coll = OutputCollection({"x": 1.0, "c": {"y": 2.0}}, {}, {})
    level = coll.summaries
    for bad in ("x", "c"):
        with pytest.raises(ValueError, match=rf"`FrozenMapping.inserted`: '{bad}' is"):
            level.inserted(bad, 3.0)
    with pytest.raises(ValueError, match=r"`FrozenMapping.updated`: 'x' is already"):
        level.updated([("z", 3.0), ("x", 4.0)])
    with pytest.raises(ValueError, match=r"`FrozenMapping.updated`: 'z' is already"):
        level.updated([("z", 3.0), ("z", 4.0)])
    with pytest.raises(TypeError, match=r"keys are non-empty strings, got ''"):
        level.inserted("", 3.0)
    for key in (1, None):  # (refused by the checks of the tests' type checker too)
        with pytest.raises(TypeError):
            level.inserted(key, 3.0)  # pyright: ignore[reportArgumentType]
    # Nothing was added by the refused calls, and the accepted ones add in order.
    assert list(level) == ["x", "c"]
    assert len(level) == 2
    grown = level.updated([("z", 3.0), ("w", 4.0)])
    assert list(grown) == ["x", "c", "z", "w"]
    assert len(grown) == 4
    assert grown["z"] == 3.0
    assert grown["w"] == 4.0
    assert list(level) == ["x", "c"]
    assert len(level) == 2
    assert list(level.inserted("v", 5.0)) == ["x", "c", "v"]


# From test_regressions.py (trying to break frozen logs): a level read and extended
# from two threads at once.
def test_reading_and_extending_an_unflattened_level_from_two_threads() -> None:
    keys = [f"k{i:05d}" for i in range(20_000)]
    tree = OutputCollection(dict.fromkeys(keys, 1.0), {}, {}).summaries
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(5):
            level = jax.tree_util.tree_map(lambda x: x, tree)  # made by unflattening
            barrier = threading.Barrier(2)
            out: dict[str, Any] = {}

            def read(
                level: Any = level, barrier: Any = barrier, out: Any = out
            ) -> None:
                barrier.wait()
                out["read"] = level.get("k00000")

            def extend(
                level: Any = level, barrier: Any = barrier, out: Any = out
            ) -> None:
                barrier.wait()
                out["new"] = level.inserted("new", -1.0)

            threads = [threading.Thread(target=f) for f in (read, extend)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert out["read"] == 1.0
            assert out["new"]["new"] == -1.0
            assert "new" not in level
            assert len(out["new"]) == len(keys) + 1
    finally:
        sys.setswitchinterval(interval)


# From test_regressions.py.
def test_str_subclass_keys_are_found_in_a_level() -> None:
    coll = OutputCollection.empty().add_summary("a", 1.0)
    for level in (coll.summaries, jax.jit(lambda c: c)(coll).summaries):
        assert np.str_("a") in level  # as in a dict: `np.str_` is a `str`
        assert np.str_("b") not in level
        assert level[np.str_("a")] == 1.0


# Found while rewriting test_host_cost.py (issue 36): `inserted` on a checked level
# returns a level that claims its new value checked, so `OutputCollection(level)`
# takes a str leaf (`updated` too).
def test_a_level_grown_by_inserted_is_checked_where_it_enters() -> None:
    empty = OutputCollection.empty().summaries
    with pytest.raises(TypeError, match=r"summaries/c/a"):
        OutputCollection(empty.inserted("c", empty.inserted("a", "text")), {}, {})
    with pytest.raises(TypeError, match=r"summaries/b"):
        OutputCollection(empty.updated([("b", "text")]), {}, {})

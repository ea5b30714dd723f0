"""Memory of a deep chain of `ctx.call` children, per level (exact counts).

Moved from the test suite (they took minutes of it): each level of a chain K deep
must keep the same objects and bytes alive however deep it is. Prints one table; the
"met" column gives the targets. Usage:

    .venv/bin/python benchmarks/chain_memory.py
"""

import gc
import sys
import tracemalloc
from collections.abc import Callable
from typing import Any

import jax

import eqxctx
from eqxctx import Context


_SRC = eqxctx.__file__.rsplit("/", 1)[0]


def _bytes_from(files: list[str], exclude: tuple[str, ...] = ()) -> int:
    """Bytes alive that were allocated in `files` (glob patterns), but `exclude`."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, f) for f in files]
    )
    if exclude:
        snapshot = snapshot.filter_traces(
            [tracemalloc.Filter(False, f) for f in exclude]
        )
    return sum(stat.size for stat in snapshot.statistics("filename"))


def _chain_bottom(k: int, measure: Callable[[], Any]) -> Any:
    """Run a chain of `k` children, each calling the next; `measure()` at the bottom."""
    seen: list[Any] = []

    def node(x: float, ctx: Context, *, i: int) -> tuple[float, Context]:
        ctx = ctx.add_summary("s", x).add_module_output("h", x)
        if i + 1 < k:
            return ctx.call(f"c{i + 1}", node, x, i=i + 1)
        seen.append(measure())
        return x, ctx

    out, ctx = Context.root(prng_key=jax.random.PRNGKey(0)).call("c0", node, 1.0, i=0)
    bottom = "/".join(f"c{i}" for i in range(k)) + "/s"
    assert ctx.collection.flatten("summaries")[bottom] == 1.0
    assert ctx.collection.child("c0").child("c1").flatten("module_outputs")["h"] == out
    return seen[0]


def chain_objects_and_bytes() -> list[str]:
    """Each level of a chain keeps the same objects and bytes alive, however deep.

    A child used to copy its parent's path (and its key's names) into a new tuple, so
    a chain K deep held O(K^2) of them (and Python's garbage collector walked them).
    """
    ours = ("Context", "OutputCollection", "FrozenMapping")

    def objects() -> dict[str, int]:
        gc.collect()
        counts: dict[str, int] = dict.fromkeys(ours, 0)
        for obj in gc.get_objects():
            name = type(obj).__name__
            if name in counts and type(obj).__module__.startswith("eqxctx"):
                counts[name] += 1
        return counts

    def eqxctx_bytes() -> int:
        # (JAX's name stack is JAX's: `jax.named_scope` per level.)
        return _bytes_from([f"{_SRC}/*"])

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4000))
    try:
        _chain_bottom(300, lambda: None)  # child names validated and cached once
        at = {k: _chain_bottom(k, objects) for k in (100, 200, 300)}
        # Per level: the context the level's `fn` holds, its collection, and a
        # mapping with its log (the list of its values) per kind that received an
        # entry; and before CPython 3.12, which frees a call's argument tuple once
        # the callee's frame holds them, the child handed to `fn`.
        per_level = [
            {n: (at[k + 100][n] - at[k][n]) / 100 for n in ours} for k in (100, 200)
        ]
        want = {
            "Context": 2 if sys.version_info < (3, 12) else 1,
            "OutputCollection": 1,
            "FrozenMapping": 2,
        }
        rows = [
            f"| objects per level, levels 100-199 / 200-299 | {per_level[0]} / "
            f"{per_level[1]} | {want} | "
            f"{'yes' if per_level[0] == per_level[1] == want else 'NO'} |"
        ]
        tracemalloc.start()
        try:
            size = {k: _chain_bottom(k, eqxctx_bytes) for k in (100, 200, 300)}
        finally:
            tracemalloc.stop()
    finally:
        sys.setrecursionlimit(limit)
    # Bytes per level, levels 100-199 vs 200-299: equal (a path tuple per level
    # made the deeper levels ~1.6 kB larger each).
    first, second = size[200] - size[100], size[300] - size[200]
    met = second <= 1.02 * first  # (no growth with depth)
    rows.append(
        f"| bytes per level, levels 100-199 / 200-299 | {first / 100:.0f} / "
        f"{second / 100:.0f} | deeper <= shallower + 2% | {'yes' if met else 'NO'} |"
    )
    return rows


def main() -> None:
    print("| measure | measured | target | met |\n|---|---|---|:--:|")
    for row in chain_objects_and_bytes():
        print(row)


if __name__ == "__main__":
    main()

"""A loop's carry: the typed loop state, weak-type promotion and the carry check.

Shared by `scan_in_context` and the while loops. The rules are `jax.lax.scan`'s and
`jax.lax.while_loop`'s; eqxctx checks them itself so that errors name the user's
carry, not the loop state around it.
"""

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from ._repeat import accumulate_trees, cast_like
from ._typing import Leaf, SummaryTree


class LoopState(eqx.Module):
    """What a loop threads through `jax.lax.scan` / `jax.lax.while_loop`.

    Diffrax's `State` (`diffrax/_integrate.py`): named, typed fields, not a
    positional tuple. Fields that a loop does not need are None (empty subtrees:
    nothing is carried). A loop builds one per trace of its body.

    Attributes:
        carry: the user's carry, any PyTree.
        summaries: the summaries accumulated so far (merged loops), else None.
        first: bool scalar, True until one iteration has been accumulated.
        iteration: uint32 scalar, the index i of the next iteration (its key is
            `fold_in(child_key, i)`).
    """

    carry: PyTree
    summaries: SummaryTree | None = None
    first: Array | None = None
    iteration: Array | None = None

    def accumulate(
        self, new: SummaryTree, like: SummaryTree
    ) -> tuple[SummaryTree, Array]:
        """Return `(summaries, first)` with `new` accumulated (whole on the first).

        `like` gives the accumulator's structure and dtypes (`accumulator_shape`).
        """
        acc, first = self.summaries, self.first
        assert acc is not None  # a merged loop's state
        assert first is not None
        new = cast_like(new, like)
        summed = cast_like(accumulate_trees(acc, new), like)
        acc = jax.tree_util.tree_map(lambda a, b: jnp.where(first, a, b), new, summed)
        return acc, jnp.array(False)


class Names(NamedTuple):
    """How a loop's messages name things.

    Attributes:
        where: the call and place, e.g. "`while_in_context` at 'root/while'".
        leaf: the carry leaf's name, `{}` standing for its key path (`"carry{}"`).
        fn: the body, as the user knows it ("the body", "body_fn").
        lax: the JAX loop whose rules apply ("jax.lax.scan").
    """

    where: str
    leaf: str
    fn: str
    lax: str


def is_weak(x: object) -> bool:
    """Return whether `x` is weakly typed (a Python scalar, or an array from one)."""
    try:
        return bool(getattr(jax.typeof(x), "weak_type", False))
    except TypeError:  # not an array; JAX's loop rejects it itself
        return False


def _type_str(x: Leaf) -> str:
    return f"{jnp.result_type(x)}{list(jnp.shape(x))}"


def promote_weak(carry: PyTree, out: PyTree) -> tuple[PyTree, bool]:
    """Apply JAX's rule for a weakly typed initial carry.

    A weakly typed leaf whose dtype differs from the body's result `out` (same shape)
    is converted to `jnp.result_type(leaf, out)`, as `jax.lax.scan` and
    `jax.lax.while_loop` do before tracing the body again. Returns the carry and
    whether a leaf changed; a carry of another structure is returned as it is
    (`check_carry` reports it).

    Raises:
        jax.dtypes.TypePromotionError: under strict promotion, where JAX's loops raise.
    """
    leaves, treedef = jax.tree_util.tree_flatten(carry)
    outs = jax.tree_util.tree_leaves(out)
    if jax.tree_util.tree_structure(out) != treedef:
        return carry, False
    changed = False
    promoted: list[Leaf] = []
    for x, o in zip(leaves, outs, strict=True):
        if (
            is_weak(x)
            and jnp.shape(x) == jnp.shape(o)
            and jnp.result_type(x) != jnp.result_type(o)
        ):
            x = jax.lax.convert_element_type(x, jnp.result_type(x, o))
            changed = True
        promoted.append(x)
    return treedef.unflatten(promoted), changed


def check_carry(before: PyTree, after: PyTree, given: PyTree, names: Names) -> None:
    """Raise for a body whose carry changes structure, shape or dtype (trace time).

    `before` went into this trace of the body and `after` came out; `given` is the
    initial carry as the user passed it. JAX's rule for weak types is kept: on the
    first trace a weakly typed leaf of `given` may come back in another dtype (same
    shape); JAX then converts it (`promote_weak`) and traces again, where the dtypes
    must match.

    Raises:
        TypeError: naming the carry leaf, its type going in and coming out.
    """
    got = jax.tree_util.tree_structure(after)
    want = jax.tree_util.tree_structure(before)
    fn, lax = names.fn, names.lax
    if got != want:
        raise TypeError(
            f"{names.where}: {fn} returned a carry with structure {got}, but "
            f"{names.leaf.format('')} has structure {want}; {fn} must return a carry "
            f"of the same structure, shapes and dtypes (as in `{lax}`)."
        )
    leaves = jax.tree_util.tree_leaves_with_path(before)
    inits = jax.tree_util.tree_leaves(given)
    weak = [is_weak(x) for x in inits]
    # Traced again: a weakly typed initial leaf came in converted.
    promoted = [w and not is_weak(a) for w, (_, a) in zip(weak, leaves, strict=True)]
    first_trace = not any(promoted)
    outs = jax.tree_util.tree_leaves(after)
    for j, ((path, a), b) in enumerate(zip(leaves, outs, strict=True)):
        same_shape = jnp.shape(a) == jnp.shape(b)
        if same_shape and jnp.result_type(a) == jnp.result_type(b):
            continue
        if first_trace and weak[j] and same_shape:
            continue  # JAX converts it and traces the body again
        name = names.leaf.format(jax.tree_util.keystr(path))
        returned = f"but {fn} returned {_type_str(b)}"
        if not weak[j]:
            raise TypeError(
                f"{names.where}: {name} went in as {_type_str(a)} {returned} for "
                f"it; {fn} must return a carry of the same structure, shapes and "
                f"dtypes (as in `{lax}`). Cast it, e.g. `new.astype(old.dtype)`, or "
                "start from a carry of the right dtype (a Python scalar takes the "
                "body's dtype)."
            )
        went_in = (
            f"went in as a weakly typed {_type_str(inits[j])} (e.g. a Python scalar)"
        )
        if promoted[j]:
            went_in += (
                f", which `{lax}` converted to {_type_str(a)} (the result type of it "
                "and the dtype the body first returned) before tracing the body again,"
            )
        raise TypeError(
            f"{names.where}: {name} {went_in} {returned}; {fn} must return a carry of "
            "the same shapes"
            + (" and dtypes" if same_shape else "")
            + f" (as in `{lax}`, where a weakly typed carry may change its dtype once, "
            "never its shape). Start from a carry of the dtype and shape the body "
            "returns, e.g. `jnp.zeros(shape, dtype)`."
        )

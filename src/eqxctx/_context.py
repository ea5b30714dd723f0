"""Context: a named invocation context with a name-derived PRNG key and outputs.

Follows AXLearn's `InvocationContext` (`axlearn/common/module.py`), without its
thread-local stack: a `Context` is passed in and returned explicitly.
"""

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Bool

from ._checks import (
    check_context_path,
    check_is_training,
    check_path,
    check_prng_key,
    note_missing_key,
)
from ._collection import (
    OutputCollection,
    add_leaf,
    check_collection,
    check_is_collection,
    name_in_use,
    validate_child_name,
    with_child,
)
from ._context_base import ContextBase, set_collection, set_frame
from ._errors import CALL_TWICE_HINT, PREFIX_HINT, OutputConflictError
from ._frame import (
    UNSET,
    Frame,
    child_frame as _child_frame,
    keyed_frame,
    root_frame,
)
from ._gradients import add_probe
from ._leaves import drops as _drops
from ._ledger import Ledger, lost_error, unreturned
from ._typing import ArrayTree, Children, Leaf, Names, PRNGKey, R


class Context(ContextBase):
    """An invocation context: a path, a PRNG key, a training flag and outputs.

    Model methods take the context last and return it last: `method(self, x, ctx)
    -> (y, ctx)`. Every method returns a new `Context`; `self` is unchanged. A
    PyTree (the key, collection, gradient sinks and row mask are children; the path,
    training flag and summary level static), so contexts pass through JAX
    transformations. `Context.root` makes one.

    Attributes:
        path: the names from the root, static (e.g. `("root", "encoder")`).
        prng_key: a raw `uint32[2]` key (`jax.random.PRNGKey`), a typed key
            (`jax.random.key`) or None (traced).
        is_training: training mode, static.
        collection: the context's `OutputCollection`.
        summary_level: summaries and module outputs added with a `level` above it
            are dropped (static; None keeps all). Set at the root, inherited by
            every child and iteration.
        row_mask: `bool[batch]`, the padded step's real rows (traced), or None;
            see `Context.row_mask`.

    Raises:
        TypeError: if `path` is not a non-empty tuple of names, `collection` is
            not an `OutputCollection`, or another argument is bad (see
            `Context.root`).
        ValueError: for an invalid name in `path`.

    Examples:
        >>> ctx = Context.root(prng_key=jax.random.PRNGKey(0))
        >>> ctx = ctx.add_summary("loss", 1.0)
        >>> ctx.collection.flatten("summaries")
        {'loss': 1.0}
    """

    __slots__ = ()

    def __init__(
        self,
        path: Names,
        prng_key: PRNGKey | None,
        is_training: bool,
        collection: OutputCollection,
        summary_level: int | None = None,
        row_mask: Bool[Array, " batch"] | np.ndarray | None = None,
    ):
        names = check_context_path(path)
        frame = root_frame(names, prng_key, is_training, summary_level, row_mask, "")
        check_is_collection(collection, "Context", "collection")
        set_frame(self, frame)
        set_collection(self, collection)

    @classmethod
    def root(
        cls,
        *,
        prng_key: PRNGKey | None = None,
        is_training: bool | np.bool_ = False,
        name: str = "root",
        summary_level: int | None = None,
        row_mask: Bool[Array, " batch"] | np.ndarray | None = None,
    ) -> "Context":
        """Return a root context with an empty collection.

        Args:
            prng_key: a raw `uint32[2]` or typed key, or None (no randomness).
            is_training: training mode, static.
            name: the first entry of every path, matching `^[a-z][a-z0-9_]*$`.
            summary_level: keep only summaries and module outputs added with
                `level <= summary_level` (a static int); None keeps all.
            row_mask: `bool[batch]`, True for a padded batch's real rows (traced);
                None outside a padded step (`MethodRunner` sets it).

        Raises:
            ValueError: for an invalid name.
            TypeError: naming the argument, if `prng_key` is not None, a
                `uint32[2]` key or a typed key, `is_training` is not a bool,
                `summary_level` is neither None nor an int, or `row_mask` is
                neither None nor a rank-1 bool array.
        """
        validate_child_name(name, where="Context.root(name=...)")
        frame = root_frame((name,), prng_key, is_training, summary_level, row_mask)
        return _make(frame, OutputCollection.empty())

    def child(
        self,
        name: str,
        *,
        prng_key: PRNGKey | None = UNSET,
        is_training: bool | np.bool_ = UNSET,
    ) -> "Context":
        """Return a child context with an empty collection (the low-level step).

        Records nothing in `self`: two `child("a")` give the same key. Model code
        uses `ctx.call(name, fn)`, which also attaches the child's outputs; by hand,
        `ctx.merge(OutputCollection.empty().add_child(name, child.collection))`.
        The key is `jax.random.fold_in(self.prng_key, seed)` with AXLearn's seed,
        `int(md5(name).hexdigest(), 16) % (2**31 - 1)` (bit for bit).

        Args:
            name: the child's name, matching `^[a-z][a-z0-9_]*$`.
            prng_key: overrides the derived key.
            is_training: overrides the parent's training flag.

        Raises:
            ValueError: for an invalid name.
            TypeError: for a bad `prng_key` or `is_training` (as `Context.root`).
        """
        validate_child_name(name, where="Context.child")
        training = (
            self.is_training
            if is_training is UNSET
            else check_is_training(is_training, "Context.child")
        )
        if prng_key is UNSET:
            return _make(_child_frame(self._frame, name, training), _EMPTY)
        key = check_prng_key(prng_key, "Context.child")
        frame = self._frame
        path = (*self.path, name)
        at = keyed_frame(frame, path, key, training, frame.shape_only, frame.gradients)
        return _make(at, _EMPTY)

    def add_summary(self, name: str, value: Leaf, level: int = 0) -> "Context":
        """Return a new context with summary `name` added.

        Args:
            name: a non-empty string without '/'.
            value: an array, a Python number or a `Summary`.
            level: a static int: the summary is kept only if `level <=
                ctx.summary_level` (or that is None). A dropped summary leaves the
                context unchanged (only its name is checked) and XLA removes its
                computation.

        Raises:
            OutputConflictError: if `name` is taken (see
                `OutputCollection.add_summary`); each error notes the context path.
            TypeError: for an invalid value, or a `level` that is not an int.
            ValueError: for an invalid name or value.
        """
        # The default (an int level 0, no summary level) costs two compares per add;
        # any other level is checked by `_drops`.
        if (
            type(level) is not int or level or self._frame.summary_level is not None
        ) and _drops(self, name, level, "Context.add_summary"):
            return self
        try:
            new = add_leaf(self.collection, "summaries", name, value)
            return _with(self, new, "summaries", name)
        except (OutputConflictError, TypeError, ValueError) as e:
            _note_context(e, self)
            raise

    def add_state_update(self, name: str, value: Leaf) -> "Context":
        """Return a new context with state update `name` added.

        As `add_summary`, without a level: a state update is the model's new state
        (e.g. batch norm statistics), so no `summary_level` drops one.
        """
        try:
            new = add_leaf(self.collection, "state_updates", name, value)
            return _with(self, new, "state_updates", name)
        except (OutputConflictError, TypeError, ValueError) as e:
            _note_context(e, self)
            raise

    def add_module_output(self, name: str, value: Leaf, level: int = 0) -> "Context":
        """Return a new context with module output `name` added (as `add_summary`)."""
        if (
            type(level) is not int or level or self._frame.summary_level is not None
        ) and _drops(self, name, level, "Context.add_module_output"):
            return self
        try:
            new = add_leaf(self.collection, "module_outputs", name, value)
            return _with(self, new, "module_outputs", name)
        except (OutputConflictError, TypeError, ValueError) as e:
            _note_context(e, self)
            raise

    def add_gradient_summary(
        self,
        name: str,
        x: ArrayTree,  # checked by `_gradients` with a message naming the path
        fn: object = None,  # checked by `_gradients`, naming the path
        level: int = 0,
    ) -> tuple[Array, "Context"]:
        """Return `x` unchanged and a context recording `fn(cotangent of x)`.

        A forward identity. Under `eqxctx.value_and_grad`, the backward pass's
        `fn(d loss / d x)` becomes summary `name`, where `add_summary` would put it
        (`iter{i}/name` under a scan, accumulated with `merge_summaries=True`).
        Anywhere else it records nothing and costs nothing. See the "Gradient
        summaries" docs page.

        Args:
            name: the summary's name (non-empty, no `/`).
            x: a floating-point array, any shape (traced).
            fn: static, `fn(cotangent) -> array or Summary`, the cotangent having
                `x`'s shape and dtype. None: its root mean square, float32 `[]`.
            level: as in `add_summary`; a dropped probe records nothing and adds
                nothing to the backward pass.

        Returns:
            `(x, ctx)`: `x` itself and the new context.

        Raises:
            TypeError: `x` is not a floating-point array, `level` is not an int,
                or (under `value_and_grad`) `fn` returns neither an array nor a
                `Summary`; naming the path.
            OutputConflictError: under `value_and_grad`, if summary `name` exists.
        """
        return add_probe(self, self._frame.gradients, "summaries", name, x, fn, level)

    def add_gradient_output(
        self, name: str, x: ArrayTree, level: int = 0
    ) -> tuple[Array, "Context"]:
        """Return `x` unchanged and a context recording the cotangent of `x`.

        As `add_gradient_summary`, with the full cotangent (`x`'s shape and dtype,
        stacked `[N, ...]` under a scan) as module output `name`, like Flax's
        `perturb`. Raises as `add_gradient_summary`.
        """
        return add_probe(
            self, self._frame.gradients, "module_outputs", name, x, None, level
        )

    def replace_collection(self, collection: OutputCollection) -> "Context":
        """Return a new context whose collection is `collection`.

        Raises:
            TypeError: if `collection` is not an `OutputCollection`, or a leaf of it
                is not a valid leaf (a collection made by `jax.tree_util` functions
                is checked here, once).
        """
        where = "Context.replace_collection(collection)"
        check_is_collection(collection, where, "collection")
        return _with(self, check_collection(collection), "replace", None)

    def discard(self) -> None:
        """Say that the outputs this context holds are dropped on purpose.

        Inside a body that eqxctx checks (`functional`, `value_and_grad`, a
        `MethodRunner` step, `Context.call`, every scan, vmap, branch and loop
        body), an output added to a context that is not returned raises
        `LostOutputError` when the body returns. Calling `ctx.discard()` on the
        context that holds such outputs (e.g. `ctx.merge(coll).discard()` for a
        combinator's collection) drops them without an error. Nothing else
        changes: `self` is unchanged, and the outputs are in no collection.
        """
        ledger = self._frame.ledger
        if ledger is not None:
            ledger.record("discard", self.collection, self.collection)

    def merge(self, collection: OutputCollection) -> "Context":
        """Return a new context whose collection is merged with `collection`.

        O(size of `collection`'s top level), whatever the context holds.

        Raises:
            OutputConflictError: on a name conflict (`OutputCollection.merge`),
                naming the context path and suggesting another `child_name_prefix`.
            TypeError: if `collection` is not an `OutputCollection`.
        """
        check_is_collection(collection, "Context.merge(collection)", "collection")
        try:
            merged = self.collection.merge(collection)
        except OutputConflictError as e:
            where = "/".join(self.path)
            msg = str(e)
            if PREFIX_HINT not in msg:
                msg = f"{msg} {PREFIX_HINT}"
            raise OutputConflictError(f"In context {where!r}: {msg}") from None
        return _with(self, merged, "merge", collection)

    def call(
        self,
        name: str,
        fn: Callable[..., tuple[R, "Context"]],
        /,
        *args: object,
        **kwargs: object,
    ) -> tuple[R, "Context"]:
        """Run `fn(*args, child_ctx, **kwargs)` in child context `name`.

        `fn` returns `(out, child_ctx)`; the child's outputs are attached under
        `name`. Runs in `jax.named_scope(name)`; O(1) besides `fn`.

        Args:
            name: the child's name, matching `^[a-z][a-z0-9_]*$`.
            fn: called as `fn(*args, child_ctx, **kwargs) -> (out, child_ctx)`.
            *args: positional arguments, before the context.
            **kwargs: keyword arguments.

        Returns:
            `(out, ctx)`: `fn`'s output and a new context holding the child's outputs.

        Raises:
            ValueError: for an invalid name, or if `fn` returns another context.
            OutputConflictError: if `name` is already used here.
            TypeError: if `fn` does not return `(out, Context)`.
            LostOutputError: if an output added in `fn` is missing from the context
                it returns (see `Context.discard`).
        """
        coll = self.collection
        if type(name) is not str or name not in _VALID_NAMES:
            validate_child_name(name, where="Context.call")
            if len(_VALID_NAMES) < _MAX_VALID_NAMES:
                _VALID_NAMES[name] = None
        if name_in_use(coll, name):
            raise OutputConflictError(
                f"`Context.call`: {name!r} is already used in context "
                f"{'/'.join(self.path)!r}. {CALL_TWICE_HINT}"
            )
        frame = self._frame
        at = _child_frame(frame, name, frame.is_training, Ledger())
        # The child context is made in the call: the call's argument tuple holds the
        # empty child until `fn` returns (nothing that grows while `fn` runs).
        with jax.named_scope(name):
            try:
                result = fn(*args, _make(at, _EMPTY), **kwargs)
            except TypeError as e:
                note_missing_key(e, _make(at, _EMPTY), f"`Context.call({name!r}, fn)`")
                raise
        if (
            type(result) is not tuple
            or len(result) != 2
            or type(result[1]) is not Context
        ):
            check_returns_context(result, f"`Context.call({name!r}, fn)`: fn")
        out, child_out = result
        if child_out._frame is not at:
            check_path(
                child_out, _make(at, _EMPTY), f"`Context.call({name!r}, fn)`: fn"
            )
        if lost := unreturned(at.ledger, child_out._frame.ledger, child_out.collection):
            what = f"`Context.call({name!r}, fn)`: fn"
            raise lost_error(lost, what, "/".join(child_out.path))
        return out, _with(
            self, with_child(coll, name, child_out.collection), "call", name
        )


_EMPTY = OutputCollection.empty()
# Child names already validated (a model calls the same names every trace); bounded
# so that generated names cannot grow it without limit.
_VALID_NAMES: dict[str, None] = {}
_MAX_VALID_NAMES = 1 << 16


def _note_context(error: Exception, ctx: Context) -> None:
    """Note on an add's `error` the context it was added to (its paths are local)."""
    error.add_note(f"In context {'/'.join(ctx.path)!r}.")


_new = object.__new__


def _make(frame: Frame, collection: OutputCollection) -> Context:
    """Build a context from checked parts (no walk, no checks)."""
    out = _new(Context)
    set_frame(out, frame)
    set_collection(out, collection)
    return out


make_context = _make  # for `_bodies.py`


def frame_of(ctx: Context) -> Frame:
    """`ctx`'s frame (for `_bodies.py`)."""
    return ctx._frame  # pyright: ignore[reportPrivateUsage]


def _with(
    ctx: Context, collection: OutputCollection, what: str = "", arg: object = None
) -> Context:
    """`ctx` with `collection`; records in its ledger what the add (`what`) added."""
    frame = ctx._frame  # pyright: ignore[reportPrivateUsage]
    out = _new(Context)
    set_frame(out, frame)
    set_collection(out, collection)
    if what and (ledger := frame.ledger) is not None:
        ledger.record(what, arg, collection)
    return out


_FIELDS = ("prng_key", "collection", "gradients", "row_mask")
_KEYS = tuple(map(jax.tree_util.GetAttrKey, _FIELDS))
_Aux = tuple[Names, bool, int | None]  # path, is_training, summary_level: static


def _flatten_with_keys(ctx: Context) -> tuple[list[Any], _Aux]:
    children, aux = _flatten(ctx)
    return list(zip(_KEYS, children, strict=False)), aux


def _flatten(ctx: Context) -> tuple[tuple[object, ...], _Aux]:
    # The gradient sinks (under `value_and_grad` only) and the row mask (in a padded
    # runner step only) are children too, so that they pass through transformations
    # of a function taking the context; None (an empty subtree) where one is absent.
    aux = (ctx.path, ctx.is_training, ctx.summary_level)
    frame = ctx._frame  # pyright: ignore[reportPrivateUsage]
    grads, mask = frame.gradients, frame.row_mask
    if grads is None and mask is None:
        return (ctx.prng_key, ctx.collection), aux
    return (ctx.prng_key, ctx.collection, grads, mask), aux


def _unflatten(aux: _Aux, children: Children) -> Context:
    path, is_training, level = aux
    grads = mask = None
    if len(children) == 4:
        grads, mask = children[2], children[3]
    frame = Frame(path, children[0], is_training, False, level, grads, row_mask=mask)
    return _make(frame, children[1])


jax.tree_util.register_pytree_with_keys(
    Context, _flatten_with_keys, _unflatten, _flatten
)


def check_returns_context(result: object, what: str) -> tuple[ArrayTree, Context]:
    """Return `result` as `(out, ctx)`, or raise `TypeError` starting with `what`."""
    if (
        not isinstance(result, tuple)
        or len(result) != 2
        or not isinstance(result[1], Context)
    ):
        raise TypeError(
            f"{what} must return `(output, ctx)` with the context last, got "
            f"{type(result).__name__}. Return the context you were given, after "
            "adding outputs to it."
        )
    return result[0], result[1]

"""Context: a named invocation context with a name-derived PRNG key and outputs.

Follows AXLearn's `InvocationContext` (`axlearn/common/module.py`), without its
thread-local stack: a `Context` is passed in and returned explicitly.
"""

import dataclasses
import functools
import hashlib
from collections.abc import Callable
from typing import Any, NoReturn, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool

from ._checks import note_missing_key
from ._collection import (
    OutputCollection,
    add_leaf,
    check_collection,
    check_is_collection,
    name_in_use,
    validate_child_name,
    with_child,
)
from ._errors import CALL_TWICE_HINT, PREFIX_HINT, OutputConflictError
from ._frozen import TreeEquality
from ._gradients import (
    ADDERS,
    GradientState,
    GradKind,
    check_probe_input,
    pending,
    probe,
    probe_fn,
)
from ._leaves import validate_leaf_name
from ._ledger import Ledger, lost_error
from ._rows import RowMask, check_row_mask, row_where
from ._typing import ArrayTree, Children, Leaf, MaybeKey, Names, PRNGKey, R


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()  # `Any`: the default of parameters of other types

#: A `_gradients.GradientState` (the `value_and_grad` sinks), or None. `Any`:
#: `_gradients` imports this module, so the class cannot be named here.
GradientSinks: TypeAlias = Any


@functools.lru_cache(maxsize=4096)
def child_seed(name: str) -> int:
    """Return AXLearn's seed of a child name: md5 of the name, mod `2**31 - 1`."""
    return int(hashlib.md5(name.encode("utf-8")).hexdigest(), 16) % (2**31 - 1)


def fold_in_name(prng_key: PRNGKey | None, name: str) -> PRNGKey | None:
    """Return `jax.random.fold_in(prng_key, child_seed(name))`, or None for None.

    `prng_key` is a raw `uint32[2]` key or a typed key; other dtypes are rejected by
    the runtime shape checks in the test suite (jaxtyping).
    """
    if prng_key is None:
        return None
    return jax.random.fold_in(prng_key, child_seed(name))


def check_is_training(value: object, where: str) -> bool:
    """Return `value` as a `bool`, or raise `TypeError` unless it is a (NumPy) bool."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(
        f"`{where}`: is_training must be a bool, got {type(value).__name__} "
        f"{value!r}. Pass True or False."
    )


def check_prng_key(key: object, where: str) -> MaybeKey:
    """Return `key` if it is None, a raw `uint32[2]` key or a typed key, else raise.

    Raises:
        TypeError: for anything else (a Python int, a string, a float array), saying
            what was given and how to make a key.
    """
    if key is None:
        return None
    dtype = getattr(key, "dtype", None)
    shape = getattr(key, "shape", None)
    if dtype is not None and shape is not None:
        if jnp.issubdtype(dtype, jax.dtypes.prng_key) and tuple(shape) == ():
            return key
        if dtype == np.uint32 and tuple(shape) == (2,):
            return key
    given = (
        f"an array of dtype {dtype} and shape {tuple(shape)}"
        if dtype is not None and shape is not None
        else f"{type(key).__name__} {key!r}"
    )
    raise TypeError(
        f"`{where}`: prng_key must be a raw key (uint32[2], `jax.random.PRNGKey(0)`), "
        f"a typed key (`jax.random.key(0)`) or None, got {given}."
    )


def _check_path(path: object) -> tuple[str, ...]:
    """Return `path` as a tuple of valid names, or raise naming `Context(path=...)`."""
    if isinstance(path, str) or not isinstance(path, (tuple, list)) or not path:
        raise TypeError(
            "`Context(path=...)`: expected a non-empty tuple of names from the root, "
            f"e.g. ('root',) or ('root', 'encoder'), got {type(path).__name__} "
            f"{path!r}. `Context.root(...)` makes a root context."
        )
    for name in path:
        validate_child_name(name, where="Context(path=...)")
    return tuple(path)


class Context(TreeEquality):
    """An invocation context: a path, a PRNG key, a training flag and outputs.

    Model methods take the context as their last positional argument and return it
    last: `method(self, x, ctx) -> (y, ctx)`. Every method here returns a new
    `Context`; `self` is unchanged. A PyTree (its key and collection are children,
    its path and training flag static), so contexts pass through JAX
    transformations.

    A child's key is folded in when it is read (`ctx.prng_key`, or flattening the
    context as a PyTree), from the nearest ancestor whose key is known (the root, an
    iteration of a scan, or a context unflattened by a transformation), so children
    whose key is never read cost nothing at trace time. Nothing is remembered: a
    read D levels below that ancestor costs D `fold_in`s.

    Args:
        path: the names from the root to this context.
        prng_key: the key (raw or typed), or None.
        is_training: training mode.
        collection: the context's outputs.
        summary_level: the summary level (see `Context.root`), or None.
        row_mask: the batch's real rows (see `Context.root`), or None.

    Raises:
        TypeError: if `path` is not a non-empty tuple (or list) of names, `prng_key`
            is neither None, a raw `uint32[2]` key nor a typed key, `is_training` is
            not a bool, `collection` is not an `OutputCollection`,
            `summary_level` is neither None nor an int, or `row_mask` is neither
            None nor a `bool[batch]` array.
        ValueError: for an invalid name in `path` (names match `^[a-z][a-z0-9_]*$`).

    Attributes:
        path: the names from the root to this context, static (e.g.
            `("root", "encoder")`).
        prng_key: a raw `uint32[2]` key (`jax.random.PRNGKey`) or a typed key
            (`jax.random.key`), or None (traced).
        is_training: whether the model runs in training mode, static.
        collection: the `OutputCollection` of this context.
        summary_level: summaries and module outputs added with a `level` above it
            are dropped (static; None keeps everything). Set at the root
            (`Context.root`, `functional`, `MethodRunner.create`) and inherited by
            every child and every iteration of a scan, vmap, branch or loop.
        row_mask: under a padded `MethodRunner` step, `bool[batch]` (True for the
            batch's real rows, traced); None elsewhere. Inherited like
            `summary_level`; see `Context.row_mask`.

    Examples:
        >>> ctx = Context.root(prng_key=jax.random.PRNGKey(0))
        >>> ctx = ctx.add_summary("loss", 1.0)
        >>> ctx.collection.flatten("summaries")
        {'loss': 1.0}
    """

    # The collection, and a `_Frame` with everything else: adding an output makes a
    # context with a new collection and the same frame.
    __slots__ = ("_frame", "collection")
    _frame: "_Frame"
    collection: OutputCollection

    def __init__(
        self,
        path: Names,
        prng_key: PRNGKey | None,
        is_training: bool,
        collection: OutputCollection,
        summary_level: int | None = None,
        row_mask: Bool[Array, " batch"] | np.ndarray | None = None,
    ):
        names = _check_path(path)
        key = check_prng_key(prng_key, "Context")
        training = check_is_training(is_training, "Context")
        check_is_collection(collection, "Context", "collection")
        level = check_summary_level(summary_level, "Context")
        mask = check_row_mask(row_mask, "Context")
        frame = _Frame(names, key, training, False, level, None, row_mask=mask)
        _set_frame(self, frame)
        _set_collection(self, collection)

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field '{name}'")

    def __repr__(self) -> str:
        mask = self._frame.row_mask
        return (
            f"Context(path={self.path!r}, prng_key={self.prng_key!r}, "
            f"is_training={self.is_training!r}, collection={self.collection!r}, "
            f"summary_level={self.summary_level!r}"
            + ("" if mask is None else f", row_mask={mask.array!r}")
            + ")"
        )

    def __reduce__(self) -> tuple[object, ...]:
        mask = self._frame.row_mask
        return (
            Context,
            (
                self.path,
                self.prng_key,
                self.is_training,
                self.collection,
                self.summary_level,
                None if mask is None else mask.array,
            ),
        )

    @property
    def path(self) -> tuple[str, ...]:
        """The names from the root to this context (a child's, built on each read)."""
        frame = self._frame
        path = frame.path
        return _render_path(frame) if path is None else path

    @property
    def prng_key(self) -> MaybeKey:
        """The context's key: a child's is `jax.random.fold_in(parent_key, seed(name))`.

        Folded in on each read, from the nearest ancestor whose key is known (the
        root, an iteration, a context unflattened by a transformation); None in a
        keyless context.
        """
        frame = self._frame
        key = frame.key
        return _derive_key(frame) if key is _DERIVED else key

    @property
    def is_training(self) -> bool:
        """Whether the model runs in training mode (static)."""
        return self._frame.is_training

    @property
    def summary_level(self) -> int | None:
        """The summary level (static): see `Context.root`."""
        return self._frame.summary_level

    @property
    def row_mask(self) -> Bool[Array, " batch"] | np.ndarray | None:
        """The real rows of the padded batch: `bool[batch]`, or None (traced).

        Under a `MethodRunner` step with `pad_batches=True` (or a `mask_kwarg`),
        True for the batch's real rows and False for the zero rows it was padded
        with (all True for a batch that needed no padding); None in any other
        context. Set at the root (`Context.root(row_mask=...)`) and inherited by
        every child and every iteration of a scan, vmap, branch or loop, and kept
        through JAX transformations of a function taking the context; inside a
        `vmap_in_context` it is still the whole batch's mask. Summaries over the
        rows should count only the real ones: `MomentsSummary(x,
        where=ctx.row_where(x))`, `HistogramSummary(x, where=ctx.row_where(x))`,
        a `WeightedSummary` weighted by `jnp.sum(ctx.row_mask)`.

        Reading it tells the runner that the method handles padding: a padded step
        whose summaries never read it warns once (see `MethodRunner.create`).
        """
        mask = self._frame.row_mask
        if mask is None:
            return None
        mask.reads.read = True
        return mask.array

    def row_where(self, x: ArrayLike) -> Bool[Array, "batch ..."] | np.ndarray | None:
        """Return `where=` for a summary of `x`'s rows: the row mask, or None.

        The mask (`Context.row_mask`) reshaped to `[batch, 1, ..., 1]` with `x`'s
        rank, so that it broadcasts over `x`'s other axes as NumPy's `where=` does;
        None outside a padded step (so `MomentsSummary(x, where=ctx.row_where(x))`
        is right in both).

        Args:
            x: an array whose leading axis is the batch's (any dtype; only its
                shape is read).

        Returns:
            `bool[batch, 1, ..., 1]` of `x`'s rank, or None.

        Raises:
            ValueError: under a padded step, for a scalar `x` or one whose leading
                size is not the batch's (naming the context path).
        """
        mask = self.row_mask
        if mask is None:
            return None
        return row_where(mask, x, "/".join(self.path))

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
            prng_key: the root key (raw or typed), or None for a key-less context.
            is_training: training mode, static.
            name: the root's name, the first entry of every path, matching
                `^[a-z][a-z0-9_]*$`.
            summary_level: keep only summaries and module outputs added with
                `level <= summary_level` (static, inherited by every child and
                iteration context); None keeps everything.
            row_mask: `bool[batch]`, True for the real rows of a padded batch
                (traced), inherited by every child and iteration context and read
                as `ctx.row_mask`; None (the default) outside a padded step. A
                `MethodRunner` with `pad_batches=True` sets it.

        Raises:
            ValueError: for an invalid name.
            TypeError: if `is_training` is not a bool, `summary_level` is neither
                None nor an int, `prng_key` is neither None, a raw `uint32[2]` key
                nor a typed key (the message says what it got), or `row_mask` is
                neither None nor a rank-1 bool array.
        """
        validate_child_name(name, where="Context.root(name=...)")
        key = check_prng_key(prng_key, "Context.root")
        training = check_is_training(is_training, "Context.root")
        level = check_summary_level(summary_level, "Context.root")
        mask = check_row_mask(row_mask, "Context.root")
        frame = _Frame((name,), key, training, False, level, None, row_mask=mask)
        return _make(frame, OutputCollection.empty())

    @property
    def name(self) -> str:
        """The last entry of `path`."""
        return self.path[-1]

    def child(
        self,
        name: str,
        *,
        prng_key: PRNGKey | None = _UNSET,
        is_training: bool | np.bool_ = _UNSET,
    ) -> "Context":
        """Return a child context with an empty collection (the low-level step).

        `child` records nothing in `self` and reserves no name: two `child("a")`
        calls, or `child("a")` and a later `call("a", ...)`, give contexts with the
        same key. Model code should use `ctx.call(name, fn)`, which makes the child,
        runs `fn` in it and attaches its outputs under `name`. If you make a child
        by hand, get its outputs back with `ctx.merge(OutputCollection.empty()
        .add_child(name, child.collection))`; `call`, `add_child` and `merge` all
        refuse a second child of one name (`OutputConflictError`), also when the
        first one is empty.

        The child's key is `jax.random.fold_in(self.prng_key, seed(name))` with
        AXLearn's seed (`int(md5(name).hexdigest(), 16) % (2**31 - 1)`), so keys match
        AXLearn's bit for bit. Typed keys give the same key data as raw keys. The child
        refers to `self`'s frame for its path and key, folded in when read (not to
        its outputs), keeping it alive.

        Args:
            name: the child's name, matching `^[a-z][a-z0-9_]*$`.
            prng_key: overrides the derived key.
            is_training: overrides the parent's training flag.

        Raises:
            ValueError: for an invalid name.
            TypeError: if `is_training` is given and is not a bool, or `prng_key` is
                given and is neither None, a raw `uint32[2]` key nor a typed key.
        """
        validate_child_name(name, where="Context.child")
        training = (
            self.is_training
            if is_training is _UNSET
            else check_is_training(is_training, "Context.child")
        )
        if prng_key is _UNSET:
            return _make(_child_frame(self._frame, name, training), _EMPTY)
        prng_key = check_prng_key(prng_key, "Context.child")
        frame = self._frame
        return _make(
            _Frame(
                (*self.path, name),
                prng_key,
                training,
                frame.shape_only,
                frame.summary_level,
                frame.gradients,
                row_mask=frame.row_mask,
            ),
            _EMPTY,
        )

    def add_summary(self, name: str, value: Leaf, level: int = 0) -> "Context":
        """Return a new context with summary `name` added.

        See `OutputCollection.add_summary` for the accepted values and errors.

        Args:
            name: a non-empty string without '/'.
            value: an array, a Python number or a `Summary`.
            level: the summary's level (an int, static): it is kept only if `level
                <= ctx.summary_level` (every level is kept when `summary_level` is
                None, the default). A dropped summary is not returned, so XLA
                removes its computation; only its name is checked (not its value
                or conflicts), and the context is returned unchanged.
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

        State updates have no level: they are the model's new state (e.g. batch
        norm statistics), not an observation of it, so no `summary_level` drops one.
        """
        try:
            new = add_leaf(self.collection, "state_updates", name, value)
            return _with(self, new, "state_updates", name)
        except (OutputConflictError, TypeError, ValueError) as e:
            _note_context(e, self)
            raise

    def add_module_output(self, name: str, value: Leaf, level: int = 0) -> "Context":
        """Return a new context with module output `name` added.

        `level` works as in `add_summary`: the output is kept only if `level <=
        ctx.summary_level` (or `summary_level` is None).
        """
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
        `fn(d loss / d x)` becomes summary `name` of this context, where
        `add_summary(name, ...)` would put it (per-iteration `iter{i}/name` under a
        scan, accumulated with `merge_summaries=True`). Anywhere else (`functional`,
        `jax.grad`, no differentiation) it records nothing and costs nothing: `x`
        itself is returned with `self`. See the "Gradient summaries" docs page.

        Args:
            name: the summary's name (non-empty, no `/`).
            x: a floating-point array, any shape (traced).
            fn: static, `fn(cotangent) -> array or Summary`, where the cotangent has
                `x`'s shape and dtype. None: the root mean square of the cotangent,
                a float32 scalar.
            level: the summary's level (an int, static), as in `add_summary`: the
                probe is kept only if `level <= ctx.summary_level` (every level is
                kept when `summary_level` is None, the default); a dropped probe
                records nothing and adds nothing to the backward pass.

        Returns:
            `(x, ctx)`: `x` itself and the new context.

        Raises:
            TypeError: `x` is not a floating-point array, `level` is not an int,
                or (under `value_and_grad`) `fn` returns neither an array nor a
                `Summary`; the message names the path.
            OutputConflictError: under `value_and_grad`, a summary `name` already
                exists at this path (forward and gradient summaries share names).
        """
        return _add_probe(self, "summaries", name, x, fn, level)

    def add_gradient_output(
        self, name: str, x: ArrayTree, level: int = 0
    ) -> tuple[Array, "Context"]:
        """Return `x` unchanged and a context recording the cotangent of `x`.

        As `add_gradient_summary`, with the full cotangent (`x`'s shape and dtype)
        recorded as module output `name` (stacked `[N, ...]` under a scan), like
        Flax's `perturb`; `level` as in `add_module_output`.

        Raises:
            TypeError: `x` is not a floating-point array (naming the path), or
                `level` is not an int.
            OutputConflictError: under `value_and_grad`, module output `name`
                already exists at this path.
        """
        return _add_probe(self, "module_outputs", name, x, None, level)

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

        Costs O(size of `collection`'s top level), whatever the context holds.

        Raises:
            OutputConflictError: on any name conflict (see `OutputCollection.merge`);
                the message names the context path and suggests another
                `child_name_prefix` for scan results (`child_name` for branches
                and loops).
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

        `fn` returns `(out, child_ctx)`; its collection is attached under `name`.
        Runs in `jax.named_scope(name)`, so profiles show the model tree. Costs
        O(1) besides `fn` itself and the scope, whatever the context already holds.

        Args:
            name: the child's name, matching `^[a-z][a-z0-9_]*$`.
            fn: called as `fn(*args, child_ctx, **kwargs) -> (out, child_ctx)`.
            *args: positional arguments, before the context.
            **kwargs: keyword arguments.

        Returns:
            `(out, ctx)`: `fn`'s output and a new context holding the child's outputs.

        Raises:
            ValueError: for an invalid name.
            OutputConflictError: if `name` was already called (or is already used).
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
        if at.ledger:  # the child added something
            _check_lost(at, child_out, "`Context.call({!r}, fn)`: fn", name)
        return out, _with(
            self, with_child(coll, name, child_out.collection), "call", name
        )


_EMPTY = OutputCollection.empty()
# Child names already validated (a model calls the same names every trace); bounded
# so that generated names cannot grow it without limit.
_VALID_NAMES: dict[str, None] = {}
_MAX_VALID_NAMES = 1 << 16


class _Frame:
    """Everything of a context but its collection; never written after construction.

    Shared by the contexts that adds make from it (an add builds a context of two
    fields). A child's frame (`_child_frame`) holds its parent's frame and its name
    instead of a path (`path` None) and a key (`key` `_DERIVED`), so making a child
    is O(1) whatever the depth; `Context.path` and `Context.prng_key` derive them on
    each read.
    """

    __slots__ = (
        "gradients",
        "is_training",
        "key",
        "ledger",
        "name",
        "path",
        "row_mask",
        "shape_only",
        "summary_level",
        "up",
    )

    def __init__(
        self,
        path: Names | None,
        key: MaybeKey,  # also batched: a context unflattened by `jax.vmap`
        is_training: bool,
        shape_only: bool,
        summary_level: int | None,
        gradients: GradientSinks,
        up: "_Frame | None" = None,
        name: str | None = None,
        *,
        row_mask: RowMask | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self.path = path
        self.key = key
        self.is_training = is_training
        # True inside eqxctx's own shape-only passes (`jax.eval_shape` of a scan
        # body): nested scans then skip their own shape pass (see `scan_in_context`).
        self.shape_only = shape_only
        self.summary_level = summary_level
        # `_gradients.GradientState` under `eqxctx.value_and_grad`, else None.
        self.gradients = gradients
        self.up = up
        self.name = name
        # The padded step's row mask (`Context.row_mask`), inherited as is.
        self.row_mask = row_mask
        # The adds to check when the body handed this frame's context returns.
        self.ledger = ledger


def _note_context(error: Exception, ctx: Context) -> None:
    """Note on an add's `error` the context it was added to (its paths are local)."""
    error.add_note(f"In context {'/'.join(ctx.path)!r}.")


_new = object.__new__
# The slots' own setters: faster than `object.__setattr__`, and the class's
# `__setattr__` (which refuses every assignment) is not involved.
_set_frame = Context.__dict__["_frame"].__set__
_set_collection = Context.__dict__["collection"].__set__


def _make(frame: _Frame, collection: OutputCollection) -> Context:
    """Build a context from checked parts (no walk, no checks)."""
    out = _new(Context)
    _set_frame(out, frame)
    _set_collection(out, collection)
    return out


#: The `key` of a child's frame whose key is `fold_in(parent's key, seed(name))`.
_DERIVED: Any = _Unset()


def _child_frame(
    parent: _Frame, name: str, is_training: bool, ledger: Ledger | None = None
) -> _Frame:
    """The frame of `parent`'s child `name` (O(1): its path and key are read later)."""
    return _Frame(
        None,
        None if parent.key is None else _DERIVED,
        is_training,
        parent.shape_only,
        parent.summary_level,
        parent.gradients,
        parent,
        name,
        row_mask=parent.row_mask,
        ledger=ledger,
    )


def _derive_key(frame: _Frame) -> MaybeKey:
    """Fold the names in from the nearest ancestor whose key is known (no memo)."""
    names: list[str] = []
    while (key := frame.key) is _DERIVED:
        assert frame.up is not None  # (a child's frame has both)
        assert frame.name is not None
        names.append(frame.name)
        frame = frame.up
    for name in reversed(names):
        key = fold_in_name(key, name)
    return key


def _render_path(frame: _Frame) -> tuple[str, ...]:
    """The path of a child's frame: its ancestors' names up to one with a path."""
    names: list[str] = []
    while frame.path is None:
        assert frame.up is not None  # (a child's frame has both)
        assert frame.name is not None
        names.append(frame.name)
        frame = frame.up
    return (*frame.path, *reversed(names))


def iteration_context(
    parent: Context,
    name: str,
    prng_key: PRNGKey | None,
    *,
    shape_only: bool,
    gradients: GradientSinks = _UNSET,
) -> Context:
    """The context of one iteration of a scan or vmap: `parent`'s child `name`.

    `gradients` (the iteration's gradient sinks) defaults to the parent's.
    """
    frame = parent._frame  # pyright: ignore[reportPrivateUsage]
    return _make(
        _Frame(
            (*parent.path, name),
            prng_key,
            frame.is_training,
            shape_only or frame.shape_only,
            frame.summary_level,
            frame.gradients if gradients is _UNSET else gradients,
            row_mask=frame.row_mask,
            ledger=Ledger(),
        ),
        _EMPTY,
    )


def _add_probe(
    ctx: Context,
    kind: GradKind,
    name: str,
    x: ArrayTree,  # checked here, with a message naming the path
    fn: object,  # checked here, with a message naming the path
    level: object,  # checked by `_drops`, with a message
) -> tuple[ArrayTree, Context]:
    """`ctx.add_gradient_summary` / `add_gradient_output` (see their docstrings)."""
    where = ADDERS[kind]
    validate_leaf_name(name, where=where)
    path = "/".join((*ctx.path, name))
    check_probe_input(x, where, path)
    # A probe above the summary level is dropped: no sink, no custom_vjp, nothing
    # in the backward pass (the default, level 0 with no level set, costs a compare).
    if (type(level) is not int or level or ctx.summary_level is not None) and _drops(
        ctx, name, level, where
    ):
        return x, ctx
    fn = probe_fn(kind, fn, where, path)
    state: GradientState | None = gradient_state(ctx)
    if state is None:
        return x, ctx  # not under `value_and_grad`: an exact identity
    key = (ctx.path, kind, name)
    placeholder = pending(state, key, fn, x, where)
    try:
        if kind == "summaries":
            ctx = ctx.add_summary(name, placeholder)
        else:
            ctx = ctx.add_module_output(name, placeholder)
    except OutputConflictError as e:
        raise OutputConflictError(
            f"`{where}`: {path!r}: {e} Forward and gradient {kind} share names."
        ) from None
    return probe(x, state.sinks.get(key), fn), ctx


def gradient_state(ctx: Context) -> GradientSinks:
    """The context's `_gradients.GradientState`, or None (no `value_and_grad`)."""
    return ctx._frame.gradients  # pyright: ignore[reportPrivateUsage]


def gradient_root(
    prng_key: MaybeKey,
    is_training: bool,
    *,
    shape_only: bool,
    gradients: GradientSinks,
    summary_level: int | None = None,
) -> Context:
    """A root context (named "root") carrying a `_gradients.GradientState`."""
    frame = _Frame(
        ("root",),
        prng_key,
        is_training,
        shape_only,
        summary_level,
        gradients,
        ledger=Ledger(),
    )
    return _make(frame, _EMPTY)


def row_mask_read(ctx: Context) -> bool:
    """Whether model code read `ctx`'s row mask (in any context of its root)."""
    mask = ctx._frame.row_mask  # pyright: ignore[reportPrivateUsage]
    return mask is not None and mask.reads.read


def is_shape_only(ctx: Context) -> bool:
    """Whether `ctx` is used inside one of eqxctx's shape-only passes."""
    return ctx._frame.shape_only  # pyright: ignore[reportPrivateUsage]


def _with(
    ctx: Context, collection: OutputCollection, what: str = "", arg: object = None
) -> Context:
    """`ctx` with `collection`; records in its ledger what the add (`what`) added."""
    frame = ctx._frame  # pyright: ignore[reportPrivateUsage]
    out = _new(Context)
    _set_frame(out, frame)
    _set_collection(out, collection)
    if what and (ledger := frame.ledger) is not None:
        ledger.record(what, arg, collection)
    return out


def owned(ctx: Context) -> Context:
    """`ctx` with a fresh ledger, for the call that owns it (see `_ledger`)."""
    f = ctx._frame  # pyright: ignore[reportPrivateUsage]
    frame = _Frame(
        f.path,
        f.key,
        f.is_training,
        f.shape_only,
        f.summary_level,
        f.gradients,
        f.up,
        f.name,
        row_mask=f.row_mask,
        ledger=Ledger(),
    )
    return _make(frame, ctx.collection)


def check_lost(returned: Context, given: Context, what: str) -> None:
    """Raise `LostOutputError` if `given`'s body lost an output (see `_ledger`).

    `returned` is the context the body returned.
    """
    _check_lost(given._frame, returned, what)  # pyright: ignore[reportPrivateUsage]


def _check_lost(given: _Frame, returned: Context, what: str, arg: str = "") -> None:
    ledger = given.ledger
    if ledger:
        exact = returned._frame.ledger is ledger  # pyright: ignore[reportPrivateUsage]
        if lost := ledger.lost(returned.collection, exact):
            raise lost_error(lost, what.format(arg), "/".join(returned.path))
        ledger.clear()  # checked


def note_result(context: Context, collection: OutputCollection) -> None:
    """Record a combinator's `collection`: it must be merged into `context`'s line."""
    ledger = context._frame.ledger  # pyright: ignore[reportPrivateUsage]
    if ledger is not None:
        ledger.record("result", collection, collection)


_KEYS = (
    jax.tree_util.GetAttrKey("prng_key"),
    jax.tree_util.GetAttrKey("collection"),
    jax.tree_util.GetAttrKey("gradients"),
    jax.tree_util.GetAttrKey("row_mask"),
)


_Aux = tuple[Names, bool, int | None]  # path, is_training, summary_level: static


def _flatten_with_keys(ctx: Context) -> tuple[list[Any], _Aux]:
    children = _flatten(ctx)[0]
    return list(zip(_KEYS, children, strict=False)), (
        ctx.path,
        ctx.is_training,
        ctx.summary_level,
    )


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
    frame = _Frame(path, children[0], is_training, False, level, grads, row_mask=mask)
    return _make(frame, children[1])


jax.tree_util.register_pytree_with_keys(
    Context, _flatten_with_keys, _unflatten, _flatten
)


def check_context(value: object, where: str) -> None:
    """Raise `TypeError` naming `where` unless `value` is a `Context`."""
    if not isinstance(value, Context):
        given = f"{type(value).__name__} {value!r}"[:100]
        raise TypeError(
            f"`{where}(context=...)`: context must be a `Context` (the calling "
            f"context, e.g. `Context.root()` or the `ctx` your method was handed), got "
            f"{given}."
        )


def check_summary_level(level: object, where: str) -> int | None:
    """Return `level` (None or an int), or raise `TypeError` naming `where`."""
    if level is None:
        return None
    if isinstance(level, (int, np.integer)) and not isinstance(level, bool):
        return int(level)
    raise TypeError(
        f"`{where}(summary_level=...)`: expected None (keep every summary) or an "
        f"int, got {type(level).__name__} {level!r}."
    )


def _drops(ctx: Context, name: object, level: object, where: str) -> bool:
    """Whether an entry of `level` is dropped in `ctx` (checks the level and name)."""
    if isinstance(level, bool) or not isinstance(level, (int, np.integer)):
        raise TypeError(
            f"`{where}(level=...)`: expected an int (a static level, 0 by default), "
            f"got {type(level).__name__} {level!r}."
        )
    cap = ctx.summary_level
    if cap is None or level <= cap:
        return False
    validate_leaf_name(name, where=where)
    return True


def check_path(returned: Context, given: Context, what: str) -> None:
    """Raise `ValueError` unless `returned` has the path of the context `given`.

    A function handed a context must return that context (with outputs added), not
    its parent's or a child's: the outputs would land at the wrong path.
    """
    if returned.path is not given.path and returned.path != given.path:
        raise ValueError(
            f"{what} returned the context at {'/'.join(returned.path)!r}, but was "
            f"handed the context at {'/'.join(given.path)!r}. Return the context you "
            "were given (after adding outputs to it); merge a child's outputs with "
            "`ctx.call` or `ctx.merge`."
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

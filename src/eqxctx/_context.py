"""Context: a named invocation context with a name-derived PRNG key and outputs.

Follows AXLearn's `InvocationContext` (`axlearn/common/module.py`), without its
thread-local stack: a `Context` is passed in and returned explicitly.
"""

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from ._collection import OutputCollection, add_leaf, validate_child_name
from ._errors import CALL_TWICE_HINT, PREFIX_HINT, OutputConflictError
from ._typing import PRNGKey


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()


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


class Context(eqx.Module):
    """An invocation context: a path, a PRNG key, a training flag and outputs.

    Model methods take the context as their last positional argument and return it
    last: `method(self, x, ctx) -> (y, ctx)`. Every method here returns a new
    `Context`; `self` is unchanged.

    Attributes:
        path: the names from the root to this context, static (e.g.
            `("root", "encoder")`).
        prng_key: a raw `uint32[2]` key (`jax.random.PRNGKey`) or a typed key
            (`jax.random.key`), or None (traced).
        is_training: whether the model runs in training mode, static.
        collection: the `OutputCollection` of this context.

    Examples:
        >>> ctx = Context.root(prng_key=jax.random.PRNGKey(0))
        >>> ctx = ctx.add_summary("loss", 1.0)
        >>> ctx.collection.flatten("summaries")
        {'loss': 1.0}
    """

    path: tuple[str, ...] = eqx.field(static=True)
    prng_key: Any
    is_training: bool = eqx.field(static=True)
    collection: OutputCollection

    @classmethod
    def root(
        cls, *, prng_key: Any = None, is_training: bool = False, name: str = "root"
    ) -> "Context":
        """Return a root context with an empty collection.

        Args:
            prng_key: the root key (raw or typed), or None for a key-less context.
            is_training: training mode, static.
            name: the root's name, the first entry of every path.
        """
        return cls((name,), prng_key, is_training, OutputCollection.empty())

    @property
    def name(self) -> str:
        """The last entry of `path`."""
        return self.path[-1]

    def child(
        self, name: str, *, prng_key: Any = _UNSET, is_training: Any = _UNSET
    ) -> "Context":
        """Return a child context with an empty collection.

        The child's key is `jax.random.fold_in(self.prng_key, seed(name))` with
        AXLearn's seed (`int(md5(name).hexdigest(), 16) % (2**31 - 1)`), so keys match
        AXLearn's bit for bit. Typed keys give the same key data as raw keys.

        Args:
            name: the child's name, matching `^[a-z][a-z0-9_]*$`.
            prng_key: overrides the derived key.
            is_training: overrides the parent's training flag.

        Raises:
            ValueError: for an invalid name.
        """
        validate_child_name(name, where="Context.child")
        return Context(
            (*self.path, name),
            fold_in_name(self.prng_key, name) if prng_key is _UNSET else prng_key,
            self.is_training if is_training is _UNSET else bool(is_training),
            OutputCollection.empty(),
        )

    def add_summary(self, name: str, value: Any) -> "Context":
        """Return a new context with summary `name` added.

        See `OutputCollection.add_summary` for the accepted values and errors.
        """
        coll = add_leaf(self.collection, "summaries", name, value)
        return dataclasses.replace(self, collection=coll)

    def add_state_update(self, name: str, value: Any) -> "Context":
        """Return a new context with state update `name` added."""
        coll = add_leaf(self.collection, "state_updates", name, value)
        return dataclasses.replace(self, collection=coll)

    def add_module_output(self, name: str, value: Any) -> "Context":
        """Return a new context with module output `name` added."""
        coll = add_leaf(self.collection, "module_outputs", name, value)
        return dataclasses.replace(self, collection=coll)

    def replace_collection(self, collection: OutputCollection) -> "Context":
        """Return a new context whose collection is `collection`."""
        return dataclasses.replace(self, collection=collection)

    def merge(self, collection: OutputCollection) -> "Context":
        """Return a new context whose collection is merged with `collection`.

        Raises:
            OutputConflictError: on any name conflict (see `OutputCollection.merge`);
                the message names the context path and suggests another
                `child_name_prefix` for scan results.
        """
        try:
            merged = self.collection.merge(collection)
        except OutputConflictError as e:
            where = "/".join(self.path)
            msg = str(e)
            if PREFIX_HINT not in msg:
                msg = f"{msg} {PREFIX_HINT}"
            raise OutputConflictError(f"In context {where!r}: {msg}") from None
        return self.replace_collection(merged)

    def call(
        self,
        name: str,
        fn: Callable[..., tuple[Any, "Context"]],
        /,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Any, "Context"]:
        """Run `fn(*args, child_ctx, **kwargs)` in child context `name`.

        `fn` returns `(out, child_ctx)`; its collection is attached under `name`.
        Runs inside `jax.named_scope(name)`, so profiles show the model tree.

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
        """
        coll = self.collection
        validate_child_name(name, where="Context.call")
        if name in coll.child_names() or name in coll.leaf_names():
            raise OutputConflictError(
                f"`Context.call`: {name!r} is already used in context "
                f"{'/'.join(self.path)!r}. {CALL_TWICE_HINT}"
            )
        child = self.child(name)
        with jax.named_scope(name):
            result = fn(*args, child, **kwargs)
        out, child_out = check_returns_context(
            result, f"`Context.call({name!r}, fn)`: fn"
        )
        return out, self.replace_collection(coll.add_child(name, child_out.collection))


def check_returns_context(result: object, what: str) -> tuple[Any, Context]:
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

"""Shared type aliases and TypeVars (named after what they hold, as in Optax's base)."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias, TypeVar

import numpy as np
from jaxtyping import Array, Key, UInt32


Carry = TypeVar("Carry")
X = TypeVar("X")
Y = TypeVar("Y")
R = TypeVar("R")
#: The type of a `MethodRunner`'s model (for static type checkers).
ModelT = TypeVar("ModelT")
#: The type of its method's output (`MethodRunner.Output.output_batch`).
OutputT = TypeVar("OutputT")

#: A PRNG key: a raw `uint32[2]` key (`jax.random.PRNGKey`) or a typed key
#: (`jax.random.key`).
PRNGKey: TypeAlias = Key[Array, ""] | UInt32[Array, "2"] | UInt32[np.ndarray, "2"]

#: A PRNG key on the device (what a `MethodRunner` holds, placed on its mesh): a raw
#: `uint32[2]` or a typed key array.
PRNGKeyArray: TypeAlias = Key[Array, ""] | UInt32[Array, "2"]

#: An array on the device (`jax.Array`) or on the host (NumPy): what a `Summary`'s
#: `value()` returns; host views of per-iteration summaries hold NumPy values.
ArrayValue: TypeAlias = Array | np.ndarray | np.number[Any] | np.bool_

#: A key or a batch of keys (leading axes), e.g. a scan's `per_iteration` keys or
#: the key of a context unflattened by `jax.vmap`.
PRNGKeys: TypeAlias = (
    Key[Array, "*batch"] | UInt32[Array, "*batch 2"] | UInt32[np.ndarray, "*batch 2"]
)

#: A batch of inputs: any PyTree of arrays (NumPy or JAX), e.g. `{"x": x}`.
Batch: TypeAlias = Any

#: A `jax.tree_util.PyTreeDef` (JAX exports it as a value, not a type).
TreeDef: TypeAlias = Any

#: Any PyTree (of arrays, numbers, `Summary`s, None, ...): a carry, `xs`, `ys`, a
#: function's output or gradients, passed through or flattened at run time. `Any`
#: for type checkers, as jaxtyping's `PyTree` is.
ArrayTree: TypeAlias = Any

#: A dtype: a NumPy dtype, a scalar type (`np.float32`) or JAX's extended dtype of a
#: typed key; checked at run time (`jnp.issubdtype`).
DType: TypeAlias = Any

#: A tuple of names (a context's path, a mapping's keys). `tuple[Any, ...]`, not
#: `tuple[str, ...]`: beartype samples the items of a variadic tuple with `random`,
#: which hypothesis forbids inside strategies (contexts are built in strategies).
Names: TypeAlias = tuple[Any, ...]

#: The children of a PyTree node as JAX hands them to an `unflatten` function (a
#: tuple or a list). `Any`: beartype samples a sequence's items with `random`, which
#: hypothesis forbids inside strategies.
Children: TypeAlias = Any

#: A `jax.tree_util` key path: a tuple of `DictKey`, `GetAttrKey`, `SequenceKey`, ...
KeyPath: TypeAlias = tuple[Any, ...]

#: An array leaf as the runner places it: a `jax.Array` (global, single-device or
#: traced), a NumPy array, a Python scalar, or (for `MethodRunner.lower`) a
#: `jax.ShapeDtypeStruct`.
ArrayLeaf: TypeAlias = Any

#: A model: a PyTree (e.g. an `eqx.Module`) whose array leaves are its parameters and
#: whose other leaves are static.
Model: TypeAlias = Any

#: A model's array part (`eqx.partition(model, eqx.is_array)[0]`): its parameters in
#: the model's structure, None elsewhere.
Params: TypeAlias = Any

#: How a tree is split over a mesh: a `DataPartition`, a `PartitionSpec` or None
#: (replicated), or a prefix tree of them over the batch, the output or the
#: parameters (for the parameters also a callable `(path, leaf) -> PartitionSpec`).
PartitionTree: TypeAlias = Any

#: The method a `MethodRunner` runs: `method(model, batch, ctx, **kwargs) -> (output,
#: ctx)`, or the name of a method of the model.
Method: TypeAlias = Callable[..., Any] | str

#: One entry of a `PartitionSpec`: None, a mesh axis name, or a tuple of names.
SpecEntry: TypeAlias = Any

#: What `Context.prng_key` holds: a `PRNGKey` (or a batch of them, once a context has
#: passed through `jax.vmap`), or None for a key-less context. `Any` for type
#: checkers, so that `jax.random.normal(ctx.prng_key, ...)` needs no narrowing; a
#: key-less context is reported by JAX at the call that needs the key.
MaybeKey: TypeAlias = Any

#: A leaf of an output collection: a JAX or NumPy array, a Python number or a
#: `Summary` (any, at run time: values also pass through JAX transformations).
Leaf: TypeAlias = Any

#: A nested mapping of names to leaves or nested mappings (one kind of a collection).
Tree: TypeAlias = Mapping[str, Any]

#: A nested mapping of summaries (`OutputCollection.summaries`, `Output.summaries`).
SummaryTree: TypeAlias = Mapping[str, Any]

#: A path predicate: `drop(path) -> bool` with "/"-joined paths.
PathPredicate: TypeAlias = Callable[[str], bool]

#: `jax.vmap`'s `in_axes`: a prefix tree of the inputs with an int or None per subtree.
InAxes: TypeAlias = int | Sequence[Any] | Mapping[str, Any] | None

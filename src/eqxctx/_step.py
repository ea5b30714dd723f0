"""The compiled step of `MethodRunner`: its static settings and the traced function.

`Settings` holds everything static about a runner (the method, the mesh, the
partitions, the model's non-array leaves), hashed and compared by value, so that equal
settings share one `jax.jit` (`Settings.jitted`) and its compilations, as equal static
parts do under `eqx.filter_jit`. `step` is AXLearn's `_jit_run_on_batch`
(`axlearn/common/inference.py`): split the key, run the method in a root context, and
constrain inputs, outputs and parameters to their shardings.
"""

import collections
import dataclasses
import functools
import operator
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._collection import OutputCollection
from ._context import Context, check_returns_context
from ._partition import (
    check_divisible,
    is_explicit,
    leaf_spec,
    named_sharding,
    normalize_spec,
    path_str,
    resolve_specs,
)
from ._transfer import constrain, to_global


REPLICATED = PartitionSpec()
_setattr = object.__setattr__  # sets fields of the frozen `Settings`
_flatten = jax.tree_util.default_registry.flatten


class Frozen:
    """A PyTree of hashable leaves, hashed and compared by value (a static arg)."""

    __slots__ = ("_hash", "leaves", "treedef", "types")

    def __init__(self, tree: Any, *, what: str):
        leaves, treedef = jax.tree.flatten(tree)
        self.leaves = tuple(leaves)
        self.treedef = treedef
        # `2 == 2.0 == True`: compare types too (of the leaves and of the values in
        # the treedef, such as `eqx.field(static=True)` fields), or runners of
        # models that differ only there would share one compiled program (and its
        # output dtypes).
        self.types = _value_types(tree)
        try:
            self._hash = hash((treedef, self.leaves, self.types))
        except TypeError as e:
            raise TypeError(
                f"`MethodRunner`: {what} has a non-array leaf that is not hashable "
                f"({e}). Non-array leaves are static (as in `eqx.filter_jit`) and "
                "must be hashable; turn it into an array or a tuple."
            ) from None

    def tree(self) -> Any:
        return self.treedef.unflatten(self.leaves)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, Frozen)
            and self._hash == other._hash
            and self.treedef == other.treedef
            and self.types == other.types
            and self.leaves == other.leaves
        )


def _value_types(x: Any) -> Any:
    """The types of everything `x` holds, nested like it (for `Frozen`'s equality).

    Walks dataclasses (so `eqx.Module`s, including their `eqx.field(static=True)`
    fields, which a treedef compares only with `==`), tuples, lists and dicts.
    """
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (
            type(x),
            tuple(
                (f.name, _value_types(getattr(x, f.name, None)))
                for f in dataclasses.fields(x)
            ),
        )
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_value_types(v) for v in x))
    if isinstance(x, dict):
        return (dict, tuple((k, _value_types(v)) for k, v in x.items()))
    return type(x)


@dataclasses.dataclass(frozen=True, eq=False)
class Settings:
    """The static part of a runner; equal settings share one compiled program."""

    method: Any
    mesh: Mesh
    input_partition: Any
    output_partition: Any
    param_specs: tuple[PartitionSpec, ...]
    static_model: Frozen
    drop_module_outputs: Callable[[str], bool]
    is_training: bool
    # The structure of the model's array part (`MethodRunner.param_leaves`).
    param_treedef: Any
    # Per batch treedef: how batches of that structure are placed and recognized.
    batch_cache: dict[Any, "BatchEntry"] = dataclasses.field(
        default_factory=dict[Any, Any]
    )
    # The last batch's `(treedef, signature, expected, dict_keys)` (see `BatchEntry`):
    # `MethodRunner.__call__` passes a batch that matches it straight to the step.
    last_batch: "tuple[Any, Callable[[Any], Any], list[Any], Any] | None" = None
    # `jax.jit` of the step without keyword arguments, shared by equal settings.
    jitted: Callable[..., Any] = dataclasses.field(init=False, repr=False)
    _key: tuple[Any, ...] = dataclasses.field(init=False, repr=False)
    _hash: int = dataclasses.field(init=False, repr=False)

    def key(self) -> tuple[Any, ...]:
        return (
            self.method,
            self.mesh,
            Frozen(self.input_partition, what="input_partition"),
            Frozen(self.output_partition, what="output_partition"),
            self.param_specs,
            self.static_model,
            self.drop_module_outputs,
            self.is_training,
            self.param_treedef,
        )

    def __post_init__(self) -> None:
        _setattr(self, "_key", self.key())
        _setattr(self, "_hash", hash(self._key))
        _setattr(self, "jitted", _jit_for(self))

    def __hash__(self) -> int:
        return self._hash

    def __copy__(self) -> "Settings":
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> "Settings":
        # Immutable and static (its cache only speeds calls up): copies share it,
        # so a copied runner keeps its compilations and compares equal.
        del memo
        return self

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, Settings)
            and self._hash == other._hash
            and self._key == other._key
        )

    @property
    def explicit(self) -> bool:
        return is_explicit(self.mesh)

    def placed_batch(self, leaves: list[Any], treedef: Any) -> bool:
        """Return whether the batch's leaves are arrays with the input shardings."""
        entry = self.batch_cache.get(treedef)
        if entry is None:
            return False
        try:
            if list(map(entry.signature, leaves)) != entry.expected:
                return False
        except AttributeError:  # a host-local leaf: NumPy, Python scalar
            return False
        _setattr(self, "last_batch", entry.last(treedef))
        return True

    def place_batch(self, batch: Any, flat: tuple[list[Any], Any] | None = None) -> Any:
        """Return `batch` as global arrays with the input partition (new containers).

        Leaves that are tracers (the runner called inside `jax.jit`, `jax.vmap`, ...)
        are left to the step, which constrains them to the input partition. `flat`
        is `batch`'s `(leaves, treedef)` when the caller has flattened it already.

        Raises:
            TypeError: for a leaf that is not an array (naming its path).
            ValueError: for a dimension that does not divide over its mesh axes.
        """
        leaves, treedef = flat if flat is not None else _flatten(batch)
        if self.placed_batch(leaves, treedef):
            return treedef.unflatten(leaves)
        if any(isinstance(x, Tracer) for x in leaves):
            return treedef.unflatten(leaves)
        entry = self.batch_cache.get(treedef)
        if entry is not None:
            base = entry.specs
        else:
            base = resolve_specs(
                self.input_partition, batch, self.mesh, what="input_partition"
            )
        with_path = jax.tree_util.tree_flatten_with_path(batch)[0]
        placed: list[Any] = []
        shardings: list[NamedSharding] = []
        for (path, x), spec in zip(with_path, base, strict=True):
            try:
                spec = leaf_spec(spec, np.ndim(x), explicit=self.explicit)
            except ValueError:  # name the leaf (computing paths only here)
                leaf_spec(spec, np.ndim(x), explicit=self.explicit, path=path_str(path))
                raise
            s = named_sharding(self.mesh, spec)
            if not (isinstance(x, jax.Array) and x.sharding == s):
                x = to_global(x, s, path=path_str(path))
            placed.append(x)
            shardings.append(s)
        if any(isinstance(x, Tracer) for x in placed):
            # Host-local leaves placed inside a trace (a runner called in `jax.jit`
            # on a batch it closes over): nothing to remember for later calls.
            return treedef.unflatten(placed)
        # The rank rule maps a leaf of rank r < len(spec) to a shorter spec, whose
        # sharding an array of another rank can have too: compare ranks as well.
        by_rank = any(np.ndim(x) < len(b) for x, b in zip(placed, base, strict=True))
        signature = _SIGNATURE_WITH_RANK if by_rank else _SIGNATURE
        entry = BatchEntry(
            base,
            shardings,
            _flat_dict_keys(batch, with_path),
            signature,
            list(map(signature, placed)),
        )
        self.batch_cache[treedef] = entry
        _setattr(self, "last_batch", entry.last(treedef))
        return treedef.unflatten(placed)

    def place_kwargs(self, dynamic: Any) -> Any:
        """Replicate array keyword arguments committed to devices off the mesh.

        `jax.jit` refuses an argument committed to another device set (e.g. a
        `jax.device_put(x, jax.devices()[3])`) than the mesh's; arrays already on
        the mesh and NumPy arrays pass as they are.
        """

        def place(x: Any) -> Any:
            if (
                isinstance(x, jax.Array)
                and not isinstance(x, Tracer)
                and x.committed
                and x.sharding.device_set != self.mesh_devices
            ):
                return jax.device_put(x, replicated(self.mesh, x))
            return x

        return jax.tree.map(place, dynamic)

    @functools.cached_property
    def mesh_devices(self) -> set[Any]:
        return set(self.mesh.devices.flat)


# What `MethodRunner.__call__` compares of each batch leaf with the last batch's: the
# type (a `jax.Array` subclass, not a PyTree with a `.sharding`), the sharding, and the
# rank where the rank rule makes it matter. Read in C by `map`.
_SIGNATURE = operator.attrgetter("__class__", "sharding")
_SIGNATURE_WITH_RANK = operator.attrgetter("__class__", "sharding", "ndim")


class BatchEntry(NamedTuple):
    """How batches of one structure are placed (`Settings.batch_cache`).

    Attributes:
        specs: the input spec of each leaf, before the rank rule.
        shardings: the sharding of each placed leaf.
        dict_keys: for a plain dict whose values are all leaves, its keys in leaf
            order (such a batch is checked without flattening it); else None.
        signature: what is compared of each leaf (`_SIGNATURE...`).
        expected: `signature` of each placed leaf.
    """

    specs: list[PartitionSpec]
    shardings: list[NamedSharding]
    dict_keys: tuple[Any, ...] | None
    signature: Callable[[Any], Any]
    expected: list[Any]

    def last(self, treedef: Any) -> tuple[Any, Callable[[Any], Any], list[Any], Any]:
        return (treedef, self.signature, self.expected, self.dict_keys)


def _flat_dict_keys(batch: Any, with_path: list[Any]) -> tuple[Any, ...] | None:
    """The keys of a plain dict whose values are all leaves, in leaf order; else None.

    Such a batch (AXLearn's usual input) is checked without flattening it: same keys,
    same shardings (`MethodRunner.__call__`).
    """
    if type(batch) is not dict or len(with_path) != len(batch):
        return None
    keys: list[Any] = []
    for path, _ in with_path:
        if len(path) != 1 or not isinstance(path[0], jax.tree_util.DictKey):
            return None
        keys.append(path[0].key)
    return tuple(keys)


def _constrain_tree(
    tree: Any, partition: Any, mesh: Mesh, *, what: str, kind: str
) -> Any:
    """Constrain every array of `tree` by `partition` (with the rank rule).

    Runs at trace time. Checks that each leaf's dimensions divide over their mesh
    axes (`kind` is "batch" or "output", for the message): on Auto meshes JAX would
    silently replicate a leaf that does not divide, on Explicit meshes its error
    names no leaf.
    """
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    specs = resolve_specs(partition, tree, mesh, what=what)
    explicit = is_explicit(mesh)
    out: list[Any] = []
    for (path, x), s in zip(with_path, specs, strict=True):
        if isinstance(x, jax.Array):
            name = path_str(path)
            spec = leaf_spec(s, np.ndim(x), explicit=explicit, path=name)
            check_divisible(np.shape(x), spec, mesh, path=name, what=kind)
            x = constrain(x, named_sharding(mesh, spec), explicit=explicit)
        out.append(x)
    return treedef.unflatten(out)


def _replicate(tree: Any, mesh: Mesh) -> Any:
    explicit = is_explicit(mesh)
    return jax.tree.map(
        lambda x: constrain(x, replicated(mesh, x), explicit=explicit), tree
    )


def replicated(mesh: Mesh, x: Any) -> NamedSharding:
    return named_sharding(
        mesh, normalize_spec(REPLICATED, np.ndim(x), explicit=is_explicit(mesh))
    )


@jax.tree_util.register_pytree_node_class
class StaticOut:
    """Non-array outputs, carried in the output treedef (like `eqx.filter_jit`)."""

    def __init__(self, value: Any):
        self.value = value

    def tree_flatten(self) -> tuple[tuple[()], Any]:
        return (), self.value

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> "StaticOut":
        del children
        return cls(aux)


def _step(
    settings: Settings,
    static_kwargs: Frozen | None,
    param_leaves: tuple[Any, ...],
    prng_key: Any,
    batch: Any,
    dynamic_kwargs: Any,
) -> tuple[Any, Any, StaticOut | None]:
    """The traced step: AXLearn's `_jit_run_on_batch`."""
    mesh, explicit = settings.mesh, settings.explicit
    p_leaves = [
        constrain(x, named_sharding(mesh, s), explicit=explicit)
        for x, s in zip(param_leaves, settings.param_specs, strict=True)
    ]
    params = settings.param_treedef.unflatten(p_leaves)
    model = eqx.combine(params, settings.static_model.tree())
    batch = _constrain_tree(
        batch, settings.input_partition, mesh, what="input_partition", kind="batch"
    )
    new_key, iter_key = jax.random.split(prng_key)
    new_key = constrain(new_key, replicated(mesh, new_key), explicit=explicit)
    kwargs: dict[str, Any] = {}
    if static_kwargs is not None:
        kwargs = eqx.combine(dynamic_kwargs, static_kwargs.tree())
    ctx = Context.root(prng_key=iter_key, is_training=settings.is_training)
    method = settings.method
    if isinstance(method, str):
        result = getattr(model, method)(batch, ctx, **kwargs)
        what = f"`MethodRunner`: method {type(model).__name__}.{method}"
    else:
        result = method(model, batch, ctx, **kwargs)
        what = f"`MethodRunner`: method {getattr(method, '__name__', method)!r}"
    if (
        isinstance(result, tuple)
        and len(result) == 2
        and isinstance(result[0], Context)
        and not isinstance(result[1], Context)
    ):
        raise TypeError(
            f"{what} returned `(ctx, output)`; it must return `(output, ctx)` (the "
            "context last, as in `y, state = layer(x, state)`). Swap the order."
        )
    output_batch, ctx = check_returns_context(result, what)
    output_batch = _constrain_tree(
        output_batch,
        settings.output_partition,
        mesh,
        what="output_partition",
        kind="output",
    )
    drop = settings.drop_module_outputs
    pruned = OutputCollection({}, {}, ctx.collection.module_outputs).prune(
        lambda p: p.startswith("module_outputs/") and drop(p[len("module_outputs/") :])
    )
    summaries = _replicate(ctx.collection.summaries, mesh)
    module_outputs = _replicate(pruned.module_outputs, mesh)
    dynamic, static = eqx.partition(
        (output_batch, summaries, module_outputs), eqx.is_array
    )
    has_static = any(x is not None for x in jax.tree.leaves(static))
    # None (an empty PyTree, unflattened in C++) when every output is an array.
    return new_key, dynamic, StaticOut(static) if has_static else None


jit_step = jax.jit(_step, static_argnums=(0, 1))


def _step_without_kwargs(
    settings: Settings, param_leaves: tuple[Any, ...], prng_key: Any, batch: Any
) -> tuple[Any, Any, StaticOut | None]:
    return _step(settings, None, param_leaves, prng_key, batch, None)


#: The compiled step per settings (LRU): runners re-created from equal settings
#: share one `jax.jit` and so its compilations.
_JITS: "collections.OrderedDict[Settings, Callable[..., Any]]" = (
    collections.OrderedDict()
)
_MAX_JITS = 256


def _jit_for(settings: "Settings") -> Callable[..., Any]:
    """Return the `jax.jit` of the step for `settings` without keyword arguments.

    Closing over the settings (instead of passing them as a static argument) saves
    the static-argument hashing on every call.
    """
    with _JITS_LOCK:
        fn = _JITS.get(settings)
        if fn is None:
            fn = jax.jit(functools.partial(_step_without_kwargs, settings))
            _JITS[settings] = fn
            if len(_JITS) > _MAX_JITS:
                _JITS.popitem(last=False)
        else:
            _JITS.move_to_end(settings)
        return fn


_JITS_LOCK = threading.Lock()

"""MethodRunner: run a model method on sharded batches, compiled once per signature.

Follows AXLearn's `MethodRunner` and `InferenceRunner.create_method_runner`
(`axlearn/common/inference.py`): a jitted step over `(prng_key, input_batch)` that
returns `(new_key, outputs, summaries, module_outputs)`, with inputs, outputs and
parameters under sharding constraints.

Why the hot path looks the way it does (measured in `benchmarks/bench_runner.py`):
`eqx.filter_jit` partitions every argument into arrays and the rest on every call
(Python work per leaf) and blocks on a marker output after every call. The runner keeps
filter_jit's semantics (array leaves traced, every other leaf static, equal static
parts share a compilation) but partitions the model once, in `MethodRunner.create`,
and calls one module-level `jax.jit` whose static argument is a hashable settings
object (`_Settings`: the method, the mesh, the partitions and the model's non-array
part, compared by value). A warm call therefore costs JAX's own C++ dispatch plus a
constant amount of Python work, and it never blocks.
"""

import collections
import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._collection import OutputCollection
from ._context import Context, check_returns_context
from ._sharding import (
    DataPartition,
    check_divisible,
    constrain,
    is_explicit,
    leaf_spec,
    named_sharding,
    normalize_spec,
    resolve_specs,
    to_global,
)


_REPLICATED = PartitionSpec()
# Bound once: the hot path calls them on every runner call.
_setattr = object.__setattr__
_getattribute = object.__getattribute__
_flatten = jax.tree_util.default_registry.flatten


def _path_str(path: tuple[Any, ...]) -> str:
    """Return a key path as "a/b/0" (attribute names, dict keys, sequence indices)."""
    parts: list[str] = []
    for k in path:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


class _Frozen:
    """A PyTree of hashable leaves, hashed and compared by value (a static arg)."""

    __slots__ = ("_hash", "leaves", "treedef")

    def __init__(self, tree: Any, *, what: str):
        leaves, treedef = jax.tree.flatten(tree)
        self.leaves = tuple(leaves)
        self.treedef = treedef
        try:
            self._hash = hash((treedef, self.leaves))
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
            isinstance(other, _Frozen)
            and self._hash == other._hash
            and self.treedef == other.treedef
            and self.leaves == other.leaves
        )


@dataclasses.dataclass(frozen=True, eq=False)
class _Settings:
    """The static part of a runner; equal settings share one compiled program."""

    method: Any
    mesh: Mesh
    input_partition: Any
    output_partition: Any
    param_specs: tuple[PartitionSpec, ...]
    static_model: _Frozen
    drop_module_outputs: Callable[[str], bool]
    is_training: bool
    # Per batch treedef: the input spec of each leaf, before the rank rule.
    batch_cache: dict[Any, tuple[list[PartitionSpec], list[NamedSharding]]] = (
        dataclasses.field(default_factory=dict[Any, Any])
    )

    last_batch: tuple[Any, list[NamedSharding]] | None = None
    # `jax.jit` of the step without keyword arguments, shared by equal settings.
    jitted: Callable[..., Any] = dataclasses.field(init=False, repr=False)
    _key: tuple[Any, ...] = dataclasses.field(init=False, repr=False)
    _hash: int = dataclasses.field(init=False, repr=False)

    def key(self) -> tuple[Any, ...]:
        return (
            self.method,
            self.mesh,
            _Frozen(self.input_partition, what="input_partition"),
            _Frozen(self.output_partition, what="output_partition"),
            self.param_specs,
            self.static_model,
            self.drop_module_outputs,
            self.is_training,
        )

    def __post_init__(self) -> None:
        _setattr(self, "_key", self.key())
        _setattr(self, "_hash", hash(self._key))
        _setattr(self, "jitted", _jit_for(self))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, _Settings)
            and self._hash == other._hash
            and self._key == other._key
        )

    @property
    def explicit(self) -> bool:
        return is_explicit(self.mesh)

    def placed_batch(self, leaves: list[Any], treedef: Any) -> bool:
        """Return whether the batch's leaves already have the input shardings."""
        last = self.last_batch  # (treedef, shardings), read once: thread safe
        if last is None or last[0] != treedef:
            entry = self.batch_cache.get(treedef)
            if entry is None:
                return False
            last = (treedef, entry[1])
        try:
            for x, s in zip(leaves, last[1], strict=True):
                if x.sharding != s:
                    return False
        except AttributeError:  # a host-local leaf: NumPy, Python scalar
            return False
        _setattr(self, "last_batch", last)
        return True

    def place_batch(self, batch: Any) -> Any:
        """Return `batch` as global arrays with the input partition."""
        leaves, treedef = _flatten(batch)
        if self.placed_batch(leaves, treedef):
            return batch
        entry = self.batch_cache.get(treedef)
        if entry is not None:
            base = entry[0]
        else:
            base = resolve_specs(
                self.input_partition, batch, self.mesh, what="input_partition"
            )
        with_path = jax.tree_util.tree_flatten_with_path(batch)[0]
        placed: list[Any] = []
        shardings: list[NamedSharding] = []
        for (path, x), spec in zip(with_path, base, strict=True):
            s = named_sharding(
                self.mesh, leaf_spec(spec, np.ndim(x), explicit=self.explicit)
            )
            if not (isinstance(x, jax.Array) and x.sharding == s):
                x = to_global(x, s, path=_path_str(path))
            placed.append(x)
            shardings.append(s)
        self.batch_cache[treedef] = (base, shardings)
        _setattr(self, "last_batch", (treedef, shardings))
        return treedef.unflatten(placed)


def _constrain_tree(tree: Any, partition: Any, mesh: Mesh, *, what: str) -> Any:
    """Constrain every array of `tree` by `partition` (with the rank rule)."""
    leaves, treedef = jax.tree.flatten(tree)
    specs = resolve_specs(partition, tree, mesh, what=what)
    explicit = is_explicit(mesh)
    out = [
        constrain(
            x,
            named_sharding(mesh, leaf_spec(s, np.ndim(x), explicit=explicit)),
            explicit=explicit,
        )
        for x, s in zip(leaves, specs, strict=True)
    ]
    return treedef.unflatten(out)


def _replicate(tree: Any, mesh: Mesh) -> Any:
    explicit = is_explicit(mesh)
    return jax.tree.map(
        lambda x: constrain(x, _replicated(mesh, x), explicit=explicit), tree
    )


def _replicated(mesh: Mesh, x: Any) -> NamedSharding:
    return named_sharding(
        mesh, normalize_spec(_REPLICATED, np.ndim(x), explicit=is_explicit(mesh))
    )


@jax.tree_util.register_pytree_node_class
class _StaticOut:
    """Non-array outputs, carried in the output treedef (like `eqx.filter_jit`)."""

    def __init__(self, value: Any):
        self.value = value

    def tree_flatten(self) -> tuple[tuple[()], Any]:
        return (), self.value

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> "_StaticOut":
        del children
        return cls(aux)


def _step(
    settings: _Settings,
    static_kwargs: _Frozen | None,
    params: Any,
    prng_key: Any,
    batch: Any,
    dynamic_kwargs: Any,
) -> tuple[Any, Any, _StaticOut]:
    """The traced step: AXLearn's `_jit_run_on_batch`."""
    mesh, explicit = settings.mesh, settings.explicit
    p_leaves, p_def = jax.tree.flatten(params)
    p_leaves = [
        constrain(x, named_sharding(mesh, s), explicit=explicit)
        for x, s in zip(p_leaves, settings.param_specs, strict=True)
    ]
    model = eqx.combine(p_def.unflatten(p_leaves), settings.static_model.tree())
    batch = _constrain_tree(batch, settings.input_partition, mesh, what="input")
    new_key, iter_key = jax.random.split(prng_key)
    new_key = constrain(new_key, _replicated(mesh, new_key), explicit=explicit)
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
    output_batch, ctx = check_returns_context(result, what)
    output_batch = _constrain_tree(
        output_batch, settings.output_partition, mesh, what="output_partition"
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
    return new_key, dynamic, _StaticOut(static if has_static else None)


_jit_step = jax.jit(_step, static_argnums=(0, 1))


def _step_without_kwargs(
    settings: _Settings, params: Any, prng_key: Any, batch: Any
) -> tuple[Any, Any, _StaticOut]:
    return _step(settings, None, params, prng_key, batch, None)


#: The compiled step per settings (LRU): runners re-created from equal settings
#: share one `jax.jit` and so its compilations.
_JITS: "collections.OrderedDict[_Settings, Callable[..., Any]]" = (
    collections.OrderedDict()
)
_MAX_JITS = 256


def _jit_for(settings: "_Settings") -> Callable[..., Any]:
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


def _new(cls: type[Any], fields: dict[str, Any]) -> Any:
    """Build an `eqx.Module` from its fields without `__init__`, as its unflatten does.

    The hot path's constructor: `eqx.Module.__init__` walks every leaf of its arguments
    (Python work per parameter), this costs ~0.3 µs.
    """
    self = object.__new__(cls)
    _setattr(self, "__dict__", fields)
    return self


def _available_methods(model: Any) -> list[str]:
    return sorted(
        n
        for n in dir(type(model))
        if not n.startswith("_") and callable(getattr(type(model), n, None))
    )


def _resolve_param_specs(
    param_partition: Any, params: Any, mesh: Mesh
) -> tuple[PartitionSpec, ...]:
    with_path = jax.tree_util.tree_flatten_with_path(params)[0]
    if param_partition is None:
        return tuple(_REPLICATED for _ in with_path)
    if callable(param_partition) and not isinstance(param_partition, PartitionSpec):
        specs: list[PartitionSpec] = []
        for path, leaf in with_path:
            spec = param_partition(_path_str(path), leaf)
            if not isinstance(spec, PartitionSpec):
                raise TypeError(
                    "`MethodRunner.create(param_partition=fn)`: fn must return a "
                    f"`PartitionSpec`, got {type(spec).__name__} for parameter "
                    f"{_path_str(path)!r}."
                )
            specs.append(spec)
        return tuple(specs)
    return tuple(resolve_specs(param_partition, params, mesh, what="param_partition"))


def _finish(
    fields: dict[str, Any], result: tuple[Any, Any, _StaticOut], batch: Any
) -> tuple["MethodRunner", "MethodRunner.Output"]:
    """Build the next runner and the output of one call, in O(1) Python work."""
    new_key, out, extra = result
    if extra.value is not None:
        out = eqx.combine(out, extra.value)
    runner_fields = fields.copy()
    runner_fields["prng_key"] = new_key
    output_batch, summaries, module_outputs = out
    output = _new(
        _Output,
        {
            "output_batch": output_batch,
            "input_batch": batch,
            "summaries": summaries,
            "module_outputs": module_outputs,
        },
    )
    return _new(MethodRunner, runner_fields), output


class MethodRunner(eqx.Module):
    """Runs a model method on (sharded) batches, compiled once per batch signature.

    AXLearn's `MethodRunner`, as an immutable PyTree: calling it returns a new runner
    holding the next PRNG key, so the same runner called twice on the same batch gives
    the same result. Build one with `MethodRunner.create`.

    The method runs under `jax.jit` with `eqx.filter_jit`'s semantics: array leaves
    (of the model, the batch and keyword arguments) are traced, every other leaf is
    static, and runners re-created from equal settings (equal static parts, the same
    method and mesh) share one compiled program. A call does not block: outputs are
    global arrays that may still be computing, so a loop can prepare the next batch
    while the device works.

    Attributes:
        params: the model's array leaves, in the model's structure (None where the
            model has non-array leaves), placed by `param_partition` (traced).
        prng_key: the key that the next call splits: `new_key, iter_key =
            jax.random.split(prng_key)`; `iter_key` is the root context's key and
            `new_key` the returned runner's key (replicated over the mesh).
        settings: the static part (method, mesh, partitions, the model's non-array
            part); compared by value.
    """

    params: Any
    prng_key: Any
    settings: _Settings = eqx.field(static=True)

    class Output(eqx.Module):
        """What one call of a `MethodRunner` returns (AXLearn's `MethodRunner.Output`).

        Attributes:
            output_batch: the method's output, as global arrays with the output
                partition.
            input_batch: the global input arrays actually used, with the input
                partition; pass them to another runner without a host transfer.
            summaries: the root context's summaries (nested mapping; may hold
                `IterationSummaries` and `Summary` leaves), replicated.
            module_outputs: the module outputs kept by `drop_module_outputs`
                (nested mapping), replicated.
        """

        output_batch: Any
        input_batch: Any
        summaries: dict[str, Any]
        module_outputs: dict[str, Any]

    @classmethod
    def create(
        cls,
        model: Any,
        method: Callable[..., Any] | str,
        *,
        mesh: Mesh,
        prng_key: Any,
        input_partition: Any = DataPartition.FULL,
        output_partition: Any = DataPartition.BATCH,
        param_partition: Any = None,
        drop_module_outputs: Callable[[str], bool] = lambda path: True,
        is_training: bool = False,
    ) -> "MethodRunner":
        """Return a runner of `method` on `model`, with parameters placed on `mesh`.

        Follows AXLearn's `InferenceRunner.create_method_runner`.

        Args:
            model: a PyTree (e.g. an `eqx.Module`); its array leaves are the
                parameters (traced), its other leaves are static and must be hashable.
            method: `method(model, input_batch, ctx, **kwargs) -> (output_batch,
                ctx)`, or the name of a method of `model` called as
                `getattr(model, method)(input_batch, ctx, **kwargs)`. Static.
            mesh: the device mesh (Auto or Explicit axis types; one device is fine).
            prng_key: a raw `uint32[2]` or typed key; stored replicated over `mesh`.
            input_partition: a `DataPartition`, a `PartitionSpec`, or a prefix tree
                of them over the batch. Rank-0 leaves are replicated, rank-1 leaves
                take only the first spec entry (AXLearn's `reshard_fn`).
            output_partition: the same, for the method's output.
            param_partition: a PyTree of `PartitionSpec` (a prefix of the model's
                array leaves), or a callable `(path: str, leaf) -> PartitionSpec`
                with paths like `"layers/0/weight"`; None replicates every parameter.
            drop_module_outputs: `drop(path) -> bool` with paths relative to the
                module outputs (`"input_stats/x_mean"`); the default drops all.
            is_training: the root context's training flag (static).

        Returns:
            A new `MethodRunner`.

        Raises:
            AttributeError: if `method` is a name that `model` does not have; the
                message lists the available methods.
            ValueError: for `DataPartition.BATCH` on a mesh without a `"data"` or
                `"fsdp"` axis, a `param_partition` tree that does not match the model,
                or a parameter dimension that does not divide over its mesh axes.
            TypeError: for an unhashable non-array leaf of `model`.
        """
        if isinstance(method, str) and not callable(getattr(model, method, None)):
            raise AttributeError(
                f"`MethodRunner.create(method={method!r})`: {type(model).__name__} "
                f"has no method {method!r}; available methods: "
                f"{_available_methods(model)}."
            )
        for what, part in (("input", input_partition), ("output", output_partition)):
            for leaf in jax.tree.leaves(
                part, is_leaf=lambda x: isinstance(x, (PartitionSpec, DataPartition))
            ):
                if isinstance(leaf, DataPartition):
                    # Raises early for BATCH on a mesh without data-like axes.
                    resolve_specs(leaf, 0, mesh, what=f"{what}_partition")
        params, static = eqx.partition(model, eqx.is_array)
        specs = _resolve_param_specs(param_partition, params, mesh)
        leaves, treedef = jax.tree.flatten(params)
        with_path = jax.tree_util.tree_flatten_with_path(params)[0]
        placed: list[Any] = []
        padded: list[PartitionSpec] = []
        for (path, x), spec in zip(with_path, specs, strict=True):
            check_divisible(np.shape(x), spec, mesh, path=_path_str(path))
            padded.append(normalize_spec(spec, np.ndim(x), explicit=is_explicit(mesh)))
            placed.append(jax.device_put(x, named_sharding(mesh, padded[-1])))
        del leaves
        settings = _Settings(
            method=method,
            mesh=mesh,
            input_partition=input_partition,
            output_partition=output_partition,
            param_specs=tuple(padded),
            static_model=_Frozen(static, what="the model"),
            drop_module_outputs=drop_module_outputs,
            is_training=bool(is_training),
        )
        key = jax.device_put(prng_key, _replicated(mesh, prng_key))
        return cls(treedef.unflatten(placed), key, settings)

    @property
    def model(self) -> Any:
        """The model: `params` combined with its non-array part."""
        return eqx.combine(self.params, self.settings.static_model.tree())

    @property
    def mesh(self) -> Mesh:
        """The device mesh."""
        return self.settings.mesh

    def __call__(
        self, input_batch: Any, **kwargs: Any
    ) -> tuple["MethodRunner", "MethodRunner.Output"]:
        """Run the method on one batch; return the next runner and the outputs.

        Args:
            input_batch: a PyTree of global arrays, or of host-local leaves (NumPy
                arrays, single-device arrays; in a multi-process run each process
                passes its own slice of the batch), or a mixture. Leaves are placed
                by the input partition with `jax.make_array_from_process_local_data`.
            **kwargs: keyword arguments of the method; array leaves are traced, other
                leaves are static (hashable).

        Returns:
            `(runner, output)`: a new runner holding the next key, and a
            `MethodRunner.Output` of global arrays. `self` is unchanged.

        Raises:
            ValueError: if a batch dimension does not divide over the mesh axes it is
                split over (naming the leaf, its shape and the axes), or if the input
                or output partition tree does not match the batch or the output.
            TypeError: if the method does not return `(output_batch, ctx)`.
        """
        # The hot path: read the fields once (an `eqx.Module`'s `__getattribute__`
        # is Python code that wraps methods; it costs ~0.5 µs per access).
        fields: dict[str, Any] = _getattribute(self, "__dict__")
        settings: _Settings = fields["settings"]
        # Fast path: the batch has the structure and shardings of the last one.
        leaves, treedef = _flatten(input_batch)
        last = settings.last_batch
        batch = input_batch
        if last is None or last[0] != treedef:
            batch = settings.place_batch(input_batch)
        else:
            try:
                for x, s in zip(leaves, last[1], strict=True):
                    if x.sharding != s:
                        batch = settings.place_batch(input_batch)
                        break
            except AttributeError:  # a host-local leaf: NumPy, Python scalar
                batch = settings.place_batch(input_batch)
        if kwargs:
            dynamic, static = eqx.partition(kwargs, eqx.is_array)
            static_kwargs = _Frozen(static, what="a keyword argument")
            result = _jit_step(
                settings,
                static_kwargs,
                fields["params"],
                fields["prng_key"],
                batch,
                dynamic,
            )
        else:
            result = settings.jitted(fields["params"], fields["prng_key"], batch)
        new_key, out, extra = result
        if extra.value is not None:
            out = eqx.combine(out, extra.value)
        runner_fields = fields.copy()
        runner_fields["prng_key"] = new_key
        runner = object.__new__(MethodRunner)
        _setattr(runner, "__dict__", runner_fields)
        output = object.__new__(_Output)
        _setattr(
            output,
            "__dict__",
            {
                "output_batch": out[0],
                "input_batch": batch,
                "summaries": out[1],
                "module_outputs": out[2],
            },
        )
        return runner, output

    def lower(self, batch_spec: Any, **kwargs: Any) -> "LoweredRunner":
        """Lower the step for batches like `batch_spec`, ahead of time.

        Args:
            batch_spec: a PyTree of `jax.ShapeDtypeStruct` (with or without
                shardings; without, the input partition's) or of arrays.
            **kwargs: the method's keyword arguments (as for a call).

        Returns:
            A `LoweredRunner` with `.as_text()` and `.compile()`.
        """
        settings = self.settings
        specs = resolve_specs(
            settings.input_partition, batch_spec, settings.mesh, what="input_partition"
        )
        leaves, treedef = jax.tree.flatten(batch_spec)
        with_path = jax.tree_util.tree_flatten_with_path(batch_spec)[0]
        structs: list[jax.ShapeDtypeStruct] = []
        for (path, x), spec in zip(with_path, specs, strict=True):
            shape = tuple(np.shape(x))
            sharding = getattr(x, "sharding", None)
            if not isinstance(sharding, NamedSharding):
                s = leaf_spec(spec, len(shape), explicit=settings.explicit)
                check_divisible(shape, s, settings.mesh, path=_path_str(path))
                sharding = named_sharding(settings.mesh, s)
            structs.append(
                jax.ShapeDtypeStruct(shape, np.result_type(x), sharding=sharding)
            )
        del leaves
        if kwargs:
            dynamic, static = eqx.partition(kwargs, eqx.is_array)
            static_kwargs = _Frozen(static, what="a keyword argument")
        else:
            dynamic = static_kwargs = None
        lowered = _jit_step.lower(
            settings,
            static_kwargs,
            self.params,
            self.prng_key,
            treedef.unflatten(structs),
            dynamic,
        )
        return LoweredRunner(self, lowered, static_kwargs)


_Output = MethodRunner.Output


class LoweredRunner:
    """A runner step lowered ahead of time by `MethodRunner.lower`."""

    def __init__(self, runner: MethodRunner, lowered: Any, static_kwargs: Any):
        self._runner = runner
        self._lowered = lowered
        self._static_kwargs = static_kwargs

    def as_text(self) -> str:
        """Return the lowered program (StableHLO) as text."""
        return self._lowered.as_text()

    def compile(self) -> "CompiledRunner":
        """Compile the lowered program; the result is called like the runner."""
        return CompiledRunner(
            self._runner, self._lowered.compile(), self._static_kwargs
        )


class CompiledRunner:
    """A compiled runner step: `compiled(batch, **kwargs) -> (runner, output)`.

    Runs the program compiled by `MethodRunner.lower(...).compile()` with the key of
    the runner it was lowered from; returns that runner's successor and the output,
    exactly like calling the runner.
    """

    def __init__(self, runner: MethodRunner, compiled: Any, static_kwargs: Any):
        self._runner = runner
        self._compiled = compiled
        self._static_kwargs = static_kwargs

    def as_text(self) -> str:
        """Return the compiled (optimized HLO) program as text."""
        return self._compiled.as_text()

    def __call__(
        self, input_batch: Any, **kwargs: Any
    ) -> tuple[MethodRunner, MethodRunner.Output]:
        """Run the compiled step; see `MethodRunner.__call__`.

        Raises:
            ValueError: if the static keyword arguments differ from the lowered ones.
        """
        runner = self._runner
        batch = runner.settings.place_batch(input_batch)
        dynamic, static = eqx.partition(kwargs, eqx.is_array) if kwargs else (None, {})
        static_kwargs = _Frozen(static, what="a keyword argument") if kwargs else None
        if static_kwargs != self._static_kwargs:
            raise ValueError(
                "`CompiledRunner`: the non-array keyword arguments differ from those "
                "given to `MethodRunner.lower`; lower again for new static arguments."
            )
        result = self._compiled(runner.params, runner.prng_key, batch, dynamic)
        return _finish(_getattribute(runner, "__dict__"), result, batch)

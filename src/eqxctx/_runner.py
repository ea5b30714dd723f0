"""MethodRunner: run a model method on sharded batches, compiled once per signature.

Follows AXLearn's `MethodRunner` and `InferenceRunner.create_method_runner`
(`axlearn/common/inference.py`): a jitted step over `(prng_key, input_batch)` that
returns `(new_key, outputs, summaries, module_outputs)`, with inputs, outputs and
parameters under sharding constraints.

Why the hot path looks the way it does (measured in `benchmarks/bench_runner.py`):
`eqx.filter_jit` partitions every argument into arrays and the rest on every call
(Python work per leaf; 2-3x the time of `jax.jit` on a small model) and blocks on a
marker output after every call. The runner keeps filter_jit's semantics (array leaves
traced, every other leaf static, equal static parts share a compilation) but partitions
the model once, in `MethodRunner.create`, flattens its array part into a tuple
(`param_leaves`) and calls a `jax.jit` of the step closed over its hashable settings
(`_step.Settings`, which also hold the parameters' structure), shared by equal settings.
A warm call costs JAX's own C++ dispatch plus a constant amount of Python work, and
never blocks. JAX flattens a tuple of parameters in C++, ~1.7 µs faster than an
`eqx.Module` (one Python callback per Module node), which pays for the Python work
(~2.5 µs on one CPU core: ~0.8 µs to check that the batch has the last batch's
structure, leaf types and shardings — a plain dict by its keys, without flattening it
— read and compared in C with `map` and list equality, and to copy its containers;
~0.8 µs to build the next runner and the output without `eqx.Module.__init__`; the rest
is the method call itself). Measured:
1.02-1.08x of a bare `jax.jit` call over the model at 10 and 100 parameter leaves.
The alternative, `eqx.filter_jit(...).lower(...).compile()` cached per input signature,
needs the signature (shapes, dtypes, shardings of every leaf) computed in Python on
each call, which grows with the leaf count.

Why the batch check stays in Python: handing it to JAX (`jax.jit(...,
in_shardings=...)` per batch structure, falling back to `place_batch` when JAX raises
for a leaf with another sharding) was measured and rejected. `in_shardings` itself
adds ~0.8 µs to JAX's C++ dispatch (jax 0.10.2, 10 parameter leaves), nearly all that
the Python check costs; JAX places NumPy leaves itself without handing back the
placed arrays, so `Output.input_batch` could no longer hold the global arrays actually
used (outputs that are inputs are copied, not forwarded); the specs depend on each
leaf's rank (the rank rule), not just the batch structure; and in a multi-process run
a process-local NumPy leaf must go through `jax.make_array_from_process_local_data`,
never be taken by `jit` as the global value.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from ._aot import LoweredRunner, lower_runner
from ._partition import (
    DataPartition,
    check_divisible,
    is_explicit,
    named_sharding,
    normalize_spec,
    path_str,
    resolve_param_specs,
    resolve_specs,
)
from ._step import Frozen, Settings, jit_step, replicated


# Bound once: the hot path calls them on every runner call.
_setattr = object.__setattr__
_getattribute = object.__getattribute__
_flatten = jax.tree_util.default_registry.flatten
_new = object.__new__


def _available_methods(model: Any) -> list[str]:
    names = {
        n
        for n in dir(type(model))
        if not n.startswith("_") and callable(getattr(type(model), n, None))
    }
    if callable(model):
        names.add("__call__")
    return sorted(names)


def _check_method(model: Any, method: object) -> None:
    """Raise for a method of `model` bound to it (`model.predict`)."""
    owner = getattr(method, "__self__", None)
    func = getattr(method, "__func__", None)
    if owner is None or func is None or isinstance(owner, type):
        return
    if owner is model or isinstance(owner, eqx.Module):
        name = getattr(func, "__name__", "method")
        raise TypeError(
            f"`MethodRunner.create(method=...)`: got the bound method "
            f"{type(owner).__name__}.{name} (e.g. `model.{name}`); it holds the "
            "model's arrays and cannot be static. Pass the name, "
            f"`method={name!r}`, or the unbound function, "
            f"`method=type(model).{name}`."
        )


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
        param_leaves: the model's array leaves, flattened once in `create` and placed
            by `param_partition` (traced). `runner.params` gives them in the model's
            structure, `runner.model` the whole model. Calls do not place them again:
            for other parameters, create another runner.
        prng_key: the key that the next call splits: `new_key, iter_key =
            jax.random.split(prng_key)`; `iter_key` is the root context's key and
            `new_key` the returned runner's key (replicated over the mesh).
        settings: the static part (method, mesh, partitions, the model's non-array
            part); compared by value.
    """

    param_leaves: tuple[Any, ...]
    prng_key: Any
    settings: Settings = eqx.field(static=True)

    class Output(eqx.Module):
        """What one call of a `MethodRunner` returns (AXLearn's `MethodRunner.Output`).

        Attributes:
            output_batch: the method's output, as global arrays with the output
                partition.
            input_batch: the global input arrays actually used, with the input
                partition, in new containers (already-placed arrays are passed
                through); pass them to another runner without a host transfer.
            summaries: the root context's summaries (nested mapping; may hold
                `IterationSummaries` and `Summary` leaves), replicated.
            module_outputs: the module outputs kept by `drop_module_outputs`
                (nested mapping), replicated.
        """

        output_batch: Any
        input_batch: Any
        summaries: dict[str, Any]
        module_outputs: dict[str, Any]

        if not TYPE_CHECKING:
            # Plain attribute access: an `Output` has no methods for `eqx.Module`'s
            # `__getattribute__` to wrap, and reading its fields is the hot path of
            # every loop over batches (~0.5 µs saved per read).
            __getattribute__ = object.__getattribute__

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
                array leaves; e.g. `jax.tree.map(lambda _: P(), model)` — the tree
                form even when it is callable, like an `eqx.Module` with
                `__call__`), or a callable with no `PartitionSpec` leaves (a
                function) `(path: str, leaf) -> PartitionSpec` with paths like
                `"layers/0/weight"`; None replicates every parameter. Trailing None
                entries beyond a parameter's rank are dropped.
            drop_module_outputs: `drop(path) -> bool` with paths relative to the
                module outputs (`"input_stats/x_mean"`); the default drops all.
            is_training: the root context's training flag (static).

        Static callables (`method`, `drop_module_outputs`) compare by identity:
        define them once (e.g. at module level), not as a new lambda per `create`,
        so that re-created runners share their compilations.

        Returns:
            A new `MethodRunner`.

        Raises:
            AttributeError: if `method` is a name that `model` does not have; the
                message lists the available methods.
            ValueError: for `DataPartition.BATCH` on a mesh without a `"data"` or
                `"fsdp"` axis, a `param_partition` tree that does not match the model,
                a spec naming a mesh axis the mesh does not have (naming the
                argument, the leaf and the mesh axes), or a parameter dimension that
                does not divide over its mesh axes.
            TypeError: for an unhashable non-array leaf of `model`, a bound method
                of the model as `method` (pass its name or `type(model).method`), or
                `prng_key=None`.
        """
        if prng_key is None:
            raise TypeError(
                "`MethodRunner.create(prng_key=None)`: the runner needs a key to "
                "split on every call; pass e.g. `prng_key=jax.random.key(0)`."
            )
        _check_method(model, method)
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
        specs = resolve_param_specs(param_partition, params, mesh)
        leaves, treedef = jax.tree.flatten(params)
        with_path = jax.tree_util.tree_flatten_with_path(params)[0]
        placed: list[Any] = []
        padded: list[PartitionSpec] = []
        for (path, x), spec in zip(with_path, specs, strict=True):
            name = path_str(path)
            check_divisible(np.shape(x), spec, mesh, path=name, what="parameter")
            padded.append(
                normalize_spec(spec, np.ndim(x), explicit=is_explicit(mesh), path=name)
            )
            placed.append(jax.device_put(x, named_sharding(mesh, padded[-1])))
        del leaves
        settings = Settings(
            method=method,
            mesh=mesh,
            input_partition=input_partition,
            output_partition=output_partition,
            param_specs=tuple(padded),
            static_model=Frozen(static, what="the model"),
            drop_module_outputs=drop_module_outputs,
            is_training=bool(is_training),
            param_treedef=treedef,
        )
        key = jax.device_put(prng_key, replicated(mesh, prng_key))
        return cls(tuple(placed), key, settings)

    @property
    def params(self) -> Any:
        """The model's array leaves in the model's structure (None elsewhere)."""
        return self.settings.param_treedef.unflatten(self.param_leaves)

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
            ValueError: if a batch or output dimension does not divide over the
                mesh axes it is split over (naming the leaf, its shape and the axes;
                outputs are checked when the step is traced), if the input or output
                partition tree does not match the batch or the output, or if a spec
                names an unknown mesh axis or has non-None entries beyond a leaf's
                rank.
            TypeError: if the method does not return `(output_batch, ctx)` (a
                method returning `(ctx, output)` is told to swap them), or a batch
                leaf is not an array (a `jax.ShapeDtypeStruct`: use `lower`; an
                object that is not a registered PyTree), naming the leaf.
        """
        # The hot path: read the fields once (an `eqx.Module`'s `__getattribute__`
        # is Python code that wraps methods; it costs ~0.5 µs per access).
        fields: dict[str, Any] = _getattribute(self, "__dict__")
        settings: Settings = fields["settings"]
        # Fast path: the batch has the structure, leaf types and shardings of the
        # last one (`_step.BatchEntry`), read and compared in C (`map`, list
        # equality, which tries identity first); a leaf without `.sharding` (NumPy, a
        # Python scalar) raises AttributeError and goes through `place_batch`. A
        # plain dict of arrays with the last batch's keys is not even flattened
        # (~0.4 µs saved). The containers are copied: `Output.input_batch` never
        # aliases the caller's dict.
        last = settings.last_batch
        batch = flat = None
        if last is not None:
            last_treedef, signature, expected, keys = last
            try:
                if keys is not None and type(input_batch) is dict:
                    if len(input_batch) == len(keys) and (
                        list(map(signature, map(input_batch.__getitem__, keys)))
                        == expected
                    ):
                        batch = input_batch.copy()
                else:
                    flat = leaves, treedef = _flatten(input_batch)
                    if treedef == last_treedef and (
                        list(map(signature, leaves)) == expected
                    ):
                        batch = treedef.unflatten(leaves)
            except (AttributeError, KeyError):
                pass
        if batch is None:
            batch = settings.place_batch(input_batch, flat)
        if kwargs:
            dynamic, static = eqx.partition(kwargs, eqx.is_array)
            static_kwargs = Frozen(static, what="a keyword argument")
            dynamic = settings.place_kwargs(dynamic)
            result = jit_step(
                settings,
                static_kwargs,
                fields["param_leaves"],
                fields["prng_key"],
                batch,
                dynamic,
            )
        else:
            result = settings.jitted(fields["param_leaves"], fields["prng_key"], batch)
        new_key, out, extra = result
        if extra is not None:
            out = eqx.combine(out, extra.value)
        output_batch, summaries, module_outputs = out
        runner_fields = fields.copy()
        runner_fields["prng_key"] = new_key
        runner = _new(MethodRunner)
        _setattr(runner, "__dict__", runner_fields)
        output = _new(_Output)
        _setattr(
            output,
            "__dict__",
            {
                "output_batch": output_batch,
                "input_batch": batch,
                "summaries": summaries,
                "module_outputs": module_outputs,
            },
        )
        return runner, output

    def lower(self, batch_spec: Any, **kwargs: Any) -> LoweredRunner:
        """Lower the step for batches like `batch_spec`, ahead of time.

        Args:
            batch_spec: a PyTree of `jax.ShapeDtypeStruct` (with or without
                shardings; without, the input partition's) or of arrays.
            **kwargs: the method's keyword arguments (as for a call).

        Returns:
            A `LoweredRunner` with `.as_text()` and `.compile()`. The compiled
            runner places each batch leaf with the sharding it was lowered for, so
            its `input_batch` has those shardings.

        Raises:
            ValueError: if a batch dimension does not divide over the mesh axes it
                is split over, or the input partition tree does not match
                `batch_spec` (naming the leaf, its shape and the axes).
        """
        return lower_runner(self, batch_spec, **kwargs)


_Output = MethodRunner.Output

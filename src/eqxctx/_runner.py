"""MethodRunner: run a model method on sharded batches, compiled once per signature.

Follows AXLearn's `MethodRunner` and `InferenceRunner.create_method_runner`
(`axlearn/common/inference.py`): a jitted step over `(prng_key, input_batch)` that
returns `(new_key, outputs, summaries, module_outputs)`, with inputs, outputs and
parameters under sharding constraints.

`eqx.filter_jit`'s semantics without its per-call partitioning: `create` partitions
the model once into parameter leaves and a hashable `Settings`, and a call is
`Step.call` (`_step.py`) plus the next runner's constructor.
"""

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, cast

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import PyTree

from ._aot import LoweredRunner, lower_runner
from ._checks import (
    check_callable,
    check_is_training,
    check_prng_key,
    check_summary_level,
)
from ._context import Context
from ._frozen import Frozen, TreeEquality, refuse_assignment
from ._partition import (
    DataPartition,
    leaf_shardings,
    path_str,
    resolve_param_specs,
    resolve_specs,
)
from ._step import Step
from ._traced import Settings
from ._transfer import place, replicated
from ._typing import (
    Batch,
    Model,
    ModelT,
    OutputT,
    Params,
    PartitionTree,
    PathPredicate,
    PRNGKeyArray,
    SummaryTree,
    Tree,
)


#: `MethodRunner.Output`'s own type variable (`OutputT` is `MethodRunner`'s).
OutputBatchT = TypeVar("OutputBatchT")
#: `MethodRunner.create`'s own: a class's type variables are not solved from the
#: arguments of its class methods.
NewModelT = TypeVar("NewModelT")
NewOutputT = TypeVar("NewOutputT")


def _available_methods(model: Model) -> list[str]:
    cls = type(model)
    names = {n for n in dir(cls) if n[0] != "_" and callable(getattr(cls, n, None))}
    return sorted(names | ({"__call__"} if callable(model) else set()))


def _check_method(model: Model, method: object) -> None:
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


# Not an `eqx.Module`: its field reads and rebuilds cost a few % of every call.
@jax.tree_util.register_dataclass
@refuse_assignment
@dataclasses.dataclass(frozen=True, slots=True, repr=False, eq=False)
class MethodRunner(TreeEquality, Generic[ModelT, OutputT]):
    """Runs a model method on (sharded) batches, compiled once per batch signature.

    AXLearn's `MethodRunner`, as an immutable PyTree: calling it returns a new runner
    holding the next PRNG key, so the same runner called twice on the same batch gives
    the same result. Build one with `MethodRunner.create`.

    A frozen dataclass registered as a PyTree (`param_leaves` and `prng_key` are
    its children, `step` its static part; `dataclasses.replace(runner,
    prng_key=...)` changes the key); runners compare like `eqx.Module`s. A
    subclass may add methods but not fields.

    The method runs under `jax.jit` with `eqx.filter_jit`'s semantics: array leaves
    (of the model, the batch and keyword arguments) are traced, the rest static,
    and runners re-created from equal settings share one compiled program. A call
    does not block; on the CPU, JAX may read a NumPy argument in place after the
    call returns (as `jax.jit` does): wait for the outputs
    (`jax.block_until_ready`) before refilling its buffer.

    For static type checkers a runner is a `MethodRunner[ModelT, OutputT]`: `model`
    has the model's type and `Output.output_batch` the method's output type (`Any`
    for a method given by name).

    Attributes:
        param_leaves: the model's array leaves, flattened once in `create` and placed
            by `param_partition` (traced; always with the sharding the step is
            compiled for, sharing the buffers of a leaf already placed
            equivalently). `runner.params` gives them in the model's
            structure, `runner.model` the whole model. Calls do not place them again:
            for other parameters, create another runner.
        prng_key: the key that the next call splits: `new_key, iter_key =
            jax.random.split(prng_key)`; `iter_key` is the root context's key and
            `new_key` the returned runner's key (replicated over the mesh).
        step: the static part: the `Settings` (method, mesh, partitions, the model's
            non-array part, padding, donation; compared by value) and the compiled
            step's caches, shared by runners of equal settings.
    """

    param_leaves: tuple[jax.Array, ...]
    prng_key: PRNGKeyArray
    step: Step = dataclasses.field(metadata={"static": True})

    @jax.tree_util.register_dataclass
    @refuse_assignment
    @dataclasses.dataclass(frozen=True, slots=True)
    class Output(Generic[OutputBatchT]):
        """What one call of a `MethodRunner` returns (AXLearn's `MethodRunner.Output`).

        A frozen dataclass registered as a PyTree (its four fields are children).

        Attributes:
            output_batch: the method's output, as global arrays with the output
                partition. With padding, leaves whose leading size is the padded
                batch size are cut to the real rows (and replicated).
            input_batch: the global input arrays used, with the input partition,
                in new containers (arrays already placed equivalently pass through);
                pass them to another runner without a host transfer. With padding,
                cut to the real rows. None with `donate_batch=True`.
            summaries: the root context's summaries (nested mapping; may hold
                `IterationSummaries` and `Summary` leaves), replicated.
            module_outputs: the module outputs kept by `drop_module_outputs`
                (nested mapping), replicated; not cut by padding.
        """

        output_batch: OutputBatchT
        input_batch: Batch
        summaries: SummaryTree
        module_outputs: Tree

    @classmethod
    def create(
        cls,
        model: NewModelT,
        method: Callable[..., tuple[NewOutputT, Context]] | str,
        *,
        mesh: Mesh,
        prng_key: object,
        input_partition: PartitionTree = DataPartition.FULL,
        output_partition: PartitionTree = DataPartition.BATCH,
        param_partition: PartitionTree = None,
        drop_module_outputs: PathPredicate = lambda path: True,
        is_training: bool | np.bool_ = False,
        pad_batches: bool = False,
        batch_sizes: Sequence[int] | None = None,
        mask_kwarg: str | None = None,
        donate_batch: bool = False,
        summary_level: int | None = None,
    ) -> "MethodRunner[NewModelT, NewOutputT]":
        """Return a runner of `method` on `model`, with parameters placed on `mesh`.

        Follows AXLearn's `InferenceRunner.create_method_runner`.

        Args:
            model: a PyTree (e.g. an `eqx.Module`); its array leaves are the
                parameters (traced), its other leaves are static and must be hashable.
            method: `method(model, input_batch, ctx, **kwargs) -> (output_batch,
                ctx)`, or the name of a method of `model` called as
                `getattr(model, method)(input_batch, ctx, **kwargs)`. Static.
            mesh: the device mesh (Auto or Explicit axis types; one device is fine).
                Called under another context mesh (`jax.set_mesh(other)`), the
                method is traced, lowered and run with this one as the context
                mesh, as AXLearn's runner runs under its mesh; with no context mesh
                set, under none, as `jax.jit` (set this mesh with `jax.set_mesh`
                for a method that uses a bare `PartitionSpec`).
            prng_key: a raw `uint32[2]` or typed key (uncommitted, on one device or
                on the mesh); stored replicated over `mesh` with the sharding the
                step returns its next key with, so the first call compiles once.
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
            pad_batches: pad the leading (batch) axis of every batch leaf of rank
                >= 1 with zero rows up to the next multiple of the number of shards
                it is split into (the data-parallel device count), or with
                `batch_sizes` up to the smallest listed size >= the batch; the
                outputs come back cut to the real rows. A batch that needs no padding
                is not changed. Each padded size compiles once. Typed PRNG key
                leaves are padded with keys of all-zero key data. Every context
                holds the real rows' mask, `ctx.row_mask` (`bool[padded_batch]`,
                split like the batch axis), for summaries to count only those rows
                (`MomentsSummary(x, where=ctx.row_where(x))`); a method that adds
                summaries but never reads it (and has no `mask_kwarg`) gets a
                `UserWarning`, once per runner settings.
            batch_sizes: the padded sizes (e.g. `(64, 256, 1024)`), each a multiple
                of the batch axis' shard count; needs `pad_batches=True`.
            mask_kwarg: if given, the method is also called with
                `**{mask_kwarg: mask}`: `ctx.row_mask`, True for real rows (all True
                for a batch that needs no padding). Every batch needs a leaf of
                rank >= 1.
            donate_batch: donate the placed batch's buffers to the step (JAX's
                `donate_argnums`): XLA may reuse them for outputs of the same shape
                and dtype, and donated arrays (also a placed batch passed through)
                are deleted after the call; `Output.input_batch` is then None. A
                call passing a batch array again (as a batch leaf, keyword argument
                or parameter), or a deleted one, raises `ValueError`.
            summary_level: the root context's summary level (static, part of the
                compilation key): summaries and module outputs added with `level >
                summary_level` are dropped, and XLA removes their computation; None
                (the default) keeps everything. Two runners of one model with
                different levels (a cheap one every step, a full one every N steps)
                compile once each.

        Static callables (`method`, `drop_module_outputs`) compare by identity:
        define them once, not as a new lambda per `create`, to share compilations.

        Returns:
            A new `MethodRunner`.

        Raises:
            AttributeError: if `method` is a name that `model` does not have; the
                message lists the available methods.
            ValueError: for `DataPartition.BATCH` on a mesh without a `"data"` or
                `"fsdp"` axis, a `param_partition` tree that does not match the model,
                a spec naming a mesh axis the mesh does not have (naming the
                argument, the leaf and the mesh axes), a parameter dimension that
                does not divide over its mesh axes, `batch_sizes` that are not
                positive integers or given without `pad_batches=True`, or a
                `mask_kwarg` that is not an identifier.
            TypeError: for an unhashable non-array leaf of `model`, a bound method
                of the model as `method` (pass its name or `type(model).method`), a
                `method` that is neither callable nor a string, a `mesh` that is not
                a `jax.sharding.Mesh`, a non-callable `drop_module_outputs`, an
                `is_training` that is not a bool, a `summary_level` that is neither
                None nor an int, or a `prng_key` that is None or not a key.
        """
        where = "MethodRunner.create"
        if prng_key is None:
            raise TypeError(
                "`MethodRunner.create(prng_key=None)`: the runner needs a key to "
                "split on every call; pass e.g. `prng_key=jax.random.key(0)`."
            )
        check_prng_key(prng_key, where)
        if not isinstance(mesh, Mesh):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(
                f"`{where}(mesh=...)`: mesh must be a `jax.sharding.Mesh` (e.g. "
                "`jax.make_mesh((jax.device_count(),), ('data',))`; one device is "
                f"fine), got {type(mesh).__name__} {mesh!r}."
            )
        if not isinstance(method, str):
            check_callable(
                method,
                where,
                "method",
                "a function `method(model, batch, ctx)` or "
                "the name of a method of the model",
            )
        check_callable(
            drop_module_outputs,
            where,
            "drop_module_outputs",
            "a callable `drop(path) -> bool`",
        )
        is_training = check_is_training(is_training, where)
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
        sizes = _check_padding(pad_batches, batch_sizes, mask_kwarg)
        level = check_summary_level(summary_level, "MethodRunner.create")
        params, static = eqx.partition(model, eqx.is_array)
        specs = resolve_param_specs(param_partition, params, mesh)
        leaves, treedef = jax.tree.flatten(params)
        with_path = jax.tree_util.tree_flatten_with_path(params)[0]
        shardings = leaf_shardings(
            specs, with_path, mesh, kind="parameter", rank_rule=False
        )
        placed = place(
            leaves,
            shardings,
            paths=lambda: [path_str(p) for p, _ in with_path],
            process_local=False,
            exact=True,
        )
        settings = Settings(
            method=method,
            mesh=mesh,
            input_partition=Frozen(input_partition, what="input_partition"),
            output_partition=Frozen(output_partition, what="output_partition"),
            param_specs=tuple(s.spec for s in shardings),
            static_model=Frozen(static, what="the model"),
            drop_module_outputs=drop_module_outputs,
            is_training=bool(is_training),
            param_treedef=treedef,
            pad_batches=bool(pad_batches),
            batch_sizes=sizes,
            mask_kwarg=mask_kwarg,
            donate_batch=bool(donate_batch),
            summary_level=level,
        )
        (key,) = place(
            [prng_key],
            [replicated(mesh, prng_key)],
            paths=lambda: ["prng_key"],
            process_local=False,
            exact=True,
        )
        runner = cls(tuple(placed), key, Step.of(settings, cls.Output))
        return cast("MethodRunner[NewModelT, NewOutputT]", runner)

    @property
    def settings(self) -> Settings:
        """The runner's static configuration (compared by value)."""
        return self.step.settings

    @property
    def params(self) -> Params:
        """The model's array leaves in the model's structure (None elsewhere)."""
        return self.settings.param_treedef.unflatten(self.param_leaves)

    @property
    def model(self) -> ModelT:
        """The model: `params` combined with its non-array part."""
        return eqx.combine(self.params, self.settings.static_model.tree())

    @property
    def mesh(self) -> Mesh:
        """The device mesh."""
        return self.settings.mesh

    @property
    def trace_count(self) -> int:
        """How many times JAX has traced this runner's step (an `int`).

        Shared by runners of equal settings and their successors: a new batch
        signature (structure, shapes, dtypes, shardings, static keyword arguments)
        traces once, `lower` once, a warm call never. Assert "no recompiles":

            before = runner.trace_count
            for batch in batches:
                runner, out = runner(batch)
            assert runner.trace_count == before  # batches of one signature

        A sharding that is equivalent but not equal to a seen one compiles again
        without tracing (JAX caches by sharding).
        """
        return self.step.traces

    def __call__(
        self, input_batch: Batch, **kwargs: PyTree
    ) -> tuple["MethodRunner[ModelT, OutputT]", "MethodRunner.Output[OutputT]"]:
        """Run the method on one batch; return the next runner and the outputs.

        Args:
            input_batch: a PyTree of global arrays, or of host-local leaves (NumPy
                arrays, single-device arrays; in a multi-process run each process
                passes its own slice of the batch), or a mixture. Leaves are placed
                by the input partition with `jax.make_array_from_process_local_data`;
                global arrays whose sharding is equivalent to it pass as they are.
            **kwargs: keyword arguments of the method; array leaves are traced, other
                leaves are static (hashable).

        Returns:
            `(runner, output)`: a new runner holding the next key, and a
            `MethodRunner.Output` of global arrays. `self` is unchanged.

        Raises:
            ValueError: if a batch or output dimension does not divide over the
                mesh axes it is split over (naming the leaf, its shape and the axes;
                outputs are checked when the step is traced), if the input or output
                partition tree does not match the batch or the output, if a spec
                names an unknown mesh axis or has non-None entries beyond a leaf's
                rank, or, with padding or a mask, if the leaves' leading sizes
                differ, the batch is larger than the largest of `batch_sizes`, or
                no leaf has rank >= 1; on an Explicit mesh inside a traced function
                closing over the runner with no context mesh, for a traced batch
                leaf not placed on the mesh (naming it and the ways out).
            TypeError: if the method does not return `(output_batch, ctx)` (a
                method returning `(ctx, output)` is told to swap them), or a batch
                leaf is not an array (a `jax.ShapeDtypeStruct`: use `lower`; an
                object that is not a registered PyTree), naming the leaf.
        """
        step = self.step
        params = self.param_leaves
        new_key, output = step.call(params, self.prng_key, input_batch, kwargs)
        return type(self)(params, new_key, step), output

    def __repr__(self) -> str:
        return eqx.tree_pformat(self)

    def __init_subclass__(cls) -> None:
        # No zero-argument `super()` in a slots dataclass (the class is rebuilt).
        if inspect.get_annotations(cls):
            raise TypeError(
                f"`{cls.__name__}(MethodRunner)`: a subclass of `MethodRunner` may add "
                "methods, not fields (its runners are rebuilt from `param_leaves`, "
                "`prng_key` and `step` on every call)."
            )
        jax.tree_util.register_dataclass(
            cls, data_fields=["param_leaves", "prng_key"], meta_fields=["step"]
        )

    def lower(
        self, batch_spec: Batch, **kwargs: PyTree
    ) -> "LoweredRunner[MethodRunner[ModelT, OutputT], MethodRunner.Output[OutputT]]":
        """Lower the step for batches like `batch_spec`, ahead of time.

        Args:
            batch_spec: a PyTree of `jax.ShapeDtypeStruct` (with or without
                shardings; without, the input partition's) or of arrays. With
                `pad_batches=True`, its leading size is the padded size the compiled
                runner pads smaller batches to (it must divide over the batch
                axis' shards).
            **kwargs: the method's keyword arguments (as for a call; an array
                one may be given as a `jax.ShapeDtypeStruct`). The compiled runner
                is called with the same names: array values may change, the other
                values are static.

        Returns:
            A `LoweredRunner` with `.as_text()` and `.compile()`. The compiled
            runner places each batch leaf with the sharding it was lowered for, so
            its `input_batch` has those shardings.

        Raises:
            ValueError: if a batch dimension does not divide over the mesh axes it
                is split over, or the input partition tree does not match
                `batch_spec` (naming the leaf, its shape and the axes); with
                `pad_batches=True`, a leading size that does not divide over the
                batch axis' shards names the padded size to lower for.
        """
        return lower_runner(self, batch_spec, **kwargs)


def _check_padding(
    pad_batches: bool, batch_sizes: Sequence[Any] | None, mask_kwarg: object
) -> tuple[int, ...] | None:
    """Return `batch_sizes` sorted, or raise for bad padding arguments."""
    if mask_kwarg is not None and not (
        isinstance(mask_kwarg, str) and mask_kwarg.isidentifier()
    ):
        raise ValueError(
            f"`MethodRunner.create(mask_kwarg={mask_kwarg!r})`: pass the name of a "
            "keyword argument of the method (an identifier), e.g. `'mask'`."
        )
    if batch_sizes is None:
        return None
    sizes: tuple[Any, ...] = tuple(batch_sizes)
    if not sizes or not all(
        isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes
    ):
        raise ValueError(
            f"`MethodRunner.create(batch_sizes={batch_sizes!r})`: pass a non-empty "
            "sequence of positive integers, e.g. `(64, 256, 1024)`."
        )
    if not pad_batches:
        raise ValueError(
            f"`MethodRunner.create(batch_sizes={batch_sizes!r})`: batch sizes are "
            "the sizes batches are padded to; pass `pad_batches=True` too."
        )
    return tuple(sorted(set(sizes)))

"""Ahead-of-time lowering of a `MethodRunner` step: `LoweredRunner`, `CompiledRunner`.

Follows JAX's ahead-of-time API (`jax.jit(f).lower(...).compile()`, "Ahead-of-time
lowering and compilation" in the JAX docs), applied to the runner's jitted step
(`Step.jitted`): `MethodRunner.lower(batch_spec)` returns a `LoweredRunner`, whose
`compile()` returns a `CompiledRunner` called like the runner.
"""

from typing import Any, Generic, Protocol, TypeVar, cast, runtime_checkable

import jax
import numpy as np
from jax.sharding import NamedSharding, Sharding
from jaxtyping import PyTree

from ._donation import check_donated
from ._frozen import Frozen
from ._meshes import in_mesh
from ._partition import leaf_shardings, path_str, resolve_specs
from ._plan import BatchPlan, batch_rows, make_plan
from ._step import Step
from ._transfer import place
from ._typing import ArrayLeaf, Batch, PRNGKeyArray


@runtime_checkable
class Runner(Protocol):
    """What lowering reads of a `MethodRunner` (whose `lower` calls this module)."""

    def __init__(
        self, param_leaves: tuple[jax.Array, ...], prng_key: PRNGKeyArray, step: Step
    ) -> None: ...
    @property
    def param_leaves(self) -> tuple[jax.Array, ...]: ...
    @property
    def prng_key(self) -> PRNGKeyArray: ...
    @property
    def step(self) -> Step: ...


#: The `MethodRunner` (type) a lowered or compiled step is bound to.
RunnerT = TypeVar("RunnerT", bound=Runner)
#: What a call of the compiled step returns beside the runner (`MethodRunner.Output`).
OutT = TypeVar("OutT")


def _signature(
    runner: Runner,
) -> list[tuple[tuple[int, ...], Any, Sharding]]:
    leaves = [*runner.param_leaves, runner.prng_key]
    return [(np.shape(x), jax.typeof(x).dtype, x.sharding) for x in leaves]


def _dtype(x: ArrayLeaf) -> Any:
    """The dtype of an array, `ShapeDtypeStruct` or Python scalar."""
    dtype = getattr(x, "dtype", None)
    return np.result_type(x) if dtype is None else dtype


def lower_runner(
    runner: RunnerT, batch_spec: Batch, **kwargs: PyTree
) -> "LoweredRunner[RunnerT, Any]":
    """Lower `runner`'s step for batches like `batch_spec`; see `MethodRunner.lower`.

    The batch goes through the call's placement rule (`leaf_shardings`, a leaf's own
    `NamedSharding` first) into a `BatchPlan` that the compiled runner places with.
    Under another context mesh, the step is lowered under the runner's, as a call
    runs it (`Step.call`).
    """
    with in_mesh(runner.step.mesh):
        return _lower(runner, batch_spec, kwargs)


def _lower(
    runner: RunnerT,
    batch_spec: Batch,
    kwargs: dict[str, PyTree],
) -> "LoweredRunner[RunnerT, Any]":
    step = runner.step
    mesh = step.mesh
    with_path, treedef = jax.tree_util.tree_flatten_with_path(batch_spec)
    leaves = [x for _, x in with_path]
    specs = resolve_specs(
        step.input_partition, batch_spec, mesh, what="input_partition"
    )
    shardings: list[Sharding | None] = [getattr(x, "sharding", None) for x in leaves]
    todo = [i for i, s in enumerate(shardings) if not isinstance(s, NamedSharding)]
    settings = step.settings

    def computed_shardings(check: bool) -> list[NamedSharding]:
        return leaf_shardings(
            [specs[i] for i in todo],
            [with_path[i] for i in todo],
            mesh,
            kind="batch",
            check=check,
        )

    # With padding, rows that do not divide get their own message (below) first.
    computed = computed_shardings(check=not settings.pad_batches)
    for i, s in zip(todo, computed, strict=True):
        shardings[i] = s
    named = cast("list[NamedSharding]", shardings)  # every entry is one now
    structs = [
        jax.ShapeDtypeStruct(tuple(np.shape(x)), _dtype(x), sharding=s)
        for x, s in zip(leaves, named, strict=True)
    ]
    plan = make_plan(
        leaves,
        treedef,
        specs,
        named,
        with_path,
        mesh=mesh,
        by_shape=step.makes_mask,
    )
    mask = None
    if settings.pad_batches or settings.mask_kwarg is not None:
        plan.lowered_rows = batch_rows(leaves, treedef, plan.ranks, settings.mask_kwarg)
    if settings.pad_batches:
        _check_padded_rows(plan, settings.batch_sizes)
        computed_shardings(check=True)  # the other dimensions
    if plan.lowered_rows is not None and step.makes_mask:
        mask = jax.ShapeDtypeStruct(
            (plan.lowered_rows,), np.bool_, sharding=plan.mask_sharding
        )
    batch = treedef.unflatten(structs)
    if kwargs:
        dynamic, static = step.split_kwargs(kwargs, structs=True)
        lowered = step.jitted_kwargs.lower(
            static, runner.param_leaves, runner.prng_key, batch, mask, dynamic
        )
        return LoweredRunner(runner, lowered, static, plan)
    lowered = step.jitted.lower(runner.param_leaves, runner.prng_key, batch, mask)
    return LoweredRunner(runner, lowered, None, plan)


def _check_padded_rows(plan: BatchPlan, batch_sizes: tuple[int, ...] | None) -> None:
    """Refuse a lowered batch size that a padded call could not have.

    Raises:
        ValueError: if the spec's rows do not divide over the batch axis' shards,
            naming the size to lower for (the one a call pads such a batch to).
    """
    rows, multiple = plan.lowered_rows, plan.multiple
    if rows is None or rows % multiple == 0:
        return
    fits = [n for n in batch_sizes or () if n >= rows and n % multiple == 0]
    padded = fits[0] if fits else -(-rows // multiple) * multiple
    raise ValueError(
        "`MethodRunner.lower`: with `pad_batches=True` the batch spec's leading size "
        "is the padded size the step is compiled for (the compiled runner pads "
        f"smaller batches to it); {rows} rows do not divide over the {multiple} "
        f"shards of the batch axis. Lower for {padded} rows, the size a call pads "
        f"a batch of {rows} rows to."
    )


class _Staged(Generic[RunnerT, OutT]):
    """A runner's step at one ahead-of-time stage (JAX's `Lowered` or `Compiled`)."""

    def __init__(
        self,
        runner: RunnerT,
        program: Any,
        static_kwargs: Frozen | None,
        plan: BatchPlan,
    ):
        self._runner = runner
        self._program = program
        self._static_kwargs = static_kwargs
        self._plan = plan  # how the batch is placed, as lowered

    def as_text(self) -> str:
        """Return the program as text (lowered: StableHLO; compiled: optimized HLO)."""
        return self._program.as_text()


class LoweredRunner(_Staged[RunnerT, OutT]):
    """A runner step lowered ahead of time by `MethodRunner.lower`.

    Follows JAX's `jax.stages.Lowered`: `as_text()` gives the StableHLO, `compile()`
    a `CompiledRunner`. The batch shapes, dtypes and shardings are those of the
    `batch_spec` given to `lower`.
    """

    def compile(self) -> "CompiledRunner[RunnerT, OutT]":
        """Compile the lowered program; the result is called like the runner."""
        return CompiledRunner(
            self._runner, self._program.compile(), self._static_kwargs, self._plan
        )


class CompiledRunner(_Staged[RunnerT, OutT]):
    """A compiled runner step: `compiled(batch, **kwargs) -> (runner, output)`.

    Runs the program compiled by `MethodRunner.lower(...).compile()` with the
    parameters and key of the runner it is bound to (the one it was lowered from);
    returns that runner's successor and the output, exactly like calling the runner.
    Calling it again gives the same result (the same key). To run the compiled
    program in a loop, bind it to each successor:

        compiled = runner.lower(batch_spec).compile()
        for batch in batches:
            runner, out = compiled(batch)
            compiled = compiled.bind(runner)

    Each leaf of the batch is placed with the sharding it was lowered with (the
    `ShapeDtypeStruct`'s, else the input partition's), so a batch lowered with another
    sharding than the input partition runs too; inside, the step constrains it to the
    input partition as usual. Follows JAX's `jax.stages.Compiled`, bound to a runner's
    parameters and key.
    """

    @property
    def runner(self) -> RunnerT:
        """The runner whose parameters and key the next call uses."""
        return self._runner

    def bind(self, runner: RunnerT) -> "CompiledRunner[RunnerT, OutT]":
        """Return this compiled program bound to `runner` (e.g. a call's successor).

        Raises:
            ValueError: if `runner` has other settings (method, mesh, partitions,
                static model parts) than the runner this program was compiled for, or
                parameters or a key of another shape, dtype or sharding.
        """
        if runner.step.settings != self._runner.step.settings:
            raise ValueError(
                "`CompiledRunner.bind`: the runner has other settings (method, mesh, "
                "partitions or static parts of the model) than the one this program "
                "was compiled for; lower and compile it instead."
            )
        if runner.param_leaves is not self._runner.param_leaves:
            got, want = _signature(runner), _signature(self._runner)
            if got != want:
                raise ValueError(
                    "`CompiledRunner.bind`: the runner's parameters or key differ in "
                    "shape, dtype or sharding from those this program was compiled "
                    "for; lower and compile it instead."
                )
        return CompiledRunner(runner, self._program, self._static_kwargs, self._plan)

    def cost_analysis(self) -> Any:
        """Return XLA's cost estimates of the compiled program (`flops`, bytes, ...).

        JAX's `jax.stages.Compiled.cost_analysis()`: a dict of floats (keys such as
        `"flops"` and `"bytes accessed"`; which keys appear depends on the backend).
        """
        return self._program.cost_analysis()

    def memory_analysis(self) -> Any:
        """Return XLA's memory use of the compiled program (bytes per kind).

        JAX's `jax.stages.Compiled.memory_analysis()`: an object with attributes such
        as `argument_size_in_bytes`, `output_size_in_bytes`, `temp_size_in_bytes`
        and `alias_size_in_bytes` (donated buffers reused), or None where the
        backend does not report it.
        """
        return self._program.memory_analysis()

    def __call__(self, input_batch: Batch, **kwargs: PyTree) -> tuple[RunnerT, OutT]:
        """Run the compiled step; see `MethodRunner.__call__`.

        Raises:
            ValueError: if the static keyword arguments differ from the lowered ones,
                if the batch's structure differs from the lowered one, if a batch
                dimension does not divide over its mesh axes, or, with padding, if
                the batch is larger than the lowered batch size.
        """
        runner = self._runner
        step = runner.step
        plan = self._plan
        leaves, got = jax.tree.flatten(input_batch)
        if got != plan.treedef:
            raise ValueError(
                "`CompiledRunner`: the batch's structure differs from the one given to "
                f"`MethodRunner.lower` (got {got}, lowered {plan.treedef}); lower "
                "again for batches of another structure."
            )
        batch, mask, padding = step.place_batch(leaves, got, lowered=plan)
        lowered_names = (
            set() if self._static_kwargs is None else set(self._static_kwargs.tree())
        )
        if set(kwargs) != lowered_names:
            raise ValueError(
                "`CompiledRunner`: the keyword arguments differ from those given to "
                f"`MethodRunner.lower`: lowered with {sorted(lowered_names)}, called "
                f"with {sorted(kwargs)}. Pass the same keyword arguments (array "
                "values may change), or lower again."
            )
        dynamic, static = step.split_kwargs(kwargs) if kwargs else (None, None)
        if static != self._static_kwargs:
            raise ValueError(
                "`CompiledRunner`: the non-array keyword arguments differ from those "
                "given to `MethodRunner.lower` (Python scalars and other non-arrays "
                "are static: pass `jnp.asarray(...)` to trace a value); lower again "
                "for new static arguments."
            )
        params, key = runner.param_leaves, runner.prng_key
        if dynamic is not None:
            # Placed as lowered (a call places array kwargs too: `Step.place_kwargs`).
            flat, kw_def = jax.tree.flatten(dynamic)
            placed = place(
                flat,
                jax.tree.leaves(self._program.input_shardings[0][4]),
                paths=lambda: [
                    path_str(p)
                    for p, _ in jax.tree_util.tree_flatten_with_path(dynamic)[0]
                ],
                process_local=False,
            )
            dynamic = kw_def.unflatten(placed)
        if step.donate:
            check_donated(batch, params, dynamic or {}, where="CompiledRunner")
        if dynamic is not None:
            result = self._program(params, key, batch, mask, dynamic)
        else:
            result = self._program(params, key, batch, mask)
        new_key, output = step.finish(result, batch, padding)
        return type(runner)(params, new_key, step), cast(OutT, output)

"""Ahead-of-time lowering of a `MethodRunner` step: `LoweredRunner`, `CompiledRunner`.

Follows JAX's ahead-of-time API (`jax.jit(f).lower(...).compile()`, "Ahead-of-time
lowering and compilation" in the JAX docs), applied to the runner's jitted step
(`_step.jit_step`): `MethodRunner.lower(batch_spec)` returns a `LoweredRunner`, whose
`compile()` returns a `CompiledRunner` called like the runner.
"""

from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding

from ._partition import (
    check_divisible,
    leaf_spec,
    named_sharding,
    path_str,
    resolve_specs,
)
from ._step import Frozen, StaticOut, jit_step
from ._transfer import to_global


if TYPE_CHECKING:
    from ._runner import MethodRunner


_setattr = object.__setattr__
_getattribute = object.__getattribute__


def _signature(runner: "MethodRunner") -> list[tuple[Any, Any, Any]]:
    leaves = [*runner.param_leaves, runner.prng_key]
    return [(np.shape(x), jax.typeof(x).dtype, x.sharding) for x in leaves]


def _put(x: Any, sharding: Any) -> Any:
    """`x` with `sharding` (moved only when it has another)."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    return jax.device_put(x, sharding)


def _new(cls: type[Any], fields: dict[str, Any]) -> Any:
    """Build an `eqx.Module` from its fields without `__init__`, as its unflatten does.

    `eqx.Module.__init__` walks every leaf of its arguments (Python work per
    parameter), this costs ~0.3 µs.
    """
    self = object.__new__(cls)
    _setattr(self, "__dict__", fields)
    return self


def _finish(
    runner: "MethodRunner", result: tuple[Any, Any, StaticOut | None], batch: Any
) -> tuple["MethodRunner", "MethodRunner.Output"]:
    """Build the next runner and the output of one call, in O(1) Python work."""
    new_key, out, extra = result
    if extra is not None:
        out = eqx.combine(out, extra.value)
    # `MethodRunner` is final (never subclassed): `type(runner)` is `MethodRunner`.
    cls = type(runner)
    runner_fields = _getattribute(runner, "__dict__").copy()
    runner_fields["prng_key"] = new_key
    output_batch, summaries, module_outputs = out
    output = _new(
        cls.Output,
        {
            "output_batch": output_batch,
            "input_batch": batch,
            "summaries": summaries,
            "module_outputs": module_outputs,
        },
    )
    return _new(cls, runner_fields), output


def lower_runner(
    runner: "MethodRunner", batch_spec: Any, **kwargs: Any
) -> "LoweredRunner":
    """Lower `runner`'s step for batches like `batch_spec`; see `MethodRunner.lower`."""
    settings = runner.settings
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
            name = path_str(path)
            s = leaf_spec(spec, len(shape), explicit=settings.explicit, path=name)
            check_divisible(shape, s, settings.mesh, path=name)
            sharding = named_sharding(settings.mesh, s)
        structs.append(
            jax.ShapeDtypeStruct(shape, np.result_type(x), sharding=sharding)
        )
    del leaves
    if kwargs:
        dynamic, static = eqx.partition(kwargs, eqx.is_array)
        static_kwargs = Frozen(static, what="a keyword argument")
    else:
        dynamic = static_kwargs = None
    lowered = jit_step.lower(
        settings,
        static_kwargs,
        runner.param_leaves,
        runner.prng_key,
        treedef.unflatten(structs),
        dynamic,
    )
    shardings = [x.sharding for x in structs]
    return LoweredRunner(runner, lowered, static_kwargs, (treedef, shardings))


class _Staged:
    """A runner's step at one ahead-of-time stage (JAX's `Lowered` or `Compiled`)."""

    def __init__(
        self,
        runner: "MethodRunner",
        program: Any,
        static_kwargs: Any,
        inputs: tuple[Any, list[Any]],
    ):
        self._runner = runner
        self._program = program
        self._static_kwargs = static_kwargs
        self._inputs = inputs  # the batch's (treedef, shardings) as lowered

    def as_text(self) -> str:
        """Return the program as text (lowered: StableHLO; compiled: optimized HLO)."""
        return self._program.as_text()


class LoweredRunner(_Staged):
    """A runner step lowered ahead of time by `MethodRunner.lower`.

    Follows JAX's `jax.stages.Lowered`: `as_text()` gives the StableHLO, `compile()`
    a `CompiledRunner`. The batch shapes, dtypes and shardings are those of the
    `batch_spec` given to `lower`.
    """

    def compile(self) -> "CompiledRunner":
        """Compile the lowered program; the result is called like the runner."""
        return CompiledRunner(
            self._runner, self._program.compile(), self._static_kwargs, self._inputs
        )


class CompiledRunner(_Staged):
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
    def runner(self) -> "MethodRunner":
        """The runner whose parameters and key the next call uses."""
        return self._runner

    def bind(self, runner: "MethodRunner") -> "CompiledRunner":
        """Return this compiled program bound to `runner` (e.g. a call's successor).

        Raises:
            ValueError: if `runner` has other settings (method, mesh, partitions,
                static model parts) than the runner this program was compiled for, or
                parameters or a key of another shape, dtype or sharding.
        """
        if runner.settings != self._runner.settings:
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
        return CompiledRunner(runner, self._program, self._static_kwargs, self._inputs)

    def __call__(
        self, input_batch: Any, **kwargs: Any
    ) -> tuple["MethodRunner", "MethodRunner.Output"]:
        """Run the compiled step; see `MethodRunner.__call__`.

        Raises:
            ValueError: if the static keyword arguments differ from the lowered ones,
                if the batch's structure differs from the lowered one, or if a batch
                dimension does not divide over its mesh axes.
        """
        runner = self._runner
        batch = self._place(input_batch)
        dynamic, static = eqx.partition(kwargs, eqx.is_array) if kwargs else (None, {})
        static_kwargs = Frozen(static, what="a keyword argument") if kwargs else None
        if static_kwargs != self._static_kwargs:
            raise ValueError(
                "`CompiledRunner`: the non-array keyword arguments differ from those "
                "given to `MethodRunner.lower` (Python scalars and other non-arrays "
                "are static: pass `jnp.asarray(...)` to trace a value); lower again "
                "for new static arguments."
            )
        if dynamic is not None:
            # As lowered (a call places array kwargs too: `Settings.place_kwargs`).
            dynamic = jax.tree.map(_put, dynamic, self._program.input_shardings[0][3])
        result = self._program(runner.param_leaves, runner.prng_key, batch, dynamic)
        return _finish(runner, result, batch)

    def _place(self, input_batch: Any) -> Any:
        """Return the batch with the shardings it was lowered with, leaf by leaf."""
        treedef, shardings = self._inputs
        with_path, got = jax.tree_util.tree_flatten_with_path(input_batch)
        if got != treedef:
            raise ValueError(
                "`CompiledRunner`: the batch's structure differs from the one given to "
                f"`MethodRunner.lower` (got {got}, lowered {treedef}); lower again "
                "for batches of another structure."
            )
        placed: list[Any] = []
        for (path, x), s in zip(with_path, shardings, strict=True):
            if not (isinstance(x, jax.Array) and x.sharding == s):
                x = to_global(x, s, path=path_str(path))
            placed.append(x)
        return treedef.unflatten(placed)

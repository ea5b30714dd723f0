"""The traced step of `MethodRunner`: AXLearn's `_jit_run_on_batch`.

Follows `axlearn/common/inference.py`: split the key, run the method in a root
context, and constrain inputs, outputs and parameters to their shardings; summaries
and the kept module outputs come back replicated, non-array outputs in the output
treedef (`StaticOut`, as `eqx.filter_jit` does). `Step` (`_step.py`) jits these
functions closed over itself; `Settings` is the runner's configuration they run.
"""

import dataclasses
import warnings
from typing import Protocol, runtime_checkable

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array

from ._bodies import check_lost, owned, row_mask_read
from ._collection import OutputCollection
from ._context import Context, check_returns_context
from ._frozen import Frozen
from ._transfer import (
    constrain,
    constrain_leaves,
    constrain_tree,
    replicate_tree,
    replicated,
)
from ._typing import (
    ArrayTree,
    Batch,
    Children,
    Leaf,
    Method,
    PathPredicate,
    PRNGKey,
    TreeDef,
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The hashable configuration of a runner; equal settings share one `Step`.

    Holds no caches and no arrays: everything here decides what the step computes,
    and is compared by value (static callables by identity).
    """

    method: Method
    mesh: Mesh
    input_partition: Frozen
    output_partition: Frozen
    # One spec per parameter leaf, already fitted to its rank.
    param_specs: tuple[PartitionSpec, ...]
    static_model: Frozen
    drop_module_outputs: PathPredicate
    is_training: bool
    # The structure of the model's array part (`MethodRunner.param_leaves`).
    param_treedef: TreeDef
    pad_batches: bool = False
    batch_sizes: tuple[int, ...] | None = None
    mask_kwarg: str | None = None
    donate_batch: bool = False
    summary_level: int | None = None


@runtime_checkable
class StepState(Protocol):
    """What the traced step reads and counts of its `_step.Step`."""

    traces: int
    warned_unmasked: bool

    @property
    def settings(self) -> Settings: ...
    @property
    def mesh(self) -> Mesh: ...
    @property
    def explicit(self) -> bool: ...
    @property
    def param_shardings(self) -> tuple[NamedSharding, ...]: ...
    @property
    def static_model(self) -> ArrayTree: ...
    @property
    def input_partition(self) -> ArrayTree: ...
    @property
    def output_partition(self) -> ArrayTree: ...


@jax.tree_util.register_pytree_node_class
class StaticOut:
    """Non-array outputs, carried in the output treedef (like `eqx.filter_jit`)."""

    def __init__(self, value: ArrayTree):
        self.value = value

    def tree_flatten(self) -> tuple[tuple[()], ArrayTree]:
        return (), self.value

    @classmethod
    def tree_unflatten(cls, aux: ArrayTree, children: Children) -> "StaticOut":
        del children
        return cls(aux)


def run_step(
    step: StepState,
    static_kwargs: Frozen | None,
    param_leaves: tuple[Leaf, ...],
    prng_key: PRNGKey,
    batch: Batch,
    mask: Array | None,
    dynamic_kwargs: ArrayTree,
) -> tuple[PRNGKey, ArrayTree, StaticOut | None]:
    """The traced step: AXLearn's `_jit_run_on_batch`."""
    step.traces += 1
    settings, mesh, explicit = step.settings, step.mesh, step.explicit
    p_leaves = constrain_leaves(param_leaves, step.param_shardings, explicit=explicit)
    params = settings.param_treedef.unflatten(p_leaves)
    model = eqx.combine(params, step.static_model)
    batch = constrain_tree(
        batch, step.input_partition, mesh, what="input_partition", kind="batch"
    )
    new_key, iter_key = jax.random.split(prng_key)
    new_key = constrain(new_key, replicated(mesh, new_key), explicit=explicit)
    kwargs: dict[str, ArrayTree] = {}
    if static_kwargs is not None:
        kwargs = eqx.combine(dynamic_kwargs, static_kwargs.tree())
    if settings.mask_kwarg is not None and mask is not None:
        kwargs[settings.mask_kwarg] = mask
    ctx = owned(
        Context.root(
            prng_key=iter_key,
            is_training=settings.is_training,
            summary_level=settings.summary_level,
            row_mask=mask,
        )
    )
    root = ctx
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
    check_lost(ctx, root, what)
    if settings.pad_batches and settings.mask_kwarg is None and mask is not None:
        _warn_unmasked(step, root, ctx)
    output_batch = constrain_tree(
        output_batch,
        step.output_partition,
        mesh,
        what="output_partition",
        kind="output",
    )
    drop = settings.drop_module_outputs
    pruned = OutputCollection({}, {}, ctx.collection.module_outputs).prune(
        lambda p: p.startswith("module_outputs/") and drop(p[len("module_outputs/") :])
    )
    # An empty mapping comes back as None (`Step.finish` puts the shared empty one
    # back): JAX unflattens a `FrozenMapping` in Python, ~0.5 µs per call, and the
    # default `drop_module_outputs` keeps none.
    summaries = replicate_tree(ctx.collection.summaries, mesh) or None
    module_outputs = replicate_tree(pruned.module_outputs, mesh) or None
    dynamic, static = eqx.partition(
        (output_batch, summaries, module_outputs), eqx.is_array
    )
    has_static = any(x is not None for x in jax.tree.leaves(static))
    # None (an empty PyTree, unflattened in C++) when every output is an array.
    return new_key, dynamic, StaticOut(static) if has_static else None


def _warn_unmasked(step: StepState, root: Context, ctx: Context) -> None:
    """Warn once per step when a padded step's summaries never read the row mask.

    The padded rows are zeros that every summary over the rows would count (a mean
    of 0.19 with weight 24 where the 9 real rows give 0.51 with weight 9). Reading
    `ctx.row_mask` (or `row_where`) anywhere in the method counts as handling it.
    """
    summaries = ctx.collection.summaries
    if step.warned_unmasked or not summaries or row_mask_read(root):
        return
    step.warned_unmasked = True
    names = ", ".join(repr(str(k)) for k in list(summaries)[:3])
    warnings.warn(
        f"`MethodRunner(pad_batches=True)`: the method added summaries ({names}"
        f"{', ...' if len(summaries) > 3 else ''}) but never read the row mask "
        "(`ctx.row_mask`): the zero rows a batch is padded with count in every "
        "summary computed over its rows. Count only the real rows: "
        "`MomentsSummary(x, where=ctx.row_where(x))`, `HistogramSummary(x, "
        "where=ctx.row_where(x))`, a `WeightedSummary` weighted by "
        "`jnp.sum(ctx.row_mask)`. Summaries that do not depend on the rows are "
        "right as they are: read `ctx.row_mask` once to say so. (Warned once per "
        "runner settings.)",
        UserWarning,
        stacklevel=2,
    )


def run_step_without_kwargs(
    step: StepState,
    param_leaves: tuple[Leaf, ...],
    prng_key: PRNGKey,
    batch: Batch,
    mask: Array | None,
) -> tuple[PRNGKey, ArrayTree, StaticOut | None]:
    return run_step(step, None, param_leaves, prng_key, batch, mask, None)

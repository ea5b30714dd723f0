"""`Step`: the runner's compiled step of one `Settings`, with its caches.

Runners created from equal settings share one `Step` (`Step.of`), so they share its
`jax.jit`s and compilations, as equal static parts do under `eqx.filter_jit`.
`Step.call` (check the batch against the last one, else `place_batch`; run the
program; build the `Output`, through `finish` where it needs unpadding) is the one
path around the program for a call and `run_batches`; a `CompiledRunner` runs
`place_batch` and `finish` too, as Equinox's `_jit.py` routes its call and
`.lower()` through one `_call`. The settings and the traced function are in
`_traced.py`, batch plans and padding in `_plan.py`.
"""

import functools
import threading
from typing import Any, TypeAlias

import equinox as eqx
import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding
from jaxtyping import PyTree

from ._donation import check_donated
from ._frozen import Frozen
from ._mapping import EMPTY
from ._meshes import check_traced_batch, in_mesh, replicate_off_mesh
from ._partition import (
    is_explicit,
    leaf_shardings,
    named_sharding,
    path_str,
    resolve_specs,
)
from ._plan import (
    BatchPlan,
    Mask,
    Padding,
    batch_rows,
    make_plan,
    pad_rows,
    padded_size,
    unpad,
)
from ._traced import Settings, StaticOut, run_step, run_step_without_kwargs
from ._transfer import place, to_global
from ._typing import (
    ArrayLeaf,
    Batch,
    PRNGKeyArray,
    TreeDef,
)


_flatten = jax.tree_util.default_registry.flatten
_flatten_with_path = jax.tree_util.tree_flatten_with_path

#: What the jitted step returns: `(new_key, (output_batch, summaries,
#: module_outputs), static outputs or None)` (`_traced.run_step`).
StepResult: TypeAlias = tuple[
    PRNGKeyArray, tuple[PyTree, PyTree, PyTree], StaticOut | None
]


class Step:
    """The compiled step of one `Settings`, with its caches (an explicit object).

    The runner's static field: compares and hashes by its settings; copies are
    the object itself (a copied runner keeps its compilations).

    Attributes:
        settings: the configuration.
        traces: how many times the step has been traced (`MethodRunner.trace_count`).
        plans: per batch treedef, how batches of that structure are placed.
        last: the plan of the last batch placed, checked first by `call`.
    """

    __slots__ = (
        "_hash",
        "abstract_mesh",
        "donate",
        "explicit",
        "input_partition",
        "jitted",
        "jitted_kwargs",
        "last",
        "makes_mask",
        "masks",
        "mesh",
        "mesh_devices",
        "output_cls",
        "output_partition",
        "param_shardings",
        "plans",
        "settings",
        "static_model",
        "traces",
        "warned_unmasked",
    )

    def __init__(self, settings: Settings, output_cls: Any):
        self.settings = settings
        self._hash = hash(settings)
        self.mesh = mesh = settings.mesh
        self.abstract_mesh = mesh.abstract_mesh
        self.explicit = is_explicit(mesh)
        self.mesh_devices = set(mesh.devices.flat)
        self.input_partition = settings.input_partition.tree()
        self.output_partition = settings.output_partition.tree()
        self.static_model = settings.static_model.tree()
        self.param_shardings = tuple(
            named_sharding(mesh, s) for s in settings.param_specs
        )
        self.traces = 0
        self.plans: dict[TreeDef, BatchPlan] = {}
        self.last: BatchPlan | None = None
        self.masks: dict[tuple[int, NamedSharding], jax.Array] = {}
        # The rows mask: for `mask_kwarg` and a padding runner's `Context.row_mask`.
        self.makes_mask = settings.pad_batches or settings.mask_kwarg is not None
        self.warned_unmasked = False  # (`_traced._warn_unmasked`)
        self.output_cls = output_cls  # `MethodRunner.Output`
        self.donate = donate = settings.donate_batch
        # Closed over, not a static argument: ~1 µs per call.
        self.jitted = jax.jit(
            functools.partial(run_step_without_kwargs, self),
            donate_argnums=(2,) if donate else (),
        )
        self.jitted_kwargs = jax.jit(
            functools.partial(run_step, self),
            static_argnums=(0,),
            donate_argnums=(3,) if donate else (),
        )

    @staticmethod
    def of(settings: Settings, output_cls: Any) -> "Step":
        """Return the `Step` of `settings`, shared by equal settings (an LRU).

        `output_cls` is `MethodRunner.Output` (this module is below the runner's).
        """
        with _STEPS_LOCK:  # one `Step` (one set of compilations) per settings
            return _step_of(settings, output_cls)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, Step)
            and self._hash == other._hash
            and self.settings == other.settings
        )

    def __copy__(self) -> "Step":
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> "Step":
        del memo
        return self

    def __repr__(self) -> str:
        return f"Step(method={self.settings.method!r}, mesh={dict(self.mesh.shape)})"

    # -- before the program: the batch ---------------------------------------------

    def place_batch(
        self,
        leaves: list[ArrayLeaf],
        treedef: TreeDef,
        lowered: BatchPlan | None = None,
    ) -> tuple[Batch, Mask | None, Padding | None]:
        """Place (and pad) a batch given as its leaves and treedef.

        With `lowered` (a `CompiledRunner`), the leaves get the lowered shardings and
        are padded to the lowered batch size.

        Raises:
            TypeError: for a leaf that is not an array (naming its path).
            ValueError: for a dimension that does not divide over its mesh axes, or
                a batch that cannot be padded (see `MethodRunner.create`).
        """
        settings = self.settings
        ranks = tuple(map(np.ndim, leaves))
        plan = lowered
        if plan is None:
            plan = self.plans.get(treedef)
            if plan is None or plan.ranks != ranks:
                plan = self.plans[treedef] = self.plan(leaves, treedef)
        padding = rows = None
        if self.makes_mask:
            rows = batch_rows(leaves, treedef, ranks, settings.mask_kwarg)
        if rows is not None and settings.pad_batches:
            size = padded_size(rows, plan, settings.batch_sizes)
            if size != rows:
                if jax.process_count() > 1:
                    raise ValueError(
                        "`MethodRunner(pad_batches=True)`: a batch of "
                        f"{rows} rows per process would need padding to {size} in "
                        "a multi-process run, where each process holds a slice; "
                        "pad the batches on the host before splitting them."
                    )
                leaves = [
                    pad_rows(x, size) if r else x
                    for x, r in zip(leaves, ranks, strict=True)
                ]
                padding = Padding(rows, size)

        def paths() -> list[str]:
            tree = treedef.unflatten(leaves)
            return [path_str(p) for p, _ in _flatten_with_path(tree)[0]]

        placed = place(leaves, plan.shardings, paths=paths, process_local=True)
        tracing = any(isinstance(x, Tracer) for x in placed)
        mask = None
        if rows is not None:
            size = rows if padding is None else padding.size
            mask = self.mask(rows, size, plan.mask_sharding, tracing=tracing)
        if lowered is None and not tracing:
            # (Leaves placed inside a trace leave nothing to remember.)
            plan.expected = list(map(plan.signature, placed))
            if rows is not None:  # a batch matching `expected` needs no padding
                size = rows if padding is None else padding.size
                plan.mask = self.mask(size, size, plan.mask_sharding, tracing=False)
            self.last = plan
        return treedef.unflatten(placed), mask, padding

    def plan(self, leaves: list[ArrayLeaf], treedef: TreeDef) -> BatchPlan:
        """Return how batches with this structure and these leaf ranks are placed.

        Raises:
            ValueError: if the input partition does not match the batch or names an
                unknown mesh axis, or a spec has non-None entries beyond a leaf's
                rank (naming the leaf).
        """
        tree = treedef.unflatten(leaves)
        with_path = _flatten_with_path(tree)[0]
        specs = resolve_specs(
            self.input_partition, tree, self.mesh, what="input_partition"
        )
        shardings = leaf_shardings(
            specs, with_path, self.mesh, kind="batch", check=False
        )
        return make_plan(
            leaves,
            treedef,
            specs,
            shardings,
            with_path,
            mesh=self.mesh,
            by_shape=self.makes_mask,
        )

    def mask(
        self, rows: int, size: int, sharding: NamedSharding, *, tracing: bool
    ) -> Mask:
        """Return `bool[size]`, True for the first `rows` rows, placed as `sharding`."""
        host = np.arange(size) < rows
        if tracing:
            return host
        mask = self.masks.get((size, sharding)) if rows == size else None
        if mask is None:
            path = self.settings.mask_kwarg or "row_mask"
            mask = to_global(host, sharding, path=path)
            if rows == size:  # all True: the same for every batch of this size
                self.masks[(size, sharding)] = mask
        return mask

    def split_kwargs(
        self, kwargs: dict[str, PyTree], *, structs: bool = False
    ) -> tuple[PyTree, "Frozen"]:
        """Return the array and the static (frozen) parts of keyword arguments.

        `structs`: `jax.ShapeDtypeStruct` leaves count as arrays (lowering).

        Raises:
            TypeError: for an unhashable non-array keyword argument.
            ValueError: for a keyword argument named like `mask_kwarg`.
        """
        name = self.settings.mask_kwarg
        if name is not None and name in kwargs:
            raise ValueError(
                f"`MethodRunner(mask_kwarg={name!r})`: the runner passes `{name}` to "
                "the method itself; do not pass it as a keyword argument."
            )
        is_dynamic = _is_array_or_struct if structs else eqx.is_array
        dynamic, static = eqx.partition(kwargs, is_dynamic)
        return dynamic, Frozen(static, what="a keyword argument")

    # -- the call: check or place the batch, run, build the Output ------------------

    def call(
        self,
        param_leaves: tuple[jax.Array, ...],
        prng_key: PRNGKeyArray,
        input_batch: Batch,
        kwargs: dict[str, PyTree],
    ) -> tuple[PRNGKeyArray, Any]:
        """Run one batch; return `(new_key, output)`.

        Under another context mesh the method runs under the runner's, as
        AXLearn's `MethodRunner` does; under none, under none, as `jax.jit` does.
        Meshes compare as JAX's abstract meshes (axis names and sizes).
        """
        # Not `jax.set_mesh` on every call: it doubles the runner's own Python.
        mesh = jax.sharding.get_abstract_mesh()
        if mesh is self.abstract_mesh or mesh.empty:
            return self.call_in_mesh(param_leaves, prng_key, input_batch, kwargs)
        with in_mesh(self.mesh):
            return self.call_in_mesh(param_leaves, prng_key, input_batch, kwargs)

    def call_in_mesh(
        self,
        param_leaves: tuple[jax.Array, ...],
        prng_key: PRNGKeyArray,
        input_batch: Batch,
        kwargs: dict[str, PyTree],
    ) -> tuple[PRNGKeyArray, Any]:
        """Run one batch under the right mesh; return `(new_key, output)`.

        Fast path: the batch has the structure, leaf types and shardings (and, with
        padding or a mask, shapes) of the last one (`BatchPlan.expected`), compared
        in C; a plain dict with the last batch's keys is not even flattened. Any
        other batch, or a leaf without `.sharding` (AttributeError), goes through
        `place_batch`. The containers are new: `Output.input_batch` never aliases
        the caller's. A result that needs no unpadding, no donation and no static
        outputs becomes the `Output` here, without `finish` (one frame less).
        """
        last = self.last
        batch = None
        flat = None
        if last is not None:
            try:
                keys, getter = last.dict_keys, last.dict_values
                if (
                    keys is not None
                    and getter is not None
                    and type(input_batch) is dict
                ):
                    got = getter(input_batch)  # KeyError for a missing key
                    # For one key, `itemgetter` gives the value itself.
                    values = got if len(keys) > 1 else (got,)
                    if len(input_batch) == len(keys) and (
                        list(map(last.signature, values)) == last.expected  # pyright: ignore[reportArgumentType]
                    ):
                        batch = input_batch.copy()
                else:
                    flat = leaves, treedef = _flatten(input_batch)
                    if treedef == last.treedef and (
                        list(map(last.signature, leaves)) == last.expected
                    ):
                        batch = treedef.unflatten(leaves)
            except (AttributeError, KeyError):
                pass
        if batch is None or last is None:
            leaves, treedef = flat if flat is not None else _flatten(input_batch)
            batch, mask, padding = self.place_batch(leaves, treedef)
            if self.explicit:
                check_traced_batch(self.mesh, prng_key, batch)
        else:
            mask, padding = last.mask, None
        if self.donate:
            check_donated(batch, param_leaves, kwargs, where="MethodRunner")
        if kwargs:  # array parts traced, the rest static
            dynamic, static = self.split_kwargs(kwargs)
            dynamic = replicate_off_mesh(dynamic, self.mesh, self.mesh_devices)
            result = self.jitted_kwargs(
                static, param_leaves, prng_key, batch, mask, dynamic
            )
        else:
            result = self.jitted(param_leaves, prng_key, batch, mask)
        new_key, out, extra = result
        if extra is None and padding is None and not self.donate:
            output_batch, summaries, module_outputs = out
            return new_key, self.output_cls(
                output_batch,
                batch,
                EMPTY if summaries is None else summaries,
                EMPTY if module_outputs is None else module_outputs,
            )
        return self.finish(result, batch, padding)

    def finish(
        self,
        result: StepResult,
        batch: Batch | None,
        padding: Padding | None,
    ) -> tuple[PRNGKeyArray, Any]:
        """Return `(new_key, output)` from the program's result: the one output path."""
        new_key, out, extra = result
        if extra is not None:
            out = eqx.combine(out, extra.value)
        output_batch, summaries, module_outputs = out
        if self.donate:
            batch = None
        if padding is not None:
            output_batch, batch = unpad((output_batch, batch), padding, self.mesh)
        return new_key, self.output_cls(
            output_batch,
            batch,
            EMPTY if summaries is None else summaries,
            EMPTY if module_outputs is None else module_outputs,
        )


_STEPS_LOCK = threading.Lock()


@functools.lru_cache(maxsize=256)
def _step_of(settings: Settings, output_cls: Any) -> Step:
    return Step(settings, output_cls)


def _is_array_or_struct(x: object) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)

"""The runner's step: its settings, its caches, and the path around the program.

`Settings` (`_traced.py`) is a runner's hashable configuration, compared by value.
`Step` is the explicit cache of one `Settings`: its `jax.jit`s, how batches of each
structure are placed, its trace count. Runners created from equal settings share one
`Step`, so they share compilations, as equal static parts do under `eqx.filter_jit`.
`Step.call` (check the batch against the last one, else `place_batch`: place and
pad it; run the program; build the `Output`, through `finish` where it needs
unpadding) is the one path around the compiled program for a call and `run_batches`;
a `CompiledRunner` runs `place_batch` and `finish` too, as Equinox's `_jit.py` routes
its call and `.lower()` through one `_call`. The settings and the traced function
are in `_traced.py`, batch plans and padding in `_plan.py`.
"""

import collections
import contextlib
import functools
import threading
import weakref
from typing import Any, NoReturn, TypeAlias

import equinox as eqx
import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._frozen import Frozen
from ._mapping import EMPTY
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
from ._transfer import (
    place,
    replicated,
    to_global,
)
from ._typing import (
    ArrayLeaf,
    Batch,
    KeyPath,
    PRNGKeyArray,
    TreeDef,
)


_flatten = jax.tree_util.default_registry.flatten

#: What the jitted step returns: `(new_key, (output_batch, summaries,
#: module_outputs), static outputs or None)` (`_traced.run_step`).
StepResult: TypeAlias = tuple[
    PRNGKeyArray, tuple[PyTree, PyTree, PyTree], StaticOut | None
]
_flatten_with_path = jax.tree_util.tree_flatten_with_path


class Step:
    """The compiled step of one `Settings`, with its caches (an explicit object).

    Runners created from equal settings share one `Step` (`Step.of`), so they share
    its `jax.jit`s and so their compilations. `call` (with `place_batch` and
    `finish`) is the one path around the compiled program, for
    `MethodRunner.__call__`, `run_batches` and (`place_batch`, `finish`)
    `CompiledRunner`.
    A `Step` is the runner's static field: it compares and hashes by its settings.

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
        # The rows mask goes to the method (`mask_kwarg`) and to the root context
        # (`Context.row_mask`) of a padding runner.
        self.makes_mask = settings.pad_batches or settings.mask_kwarg is not None
        # Whether a padded step's summaries that never read the mask were reported.
        self.warned_unmasked = False
        self.output_cls = output_cls  # `MethodRunner.Output`
        self.donate = donate = settings.donate_batch
        # ~1 µs per call saved over `jax.jit(..., static_argnums=...)` on the
        # settings: the step closes over them.
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

        `output_cls` is `MethodRunner.Output` (passed in: this module is below the
        runner's).
        """
        with _STEPS_LOCK:
            step = _STEPS.get(settings)
            if step is None:
                step = _STEPS[settings] = Step(settings, output_cls)
                if len(_STEPS) > _MAX_STEPS:
                    _STEPS.popitem(last=False)
            else:
                _STEPS.move_to_end(settings)
            return step

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
        # Copies share the caches, so a copied runner keeps its compilations.
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
        padding = None
        rows = None
        if settings.pad_batches or settings.mask_kwarg is not None:
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
        if rows is not None and self.makes_mask:
            size = rows if padding is None else padding.size
            mask = self.mask(rows, size, plan.mask_sharding, tracing=tracing)
        if lowered is None and not tracing:
            # Host-local leaves placed inside a trace (a runner called in `jax.jit`
            # on a batch it closes over) leave nothing to remember.
            plan.expected = list(map(plan.signature, placed))
            if mask is not None and rows is not None:
                # A batch matching `expected` needs no padding: an all-True mask.
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
        return self.plan_from(leaves, treedef, specs, shardings, with_path)

    def plan_from(
        self,
        leaves: list[ArrayLeaf],
        treedef: TreeDef,
        specs: list[PartitionSpec],
        shardings: list[NamedSharding],
        with_path: list[tuple[KeyPath, ArrayLeaf]],
    ) -> BatchPlan:
        """Return the `BatchPlan` of leaves placed with `shardings` (`make_plan`)."""
        settings = self.settings
        return make_plan(
            leaves,
            treedef,
            specs,
            shardings,
            with_path,
            mesh=self.mesh,
            by_shape=settings.pad_batches or settings.mask_kwarg is not None,
        )

    def mask(
        self, rows: int, size: int, sharding: NamedSharding, *, tracing: bool
    ) -> Mask:
        """Return `bool[size]`, True for the first `rows` rows, placed as `sharding`."""
        host = np.arange(size) < rows
        if tracing:
            return host
        if rows != size:
            return to_global(
                host, sharding, path=self.settings.mask_kwarg or "row_mask"
            )
        mask = self.masks.get((size, sharding))
        if mask is None:
            mask = to_global(
                host, sharding, path=self.settings.mask_kwarg or "row_mask"
            )
            self.masks[(size, sharding)] = mask
        return mask

    def check_traced_batch(self, prng_key: PRNGKeyArray, batch: Batch) -> None:
        """Refuse a traced batch off the mesh, on Explicit axes, with no context mesh.

        A traced function (`jax.jit`, `jax.eval_shape`, `jax.grad`) that closes
        over the runner and gets the batch as arguments not placed on the mesh
        (NumPy or single-device arrays) knows no mesh: its outputs, typed with the
        runner's Explicit mesh, cannot be placed (JAX: "Length of device assignment
        1 is not equal to the size of the mesh"; the same for plain JAX code).
        A runner passed in as an argument (its key is traced on the mesh) or a
        context mesh gives the trace the mesh. A one-device mesh needs neither (the
        trace's single device is its device assignment). Runs on the slow path only.

        Raises:
            ValueError: naming the batch leaf and the three ways out.
        """
        if (
            self.mesh.size == 1
            or (
                isinstance(prng_key, Tracer)
                and not jax.typeof(prng_key).sharding.mesh.empty
            )
            or not jax.sharding.get_abstract_mesh().empty
        ):
            return
        for path, x in _flatten_with_path(batch)[0]:
            if isinstance(x, Tracer) and jax.typeof(x).sharding.mesh.empty:
                raise ValueError(
                    f"`MethodRunner`: a runner on a mesh with Explicit axes "
                    f"({dict(self.mesh.shape)}) is called inside a traced function "
                    f"(`jax.jit`, `jax.eval_shape`, `jax.grad`, ...) on the traced "
                    f"batch leaf {path_str(path)!r}, which is not placed on its mesh "
                    "(a NumPy or single-device array passed to the traced function), "
                    "and no context mesh is set: the traced function's outputs "
                    "cannot be placed on a mesh it does not know. Set the mesh "
                    "around the traced call (`with jax.set_mesh(runner.mesh): "
                    "...`), pass the runner in as an argument of the traced "
                    "function, or pass a batch placed on the mesh."
                )

    def place_kwargs(self, dynamic: PyTree) -> PyTree:
        """Replicate array keyword arguments committed to devices off the mesh.

        `jax.jit` refuses an argument committed to another device set (e.g. a
        `jax.device_put(x, jax.devices()[3])`) than the mesh's; arrays already on
        the mesh and NumPy arrays pass as they are.
        """

        def put(x: ArrayLeaf) -> ArrayLeaf:
            if (
                isinstance(x, jax.Array)
                and not isinstance(x, Tracer)
                and x.committed
                and x.sharding.device_set != self.mesh_devices
            ):
                return jax.device_put(x, replicated(self.mesh, x))
            return x

        return jax.tree.map(put, dynamic)

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

        Under a context mesh other than the runner's (`jax.set_mesh(other)`), the
        method runs with `self.mesh` as the context mesh, as AXLearn's
        `MethodRunner` runs under its mesh (the program is the one a call under
        `jax.set_mesh(self.mesh)` runs). With no context mesh it runs under none,
        as a `jax.jit` call does. Meshes are compared as JAX's abstract meshes
        (axis names and sizes): one of the runner's shape on other devices is
        taken for the runner's.
        """
        # Not `jax.set_mesh` on every call: it costs about half the runner's own
        # Python (benchmarks/README.md, bench_runner).
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
        """Run one batch; return `(new_key, output)`: the path of every call.

        `MethodRunner.__call__` and `run_batches` run batches this way; a
        `CompiledRunner` places them with its lowered plan (`place_batch`) and ends
        with `finish` too.

        Fast path: the batch has the structure, leaf types and shardings (and, with
        padding or a mask, shapes) of the last one (`BatchPlan`), read and compared
        in C (`map`, list equality, which tries identity first); a plain dict with
        the last batch's keys is not even flattened (its values are read with one
        `operator.itemgetter`). Anything else, and any leaf
        without `.sharding` (NumPy, a Python scalar: AttributeError), goes through
        `place_batch`. The containers are new: `Output.input_batch` never aliases
        the caller's. A result that needs no unpadding, no donation and no static
        outputs becomes the `Output` here, without `finish`: this runs on every
        call, where each Python frame is ~0.1 µs of a ~15 µs call.
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
                self.check_traced_batch(prng_key, batch)
        else:
            mask, padding = last.mask, None
        if self.donate:
            check_donated(batch, param_leaves, kwargs, where="MethodRunner")
        if kwargs:
            result = self.run_with_kwargs(param_leaves, prng_key, batch, mask, kwargs)
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

    def run_with_kwargs(
        self,
        param_leaves: tuple[jax.Array, ...],
        prng_key: PRNGKeyArray,
        batch: Batch,
        mask: Mask | None,
        kwargs: dict[str, PyTree],
    ) -> StepResult:
        """Run the step with the method's keyword arguments (static part static)."""
        dynamic, static = self.split_kwargs(kwargs)
        return self.jitted_kwargs(
            static, param_leaves, prng_key, batch, mask, self.place_kwargs(dynamic)
        )

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
        if padding is not None or self.donate:
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


#: Steps per settings (LRU): runners re-created from equal settings share one.
_STEPS: "collections.OrderedDict[Settings, Step]" = collections.OrderedDict()
_MAX_STEPS = 256
_STEPS_LOCK = threading.Lock()


def check_donated(
    batch: Batch,
    param_leaves: tuple[jax.Array, ...],
    kwargs: dict[str, PyTree],
    *,
    where: str,
) -> None:
    """Refuse a placed batch array that the call reads twice, or that is deleted.

    With `donate_batch=True` XLA may write an output into a batch array's buffer
    while the same array is read again: as another batch leaf, a parameter or a
    keyword argument (JAX then fails, or on some backends the process crashes).
    An array donated by an earlier call is deleted; passed again to a donating
    step on several devices, XLA's CPU runtime crashed the process. Costs a pass
    over the batch's leaves (and the keyword arguments'), and one over the
    parameters per parameter tuple (cached).

    Raises:
        ValueError: naming the batch leaf and the other argument, or the deleted
            batch leaf.
    """
    leaves = [
        x
        for x in jax.tree.leaves(batch)
        if isinstance(x, jax.Array) and not isinstance(x, Tracer)
    ]
    donated = {id(x) for x in leaves}
    if not donated:
        return
    if any(x.is_deleted() for x in leaves):
        path = next(
            path_str(p)
            for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]
            if isinstance(x, jax.Array) and not isinstance(x, Tracer) and x.is_deleted()
        )
        raise ValueError(
            f"`{where}(donate_batch=True)`: the batch leaf {path!r} is a deleted "
            "array (an earlier call donated it, or it was deleted). Pass the data "
            "again (a NumPy array, or a new device array), or keep the batch: "
            "create the runner with donate_batch=False."
        )
    if len(donated) < len(leaves):  # the same array twice in the batch
        seen: dict[int, str] = {}
        for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
            if isinstance(x, jax.Array):
                if id(x) in seen:
                    _refuse_aliased(
                        where, seen[id(x)], f"the batch leaf {path_str(path)!r}"
                    )
                seen[id(x)] = path_str(path)
    others: list[tuple[str, object]] = []
    if not donated.isdisjoint(_ids(param_leaves)):
        others += [
            (f"the model's parameter leaf {i}", x)
            for i, x in enumerate(param_leaves)
            if id(x) in donated
        ]
    for name, tree in kwargs.items():
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if id(x) in donated:
                others.append(
                    (f"keyword argument {name}{jax.tree_util.keystr(path)}", x)
                )
    for what, x in others[:1]:
        leaf = next(
            path_str(path)
            for path, y in jax.tree_util.tree_flatten_with_path(batch)[0]
            if y is x
        )
        _refuse_aliased(where, leaf, what)


def _refuse_aliased(where: str, leaf: str, what: str) -> NoReturn:
    raise ValueError(
        f"`{where}(donate_batch=True)`: the batch leaf {leaf!r} is also passed as "
        f"{what} (the same array): a donated buffer may be overwritten while the "
        "call reads it. Pass a copy (`jnp.copy(x)`) as one of them, or create the "
        "runner with donate_batch=False."
    )


#: The last parameter tuple's id and length, a weak reference to its first leaf,
#: and its leaves' ids (a runner's successors share the tuple). Nothing here keeps
#: the parameters alive; a hit needs the same tuple address and the same first leaf
#: still alive.
_param_ids: tuple[int, int, Any, frozenset[int]] | None = None


def _ids(param_leaves: tuple[jax.Array, ...]) -> frozenset[int]:
    global _param_ids
    if not param_leaves:
        return frozenset()
    cached = _param_ids
    if (
        cached is not None
        and cached[0] == id(param_leaves)
        and cached[1] == len(param_leaves)
        and cached[2]() is param_leaves[0]
    ):
        return cached[3]
    ids = frozenset(map(id, param_leaves))
    _param_ids = (
        id(param_leaves),
        len(param_leaves),
        weakref.ref(param_leaves[0]),
        ids,
    )
    return ids


def in_mesh(mesh: Mesh) -> contextlib.AbstractContextManager[object]:
    """`jax.set_mesh(mesh)` where another context mesh is set, else nothing.

    Raises:
        ValueError: inside a trace (`jax.jit` of a function calling the runner)
            under another context mesh, which JAX does not let a trace change
            (`jax.set_mesh` is refused there; JAX's own error would follow from
            the first operation on the runner's arrays).
    """
    context = jax.sharding.get_abstract_mesh()
    if context is mesh.abstract_mesh or context.empty:
        return contextlib.nullcontext()
    try:
        return jax.set_mesh(mesh)  # (it sets the mesh here; leaving restores)
    except ValueError:  # "`set_mesh` can only be used outside of `jax.jit`."
        raise ValueError(
            f"`MethodRunner`: called inside a trace (`jax.jit`, `jax.eval_shape`, "
            f"...) under the context mesh {dict(context.shape)}, not the runner's "
            f"{dict(mesh.shape)}; a trace cannot change its mesh (`jax.set_mesh` is "
            "refused under `jax.jit`). Call the runner outside the traced function, "
            "or set the runner's mesh around it (`with jax.set_mesh(runner.mesh): "
            "...`)."
        ) from None


def _is_array_or_struct(x: object) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)

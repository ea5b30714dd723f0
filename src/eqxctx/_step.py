"""The compiled step of `MethodRunner`: its settings, its caches, the traced function.

`Settings` is a runner's hashable configuration (the method, the mesh, the
partitions, the model's non-array leaves, padding and donation), compared by value.
`Step` is the explicit cache of one `Settings`: its `jax.jit`s, how batches of each
structure are placed, its trace count. Runners created from equal settings share one
`Step`, so they share compilations, as equal static parts do under `eqx.filter_jit`.
`Step.prepare` (place and pad the batch) and `Step.finish` (unpad, build the next
runner and the `Output`) are the one path around the compiled program, for a call and
for a `CompiledRunner` alike, as Equinox's `_jit.py` routes its call and `.lower()`
through one `_call`. `_step` is AXLearn's `_jit_run_on_batch`
(`axlearn/common/inference.py`): split the key, run the method in a root context, and
constrain inputs, outputs and parameters to their shardings.
"""

import collections
import dataclasses
import functools
import math
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
    batch_shards,
    is_explicit,
    leaf_shardings,
    named_sharding,
    normalize_spec,
    path_str,
    resolve_specs,
)
from ._transfer import constrain, constrain_leaves, place, to_global


REPLICATED = PartitionSpec()
_flatten = jax.tree_util.default_registry.flatten
_flatten_with_path = jax.tree_util.tree_flatten_with_path


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


@dataclasses.dataclass(frozen=True)
class Settings:
    """The hashable configuration of a runner; equal settings share one `Step`.

    Holds no caches and no arrays: everything here decides what the step computes,
    and is compared by value (static callables by identity).
    """

    method: Any
    mesh: Mesh
    input_partition: Frozen
    output_partition: Frozen
    # One spec per parameter leaf, already fitted to its rank.
    param_specs: tuple[PartitionSpec, ...]
    static_model: Frozen
    drop_module_outputs: Callable[[str], bool]
    is_training: bool
    # The structure of the model's array part (`MethodRunner.param_leaves`).
    param_treedef: Any
    pad_batches: bool = False
    batch_sizes: tuple[int, ...] | None = None
    mask_kwarg: str | None = None
    donate_batch: bool = False


class Step:
    """The compiled step of one `Settings`, with its caches (an explicit object).

    Runners created from equal settings share one `Step` (`Step.of`), so they share
    its `jax.jit`s and so their compilations. `prepare` and `finish` are the one path
    around the compiled program, for `MethodRunner.__call__` and `CompiledRunner`.
    A `Step` is the runner's static field: it compares and hashes by its settings.

    Attributes:
        settings: the configuration.
        traces: how many times the step has been traced (`MethodRunner.trace_count`).
        plans: per batch treedef, how batches of that structure are placed.
        last: the plan of the last batch placed, checked first by `prepare`.
    """

    __slots__ = (
        "_hash",
        "donate",
        "explicit",
        "input_partition",
        "jitted",
        "jitted_kwargs",
        "last",
        "masks",
        "mesh",
        "mesh_devices",
        "output_cls",
        "output_partition",
        "param_shardings",
        "plans",
        "rebuild",
        "settings",
        "static_model",
        "traces",
    )

    def __init__(self, settings: Settings, output_cls: Any):
        self.settings = settings
        self._hash = hash(settings)
        self.mesh = mesh = settings.mesh
        self.explicit = is_explicit(mesh)
        self.mesh_devices = set(mesh.devices.flat)
        self.input_partition = settings.input_partition.tree()
        self.output_partition = settings.output_partition.tree()
        self.static_model = settings.static_model.tree()
        self.param_shardings = tuple(
            named_sharding(mesh, s) for s in settings.param_specs
        )
        self.traces = 0
        self.plans: dict[Any, BatchPlan] = {}
        self.last: BatchPlan | None = None
        self.masks: dict[tuple[int, NamedSharding], Any] = {}
        # `unflatten` of the one-level structure of this step's runners: the next
        # runner is rebuilt from `(param_leaves, prng_key)` through the public PyTree
        # API (~1 µs; `eqx.Module.__init__` walks every leaf, ~10 µs). Set by the
        # first `next_runner`.
        self.rebuild: Callable[[Any], Any] | None = None
        self.output_cls = output_cls  # `MethodRunner.Output`
        self.donate = donate = settings.donate_batch
        # ~1 µs per call saved over `jax.jit(..., static_argnums=...)` on the
        # settings: the step closes over them.
        self.jitted = jax.jit(
            functools.partial(_step_without_kwargs, self),
            donate_argnums=(2,) if donate else (),
        )
        self.jitted_kwargs = jax.jit(
            functools.partial(_step, self),
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

    def __deepcopy__(self, memo: dict[int, Any]) -> "Step":
        # Copies share the caches, so a copied runner keeps its compilations.
        del memo
        return self

    def __repr__(self) -> str:
        return f"Step(method={self.settings.method!r}, mesh={dict(self.mesh.shape)})"

    # -- before the program: the batch ---------------------------------------------

    def prepare(self, input_batch: Any) -> tuple[Any, Any, "Padding | None"]:
        """Return `(batch, mask, padding)`: the batch placed (and padded) for the step.

        Fast path: the batch has the structure, leaf types and shardings (and, with
        padding or a mask, shapes) of the last one (`BatchPlan`), read and compared
        in C (`map`, list equality, which tries identity first); a plain dict with
        the last batch's keys is not even flattened. Anything else, and any leaf
        without `.sharding` (NumPy, a Python scalar: AttributeError), goes through
        `place_batch`. The containers are new: `Output.input_batch` never aliases
        the caller's.
        """
        last = self.last
        flat = None
        if last is not None:
            try:
                keys = last.dict_keys
                if keys is not None and type(input_batch) is dict:
                    if len(input_batch) == len(keys) and (
                        list(map(last.signature, map(input_batch.__getitem__, keys)))
                        == last.expected
                    ):
                        return input_batch.copy(), last.mask, None
                else:
                    flat = leaves, treedef = _flatten(input_batch)
                    if treedef == last.treedef and (
                        list(map(last.signature, leaves)) == last.expected
                    ):
                        return treedef.unflatten(leaves), last.mask, None
            except (AttributeError, KeyError):
                pass
        leaves, treedef = flat if flat is not None else _flatten(input_batch)
        return self.place_batch(leaves, treedef)

    def place_batch(
        self, leaves: list[Any], treedef: Any, lowered: "BatchPlan | None" = None
    ) -> tuple[Any, Any, "Padding | None"]:
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
            rows = batch_rows(leaves, treedef, ranks)
        if rows is not None and settings.pad_batches:
            size = self.padded_size(rows, plan)
            if size != rows:
                if jax.process_count() > 1:
                    raise ValueError(
                        "`MethodRunner(pad_batches=True)`: a batch of "
                        f"{rows} rows per process would need padding to {size} in "
                        "a multi-process run, where each process holds a slice; "
                        "pad the batches on the host before splitting them."
                    )
                leaves = [
                    _pad_rows(x, size) if r else x
                    for x, r in zip(leaves, ranks, strict=True)
                ]
                padding = Padding(rows, size)

        def paths() -> list[str]:
            tree = treedef.unflatten(leaves)
            return [path_str(p) for p, _ in _flatten_with_path(tree)[0]]

        placed = place(leaves, plan.shardings, paths=paths, process_local=True)
        tracing = any(isinstance(x, Tracer) for x in placed)
        mask = None
        if rows is not None and settings.mask_kwarg is not None:
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

    def plan(self, leaves: list[Any], treedef: Any) -> "BatchPlan":
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
        leaves: list[Any],
        treedef: Any,
        specs: list[PartitionSpec],
        shardings: list[NamedSharding],
        with_path: list[Any],
    ) -> "BatchPlan":
        """Return the `BatchPlan` of leaves placed with `shardings`."""
        ranks = tuple(map(np.ndim, leaves))
        settings = self.settings
        if settings.pad_batches or settings.mask_kwarg is not None:
            signature = _SIGNATURE_WITH_SHAPE
        elif any(r < len(s) for r, s in zip(ranks, specs, strict=True)):
            # The rank rule maps a leaf of rank r < len(spec) to a shorter spec,
            # whose sharding an array of another rank can have too.
            signature = _SIGNATURE_WITH_RANK
        else:
            signature = _SIGNATURE
        multiple = 1
        mask_sharding = named_sharding(self.mesh, REPLICATED)
        first = True
        for r, s in zip(ranks, shardings, strict=True):
            if r:
                multiple = math.lcm(multiple, batch_shards(s))
                if first:
                    spec = PartitionSpec(s.spec[0]) if len(s.spec) else REPLICATED
                    mask_sharding = named_sharding(self.mesh, spec)
                    first = False
        return BatchPlan(
            treedef,
            ranks,
            shardings,
            _flat_dict_keys(treedef.unflatten(leaves), with_path),
            signature,
            multiple,
            mask_sharding,
        )

    def padded_size(self, rows: int, plan: "BatchPlan") -> int:
        """Return the batch size that `rows` rows are padded to.

        Raises:
            ValueError: if `rows` is larger than every size of `batch_sizes` (or the
                lowered size), or a listed size does not divide over the devices.
        """
        sizes = self.settings.batch_sizes
        if plan.lowered_rows is not None:
            sizes = (plan.lowered_rows,)
        elif sizes is None:
            return -(-rows // plan.multiple) * plan.multiple
        for size in sizes:
            if size >= rows:
                if size % plan.multiple:
                    raise ValueError(
                        f"`MethodRunner(batch_sizes={sizes})`: the size {size} does "
                        f"not divide over the {plan.multiple} devices the batch is "
                        f"split over; list multiples of {plan.multiple}."
                    )
                return size
        what = (
            "the batch size it was lowered for"
            if plan.lowered_rows is not None
            else f"the largest of `batch_sizes={sizes}`"
        )
        raise ValueError(
            f"`MethodRunner(pad_batches=True)`: a batch of {rows} rows is larger "
            f"than {what} ({sizes[-1]}); split it, or list a larger size."
        )

    def mask(
        self, rows: int, size: int, sharding: NamedSharding, *, tracing: bool
    ) -> Any:
        """Return `bool[size]`, True for the first `rows` rows, placed as `sharding`."""
        host = np.arange(size) < rows
        if tracing:
            return host
        if rows != size:
            return to_global(host, sharding, path=str(self.settings.mask_kwarg))
        mask = self.masks.get((size, sharding))
        if mask is None:
            mask = to_global(host, sharding, path=str(self.settings.mask_kwarg))
            self.masks[(size, sharding)] = mask
        return mask

    def place_kwargs(self, dynamic: Any) -> Any:
        """Replicate array keyword arguments committed to devices off the mesh.

        `jax.jit` refuses an argument committed to another device set (e.g. a
        `jax.device_put(x, jax.devices()[3])`) than the mesh's; arrays already on
        the mesh and NumPy arrays pass as they are.
        """

        def put(x: Any) -> Any:
            if (
                isinstance(x, jax.Array)
                and not isinstance(x, Tracer)
                and x.committed
                and x.sharding.device_set != self.mesh_devices
            ):
                return jax.device_put(x, replicated(self.mesh, x))
            return x

        return jax.tree.map(put, dynamic)

    def split_kwargs(self, kwargs: dict[str, Any]) -> tuple[Any, "Frozen"]:
        """Return the array and the static (frozen) parts of keyword arguments.

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
        dynamic, static = eqx.partition(kwargs, eqx.is_array)
        return dynamic, Frozen(static, what="a keyword argument")

    # -- the call: prepare, run, finish -------------------------------------------

    def call(
        self,
        param_leaves: tuple[Any, ...],
        prng_key: Any,
        input_batch: Any,
        kwargs: dict[str, Any],
    ) -> tuple[Any, Any]:
        """Run one batch; return `(new_key, output)`.

        `MethodRunner.__call__` (which inlines it) and `run_batches` (which threads
        the key through it) run batches this way.
        """
        batch, mask, padding = self.prepare(input_batch)
        if kwargs:
            result = self.run_with_kwargs(param_leaves, prng_key, batch, mask, kwargs)
        else:
            result = self.jitted(param_leaves, prng_key, batch, mask)
        return self.finish(result, batch, padding)

    def run_with_kwargs(
        self,
        param_leaves: tuple[Any, ...],
        prng_key: Any,
        batch: Any,
        mask: Any,
        kwargs: dict[str, Any],
    ) -> tuple[Any, Any, "StaticOut | None"]:
        """Run the step with the method's keyword arguments (static part static)."""
        dynamic, static = self.split_kwargs(kwargs)
        return self.jitted_kwargs(
            static, param_leaves, prng_key, batch, mask, self.place_kwargs(dynamic)
        )

    def finish(
        self,
        result: tuple[Any, Any, "StaticOut | None"],
        batch: Any,
        padding: "Padding | None",
    ) -> tuple[Any, Any]:
        """Return `(new_key, output)` from the program's result: the one output path."""
        new_key, out, extra = result
        if extra is not None:
            out = eqx.combine(out, extra.value)
        output_batch, summaries, module_outputs = out
        if self.donate:
            batch = None
        if padding is not None:
            output_batch, batch = self.unpad((output_batch, batch), padding)
        return new_key, self.output_cls(output_batch, batch, summaries, module_outputs)

    def next_runner(self, runner: Any, param_leaves: Any, new_key: Any) -> Any:
        """Return `runner` with `new_key`, rebuilt through the public PyTree API."""
        rebuild = self.rebuild
        if rebuild is None:
            treedef = jax.tree.structure(runner, is_leaf=lambda x: x is not runner)
            rebuild = self.rebuild = treedef.unflatten
        return rebuild((param_leaves, new_key))

    def unpad(self, tree: Any, padding: "Padding") -> Any:
        """Cut every array leaf whose leading size is the padded one to the rows.

        The cut arrays are replicated (a sharded array must divide over its devices).
        """
        leaves, treedef = _flatten(tree)
        where = [
            i
            for i, x in enumerate(leaves)
            if isinstance(x, jax.Array) and x.ndim and x.shape[0] == padding.size
        ]
        if not where:
            return tree
        cut = _cut([leaves[i] for i in where], padding.rows, self.mesh)
        for i, x in zip(where, cut, strict=True):
            leaves[i] = x
        return treedef.unflatten(leaves)


class Padding(NamedTuple):
    """How a batch was padded: `rows` real rows, padded to `size`."""

    rows: int
    size: int


@functools.partial(jax.jit, static_argnums=(1, 2))
def _cut(leaves: list[jax.Array], rows: int, mesh: Mesh) -> list[jax.Array]:
    explicit = is_explicit(mesh)
    return [constrain(x, replicated(mesh, x), explicit=explicit)[:rows] for x in leaves]


def batch_rows(leaves: list[Any], treedef: Any, ranks: tuple[int, ...]) -> int | None:
    """Return the common leading size of the leaves of rank >= 1 (None: no such leaf).

    Raises:
        ValueError: if they differ (naming the leaves and their sizes).
    """
    sizes = [np.shape(x)[0] for x, r in zip(leaves, ranks, strict=True) if r]
    if not sizes:
        return None
    if any(n != sizes[0] for n in sizes):
        with_path = _flatten_with_path(treedef.unflatten(leaves))[0]
        named = ", ".join(
            f"{path_str(p)!r}: {np.shape(x)[0]}" for p, x in with_path if np.ndim(x)
        )
        raise ValueError(
            "`MethodRunner(pad_batches=..., mask_kwarg=...)`: the batch's leaves "
            f"have different leading (batch) sizes ({named}); padding and the mask "
            "need one batch size. Give every leaf of rank >= 1 the batch axis first."
        )
    return int(sizes[0])


def _pad_rows(x: Any, size: int) -> Any:
    """Return `x` with zero rows appended up to `size` rows (on the host if it can)."""
    if isinstance(x, Tracer):
        widths = [(0, size - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
        return jax.numpy.pad(x, widths)
    local = np.asarray(x)
    zeros = np.zeros((size - local.shape[0], *local.shape[1:]), local.dtype)
    return np.concatenate([local, zeros])


#: Steps per settings (LRU): runners re-created from equal settings share one.
_STEPS: "collections.OrderedDict[Settings, Step]" = collections.OrderedDict()
_MAX_STEPS = 256
_STEPS_LOCK = threading.Lock()


# What `MethodRunner.__call__` compares of each batch leaf with the last batch's: the
# type (a `jax.Array` subclass, not a PyTree with a `.sharding`), the sharding, and the
# rank where the rank rule makes it matter. Read in C by `map`.
_SIGNATURE = operator.attrgetter("__class__", "sharding")
_SIGNATURE_WITH_RANK = operator.attrgetter("__class__", "sharding", "ndim")
# With padding or a mask the batch size matters too.
_SIGNATURE_WITH_SHAPE = operator.attrgetter("__class__", "sharding", "shape")


class BatchPlan:
    """How batches of one structure and leaf ranks are placed (`Step.plans`).

    Attributes:
        treedef: the batch's structure.
        ranks: each leaf's rank.
        shardings: each leaf's sharding (the input partition, the rank rule).
        dict_keys: for a plain dict whose values are all leaves, its keys in leaf
            order (such a batch is checked without flattening it); else None.
        signature: what `Step.prepare` compares of each leaf (`_SIGNATURE...`).
        multiple: the padded batch size is a multiple of this (the number of shards
            of the batch axis).
        mask_sharding: the sharding of the mask (`mask_kwarg`).
        expected: `signature` of each leaf of the last batch placed by this plan.
        mask: the mask that goes with a batch matching `expected`.
        lowered_rows: the batch size of a lowered plan (`CompiledRunner`).
    """

    __slots__ = (
        "dict_keys",
        "expected",
        "lowered_rows",
        "mask",
        "mask_sharding",
        "multiple",
        "ranks",
        "shardings",
        "signature",
        "treedef",
    )

    def __init__(
        self,
        treedef: Any,
        ranks: tuple[int, ...],
        shardings: list[NamedSharding],
        dict_keys: tuple[Any, ...] | None,
        signature: Callable[[Any], Any],
        multiple: int,
        mask_sharding: NamedSharding,
    ):
        self.treedef = treedef
        self.ranks = ranks
        self.shardings = shardings
        self.dict_keys = dict_keys
        self.signature = signature
        self.multiple = multiple
        self.mask_sharding = mask_sharding
        self.expected: list[Any] | None = None
        self.mask: Any = None
        self.lowered_rows: int | None = None


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


def constrain_tree(
    tree: Any, partition: Any, mesh: Mesh, *, what: str, kind: str
) -> Any:
    """Constrain every array of `tree` by `partition` (with the rank rule).

    Runs at trace time. Checks that each leaf's dimensions divide over their mesh
    axes (`kind` is "batch" or "output", for the message): on Auto meshes JAX would
    silently replicate a leaf that does not divide, on Explicit meshes its error
    names no leaf.
    """
    with_path, treedef = _flatten_with_path(tree)
    specs = resolve_specs(partition, tree, mesh, what=what)
    arrays = [i for i, (_, x) in enumerate(with_path) if isinstance(x, jax.Array)]
    shardings = leaf_shardings(
        [specs[i] for i in arrays], [with_path[i] for i in arrays], mesh, kind=kind
    )
    leaves = [x for _, x in with_path]
    placed = constrain_leaves(
        [leaves[i] for i in arrays], shardings, explicit=is_explicit(mesh)
    )
    for i, x in zip(arrays, placed, strict=True):
        leaves[i] = x
    return treedef.unflatten(leaves)


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
    step: Step,
    static_kwargs: Frozen | None,
    param_leaves: tuple[Any, ...],
    prng_key: Any,
    batch: Any,
    mask: Any,
    dynamic_kwargs: Any,
) -> tuple[Any, Any, StaticOut | None]:
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
    kwargs: dict[str, Any] = {}
    if static_kwargs is not None:
        kwargs = eqx.combine(dynamic_kwargs, static_kwargs.tree())
    if settings.mask_kwarg is not None and mask is not None:
        kwargs[settings.mask_kwarg] = mask
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
    summaries = _replicate(ctx.collection.summaries, mesh)
    module_outputs = _replicate(pruned.module_outputs, mesh)
    dynamic, static = eqx.partition(
        (output_batch, summaries, module_outputs), eqx.is_array
    )
    has_static = any(x is not None for x in jax.tree.leaves(static))
    # None (an empty PyTree, unflattened in C++) when every output is an array.
    return new_key, dynamic, StaticOut(static) if has_static else None


def _step_without_kwargs(
    step: Step, param_leaves: tuple[Any, ...], prng_key: Any, batch: Any, mask: Any
) -> tuple[Any, Any, StaticOut | None]:
    return _step(step, None, param_leaves, prng_key, batch, mask, None)

"""Hypothesis strategies and assertion helpers for tests of code that uses eqxctx.

Requires `hypothesis` (the `test` extra): `pip install "eqxctx[test]"`. Use the
strategies with `hypothesis.given`, e.g. `@given(output_collections())`, and compare
collections with `assert_collections_equal(actual, expected)`.
"""

import contextlib
import dataclasses
import random
from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array


try:
    from hypothesis import strategies as st
    from hypothesis.extra import numpy as hnp
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "`eqxctx.testing` needs hypothesis: install it with `pip install "
        "'eqxctx[test]'` (or `pip install hypothesis`)."
    ) from e

from ._assertions import assert_collections_equal
from ._collection import ADDERS, KINDS, OutputCollection, name_in_use
from ._combinators import scan_in_context, vmap_in_context
from ._context import Context
from ._errors import OutputConflictError
from ._media import AudioSummary, CallbackSummary, ImageSummary
from ._moments import MomentsSummary
from ._statistics import HistogramSummary
from ._summary import MaxSummary, MinSummary, Summary, SumSummary, WeightedSummary
from ._typing import ArrayTree, ArrayValue, DType, Leaf


__all__ = [
    "DEFAULT_SUMMARY_KINDS",
    "array_leaves",
    "assert_collections_equal",
    "child_names",
    "contexts",
    "leaf_names",
    "output_collections",
    "summary_leaves",
]

Draw: TypeAlias = Callable[[st.SearchStrategy[Any]], Any]
Strategy: TypeAlias = st.SearchStrategy[Any]

#: The raw-value marker in `summary_kinds`: raw arrays as summary leaves.
RAW = "raw"

#: `RAW` or a `Summary` subclass (`Any`: each kind takes its own fields).
SummaryKind: TypeAlias = Any

#: What `summary_leaves` and `output_collections` draw by default: raw arrays and
#: every built-in `Summary` kind, each shaped as its `validate()` requires.
DEFAULT_SUMMARY_KINDS: tuple[SummaryKind, ...] = (
    RAW,
    WeightedSummary,
    MinSummary,
    MaxSummary,
    SumSummary,
    HistogramSummary,
    MomentsSummary,
    ImageSummary,
    AudioSummary,
    CallbackSummary,
)
# The kinds a scan body adds per iteration (elementwise, stackable).
_STACKABLE = (RAW, WeightedSummary, MinSummary, MaxSummary, SumSummary)

# Characters every writer keeps as they are (TensorBoard turns others into '_').
_WRITER_SAFE = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-"


def child_names() -> st.SearchStrategy[str]:
    """Return a strategy of valid child names (`^[a-z][a-z0-9_]*$`, short)."""
    return st.from_regex(r"\A[a-z][a-z0-9_]{0,5}\Z")


def leaf_names(*, any_printable: bool = False) -> st.SearchStrategy[str]:
    """Return a strategy of valid leaf names (non-empty, no '/', at most 6 long).

    Args:
        any_printable: draw from all printable ASCII characters but '/' (names that
            `OutputCollection` accepts, some of which writers refuse or rename:
            `"step"`, or `"a b"` and `"a_b"`, which get one TensorBoard tag). The
            default draws only names every writer writes as they are: letters,
            digits and `_.-`, never `"step"`.
    """
    if any_printable:
        alphabet = st.characters(
            min_codepoint=33, max_codepoint=126, exclude_characters="/"
        )
        return st.text(alphabet, min_size=1, max_size=6)
    names = st.text(st.sampled_from(_WRITER_SAFE), min_size=1, max_size=6)
    return names.filter(lambda n: n != "step")  # `JsonlWriter`'s own key


def _shapes(max_side: int, max_rank: int) -> st.SearchStrategy[tuple[int, ...]]:
    return hnp.array_shapes(
        min_dims=0, max_dims=max_rank, min_side=1, max_side=max_side
    )


def _elements(dtype: DType) -> st.SearchStrategy[Any]:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return st.booleans()
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return st.integers(max(info.min, -100), min(info.max, 100))
    return st.floats(-100, 100, width=min(dtype.itemsize * 8, 64))


def array_leaves(
    max_side: int = 3,
    max_rank: int = 2,
    *,
    shapes: st.SearchStrategy[tuple[int, ...]] | None = None,
    dtypes: Sequence[Any] = (np.float32,),
) -> st.SearchStrategy[np.ndarray]:
    """Return a strategy of small NumPy arrays with finite values in [-100, 100].

    Args:
        max_side: the largest size of one axis (without `shapes`).
        max_rank: the largest rank (without `shapes`).
        shapes: a strategy of shapes (e.g. `hnp.array_shapes(...)`), instead of
            `max_side`/`max_rank`.
        dtypes: the dtypes to draw from (bool, integer or floating; default
            float32).
    """
    shape_st = _shapes(max_side, max_rank) if shapes is None else shapes

    @st.composite
    def arrays(draw: Draw) -> np.ndarray:
        dtype = np.dtype(draw(st.sampled_from(list(dtypes))))
        shape = draw(shape_st)
        return draw(hnp.arrays(dtype, shape, elements=_elements(dtype)))

    return arrays()


def _plot(x: ArrayValue) -> ArrayValue:
    """A `CallbackSummary` function (module level: one identity for every draw)."""
    return np.sum(np.asarray(x, np.float32))


def summary_leaves(
    *,
    summary_kinds: Sequence[Any] | None = None,
    shapes: st.SearchStrategy[tuple[int, ...]] | None = None,
    dtypes: Sequence[Any] = (np.float32,),
) -> st.SearchStrategy[Any]:
    """Return a strategy of summary leaves: raw arrays and `Summary` kinds.

    Every leaf passes `validate()` and is written by every writer: weights are not
    negative, images are `[batch, height, width(, 1|3|4)]` in `[0, 1]`, audio is
    `[time(, channels)]` in `[-1, 1]`, histograms have 4 buckets over `[-100, 100]`,
    and a `CallbackSummary` sums its argument (one function: two draws accumulate).

    Args:
        summary_kinds: the kinds to draw (default: `DEFAULT_SUMMARY_KINDS`);
            `"raw"` stands for raw arrays. Any other `Summary` subclass (a user's
            kind) is drawn as `kind(value)`, with `value` drawn as a raw array.
        shapes: shapes of raw arrays, of the elementwise kinds' values and of the
            values that the reducing kinds reduce; default: scalars.
        dtypes: dtypes of raw arrays and of `MinSummary`/`MaxSummary`/`SumSummary`
            values; floating ones for `WeightedSummary` means.
    """
    kinds = DEFAULT_SUMMARY_KINDS if summary_kinds is None else tuple(summary_kinds)
    unknown = [
        k
        for k in kinds
        if k != RAW and not (isinstance(k, type) and issubclass(k, Summary))
    ]
    if unknown or not kinds:
        raise ValueError(
            f"`summary_leaves(summary_kinds=...)`: expected `Summary` subclasses or "
            f'"raw", got {list(kinds)!r}.'
        )
    shape_st = st.just(()) if shapes is None else shapes
    values = array_leaves(shapes=shape_st, dtypes=dtypes)
    floats = [d for d in dtypes if np.issubdtype(np.dtype(d), np.floating)]
    means = array_leaves(shapes=shape_st, dtypes=floats or (np.float32,))

    @st.composite
    def leaf(draw: Draw) -> Leaf:
        with _same_random_state():
            return _summary_leaf(draw, draw(st.sampled_from(kinds)), values, means)

    return leaf()


def _weighted(draw: Draw, values: Strategy, means: Strategy) -> Leaf:
    weight = draw(hnp.arrays(np.float32, (), elements=st.floats(0, 10, width=32)))
    return WeightedSummary(draw(means), weight)


def _image(draw: Draw, values: Strategy, means: Strategy) -> Leaf:
    shape = draw(
        st.tuples(
            st.integers(1, 2),
            st.integers(1, 3),
            st.integers(1, 3),
            st.sampled_from([(), (1,), (3,), (4,)]),
        )
    )
    full = shape[:3] + shape[3]
    pixels = st.floats(0, 1, width=32)
    return ImageSummary(draw(hnp.arrays(np.float32, full, elements=pixels)))


def _audio(draw: Draw, values: Strategy, means: Strategy) -> Leaf:
    shape = draw(st.sampled_from([(4,), (4, 1), (4, 2)]))
    wave = draw(hnp.arrays(np.float32, shape, elements=st.floats(-1, 1, width=32)))
    return AudioSummary(wave, sample_rate=8000)


#: Kinds not drawn as `kind(value)` (as `MinSummary`, ..., a user's kind are).
_DRAW: dict[type, Callable[[Draw, Strategy, Strategy], Leaf]] = {
    WeightedSummary: _weighted,
    HistogramSummary: lambda draw, values, means: HistogramSummary(
        draw(values), bins=4, range=(-100, 100)
    ),
    CallbackSummary: lambda draw, values, means: CallbackSummary(_plot, draw(values)),
    ImageSummary: _image,
    AudioSummary: _audio,
}


def _summary_leaf(
    draw: Draw, kind: SummaryKind, values: Strategy, means: Strategy
) -> Leaf:
    """Draw one summary leaf of `kind` (see `summary_leaves`)."""
    if kind == RAW:
        return draw(values)
    make = _DRAW.get(kind)
    return kind(draw(values)) if make is None else make(draw, values, means)


@dataclasses.dataclass(frozen=True)
class _Spec:
    kinds: tuple[str, ...]
    max_width: int
    leaf_names: st.SearchStrategy[str]
    shapes: st.SearchStrategy[tuple[int, ...]]
    dtypes: tuple[Any, ...]
    summary_kinds: tuple[Any, ...]
    iterations: bool


#: What a scan body adds per iteration, for a stackable kind not made as `kind(x)`.
_STACKED: dict[SummaryKind, Callable[[Array], Leaf]] = {
    RAW: lambda x: x,
    WeightedSummary: lambda x: WeightedSummary(
        x.astype(jnp.float32), jnp.ones((), jnp.float32)
    ),
}


def _stacked_leaf(kind: SummaryKind, x: Array) -> Leaf:
    """What a scan body adds per iteration for `kind`, from its slice `x`."""
    make = _STACKED.get(kind)
    return kind(x) if make is None else make(x)


@contextlib.contextmanager
def _same_random_state() -> Generator[None]:
    """Leave Python's `random` state as it was (hypothesis checks it in strategies).

    Runtime type checkers (beartype) check one random item of a list with `random`.
    """
    state = random.getstate()
    try:
        yield
    finally:
        random.setstate(state)


@st.composite
def _iteration_entry(draw: Draw, spec: _Spec) -> OutputCollection:
    """A collection made by running `scan_in_context` or `vmap_in_context`."""
    prefix = draw(child_names())
    length = draw(st.integers(0, 3))
    stackable = [k for k in spec.summary_kinds if k in _STACKABLE]
    names = draw(st.lists(spec.leaf_names, max_size=3, unique=True))
    kinds = {n: draw(st.sampled_from(stackable)) for n in names} if stackable else {}
    nested = draw(st.booleans())
    merge = draw(st.sampled_from([False, False, True]))
    combinator = draw(st.sampled_from(["scan", "scan", "vmap"]))
    batch = draw(st.sampled_from([None, None, 2]))
    outputs = [k for k in ("module_outputs", "state_updates") if k in spec.kinds]
    dtype = np.dtype(draw(st.sampled_from(spec.dtypes)))
    outer = () if batch is None else (batch,)
    n = max(length, 1) if combinator == "vmap" else length
    xs = draw(hnp.arrays(dtype, (*outer, n, 2), elements=_elements(dtype)))

    def body(x: Array, ctx: Context) -> Context:
        for name, kind in kinds.items():
            ctx = ctx.add_summary(name, _stacked_leaf(kind, x[0]))
        for kind in outputs:
            ctx = getattr(ctx, ADDERS[kind])("x", x)
        if nested:
            _, _, inner = scan_in_context(
                lambda c, y, ictx: (c, None, ictx.add_summary("y", y)),
                context=ctx,
                carry=(),
                xs=x,
            )
            ctx = ctx.merge(inner)
        return ctx

    def run(xs_: ArrayTree) -> OutputCollection:  # NumPy, or traced by `jax.vmap`
        ctx = Context.root()
        if combinator == "vmap":
            return vmap_in_context(
                lambda x, c: (None, body(x, c)),
                context=ctx,
                xs=xs_,
                child_name_prefix=prefix,
                merge_summaries=merge,
            )[1]
        return scan_in_context(
            lambda c, x, ictx: (c, None, body(x, ictx)),
            context=ctx,
            carry=(),
            xs=xs_,
            child_name_prefix=prefix,
            merge_summaries=merge,
        )[2]

    if "summaries" not in spec.kinds:
        kinds.clear()
        nested = False
    if nested:  # the nested scan's child `iter` and its `iter{i}` are reserved
        kinds = {n: k for n, k in kinds.items() if not n.startswith("iter")}
    with _same_random_state():
        return run(xs) if batch is None else jax.vmap(run)(xs)


@st.composite
def _collection(draw: Draw, depth: int, spec: _Spec) -> OutputCollection:
    coll = OutputCollection.empty()
    n = draw(st.integers(0, spec.max_width))
    choices: tuple[str, ...] = spec.kinds
    if depth > 0:
        choices += ("child",) + (("iterations",) if spec.iterations else ())
    if not choices:
        return coll
    for _ in range(n):
        choice = draw(st.sampled_from(choices))
        if choice == "iterations":
            entry = draw(_iteration_entry(spec))
            with _same_random_state(), contextlib.suppress(OutputConflictError):
                coll = coll.merge(entry)
            continue
        if choice == "child":
            name = draw(child_names())
            if name_in_use(coll, name) or name in coll.child_names():
                continue
            child = draw(_collection(depth - 1, spec))
            with _same_random_state():
                coll = coll.add_child(name, child)
            continue
        name = draw(spec.leaf_names)
        if name in coll.child_names() or name in getattr(coll, choice):
            continue
        if choice == "summaries":
            value = draw(
                summary_leaves(
                    summary_kinds=spec.summary_kinds,
                    shapes=spec.shapes,
                    dtypes=spec.dtypes,
                )
            )
        else:
            value = draw(array_leaves(shapes=spec.shapes, dtypes=spec.dtypes))
        # `OutputConflictError`: a reserved `{prefix}{i}`.
        with _same_random_state(), contextlib.suppress(OutputConflictError):
            coll = getattr(coll, ADDERS[choice])(name, value)
    return coll


def output_collections(
    max_depth: int = 2,
    max_width: int = 4,
    *,
    kinds: Sequence[str] = KINDS,
    leaf_names: st.SearchStrategy[str] | None = None,
    shapes: st.SearchStrategy[tuple[int, ...]] | None = None,
    dtypes: Sequence[Any] = (np.float32,),
    summary_kinds: Sequence[Any] | None = None,
    iterations: bool = True,
) -> st.SearchStrategy[OutputCollection]:
    """Return a strategy of valid `OutputCollection`s built through the public API.

    Each level holds up to `max_width` entries: leaves of the three kinds, children
    (down to `max_depth`), and the collections of `scan_in_context` and
    `vmap_in_context` calls (0 to 3 iterations), made by running them, also nested
    and under an outer `jax.vmap`. By default every collection is accepted by every
    writer, `SummaryAccumulator.update` and `jax.jit`.

    Args:
        max_depth: the deepest nesting of children.
        max_width: the most entries (leaves, children or scan results) per level.
        kinds: the kinds of leaves to draw, among `"summaries"`, `"state_updates"`
            and `"module_outputs"` (scan results hold only these kinds, too).
        leaf_names: a strategy of leaf names (default: `leaf_names()`, names every
            writer writes as they are). Names must be valid (non-empty, no "/").
        shapes: a strategy of shapes of the array leaves (default: rank 0 to 2,
            sides 1 to 3); summaries get shape `()` unless given.
        dtypes: the dtypes of array leaves (default float32).
        summary_kinds: the summary kinds to draw (see `summary_leaves`; default
            `DEFAULT_SUMMARY_KINDS`).
        iterations: include the results of `scan_in_context`/`vmap_in_context`
            calls (each is traced).

    Raises:
        ValueError: for an unknown kind or summary kind.
    """
    bad = [k for k in kinds if k not in KINDS]
    if bad or isinstance(kinds, str):
        raise ValueError(
            f"`output_collections(kinds=...)`: expected some of {KINDS}, got {kinds!r}."
        )
    spec = _Spec(
        kinds=tuple(kinds),
        max_width=max_width,
        leaf_names=_default_leaf_names() if leaf_names is None else leaf_names,
        shapes=_shapes(3, 2) if shapes is None else shapes,
        dtypes=tuple(dtypes),
        summary_kinds=(
            DEFAULT_SUMMARY_KINDS if summary_kinds is None else tuple(summary_kinds)
        ),
        iterations=iterations,
    )
    summary_leaves(summary_kinds=spec.summary_kinds)  # checks the kinds
    return _collection(max_depth, spec)


_default_leaf_names = leaf_names


def contexts(
    *,
    max_path: int = 2,
    keys: Sequence[str | None] = ("raw", "typed", None),
    is_training: st.SearchStrategy[bool] | None = None,
    collections: st.SearchStrategy[OutputCollection] | None = None,
) -> st.SearchStrategy[Context]:
    """Return a strategy of `Context`s: random paths, keys, training flags, outputs.

    A context is a root (a random valid name) and 0 to `max_path` children below
    it (`Context.child`), with its collection replaced by a drawn one, as a
    context handed to a model method would be.

    Args:
        max_path: the most names below the root.
        keys: the key kinds to draw: `"raw"` (`jax.random.PRNGKey(seed)`),
            `"typed"` (`jax.random.key(seed)`) and None (no key).
        is_training: a strategy of training flags (default: `st.booleans()`).
        collections: a strategy of collections (default: `output_collections()`).

    Raises:
        ValueError: for an unknown key kind.
    """
    bad = [k for k in keys if k not in ("raw", "typed", None)]
    if bad or not keys:
        raise ValueError(
            "`contexts(keys=...)`: expected some of 'raw', 'typed', None, got "
            f"{keys!r}."
        )
    training = st.booleans() if is_training is None else is_training
    colls = output_collections() if collections is None else collections

    @st.composite
    def context(draw: Draw) -> Context:
        kind = draw(st.sampled_from(list(keys)))
        seed = draw(st.integers(0, 2**31 - 1))
        make_key = {"raw": jax.random.PRNGKey, "typed": jax.random.key}.get(kind)
        key = None if make_key is None else make_key(seed)
        training_flag, root = draw(training), draw(child_names())
        names, coll = draw(st.lists(child_names(), max_size=max_path)), draw(colls)
        with _same_random_state():
            ctx = Context.root(prng_key=key, is_training=training_flag, name=root)
            for name in names:
                ctx = ctx.child(name)
            return ctx.replace_collection(coll)

    return context()

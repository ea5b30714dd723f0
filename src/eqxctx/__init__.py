"""eqxctx: AXLearn's invocation contexts for Equinox, as explicit immutable PyTrees."""

from ._aot import (
    CompiledRunner as CompiledRunner,
    LoweredRunner as LoweredRunner,
)
from ._batches import (
    SummaryAccumulator as SummaryAccumulator,
    run_batches as run_batches,
)
from ._capture import (
    HookPoint as HookPoint,
    Intervention as Intervention,
    Tap as Tap,
    add_vector as add_vector,
    apply_function as apply_function,
    capture as capture,
    capture_value_and_grad as capture_value_and_grad,
    hook_points as hook_points,
    mean_ablate as mean_ablate,
    replace_with as replace_with,
    zero_ablate as zero_ablate,
)
from ._collection import OutputCollection as OutputCollection
from ._combinators import (
    scan_in_context as scan_in_context,
    vmap_in_context as vmap_in_context,
)
from ._context import Context as Context
from ._control import (
    cond_in_context as cond_in_context,
    switch_in_context as switch_in_context,
)
from ._errors import (
    LostOutputError as LostOutputError,
    OutputConflictError as OutputConflictError,
)
from ._functional import functional as functional
from ._iterations import IterationSummaries as IterationSummaries
from ._loops import (
    fori_in_context as fori_in_context,
    while_in_context as while_in_context,
)
from ._media import (
    AudioSummary as AudioSummary,
    CallbackSummary as CallbackSummary,
    ImageSummary as ImageSummary,
)
from ._moments import MomentsSummary as MomentsSummary
from ._partition import DataPartition as DataPartition
from ._propagate import (
    propagate_repeated_output_collections as propagate_repeated_output_collections,
)
from ._runner import MethodRunner as MethodRunner
from ._statistics import HistogramSummary as HistogramSummary
from ._summary import (
    MaxSummary as MaxSummary,
    MinSummary as MinSummary,
    Summary as Summary,
    SumSummary as SumSummary,
    WeightedSummary as WeightedSummary,
)
from ._transfer import to_host as to_host
from ._value_and_grad import value_and_grad as value_and_grad


__version__ = "0.1.0"

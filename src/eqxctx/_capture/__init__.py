"""Capture and intervene on unmodified Equinox models (see `docs/instrumenting.md`).

`_points`: hook points and selections; `_interventions`: what a point can do to its
output; `_tap`: `Tap` and the wrapper module put in place of a selected point, with
its on-device recording; `_refs`: the `jax.ref` buffers of the ref path and the
rule that chooses it; `_session`: one capture's shape pass, sinks, buffers and
layout; `_run`: `capture` and `capture_value_and_grad`.
"""

from ._interventions import (
    Intervention as Intervention,
    add_vector as add_vector,
    apply_function as apply_function,
    mean_ablate as mean_ablate,
    replace_with as replace_with,
    zero_ablate as zero_ablate,
)
from ._points import HookPoint as HookPoint, hook_points as hook_points
from ._run import capture as capture, capture_value_and_grad as capture_value_and_grad
from ._tap import Tap as Tap

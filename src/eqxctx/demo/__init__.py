"""The main job: `python -m eqxctx.demo` trains and evaluates a model with eqxctx.

It trains a residual Equinox classifier (an embedding, `--layers` blocks with stacked
parameters run by `eqxctx.scan_in_context`, a head) on scikit-learn's 8x8 handwritten
digits with optax's Adam under `eqx.filter_jit` and `eqxctx.functional`, evaluates it
with an `eqxctx.MethodRunner` sharded over `--devices` simulated CPU devices, and
writes the summaries (`eqxctx.writers`) and a plot into a new run folder under
`--logdir`. Run `python -m eqxctx.demo --help` for the flags; see `docs/demo.md`.
"""

"""Exception classes of eqxctx and their long messages."""


class OutputConflictError(ValueError):
    """A name is added twice to one level of an `OutputCollection`.

    Raised by `OutputCollection.add_summary` / `add_state_update` /
    `add_module_output` / `add_child` / `merge`, by `Context.call` when one child name
    is called twice, and by `Context.merge` when a scan's collection collides with the
    caller's (for example two `scan_in_context` calls with the same
    `child_name_prefix`, or two `cond_in_context` calls with the same `child_name`).
    The message names the offending path and says what to do.

    AXLearn silently overwrites summaries that are added twice; eqxctx never loses data
    silently, so it raises instead.
    """


CALL_TWICE_HINT = (
    "A child name can be called only once per context, because its outputs are stored "
    "under that name. To call a module several times, give each call its own name "
    "(e.g. `ctx.call('layer0', ...)`, `ctx.call('layer1', ...)`), or run the repeated "
    "calls with `eqxctx.scan_in_context` / `eqxctx.vmap_in_context`, which stack the "
    "outputs of every iteration."
)

PREFIX_HINT = (
    "If this collection comes from `scan_in_context` or `vmap_in_context`, pass "
    "another `child_name_prefix=` so that its children (`{prefix}`, `{prefix}0`, "
    "`{prefix}1`, ...) do not collide with names already in the context; if it "
    "comes from `cond_in_context`, `switch_in_context`, `while_in_context` or "
    "`fori_in_context`, pass another `child_name=`."
)


class LostOutputError(ValueError):
    """An output added to a context does not reach the collection that is returned.

    Contexts are immutable: `ctx.add_summary(...)` returns a new context, and an
    add whose result is dropped, a context extended along two lines of which only
    one is returned, or a combinator's collection that is never merged
    (`ctx.merge(coll)`) would lose outputs silently. Raised when the body that
    was handed the context returns (`functional`, `value_and_grad`, a
    `MethodRunner` step, `Context.call`, and every scan, vmap, branch and loop
    body), at trace time. The message names each lost entry's path and kind, the
    file and line that added it, and the fix; `Context.discard` drops outputs on
    purpose.
    """

"""Ledger: what one body added to its context, checked when the body returns.

No output is lost silently (issue 37): contexts are immutable, so an add whose
result is dropped (`ctx.add_summary(...)` without `ctx = `), a context extended
along two lines of which one is returned, or a combinator's collection never
merged would vanish without a word. The call that makes a context for a body
(`functional`, `value_and_grad`, a runner step, `ctx.call`, each combinator body)
gives its frame a fresh `Ledger`; adds record what they added; the call checks the
returned collection against it. The ledger belongs to that one call: no global or
thread-local state.
"""

from types import CodeType

from ._collection import OutputCollection
from ._errors import LostOutputError
from ._iterations import IterationSummaries
from ._mapping import EMPTY, FrozenMapping
from ._sites import call_site


#: One record: (what, its top-level entries as (level, name, id of the object),
#: whether it holds any leaf, code, line). `what` is a kind ("summaries", ...),
#: "call" (a child), "merge" (`ctx.merge`), "result" (a combinator's collection),
#: "replace" (`replace_collection`) or "discard" (`Context.discard`). Only ids
#: are kept: an add inside a nested JAX trace must not keep its tracers alive.
Entry = tuple[str, tuple[tuple[str, str, int], ...], bool, CodeType | None, int]

_KINDS = ("summaries", "state_updates", "module_outputs")


def _top(coll: OutputCollection) -> tuple[tuple[str, str, int], ...]:
    return tuple(
        (k, n, id(v)) for k in _KINDS for n, v in getattr(coll, k).items_list()
    )


def _kept(level: object) -> bool:
    """Whether a child's `level` holds a leaf: its own entries first, then deeper."""
    if level is EMPTY or not isinstance(level, FrozenMapping):
        return False
    nested: list[FrozenMapping] = []
    for value in level.values():
        if isinstance(value, FrozenMapping):
            nested.append(value)
        elif not isinstance(value, IterationSummaries) or (
            value.length and value.ndims
        ):
            return True
    return any(_kept(m) for m in nested)


class Ledger(list[Entry]):
    """The records of one body's adds, in order (see the module docstring)."""

    __slots__ = ()

    def record(self, what: str, arg: object, new: OutputCollection) -> None:
        """Record an add of `arg` (`what`) that made `new`, with the user's line.

        `arg`: the name added (a kind, "call") or the collection ("merge",
        "result", "discard").
        """
        if type(arg) is str:
            level = new.summaries if what == "call" else getattr(new, what)
            value = level.get(arg)
            pairs = (("summaries" if what == "call" else what, arg, id(value)),)
            # A child whose body kept nothing (no leaf, at any depth) loses nothing.
            full = what != "call" or (
                _kept(value)
                or _kept(new.state_updates.get(arg))
                or _kept(new.module_outputs.get(arg))
            )
        elif isinstance(arg, OutputCollection):
            pairs, full = _top(arg), not arg.is_empty()
        else:  # "replace"
            pairs, full = (), False
        code, line = call_site(2)
        self.append((what, pairs, full, code, line))

    def lost(self, coll: OutputCollection, exact: bool) -> list[Entry]:
        """The recorded entries missing from `coll` (and not discarded).

        `exact`: `coll` comes from this ledger's contexts, so entries must be the
        very objects added (which also catches a context extended along two lines);
        otherwise (a context rebuilt by a JAX transformation, or after
        `replace_collection`) their names must be present.
        """
        out: list[Entry] = []
        replaced = discarded = False
        for entry in self:  # one pass, no generators: this runs for every body
            what = entry[0]
            if what == "replace":
                replaced = True
            elif what == "discard":
                discarded = True
            elif entry[2] and not _has(coll, entry[1], exact):
                out.append(entry)
        if not out:
            return out
        if replaced and exact:
            return self.lost(coll, False)
        if discarded:
            kept = [e[1] for e in self if e[0] == "discard"]
            dropped = {p if exact else p[:2] for pairs in kept for p in pairs}
            out = [
                e
                for e in out
                if not all((p if exact else p[:2]) in dropped for p in e[1])
            ]
        return out


def _has(
    coll: OutputCollection, pairs: tuple[tuple[str, str, int], ...], exact: bool
) -> bool:
    if exact and len(pairs) == 1:  # an add or a call: the common case
        k, n, i = pairs[0]
        return id(getattr(coll, k).get(n)) == i
    if exact:
        return all(id(getattr(coll, k).get(n)) == i for k, n, i in pairs)
    return all(n in getattr(coll, k) for k, n, _ in pairs)


_WHAT = {
    "summaries": "summary",
    "state_updates": "state update",
    "module_outputs": "module output",
    "call": "child (ctx.call)",
}


def lost_error(lost: list[Entry], what: str, path: str) -> LostOutputError:
    """The error naming each lost entry, where it was added and the fix."""
    lines: list[str] = []
    for kind, pairs, _, code, line in lost[:8]:
        where = "?" if code is None else f"{code.co_filename}:{line}"
        if kind in ("merge", "result"):
            names = sorted({n for _, n, _ in pairs})
            desc = f"{path}/{names}: " + (
                "a combinator's collection, never merged"
                if kind == "result"
                else "a collection merged with `ctx.merge`"
            )
        else:
            desc = f"{_WHAT[kind]} {path}/{pairs[0][1]}"
        lines.append(f"  - {desc}, at {where}")
    more = f"\n  ... and {len(lost) - 8} more" if len(lost) > 8 else ""
    return LostOutputError(
        f"{what} returned a context that lacks outputs added at {path!r}; they "
        "would be lost silently:\n" + "\n".join(lines) + more + "\nContexts are "
        "immutable: keep each new one (`ctx = ctx.add_summary(...)`, `y, ctx = "
        "ctx.call(...)`), merge each combinator's collection (`ctx = "
        "ctx.merge(coll)`), and return the context that holds them all. To drop "
        "outputs on purpose, call `ctx.discard()` on the context holding them."
    )


def unreturned(
    ledger: Ledger | None, returned: Ledger | None, collection: OutputCollection
) -> list[Entry]:
    """What `ledger`'s body added that `collection` (returned) lacks; [] clears it.

    `returned` is the ledger of the returned context's frame: the same ledger means
    the context came from the body's own adds, so entries are compared by identity.
    """
    if not ledger:
        return []
    lost = ledger.lost(collection, returned is ledger)
    if not lost:
        ledger.clear()  # checked
    return lost

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

import os
import sys
from pathlib import Path
from types import CodeType, FrameType

from ._collection import OutputCollection
from ._errors import LostOutputError
from ._iterations import has_leaf
from ._mapping import FrozenMapping


#: One record: (what, name or collection, the collection right after it, code, line).
#: `what` is a kind ("summaries", ...), "call" (a child), "merge" (`ctx.merge`),
#: "result" (a combinator's collection), "replace" (`replace_collection`) or
#: "discard" (`Context.discard`).
Entry = tuple[str, object, OutputCollection, CodeType | None, int]

_KINDS = ("summaries", "state_updates", "module_outputs")
# The level where a named entry is looked up (a child is in all three).
_LEVEL = {k: k for k in _KINDS} | {"call": "summaries"}
_HERE = Path(__file__).parent
# Frames skipped to find the user's line: eqxctx's private modules, and the
# wrappers of runtime type checkers (jaxtyping, beartype: "<@beartype(...)>").
_INTERNAL = {str(p) for p in _HERE.glob("_*.py")} | {
    str(p) for p in (_HERE / "_capture").glob("*.py")
}
_CHECKERS = (f"{os.sep}jaxtyping{os.sep}", f"{os.sep}beartype{os.sep}")
# Whether a file's frames are skipped, by file name (a memo of `_skipped`).
_SKIP: dict[str, bool] = {}


def _skipped(file: str) -> bool:
    return file in _INTERNAL or file[:1] == "<" or any(c in file for c in _CHECKERS)


class Ledger(list[Entry]):
    """The records of one body's adds, in order (see the module docstring)."""

    __slots__ = ()

    def record(self, what: str, arg: object, new: OutputCollection) -> None:
        """Record an add of `arg` (`what`) that made `new`, with the user's line."""
        f: FrameType | None = sys._getframe(2)  # pyright: ignore[reportPrivateUsage]
        while f is not None:
            file = f.f_code.co_filename
            skip = _SKIP.get(file)
            if skip is None:
                skip = _SKIP[file] = _skipped(file)
            if not skip:
                self.append((what, arg, new, f.f_code, f.f_lineno))
                return
            f = f.f_back
        self.append((what, arg, new, None, 0))

    def lost(self, coll: OutputCollection, exact: bool) -> list[Entry]:
        """The recorded entries missing from `coll` (and not discarded).

        `exact`: `coll` comes from this ledger's contexts, so entries must be the
        very objects added (which also catches a context extended along two lines);
        otherwise (a context rebuilt by a JAX transformation, or after
        `replace_collection`) their names must be present.
        """
        out: list[Entry] = []
        for entry in self:
            what, arg, new = entry[0], entry[1], entry[2]
            if exact and type(arg) is str:  # the common case, first
                level = _LEVEL[what]
                if getattr(coll, level).get(arg) is getattr(new, level).get(arg):
                    continue
            if what not in ("replace", "discard"):
                out.append(entry)
        if not out:
            return out
        if any(e[0] == "replace" for e in self):
            exact = False
        targets = (coll, *(e[1] for e in self if e[0] == "discard"))
        return [e for e in out if _lost(e, targets, exact)]  # pyright: ignore[reportArgumentType]


def _lost(entry: Entry, targets: tuple[OutputCollection, ...], exact: bool) -> bool:
    what, arg, new, _, _ = entry
    if isinstance(arg, OutputCollection):  # "merge", "result"
        pairs = [(k, n, v) for k in _KINDS for n, v in getattr(arg, k).items_list()]
    else:
        assert isinstance(arg, str)
        pairs = [(_LEVEL[what], arg, getattr(new, _LEVEL[what]).get(arg))]
    for target in targets:
        if all(
            (getattr(target, k).get(n) is v) if exact else (n in getattr(target, k))
            for k, n, v in pairs
        ):
            return False
    # Nothing is lost with an empty child or collection.
    if isinstance(arg, OutputCollection):
        return not arg.is_empty()
    if what == "call":
        levels = [getattr(new, k).get(arg) for k in _KINDS]
        return any(has_leaf(m) for m in levels if isinstance(m, FrozenMapping))
    return True


_WHAT = {
    "summaries": "summary",
    "state_updates": "state update",
    "module_outputs": "module output",
    "call": "child (ctx.call)",
}


def lost_error(lost: list[Entry], what: str, path: str) -> LostOutputError:
    """The error naming each lost entry, where it was added and the fix."""
    lines: list[str] = []
    for kind, arg, _, code, line in lost[:8]:
        where = "?" if code is None else f"{code.co_filename}:{line}"
        if isinstance(arg, OutputCollection):
            names = sorted({n for k in _KINDS for n in getattr(arg, k)})
            desc = f"{path}/{names}: " + (
                "a combinator's collection, never merged"
                if kind == "result"
                else "a collection merged with `ctx.merge`"
            )
        else:
            desc = f"{_WHAT[kind]} {path}/{arg}"
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

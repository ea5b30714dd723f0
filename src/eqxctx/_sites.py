"""The user's call site: the first frame outside eqxctx (for error messages).

Shared by the ledger (where an output was added) and the gradient probes (where a
probe was added), so the two name the same line.
"""

import os
import sys
from pathlib import Path
from types import CodeType, FrameType


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


def call_site(depth: int) -> tuple[CodeType | None, int]:
    """The code and line of the first frame outside eqxctx, `depth` frames up or more.

    `depth` 1 starts at the caller's caller. `(None, 0)` if every frame is eqxctx's.
    """
    f: FrameType | None = sys._getframe(depth + 1)  # pyright: ignore[reportPrivateUsage]
    while f is not None:
        file = f.f_code.co_filename
        skip = _SKIP.get(file)
        if skip is None:
            skip = _SKIP[file] = _skipped(file)
        if not skip:
            return f.f_code, f.f_lineno
        f = f.f_back
    return None, 0

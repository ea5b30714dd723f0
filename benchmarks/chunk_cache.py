"""Emulate CPython's fix of python/cpython#142183 in this process (benchmarks only).

CPython 3.11 to 3.13.x before March 2026 keep a thread's frames in 16 KiB chunks and
unmap a chunk as soon as the frame at its start returns, so a call depth that keeps
crossing a chunk's start maps, faults in and unmaps a chunk each time
(benchmarks/README.md, bench_trace 1e). The fix keeps one chunk per thread.
`install()` compiles `chunk_cache.c` (needs a C compiler) and makes it CPython's arena
allocator: one freed 16 KiB block is kept for the next request of that size, every
other block is mapped and unmapped as before. Frame chunks are the only 16 KiB blocks
CPython asks of that allocator (pymalloc's arenas are 1 MiB from 3.10 on).
"""

import ctypes
import hashlib
import pathlib
import shutil
import subprocess
import sys


_SOURCE = pathlib.Path(__file__).with_name("chunk_cache.c")
_lib: ctypes.CDLL | None = None  # kept alive while installed


class _ArenaAllocator(ctypes.Structure):
    # PyObjectArenaAllocator: ctx, alloc(ctx, size), free(ctx, ptr, size).
    _fields_ = [
        ("ctx", ctypes.c_void_p),
        ("alloc", ctypes.c_void_p),
        ("free", ctypes.c_void_p),
    ]


def _build() -> pathlib.Path:
    source = _SOURCE.read_bytes()
    tag = hashlib.sha256(source).hexdigest()[:12]
    out = pathlib.Path(__file__).parent.parent / "runs" / "chunk_cache" / f"{tag}.so"
    if out.exists():
        return out
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("--chunk-cache needs a C compiler (cc or gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [compiler, "-O2", "-shared", "-fPIC", "-o", str(out), str(_SOURCE)], check=True
    )
    return out


def install() -> None:
    """Make the chunk-keeping allocator CPython's arena allocator (idempotent)."""
    global _lib
    if _lib is not None:
        return
    if sys.implementation.name != "cpython":
        raise SystemExit("--chunk-cache needs CPython")
    lib = ctypes.CDLL(str(_build()))
    alloc = ctypes.cast(lib.chunk_cache_alloc, ctypes.c_void_p).value
    free = ctypes.cast(lib.chunk_cache_free, ctypes.c_void_p).value
    allocator = _ArenaAllocator(None, alloc, free)
    # CPython copies the struct; the library must stay loaded.
    ctypes.pythonapi.PyObject_SetArenaAllocator(ctypes.byref(allocator))
    _lib = lib


def counts() -> tuple[int, int]:
    """(16 KiB blocks mapped, requests served from the cache) since `install()`."""
    if _lib is None:
        return (0, 0)
    _lib.chunk_cache_mapped.restype = ctypes.c_ulong
    _lib.chunk_cache_reused.restype = ctypes.c_ulong
    return (int(_lib.chunk_cache_mapped()), int(_lib.chunk_cache_reused()))

"""glibc malloc settings for XLA:CPU's per-step buffers, applied once when jaxinfer is imported.

Why: XLA:CPU allocates each execution's buffers (outputs and one temporary buffer for its intermediates) with
``posix_memalign``, from the worker thread that runs the program. glibc serves a request that large (a prefill
step's temporary buffer: ~100 MB for the benchmark model's [16, 64] grid, ~450 MB for hidden 1024) from a fresh
``mmap``: the per-thread arenas always do, and the main arena does above its mmap threshold (32 MB at most). The
memory goes back to the kernel when the step ends, so every step faults its buffers in again, 4 KiB at a time:
~50,000 page faults per batch-32 prefill of the benchmark model, ~10% of its time (docs/benchmarks.md "Host memory
(CPU)"). With one arena, no mmap-served chunks and freed memory kept (below), the second step reuses the first
one's pages: ~10 faults.

Settings (``mallopt``, glibc's malloc.h): M_ARENA_MAX 1 (every thread allocates from the main arena; a thread
that already has an arena keeps it, hence at import, before XLA's worker threads first allocate), M_MMAP_MAX 0 (no
chunk is its own mapping), M_TRIM_THRESHOLD 1 GiB (up to that much free memory at the heap's top is kept for the
next step). The cost: freed memory is reused, not returned to the kernel (``malloc_trim(0)`` returns it), so a
process keeps its step buffers, plus a buffer or two the heap grows by when other threads' small allocations take
pieces of a freed one (hidden 1024, batch-32 prefill: peak 2.82 -> 3.21 GB, resident after 2.2 -> 3.1 GB); and the
threads share one arena's lock, which a process of a few threads does not feel. vLLM's CPU backend asks for
TCMalloc (LD_PRELOAD) for the same kind of reason; a preload cannot be set from inside the process.

One arena also serializes other threads' allocations: ``tokenizers``' batch encoding (a thread pool allocating at
every token) ran at 0.56-0.66x of encoding sequentially on it, so jaxinfer's Tokenizer encodes large jobs in worker
processes while the arenas are limited (``ONE_ARENA``; engine/tokenizer_workers.py, docs/benchmarks.md
"Tokenization"). Starting that pool before the limit (its threads keep their own arenas) is not a way out: threads
started after the limit are then handed the existing arenas in turn, XLA's among them, and a non-main arena maps a
large buffer afresh every time.

Not applied: off Linux/glibc, when ``JAXINFER_MALLOC=default``, or when the environment already configures glibc's
malloc (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_MAX_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``): those are the
user's. No library sets these (they are process-wide allocator knobs), hence this module.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 1 << 30))
USER_VARIABLES = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
ONE_ARENA = False  # set once tune_malloc has limited this process to one arena


def tune_malloc(environ=os.environ) -> bool:
    """Applies SETTINGS unless the module doc says not to; True when they were applied."""
    if environ.get("JAXINFER_MALLOC", "") == "default" or any(v in environ for v in USER_VARIABLES):
        return False
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    global ONE_ARENA
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    applied = all(mallopt(option, value) == 1 for option, value in SETTINGS)
    ONE_ARENA = ONE_ARENA or applied
    return applied


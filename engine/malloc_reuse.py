"""glibc's malloc set to keep a CPU engine's freed activation buffers for the next step.

Why: a prefill step allocates activations of several MiB (a 1,024-token SmolLM2 chunk's MLP input is 12 MiB).
glibc serves a block above its mmap threshold (128 KiB at first, raised to at most 32 MiB as such blocks are
freed) with a fresh `mmap`, and hands freed memory at the top of a heap back to the kernel past its trim
threshold. Each step then page-faults its activations in again, each page zeroed by the kernel: in `perf`,
~10% of a 1,024-token prefill on the 2-core VM was kernel time in clear_page and exc_page_fault
(docs/benchmarks.md: 639-696 -> 576-584 ms with the settings below).

How: `mallopt(M_MMAP_THRESHOLD, 32 MiB)` (glibc's maximum: larger blocks are still mapped and unmapped) and
`mallopt(M_TRIM_THRESHOLD, 2 GiB)`, once per process, before the first step. Freed memory stays in the process
for reuse, as torch's CUDA caching allocator keeps it on a GPU: the resident size stays at the largest step's
activations. Not glibc (musl, macOS), or `TGI_HPC_MALLOC_REUSE=0`: nothing changes.
"""
from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

ENV = "TGI_HPC_MALLOC_REUSE"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20                     # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = (1 << 31) - 1                # mallopt takes an int
_applied: bool | None = None


def glibc_mallopt():
    """The C library's `mallopt(param, value)` (nonzero when taken), typed; None where it has none."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def apply() -> bool:
    """Set both thresholds (once per process); True when glibc took them."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(ENV, "1") == "0":
        logger.info("malloc: left at glibc's defaults (%s=0)", ENV)
        return False
    mallopt = glibc_mallopt()
    if mallopt is None:
        return False
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if _applied:
        logger.info("malloc: freed activations kept for reuse (mmap threshold %d MiB, trim threshold %d MiB)",
                    MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return _applied

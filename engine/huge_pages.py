"""Host tensors on transparent huge pages: the fused CPU decode step's packed weights (engine/cpu_decode_step.py).

Why: a CPU decode step streams every weight once. On 4 KiB pages every 4 KiB is a TLB entry, a page walk when it
misses, and a boundary where the hardware prefetchers stop; on 2 MiB pages the same bytes are 512 times fewer
entries. Linux gives a region huge pages when transparent huge pages are `always`, or `madvise` (the usual default,
and this VM's) and the region asked with `madvise(MADV_HUGEPAGE)`. torch's CPU allocator does not ask. The few-row
GEMV over SmolLM2's 121 linears: 9.9 -> 8.9 ms at one row, 14.9 -> 13.9 ms at 16 (docs/benchmarks.md).
The KV cache stays on torch's allocator: on huge pages, a served run that keeps writing fresh blocks was slower
(each first touch zeroes 2 MiB inside the step; measured in docs/benchmarks.md).

How: an anonymous mapping, its start rounded up to 2 MiB, advised `MADV_HUGEPAGE` before the first touch, and a
tensor over it (`torch.frombuffer` holds the mapping until the last view of it is gone). The memory is zeroed and
committed on first touch, as `torch.empty`'s. Where the mapping or the advice fails (another OS, THP `never`), or
`TGI_HPC_HUGE_PAGES=0`, it is a plain `torch.empty`.
"""
from __future__ import annotations

import math
import mmap
import os

import torch

HUGE_PAGE = 2 << 20
ENV = "TGI_HPC_HUGE_PAGES"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A contiguous CPU tensor of `shape` (zeros) whose memory starts on a 2 MiB boundary and asks for huge pages."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not enabled():
        return torch.empty(*shape, dtype=dtype)
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(region, dtype=torch.uint8)
        start = -raw.data_ptr() % HUGE_PAGE
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return torch.empty(*shape, dtype=dtype)
    return raw[start:start + nbytes].view(dtype).view(shape)


def huge_bytes(tensor: torch.Tensor) -> int:
    """Bytes of huge pages (AnonHugePages in /proc/self/smaps) in the mapping that holds `tensor`'s memory."""
    address = tensor.data_ptr()
    try:
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(part, 16) for part in head.split("-"))
                    inside = lo <= address < hi
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) << 10
    except OSError:
        return 0
    return 0

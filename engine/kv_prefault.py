"""Faulting a CPU KV cache's pages in just ahead of the blocks the engine starts to use.

Why: the cache is allocated untouched, and the block manager hands out never-used blocks in id order as it grows.
Each new block's first write would page-fault inside a step: with a default-sized cache (11 GiB on the 2-core VM)
that cost the served 128-token row 10-17% of its throughput (docs/benchmarks.md, "Peer"). The block manager grows
freely only through the first `ahead_blocks` blocks (those faulted in at start), and past them only as the load
needs (engine/block_manager.py); this thread keeps the next blocks resident before it uses them.

How: a background thread keeps the pages of blocks `[0, highest block used + AHEAD_BYTES of blocks)` resident with
`MADV_POPULATE_WRITE` (Linux 5.14+), which faults pages in writable and leaves their contents as they are (the
engine may be writing blocks meanwhile). Memory is committed as the engine grows into the cache, never all at
start: on a shared node or a laptop, a default-sized cache is half the memory available, and an engine that serves
a few requests should not hold it. Where the kernel cannot, the cache faults in as blocks are used, as before.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import os
import threading
from typing import Any

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23        # Linux 5.14+
AHEAD_BYTES = 512 << 20         # resident beyond the highest block used: several steps of the largest prefill
_PAGE = 4096
_RUNNING: dict[threading.Thread, "_Shared"] = {}     # stopped and joined at exit (see KVPrefault.close)


class _Shared:
    """What the engine and the thread share: the thread holds this, never the cache or its KVPrefault."""
    __slots__ = ("wanted", "faulted", "wake", "stop", "failed")

    def __init__(self, wanted: int):
        self.wanted, self.faulted, self.failed = wanted, 0, False
        self.wake, self.stop = threading.Event(), threading.Event()
        self.wake.set()

    def request_stop(self) -> None:
        """The thread returns at its next check (between slabs, or when it wakes)."""
        self.stop.set()
        self.wake.set()


class KVPrefault:
    """`note(block_id)` after the engine hands out `block_id`; the thread keeps `AHEAD_BYTES` of blocks past it
    resident. `cache` is `[..., num_blocks, ...]` contiguous with the block axis at `block_dim`: each leading index
    (k/v, layer) is a slab of `num_blocks` blocks, faulted slab by slab. `done`: nothing more to do (all blocks
    asked for, or the kernel cannot), so the engine stops calling `note`."""

    def __init__(self, cache: Any, block_dim: int, ahead_bytes: int = AHEAD_BYTES):
        assert cache.is_contiguous()
        self.num_blocks = cache.shape[block_dim]
        slabs = 1
        for size in cache.shape[:block_dim]:
            slabs *= size
        block_bytes = cache[(0,) * (block_dim + 1)].numel() * cache.element_size()   # one block of one slab
        self.total_bytes = block_bytes * self.num_blocks * slabs
        self._ahead = max(1, ahead_bytes // max(block_bytes * slabs, 1))
        self.ahead_blocks = min(self.num_blocks, self._ahead)       # faulted in at start
        self._shared = _Shared(self.ahead_blocks)
        self._rearm = self._shared.wanted            # note() wakes the thread once a used block reaches this
        self._thread = None
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
            madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            self.done = True
            return
        self.done = self._rearm >= self.num_blocks
        addresses = [cache.data_ptr() + i * self.num_blocks * block_bytes for i in range(slabs)]
        self._thread = threading.Thread(target=_fault_ahead, name="kv-prefault", daemon=True,
                                        args=(self._shared, addresses, block_bytes, self.num_blocks, self.total_bytes,
                                              madvise))
        _RUNNING[self._thread] = self._shared
        self._thread.start()

    def note(self, block_id: int) -> None:
        """The engine uses `block_id` now. Cheap: wakes the thread once per half-margin of new blocks."""
        if block_id >= self._rearm:
            shared = self._shared
            shared.wanted = min(self.num_blocks, block_id + 1 + self._ahead)
            self._rearm = block_id + 1 + self._ahead // 2
            self.done = shared.wanted >= self.num_blocks or shared.failed
            shared.wake.set()

    @property
    def resident_blocks(self) -> int:
        """Blocks `[0, resident_blocks)` are faulted in (in every slab)."""
        return self._shared.faulted

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread (it ends the slab it is faulting) and wait for it: before the cache is freed, and at exit
        (a daemon thread still inside a call when the interpreter ends is not a clean exit)."""
        self._shared.request_stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __del__(self) -> None:
        self._shared.request_stop()


@atexit.register
def _stop_all() -> None:
    for thread, shared in list(_RUNNING.items()):
        shared.request_stop()
        thread.join(10)


def _fault_ahead(shared: _Shared, slabs: list[int], block_bytes: int, num_blocks: int, total_bytes: int,
                 madvise: Any) -> None:
    try:
        while not shared.stop.is_set():
            shared.wake.wait()
            shared.wake.clear()
            target = shared.wanted
            if shared.stop.is_set() or target <= shared.faulted:
                continue
            for slab in slabs:
                start = (slab + shared.faulted * block_bytes) // _PAGE * _PAGE
                end = slab + target * block_bytes
                if madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
                    logger.info("KV cache pages not faulted in ahead (madvise: %s); they fault in as blocks are used",
                                os.strerror(ctypes.get_errno()))
                    shared.failed = True
                    return
                if shared.stop.is_set():
                    return
            shared.faulted = target
            if target >= num_blocks:
                logger.info("KV cache resident: all %d blocks (%d MiB) faulted in, ahead of use", num_blocks,
                            total_bytes >> 20)
                return
    finally:
        _RUNNING.pop(threading.current_thread(), None)

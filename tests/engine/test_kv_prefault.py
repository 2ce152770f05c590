"""The CPU KV cache's pages fault in just ahead of the blocks in use, in a background thread, contents unchanged."""
from __future__ import annotations

import mmap
import time

import numpy as np
import pytest
import torch

from engine.kv_prefault import KVPrefault

MIB = 1 << 20


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s pages in memory now: bit 63 of each page's /proc/self/pagemap entry."""
    page = 4096
    first = tensor.data_ptr() // page
    last = (tensor.data_ptr() + tensor.numel() * tensor.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = np.frombuffer(pagemap.read((last - first + 1) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum()) * page


def wait_for(check, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def fresh_empty(*shape: int) -> tuple[torch.Tensor, mmap.mmap]:
    """A float32 tensor over a new anonymous mapping: no page resident until touched. (torch.empty may reuse memory
    the process freed before, already resident: glibc serves a large request from a free chunk when one fits.)"""
    mapping = mmap.mmap(-1, int(np.prod(shape)) * 4)
    return torch.frombuffer(mapping, dtype=torch.float32).view(*shape), mapping


@pytest.fixture
def cache():
    # [k/v, layer, block, 16 tokens, 2 heads, 64] float32: 8 KiB per block per slab, 6 slabs, 1024 blocks = 48 MiB
    tensor, mapping = fresh_empty(2, 3, 1024, 16, 2, 64)
    tensor[1, 2, 5] = 7.0           # written before the thread gets there: kept
    tensor[0, 0, -1] = 9.0
    yield tensor
    del tensor
    mapping.close()


def test_only_the_margin_is_resident_at_start_and_more_follows_use(cache):
    # 6 MiB ahead over 6 slabs: 128 blocks
    prefault = KVPrefault(cache, block_dim=2, ahead_bytes=6 * MIB)
    try:
        wait_for(lambda: prefault.resident_blocks == 128)
        assert resident_bytes(cache) < 16 * MIB                 # not the whole 48 MiB cache
        prefault.note(10)                                       # inside the first half of the margin: no wake-up
        time.sleep(0.05)
        assert prefault.resident_blocks == 128 and not prefault.done
        prefault.note(600)
        wait_for(lambda: prefault.resident_blocks == 601 + 128)
        assert 729 * 48 * 1024 <= resident_bytes(cache) < 40 * MIB
        prefault.note(1000)                                     # the margin reaches the end: the thread finishes
        assert prefault.done
        wait_for(lambda: prefault.resident_blocks == 1024)
        assert resident_bytes(cache) >= 48 * MIB
        assert bool((cache[1, 2, 5] == 7.0).all()) and bool((cache[0, 0, -1] == 9.0).all())
    finally:
        prefault.close()


def test_a_cache_smaller_than_the_margin_is_faulted_at_once_and_close_stops_the_thread(cache):
    prefault = KVPrefault(cache, block_dim=2)                   # 512 MiB margin > 48 MiB cache
    assert prefault.done                                        # the engine need not call note()
    wait_for(lambda: prefault.resident_blocks == 1024)
    prefault.close()
    assert not prefault._thread.is_alive()

    other = torch.empty(2, 3, 1024, 16, 2, 64)
    idle = KVPrefault(other, block_dim=2, ahead_bytes=MIB)
    wait_for(lambda: idle.resident_blocks > 0)
    idle.close(timeout=5)                                       # waiting for work: stops at once
    assert not idle._thread.is_alive()


def test_the_thread_ends_when_its_owner_is_dropped():
    import gc

    cache = torch.empty(2, 3, 1024, 16, 2, 64)
    prefault = KVPrefault(cache, block_dim=2, ahead_bytes=MIB)
    thread = prefault._thread
    wait_for(lambda: prefault.resident_blocks > 0)
    del prefault
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


def test_an_engine_grows_its_cpu_cache_only_as_the_load_needs_and_reused_blocks_give_the_same_tokens(monkeypatch):
    """Past the blocks faulted in at start, the engine reuses freed blocks before touching never-used ones
    (BlockManager's eager_blocks), and what a reused block held before never shows in a later request's output."""
    import functools

    from engine import worker
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from fakes import test_model_path

    config = dict(model_id=str(test_model_path("tiny-llama")), device="cpu", dtype="float32",
                  cpu_kv_cache_bytes=32 * MIB)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(40)] for i in range(12)]   # 12 different prompts of 3 blocks
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with LLMEngine(EngineConfig(**config)) as engine:                         # the cache is smaller than the margin
        assert engine.runner.kv_eager_blocks == engine.runner.num_kv_blocks
        expected = [[t.id for t in out.tokens] for prompt in prompts for out in engine.generate([prompt], params)]
    monkeypatch.setattr(worker, "KVPrefault", functools.partial(KVPrefault, ahead_bytes=1))
    with LLMEngine(EngineConfig(**config)) as engine:
        eager = engine.runner.kv_eager_blocks
        assert eager == 1 and engine.block_manager.num_blocks > 100
        got = [[t.id for t in out.tokens] for prompt in prompts for out in engine.generate([prompt], params)]
        assert engine.block_manager.num_used_blocks <= max(eager, 4)         # one request at a time: 3-4 blocks
        both = engine.generate(prompts[:6], params)                           # six at once: the cache grows to fit
        assert engine.block_manager.num_used_blocks >= 6 * 3
    assert got == expected
    assert [[t.id for t in out.tokens] for out in both] == expected[:6]

"""The KV cache budget on a GPU, alone and shared between engines (pure arithmetic: no GPU needed)."""
from __future__ import annotations

import pytest

from engine.kv_budget import CUDA_CONTEXT_BYTES, kv_budget

GB = 1 << 30


def test_alone_everything_in_use_counts_as_before():
    # 80 GB GPU, 16 GB of weights, 2 GB peak activations, 1 GB used by someone else, context 0.5 GB
    total, current, peak = 80 * GB, 16 * GB, 18 * GB
    free = total - current - CUDA_CONTEXT_BYTES - 1 * GB
    assert kv_budget(total, free, peak, current, current, 1.0, 0.9) == 0.9 * total - (total - free) - peak + current


def test_two_engines_sharing_a_gpu_each_fill_their_own_share():
    total = 80 * GB
    # engine A (share 0.8) is up: 16 GB weights + its KV cache fill 0.8 * 0.9 of the GPU
    a_used = int(0.8 * 0.9 * total)
    # engine B (share 0.2) measures after its warm-up: 1 GB weights, 1.5 GB peak
    b_current, b_peak = 1 * GB, int(1.5 * GB)
    free = total - a_used - b_current - CUDA_CONTEXT_BYTES
    budget = kv_budget(total, free, b_peak, b_current, b_current, 0.2, 0.9)
    assert budget == pytest.approx(0.2 * 0.9 * total - CUDA_CONTEXT_BYTES - b_peak)   # A's memory does not count against B
    # the old formula (everything in use counts) leaves B nothing at all
    assert 0.2 * 0.9 * total - (total - free) - b_peak + b_current < 0


def test_a_shared_budget_never_exceeds_what_is_free():
    total = 80 * GB
    free = 4 * GB   # another engine took more than its share
    budget = kv_budget(total, free, 2 * GB, 1 * GB, 1 * GB, 0.5, 0.9)
    assert budget == pytest.approx(free - total * 0.5 * (1 - 0.9))   # less than its share would give

"""engine/huge_pages.py: tensors on 2 MiB pages for the fused CPU decode step's packed weights."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from engine import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """'always', 'madvise' or 'never' (the bracketed word), '' where the kernel has no THP."""
    text = THP.read_text() if THP.exists() else ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


def test_empty_is_zeroed_aligned_and_of_the_asked_shape_and_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        t = huge_pages.empty(3, 1 << 19, dtype=dtype)
        assert t.shape == (3, 1 << 19) and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
        assert torch.count_nonzero(t) == 0


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="needs THP in 'always' or 'madvise' mode")
def test_touched_memory_is_backed_by_huge_pages_where_the_kernel_allows():
    t = huge_pages.empty(16 << 20)  # 64 MiB
    t.fill_(1.0)
    assert huge_pages.huge_bytes(t) >= huge_pages.HUGE_PAGE


def test_a_view_keeps_the_mapping_alive_after_the_base_is_gone():
    base = huge_pages.empty(4, 1 << 20)
    base[2].fill_(7.0)
    view = base[2]
    del base
    gc.collect()
    torch.empty(8 << 20).fill_(3.0)  # reuse any freed memory
    assert torch.all(view == 7.0)


def test_small_tensors_and_the_switch_fall_back_to_torch_empty(monkeypatch):
    small = huge_pages.empty(100)
    assert small.shape == (100,)
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert not huge_pages.enabled()
    plain = huge_pages.empty(1 << 22)
    assert plain.shape == (1 << 22,) and torch.count_nonzero(plain.zero_()) == 0


def test_a_failing_mapping_falls_back(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("no mapping")
    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    t = huge_pages.empty(1 << 22)
    assert t.shape == (1 << 22,)


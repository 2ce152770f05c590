"""Plain-torch float64 reference of the paged varlen attention the kernels compute.

Slow on purpose (a loop over sequences, the blocks gathered one by one): it is the definition every
backend is checked against, in tests and in the start-up self-check.
"""
from __future__ import annotations

import torch


def write_kv_cache_reference(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k/v [T, kv_heads, d] into the flat slots of [num_blocks, block_size, kv_heads, d]; slots < 0 skipped."""
    keep = slot_mapping >= 0
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping[keep]] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping[keep]] = v[keep]


def paged_attention_reference(q, k_cache, v_cache, *, cu_seqlens_q, seq_lens, block_tables, scale,
                              window=None, softcap=None) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]: each sequence's queries are the last q_len of its seq_lens positions."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    groups = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    for b in range(len(seq_lens)):
        start, end, length = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seq_lens[b])
        positions = torch.arange(length, device=q.device)
        slots = block_tables[b, positions // block_size].long() * block_size + positions % block_size
        keys = k_cache.flatten(0, 1)[slots].double().repeat_interleave(groups, dim=1)    # [K, H, D]
        values = v_cache.flatten(0, 1)[slots].double().repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = positions[length - (end - start):, None]
        visible = positions[None, :] <= query_pos
        if window is not None:
            visible &= positions[None, :] > query_pos - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out

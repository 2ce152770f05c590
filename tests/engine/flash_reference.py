"""CPU stand-ins for flash-attn's paged kernels, written from their documented semantics
(bottom-right aligned causal mask, window_size=(left, right), GQA by head groups)."""
from __future__ import annotations

import torch


def _attend(queries, k_cache, v_cache, slots, softmax_scale, window_size):
    """queries [Q, H, D] at the last Q positions of a context whose keys sit in `slots`."""
    groups = queries.shape[1] // k_cache.shape[2]
    keys = k_cache.flatten(0, 1)[slots].repeat_interleave(groups, dim=1)
    values = v_cache.flatten(0, 1)[slots].repeat_interleave(groups, dim=1)
    num_keys = len(slots)
    query_pos = torch.arange(len(queries))[:, None] + num_keys - len(queries)
    key_pos = torch.arange(num_keys)[None, :]
    mask = key_pos <= query_pos
    if window_size[0] >= 0:
        mask &= key_pos >= query_pos - window_size[0]
    scores = torch.einsum("qhd,khd->hqk", queries, keys) * softmax_scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


def _slots(block_table_row, num_keys, block_size):
    return [int(block_table_row[j // block_size]) * block_size + j % block_size for j in range(num_keys)]


def reference_flash_varlen(q, k_cache, v_cache, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window_size, block_table):
    """flash_attn_varlen_func over a paged cache: q [T, H, D] -> [T, H, D]."""
    assert causal and max_seqlen_q >= 1 and max_seqlen_k >= 1
    out = []
    for b in range(len(cu_seqlens_q) - 1):
        queries = q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]
        slots = _slots(block_table[b], int(cu_seqlens_k[b + 1] - cu_seqlens_k[b]), k_cache.shape[1])
        out.append(_attend(queries, k_cache, v_cache, slots, softmax_scale, window_size))
    return torch.cat(out)


def reference_flash_kvcache(q, k_cache, v_cache, *, cache_seqlens, block_table, softmax_scale, causal,
                            window_size):
    """flash_attn_with_kvcache over a paged cache (K/V already written): q [B, Q, H, D] -> [B, Q, H, D]."""
    assert causal and cache_seqlens.dtype == torch.int32 and block_table.dtype == torch.int32
    out = []
    for b in range(q.shape[0]):
        slots = _slots(block_table[b], int(cache_seqlens[b]), k_cache.shape[1])
        out.append(_attend(q[b], k_cache, v_cache, slots, softmax_scale, window_size))
    return torch.stack(out)

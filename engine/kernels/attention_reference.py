"""Plain-torch float64 references for engine/kernels/triton_attention.py: the same math, written to be
obviously right (one sequence at a time, explicit masks), for tests and start-up self-checks."""
from __future__ import annotations

import torch


def paged_attention_reference(q, k_cache, v_cache, *, cu_seqlens_q, seq_lens, block_tables, scale: float,
                              window: int | None = None, softcap: float | None = None,
                              alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Causal paged attention in float64; returns [T, H, D] in q's dtype (see unified_attention).

    Query i of sequence b sits at position seq_lens[b] - q_len[b] + i; key j is visible from position p
    iff j <= p and (no window or j > p - window); softcap maps scaled scores s to softcap * tanh(s / softcap);
    ALiBi adds slope_h * (j - p) to head h's scores.
    """
    out = torch.empty_like(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_seq = q[cu[b]:cu[b + 1]].double()
        q_len = q_seq.shape[0]
        blocks = block_tables[b, : -(-seq_len // block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].double().repeat_interleave(group, dim=1)
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_seq, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.double().view(-1, 1, 1) * (k_pos - q_pos)
        visible = k_pos <= q_pos
        if window is not None and window > 0:
            visible &= k_pos > q_pos - window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def write_kv_cache_reference(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Scatter k, v [T, KVH, D] into the caches at flat slots (block * block_size + offset); skip slots < 0."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)

"""ALiBi (Press et al., "Train Short, Test Long"): position information as a per-head linear bias on the
attention scores instead of position embeddings (BLOOM, Falcon-RW). Head h adds slope_h * (key position -
query position) to its scaled scores; the slopes are a geometric series fixed by the head count.

Only the portable backend applies it (`AttentionBackend.supports_alibi`): the bias is computed from the step's
masks, so it works unchanged over prefill chunks, decode rows and speculative spans of the paged cache.
"""
from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """[num_heads] float32: 2^(-8/n), 2^(-16/n), ... for the largest power of two n <= num_heads, then the odd
    steps of the series for 2n heads for the rest (the paper's rule for head counts that are not powers of two)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = [2 ** (-8 * i / closest) for i in range(1, closest + 1)]
    slopes += [2 ** (-4 * i / closest) for i in range(1, 2 * (num_heads - closest), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, mask: torch.Tensor | None, num_queries: int, num_keys: int) -> torch.Tensor:
    """[H, Q, K] or [B, H, Q, K] float32 bias slope_h * (key - query position). A query's position is its last
    visible key (`mask` [Q, K] or [B, 1, Q, K] bool, causal); mask None = causal, top-left aligned (query i at
    num_keys - num_queries + i)."""
    key_pos = torch.arange(num_keys, device=slopes.device)
    if mask is None:
        query_pos = torch.arange(num_queries, device=slopes.device)[:, None] + (num_keys - num_queries)
    else:
        query_pos = torch.where(mask, key_pos, 0).amax(-1, keepdim=True)
    return slopes.view(-1, 1, 1) * (key_pos - query_pos).float()  # a mask's head axis (size 1) becomes H

"""The attention op of a decoder layer: owns the layer's slice of the paged KV cache and hands the
step's work to the backend chosen at start-up (engine/attention/: portable, Triton or flash-attn).

Before the cache exists (the warm-up forward that sizes it) a layer attends causally over its input
as one sequence, with no cache. While `Attention.split` is set (engine/piecewise_graphs.py captures or
replays a forward), every layer hands its q/k/v to it instead and reads back what it returns.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.attention.backend import attend
from engine.attention.portable import PortableBackend

__all__ = ["Attention", "AttentionMetadata"]


class Attention(nn.Module):
    split: ClassVar[Callable | None] = None   # (layer, q, k, v) -> [T, heads * d]: the piecewise graphs' cut

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None,
                 alibi_slopes: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap  # Gemma 2: scores = cap * tanh(scores / cap)
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)  # [heads] (BLOOM): attention/alibi.py
        self.impl: AttentionBackend = _PORTABLE
        self.k_cache = self.v_cache = torch.tensor([])  # set by the worker: [num_blocks, block_size, kv, d]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] -> [T, heads * d]."""
        if Attention.split is not None:
            return Attention.split(self, q, k, v)
        if meta is None or self.k_cache.numel() == 0:
            out = attend(self, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None)
            return out[0].transpose(0, 1).reshape(q.shape[0], -1)
        return self.cached(q, k, v, meta)

    def cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's attention over the paged cache (the K/V written first), on the backend chosen."""
        impl = self.impl
        if meta.bidirectional and not impl.supports_bidirectional_images:  # images attending both ways (Gemma 3)
            impl = _PORTABLE
        return impl.forward(self, q, k, v, meta)


_PORTABLE = PortableBackend()

"""The interface every attention backend implements, and the dense causal attention they share.

A backend is one object per rank, shared by all layers. Per step, `prepare` adds what the backend
precomputes once for every layer (masks, gather indices); per layer, `forward` writes the new
tokens' K/V into the layer's paged cache and attends.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from engine.attention.alibi import alibi_bias
from engine.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from engine.layers.attention import Attention

# torch >= 2.5 broadcasts kv heads over query groups itself (no repeat_interleave copy)
SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


class AttentionBackend:
    name: ClassVar[str]
    # the KV block size this backend runs best with, and the ones it accepts (None = any power of two)
    default_block_size: ClassVar[int] = 16
    block_sizes: ClassVar[tuple[int, ...] | None] = None
    supports_cuda_graphs: ClassVar[bool] = False
    supports_alibi: ClassVar[bool] = False  # applies Attention.alibi_slopes (engine/attention/alibi.py)
    # applies AttentionMetadata.bidirectional (image tokens that see their image's later tokens: Gemma 3); a step
    # that has such spans runs on the portable backend otherwise (Attention.forward)
    supports_bidirectional_images: ClassVar[bool] = False

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run here (None = it can); checked before the numeric self-check."""
        return None

    def configure(self, layers: list, dtype: torch.dtype) -> dict[str, str]:
        """Choices made for the model's layers before the self-check, as {what: choice} for /info's
        attention_checks; the default makes none."""
        return {}

    def prepare(self, meta: AttentionMetadata, windows: set[int | None]) -> None:
        """Per-step work shared by all layers; the default needs none."""

    def forward(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] -> [T, heads * d]; writes k/v to the layer's cache."""
        raise NotImplementedError

    def graph_workspace(self, max_batch: int, num_heads: int, head_dim: int, max_seq_len: int,
                        device: torch.device) -> object | None:
        """Buffers a captured decode graph must reuse at every replay (None = none needed)."""
        return None

    @staticmethod
    def store(layer: Attention, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        layer.k_cache.view(-1, layer.num_kv_heads, layer.head_dim).index_copy_(0, slot_mapping, k)
        layer.v_cache.view(-1, layer.num_kv_heads, layer.head_dim).index_copy_(0, slot_mapping, v)


def attend(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, heads, Q, d], k/v [B, kv_heads, K, d] -> [B, heads, Q, d]; mask None = causal, top-left
    aligned (Q == K). Soft-capped scores (Gemma 2) and ALiBi (BLOOM) cannot go through SDPA, so they take explicit
    math."""
    if mask is None and layer.sliding_window is not None:
        mask = causal_mask(q.shape[2], k.shape[2] - q.shape[2], k.shape[2], layer.sliding_window, q.device)
    groups = layer.num_heads // layer.num_kv_heads
    alibi = getattr(layer, "alibi_slopes", None)
    if layer.logit_softcap or alibi is not None:
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * layer.scale
        if layer.logit_softcap:
            scores = layer.logit_softcap * torch.tanh(scores / layer.logit_softcap)
        if alibi is not None:  # in float32: the bias grows with the distance
            scores = scores.float() + alibi_bias(alibi, mask, q.shape[2], k.shape[2])
        if mask is None:
            mask = causal_mask(q.shape[2], k.shape[2] - q.shape[2], k.shape[2], None, q.device)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)
    # enable_gqa is only taken by CUDA's flash SDPA, which has no mask: with a mask on CUDA it would drop to
    # the math backend and its [B, H, Q, K] scores, while the memory-efficient one takes repeated heads
    native_gqa = SDPA_HAS_GQA and not (mask is not None and q.is_cuda)
    if groups > 1 and not native_gqa:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    extra = {"enable_gqa": True} if groups > 1 and native_gqa else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=layer.scale,
                                          **extra)


def causal_mask(num_queries: int, start_pos: int, num_keys: int, window: int | None,
                device: torch.device) -> torch.Tensor:
    """[Q, K] bool: query i (position start_pos + i) sees keys j <= its position, within the window."""
    query_pos = torch.arange(num_queries, device=device)[:, None] + start_pos
    key_pos = torch.arange(num_keys, device=device)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask

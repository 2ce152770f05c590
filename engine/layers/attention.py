"""Paged attention: write the step's K/V into the cache slots, then attend over each sequence's blocks.

Two backends share one cache layout ([num_blocks, block_size, kv_heads, head_dim] per layer):
- "sdpa": portable. K/V are gathered from the cache into a padded [seqs, max_context] batch and
  torch's scaled_dot_product_attention runs with a boolean mask (causal with the chunk offset,
  sliding window). Handles prefill, chunked prefill, decode and mixed batches, on CPU and GPU.
- "flash-attn-varlen": GPU only, when `flash_attn` or `vllm_flash_attn` imports; the kernel reads
  the paged cache through the block table directly. Decode batches replayed from CUDA graphs
  (engine/cuda_graphs.py) use the same package's `flash_attn_with_kvcache` instead, whose inputs
  have fixed shapes (`cache_seqlens` set in the metadata).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# torch >= 2.5 broadcasts kv heads over query groups itself (no repeat_interleave copy)
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step layout of the flattened batch; built once, read by every layer."""

    slot_mapping: torch.Tensor                  # [T] cache slot of each new token
    num_seqs: int = 0
    max_query_len: int = 0
    max_context_len: int = 0
    # sdpa
    key_slots: torch.Tensor | None = None       # [B, max_context] cache slot of each context token
    query_rows: torch.Tensor | None = None      # [T] row of each token in the padded [B * max_query] batch
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> [B, 1, max_q, max_ctx]
    # flash-attn
    cu_seqlens_q: torch.Tensor | None = None    # [B + 1] int32
    cu_seqlens_k: torch.Tensor | None = None    # [B + 1] int32
    block_tables: torch.Tensor | None = None    # [B, max_blocks] int32
    cache_seqlens: torch.Tensor | None = None   # [B] int32: pure decode through flash_attn_with_kvcache


def flash_attn_varlen():
    """The flash-attn varlen function if a CUDA build is importable, else None (never required)."""
    return _flash_function("flash_attn_varlen_func")


def flash_attn_kvcache():
    """flash_attn_with_kvcache from the same packages (decode over a paged cache, fixed shapes)."""
    return _flash_function("flash_attn_with_kvcache")


def flash_attn_version() -> str:
    """'vllm_flash_attn 2.6.2' for logs; flash-attn releases differ in what CUDA graphs tolerate."""
    module = next(_flash_modules(), None)
    if module is None:
        return "no flash-attn package"
    return f"{module.__name__} {getattr(module, '__version__', '(unknown version)')}"


def _flash_function(name: str):
    return next((getattr(module, name) for module in _flash_modules() if hasattr(module, name)), None)


def _flash_modules():
    """The importable flash-attn packages, vLLM's build first."""
    for package in ("vllm_flash_attn", "flash_attn"):
        try:
            yield __import__(package)
        except Exception:  # ImportError, or a CUDA/ABI mismatch raised at import time
            continue


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap  # Gemma 2: scores -> cap * tanh(scores / cap) before the softmax
        self.backend = "sdpa"
        self.flash_fn = None
        self.flash_decode_fn = None  # flash_attn_with_kvcache, for decode graphs
        self.k_cache = self.v_cache = torch.tensor([])  # set by the runner: [num_blocks, block_size, kv, d]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] -> [T, heads * d]."""
        if meta is None or self.k_cache.numel() == 0:  # warm-up: one causal sequence, no cache
            out = self._sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None)
            return out[0].transpose(0, 1).reshape(q.shape[0], -1)
        self._store(k, v, meta.slot_mapping)
        if meta.cache_seqlens is not None:
            return self._flash_decode(q, meta)
        if self.backend == "flash-attn-varlen":
            return self._flash(q, meta)
        return self._paged_sdpa(q, meta)

    def _store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, k)
        self.v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, v)

    def _paged_sdpa(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_seqs, max_q = meta.num_seqs, meta.max_query_len
        keys = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)[meta.key_slots]  # [B, ctx, kv, d]
        values = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)[meta.key_slots]
        if max_q == 1:  # pure decode: one query per sequence, already in order, nothing to pad
            padded = q.view(num_seqs, 1, self.num_heads, self.head_dim)
        else:
            padded = q.new_zeros(num_seqs * max_q, self.num_heads, self.head_dim)
            padded[meta.query_rows] = q
            padded = padded.view(num_seqs, max_q, self.num_heads, self.head_dim)
        out = self._sdpa(padded.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                         meta.masks[self.sliding_window])
        out = out.transpose(1, 2).reshape(num_seqs * max_q, -1)
        return out if max_q == 1 else out[meta.query_rows]

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
        """q [B, heads, Q, d], k/v [B, kv_heads, K, d]; mask None means plain causal."""
        if mask is None and self.sliding_window is not None:
            mask = causal_mask(q.shape[2], 0, k.shape[2], self.sliding_window, q.device)[None, None]
        groups = self.num_heads // self.num_kv_heads
        if self.logit_softcap is not None:
            return softcapped_attention(q, k, v, mask, self.scale, self.logit_softcap, groups)
        # enable_gqa is only taken by CUDA's flash SDPA, which has no mask: with a mask on CUDA it would drop to
        # the math backend and its [B, H, Q, K] scores, while the memory-efficient one takes repeated heads
        native_gqa = _SDPA_HAS_GQA and not (mask is not None and q.is_cuda)
        if groups > 1 and not native_gqa:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        extra = {"enable_gqa": True} if groups > 1 and native_gqa else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                              **extra)

    @property
    def _flash_window(self) -> tuple[int, int]:
        """flash-attn's (left, right) key range for HF's `key > query - sliding_window`."""
        return (self.sliding_window - 1, 0) if self.sliding_window else (-1, -1)

    def _flash(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = self.flash_fn(q, self.k_cache, self.v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                            cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_query_len,
                            max_seqlen_k=meta.max_context_len, softmax_scale=self.scale, causal=True,
                            window_size=self._flash_window, block_table=meta.block_tables)
        return out.reshape(q.shape[0], -1)

    def _flash_decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = self.flash_decode_fn(q.unsqueeze(1), self.k_cache, self.v_cache, cache_seqlens=meta.cache_seqlens,
                                   block_table=meta.block_tables, softmax_scale=self.scale, causal=True,
                                   window_size=self._flash_window)
        return out.reshape(q.shape[0], -1)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         scale: float, cap: float, groups: int) -> torch.Tensor:
    """SDPA's math with the scores soft-capped (SDPA itself has no cap); mask None means causal."""
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if mask is None:
        mask = causal_mask(q.shape[2], k.shape[2] - q.shape[2], k.shape[2], None, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)


def causal_mask(num_queries: int, start_pos: int, num_keys: int, window: int | None,
                device: torch.device) -> torch.Tensor:
    """[Q, K] bool: query i (position start_pos + i) sees keys j <= its position, within the window."""
    query_pos = torch.arange(num_queries, device=device)[:, None] + start_pos
    key_pos = torch.arange(num_keys, device=device)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask

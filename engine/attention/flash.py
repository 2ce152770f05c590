"""flash-attn's paged kernels, when `vllm_flash_attn` or `flash_attn` imports (never required).

Mixed batches go through `flash_attn_varlen_func` with the block table; pure decode batches through
`flash_attn_with_kvcache`, whose lengths live in a tensor, so the same call is captured in CUDA
graphs. Its paged kernels need blocks of a multiple of 256 tokens.
"""
from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend


def flash_function(name: str):
    """`name` from the first importable flash-attn package, vLLM's build first; None if none imports."""
    return next((getattr(module, name) for module in flash_modules() if hasattr(module, name)), None)


def flash_version() -> str:
    """'vllm_flash_attn 2.6.2' for logs; flash-attn releases differ in what CUDA graphs tolerate."""
    module = next(flash_modules(), None)
    if module is None:
        return "no flash-attn package"
    return f"{module.__name__} {getattr(module, '__version__', '(unknown version)')}"


def flash_modules():
    for package in ("vllm_flash_attn", "flash_attn"):
        try:
            yield __import__(package)
        except Exception:  # ImportError, or a CUDA/ABI mismatch raised at import time
            continue


class FlashBackend(AttentionBackend):
    name = "flash-attn"
    default_block_size = 256
    block_sizes = (256, 512)
    supports_cuda_graphs = True

    def __init__(self, varlen_fn=None, decode_fn=None) -> None:
        self.varlen_fn = varlen_fn or flash_function("flash_attn_varlen_func")
        self.decode_fn = decode_fn or flash_function("flash_attn_with_kvcache")

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda":
            return "flash-attn needs a CUDA device"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"flash-attn needs float16 or bfloat16, not {dtype}"
        if flash_function("flash_attn_varlen_func") is None or flash_function("flash_attn_with_kvcache") is None:
            return "neither vllm_flash_attn nor flash_attn is importable"
        return None

    def forward(self, layer, q, k, v, meta):
        self.store(layer, k, v, meta.slot_mapping)
        window = (layer.sliding_window - 1, 0) if layer.sliding_window else (-1, -1)  # HF's key > query - window
        extra = {"softcap": layer.logit_softcap} if layer.logit_softcap else {}
        if meta.max_query_len == 1:
            out = self.decode_fn(q.unsqueeze(1), layer.k_cache, layer.v_cache, cache_seqlens=meta.seq_lens,
                                 block_table=meta.block_tables, softmax_scale=layer.scale, causal=True,
                                 window_size=window, **extra)
        else:
            cu_seqlens_k = torch.nn.functional.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
            out = self.varlen_fn(q, layer.k_cache, layer.v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                                 cu_seqlens_k=cu_seqlens_k, max_seqlen_q=meta.max_query_len,
                                 max_seqlen_k=meta.max_seq_len, softmax_scale=layer.scale, causal=True,
                                 window_size=window, block_table=meta.block_tables, **extra)
        return out.reshape(q.shape[0], -1)

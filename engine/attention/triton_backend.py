"""Our Triton kernels (engine/kernels/triton_attention.py): the default on CUDA without flash-attn.

One kernel serves prefill, chunked prefill and decode rows of the same batch; pure decode batches
take a split-KV kernel. Nothing here syncs with the GPU, so decode steps are captured in CUDA
graphs, with the split-KV buffers preallocated once (`graph_workspace`) and a fixed length bound.
On a CPU it runs only under TRITON_INTERPRET=1 (Triton's interpreter): that is how CI tests it.
"""
from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.kernels import triton_available, triton_interpreted


class TritonBackend(AttentionBackend):
    name = "triton"
    default_block_size = 16
    block_sizes = (16, 32, 64, 128, 256)
    supports_cuda_graphs = True

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if not triton_available():
            return "triton is not importable"
        if device.type != "cuda" and not triton_interpreted():
            return "Triton kernels need a GPU here (TRITON_INTERPRET=1 runs them, slowly, on a CPU)"
        return None

    def __init__(self) -> None:
        from engine.kernels import triton_attention  # imported late: TRITON_INTERPRET is read at import

        self.kernels = triton_attention

    def forward(self, layer, q, k, v, meta):
        self.kernels.write_kv_cache(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        self.kernels.unified_attention(
            q, layer.k_cache, layer.v_cache, out, cu_seqlens_q=meta.cu_seqlens_q, seq_lens=meta.seq_lens,
            block_tables=meta.block_tables, max_query_len=meta.max_query_len, scale=layer.scale,
            window=layer.sliding_window, softcap=layer.logit_softcap, workspace=meta.extra.get("workspace"),
            max_seq_len=meta.max_seq_len)
        return out.view(q.shape[0], -1)

    def graph_workspace(self, max_batch, num_heads, head_dim, max_seq_len, device):
        return self.kernels.DecodeWorkspace(max_batch, num_heads, head_dim, device=device)

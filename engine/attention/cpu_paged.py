"""CPU paged attention that reads the cache in place (the CPU default when its kernel builds and checks).

Decode rows and short spans (speculative verification, up to MAX_BATCHED_QUERY queries over a cached
context) go to the C++ kernel in engine/kernels/cpu_attention.py: each (span, kv head) walks its own
blocks with an online softmax, so no context is copied out of the cache and nothing is padded to the
longest sequence. Prefill chunks keep the portable path (one causal SDPA each, a GEMM where it pays).
"""
from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.portable import batched_seqs, prefill_chunks, row_starts, run_prefills
from engine.kernels import cpu_attention


class CpuPagedBackend(AttentionBackend):
    name = "cpu_paged"
    default_block_size = 16  # 16, 32 and 64 measured within noise (scripts/bench_cpu_attention.py)

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cpu":
            return "a CPU kernel (this device is not the CPU)"
        if dtype not in cpu_attention.DTYPES:
            return f"no kernel for {dtype}"
        if cpu_attention.compiler() is None:
            return "no C++ compiler to build its kernel (set CXX or put g++ on PATH)"
        return None

    def __init__(self) -> None:
        cpu_attention.load()  # compiles on first use (cached on disk); a failure is the self-check's reason

    def prepare(self, meta: AttentionMetadata, windows: set[int | None]) -> None:
        batched = batched_seqs(meta)
        starts = row_starts(meta.query_lens_host)
        work = None
        if batched:
            work = torch.tensor([[b, starts[b], meta.query_lens_host[b], meta.seq_lens_host[b]] for b in batched],
                                dtype=torch.int32)  # [N, 4]: sequence, first row, rows, seq_len
        meta.extra["cpu_paged"] = (work, prefill_chunks(meta, set(batched), starts, windows))

    def forward(self, layer, q, k, v, meta):
        self.store(layer, k, v, meta.slot_mapping)
        if "cpu_paged" not in meta.extra:  # metadata built without this backend's prepare (tests)
            self.prepare(meta, {layer.sliding_window})
        work, prefills = meta.extra["cpu_paged"]
        out = q.new_empty(q.shape)
        if work is not None:
            cpu_attention.paged_attention(
                out, q if q.stride(2) == 1 else q.contiguous(), layer.k_cache, layer.v_cache, work,
                meta.block_tables, scale=layer.scale, window=layer.sliding_window, softcap=layer.logit_softcap)
        run_prefills(layer, q, k, v, prefills, out)
        return out.view(q.shape[0], -1)

"""CPU paged attention that reads the cache in place (the CPU default when its kernel builds and checks).

Decode rows and short spans (speculative verification, up to MAX_BATCHED_QUERY queries over a cached
context) go to the C++ kernel in engine/kernels/cpu_attention.py: each (span, kv head) walks its own
blocks with an online softmax, so no context is copied out of the cache and nothing is padded to the
longest sequence. Prefill chunks go to the C++ kernel in engine/kernels/cpu_prefill_attention.py (causal,
tiled over queries and keys, the cached prefix read in place, no mask built) when it passed its start-up
self-check on the model's head layouts (`configure`), else to the portable path (one causal SDPA each).
"""
from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.portable import batched_seqs, prefill_chunks, row_starts, run_prefills
from engine.kernels import cpu_attention, cpu_prefill_attention


class CpuPagedBackend(AttentionBackend):
    name = "cpu_paged"
    default_block_size = 16  # 16, 32 and 64 measured within noise (scripts/bench_cpu_attention.py)
    supports_bidirectional_images = True  # through the portable prefill chunks

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
        self.prefill_layouts: set[tuple] = set()  # head layouts whose prefill chunks take the C++ kernel

    def configure(self, layers: list, dtype: torch.dtype) -> dict[str, str]:
        layouts = {_layout(layer) for layer in layers}
        use, shown = cpu_prefill_attention.choose(layouts, dtype)
        self.prefill_layouts = layouts if use else set()
        return {"cpu_paged prefill": shown}

    def prepare(self, meta: AttentionMetadata, windows: set[int | None]) -> None:
        batched = batched_seqs(meta)
        starts = row_starts(meta.query_lens_host)
        work = _work(meta, batched, starts)
        chunks = [b for b in range(meta.num_seqs) if b not in set(batched)]
        # image tokens attending both ways (Gemma 3) need the SDPA path's widened masks
        kernel = bool(chunks and self.prefill_layouts and cpu_prefill_attention.allowed() and not meta.bidirectional)
        # the SDPA path's masks and slots only when a layer needs them (a layout the kernel was not checked on)
        sdpa = None if kernel else prefill_chunks(meta, set(batched), starts, windows)
        meta.extra["cpu_paged"] = [work, _work(meta, chunks, starts) if kernel else None, sdpa, batched, starts,
                                   windows]

    def forward(self, layer, q, k, v, meta):
        self.store(layer, k, v, meta.slot_mapping)
        if "cpu_paged" not in meta.extra:  # metadata built without this backend's prepare (tests)
            self.prepare(meta, {layer.sliding_window})
        state = meta.extra["cpu_paged"]
        work, chunk_work, sdpa, batched, starts, windows = state
        out = q.new_empty(q.shape)
        if q.stride(2) != 1:
            q = q.contiguous()
        if work is not None:
            cpu_attention.paged_attention(
                out, q, layer.k_cache, layer.v_cache, work,
                meta.block_tables, scale=layer.scale, window=layer.sliding_window, softcap=layer.logit_softcap)
        if chunk_work is not None and _layout(layer) in self.prefill_layouts:
            cpu_prefill_attention.prefill_attention(
                out, q, layer.k_cache, layer.v_cache, chunk_work, meta.block_tables, scale=layer.scale,
                window=layer.sliding_window, softcap=layer.logit_softcap)
        else:
            if sdpa is None:  # built once per step, for the layers the kernel does not serve
                state[2] = sdpa = prefill_chunks(meta, set(batched), starts, windows | {layer.sliding_window})
            run_prefills(layer, q, k, v, sdpa, out)
        return out.view(q.shape[0], -1)


def _layout(layer) -> tuple:
    """What the prefill kernel's self-check covers: (heads, kv heads, head dim, window, softcap)."""
    return (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.sliding_window, layer.logit_softcap)


def _work(meta: AttentionMetadata, seqs: list[int], starts: list[int]) -> torch.Tensor | None:
    """[N, 4] int32: sequence, first row, rows, seq_len of each of `seqs` (None when there are none)."""
    if not seqs:
        return None
    return torch.tensor([[b, starts[b], meta.query_lens_host[b], meta.seq_lens_host[b]] for b in seqs],
                        dtype=torch.int32)

"""CPU micro-benchmark of decode attention: portable (gather + padded SDPA) against cpu_paged (C++ in place).

    python scripts/bench_cpu_attention.py                       # SmolLM2-135M heads (9/3 of 64), fp32, block 16
    python scripts/bench_cpu_attention.py --dtype bfloat16 --flex   # also FlexAttention compiled for CPU

Per case (batch x context): one decode row per sequence at that context, on shuffled blocks. Times are
per layer (the backend's `forward`, KV write included) plus the per-step `prepare` shared by all layers;
every method runs on the same data in the same process, interleaved round by round, and the median of
the rounds is printed: wall time (median, min) and the process's CPU time (steadier on a shared box; with
several threads it adds theirs up). --flex adds FlexAttention (torch.nn.attention.flex_attention, compiled by
Inductor's C++ backend) over the paged cache in place, with a block mask built from the block tables
per step (its build time is the `prepare` column). On torch 2.13 its first compile took minutes and its
recompile for the second shape failed (docs/cpu-attention.md): run it with one case, e.g.
`--flex --batches 16 --contexts 128`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `engine` importable from a checkout

from engine.attention.backend import AttentionBackend  # noqa: E402
from engine.attention.cpu_paged import CpuPagedBackend  # noqa: E402
from engine.attention.metadata import build_metadata  # noqa: E402
from engine.attention.portable import PortableBackend  # noqa: E402
from engine.batch import SeqSpan  # noqa: E402
from engine.kernels.attention_reference import paged_attention_reference  # noqa: E402
from engine.layers.attention import Attention  # noqa: E402


def make_case(batch, context, heads, kv_heads, dim, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // block_size)
    blocks = (torch.randperm(batch * per_seq, generator=gen) + 1).tolist()
    spans = [SeqSpan(b, [0], context - 1, blocks[b * per_seq:(b + 1) * per_seq]) for b in range(batch)]
    layer = Attention(heads, kv_heads, dim, dim ** -0.5)
    cache = torch.randn(2, batch * per_seq + 1, block_size, kv_heads, dim, generator=gen).to(dtype)
    layer.k_cache, layer.v_cache = cache[0], cache[1]
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    return spans, layer, q, k, v


class Flex:
    """FlexAttention over the paged cache in place (the layout torch's experimental _paged_attention builds):
    K/V viewed [1, kv, slots, d], a BlockMask whose kv blocks are each sequence's block table, and a mask mod
    mapping a physical slot to its logical position. Decode rows only; recompiles for each new shape."""
    name = "flex"

    def __init__(self):
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        self.block_mask = BlockMask
        self.attend = torch.compile(flex_attention, dynamic=False)

    def prepare(self, meta, windows):
        tables, block_size = meta.block_tables, meta.block_size
        batch, width = tables.shape
        num_pages = int(tables.max()) + 1
        logical = torch.full((batch, num_pages), -1, dtype=torch.int32)  # [B, page] -> logical block (-1 = not its)
        logical.scatter_(1, tables.long(), torch.arange(width, dtype=torch.int32).expand(batch, width).contiguous())
        seq_lens = meta.seq_lens

        def visible(b, h, q_idx, kv_idx):
            block = logical[b, kv_idx // block_size]
            return (block >= 0) & (block * block_size + kv_idx % block_size < seq_lens[b])

        indices = torch.zeros(batch, 1, 1, num_pages, dtype=torch.int32)  # columns must cover every page
        indices[:, 0, 0, :width] = tables
        counts = ((seq_lens + block_size - 1) // block_size).view(batch, 1, 1).int()
        meta.extra["flex"] = self.block_mask.from_kv_blocks(counts, indices, BLOCK_SIZE=(1, block_size),
                                                            mask_mod=visible, seq_lengths=(1, num_pages * block_size))

    def forward(self, layer, q, k, v, meta):
        AttentionBackend.store(layer, k, v, meta.slot_mapping)
        mask = meta.extra["flex"]
        slots = mask.seq_lengths[1]
        keys, values = (cache.view(-1, layer.num_kv_heads, layer.head_dim)[:slots].transpose(0, 1)[None]
                        .expand(q.shape[0], -1, -1, -1) for cache in (layer.k_cache, layer.v_cache))
        out = self.attend(q[:, :, None], keys, values, block_mask=mask, scale=layer.scale,
                          enable_gqa=layer.num_heads != layer.num_kv_heads)
        return out.reshape(q.shape[0], -1)


def time_method(backend, spans, layer, q, k, v, block_size):
    meta = build_metadata(spans, block_size, torch.device("cpu"))
    start = time.perf_counter()
    backend.prepare(meta, {None})
    prepared, cpu_start = time.perf_counter(), time.process_time()
    layer.impl = backend
    out = layer(q, k, v, meta)
    return prepared - start, time.perf_counter() - prepared, time.process_time() - cpu_start, out


def run_case(methods, batch, context, args, dtype):
    spans, layer, q, k, v = make_case(batch, context, 9 if args.heads is None else args.heads, args.kv_heads,
                                      args.head_dim, args.block_size, dtype)
    times = {m.name: ([], [], []) for m in methods}
    outs = {}
    for round_ in range(args.repeat + 2):
        for method in methods:
            *measured, outs[method.name] = time_method(method, spans, layer, q, k, v, args.block_size)
            if round_ >= 2:  # warm-up rounds (compiles, caches)
                for series, value in zip(times[method.name], measured):
                    series.append(value)
    meta = build_metadata(spans, args.block_size, torch.device("cpu"))
    expected = paged_attention_reference(q, layer.k_cache, layer.v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                                         seq_lens=meta.seq_lens, block_tables=meta.block_tables,
                                         scale=layer.scale).float().reshape(batch, -1)
    rows = []
    for method in methods:
        prep, fwd, cpu = times[method.name]
        error = (outs[method.name].float() - expected).abs().max().item()
        rows.append(dict(method=method.name, batch=batch, context=context, layer_ms=1e3 * statistics.median(fwd),
                         layer_ms_min=1e3 * min(fwd), layer_cpu_ms=1e3 * statistics.median(cpu),
                         prepare_ms=1e3 * statistics.median(prep), max_error=error))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--heads", type=int, default=None, help="query heads (default 9, SmolLM2-135M)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--contexts", default="128,512,1024,2048")
    parser.add_argument("--batches", default="16,1")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--flex", action="store_true", help="also FlexAttention compiled by Inductor (slow to build)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    methods = [PortableBackend(), CpuPagedBackend()] + ([Flex()] if args.flex else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, heads "
          f"{args.heads or 9}/{args.kv_heads} of {args.head_dim}, block {args.block_size}, median of {args.repeat}")
    print(f"{'batch':>5} {'context':>7} {'method':>10} {'layer ms':>9} {'min':>7} {'cpu ms':>7} {'prepare ms':>10}"
          f" {'max err':>8} {'speed-up':>8} {'cpu':>6}")
    rows = []
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            case = run_case(methods, batch, context, args, dtype)
            base, base_cpu = case[0]["layer_ms"], case[0]["layer_cpu_ms"]
            for row in case:
                print(f"{batch:>5} {context:>7} {row['method']:>10} {row['layer_ms']:>9.3f} {row['layer_ms_min']:>7.3f}"
                      f" {row['layer_cpu_ms']:>7.3f} {row['prepare_ms']:>10.3f} {row['max_error']:>8.1e}"
                      f" {base / row['layer_ms']:>7.2f}x {base_cpu / row['layer_cpu_ms']:>5.2f}x", flush=True)
            rows += case
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""GPU micro-benchmark of our Triton paged attention against torch SDPA (and flash-attn when importable).

    python scripts/bench_attention.py --json attention.json          # Llama-3-8B heads, bf16, block 16

Cases: one prefill-heavy mixed batch (prefill chunks beside decode rows) and pure decode at batch
1/16/64/256 with 1k and 4k contexts. Baselines run on the same data in the same invocation:
- sdpa-padded: what a naive engine does: gather each sequence's KV from the paged cache into a padded
  [B, H, max_ctx, D] tensor (kv heads repeated), pad queries to [B, H, max_q, D], SDPA with a boolean mask (gather timed in);
- sdpa-gathered: the same SDPA call on KV already gathered (attention alone, no cache gather);
- flash-attn (flash_attn_varlen_func / flash_attn_with_kvcache with a block table, on a copy of the cache in
  256-token pages, which flash-attn needs), if the package imports.
Times are GPU times per call: each method's calls are captured in a CUDA graph (eager if capture fails)
and replayed between CUDA events after a warm-up. KV bandwidth = unique bytes of K and V that the batch
attends to / time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `engine` importable from a checkout

from engine.kernels.triton_attention import DecodeWorkspace, decode_num_splits, unified_attention  # noqa: E402

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except Exception:  # absent, or built for another torch
    flash_attn_varlen_func = flash_attn_with_kvcache = None


def make_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype, gen):
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    width = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * width
    table = torch.randperm(num_blocks, generator=gen).view(len(seq_lens), width).int()
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return dict(q=torch.randn(int(cu[-1]), heads, head_dim, dtype=dtype, device="cuda"),
                k_cache=torch.randn(shape, dtype=dtype, device="cuda"),
                v_cache=torch.randn(shape, dtype=dtype, device="cuda"),
                cu_seqlens_q=cu.cuda(), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                block_tables=table.cuda(), q_lens=q_lens, seq_lens_host=seq_lens)


def gpu_time_ms(fn, reps):
    """Per-call GPU time of fn: `reps` calls in one CUDA graph (eager when capture fails)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    runner, mode = None, "graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        runner = graph.replay
        runner()
    except Exception:
        torch.cuda.synchronize()
        mode = "eager"

        def runner():
            for _ in range(reps):
                fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best, mode


def ours(b, scale, workspace):
    out = torch.empty_like(b["q"])
    kw = dict(cu_seqlens_q=b["cu_seqlens_q"], seq_lens=b["seq_lens"], block_tables=b["block_tables"],
              max_query_len=max(b["q_lens"]), scale=scale, workspace=workspace,
              max_seq_len=max(b["seq_lens_host"]))
    return lambda: unified_attention(b["q"], b["k_cache"], b["v_cache"], out, **kw), out


def sdpa_inputs(b):
    """Padded queries, gather indices and mask, built once on the host (not timed)."""
    num_seqs, max_q, max_ctx = len(b["q_lens"]), max(b["q_lens"]), max(b["seq_lens_host"])
    block_size = b["k_cache"].shape[1]
    pos = torch.arange(max_ctx, device="cuda")
    blocks = b["block_tables"].long().gather(1, (pos // block_size).clamp(max=b["block_tables"].shape[1] - 1)
                                             .expand(num_seqs, -1))
    slots = blocks * block_size + pos % block_size  # [B, max_ctx]
    q_pad = torch.zeros(num_seqs, max_q, *b["q"].shape[1:], dtype=b["q"].dtype, device="cuda")
    mask = torch.zeros(num_seqs, 1, max_q, max_ctx, dtype=torch.bool, device="cuda")
    cu = b["cu_seqlens_q"].tolist()
    for i, (ql, sl) in enumerate(zip(b["q_lens"], b["seq_lens_host"])):
        q_pad[i, :ql] = b["q"][cu[i]:cu[i + 1]]
        q_pos = torch.arange(sl - ql, sl, device="cuda")[:, None]
        mask[i, 0, :ql] = pos[None, :] <= q_pos
    return q_pad.transpose(1, 2), slots, mask


def sdpa(b, scale, gathered):
    q_pad, slots, mask = sdpa_inputs(b)
    kv_heads, head_dim = b["k_cache"].shape[2:]
    flat_k, flat_v = b["k_cache"].view(-1, kv_heads, head_dim), b["v_cache"].view(-1, kv_heads, head_dim)

    group = b["q"].shape[1] // kv_heads

    def gather():  # [B, H, ctx, D]: kv heads repeated, since SDPA's masked (mem-efficient) kernel lacks GQA
        return tuple(c[slots].repeat_interleave(group, dim=2).transpose(1, 2) for c in (flat_k, flat_v))

    pre = gather() if gathered else None

    def run():
        k, v = pre if gathered else gather()
        return F.scaled_dot_product_attention(q_pad, k, v, attn_mask=mask, scale=scale)
    return run, q_pad, mask


def flash(b, scale):
    """flash-attn on a copy of the cache in 256-token pages (its paged kernels need multiples of 256)."""
    page = 256
    num_seqs = len(b["q_lens"])
    kv_heads, head_dim = b["k_cache"].shape[2:]
    width = max(-(-n // page) for n in b["seq_lens_host"])
    k_pages = torch.zeros(num_seqs * width, page, kv_heads, head_dim, dtype=b["q"].dtype, device="cuda")
    v_pages = torch.zeros_like(k_pages)
    q_pad, slots, _ = sdpa_inputs(b)
    flat_k, flat_v = b["k_cache"].view(-1, kv_heads, head_dim), b["v_cache"].view(-1, kv_heads, head_dim)
    k_pages.view(num_seqs, width * page, kv_heads, head_dim)[:, :slots.shape[1]] = flat_k[slots]
    v_pages.view(num_seqs, width * page, kv_heads, head_dim)[:, :slots.shape[1]] = flat_v[slots]
    table = torch.arange(num_seqs * width, dtype=torch.int32, device="cuda").view(num_seqs, width)
    if max(b["q_lens"]) == 1:
        q = b["q"].unsqueeze(1)
        return lambda: flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=b["seq_lens"], block_table=table,
                                               softmax_scale=scale, causal=True)
    cu_k = torch.zeros(num_seqs + 1, dtype=torch.int32, device="cuda")
    cu_k[1:] = b["seq_lens"].cumsum(0)
    return lambda: flash_attn_varlen_func(b["q"], k_pages, v_pages, b["cu_seqlens_q"], cu_k, max(b["q_lens"]),
                                          max(b["seq_lens_host"]), softmax_scale=scale, causal=True,
                                          block_table=table)


def run_case(name, q_lens, ctx_lens, args, dtype, gen):
    b = make_batch(q_lens, ctx_lens, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype, gen)
    scale = args.head_dim ** -0.5
    reps = 10 if max(q_lens) > 1 else 50
    decode = max(q_lens) == 1
    workspace = DecodeWorkspace(len(q_lens), args.heads, args.head_dim, 32, "cuda") if decode else None
    kv_bytes = sum(b["seq_lens_host"]) * args.kv_heads * args.head_dim * 2 * b["k_cache"].element_size()
    row = {"case": name, "batch": len(q_lens), "tokens": sum(q_lens), "max_ctx": max(b["seq_lens_host"]),
           "kv_mb": kv_bytes / 1e6}
    if decode:
        row["splits"] = decode_num_splits(len(q_lens), args.kv_heads, max(b["seq_lens_host"]), "cuda", 32)
    fn, out = ours(b, scale, workspace)
    row["ours_ms"], row["ours_mode"] = gpu_time_ms(fn, reps)
    row["ours_gbps"] = kv_bytes / row["ours_ms"] / 1e6
    for key, gathered in (("sdpa_padded_ms", False), ("sdpa_gathered_ms", True)):
        try:
            run, _, _ = sdpa(b, scale, gathered)
            row[key], _ = gpu_time_ms(run, reps)
            if gathered:  # correctness sanity on the same data
                ref = run().transpose(1, 2)
                cu = b["cu_seqlens_q"].tolist()
                row["max_abs_diff_vs_sdpa"] = max(
                    (out[cu[i]:cu[i + 1]].float() - ref[i, :ql].float()).abs().max().item()
                    for i, ql in enumerate(q_lens))
        except torch.OutOfMemoryError:
            row[key] = None
        torch.cuda.empty_cache()
    if flash_attn_varlen_func is not None:
        try:
            row["flash_ms"], _ = gpu_time_ms(flash(b, scale), reps)
        except Exception as exc:  # an old flash-attn without paged KV, say
            row["flash_error"] = repr(exc)[:200]
    for key in ("sdpa_padded_ms", "sdpa_gathered_ms", "flash_ms"):
        if row.get(key):
            row[key.replace("_ms", "_over_ours")] = row[key] / row["ours_ms"]
    del b
    torch.cuda.empty_cache()
    return row


def cases(args):
    gen_cases = [("mixed: 4x1024 prefill + 60 decode@1k", [1024] * 4 + [1] * 60, [0] * 4 + [1024] * 60),
                 ("chunked: 8x512 chunk@2k + 24 decode@2k", [512] * 8 + [1] * 24, [2048] * 8 + [2048] * 24)]
    for ctx in args.contexts:
        for batch in args.batches:
            gen_cases.append((f"decode b={batch} ctx={ctx}", [1] * batch, [ctx - 1] * batch))
    return gen_cases


def sweep(args, dtype, gen):
    """Try launch configurations of both kernels on a few cases; print each time (for tuning the defaults)."""
    import itertools

    from engine.kernels import triton_attention as ta

    scale = args.head_dim ** -0.5
    results = []
    default_prefill, default_decode = ta.prefill_config, ta.decode_config
    for name, q_lens, ctx_lens in cases(args)[:2]:
        b = make_batch(q_lens, ctx_lens, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype, gen)
        for block_m, tile_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
            cfg = dict(block_m=block_m, tile_n=tile_n, num_warps=warps, num_stages=stages)
            ta.prefill_config = lambda *a, cfg=cfg: cfg
            try:
                ms, _ = gpu_time_ms(ours(b, scale, None)[0], 5)
            except Exception as exc:
                ms = None
                print("  failed", cfg, repr(exc)[:120])
            ta.prefill_config = default_prefill
            results.append({"case": name, **cfg, "ms": ms})
            print(f"{name:42s} {cfg} {ms}", flush=True)
    for batch, ctx in ((1, 1024), (1, 4096), (16, 1024), (16, 4096), (64, 1024)):
        b = make_batch([1] * batch, [ctx - 1] * batch, args.heads, args.kv_heads, args.head_dim, args.block_size,
                       dtype, gen)
        workspace = DecodeWorkspace(batch, args.heads, args.head_dim, 64, "cuda")
        kv_bytes = batch * ctx * args.kv_heads * args.head_dim * 4
        for tile_n, warps, stages, splits in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4),
                                                                (1, 2, 4, 8, 16, 32, 64)):
            if splits * batch * args.kv_heads > 8 * 132 or splits * tile_n > ctx:
                continue
            cfg = dict(block_m=16, tile_n=tile_n, num_warps=warps, num_stages=stages)
            ta.decode_config = lambda *a, cfg=cfg: cfg
            out = torch.empty_like(b["q"])
            fn = lambda: unified_attention(b["q"], b["k_cache"], b["v_cache"], out, cu_seqlens_q=b["cu_seqlens_q"],  # noqa: E731
                                           seq_lens=b["seq_lens"], block_tables=b["block_tables"], max_query_len=1,
                                           scale=scale, workspace=workspace, num_splits=splits)
            try:
                ms, _ = gpu_time_ms(fn, 20)
            except Exception as exc:
                ms = None
                print("  failed", cfg, repr(exc)[:120])
            ta.decode_config = default_decode
            results.append({"case": f"decode b={batch} ctx={ctx}", "splits": splits, **cfg, "ms": ms,
                            "gbps": kv_bytes / ms / 1e6 if ms else None})
        best = sorted((r for r in results if r["case"] == f"decode b={batch} ctx={ctx}" and r["ms"]),
                      key=lambda r: r["ms"])[:5]
        for r in best:
            print(r, flush=True)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096])
    parser.add_argument("--sweep", action="store_true", help="try launch configurations instead (slow)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs CUDA")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    if args.sweep:
        results = sweep(args, dtype, gen)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        return
    rows = []
    header = (f"{'case':42s} {'ours ms':>9s} {'GB/s':>7s} {'splits':>6s} {'sdpa-pad/ours':>13s} "
              f"{'sdpa-gath/ours':>14s} {'flash/ours':>10s} {'maxdiff':>8s}")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} {args.dtype} H={args.heads} "
          f"KVH={args.kv_heads} D={args.head_dim} block={args.block_size}; flash-attn "
          f"{'present' if flash_attn_varlen_func else 'absent'}")
    print(header)
    for name, q_lens, ctx_lens in cases(args):
        row = run_case(name, q_lens, ctx_lens, args, dtype, gen)
        rows.append(row)

        def fmt(key, width):
            return f"{row[key]:{width}.2f}" if row.get(key) else f"{'-':>{width}s}"
        print(f"{name:42s} {row['ours_ms']:9.4f} {row['ours_gbps']:7.0f} {row.get('splits', '-')!s:>6s} "
              f"{fmt('sdpa_padded_over_ours', 13)} {fmt('sdpa_gathered_over_ours', 14)} "
              f"{fmt('flash_over_ours', 10)} {row.get('max_abs_diff_vs_sdpa', float('nan')):8.4f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

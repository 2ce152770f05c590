"""Where a CPU prefill's time goes, in-process: one long prompt, and new tokens over a cached prefix.

    python scripts/bench_cpu_prefill.py                         # SmolLM2 fp32, 1 thread, 1024 fresh + 128 over 1024
    python scripts/bench_cpu_prefill.py --profile               # also torch.profiler op tables (self CPU time)
    python scripts/bench_cpu_prefill.py --prefill-attention sdpa,kernel   # both prefill attentions, same run
    python scripts/bench_cpu_prefill.py --layer                 # one layer's attention alone: SDPA vs the kernel

Cases: `fresh` = one prompt of --prompt tokens from position 0; `prefix` = --new tokens after a cached
prefix of --prompt tokens (a prefix-cache hit: the cached blocks are only read); `short` = the same --new
tokens as a prompt of their own (prefix - short = what attending to the cached prefix costs). Each case runs
the model runner's forward (logits of the last token), warmed up, `--repeat` times per method, methods
interleaved round by round so that all see the same load; printed: median process CPU time (steadier on a
shared box than wall time) and median wall time, per method, and the ratio to the first method.
`--layer`: one attention layer alone (SmolLM2's 9/3 heads of 64, blocks of 16), the portable path's causal
SDPA (with the gather and mask it uses over a cached prefix) against the kernel, CPU ms and GFLOP/s (causal
FLOPs: 4 * heads * dim * queries * visible keys on average).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(HERE), str(HERE / "scripts")]

from bench_engine import resolve_model_dir  # noqa: E402
from engine.batch import SeqSpan  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.kernels import cpu_prefill_attention  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402


def cases(prompt: int, new: int, block_size: int, vocab: int) -> dict[str, SeqSpan]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(100, vocab - 100, (prompt + new,), generator=gen).tolist()
    blocks = list(range(1, -(-(prompt + new) // block_size) + 1))
    return {"fresh": SeqSpan(0, tokens[:prompt], 0, blocks[: -(-prompt // block_size)]),
            "prefix": SeqSpan(0, tokens[prompt:], prompt, blocks),
            "short": SeqSpan(1, tokens[prompt:], 0, [len(blocks) + 1 + i for i in range(-(-new // block_size))])}


def layer_bench(args: argparse.Namespace) -> None:
    from engine.attention.backend import attend, causal_mask
    from engine.layers.attention import Attention

    heads, kv_heads, dim, bs = 9, 3, 64, 16
    layer = Attention(heads, kv_heads, dim, dim ** -0.5)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {heads}/{kv_heads} heads of {dim}, "
          f"median of {args.repeat}\n| chunks x queries over cached | SDPA CPU ms | kernel CPU ms | SDPA GFLOP/s | "
          f"kernel GFLOP/s | kernel vs SDPA | max error |\n|---|---|---|---|---|---|---|")
    for num, queries, cached in ((1, 512, 0), (1, 1024, 0), (1, 2048, 0), (1, 128, 1024), (1, 1024, 1024),
                                 (16, 128, 0), (16, 128, 1024)):
        seq_len, gen = queries + cached, torch.Generator().manual_seed(0)
        per_seq = -(-seq_len // bs)
        tables = (torch.randperm(num * per_seq, generator=gen) + 1).int().view(num, per_seq)
        k_cache, v_cache = (torch.randn(num * per_seq + 1, bs, kv_heads, dim, generator=gen) for _ in range(2))
        q = torch.randn(num * queries, heads, dim, generator=gen)
        work = torch.tensor([[b, b * queries, queries, seq_len] for b in range(num)], dtype=torch.int32)
        positions = torch.arange(seq_len)
        slots = [tables[b, positions // bs].long() * bs + positions % bs for b in range(num)]
        fresh = [[cache.view(-1, kv_heads, dim).index_select(0, slots[b]) for cache in (k_cache, v_cache)]
                 for b in range(num)]
        mask = None if cached == 0 else causal_mask(queries, cached, seq_len, None, q.device)

        def sdpa():  # portable's run_prefills: fresh K/V as they come, a cached context gathered and masked
            out = torch.empty_like(q)
            for b in range(num):
                keys, values = fresh[b] if cached == 0 else (cache.view(-1, kv_heads, dim).index_select(0, slots[b])
                                                             for cache in (k_cache, v_cache))
                rows = slice(b * queries, (b + 1) * queries)
                out[rows] = attend(layer, q[rows].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                   values.transpose(0, 1)[None], mask)[0].transpose(0, 1)
            return out

        def kernel():
            out = torch.empty_like(q)
            cpu_prefill_attention.prefill_attention(out, q, k_cache, v_cache, work, tables, scale=layer.scale,
                                                    window=None, softcap=None)
            return out

        times = {sdpa: [], kernel: []}
        for round_ in range(args.repeat + 1):
            for method in times:
                start = time.process_time()
                method()
                if round_:  # the first round warms up
                    times[method].append(time.process_time() - start)
        flops = 4 * heads * dim * num * queries * (cached + (queries + 1) / 2)
        a, b = (statistics.median(times[m]) for m in (sdpa, kernel))
        error = (sdpa() - kernel()).abs().max().item()
        print(f"| {num} x {queries} over {cached} | {a * 1e3:.1f} | {b * 1e3:.1f} | {flops / a / 1e9:.0f} | "
              f"{flops / b / 1e9:.0f} | {a / b:.2f}x | {error:.1e} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default="smollm2")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--prefill-attention", default=None,
                        help="comma-separated methods to compare (sdpa, kernel); default: the engine's choice")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--layer", action="store_true", help="one attention layer alone: SDPA vs the kernel")
    parser.add_argument("--engine-config", default="{}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.layer:
        return layer_bench(args)
    config = EngineConfig(model_id=str(resolve_model_dir(args.model_id)), device="cpu",
                          **json.loads(args.engine_config))
    runner = ModelRunner(config, ModelConfig.from_pretrained(config.model_id))
    methods = args.prefill_attention.split(",") if args.prefill_attention else [None]
    try:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), attention {runner.attention_backend}, "
              f"element-wise {runner.elementwise_backend}, checks {runner.attention_checks}, "
              f"median of {args.repeat}")
        spans = cases(args.prompt, args.new, runner.block_size, runner.model_config.vocab_size)
        runner.run([spans["fresh"]])  # fills the prefix's blocks, warms up
        print(f"| case | method | CPU ms | wall ms | CPU vs first |\n|---|---|---|---|---|")
        for name, span in spans.items():
            times = {m: ([], []) for m in methods}
            for _ in range(args.repeat):
                for method in methods:
                    if method:
                        cpu_prefill_attention.force(method)
                    start, cpu = time.perf_counter(), time.process_time()
                    runner.run([span])
                    times[method][0].append(time.process_time() - cpu)
                    times[method][1].append(time.perf_counter() - start)
            first = statistics.median(times[methods[0]][0])
            for method in methods:
                cpu_ms, wall_ms = (1e3 * statistics.median(series) for series in times[method])
                print(f"| {name} {len(span.token_ids)} over {span.start_pos} | {method or 'default'} | {cpu_ms:.1f} | "
                      f"{wall_ms:.1f} | {cpu_ms / 1e3 / first:.2f}x |", flush=True)
            if args.profile:
                for method in methods:
                    if method:
                        cpu_prefill_attention.force(method)
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                        runner.run([span])
                    print(f"--- {name}, {method or 'default'} ---")
                    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    finally:
        runner.close()


if __name__ == "__main__":
    main()

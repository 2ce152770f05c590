"""Where a CPU prefill's time goes, in-process: one long prompt, and new tokens over a cached prefix.

    python scripts/bench_cpu_prefill.py                         # SmolLM2 fp32, 1 thread, 1024 fresh + 128 over 1024
    python scripts/bench_cpu_prefill.py --profile               # also torch.profiler op tables (self CPU time)
    python scripts/bench_cpu_prefill.py --prefill-attention sdpa,kernel   # both prefill attentions, same run

Cases: `fresh` = one prompt of --prompt tokens from position 0; `prefix` = --new tokens after a cached
prefix of --prompt tokens (what a prefix-cache hit costs: the cached blocks are only read). Each case runs
the model runner's forward (logits of the last token), warmed up, `--repeat` times per method, methods
interleaved round by round so that all see the same load; printed: median process CPU time (steadier on a
shared box than wall time) and median wall time, per method, and the ratio to the first method.
"""
from __future__ import annotations

import argparse
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
            "prefix": SeqSpan(0, tokens[prompt:], prompt, blocks)}


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
    parser.add_argument("--engine-config", default="{}")
    args = parser.parse_args()
    import json
    torch.set_num_threads(args.threads)
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

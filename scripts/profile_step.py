"""Where a decode step's device time goes: kernels per step, by name and kind, under torch.profiler.

    python scripts/profile_step.py --config-like 8b --load-format dummy --model-id TOKENIZER_DIR \\
        --device cuda --dtype bfloat16 --batch-sizes 1,256 --prompt-len 128 [--profile-steps 8]

For each batch size B, B prompts go in, the prefill and a few decode steps run, then --profile-steps
decode steps run under torch.profiler. It prints, per step: wall ms, device-busy ms (the sum of kernel
times), kernel launches, and the kernels grouped by kind (GEMM, attention, norm/RoPE/activation,
sampling, copies) and by name. Takes bench_engine.py's model flags; CPU works too (op-level times).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engine  # noqa: E402

KINDS = (  # first match wins; names are lower-cased kernel (CUDA) or op (CPU) names
    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90_xmma", "matmul", "addmm", "aten::mm", "linear")),
    ("attention", ("paged", "attention", "attn", "flash", "sdpa", "decode_kernel", "prefill_kernel")),
    ("norm/rope/act", ("rms", "norm", "rope", "rotary", "silu", "gelu", "act_and_mul", "fused_add")),
    ("sampling", ("argmax", "topk", "sort", "softmax", "multinomial", "scatter", "gather", "penalt", "cumsum")),
    ("copy/fill", ("copy", "memcpy", "memset", "fill", "cat", "index_put", "store_kv", "reshape_and_cache")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other elementwise")


def device_events(prof: Any, device: torch.device) -> list[tuple[str, float]]:
    """(name, microseconds) of every kernel (CUDA) or every top-level aten op (CPU) the profile saw."""
    events = []
    for event in prof.events():
        if device.type == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
        elif not event.name.startswith("aten::") or event.cpu_parent is not None:
            continue
        events.append((event.name, event.time_range.elapsed_us()))
    return events


def profile_batch(engine: Any, prompts: list[list[int]], steps: int, device: torch.device,
                  top: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{len(prompts)}-{i}", prompt, bench_engine.greedy(steps + 64))
    for _ in range(64):  # the prefill (in chunks where the budget cuts it) until every sequence decodes
        engine.step()
        if engine.stats().batch_size == len(prompts):
            break
    for _ in range(2):  # warm decode steps: the last prefill chunk may have shared the first full step
        engine.step()
    bench_engine.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        bench_engine.synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    while engine.has_unfinished_requests():
        engine.step()
    events = device_events(prof, device)
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for name, us in events:
        by_name[name].append(us)
    by_kind: dict[str, float] = collections.defaultdict(float)
    for name, times in by_name.items():
        by_kind[kind_of(name)] += sum(times) / steps / 1e3
    busy_ms = sum(us for _, us in events) / steps / 1e3
    names = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    return {
        "batch": len(prompts), "steps": steps, "wall_ms_per_step": wall_ms, "busy_ms_per_step": busy_ms,
        "launches_per_step": len(events) / steps,
        "by_kind_ms_per_step": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top": [{"name": name[:110], "kind": kind_of(name), "per_step": len(times) / steps,
                 "avg_us": sum(times) / len(times), "ms_per_step": sum(times) / steps / 1e3}
                for name, times in names],
    }


def print_profile(result: dict[str, Any]) -> None:
    print(f"\nbatch {result['batch']}: {result['wall_ms_per_step']:.2f} ms/step wall, "
          f"{result['busy_ms_per_step']:.2f} ms device busy, {result['launches_per_step']:.0f} kernels/step")
    print("  by kind (ms/step): " + ", ".join(f"{k} {v:.3f}" for k, v in result["by_kind_ms_per_step"].items()))
    print("  | ms/step | per step | avg us | kind | kernel |\n  |---|---|---|---|---|")
    for row in result["top"]:
        print(f"  | {row['ms_per_step']:.3f} | {row['per_step']:.0f} | {row['avg_us']:.1f} | {row['kind']} | "
              f"{row['name']} |")


def run(args: argparse.Namespace, model_dir: Path, device: torch.device, dtype: str) -> dict[str, Any]:
    max_batch = max(args.batch_sizes)
    args.new_tokens = args.profile_steps + 64
    engine = bench_engine.build_engine(model_dir, args, device, dtype, max_batch, 0)
    print(f"engine backends: attention {engine.runner.attention_backend}, linear {engine.runner.linear_backend}, "
          f"element-wise {engine.runner.elementwise_backend}, decode CUDA graphs {engine.runner.cuda_graph_sizes or 'none'}")
    try:
        prompts = bench_engine.make_prompts(engine.tokenizer, max_batch, args.prompt_len, engine.vocab_size)
        profile_batch(engine, prompts[:2], 2, device, 1)  # warm-up: compiles, graph capture
        results = []
        for batch in args.batch_sizes:
            results.append(profile_batch(engine, prompts[:batch], args.profile_steps, device, args.top))
            print_profile(results[-1])
        return {"profiles": results}
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--profile-steps", type=int, default=8, help="decode steps under the profiler")
    extra.add_argument("--top", type=int, default=25, help="kernels listed by name")
    own, rest = extra.parse_known_args(argv)
    args = bench_engine.parse_args(rest)
    args.profile_steps, args.top = own.profile_steps, own.top
    results = bench_engine.run_benchmark(args, run)
    if args.json_out:
        print(json.dumps({"profiles": len(results["profiles"])}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The few-row float32 linear (engine/kernels/cpu_gemv.py) against oneDNN's packed GEMM (engine/layers/cpu_gemm.py)
over one decode step's linears: a Llama-layout model's layer shapes x its layer count, plus the LM head.

    python scripts/bench_cpu_gemv.py [--model-id smollm2] [--rows 1,4,8,16] [--threads 2] [--bfloat16]

Random weights of the model's shapes (config.json only), each layer its own, so a step streams them from memory
as the engine does; both kernels alternate twice per row count; median of 7 steps, ms per step. `--bfloat16`:
weights whose values are bfloat16s (a bfloat16 checkpoint), tgi_gemv's float32 panels against its bfloat16 ones
(the same results bit for bit, half the bytes) instead of oneDNN against tgi_gemv.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_engine  # noqa: E402

from engine.kernels import cpu_gemv  # noqa: E402
from engine.layers import cpu_gemm  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default="smollm2")
    parser.add_argument("--rows", default="1,4,8,16", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--threads", type=int)
    parser.add_argument("--bfloat16", action="store_true", help="tgi_gemv's float32 panels against its bfloat16 ones")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_pretrained(bench_engine.resolve_model_dir(args.model_id))
    hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = [((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, hidden),
              (hidden, cfg.num_attention_heads * d), (2 * inter, hidden), (hidden, inter)]
    generator = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=generator) * 0.02 for n, k in shapes] for _ in range(cfg.num_hidden_layers)]
    weights.append([torch.randn(cfg.vocab_size, hidden, generator=generator) * 0.02])
    if args.bfloat16:
        weights = [[w.bfloat16().float() for w in layer] for layer in weights]
        names = ("tgi_gemv float32 panels", "tgi_gemv bfloat16 panels")
        packed = {names[0]: [[cpu_gemv.pack(w) for w in layer] for layer in weights],
                  names[1]: [[cpu_gemv.pack(w, dtype=torch.bfloat16) for w in layer] for layer in weights]}
    else:
        names = ("oneDNN", "tgi_gemv")
        packed = {names[0]: [[cpu_gemm.pack(w) for w in layer] for layer in weights],
                  names[1]: [[cpu_gemv.pack(w) for w in layer] for layer in weights]}
    print(f"{cfg.architecture}: {cfg.num_hidden_layers} layers of {shapes} + LM head {cfg.vocab_size} x {hidden}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"| rows | {names[0]} ms / step | {names[1]} ms / step | {names[0]} / {names[1]} |\n|---|---|---|---|")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=generator) for k in {w.shape[1] for layer in weights for w in layer}}

        def step(name: str) -> None:
            for layer, panels in zip(weights, packed[name]):
                for w, p in zip(layer, panels):
                    if name == "oneDNN":
                        cpu_gemm.linear(inputs[w.shape[1]], p, None)
                    else:
                        cpu_gemv.linear(inputs[w.shape[1]], p, w.shape[0])

        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(2):
            for name in names:
                step(name)
                for _ in range(7):
                    start = time.perf_counter()
                    step(name)
                    times[name].append(1e3 * (time.perf_counter() - start))
        a, b = statistics.median(times[names[0]]), statistics.median(times[names[1]])
        print(f"| {rows} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

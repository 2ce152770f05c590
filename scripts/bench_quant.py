"""Quantized GEMMs against the bf16 GEMM on Llama-3-8B's linear shapes, batch 1/16/256 (one GPU, < 2 min).

    python scripts/bench_quant.py --json quant.json        # CUDA; FP8 rows need compute capability 8.9+
    python scripts/bench_quant.py --smoke                  # CPU, Triton interpreter, tiny shapes: checks the script
    python scripts/bench_quant.py --cpu                    # CPU: dequantize-per-forward vs fp32, SmolLM2 shapes

Rows per (layer, batch):
- bf16:      F.linear(x, W) with W [N, K] bf16 (cuBLAS), the baseline of every ratio;
- w4a16:     engine.kernels.quant_gemm.wna16_gemm, int4 with group 128 (GPTQ/AWQ/compressed-tensors layout);
- w4a16-act: the same with act-order (scales gathered through g_idx);
- w8a16:     int8, group 128;
- w4a16-gemv / w8a16-gemv: quant_gemm.wna16_gemv, the split-K GEMV the engine takes at decode (batch <= 4)
  on layers where it times faster at load ("-" at larger batches);
- fp8:       what the FP8 method runs: per-token activation quantization + torch._scaled_mm, per-channel scales.
Each quantized result is checked against the bf16 GEMM on its dequantized weight before timing.
Ratios are bf16 time / method time (above 1 = faster than bf16).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `engine` importable from a checkout

from engine.kernels.quant_gemm import GEMV_MAX_ROWS, dequantize, wna16_gemm, wna16_gemv  # noqa: E402
from engine.layers.quantization.fp8 import quantize_rows, quantize_tokens, scaled_mm_usable  # noqa: E402

# Llama-3-8B: hidden 4096, 32 heads / 8 kv heads of 128, MLP 14336 (fused as the engine fuses them)
LLAMA3_8B = {"qkv_proj": (4096, 6144), "o_proj": (4096, 4096), "gate_up_proj": (4096, 28672),
             "down_proj": (14336, 4096)}
SMOKE = {"qkv_proj": (256, 384), "down_proj": (512, 256)}
GROUP = 128


def packed_weight(k: int, n: int, bits: int, act_order: bool, device: torch.device, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(k * 7 + n + bits)
    pack = 32 // bits
    words = torch.randint(-2**31, 2**31 - 1, (k // pack, n), generator=generator, dtype=torch.int64)
    qweight = words.to(torch.int32)
    groups = -(-k // GROUP)
    scales = (torch.rand(groups, n, generator=generator) * 0.002 + 0.0005).to(dtype)
    zeros = torch.full((groups, n), float(2 ** (bits - 1)), dtype=dtype)
    g_idx = (torch.arange(k) // GROUP).to(torch.int32)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=generator)]
    return [t.to(device) for t in (qweight, scales, zeros, g_idx)]


def timer(device: torch.device):
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100)
    import time

    def cpu_time(fn):
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return cpu_time


def bench(shapes: dict[str, tuple[int, int]], batches: list[int], device: torch.device) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter is wrong in bf16
    measure, rows = timer(device), []
    fp8 = scaled_mm_usable(device)
    for layer, (k, n) in shapes.items():
        weight = (torch.randn(n, k, device=device) * 0.02).to(dtype)
        quantized = {name: packed_weight(k, n, bits, act, device, dtype)
                     for name, bits, act in (("w4a16", 4, False), ("w4a16-act", 4, True), ("w8a16", 8, False))}
        bits_of = {"w4a16": 4, "w4a16-act": 4, "w8a16": 8}
        w8, w8_scale = quantize_rows(weight) if fp8 else (None, None)
        for m in batches:
            x = torch.randn(m, k, device=device).to(dtype)
            row = {"layer": layer, "k": k, "n": n, "batch": m, "bf16_ms": measure(lambda: F.linear(x, weight))}
            for name, (qweight, scales, zeros, g_idx) in quantized.items():
                bits, group = bits_of[name], 0 if name.endswith("act") else GROUP
                fn = lambda: wna16_gemm(x, qweight, scales, zeros, g_idx, bits, group)  # noqa: E731
                want = (x.float() @ dequantize(qweight, scales, zeros, g_idx, bits, torch.float32))
                error = (fn().float() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
                if error > 2e-2:
                    raise SystemExit(f"{name} {layer} batch {m}: relative error {error:.3g} against the reference")
                row[f"{name}_ms"] = measure(fn)
                if name in ("w4a16", "w8a16"):
                    row[f"{name}-gemv_ms"] = float("nan")
                    if m <= GEMV_MAX_ROWS:
                        gemv = lambda: wna16_gemv(x, qweight, scales, zeros, g_idx, bits, group)  # noqa: E731
                        error = (gemv().float() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
                        if error > 2e-2:
                            raise SystemExit(f"{name}-gemv {layer} batch {m}: relative error {error:.3g}")
                        row[f"{name}-gemv_ms"] = measure(gemv)
            if fp8:
                def fp8_gemm():
                    xq, x_scale = quantize_tokens(x)
                    return torch._scaled_mm(xq, w8.t(), scale_a=x_scale, scale_b=w8_scale.view(1, -1),
                                            out_dtype=torch.bfloat16)
                row["fp8_ms"] = measure(fp8_gemm)
            rows.append(row)
    return rows


# SmolLM2-135M: hidden 576, 9 heads / 3 kv heads of 64, MLP 1536
SMOLLM2 = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_up_proj": (576, 3072), "down_proj": (1536, 576)}


def bench_cpu(batches: list[int]) -> list[dict]:
    """Why the CPU path dequantizes at load: what dequantizing the int4 weight every forward, then an fp32
    matmul, costs against the fp32 matmul alone (which is what a layer dequantized at load runs)."""
    from engine.kernels.quant_gemm import gemm_reference

    measure, rows = timer(torch.device("cpu")), []
    for layer, (k, n) in SMOLLM2.items():
        weight = torch.randn(n, k) * 0.02
        qweight, scales, zeros, g_idx = packed_weight(k, n, 4, False, torch.device("cpu"), torch.float32)
        for m in batches:
            x = torch.randn(m, k)
            best = lambda fn: min(measure(fn) for _ in range(5))  # noqa: E731
            rows.append({"layer": layer, "k": k, "n": n, "batch": m, "bf16_ms": best(lambda: F.linear(x, weight)),
                         "dequant-per-forward_ms": best(lambda: gemm_reference(x, qweight, scales, zeros, g_idx, 4))})
    return rows


def report(rows: list[dict]) -> None:
    methods = [key[:-3] for key in rows[0] if key.endswith("_ms") and key != "bf16_ms"]
    widths = [max(12, len(m) + 4) for m in methods]
    print(f"{'layer':<13}{'K x N':>13}{'batch':>6}{'bf16 ms':>9}" +
          "".join(f"{m + ' x':>{w}}" for m, w in zip(methods, widths)))
    for row in rows:
        ratios = "".join(f"{row['bf16_ms'] / row[m + '_ms']:>{w}.3f}" if row[m + "_ms"] == row[m + "_ms"]
                         else f"{'-':>{w}}" for m, w in zip(methods, widths))
        print(f"{row['layer']:<13}{row['k']:>6} x{row['n']:>6}{row['batch']:>6}{row['bf16_ms']:>9.4f}{ratios}")
    print("x = bf16 time / method time (>1: faster than bf16)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write every number to this JSON file")
    parser.add_argument("--batches", default="1,16,256")
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    parser.add_argument("--cpu", action="store_true", help="dequantize-per-forward vs fp32 F.linear on CPU (the "
                                                           "'bf16' column is fp32 here)")
    args = parser.parse_args(argv)
    if args.cpu:
        rows = bench_cpu([int(b) for b in args.batches.split(",")])
        report(rows)
        if args.json:
            Path(args.json).write_text(json.dumps({"date": datetime.date.today().isoformat(), "device": "cpu",
                                                   "rows": rows}, indent=1))
        return 0
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_quant.py needs a CUDA GPU (or --smoke to check the script on CPU)")
    device = torch.device("cpu" if args.smoke else "cuda")
    rows = bench(SMOKE if args.smoke else LLAMA3_8B, [int(b) for b in args.batches.split(",")], device)
    report(rows)
    if device.type == "cuda" and not scaled_mm_usable(device):
        print("fp8: not measured, torch._scaled_mm needs compute capability 8.9+ (the engine dequantizes there)")
    if args.json:
        machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
        Path(args.json).write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "device": machine, "torch": torch.__version__,
            "group_size": GROUP, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

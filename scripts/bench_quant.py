"""Quantized GEMMs against the bf16 GEMM on Llama-3-8B's linear shapes, batch 1/16/256 (one GPU, < 2 min).

    python scripts/bench_quant.py --json quant.json        # CUDA; FP8 rows need compute capability 8.9+
    python scripts/bench_quant.py --smoke                  # CPU, Triton interpreter, tiny shapes: checks the script
    python scripts/bench_quant.py --cpu                    # CPU: dequantize-per-forward vs fp32, SmolLM2 shapes

Rows per (layer, batch):
- bf16:          F.linear(x, W) with W [N, K] bf16 (cuBLAS), the baseline of every ratio;
- w4a16:         engine.kernels.quant_gemm.wna16_gemm, int4 with group 128 (GPTQ/AWQ/compressed-tensors layout),
                 as the engine runs it: the launch (GEMV or tiled kernel, tiles, K splits) that
                 quant_gemm.choose_configs timed fastest for the shape and row bucket, as at model load;
- w4a16-default: the same kernel with the heuristic launch (quant_gemm.default_config), no timing;
- w4a16-act:     act-order as the engine loads it (rows sorted by group, x read through the permutation,
                 wna16.sort_act_order), chosen launch;
- w8a16:         int8, group 128, chosen launch;
- fp8:           what the FP8 method runs: per-token activation quantization (one Triton kernel,
                 engine/kernels/fp8_quant.py) + torch._scaled_mm, per-channel scales;
- fp8-torch-quant: the same with the quantization in torch ops (the kernel's reference): the kernel's A/B.
Each quantized result is checked against the bf16 GEMM on its dequantized weight before timing; a method that
raises (e.g. does not compile) is reported and left out ("-"). The launches chosen are listed after the table.
Ratios are bf16 time / method time (above 1 = faster than bf16).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `engine` importable from a checkout

from engine.kernels import quant_gemm  # noqa: E402
from engine.kernels.quant_gemm import dequantize, wna16_gemm  # noqa: E402
from engine.kernels.fp8_quant import quantize_tokens_reference  # noqa: E402
from engine.layers.quantization.fp8 import quantize_rows, quantize_tokens, scaled_mm_usable  # noqa: E402
from engine.layers.quantization.wna16 import sort_act_order  # noqa: E402

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

        return lambda fn: do_bench(fn, warmup=10, rep=40)

    def cpu_time(fn):
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return cpu_time


METHODS = {"w4a16": (4, False, True), "w4a16-default": (4, False, False), "w4a16-act": (4, True, True),
           "w8a16": (8, False, True)}  # name: bits, act-order, launch chosen by timing


def bench(shapes: dict[str, tuple[int, int]], batches: list[int], device: torch.device,
          tune: bool = True) -> tuple[list[dict], dict]:
    """Rows, and {"tune_s": seconds spent choosing launches (compiles included), "chosen": {...}}."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter is wrong in bf16
    measure, rows = timer(device), []
    fp8 = scaled_mm_usable(device)
    info = {"tune_s": 0.0, "chosen": {}}
    for layer, (k, n) in shapes.items():
        weight = (torch.randn(n, k, device=device) * 0.02).to(dtype)
        quantized = {(bits, act): packed_weight(k, n, bits, act, device, dtype)
                     for bits, act, _ in METHODS.values()}
        reference = {key: list(tensors) for key, tensors in quantized.items()}  # as packed, for dequantize
        perms = {key: None for key in quantized}
        for (bits, act), tensors in quantized.items():
            if act:  # what the engine does at load
                tensors[0], tensors[3], perms[(bits, act)] = sort_act_order(tensors[0], tensors[3], bits, GROUP)
        if tune and device.type == "cuda":
            start = time.perf_counter()
            for (bits, act), tensors in quantized.items():
                chosen = quant_gemm.choose_configs(dtype, *tensors, bits, GROUP, perm=perms[(bits, act)])
                info["chosen"][f"{layer} {bits}-bit{' act' if act else ''}"] = {
                    b: c.label() for b, c in chosen.items()}
            info["tune_s"] += time.perf_counter() - start
        w8, w8_scale = quantize_rows(weight) if fp8 else (None, None)
        for m in batches:
            x = torch.randn(m, k, device=device).to(dtype)
            row = {"layer": layer, "k": k, "n": n, "batch": m, "bf16_ms": measure(lambda: F.linear(x, weight))}
            for name, (bits, act, chosen) in METHODS.items():
                qweight, scales, zeros, g_idx = quantized[(bits, act)]
                perm = perms[(bits, act)]
                config = None if chosen else quant_gemm.default_config(m, n, k, bits, GROUP, device)
                fn = lambda: wna16_gemm(x, qweight, scales, zeros, g_idx, bits, GROUP, config=config,  # noqa: E731
                                        perm=perm)
                row[f"{name}_ms"] = float("nan")
                try:
                    want = (x.float() @ dequantize(*reference[(bits, act)], bits, torch.float32))
                    error = (fn().float() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
                    del want
                    if error > 2e-2:
                        print(f"{name} {layer} batch {m}: relative error {error:.3g} against the reference, "
                              "not timed", file=sys.stderr)
                        continue
                    row[f"{name}_ms"] = measure(fn)
                except Exception as exc:  # noqa: BLE001 - one kernel that fails here must not hide the others
                    print(f"{name} {layer} batch {m}: raised {type(exc).__name__}: {exc}"[:400], file=sys.stderr)
            if fp8:
                def fp8_gemm(quantize):
                    def gemm():
                        xq, x_scale = quantize(x)
                        return torch._scaled_mm(xq, w8.t(), scale_a=x_scale, scale_b=w8_scale.view(1, -1),
                                                out_dtype=torch.bfloat16)
                    return gemm
                row["fp8_ms"] = measure(fp8_gemm(quantize_tokens))
                # the same GEMM after torch's eight-op quantization: the kernel's A/B
                row["fp8-torch-quant_ms"] = measure(fp8_gemm(quantize_tokens_reference))
            rows.append(row)
    return rows, info


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
    parser.add_argument("--no-tune", action="store_true", help="heuristic launches only (no timing at start)")
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
    start = time.perf_counter()
    rows, info = bench(SMOKE if args.smoke else LLAMA3_8B, [int(b) for b in args.batches.split(",")], device,
                       tune=not args.no_tune)
    report(rows)
    for what, chosen in info["chosen"].items():
        print(f"chosen launches, {what}: " + ", ".join(f"batch<={'4' if b == 1 else '32' if b == 16 else 'any'} "
                                                      f"{label}" for b, label in chosen.items()))
    info["total_s"] = time.perf_counter() - start
    print(f"choosing launches took {info['tune_s']:.1f} s (compiles included), the whole run {info['total_s']:.1f} s")
    if device.type == "cuda" and not scaled_mm_usable(device):
        print("fp8: not measured, torch._scaled_mm needs compute capability 8.9+ (the engine dequantizes there)")
    if args.json:
        machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
        Path(args.json).write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "device": machine, "torch": torch.__version__,
            "group_size": GROUP, "rows": rows, **info}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

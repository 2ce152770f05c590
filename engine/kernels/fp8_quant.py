"""Per-token FP8 (e4m3) activation quantization in one Triton kernel, and its torch reference.

FP8 W8A8 layers (engine.layers.quantization.fp8) quantize their input rows before every `torch._scaled_mm`:
each row's absmax becomes its scale (absmax / 448, at least 1e-12 / 448), and the row divided by it is rounded
to e4m3. In torch that is about eight kernels per linear (casts, abs, amax, clamp, divisions), which on an H200
cost more than the FP8 GEMM saves. Here it is one program per row: a pass for the absmax, a pass to scale, clamp,
round and store. The arithmetic is torch's (fp32 absmax, IEEE division, round to nearest even), so the
reference and the kernel agree bit for bit; `self_check` holds the kernel to that at start-up on the device.
No host syncs: capturable in CUDA graphs.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton use the reference
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def quantize_tokens_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 scale [M, 1]): the dynamic per-token activation scales, in torch."""
    scale = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


if triton is not None:
    @triton.jit(do_not_specialize=["K"])
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, FMAX: tl.constexpr,
                              BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / FMAX
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FMAX), FMAX)
            tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


def quantize_tokens_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_tokens_reference` in one kernel launch (CUDA tensors, or any under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("the FP8 quantization kernel needs the `triton` package")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, device=x.device, dtype=FP8)
    scale = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    if m:
        block = min(4096, triton.next_power_of_2(max(k, 16)))
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FMAX=FP8_MAX, BLOCK=block,
                                    num_warps=8 if block >= 2048 else 4)
    return q, scale


_checks: dict[torch.device, str] = {}


def self_check(device: torch.device) -> str:
    """Once per device: "ok" when the kernel gives the reference's bytes on random rows (bf16, fp16 and fp32;
    1, 3 and 70 rows; widths 64, 1000 and 4096, one row of zeros, one with a huge value), else why not."""
    if device not in _checks:
        try:
            verdict = _compare_on(device)
        except Exception as error:  # a kernel that does not compile here must not take the engine down
            verdict = f"raised {type(error).__name__}: {error}"
        _checks[device] = verdict
    return _checks[device]


def _compare_on(device: torch.device) -> str:
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, width in ((1, 4096), (3, 1000), (70, 64)):
            x = torch.randn(rows, width, generator=generator) * 4
            if rows > 2:
                x[1] = 0.0
                x[2, width // 2] = 6e4
            x = x.to(device, dtype)
            got_q, got_s = quantize_tokens_triton(x)
            want_q, want_s = quantize_tokens_reference(x)
            if not torch.equal(got_s, want_s):
                return f"scales differ from torch's ({dtype}, {rows} x {width})"
            if not torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)):
                return f"e4m3 values differ from torch's ({dtype}, {rows} x {width})"
    return "ok"


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on a CUDA device where it passed its self-check, else the torch reference."""
    if x.device.type == "cuda" and triton is not None and self_check(x.device) == "ok":
        return quantize_tokens_triton(x)
    return quantize_tokens_reference(x)


def kernel_report() -> dict[str, str]:
    """For /info: {"fp8_activation_quant": "triton" or "torch (why)"} once checked on a device."""
    return {"fp8_activation_quant": "triton" if verdict == "ok" else f"torch ({verdict})"
            for verdict in _checks.values()}

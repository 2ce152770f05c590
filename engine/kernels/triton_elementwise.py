"""Fused GPU element-wise kernels of the decoder layer (Triton): residual add + RMSNorm, RoPE in place on
q and k, SiLU-and-mul.

Eager torch runs these as ~40 kernels a layer (casts, mean, rsqrt, the cos/sin gather, cat, addcmul,
...). On an H200, an 8B model's batch-1 decode step spent ~1.9 ms of its 5.95 ms of device time in them,
against 3.5 ms for all the weights; inside a CUDA graph each kernel still costs its launch gap. Here each
is one kernel: one program per row (norm, RoPE) or per row and column block (SiLU-and-mul), reading and
writing every value once.

References (the exact formulas, roundings included, that the kernels follow) are the torch paths they
replace: RMSNorm.norm / RMSNorm.forward (engine/layers/layernorm.py), RotaryEmbedding.forward
(engine/layers/rotary_embedding.py), SiluAndMul.forward (engine/layers/activation.py): each intermediate
that torch rounds to the model's dtype is rounded here too. `self_check` runs every kernel against those
references at start-up; `install` turns the fused paths on in a model's layers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import choice, triton_interpreted


@triton.jit
def _add_rms_norm_kernel(x_ptr, x_stride, r_ptr, r_stride, w_ptr, out_ptr, sum_ptr, n, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # torch: x + residual, rounded to the dtype, is both the sum out and the norm's input
        r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * n + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inverse = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    y = (xf * inverse).to(x.dtype)  # torch: the normalized row rounded, then times the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit
def _rope_heads(x_ptr, stride_t, stride_h, heads, token, c1, c2, s1, s2,
                HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < HALF)
    first = x_ptr + token * stride_t + h * stride_h + d
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    # torch: addcmul(x * cos, rotate_half(x), sin): the product x * cos rounded, the sum rounded once
    out1 = ((x1 * c1.to(dtype)).to(tl.float32) + x2.to(tl.float32) * s1.to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * c2.to(dtype)).to(tl.float32) + x1.to(tl.float32) * s2.to(dtype).to(tl.float32)).to(dtype)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)


@triton.jit
def _rope_kernel(q_ptr, q_stride_t, q_stride_h, q_heads, k_ptr, k_stride_t, k_stride_h, k_heads,
                 positions_ptr, cos_ptr, sin_ptr, table_stride,
                 HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    in_half = d < HALF
    row = position * table_stride + d
    c1 = tl.load(cos_ptr + row, mask=in_half, other=0.0)
    c2 = tl.load(cos_ptr + row + HALF, mask=in_half, other=0.0)
    s1 = tl.load(sin_ptr + row, mask=in_half, other=0.0)
    s2 = tl.load(sin_ptr + row + HALF, mask=in_half, other=0.0)
    _rope_heads(q_ptr, q_stride_t, q_stride_h, q_heads, token, c1, c2, s1, s2, HALF, BLOCK_HQ, BLOCK_D)
    _rope_heads(k_ptr, k_stride_t, k_stride_h, k_heads, token, c1, c2, s1, s2, HALF, BLOCK_HK, BLOCK_D)


@triton.jit
def _silu_and_mul_kernel(x_ptr, x_stride, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + n + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # torch: F.silu rounded, then .mul_(up) rounded
    tl.store(out_ptr + row * n + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, n] with a unit last stride (a view where it can be one)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm.forward in one kernel: norm(x), or (norm(x + residual), x + residual). weight has x's dtype."""
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x)
    rows = x2.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    r2 = _rows(residual) if residual is not None else x2
    summed = torch.empty_like(out) if residual is not None else out
    if rows:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(rows,)](x2, x2.stride(0), r2, r2.stride(0), weight, out, summed, n, eps,
                                      HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block))
    if residual is None:
        return out.view(shape)
    return out.view(shape), summed.view(shape)


def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, heads, head_dim] and k [T, kv_heads, head_dim] in place by the rows `positions` of the
    tables cos/sin [max_position, rotary_dim] (RotaryEmbedding's: sin's first half negated). Channels past
    rotary_dim pass through. Returns (q, k)."""
    tokens, rot = q.shape[0], cos.shape[-1]
    assert q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
    if tokens:
        half = rot // 2
        block_d = triton.next_power_of_2(half)
        block_hq, block_hk = triton.next_power_of_2(q.shape[1]), triton.next_power_of_2(k.shape[1])
        _rope_kernel[(tokens,)](q, q.stride(0), q.stride(1), q.shape[1], k, k.stride(0), k.stride(1), k.shape[1],
                                positions, cos, sin, cos.stride(0), HALF=half, BLOCK_HQ=block_hq,
                                BLOCK_HK=block_hk, BLOCK_D=block_d, num_warps=_warps(block_hq * block_d))
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiluAndMul.forward: silu(gate) * up of x [..., 2n] = [gate | up]."""
    shape, n = x.shape, x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, x2.stride(0), out, n, BLOCK=block,
                                                                   num_warps=4)
    return out.view(*shape[:-1], n)


def choose(wanted: str, device: torch.device, dtype: torch.dtype) -> str:
    """'triton' or 'aten' for this device and dtype; raises when `wanted` cannot be honoured."""
    return choice.choose(wanted, "triton", "aten", lambda: unusable_reason(device, dtype),
                         what="GPU element-wise backend", flag="--gpu-elementwise", device=device)


def unusable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the fused kernels cannot serve this device and dtype (None: they can, and passed self_check)."""
    if device.type != "cuda" and not triton_interpreted():
        return f"device is {device.type} (Triton kernels need a GPU, or TRITON_INTERPRET=1)"
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {dtype}"
    try:
        return self_check(device, dtype)
    except Exception as error:  # a kernel that fails to compile must not take the engine down
        return f"self-check raised {type(error).__name__}: {error}"


def self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Each kernel against the torch formula it replaces, on odd shapes and strided views; None when all agree.
    Tolerance: one rounding of `dtype` (the kernels' float32 sums run in another order than torch's)."""
    from engine.layers.activation import SiluAndMul
    from engine.layers.layernorm import RMSNorm
    from engine.layers.rotary_embedding import RotaryEmbedding

    generator = torch.Generator().manual_seed(0)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:
        return torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

    for rows in (1, 5, 33):
        x, residual = rand(rows, 100, scale=3), rand(rows, 100)
        norm = RMSNorm(100, 1e-5).to(device, dtype)
        norm.weight.data.copy_(torch.rand(100, generator=generator) + 0.5)
        want, want_sum = norm(x, residual)
        got, got_sum = add_rms_norm(x, residual, norm.weight, 1e-5)
        if not (close(got, want) and torch.equal(got_sum, want_sum)):
            return "add + RMSNorm disagrees with RMSNorm"
        if not close(add_rms_norm(x, None, norm.weight, 1e-5), norm(x)):
            return "RMSNorm disagrees with RMSNorm"
        rope = RotaryEmbedding(16, 1024, 10000.0, rotary_dim=12).to(device)
        qkv = rand(rows, 7 * 16)
        q, k = qkv[:, :64].view(rows, 4, 16), qkv[:, 64:96].view(rows, 2, 16)
        positions = torch.randint(0, 1024, (rows,), generator=generator).to(device)
        want_q, want_k = rope(positions, q, k)
        got_q, got_k = rope_(q.clone(), k.clone(), positions, rope.cos, rope.sin)
        if not (close(got_q, want_q) and close(got_k, want_k)):
            return "RoPE disagrees with RotaryEmbedding"
        gate_up = rand(rows, 2 * 50, scale=4)
        if not close(silu_and_mul(gate_up), SiluAndMul()(gate_up.clone())):
            return "SiLU-and-mul disagrees with SiluAndMul"
    return None


def install(model: torch.nn.Module) -> int:
    """Turn the fused paths on in `model`'s RMSNorm, RotaryEmbedding and SiluAndMul modules (exact classes)."""
    return choice.install_fused(model, "fused_gpu")

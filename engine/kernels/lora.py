"""Batched LoRA for a mixed batch: each token t adds B_i (A_i x_t) for its own adapter i (0 = none).

Two kernels, one program per token: `shrink` h[t] = A_i x_t (float32, [T, R]) and `expand`
y[t] += B_i h[t], reading adapter i's rows of the stacked A [N, R, in] and B [N, out, R]. Tokens of
the base model (index 0) do nothing. No GPU->CPU sync. Reference: engine/kernels/lora_reference.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink(x_ptr, a_ptr, idx_ptr, h_ptr, K, R, stride_x, stride_an, stride_ar, stride_h,
            BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    adapter = tl.load(idx_ptr + t)
    if adapter > 0:
        rows = tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        a_base = a_ptr + (adapter - 1).to(tl.int64) * stride_an
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + t.to(tl.int64) * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
            av = tl.load(a_base + rows[:, None] * stride_ar + cols[None, :],
                         mask=(rows[:, None] < R) & (cols[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
        tl.store(h_ptr + t.to(tl.int64) * stride_h + rows, acc, mask=rows < R)


@triton.jit
def _expand(h_ptr, b_ptr, idx_ptr, y_ptr, N_OUT, R, stride_h, stride_bn, stride_bo, stride_y,
            BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    adapter = tl.load(idx_ptr + t)
    if adapter > 0:
        outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_R)
        hv = tl.load(h_ptr + t.to(tl.int64) * stride_h + rows, mask=rows < R, other=0.0)
        bv = tl.load(b_ptr + (adapter - 1).to(tl.int64) * stride_bn + outs[:, None] * stride_bo + rows[None, :],
                     mask=(outs[:, None] < N_OUT) & (rows[None, :] < R), other=0.0).to(tl.float32)
        update = tl.sum(bv * hv[None, :], axis=1)
        y_row = y_ptr + t.to(tl.int64) * stride_y + outs
        yv = tl.load(y_row, mask=outs < N_OUT, other=0.0)
        tl.store(y_row, (yv.to(tl.float32) + update).to(yv.dtype), mask=outs < N_OUT)


def lora_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               token_indices: torch.Tensor) -> torch.Tensor:
    """Add each token's adapter update to y in place and return y.

    x [T, in], y [T, out] (last dim contiguous), a [N, R, in], b [N, out, R] contiguous, token_indices [T] int32.
    """
    num_tokens, in_features = x.shape
    rank, out_features = a.shape[1], b.shape[1]
    if num_tokens == 0:
        return y
    x = x.contiguous()
    h = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(rank))
    block_k = max(16, min(128, 8192 // block_r))
    _shrink[(num_tokens,)](x, a, token_indices, h, in_features, rank, x.stride(0), a.stride(0), a.stride(1),
                           h.stride(0), BLOCK_R=block_r, BLOCK_K=block_k)
    block_n = max(16, min(128, 8192 // block_r))
    _expand[(num_tokens, triton.cdiv(out_features, block_n))](
        h, b, token_indices, y, out_features, rank, h.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_N=block_n, BLOCK_R=block_r)
    return y

"""Grouped expert GEMM for mixture-of-experts layers: one Triton launch multiplies every expert's tokens.

The (token, expert) pairs of a batch are sorted by expert and each expert's run is padded to a
multiple of BLOCK_M (`align_by_expert`), so that every BLOCK_M-row tile of the sorted list belongs to
one expert: a program loads that expert's weight tiles and the tile's token rows, and writes its
rows of the output in pair order. No GPU->CPU sync anywhere (sizes are upper bounds), so the layer
can run inside CUDA graphs.

`grouped_gemm_reference` is the same computation in plain torch; the tests hold one to the other.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


def tile_config(num_pairs: int, num_experts: int, n: int, k: int, dtype: torch.dtype) -> dict[str, int]:
    """The launch for one grouped GEMM, from host ints only (a CUDA graph's batch picks its own, once):
    BLOCK_M follows the expected rows per expert (16 at decode, where most tiles are one or two real rows and
    padding is wasted work; up to 64 in prefill, where it halves how often each expert's weights are read),
    BLOCK_K the reduction (wider for bf16/fp16 and long K), BLOCK_N the outputs, with 8 warps and 3 stages for
    the large tiles. float32 keeps narrow tiles (its tiles take twice the shared memory)."""
    per_expert = num_pairs / max(num_experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 96 else 64
    wide = dtype != torch.float32
    block_k = 64 if wide and k >= 64 else 32
    block_n = 128 if wide and n >= 128 and block_m >= 32 else 64
    big = block_m * block_n >= 64 * 128
    return {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": 8 if big else 4,
            "num_stages": 3 if wide else 2}


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """Sort the flattened (token, k) pairs by expert, padding each expert's run to `block_m`.

    Returns (sorted_pairs [P], block_experts [P // block_m]): the pair index of every padded row
    (`topk_ids.numel()` for padding) and the expert of every tile (-1 past the last used tile).
    P = pairs + num_experts * (block_m - 1) rounded up to block_m, a bound that needs no sync.
    """
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    # not bincount: on CUDA it reads the max id back to the host, which a CUDA graph cannot capture
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    first_of_expert = torch.cumsum(counts, 0) - counts  # rank of an expert's first pair in `order`
    sorted_experts = flat[order]
    rows = padded_end[sorted_experts] - padded[sorted_experts] + torch.arange(num_pairs, device=flat.device) \
        - first_of_expert[sorted_experts]
    capacity = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[rows] = order
    tile_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, tile_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_pairs, block_experts


@triton.jit(do_not_specialize=["num_pairs"])  # changes with every batch: no variant per value
def _grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, scale_ptr, sorted_ptr, experts_ptr,
                         num_pairs, N, K, rows_per_a,
                         stride_am, stride_we, stride_wn, stride_cm,
                         HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(experts_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    a_rows = pairs // rows_per_a  # rows_per_a = top_k when A holds one row per token, 1 per pair
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :],
                    mask=valid[:, None] & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + k[:, None],
                    mask=(offs_n[None, :] < N) & (k[:, None] < K), other=0.0)
        acc += tl.dot(a, w, input_precision="ieee")
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < N))


def grouped_gemm(a: torch.Tensor, weights: torch.Tensor, sorted_pairs: torch.Tensor, block_experts: torch.Tensor,
                 num_pairs: int, rows_per_a: int, scales: torch.Tensor | None = None,
                 block_n: int = 64, block_k: int = 32, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """out[p] = a[p // rows_per_a] @ weights[expert(p)].T (times scales[p]) for every pair p.

    a [rows, K], weights [E, N, K] -> out [num_pairs, N]. BLOCK_M is `align_by_expert`'s; the other
    launch parameters: `tile_config`'s for the engine, these defaults for the tests' small shapes.
    """
    a, weights = a.contiguous(), weights.contiguous()
    num_experts, n, k = weights.shape
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return out
    block_m = sorted_pairs.numel() // block_experts.numel()
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    scale_arg = scales.reshape(-1).contiguous() if scales is not None else out
    _grouped_gemm_kernel[grid](a, weights, out, scale_arg, sorted_pairs, block_experts,
                               num_pairs, n, k, rows_per_a,
                               a.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
                               HAS_SCALE=scales is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                               num_warps=num_warps, num_stages=num_stages)
    return out


def grouped_gemm_reference(a: torch.Tensor, weights: torch.Tensor, topk_ids: torch.Tensor, rows_per_a: int,
                           scales: torch.Tensor | None = None) -> torch.Tensor:
    """The same product pair by pair in plain torch (tests only: one small matmul per pair)."""
    flat = topk_ids.reshape(-1)
    rows = [a[p // rows_per_a] @ weights[int(flat[p])].T for p in range(flat.numel())]
    out = torch.stack(rows) if rows else a.new_zeros(0, weights.shape[1])
    return out if scales is None else out * scales.reshape(-1, 1).to(out.dtype)

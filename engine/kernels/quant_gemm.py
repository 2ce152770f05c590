"""W4A16 / W8A16 GEMM: int4 or int8 weights dequantized inside the matmul (Triton), and its torch reference.

One packed layout serves GPTQ, AWQ and compressed-tensors (engine.layers.quantization.wna16 converts to
it at load): `qweight` int32 [K // pack, N] with input feature k of column n at bits
(k % pack) * bits of qweight[k // pack, n], pack = 32 // bits; `scales` and `zeros` [G, N] in
fp16 (fp32 for an fp32 model); `g_idx` int32 [K], the group of each input feature. Weight (k, n) is
(q - zeros[g_idx[k], n]) * scales[g_idx[k], n]. With sorted groups (no act-order) the kernel reads one
scale row per K tile (`GROUP_SIZE` > 0); with act-order it gathers scales through g_idx (`GROUP_SIZE` = 0).
No host syncs: capturable in CUDA graphs.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton use the reference
    triton = None


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
               bits: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The [K, N] weight in `dtype` (default: the scales' dtype); math in fp32."""
    pack = 32 // bits
    shifts = torch.arange(0, 32, bits, device=qweight.device, dtype=torch.int32)
    q = (qweight.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)
    q = q.reshape(qweight.shape[0] * pack, qweight.shape[1])
    groups = g_idx.long()
    w = (q.float() - zeros.float()[groups]) * scales.float()[groups]
    return w.to(dtype or scales.dtype)


def gemm_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   g_idx: torch.Tensor, bits: int) -> torch.Tensor:
    """x [M, K] @ dequantize(...) [K, N], the plain-torch path (CPU, and the tests' reference)."""
    return x @ dequantize(qweight, scales, zeros, g_idx, bits, x.dtype)


if triton is not None:
    @triton.jit(do_not_specialize=["M"])  # the token count: no compiled variant per value
    def _wna16_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, y_ptr, M, N, K,
                      stride_xm, stride_qk, stride_sg, stride_ym,
                      BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, IEEE_DOT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        PACK: tl.constexpr = 32 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            packed = tl.load(q_ptr + (k // PACK)[:, None] * stride_qk + offs_n[None, :],
                             mask=k_ok[:, None] & n_ok[None, :], other=0)
            q = ((packed >> ((k % PACK) * BITS)[:, None]) & MASK).to(tl.float32)
            if GROUP_SIZE > 0:  # sorted groups and BLOCK_K divides GROUP_SIZE: one scale row per tile
                g = k0 // GROUP_SIZE
                s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                z = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            else:
                g = tl.load(g_ptr + k, mask=k_ok, other=0)
                s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=k_ok[:, None] & n_ok[None, :],
                            other=0.0).to(tl.float32)
                z = tl.load(z_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=k_ok[:, None] & n_ok[None, :],
                            other=0.0).to(tl.float32)
            w = ((q - z) * s).to(x.dtype)
            if IEEE_DOT:  # float32 activations: full-precision products, not TF32's 10-bit mantissas
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


    @triton.jit(do_not_specialize=["M"])
    def _wna16_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, part_ptr, M, N, K, k_per_split,
                           stride_xm, stride_qk, stride_sg,
                           BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, ROWS: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Decode (M <= ROWS <= 4): no tensor-core tile (16 rows, 15 of them padding at M = 1) but a
        multiply-and-sum over K per row, and split-K: program (n block, split) sums its K range into
        part[split, m, n] (float32), so the weight is streamed by N/BLOCK_N x splits programs at once."""
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        PACK: tl.constexpr = 32 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        k_start = split * k_per_split
        for m in tl.static_range(ROWS):
            if m < M:
                acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    k_ok = k < K
                    x = tl.load(x_ptr + m * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
                    packed = tl.load(q_ptr + (k // PACK)[:, None] * stride_qk + offs_n[None, :],
                                     mask=k_ok[:, None] & n_ok[None, :], other=0)
                    q = ((packed >> ((k % PACK) * BITS)[:, None]) & MASK).to(tl.float32)
                    if GROUP_SIZE > 0:  # BLOCK_K divides GROUP_SIZE and k_per_split: one scale row per tile
                        g = k0 // GROUP_SIZE
                        sc = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                        z = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                    else:
                        g = tl.load(g_ptr + k, mask=k_ok, other=0)
                        sc = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :],
                                     mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
                        z = tl.load(z_ptr + g[:, None] * stride_sg + offs_n[None, :],
                                    mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
                    # the weight rounded to the activation dtype, as the tiled kernel's dot operand is
                    w = ((q - z) * sc).to(x_ptr.dtype.element_ty).to(tl.float32)
                    acc += tl.sum(x[:, None] * w, axis=0)
                tl.store(part_ptr + (split * M + m) * N + offs_n, acc, mask=n_ok)


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def wna16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               g_idx: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """x [M, K] @ W [K, N] with W packed as described above. `group_size` > 0 promises sorted groups
    (g_idx[k] == k // group_size); 0 means act-order (gather scales through g_idx)."""
    if triton is None:
        raise RuntimeError("the W4A16/W8A16 Triton kernel needs the `triton` package")
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[1]
    block_k = group_size if group_size in (16, 32) else 64
    if group_size > 0 and group_size % block_k:
        group_size = 0  # a group size that is not a multiple of the tile: gather per row
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    block_n = 32 if m <= 16 else 64  # decode: more programs over N to fill the SMs (there is no split-K)
    grid = (triton.cdiv(m, _block_m(m)), triton.cdiv(n, block_n))
    _wna16_kernel[grid](x, qweight, scales, zeros, g_idx, y, m, n, k,
                        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
                        BITS=bits, GROUP_SIZE=group_size, IEEE_DOT=x.dtype == torch.float32, BLOCK_M=_block_m(m), BLOCK_N=block_n, BLOCK_K=block_k)
    return y


GEMV_MAX_ROWS = 4  # decode batches up to this many rows may take the split-K GEMV kernel


def wna16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               g_idx: torch.Tensor, bits: int, group_size: int, splits: int | None = None) -> torch.Tensor:
    """wna16_gemm for M <= GEMV_MAX_ROWS: the split-K GEMV kernel, then the splits summed (float32)."""
    if triton is None:
        raise RuntimeError("the W4A16/W8A16 Triton kernel needs the `triton` package")
    x = x.contiguous()
    m, k = x.shape
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"wna16_gemv takes at most {GEMV_MAX_ROWS} rows, got {m}")
    n = qweight.shape[1]
    block_k = group_size if group_size in (16, 32) else 64
    if group_size > 0 and group_size % block_k:
        group_size = 0
    block_n = 128
    if splits is None:  # ~4 programs per SM-sized slice of work: N/128 column blocks x splits >= 256
        splits = max(1, min(k // max(block_k, group_size if group_size > 0 else block_k), -(-256 // -(-n // block_n))))
    step = max(block_k, group_size if group_size > 0 else 0)
    k_per_split = -(-(-(-k // splits)) // step) * step  # whole groups (and tiles) per split
    splits = -(-k // k_per_split)
    parts = torch.empty(splits, m, n, device=x.device, dtype=torch.float32)
    _wna16_gemv_kernel[(triton.cdiv(n, block_n), splits)](
        x, qweight, scales, zeros, g_idx, parts, m, n, k, k_per_split, x.stride(0), qweight.stride(0),
        scales.stride(0), BITS=bits, GROUP_SIZE=group_size, ROWS=GEMV_MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k)
    return parts.sum(0).to(x.dtype)


def self_check(device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Both kernels against `gemm_reference` on small random layers (4- and 8-bit, sorted groups and
    act-order, 1 to 17 rows): {"gemm": "ok" or why not, "gemv": ...}. Run once at start-up on the device
    that will serve, so a kernel that miscompiles there is not used."""
    from engine.layers.quantization.wna16 import pack_rows  # imported late: wna16 imports this module

    generator = torch.Generator().manual_seed(0)
    report = {}
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for name, fn, rows in (("gemm", wna16_gemm, (1, 5, 17)), ("gemv", wna16_gemv, (1, 4))):
        report[name] = "ok"
        try:
            for bits, group, act_order in ((4, 32, False), (8, 64, False), (4, 32, True)):
                k, n = 128, 72
                packed = pack_rows(torch.randint(0, 2 ** bits, (k, n), generator=generator), bits)
                scales = (torch.rand(k // group, n, generator=generator) * 0.02 + 0.001).to(dtype)
                zeros = torch.randint(0, 2 ** bits, (k // group, n), generator=generator).to(dtype)
                g_idx = (torch.arange(k) // group).to(torch.int32)
                if act_order:
                    g_idx = g_idx[torch.randperm(k, generator=generator)]
                for m in rows:
                    x = torch.randn(m, k, generator=generator).to(dtype)
                    want = gemm_reference(x.float(), packed, scales.float(), zeros.float(), g_idx, bits)
                    args = [t.to(device) for t in (x, packed, scales, zeros, g_idx)]
                    got = fn(*args, bits, 0 if act_order else group).float().cpu()
                    error = (got - want).abs().max().item()
                    if not error <= tol * max(1.0, want.abs().max().item()):
                        report[name] = (f"differs from the reference by {error:.3g} ({bits}-bit, group {group}"
                                        f"{', act-order' if act_order else ''}, {m} rows)")
                        break
                if report[name] != "ok":
                    break
        except Exception as error:  # a kernel that does not compile here must not take the engine down
            report[name] = f"raised {type(error).__name__}: {error}"
    return report


_faster: dict[tuple, bool] = {}


def gemv_is_faster(x_dtype: torch.dtype, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   g_idx: torch.Tensor, bits: int, group_size: int) -> bool:
    """Whether the GEMV kernel beats the tiled one on this layer's shape at one row, timed on the device
    (CUDA events, best of 5 after a warm-up), once per (shape, bits, group, dtype). At load, not in a step."""
    key = (tuple(qweight.shape), bits, group_size, x_dtype, qweight.device)
    if key not in _faster:
        x = torch.randn(1, qweight.shape[0] * (32 // bits), device=qweight.device, dtype=x_dtype)
        times = {}
        for name, fn in (("gemm", wna16_gemm), ("gemv", wna16_gemv)):
            fn(x, qweight, scales, zeros, g_idx, bits, group_size)
            best = float("inf")
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(10):
                    fn(x, qweight, scales, zeros, g_idx, bits, group_size)
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end))
            times[name] = best
        _faster[key] = times["gemv"] < times["gemm"]
    return _faster[key]

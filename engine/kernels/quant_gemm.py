"""W4A16 / W8A16 GEMM: int4 or int8 weights dequantized inside the matmul (Triton), and its torch reference.

One packed layout serves GPTQ, AWQ and compressed-tensors (engine.layers.quantization.wna16 converts to
it at load): `qweight` int32 [K // pack, N] with input feature k of column n at bits
(k % pack) * bits of qweight[k // pack, n], pack = 32 // bits; `scales` and `zeros` [G, N] in
fp16 (fp32 for an fp32 model); `g_idx` int32 [K], the group of each input feature. Weight (k, n) is
(q - zeros[g_idx[k], n]) * scales[g_idx[k], n]. With sorted groups (no act-order) a K tile lies in one
group and the kernels read one scale row per tile (`GROUP_SIZE` > 0); with act-order they gather scales
through g_idx (`GROUP_SIZE` = 0), unless the layer's rows were sorted by group at load (`perm`: x is read
through the permutation, and one scale row per tile serves again).

Two kernels, both loading each packed word once (a [BLOCK_K / pack, BLOCK_N] tile) and unpacking it with
shifts; int -> float by the exponent trick (OR into 2^23's mantissa, subtract 2^23), not a conversion:
- `_wna16_kernel`, tiled on tensor cores: the unpacked [BLOCK_K, BLOCK_N] weight tile is dequantized once
  for BLOCK_M rows (16 at decode, up to 128 at batch 256);
- `_wna16_gemv_kernel`, decode (M <= GEMV_MAX_ROWS): no padded tensor-core tile but fp32 multiply-adds into
  a [rows, BLOCK_K / pack, BLOCK_N] accumulator reduced once at the end; with sorted groups the scale and zero
  are applied once per tile (s * (sum x q - z * sum x)), not per weight.
Both split K over `splits` programs when the layer has too few column blocks to fill the GPU: each writes
fp32 partials, which `_sum_splits_kernel` adds in a fixed order (deterministic) and casts.
Tiles, warps, stages and splits come from a `TileConfig` per (layer shape, row bucket): timed on the device
at load (`choose_configs`), else a heuristic (`default_config`). No host syncs: capturable in CUDA graphs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

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
    @triton.jit
    def _unpack(packed, SHIFT: tl.constexpr, MASK: tl.constexpr):
        """Values at bits SHIFT.. of int32 words, as exact float32 (2^23 + q read as a float, minus 2^23)."""
        bits = ((packed >> SHIFT) & MASK) | 0x4B000000
        return bits.to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit(do_not_specialize=["M"])  # the token count: no compiled variant per value
    def _wna16_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, p_ptr, y_ptr, M, N, K, k_per_split,
                      stride_xm, stride_qk, stride_sg, stride_ym,
                      BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, PERMUTED: tl.constexpr, IEEE_DOT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """y[split * M + m, n] = the sum over this split's K range; y is the output when there is one split,
        else fp32 partials [splits, M, N]. GROUP_SIZE > 0 promises BLOCK_K divides it. PERMUTED: weight row k
        multiplies input feature p[k] (act-order sorted at load)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        split = tl.program_id(2)
        PACK: tl.constexpr = 32 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_p = tl.arange(0, BLOCK_K // PACK)
        shifts = tl.arange(0, PACK) * BITS
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = split * k_per_split
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            if PERMUTED:
                kx = tl.load(p_ptr + k, mask=k_ok, other=0)
            else:
                kx = k
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kx[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            kp = k0 // PACK + offs_p
            packed = tl.load(q_ptr + kp[:, None] * stride_qk + offs_n[None, :],
                             mask=(kp < K // PACK)[:, None] & n_ok[None, :], other=0)
            bits = ((packed[:, None, :] >> shifts[None, :, None]) & MASK) | 0x4B000000  # [K/PACK, PACK, N]
            q = tl.reshape(bits, (BLOCK_K, BLOCK_N)).to(tl.float32, bitcast=True) - 8388608.0  # row k = kp*PACK+j
            if GROUP_SIZE > 0:  # one scale row per tile
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
        tl.store(y_ptr + (split * M + offs_m[:, None]) * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit(do_not_specialize=["M"])
    def _wna16_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, p_ptr, y_ptr, M, N, K, k_per_split, stride_xm,
                           stride_qk, stride_sg, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                           PERMUTED: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Decode (M <= ROWS <= 4): y[split * M + m, n] (y contiguous [.., N]) as in `_wna16_kernel`, with
        fp32 multiply-adds instead of a 16-row tensor-core tile. Word row p, nibble j of a tile is feature
        (k0 / PACK + p) * PACK + j: x is read at those strided features, one nibble plane at a time."""
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        PACK: tl.constexpr = 32 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        BLOCK_P: tl.constexpr = BLOCK_K // PACK
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, ROWS)
        offs_p = tl.arange(0, BLOCK_P)
        n_ok = offs_n < N
        r_ok = offs_r < M
        acc = tl.zeros((ROWS, BLOCK_P, BLOCK_N), dtype=tl.float32)
        k_start = split * k_per_split
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            kp = k0 // PACK + offs_p
            kp_ok = kp < K // PACK
            packed = tl.load(q_ptr + kp[:, None] * stride_qk + offs_n[None, :], mask=kp_ok[:, None] & n_ok[None, :],
                             other=0)
            x_mask = r_ok[:, None] & kp_ok[None, :]
            if GROUP_SIZE > 0:  # one group per tile: scale and zero once per tile, s * (sum x q - z sum x)
                g = k0 // GROUP_SIZE
                s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
                xq = tl.zeros((ROWS, BLOCK_P, BLOCK_N), dtype=tl.float32)
                xs = tl.zeros((ROWS, BLOCK_P), dtype=tl.float32)
                for j in tl.static_range(PACK):
                    q = _unpack(packed, j * BITS, MASK)
                    if PERMUTED:
                        kx = tl.load(p_ptr + kp * PACK + j, mask=kp_ok, other=0)
                    else:
                        kx = kp * PACK + j
                    x = tl.load(x_ptr + offs_r[:, None] * stride_xm + kx[None, :], mask=x_mask,
                                other=0.0).to(tl.float32)
                    xq += x[:, :, None] * q[None, :, :]
                    xs += x
                acc += (xq - xs[:, :, None] * z[None, None, :]) * s[None, None, :]
            else:
                for j in tl.static_range(PACK):
                    k = kp * PACK + j
                    g = tl.load(g_ptr + k, mask=kp_ok, other=0)
                    wmask = kp_ok[:, None] & n_ok[None, :]
                    s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=wmask, other=0.0)
                    z = tl.load(z_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=wmask, other=0.0)
                    w = (_unpack(packed, j * BITS, MASK) - z.to(tl.float32)) * s.to(tl.float32)
                    if PERMUTED:
                        kx = tl.load(p_ptr + k, mask=kp_ok, other=0)
                    else:
                        kx = k
                    x = tl.load(x_ptr + offs_r[:, None] * stride_xm + kx[None, :], mask=x_mask,
                                other=0.0).to(tl.float32)
                    acc += x[:, :, None] * w[None, :, :]
        y = tl.sum(acc, axis=1)
        tl.store(y_ptr + (split * M + offs_r[:, None]) * N + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & n_ok[None, :])

    @triton.jit(do_not_specialize=["numel"])
    def _sum_splits_kernel(part_ptr, y_ptr, numel, splits, BLOCK: tl.constexpr):
        """y[i] = sum over s of part[s * numel + i], in split order, cast to y's dtype."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < numel
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(0, splits):
            acc += tl.load(part_ptr + s * numel + offs, mask=ok, other=0.0)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


GEMV_MAX_ROWS = 4  # decode batches up to this many rows may take the GEMV kernel


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One launch of either kernel: block_m 0 = the GEMV kernel. `splits` K ranges (1: no partials)."""
    block_m: int
    block_n: int
    block_k: int
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def label(self) -> str:
        kind = "gemv" if self.block_m == 0 else f"m{self.block_m}"
        return f"{kind}-n{self.block_n}-k{self.block_k}-s{self.splits}-w{self.num_warps}-st{self.num_stages}"


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    if device not in _sms:
        _sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sms[device]


_sms: dict[torch.device, int] = {}


def _bucket(m: int) -> int:
    """The row count a config is chosen for: 1 (GEMV sizes), 16 (small batches), 256 (the rest)."""
    return 1 if m <= GEMV_MAX_ROWS else 16 if m <= 32 else 256


def _splits_for(n_blocks: int, k: int, block_k: int, device: torch.device) -> int:
    """Enough K splits for ~2 programs per SM, each split at least 4 tiles long."""
    want = -(-2 * _sm_count(device) // n_blocks)
    return max(1, min(want, k // (4 * block_k), 16))


def _group_block_k(block_k: int, bits: int, group_size: int) -> int:
    """block_k, or a smaller power of two dividing the group size (one scale row per tile) if one of at
    least 4 words exists; else block_k, and the kernel gathers scales through g_idx."""
    if group_size <= 0 or group_size % block_k == 0:
        return block_k
    fit = group_size & -group_size  # the largest power of two dividing it
    return fit if 4 * (32 // bits) <= fit < block_k else block_k


def default_config(m: int, n: int, k: int, bits: int, group_size: int, device: torch.device,
                   gemv: bool = False) -> TileConfig:
    """The heuristic launch (before or without timing at load): the tiled kernel unless `gemv`. Shallow K
    tiles (4 words for the GEMV) keep registers low: about 90 per thread, against 180 for 16-word tiles
    (ptxas for sm_90)."""
    pack = 32 // bits
    if gemv:
        block_k = _group_block_k(4 * pack, bits, group_size)
        return TileConfig(0, 512, block_k, _splits_for(-(-n // 512), k, block_k, device))
    if m <= 32:
        block_k = _group_block_k(64, bits, group_size)
        return TileConfig(16, 64, block_k, _splits_for(-(-n // 64), k, block_k, device), num_stages=4)
    return TileConfig(64, 128, _group_block_k(64, bits, group_size), num_warps=8)


def _launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            g_idx: torch.Tensor, bits: int, group_size: int, config: TileConfig,
            perm: torch.Tensor | None = None) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("the W4A16/W8A16 Triton kernel needs the `triton` package")
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[1]
    config = _fit_block_k(config, bits, k)
    block_k = config.block_k
    if group_size > 0 and group_size % block_k:
        group_size = 0  # a tile straddles groups: gather scales per row through g_idx
    k_per_split = -(-(-(-k // config.splits)) // block_k) * block_k  # whole tiles per split
    splits = -(-k // k_per_split)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    out = y if splits == 1 else torch.empty(splits * m, n, device=x.device, dtype=torch.float32)
    common = (x, qweight, scales, zeros, g_idx, g_idx if perm is None else perm, out, m, n, k, k_per_split,
              x.stride(0), qweight.stride(0), scales.stride(0))
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if config.block_m == 0:  # the accumulator holds rows x BLOCK_K / pack x BLOCK_N: narrower with more rows
        rows = 1 if m == 1 else 2 if m == 2 else 4
        block_n = max(32, config.block_n // rows)
        _wna16_gemv_kernel[(triton.cdiv(n, block_n), splits)](
            *common, BITS=bits, GROUP_SIZE=group_size, PERMUTED=perm is not None, ROWS=rows, BLOCK_N=block_n,
            BLOCK_K=block_k, **options)
    else:
        grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), splits)
        _wna16_kernel[grid](*common, out.stride(0), BITS=bits, GROUP_SIZE=group_size, PERMUTED=perm is not None,
                            IEEE_DOT=x.dtype == torch.float32, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                            BLOCK_K=block_k, **options)
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](out, y, m * n, splits, BLOCK=block)
    return y


def _fit_block_k(config: TileConfig, bits: int, k: int) -> TileConfig:
    """A K tile no longer than K (rounded to a power of two, at least 2 words and tl.dot's 16 deep)."""
    block_k = config.block_k
    while block_k > max(16, 2 * (32 // bits)) and block_k >= 2 * k:
        block_k //= 2
    return config if block_k == config.block_k else replace(config, block_k=block_k)


def wna16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               g_idx: torch.Tensor, bits: int, group_size: int, config: TileConfig | None = None,
               perm: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W [K, N] with W packed as described above. `group_size` > 0 promises sorted groups
    (g_idx[k] == k // group_size); 0 means act-order (gather scales through g_idx). `perm` (int32 [K]): weight
    row k multiplies x[:, perm[k]] (an act-order layer sorted by group at load, wna16.sort_act_order). The
    launch is `config`, else the one chosen for this shape at load (`choose_configs`; may be the GEMV), else
    `default_config`."""
    m, k = x.shape
    n = qweight.shape[1]
    if config is None:
        config = _chosen.get((n, k, bits, group_size, perm is not None, x.dtype, x.device, _bucket(m)))
        if config is None or (config.block_m == 0 and m > GEMV_MAX_ROWS):
            config = default_config(m, n, k, bits, group_size, x.device)
    return _launch(x, qweight, scales, zeros, g_idx, bits, group_size, config, perm)


def wna16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               g_idx: torch.Tensor, bits: int, group_size: int, splits: int | None = None,
               perm: torch.Tensor | None = None) -> torch.Tensor:
    """wna16_gemm for M <= GEMV_MAX_ROWS on the GEMV kernel (its default tiles; `splits` K ranges if given)."""
    m, k = x.shape
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"wna16_gemv takes at most {GEMV_MAX_ROWS} rows, got {m}")
    config = default_config(m, qweight.shape[1], k, bits, group_size, x.device, gemv=True)
    if splits is not None:
        config = replace(config, splits=splits)
    return _launch(x, qweight, scales, zeros, g_idx, bits, group_size, config, perm)


def self_check(device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Both kernels against `gemm_reference` on small random layers (4- and 8-bit, sorted groups, act-order
    gathered and sorted at load, 1 to 17 rows, with and without split K, every tile family `choose_configs` may
    pick): {"gemm": "ok" or why not, "gemv": ...}. Run once at start-up on the device that will serve, so a
    kernel that miscompiles there is not used."""
    from engine.layers.quantization.wna16 import pack_rows, sort_act_order  # late: wna16 imports this module

    def gemm(x, *args, perm=None):
        yield wna16_gemm(x, *args, perm=perm)
        if x.shape[0] > 16:
            for config in (TileConfig(16, 64, 64, splits=2), TileConfig(64, 128, 64, num_warps=8),
                           TileConfig(32, 32, 32)):
                yield wna16_gemm(x, *args, config=config, perm=perm)

    def gemv(x, *args, perm=None):
        yield wna16_gemv(x, *args, perm=perm)
        yield wna16_gemv(x, *args, splits=2, perm=perm)

    generator = torch.Generator().manual_seed(0)
    report = {}
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for name, fn, rows in (("gemm", gemm, (1, 5, 17)), ("gemv", gemv, (1, 3))):
        report[name] = "ok"
        try:
            for bits, group, act_order in ((4, 32, False), (8, 64, False), (4, 128, False), (4, 32, True)):
                k, n = 128, 72
                packed = pack_rows(torch.randint(0, 2 ** bits, (k, n), generator=generator), bits)
                scales = (torch.rand(k // group, n, generator=generator) * 0.02 + 0.001).to(dtype)
                zeros = torch.randint(0, 2 ** bits, (k // group, n), generator=generator).to(dtype)
                g_idx = (torch.arange(k) // group).to(torch.int32)
                forms = [(packed, g_idx, group, None)]
                if act_order:
                    g_idx = g_idx[torch.randperm(k, generator=generator)]
                    sorted_q, sorted_g, perm = sort_act_order(packed, g_idx, bits, group)
                    forms = [(packed, g_idx, 0, None), (sorted_q, sorted_g, group, perm)]
                for m in rows:
                    x = torch.randn(m, k, generator=generator).to(dtype)
                    want = gemm_reference(x.float(), packed, scales.float(), zeros.float(), g_idx, bits)
                    for weights, groups, kernel_group, perm in forms:
                        args = [t.to(device) for t in (x, weights, scales, zeros, groups)]
                        for got in fn(*args, bits, kernel_group, perm=None if perm is None else perm.to(device)):
                            error = (got.float().cpu() - want).abs().max().item()
                            if not error <= tol * max(1.0, want.abs().max().item()):
                                report[name] = (f"differs from the reference by {error:.3g} ({bits}-bit, group "
                                                f"{group}{', act-order' if act_order else ''}"
                                                f"{', sorted' if perm is not None else ''}, {m} rows)")
                                break
                        if report[name] != "ok":
                            break
                    if report[name] != "ok":
                        break
                if report[name] != "ok":
                    break
        except Exception as error:  # a kernel that does not compile here must not take the engine down
            report[name] = f"raised {type(error).__name__}: {error}"
    return report


def candidates(bucket: int, n: int, k: int, bits: int, group_size: int, gemv: bool) -> list[TileConfig]:
    """What `choose_configs` times for one row bucket: a few tiles (each a compile, so few; the defaults among
    them) x K splits (a runtime argument: free to vary)."""
    shallow = 4 * (32 // bits)
    if bucket == 1:
        tiles = [TileConfig(16, 64, 64, num_stages=4)]
        if gemv:
            tiles = [TileConfig(0, 256, shallow), TileConfig(0, 512, shallow),
                     TileConfig(0, 1024, shallow, num_warps=8)] + tiles
    elif bucket == 16:
        tiles = [TileConfig(16, 64, 64, num_stages=4), TileConfig(16, 128, 64, num_stages=4)]
    else:
        tiles = [TileConfig(64, 128, 64, num_warps=8), TileConfig(128, 128, 32, num_warps=8, num_stages=4)]
    out = []
    for tile in tiles:
        tile = replace(tile, block_k=_group_block_k(tile.block_k, bits, group_size))
        counts = set()
        for splits in (1, 2, 4, 8, 16) if bucket <= 16 else (1, 2, 4):
            per = -(-(-(-k // splits)) // tile.block_k) * tile.block_k
            if splits > 1 and per < 4 * tile.block_k or -(-k // per) in counts:
                continue
            counts.add(-(-k // per))
            out.append(replace(tile, splits=splits))
    return out


_chosen: dict[tuple, TileConfig] = {}


def choose_configs(x_dtype: torch.dtype, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   g_idx: torch.Tensor, bits: int, group_size: int, gemv: bool = True,
                   buckets: tuple[int, ...] = (1, 16, 256), perm: torch.Tensor | None = None
                   ) -> dict[int, TileConfig]:
    """Times every candidate launch of this layer's shape at each row bucket on the device (`_time`, after a
    first call that compiles it), keeps the fastest whose result matches the torch reference (on the first
    128 columns), and makes wna16_gemm use it for that (shape, bits, group, perm or not, dtype, bucket). A
    candidate that fails to compile or differs is skipped; if none is left, the heuristic `default_config`.
    Once per key; at load, never in a step. `gemv`: whether the GEMV passed its self-check. `perm`: as in
    wna16_gemm."""
    n, k = qweight.shape[1], qweight.shape[0] * (32 // bits)
    cols = min(n, 128)
    weight = dequantize(qweight[:, :cols], scales[:, :cols], zeros[:, :cols], g_idx, bits, torch.float32)
    if perm is not None:  # row k of the weight is feature perm[k]
        weight = torch.empty_like(weight).index_copy_(0, perm.long(), weight)
    chosen = {}
    for bucket in buckets:
        key = (n, k, bits, group_size, perm is not None, x_dtype, qweight.device, bucket)
        if key not in _chosen:
            x = torch.randn(bucket, k, device=qweight.device, dtype=x_dtype)
            args = (x, qweight, scales, zeros, g_idx, bits, group_size)
            want = x.float() @ weight
            bound = 2e-2 * want.abs().max().item() + 1e-6
            best, best_ms = None, float("inf")
            for config in candidates(bucket, n, k, bits, group_size, gemv):
                try:
                    if not (_launch(*args, config, perm)[:, :cols].float() - want).abs().max().item() <= bound:
                        continue
                    ms = _time(lambda: _launch(*args, config, perm))
                except Exception:  # noqa: BLE001 - a tile that does not compile here is not a candidate
                    continue
                if ms < best_ms:
                    best, best_ms = config, ms
            _chosen[key] = best or default_config(bucket, n, k, bits, group_size, qweight.device)
        chosen[bucket] = _chosen[key]
    return chosen


def _time(fn) -> float:
    """Device milliseconds of one call (median): triton's do_bench, which clears the L2 cache before each call
    (as the other layers' weights do between two uses of this one in a step) and so also hides the host's
    launch time, which CUDA graphs remove in the engine."""
    from triton.testing import do_bench

    # one quantile comes back as a bare float (Triton 3.6 on the H200 did: indexing it raised, every
    # candidate was skipped and the untimed fallback ran, slower than the heuristic launch)
    result = do_bench(fn, warmup=2, rep=8, quantiles=[0.5])
    return float(result[0] if isinstance(result, (list, tuple)) else result)

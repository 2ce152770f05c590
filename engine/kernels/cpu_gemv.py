"""Float32 linear layers for a few rows on CPU (decode steps): y[M, N] = x[M, K] W^T (+ b) for M <= 16 in one
pass over the weight, more rows in passes of 16. The weight may be stored in bfloat16 when its values are bfloat16s
(`storage_dtype`: a bfloat16 checkpoint served in float32, or a bfloat16 model): half the bytes to stream, the same
products, its k steps packed in pairs so that widening 32 weights takes two vector ops (`pack`).

Why: at a decode step the weight is streamed from memory once for every row of the batch. oneDNN's packed
GEMM (engine/layers/cpu_gemm.py) does that near the memory floor, but each call goes through ideep's set-up
(~20 us a call, 121 calls a SmolLM2 step), and at one row it reads ~15% slower than the plain loop here. The
weight is packed once into panels of 16 output features, [ceil(N / 16)][K][16], zero-padded; a panel is read
front to back, and each of its 64-byte rows is multiplied into all M rows at once (one fused broadcast-FMA per
row, the accumulators in registers). Panels are spread over OpenMP threads.

No torch headers: plain C++ built by engine/kernels/cpp_build.py. The fused decode step
(engine/cpu_decode_step.py) calls `tgi_gemv` by address; `linear` is the Python entry for tests and the
self-check. Reference: `F.linear`.
"""
from __future__ import annotations

import ctypes
import logging

import torch
import torch.nn.functional as F

from engine.kernels.cpp_build import Library
from engine.kernels.cpu_simd import BFLOAT16, VECTORS

logger = logging.getLogger(__name__)

PANEL = 16  # output features per panel: one 64-byte vector of float32

SOURCE = r"""
#include <omp.h>
#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

""" + VECTORS + BFLOAT16 + r"""
// weight lines asked for this many k steps (64-byte lines of a panel) ahead: the hardware prefetchers alone keep
// too few in flight once each line feeds several rows' FMAs (SmolLM2's linears at 8 rows, 2 threads: 10.5 -> 8.8 ms)
constexpr int64_t AHEAD = 32;
// the same distance in bytes for weights of type W (k steps of 16 weights); bfloat16 panels take two k steps a line
template <typename W> constexpr int64_t ahead() { return AHEAD * 4 / static_cast<int64_t>(sizeof(W)); }

// A panel row (16 output features) is PER16 native vectors (cpu_simd.py's fnv): one with AVX-512, two with AVX2.
// The tiles follow the register file: AVX-512 has 32 registers of 16 floats, AVX2 16 of 8, so AVX2 tiles take fewer
// rows at once (NARROW_ROWS). Lanes are summed in the same order either way: within one build the float32 and the
// bfloat16 panels give the same bits.
constexpr bool WIDE = NV == 16;
constexpr int NARROW_ROWS = 6;  // rows of one AVX2 pass: 12 ymm accumulators, beside the weights and a broadcast

// a panel's accumulator sets summed in order (set 0 first), the bias added, into y
template <int M, int KU>
inline void store_panel(fnv (&acc)[KU][M][PER16], const float* bias, float* y, int64_t y_stride, int64_t cols) {
  float b[16] = {};
  if (bias != nullptr)
    for (int64_t c = 0; c < cols; ++c) b[c] = bias[c];
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < PER16; ++h) {
      fnv s = acc[0][m][h];
      for (int u = 1; u < KU; ++u) s += acc[u][m][h];
      s += loadnv(b + h * NV);
      if (cols == 16) *reinterpret_cast<fnv*>(y + m * y_stride + h * NV) = s;
      else for (int64_t c = 0; c < NV && h * NV + c < cols; ++c) y[m * y_stride + h * NV + c] = s[c];
    }
}

// bfloat16 panels hold their k steps in pairs: line j (64 bytes) has columns 0..15 of steps 2j and 2j + 1 interleaved
// (c0 k0, c0 k1, c1 k0, ...), so each 32-bit lane is one column's two weights, whose float32s are the lane shifted up
// and the lane masked (exact: a bfloat16's bits are its float's upper half): two vector ops widen a vector of pairs,
// where one line per step took a zero-extending shuffle and a shift. An odd K's last line has zeros for step K.
inline void wpair(const uint16_t* line, fnv (&lo)[PER16], fnv (&hi)[PER16]) {
  for (int h = 0; h < PER16; ++h) {
    const unv v = *reinterpret_cast<const unv*>(line + h * 2 * NV);
    lo[h] = __builtin_bit_cast(fnv, v << 16);
    hi[h] = __builtin_bit_cast(fnv, v & 0xffff0000u);
  }
}
// the weights one panel takes: K lines of float32, or K rounded up to even half-lines of bfloat16 pairs
inline int64_t panel_size(const float*, int64_t K) { return K * 16; }
inline int64_t panel_size(const uint16_t*, int64_t K) { return (K + 1) / 2 * 32; }

// acc[m][h] += xm * w[h] for the M rows of one k step (xk: the step's 16 row values, rows from 0)
template <int M>
inline void fma_rows(fnv (&acc)[M][PER16], const float* xk, const fnv (&w)[PER16]) {
  for (int m = 0; m < M; ++m) {
    const float xm = xk[m];
    for (int h = 0; h < PER16; ++h) acc[m][h] += xm * w[h];
  }
}

// one panel (16 output features) for M rows; KU interleaved accumulator sets hide the FMA latency when
// M is small (few independent chains): k step k goes to set k % KU, the last K % KU steps to set 0
template <int M, int KU>
inline void panel(const float* xt, const float* w, int64_t K, const float* bias, float* y, int64_t y_stride,
                  int64_t cols) {
  fnv acc[KU][M][PER16] = {};
  int64_t k = 0;
  for (; k + KU <= K; k += KU)
    for (int u = 0; u < KU; ++u) {
      fnv wv[PER16];
      for (int h = 0; h < PER16; ++h) wv[h] = loadnv(w + (k + u) * 16 + h * NV);
      __builtin_prefetch(w + (k + u + ahead<float>()) * 16, 0, 0);
      fma_rows<M>(acc[u], xt + (k + u) * 16, wv);
    }
  for (; k < K; ++k) {
    fnv wv[PER16];
    for (int h = 0; h < PER16; ++h) wv[h] = loadnv(w + k * 16 + h * NV);
    fma_rows<M>(acc[0], xt + k * 16, wv);
  }
  store_panel<M, KU>(acc, bias, y, y_stride, cols);
}

// the same over bfloat16 pairs: every accumulator gets the float32 panel's products in its order, so the sums are
// the float32 kernel's bit for bit
template <int M, int KU>
inline void panel(const float* xt, const uint16_t* w, int64_t K, const float* bias, float* y, int64_t y_stride,
                  int64_t cols) {
  static_assert(KU == 1 || KU == 2 || KU == 4, "k steps come in pairs");
  fnv acc[KU][M][PER16] = {};
  const int64_t body = K - K % KU;       // steps k < body go to set k % KU
  int64_t k = 0;
  for (; k + (KU == 4 ? 4 : 2) <= body; k += (KU == 4 ? 4 : 2)) {
    fnv lo[PER16], hi[PER16];
    wpair(w + k * 16, lo, hi);
    __builtin_prefetch(w + (k + ahead<uint16_t>()) * 16, 0, 0);
    const float* xk = xt + k * 16;
    fma_rows<M>(acc[0], xk, lo);
    fma_rows<M>(acc[KU == 1 ? 0 : 1], xk + 16, hi);
    if constexpr (KU == 4) {
      wpair(w + (k + 2) * 16, lo, hi);
      fma_rows<M>(acc[2], xk + 32, lo);
      fma_rows<M>(acc[3], xk + 48, hi);
    }
  }
  for (; k < K; k += 2) {                // the rest, into set 0 in order
    fnv lo[PER16], hi[PER16];
    wpair(w + k * 16, lo, hi);
    fma_rows<M>(acc[0], xt + k * 16, lo);
    if (k + 1 < K) fma_rows<M>(acc[0], xt + (k + 1) * 16, hi);
  }
  store_panel<M, KU>(acc, bias, y, y_stride, cols);
}

// three whole panels (48 output features) for MR <= 8 rows from r0 (AVX-512 only): 24 accumulators, and each
// broadcast of a row value feeds three FMAs (on the Zen 4 VM at 9-16 rows this ran 120 SmolLM2 linears in 22.4 ms
// against 25.1 one panel at a time; on a Zen 5 VM at 8 rows, 13.0 ms against 16.2)
template <int MR>
inline void triple(const float* xt, const float* w, int64_t K, const float* bias, float* y, int64_t y_stride, int r0) {
  fnv acc[3][MR][PER16];
  for (int p = 0; p < 3; ++p)
    for (int m = 0; m < MR; ++m)
      for (int h = 0; h < PER16; ++h) acc[p][m][h] = bias == nullptr ? fnv{} : loadnv(bias + 16 * p + h * NV);
  for (int64_t k = 0; k < K; ++k) {
    fnv wv[3][PER16];
    for (int p = 0; p < 3; ++p)
      for (int h = 0; h < PER16; ++h) wv[p][h] = loadnv(w + p * K * 16 + k * 16 + h * NV);
    for (int p = 0; p < 3; ++p) __builtin_prefetch(w + p * K * 16 + (k + ahead<float>()) * 16, 0, 0);
    for (int p = 0; p < 3; ++p) fma_rows<MR>(acc[p], xt + k * 16 + r0, wv[p]);
  }
  for (int p = 0; p < 3; ++p)
    for (int m = 0; m < MR; ++m)
      for (int h = 0; h < PER16; ++h) *reinterpret_cast<fnv*>(y + (r0 + m) * y_stride + 16 * p + h * NV) = acc[p][m][h];
}

// the same over bfloat16 pairs (each accumulator's products in the float32 order)
template <int MR>
inline void triple(const float* xt, const uint16_t* w, int64_t K, const float* bias, float* y, int64_t y_stride,
                   int r0) {
  const int64_t size = panel_size(w, K);
  fnv acc[3][MR][PER16];
  for (int p = 0; p < 3; ++p)
    for (int m = 0; m < MR; ++m)
      for (int h = 0; h < PER16; ++h) acc[p][m][h] = bias == nullptr ? fnv{} : loadnv(bias + 16 * p + h * NV);
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    fnv lo[3][PER16], hi[3][PER16];
    for (int p = 0; p < 3; ++p) wpair(w + p * size + k * 16, lo[p], hi[p]);
    for (int p = 0; p < 3; ++p) __builtin_prefetch(w + p * size + (k + ahead<uint16_t>()) * 16, 0, 0);
    for (int p = 0; p < 3; ++p) fma_rows<MR>(acc[p], xt + k * 16 + r0, lo[p]);
    for (int p = 0; p < 3; ++p) fma_rows<MR>(acc[p], xt + (k + 1) * 16 + r0, hi[p]);
  }
  if (k < K) {      // an odd K's last step (its pair's second half is padding)
    fnv lo[3][PER16], hi[3][PER16];
    for (int p = 0; p < 3; ++p) wpair(w + p * size + k * 16, lo[p], hi[p]);
    for (int p = 0; p < 3; ++p) fma_rows<MR>(acc[p], xt + k * 16 + r0, lo[p]);
  }
  for (int p = 0; p < 3; ++p)
    for (int m = 0; m < MR; ++m)
      for (int h = 0; h < PER16; ++h) *reinterpret_cast<fnv*>(y + (r0 + m) * y_stride + 16 * p + h * NV) = acc[p][m][h];
}

// one panel for M rows in passes of at most NARROW_ROWS (AVX2), each a pass over the panel (again from cache)
template <int M, typename W>
inline void narrow_panel(const float* xt, const W* w, int64_t K, const float* bias, float* y, int64_t y_stride,
                         int64_t cols) {
  if constexpr (M <= NARROW_ROWS) {
    panel<M, (M == 1 ? 4 : (M == 2 ? 2 : 1))>(xt, w, K, bias, y, y_stride, cols);
  } else {
    panel<NARROW_ROWS, 1>(xt, w, K, bias, y, y_stride, cols);
    narrow_panel<M - NARROW_ROWS>(xt + NARROW_ROWS, w, K, bias, y + NARROW_ROWS * y_stride, y_stride, cols);
  }
}

template <int M, typename W>
void panels(const float* xt, const W* w, const float* bias, int64_t N, int64_t K, float* y, int64_t y_stride,
            int threads) {
  const int64_t count = (N + 15) / 16;
  const int64_t size = panel_size(w, K);
  if constexpr (!WIDE) {
#pragma omp parallel for num_threads(threads) schedule(static) if (count > 1)
    for (int64_t p = 0; p < count; ++p)
      narrow_panel<M>(xt, w + p * size, K, bias == nullptr ? nullptr : bias + p * 16, y + p * 16, y_stride,
                      std::min<int64_t>(16, N - p * 16));
  } else {
    // 3-16 rows: whole panels three at a time, rows in groups of 8 (the second group reads the triple from cache;
    // one pass of 16 rows over one panel, or over K in chunks of both groups, measured slower)
    const int64_t triples = M > 2 ? N / 48 : 0;
    const int64_t tasks = triples + count - 3 * triples;
#pragma omp parallel for num_threads(threads) schedule(static) if (tasks > 1)
    for (int64_t t = 0; t < tasks; ++t) {
      if (t < triples) {
        const float* bt = bias == nullptr ? nullptr : bias + t * 48;
        triple<(M < 8 ? (M > 2 ? M : 3) : 8)>(xt, w + t * 3 * size, K, bt, y + t * 48, y_stride, 0);
        if (M > 8) triple<(M > 8 ? M - 8 : 1)>(xt, w + t * 3 * size, K, bt, y + t * 48, y_stride, 8);
        continue;
      }
      const int64_t p = 3 * triples + (t - triples);
      const int64_t cols = std::min<int64_t>(16, N - p * 16);
      const W* wp = w + p * size;
      const float* bp = bias == nullptr ? nullptr : bias + p * 16;
      if (M <= 2) panel<M, 4>(xt, wp, K, bp, y + p * 16, y_stride, cols);
      else if (M <= 6) panel<M, 2>(xt, wp, K, bp, y + p * 16, y_stride, cols);
      else panel<M, 1>(xt, wp, K, bp, y + p * 16, y_stride, cols);
    }
  }
}

template <typename W>
void gemv(const float* x, int64_t x_stride, int64_t M, const W* w, const float* bias, int64_t N, int64_t K, float* y,
          int64_t y_stride, int threads) {
  thread_local std::vector<float> xt;
  if (static_cast<int64_t>(xt.size()) < K * 16) xt.resize(K * 16);
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t rows = std::min<int64_t>(16, M - m0);
    for (int64_t k = 0; k < K; ++k)  // x transposed: each k's 16 row values in one 64-byte line
      for (int64_t m = 0; m < 16; ++m) xt[k * 16 + m] = m < rows ? x[(m0 + m) * x_stride + k] : 0.0f;
    float* yr = y + m0 * y_stride;
    switch (rows) {
#define TGI_ROWS(n) case n: panels<n>(xt.data(), w, bias, N, K, yr, y_stride, threads); break;
      TGI_ROWS(1) TGI_ROWS(2) TGI_ROWS(3) TGI_ROWS(4) TGI_ROWS(5) TGI_ROWS(6) TGI_ROWS(7) TGI_ROWS(8)
      TGI_ROWS(9) TGI_ROWS(10) TGI_ROWS(11) TGI_ROWS(12) TGI_ROWS(13) TGI_ROWS(14) TGI_ROWS(15) TGI_ROWS(16)
#undef TGI_ROWS
    }
  }
}

}  // namespace

// y [M, N] (row stride y_stride) = x [M, K] (row stride x_stride) W^T + bias, W packed [ceil(N/16)][K][16];
// bias may be null. Rows go in passes of 16.
extern "C" void tgi_gemv(const float* x, int64_t x_stride, int64_t M, const float* w, const float* bias, int64_t N,
                         int64_t K, float* y, int64_t y_stride, int threads) {
  gemv(x, x_stride, M, w, bias, N, K, y, y_stride, threads);
}

// the same with W stored in bfloat16 (the same packing, 2 bytes a weight); same signature as tgi_gemv, so the fused
// decode step calls either by address: `w` points at the bfloat16 panels
extern "C" void tgi_gemv_bf16(const float* x, int64_t x_stride, int64_t M, const float* w, const float* bias,
                              int64_t N, int64_t K, float* y, int64_t y_stride, int threads) {
  gemv(x, x_stride, M, reinterpret_cast<const uint16_t*>(w), bias, N, K, y, y_stride, threads);
}
"""

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_LIBRARY = Library("cpu_gemv", SOURCE, {
    "tgi_gemv": (None, [_P, _I64, _I64, _P, _P, _I64, _I64, _P, _I64, ctypes.c_int]),
    "tgi_gemv_bf16": (None, [_P, _I64, _I64, _P, _P, _I64, _I64, _P, _I64, ctypes.c_int]),
}, logger)


def load() -> ctypes.CDLL:
    """The compiled kernel: built once per CPU type and compiler into the cache, loaded once per process."""
    return _LIBRARY.load()


def storage_dtype(weight: torch.Tensor) -> torch.dtype:
    """bfloat16 for a bfloat16 `weight`, or a float32 one whose every value is a bfloat16 (a bfloat16 checkpoint served
    in float32: the copy takes half the bytes and gives the same products bit for bit); else float32."""
    if weight.dtype == torch.bfloat16:
        return torch.bfloat16
    return torch.bfloat16 if torch.equal(weight.to(torch.bfloat16).float(), weight) else torch.float32


def pack(weight: torch.Tensor, empty=torch.empty, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [N, K] (float32 or bfloat16) -> panels of 16 output features, the last one zero-padded, in memory from
    `empty(*shape, dtype=...)` (e.g. engine/huge_pages.py's). float32: [ceil(N / 16), K, 16], a panel's k steps one
    64-byte line each. bfloat16 (where `storage_dtype` allows it: the values are kept exactly): [ceil(N / 16),
    K rounded up to even, 16], a panel's k steps in pairs, line j holding steps 2j and 2j + 1 of its 16 columns
    interleaved (the kernel's `wpair`; `unpack` is the inverse)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"packed weights are float32 or bfloat16, not {dtype}")
    n, k = weight.shape
    panels = -(-n // PANEL)
    width = k if dtype == torch.float32 else -(-k // 2) * 2
    padded = torch.zeros(panels * PANEL, width, dtype=dtype)
    padded[:n, :k] = weight
    packed = empty(panels, width, PANEL, dtype=dtype)
    if dtype == torch.float32:
        packed.copy_(padded.view(panels, PANEL, k).transpose(1, 2))
    else:   # [panel, column, pair, step of the pair] -> [panel, pair, column, step of the pair]
        packed.view(panels, width // 2, PANEL, 2).copy_(padded.view(panels, PANEL, width // 2, 2).transpose(1, 2))
    return packed


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The [out_features, in_features] weight `pack` packed (in its dtype): the layout's reference."""
    panels, width, _ = packed.shape
    if packed.dtype == torch.float32:
        full = packed.transpose(1, 2).reshape(panels * PANEL, width)
    else:
        full = packed.view(panels, width // 2, PANEL, 2).transpose(1, 2).reshape(panels * PANEL, width)
    return full[:out_features, :in_features]


def kernel_name(packed_dtype: torch.dtype) -> str:
    """The C function for weights packed in `packed_dtype` (same signature for both)."""
    return "tgi_gemv_bf16" if packed_dtype == torch.bfloat16 else "tgi_gemv"


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
           threads: int | None = None) -> torch.Tensor:
    """x [M, K] float32 (rows evenly strided, K contiguous) -> [M, out_features] float32, as F.linear with the
    packed weight (float32 or bfloat16 panels, accumulated in float32)."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 and packed.is_contiguous()
    assert packed.dtype in (torch.float32, torch.bfloat16)
    steps = x.shape[1] if packed.dtype == torch.float32 else -(-x.shape[1] // 2) * 2
    assert packed.shape[1] == steps and packed.shape[0] * PANEL >= out_features
    assert bias is None or (bias.is_contiguous() and bias.dtype == torch.float32 and bias.numel() == out_features)
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    getattr(load(), kernel_name(packed.dtype))(
        x.data_ptr(), x.stride(0), x.shape[0], packed.data_ptr(), None if bias is None else bias.data_ptr(),
        out_features, x.shape[1], y.data_ptr(), out_features, threads or max(1, torch.get_num_threads()))
    return y


def self_check() -> str | None:
    """None when the kernel builds and agrees with F.linear on odd shapes, its bfloat16 panels with the float32 ones
    bit for bit; else why not."""
    try:
        generator = torch.Generator().manual_seed(0)
        for rows, n, k, with_bias in ((1, 40, 24, True), (5, 17, 33, False), (16, 48, 64, True), (19, 35, 7, True)):
            weight = torch.randn(n, k, generator=generator)
            bias = torch.randn(n, generator=generator) if with_bias else None
            x = torch.randn(rows, k, generator=generator)
            if not torch.allclose(linear(x, pack(weight), n, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-4):
                return f"disagrees with F.linear at {rows} x {k} -> {n}"
            exact = weight.to(torch.bfloat16).float()
            if not torch.equal(linear(x, pack(exact, dtype=torch.bfloat16), n, bias), linear(x, pack(exact), n, bias)):
                return f"its bfloat16 panels differ from the float32 ones at {rows} x {k} -> {n}"
    except Exception as error:  # a build or load failure: the caller falls back, never fails the load
        return f"{type(error).__name__}: {error}"
    return None

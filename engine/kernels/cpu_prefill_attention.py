"""CPU causal attention for prefill chunks, reading K/V where they lie in the paged cache.

A prefill chunk's queries attend to the whole context, the cached prefix and their own new tokens
(already stored in the cache), read through the block table in place: nothing is gathered into a
[K, kvh, d] copy, and no [Q, K] mask is built. A small C++ kernel with no torch headers, built at first use
and cached on disk by engine/kernels/cpp_build.py, called through ctypes. One task is (chunk, kv head,
block of QB queries): the rows of that block that read that kv head (queries x the heads of its group)
are scored together against tiles of 64 keys, so each key is read once for all of them (in float32 straight
from the cache; bf16 and fp16 tiles are converted once). Queries are held transposed ([d, rows]) and scores
as [keys, rows], so the register-tiled score and P.V micro-kernels and the online softmax (fp32) between
them run across rows in vectors (the tiles sized to AVX-512's registers or AVX2's). Tiles past a block's last
query are never visited (causal), nor those before its sliding window; on the diagonal, keys past a row group's
last position are skipped. OpenMP spreads the tasks over threads, the longest first.

Reference: paged_attention_reference (engine/kernels/attention_reference.py), float64. `self_check` runs the
kernel against it at start-up, on the model's head layouts, and the engine falls back to SDPA
(engine/attention/portable.py) when the kernel does not build or disagrees, and on CPUs without AVX-512 (where
SDPA measured faster); `TGI_HPC_CPU_PREFILL_ATTENTION`
(auto | kernel | sdpa) overrides the choice, and /info's attention_checks shows it.
"""
from __future__ import annotations

import ctypes
import logging
import os

import torch

from engine.kernels.cpp_build import Library, built_and_checked, compiler
from engine.kernels.cpu_simd import VECTORS

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t KB = 64;  // keys per tile
constexpr int NR = 4;       // rows per micro-kernel
struct bf16 { uint16_t bits; };

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x.bits) << 16); }
inline float to_float(_Float16 x) { return static_cast<float>(x); }
inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, _Float16* dst) { *dst = static_cast<_Float16>(x); }
inline void store(float x, bf16* dst) {  // round to nearest even, as torch does
  uint32_t u = __builtin_bit_cast(uint32_t, x);
  dst->bits = std::isnan(x) ? 0x7fc0 : static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

""" + VECTORS + r"""
// The tiles' accumulators are native vectors (cpu_simd.py's fnv: arrays of f16x go through the stack without
// AVX-512), and their sizes follow the register file: AVX-512's 32 registers of 16 floats take up to 4 slices of 16
// rows (score tiles) or columns (sums), AVX2's 16 of 8 one slice
constexpr int64_t SLICES = NV == 16 ? 4 : 1;

// st[t][RV * 16 rows] = k row t . qt[D][rows], for 4 keys t at a time: 4 x RV slices of accumulators; each key value
// is broadcast from the cache where it lies, each qt vector loaded once for the 4 keys
template <int RV>
inline void score_tile(const float* const* krow, int64_t n, int64_t D, const float* qt, int64_t RP, float* st) {
  constexpr int V = RV * PER16;
  for (int64_t t = 0; t < n; t += 4) {
    fnv acc[4][V] = {};
    const float *k0 = krow[t], *k1 = krow[t + 1], *k2 = krow[t + 2], *k3 = krow[t + 3];
    for (int64_t d = 0; d < D; ++d) {
      fnv q[V];
      for (int i = 0; i < V; ++i) {
        fnv x = loadnv(qt + d * RP + NV * i);
#ifdef __AVX512F__
        asm("" : "+v"(x));  // in a register: gcc would fold this load into each of the 4 keys' FMAs (4x the loads)
#endif
        q[i] = x;
      }
      const float x0 = k0[d], x1 = k1[d], x2 = k2[d], x3 = k3[d];
      for (int i = 0; i < V; ++i) {
        acc[0][i] += x0 * q[i];
        acc[1][i] += x1 * q[i];
        acc[2][i] += x2 * q[i];
        acc[3][i] += x3 * q[i];
      }
    }
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < V; ++i) *reinterpret_cast<fnv*>(st + (t + j) * RP + NV * i) = acc[j][i];
  }
}

// acc[NR rows][16 DS columns] += sum over t < n of p[t][row] * v row t (p rows RP apart, acc rows D apart)
template <int DS>
inline void accumulate_tile(float* acc, int64_t D, const float* p, int64_t RP, const float* const* vrow,
                            int64_t d0, int64_t n) {
  constexpr int V = DS * PER16;
  fnv a[NR][V];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < V; ++i) a[r][i] = loadnv(acc + r * D + NV * i);
  for (int64_t t = 0; t < n; ++t) {
    fnv x[V];
    for (int i = 0; i < V; ++i) x[i] = loadnv(vrow[t] + d0 + NV * i);
    for (int r = 0; r < NR; ++r) {
      const float w = p[t * RP + r];
      for (int i = 0; i < V; ++i) a[r][i] += w * x[i];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < V; ++i) *reinterpret_cast<fnv*>(acc + r * D + NV * i) = a[r][i];
}

template <typename T>
struct Args {
  const T* q; int64_t q_row, q_head;   // q [T, H, D] strides; D contiguous
  const T* k; const T* v;              // caches [blocks, BS, KVH, D], contiguous
  const int32_t* work;                 // [N, 4]: sequence, first row, query rows, seq_len
  const int32_t* tables; int64_t table_stride;
  int64_t bs, kvh, group, dim, qb;
  float scale; int64_t window; float softcap;
};

struct Task { int64_t item, q0, g, cost; };

// rows of a task, padded to whole vectors
inline int64_t padded_rows(int64_t rows) { return (rows + 15) / 16 * 16; }

// pointers to the K and V rows of keys k0 .. k0 + n of kv head g, as float: in the cache itself for float32,
// else converted into kf / vf [KB, D]; keys n .. KB point at zeros
template <typename T>
inline void tile_rows(const Args<T>& a, const int32_t* table, int64_t g, int64_t k0, int64_t n, float* kf,
                      float* vf, const float* zeros, const float** krow, const float** vrow) {
  const int64_t D = a.dim, row = a.kvh * D;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = k0 + t, slot = static_cast<int64_t>(table[pos / a.bs]) * a.bs + pos % a.bs;
    const T* ks = a.k + slot * row + g * D;
    const T* vs = a.v + slot * row + g * D;
    if constexpr (std::is_same_v<T, float>) {
      krow[t] = ks;
      vrow[t] = vs;
    } else {
      for (int64_t d = 0; d < D; ++d) kf[t * D + d] = to_float(ks[d]);
      for (int64_t d = 0; d < D; ++d) vf[t * D + d] = to_float(vs[d]);
      krow[t] = kf + t * D;
      vrow[t] = vf + t * D;
    }
  }
  for (int64_t t = n; t < KB; ++t) krow[t] = vrow[t] = zeros;
}

// one task: queries q0 .. q0 + qn of work item `item`, every head of kv head g. Rows r = query * group + head
// in the group; scores are kept transposed (st [key][row]) so that the softmax runs across rows in vectors
template <typename T>
void attend(const Args<T>& a, T* out, const Task& task, float* buf) {
  const int32_t* w = a.work + task.item * 4;
  const int64_t seq = w[0], first = w[1], q_len = w[2], seq_len = w[3];
  const int64_t D = a.dim, G = a.group, H = a.kvh * G, g = task.g;
  const int64_t qn = std::min(a.qb, q_len - task.q0), R = qn * G, RP = padded_rows(R);
  const int64_t p_first = seq_len - q_len + task.q0, p_last = p_first + qn - 1;
  float* qt = buf;              // [D, RP] queries, scaled and transposed (padding rows zero)
  float* st = qt + D * RP;      // [KB, RP] scores, then probabilities
  float* acc = st + KB * RP;    // [RP, D]
  float* m = acc + RP * D;      // [RP] running max
  float* l = m + RP;            // [RP] running sum
  float* alpha = l + RP;        // [RP] this tile's rescaling of acc
  int32_t* pos = reinterpret_cast<int32_t*>(alpha + RP);  // [RP] each row's position
  int32_t* lo = pos + RP;                                  // [RP] keys <= lo are outside its window
  float* kf = reinterpret_cast<float*>(lo + RP);           // [KB, D] a tile converted to float (bf16, fp16)
  float* vf = kf + KB * D;
  float* zeros = vf + KB * D;   // [D]
  const float* krow[KB];
  const float* vrow[KB];
  for (int64_t r = 0; r < RP; ++r) {
    const int64_t rr = std::min(r, R - 1);
    const T* src = a.q + (first + task.q0 + rr / G) * a.q_row + (g * G + rr % G) * a.q_head;
    for (int64_t d = 0; d < D; ++d) qt[d * RP + r] = r < R ? to_float(src[d]) * a.scale : 0.0f;
    pos[r] = static_cast<int32_t>(p_first + rr / G);
    lo[r] = a.window > 0 ? pos[r] - static_cast<int32_t>(a.window) : -1;
    m[r] = NEG_INF;
    l[r] = 0.0f;
  }
  std::fill(acc, acc + RP * D, 0.0f);
  std::fill(zeros, zeros + D, 0.0f);
  const int32_t* table = a.tables + seq * a.table_stride;
  const int64_t k_lo = a.window > 0 ? std::max<int64_t>(0, p_first - a.window + 1) : 0, k_hi = p_last + 1;
  for (int64_t k0 = k_lo / KB * KB; k0 < k_hi; k0 += KB) {
    const int64_t n = std::min(KB, k_hi - k0), n4 = (n + 3) / 4 * 4;
    tile_rows(a, table, g, k0, n, kf, vf, zeros, krow, vrow);
    for (int64_t r0 = 0; r0 < RP; r0 += 16 * SLICES) {
      const int64_t width = std::min<int64_t>(SLICES, (RP - r0) / 16);
      // keys past the last row's position are masked for all these rows: not scored (on the diagonal)
      const int64_t keys = std::min(n4, (pos[r0 + 16 * width - 1] - k0 + 4) / 4 * 4);
      if (keys <= 0) continue;
      switch (width) {
        case 1: score_tile<1>(krow, keys, D, qt + r0, RP, st + r0); break;
        case 2: score_tile<2>(krow, keys, D, qt + r0, RP, st + r0); break;
        case 3: score_tile<3>(krow, keys, D, qt + r0, RP, st + r0); break;
        default: score_tile<4>(krow, keys, D, qt + r0, RP, st + r0); break;
      }
    }
    // the online softmax across rows, 16 at a time: mask (causal, window) and soft-cap, the tile's max per row,
    // the running max and sum, then probabilities in place of the scores
    for (int64_t r = 0; r < RP; r += 16) {
      const i16x p16 = load16i(pos + r), lo16 = load16i(lo + r);
      f16x tile_max = f16x{} + NEG_INF;
      for (int64_t t = 0; t < n; ++t) {
        const i16x key = i16x{} + static_cast<int32_t>(k0 + t);
        f16x x = load16(st + t * RP + r);
        if (a.softcap > 0.0f)
          for (int i = 0; i < 16; ++i) x[i] = a.softcap * std::tanh(x[i] / a.softcap);
        x = (key <= p16) & (key > lo16) ? x : NEG_INF;
        store16(st + t * RP + r, x);
        tile_max = tile_max > x ? tile_max : x;
      }
      const f16x m_old = load16(m + r), m_new = m_old > tile_max ? m_old : tile_max;
      const f16x empty = f16x{} + NEG_INF;
      const f16x offset = m_new == empty ? f16x{} : m_new;   // rows with no key yet: exponents stay finite
      const f16x scale = m_new == empty ? f16x{} + 1.0f : exp16(m_old - m_new);  // m_old = -inf: ~1e-38
      f16x sum = load16(l + r) * scale;
      for (int64_t t = 0; t < n; ++t) {
        const f16x x = load16(st + t * RP + r), e = exp16(x - offset);
        const f16x prob = x == empty ? f16x{} : e;
        store16(st + t * RP + r, prob);
        sum += prob;
      }
      store16(m + r, m_new);
      store16(l + r, sum);
      store16(alpha + r, scale);
    }
    for (int64_t r = 0; r < RP; ++r)
      if (alpha[r] != 1.0f) {
        float* ar = acc + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] *= alpha[r];
      }
    for (int64_t r = 0; r < RP; r += NR) {
      const int64_t keys = std::min<int64_t>(n, pos[r + NR - 1] - k0 + 1);  // the rest have probability 0
      for (int64_t d0 = 0; d0 < D && keys > 0; d0 += 16 * SLICES) {
        float* ar = acc + r * D + d0;
        switch (std::min<int64_t>(SLICES, (D - d0) / 16)) {
          case 1: accumulate_tile<1>(ar, D, st + r, RP, vrow, d0, keys); break;
          case 2: accumulate_tile<2>(ar, D, st + r, RP, vrow, d0, keys); break;
          case 3: accumulate_tile<3>(ar, D, st + r, RP, vrow, d0, keys); break;
          default: accumulate_tile<4>(ar, D, st + r, RP, vrow, d0, keys); break;
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    T* dst = out + ((first + task.q0 + r / G) * H + g * G + r % G) * D;
    const float inv = 1.0f / l[r];
    for (int64_t d = 0; d < D; ++d) store(acc[r * D + d] * inv, dst + d);
  }
}

template <typename T>
void run(const Args<T>& a, T* out, int64_t items, int threads) {
  std::vector<Task> tasks;
  for (int64_t i = 0; i < items; ++i) {
    const int32_t* w = a.work + i * 4;
    for (int64_t q0 = 0; q0 < w[2]; q0 += a.qb) {
      const int64_t last = w[3] - w[2] + std::min<int64_t>(q0 + a.qb, w[2]);  // keys of its last query
      const int64_t keys = a.window > 0 ? std::min(last, a.window + a.qb) : last;
      for (int64_t g = 0; g < a.kvh; ++g) tasks.push_back({i, q0, g, keys});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
  const int64_t RP = padded_rows(a.qb * a.group), D = a.dim;
  const int64_t scratch = D * RP + KB * RP + RP * D + 5 * RP + 2 * KB * D + D;
  const int64_t count = static_cast<int64_t>(tasks.size());
  if (count == 0) return;  // only empty chunks
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(threads, count)))
  {
    std::vector<float> buf(scratch);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) attend(a, out, tasks[i], buf.data());
  }
}

template <typename T>
void launch(void* out, const void* q, int64_t q_row, int64_t q_head, const void* k, const void* v,
            const int32_t* work, int64_t items, const int32_t* tables, int64_t table_stride, int64_t bs,
            int64_t kvh, int64_t group, int64_t dim, int64_t qb, double scale, int64_t window, double softcap,
            int threads) {
  Args<T> a{static_cast<const T*>(q), q_row, q_head, static_cast<const T*>(k), static_cast<const T*>(v), work,
            tables, table_stride, bs, kvh, group, dim, std::max<int64_t>(qb, 1), static_cast<float>(scale), window,
            static_cast<float>(softcap)};
  if (items > 0) run(a, static_cast<T*>(out), items, std::max(threads, 1));
}

}  // namespace

// out [T, H, D] contiguous; q [T, H, D] (strides q_row, q_head; D contiguous); k/v caches [blocks, bs, kvh, D]
// contiguous, the work items' new tokens already stored; work [items, 4] (sequence, first row, rows, seq_len);
// tables [B, table_stride]; dim a multiple of 16; qb queries per task; dtype 0 float32, 1 bfloat16, 2 float16;
// window <= 0 and softcap <= 0 mean none
extern "C" int tgi_prefill_attention(int dtype, void* out, const void* q, int64_t q_row, int64_t q_head,
                                     const void* k, const void* v, const int32_t* work, int64_t items,
                                     const int32_t* tables, int64_t table_stride, int64_t bs, int64_t kvh,
                                     int64_t group, int64_t dim, int64_t qb, double scale, int64_t window,
                                     double softcap, int threads) {
  if (dim <= 0 || dim % 16 != 0) return 2;
  switch (dtype) {
    case 0: launch<float>(out, q, q_row, q_head, k, v, work, items, tables, table_stride, bs, kvh, group, dim, qb,
                          scale, window, softcap, threads); return 0;
    case 1: launch<bf16>(out, q, q_row, q_head, k, v, work, items, tables, table_stride, bs, kvh, group, dim, qb,
                         scale, window, softcap, threads); return 0;
    case 2: launch<_Float16>(out, q, q_row, q_head, k, v, work, items, tables, table_stride, bs, kvh, group, dim,
                             qb, scale, window, softcap, threads); return 0;
  }
  return 1;
}

// floats in one vector register of this build (16 with AVX-512, else 8): `choose` reads it
extern "C" int tgi_prefill_vector_floats() { return NV; }
"""

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
QUERY_BLOCK = 64  # queries per task
CHOICES = ("auto", "kernel", "sdpa")
_forced: str | None = None  # benchmarks: "sdpa" turns the kernel off in this process (see force)


_LIBRARY = Library("cpu_prefill_attention", SOURCE, {
    "tgi_prefill_attention": (ctypes.c_int, [
        ctypes.c_int, *[ctypes.c_void_p] * 2, *[ctypes.c_int64] * 2, *[ctypes.c_void_p] * 3, ctypes.c_int64,
        ctypes.c_void_p, *[ctypes.c_int64] * 6, ctypes.c_double, ctypes.c_int64, ctypes.c_double, ctypes.c_int]),
    "tgi_prefill_vector_floats": (ctypes.c_int, []),
}, logger)


def load() -> ctypes.CDLL:
    """The compiled kernel: built once per CPU type and compiler into the cache, loaded once per process."""
    return _LIBRARY.load()


def vector_floats() -> int:
    """Floats in one vector register of the kernel's build: 16 with AVX-512, else 8."""
    return int(load().tgi_prefill_vector_floats())


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in DTYPES and head_dim % 16 == 0 and head_dim > 0


def prefill_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      work: torch.Tensor, block_tables: torch.Tensor, *, scale: float, window: int | None,
                      softcap: float | None, query_block: int = QUERY_BLOCK) -> None:
    """Fill out's rows of each work item [sequence, first row, rows, seq_len]: the rows are the last positions
    of that sequence, attending causally over its blocks, their own K/V already in the cache (see
    paged_attention_reference)."""
    assert out.is_contiguous() and q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype == out.dtype and q.shape[1] % k_cache.shape[2] == 0
    assert work.dtype == block_tables.dtype == torch.int32 and work.is_contiguous() and block_tables.stride(1) == 1
    assert q.device.type == "cpu" and q.shape[2] == k_cache.shape[3] and supports(q.dtype, q.shape[2])
    _, block_size, kv_heads, dim = k_cache.shape
    status = load().tgi_prefill_attention(
        DTYPES[q.dtype], out.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(),
        v_cache.data_ptr(), work.data_ptr(), work.shape[0], block_tables.data_ptr(), block_tables.stride(0),
        block_size, kv_heads, q.shape[1] // kv_heads, dim, query_block, scale, window or 0, softcap or 0.0,
        max(torch.get_num_threads(), 1))
    if status != 0:
        raise RuntimeError(f"tgi_prefill_attention returned {status}")


def choose(layouts: set[tuple[int, int, int, int | None, float | None]], dtype: torch.dtype) -> tuple[bool, str]:
    """(use the kernel, what /info shows: 'kernel' or 'sdpa (why)') for prefill chunks of these
    (heads, kv heads, head dim, window, softcap) layouts: the kernel when it builds, matches the reference on every
    one and the CPU has AVX-512 (without it, AVX2's 16 registers of 8 floats, its tiles measured slower than SDPA: a
    1,024-token SmolLM2 prefill 1.22x the time, 128 over 1,024 cached 1.32x, docs/benchmarks.md);
    $TGI_HPC_CPU_PREFILL_ATTENTION (auto | kernel | sdpa) overrides, and 'kernel' there raises when the kernel cannot
    serve."""
    wanted = os.environ.get("TGI_HPC_CPU_PREFILL_ATTENTION", "auto")
    if wanted not in CHOICES:
        raise ValueError(f"TGI_HPC_CPU_PREFILL_ATTENTION={wanted!r}; use one of {', '.join(CHOICES)}")
    reason = "TGI_HPC_CPU_PREFILL_ATTENTION=sdpa" if wanted == "sdpa" else unusable_reason(layouts, dtype)
    if reason is None and wanted == "auto":
        reason = width_reason()
    if reason is not None and wanted == "kernel":
        raise ValueError(f"the CPU prefill attention kernel cannot serve this model: {reason}")
    if reason is not None:
        logger.info("CPU prefill attention kernel not used (%s): SDPA", reason)
    return reason is None, "kernel" if reason is None else f"sdpa ({reason})"


def width_reason() -> str | None:
    """Why 'auto' leaves prefill chunks to SDPA on this CPU: None where it has AVX-512 (see `choose`)."""
    floats = vector_floats()
    return None if floats >= 16 else f"no AVX-512 here: SDPA is faster than the kernel's tiles at {floats} floats a " \
                                     "register"


def unusable_reason(layouts, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot serve these layouts (None: it can, and passed self_check)."""
    if dtype not in DTYPES:
        return f"no kernel for {dtype}"
    if any(dim % 16 for _, _, dim, _, _ in layouts):
        return "a head dim that is not a multiple of 16"

    def check() -> str | None:
        load()
        return self_check(layouts, dtype)
    return built_and_checked(check)


def self_check(layouts, dtype: torch.dtype) -> str | None:
    """The kernel against the float64 reference on each layout: a fresh prompt crossing tiles and query blocks,
    and a chunk over a cached prefix, on shuffled blocks of 16; None when all agree."""
    from engine.kernels.attention_reference import paged_attention_reference

    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    gen = torch.Generator().manual_seed(0)
    q_lens, contexts = [70, 37], [0, 45]
    for heads, kv_heads, dim, window, softcap in sorted(layouts, key=str):
        needed = [-(-(q + c) // 16) for q, c in zip(q_lens, contexts)]
        blocks = (torch.randperm(sum(needed), generator=gen) + 1).int()
        tables = torch.zeros(2, max(needed), dtype=torch.int32)
        tables[0, :needed[0]], tables[1, :needed[1]] = blocks[:needed[0]], blocks[needed[0]:]
        k_cache, v_cache = (torch.randn(sum(needed) + 1, 16, kv_heads, dim, generator=gen).to(dtype)
                            for _ in range(2))
        q = torch.randn(sum(q_lens), heads, dim, generator=gen).to(dtype)
        seq_lens = torch.tensor([q + c for q, c in zip(q_lens, contexts)], dtype=torch.int32)
        work = torch.tensor([[0, 0, q_lens[0], int(seq_lens[0])], [1, q_lens[0], q_lens[1], int(seq_lens[1])]],
                            dtype=torch.int32)
        out = torch.empty_like(q)
        prefill_attention(out, q, k_cache, v_cache, work, tables, scale=dim ** -0.5, window=window, softcap=softcap)
        expected = paged_attention_reference(q, k_cache, v_cache, cu_seqlens_q=torch.tensor([0, *q_lens]).cumsum(0),
                                             seq_lens=seq_lens, block_tables=tables, scale=dim ** -0.5,
                                             window=window, softcap=softcap)
        error = (out.float() - expected.float()).abs().max().item()
        if not error <= tolerance:  # also catches NaN
            return (f"differs from the reference by {error:.3g} ({heads}/{kv_heads} heads of {dim}, window {window}, "
                    f"softcap {softcap})")
    return None


def allowed() -> bool:
    """False once a benchmark forced SDPA in this process."""
    return _forced != "sdpa"


def force(method: str | None) -> None:
    """Benchmarks: 'sdpa' sends prefill chunks to SDPA in this process, 'kernel' or None back to the kernel
    (where the backend chose it)."""
    global _forced
    _forced = method

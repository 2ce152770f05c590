"""CPU paged attention for decode rows and short spans, reading K/V where they lie in the paged cache.

A small C++ kernel with no torch headers, built at first use and cached on disk by
engine/kernels/cpp_build.py, called through ctypes. One task is a span (or a range of its context): all
its query rows, every head, are scored against each of its blocks in turn, read whole where they lie
(online softmax, fp32 accumulation), so nothing is gathered or padded. Blocks that lie one after another
in the cache (a prompt's blocks, as the block manager hands them out) are read as one run of up to 64
tokens, and the rows that share a KV head are scored and summed together, so each K and V row is loaded
once for all of them; keys are scored four at a time, their four dot products reduced in one transpose-and-add tree,
and the softmax's exp runs on 16 lanes (engine/kernels/cpu_simd.py). The next run's lines are prefetched a few per
key while this one is computed (one burst would stall the core on its miss buffers). Batches with fewer spans than
threads split each context in ranges merged by log-sum-exp. Reference: engine/kernels/attention_reference.py.
"""
from __future__ import annotations

import ctypes
import logging

import torch

from engine.kernels.cpp_build import Library, compiler  # noqa: F401  (compiler: callers check for g++)
from engine.kernels.cpu_simd import VECTORS

logger = logging.getLogger(__name__)

SOURCE = r"""
// no torch headers: plain C++ and OpenMP compile in a second or two (torch/extension.h takes a minute)
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
struct bf16 { uint16_t bits; };

inline const float* as_float(const float* src, float*, int64_t) { return src; }
inline const float* as_float(const bf16* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(src[i].bits) << 16);
  return dst;
}
inline const float* as_float(const _Float16* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  return dst;
}

inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, _Float16* dst) { *dst = static_cast<_Float16>(x); }
inline void store(float x, bf16* dst) {  // round to nearest even, as torch does
  uint32_t u = __builtin_bit_cast(uint32_t, x);
  dst->bits = std::isnan(x) ? 0x7fc0 : static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

""" + VECTORS + r"""
inline float dot(const float* a, const float* b, int64_t n) {
  if (n % 16 == 0) {  // a tree sum: gcc's own reduction ends in 16 dependent scalar adds
    f16x acc = {};
    for (int64_t i = 0; i < n; i += 16)
      acc += *reinterpret_cast<const f16x*>(a + i) * *reinterpret_cast<const f16x*>(b + i);
    return hsum(acc);
  }
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// acc[0 : 16 * SLICES] += sum over t < n of p[t] * v[t * stride + ...], the accumulator held in registers (native
// vectors: arrays of f16x go through the stack without AVX-512, cpu_simd.py)
template <int SLICES>
inline void accumulate(float* acc, const float* p, const float* v, int64_t n, int64_t stride) {
  constexpr int DV = SLICES * PER16;
  fnv sum[DV];
  for (int i = 0; i < DV; ++i) sum[i] = loadnv(acc + NV * i);
  for (int64_t t = 0; t < n; ++t)
    for (int i = 0; i < DV; ++i) sum[i] += p[t] * loadnv(v + t * stride + NV * i);
  for (int i = 0; i < DV; ++i) *reinterpret_cast<fnv*>(acc + NV * i) = sum[i];
}


// the largest of the 16 lanes (NaN lanes lose, as in the scalar loop's comparisons)
inline float hmax(f16x x) {
  f16x y = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x = x < y ? y : x;
  y = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  x = x < y ? y : x;
  y = __builtin_shufflevector(x, x, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  x = x < y ? y : x;
  return x[0] < x[1] ? x[1] : x[0];
}

// a loaded vector kept in a register: gcc would fold the load into every FMA that uses it (one load per row)
inline fnv pinned(fnv x) {
#ifdef __AVX512F__
  asm("" : "+v"(x));
#endif
  return x;
}

// the next run's K and V lines, prefetched a few at a time while this run is scored and summed: a burst of
// prefetches stalls the core once its miss buffers are full (the arithmetic waits behind it), spread ones overlap it
struct Ahead {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t k_left = 0, v_left = 0, per = 0;  // lines left; lines per key and kv head visited
  void set(const void* k_next, const void* v_next, int64_t bytes, int64_t visits) {
    k = static_cast<const char*>(k_next);
    v = static_cast<const char*>(v_next);
    k_left = v_left = (bytes + 63) / 64;
    per = (k_left + v_left + visits - 1) / std::max<int64_t>(visits, 1);
  }
  inline void step(int64_t lines) {
    for (; lines > 0 && k_left > 0; --lines, --k_left, k += 64) __builtin_prefetch(k, 0, 1);
    for (; lines > 0 && v_left > 0; --lines, --v_left, v += 64) __builtin_prefetch(v, 0, 1);
  }
  void rest() { step(k_left + v_left); }
};

// NR rows that read the same kv head, scored together: 4 keys at a time, their sums reduced together (hsum4nv);
// DS slices of 16 floats a row, DV native vectors
template <int DS, int NR>
inline void score_group(const float* q, const int64_t* rows, int64_t D, const float* k, int64_t n, int64_t stride,
                        float* s, int64_t s_stride, Ahead& ahead) {
  constexpr int DV = DS * PER16;
  fnv qv[NR][DV];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < DV; ++i) qv[r][i] = loadnv(q + rows[r] * D + NV * i);
  int64_t t0 = 0;
  for (; t0 + 4 <= n; t0 += 4) {
    ahead.step(4 * ahead.per);
    fnv a[NR][4];
    for (int j = 0; j < 4; ++j) {  // each key's vectors loaded once for the NR rows
      fnv kv[DV];
      for (int i = 0; i < DV; ++i) kv[i] = pinned(loadnv(k + (t0 + j) * stride + NV * i));
      for (int r = 0; r < NR; ++r) {
        a[r][j] = qv[r][0] * kv[0];
        for (int i = 1; i < DV; ++i) a[r][j] += qv[r][i] * kv[i];
      }
    }
    for (int r = 0; r < NR; ++r)
      *reinterpret_cast<f4x*>(s + rows[r] * s_stride + t0) = hsum4nv(a[r][0], a[r][1], a[r][2], a[r][3]);
  }
  for (int64_t t = t0; t < n; ++t) {
    ahead.step(ahead.per);
    fnv kv[DV];
    for (int i = 0; i < DV; ++i) kv[i] = loadnv(k + t * stride + NV * i);
    for (int r = 0; r < NR; ++r) {
      fnv acc = qv[r][0] * kv[0];
      for (int i = 1; i < DV; ++i) acc += qv[r][i] * kv[i];
      s[rows[r] * s_stride + t] = hsumnv(acc);
    }
  }
}

// acc rows += sum over t of p[row][t] * V row t, NR rows of one kv head: each V row is loaded once
template <int DS, int NR>
inline void accumulate_group(float* acc, const int64_t* rows, int64_t D, const float* p, int64_t p_stride,
                             const float* v, int64_t n, int64_t stride, Ahead& ahead) {
  constexpr int DV = DS * PER16;
  fnv sum[NR][DV];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < DV; ++i) sum[r][i] = loadnv(acc + rows[r] * D + NV * i);
  for (int64_t t = 0; t < n; ++t) {
    ahead.step(ahead.per);
    fnv vv[DV];
    for (int i = 0; i < DV; ++i) vv[i] = pinned(loadnv(v + t * stride + NV * i));
    for (int r = 0; r < NR; ++r) {
      const float pr = p[rows[r] * p_stride + t];
      for (int i = 0; i < DV; ++i) sum[r][i] += pr * vv[i];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < DV; ++i) *reinterpret_cast<fnv*>(acc + rows[r] * D + NV * i) = sum[r][i];
}

template <int DS>
inline void score_rows(const float* q, const int64_t* rows, int nr, int64_t D, const float* k, int64_t n,
                       int64_t stride, float* s, int64_t s_stride, Ahead& ahead) {
  switch (nr) {
    case 1: score_group<DS, 1>(q, rows, D, k, n, stride, s, s_stride, ahead); break;
    case 2: score_group<DS, 2>(q, rows, D, k, n, stride, s, s_stride, ahead); break;
    case 3: score_group<DS, 3>(q, rows, D, k, n, stride, s, s_stride, ahead); break;
    default: score_group<DS, 4>(q, rows, D, k, n, stride, s, s_stride, ahead); break;
  }
}

template <int DS>
inline void accumulate_rows(float* acc, const int64_t* rows, int nr, int64_t D, const float* p, int64_t p_stride,
                            const float* v, int64_t n, int64_t stride, Ahead& ahead) {
  switch (nr) {
    case 1: accumulate_group<DS, 1>(acc, rows, D, p, p_stride, v, n, stride, ahead); break;
    case 2: accumulate_group<DS, 2>(acc, rows, D, p, p_stride, v, n, stride, ahead); break;
    case 3: accumulate_group<DS, 3>(acc, rows, D, p, p_stride, v, n, stride, ahead); break;
    default: accumulate_group<DS, 4>(acc, rows, D, p, p_stride, v, n, stride, ahead); break;
  }
}

// fn(rows, count, kv head) for the rows of each kv head, at most 4 at a time: row r = query * H + head, and
// kv head g serves heads g * group .. g * group + group - 1 of every query
template <typename F>
inline void head_groups(int64_t kvh, int64_t group, int64_t q_len, int64_t H, F&& fn) {
  const int64_t per_head = q_len * group;
  for (int64_t g = 0; g < kvh; ++g)
    for (int64_t x0 = 0; x0 < per_head; x0 += 4) {
      int64_t rows[4];
      const int nr = static_cast<int>(std::min<int64_t>(4, per_head - x0));
      for (int j = 0; j < nr; ++j) rows[j] = ((x0 + j) / group) * H + g * group + (x0 + j) % group;
      fn(rows, nr, g);
    }
}

// queries and output of type T over a cache of type C (the fused float32 decode step of a bfloat16 model: T float,
// C bf16); every other caller has C = T
template <typename T, typename C = T>
struct Args {
  const T* q; int64_t q_row, q_head;   // q [T, H, D] strides; D contiguous
  const C* k; const C* v;              // caches [blocks, BS, KVH, D], contiguous
  const int32_t* work;                 // [N, 4]: sequence, first row, query rows, seq_len
  const int32_t* tables; int64_t table_stride;
  int64_t bs, kvh, group, dim;
  float scale; int64_t window; float softcap;
};

// tokens read at once: a run of blocks lying one after another, up to 64 tokens (one block if larger)
inline int64_t run_tokens(int64_t bs) { return std::max<int64_t>(bs, 64 / bs * bs); }

// blocks from `blk` (< end) that lie one after another in the cache, read as one run of at most `tokens` tokens
inline int64_t run_blocks(const int32_t* table, int64_t blk, int64_t end, int64_t bs, int64_t tokens) {
  int64_t run = 1;
  while (blk + run < end && (run + 1) * bs <= tokens && table[blk + run] == table[blk] + run) ++run;
  return run;
}

// the first and one-past-last block a work item attends to
template <typename A>
inline void block_range(const A& a, int64_t item, int64_t* lo, int64_t* hi) {
  const int32_t* w = a.work + item * 4;
  int64_t first_pos = w[3] - w[2];
  int64_t start = a.window > 0 ? std::max<int64_t>(0, first_pos - a.window + 1) : 0;
  *lo = start / a.bs;
  *hi = (w[3] + a.bs - 1) / a.bs;
}

// rows r = query * heads + head of one span over blocks [begin, end): acc [R, D], m, l [R]. A block is
// read whole ([BS, kvh, D] contiguous): its K scored against every row, then its V summed into them
template <typename A>
void attend_blocks(const A& a, int64_t item, int64_t begin, int64_t end, float* acc, float* m, float* l,
                   float* work) {
  const int32_t* w = a.work + item * 4;
  const int64_t seq = w[0], first = w[1], q_len = w[2], seq_len = w[3];
  const int64_t D = a.dim, BS = a.bs, H = a.kvh * a.group, R = q_len * H, row = a.kvh * D;
  float* qf = work;               // [R, D] queries, scaled
  const int64_t L = run_tokens(BS);  // blocks lying one after another in the cache are read as one run
  float* s = qf + R * D;          // [R, L] scores, then probabilities
  float* kbuf = s + R * L;        // [L, kvh, D] one run of K, then of V, in float (bf16, fp16)
  for (int64_t r = 0; r < R; ++r) {
    const float* f = as_float(a.q + (first + r / H) * a.q_row + (r % H) * a.q_head, kbuf, D);
    for (int64_t d = 0; d < D; ++d) qf[r * D + d] = f[d] * a.scale;
  }
  for (int64_t r = 0; r < R; ++r) { m[r] = NEG_INF; l[r] = 0.0f; }
  std::fill(acc, acc + R * D, 0.0f);
  const int32_t* table = a.tables + seq * a.table_stride;
  for (int64_t blk = begin, run = begin < end ? run_blocks(table, begin, end, BS, L) : 0, next_run; blk < end;
       blk += run, run = next_run) {
    next_run = blk + run < end ? run_blocks(table, blk + run, end, BS, L) : 0;
    const int64_t base = blk * BS, n = std::min(run * BS, seq_len - base);
    const int64_t slot0 = static_cast<int64_t>(table[blk]) * BS;
    Ahead ahead;  // blocks sit anywhere in the cache, beyond the hardware prefetcher's guess: the next one early
    if (next_run > 0) {  // the whole next run
      const int64_t nb = blk + run, next = static_cast<int64_t>(table[nb]) * BS * row;
      ahead.set(a.k + next, a.v + next, std::min(next_run * BS, seq_len - nb * BS) * row * sizeof(*a.k), 2 * n * a.kvh);
    }
    const float* kf = as_float(a.k + slot0 * row, kbuf, n * row);
    if (D == 64 || D == 128) {  // rows grouped by kv head, at most 4 at a time (registers)
      head_groups(a.kvh, a.group, q_len, H, [&](const int64_t* rows, int nr, int64_t g) {
        if (D == 64) score_rows<4>(qf, rows, nr, D, kf + g * D, n, row, s, L, ahead);
        else score_rows<8>(qf, rows, nr, D, kf + g * D, n, row, s, L, ahead);
      });
    } else {
      for (int64_t t = 0; t < n; ++t)
        for (int64_t r = 0; r < R; ++r) s[r * L + t] = dot(qf + r * D, kf + t * row + ((r % H) / a.group) * D, D);
    }
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s + r * L;
      const int64_t pos = seq_len - q_len + r / H;
      const int64_t t0 = std::max<int64_t>(a.window > 0 ? pos - a.window + 1 - base : 0, 0);
      const int64_t t1 = std::min<int64_t>(pos - base + 1, n);
      if (t0 >= t1) { std::fill(sr, sr + n, 0.0f); continue; }
      if (a.softcap > 0.0f)
        for (int64_t t = t0; t < t1; ++t) sr[t] = a.softcap * std::tanh(sr[t] / a.softcap);
      const bool full = t0 == 0 && t1 == n && n % 16 == 0;  // every key of the run counts (a decode row's)
      float mx = NEG_INF;
      if (full) {  // all on 16 lanes
        f16x mv = f16x{} + NEG_INF;
        for (int64_t t = 0; t < n; t += 16) {
          const f16x x = load16(sr + t);
          mv = mv < x ? x : mv;
        }
        mx = hmax(mv);
      } else {
#pragma omp simd reduction(max : mx)
        for (int64_t t = t0; t < t1; ++t) mx = std::max(mx, sr[t]);
      }
      const float m_new = std::max(m[r], mx);
      const float alpha = m[r] == NEG_INF ? 0.0f : std::exp(m[r] - m_new);
      float sum = 0.0f;
      if (full) {  // exp and sum in one pass
        f16x sv = {};
        for (int64_t t = 0; t < n; t += 16) {
          const f16x e = exp16(load16(sr + t) - m_new);
          store16(sr + t, e);
          sv += e;
        }
        sum = hsum(sv);
      } else {
        int64_t t = 0;  // all n, masked after: no branches
        for (; t + 16 <= n; t += 16) store16(sr + t, exp16(load16(sr + t) - m_new));
        for (; t < n; ++t) sr[t] = exp1(sr[t] - m_new);
        std::fill(sr, sr + t0, 0.0f);
        std::fill(sr + t1, sr + n, 0.0f);
#pragma omp simd reduction(+ : sum)
        for (int64_t t = t0; t < t1; ++t) sum += sr[t];
      }
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
      if (alpha != 1.0f) {
        float* ar = acc + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
      }
    }
    const float* vf = as_float(a.v + slot0 * row, kbuf, n * row);
    if (D == 64 || D == 128) {
      head_groups(a.kvh, a.group, q_len, H, [&](const int64_t* rows, int nr, int64_t g) {
        if (D == 64) accumulate_rows<4>(acc, rows, nr, D, s, L, vf + g * D, n, row, ahead);
        else accumulate_rows<8>(acc, rows, nr, D, s, L, vf + g * D, n, row, ahead);
      });
      ahead.rest();
      continue;
    }
    ahead.rest();
    for (int64_t r = 0; r < R; ++r) {
      const float* p = s + r * L;
      const float* vr = vf + ((r % H) / a.group) * D;
      float* ar = acc + r * D;
      if (D == 64) {
        accumulate<4>(ar, p, vr, n, row);
      } else if (D == 128) {
        accumulate<8>(ar, p, vr, n, row);
      } else if (D % 16 == 0) {
        for (int64_t d = 0; d < D; d += 16) accumulate<1>(ar + d, p, vr + d, n, row);
      } else {
        for (int64_t t = 0; t < n; ++t) {
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ar[d] += p[t] * vr[t * row + d];
        }
      }
    }
  }
}

// rows of a span are rows first .. first + q_len of out [T, H, D]: R * D contiguous values
template <typename A, typename T>
inline void write_rows(const A& a, T* out, int64_t item, const float* acc, const float* l) {
  const int32_t* w = a.work + item * 4;
  const int64_t D = a.dim, R = w[2] * a.kvh * a.group;
  T* dst = out + w[1] * a.kvh * a.group * D;
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.0f / l[r];
    for (int64_t d = 0; d < D; ++d) store(acc[r * D + d] * inv, dst + r * D + d);
  }
}

template <typename A, typename T>
void run(const A& a, T* out, int64_t items, int64_t splits, int threads) {
  int64_t max_rows = 0, max_blocks = 0;
  for (int64_t i = 0; i < items; ++i) {
    int64_t lo, hi;
    block_range(a, i, &lo, &hi);
    max_rows = std::max<int64_t>(max_rows, a.work[i * 4 + 2] * a.kvh * a.group);
    max_blocks = std::max(max_blocks, hi - lo);
  }
  const int64_t D = a.dim, width = max_rows * (D + 2);  // one range's acc [R, D], m [R], l [R]
  const int64_t scratch = max_rows * (D + run_tokens(a.bs)) + run_tokens(a.bs) * a.kvh * D;
  if (splits <= 0)  // enough (span, range) tasks for every thread, at least 4 blocks a range
    splits = items >= 2 * threads ? 1
                                  : std::max<int64_t>(1, std::min((4 * threads + items - 1) / items, max_blocks / 4));
  const int64_t tasks = items * splits;
  std::vector<float> parts(splits == 1 ? 0 : tasks * width);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> mine(width + scratch);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t item = task / splits, part = task % splits;
      int64_t lo, hi;
      block_range(a, item, &lo, &hi);
      const int64_t chunk = (hi - lo + splits - 1) / splits;
      const int64_t begin = std::min(hi, lo + part * chunk), end = std::min(hi, begin + chunk);
      float* acc = splits == 1 ? mine.data() : parts.data() + task * width;
      attend_blocks(a, item, begin, end, acc, acc + max_rows * D, acc + max_rows * (D + 1), mine.data() + width);
      if (splits == 1) write_rows(a, out, item, acc, acc + max_rows * (D + 1));
    }
  }
  if (splits == 1) return;
  // merge the ranges of each span by log-sum-exp
#pragma omp parallel for num_threads(threads)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t rows = a.work[item * 4 + 2] * a.kvh * a.group;
    std::vector<float> acc(max_rows * D, 0.0f), l(max_rows, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      float mx = NEG_INF;
      for (int64_t p = 0; p < splits; ++p) mx = std::max(mx, parts[(item * splits + p) * width + max_rows * D + r]);
      for (int64_t p = 0; p < splits; ++p) {
        const float* part = parts.data() + (item * splits + p) * width;
        const float mp = part[max_rows * D + r];
        if (mp == NEG_INF) continue;
        const float c = std::exp(mp - mx);
        l[r] += c * part[max_rows * (D + 1) + r];
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] += c * part[r * D + d];
      }
    }
    write_rows(a, out, item, acc.data(), l.data());
  }
}

template <typename T, typename C = T>
void launch(void* out, const void* q, int64_t q_row, int64_t q_head, const void* k, const void* v,
            const int32_t* work, int64_t items, const int32_t* tables, int64_t table_stride, int64_t bs,
            int64_t kvh, int64_t group, int64_t dim, double scale, int64_t window, double softcap, int64_t splits,
            int threads) {
  Args<T, C> a{static_cast<const T*>(q), q_row, q_head, static_cast<const C*>(k), static_cast<const C*>(v), work,
            tables, table_stride, bs, kvh, group, dim, static_cast<float>(scale), window,
            static_cast<float>(softcap)};
  if (items > 0 && dim > 0) run(a, static_cast<T*>(out), items, splits, std::max(threads, 1));
}

}  // namespace

// out [T, H, D] contiguous; q [T, H, D] (strides q_row, q_head; D contiguous); k/v caches [blocks, bs, kvh, D]
// contiguous; work [items, 4] (sequence, first row, rows, seq_len); tables [B, table_stride]; dtype 0 float32,
// 1 bfloat16, 2 float16, 3 float32 queries and output over a bfloat16 cache; window <= 0 and softcap <= 0 mean
// none; splits = ranges per context (0 = choose)
extern "C" int tgi_paged_attention(int dtype, void* out, const void* q, int64_t q_row, int64_t q_head,
                                   const void* k, const void* v, const int32_t* work, int64_t items,
                                   const int32_t* tables, int64_t table_stride, int64_t bs, int64_t kvh,
                                   int64_t group, int64_t dim, double scale, int64_t window, double softcap,
                                   int64_t splits, int threads) {
  switch (dtype) {
    case 0: launch<float>(out, q, q_row, q_head, k, v, work, items, tables, table_stride, bs, kvh, group, dim,
                          scale, window, softcap, splits, threads); return 0;
    case 1: launch<bf16>(out, q, q_row, q_head, k, v, work, items, tables, table_stride, bs, kvh, group, dim,
                         scale, window, softcap, splits, threads); return 0;
    case 2: launch<_Float16>(out, q, q_row, q_head, k, v, work, items, tables, table_stride, bs, kvh, group, dim,
                             scale, window, softcap, splits, threads); return 0;
    case 3: launch<float, bf16>(out, q, q_row, q_head, k, v, work, items, tables, table_stride, bs, kvh, group, dim,
                                scale, window, softcap, splits, threads); return 0;
  }
  return 1;
}
"""

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FLOAT32_OVER_BF16 = 3   # float32 queries and output over a bfloat16 cache (the fused decode step of a bfloat16 model)


_LIBRARY = Library("cpu_attention", SOURCE, {
    "tgi_paged_attention": (ctypes.c_int, [
        ctypes.c_int, *[ctypes.c_void_p] * 2, *[ctypes.c_int64] * 2, *[ctypes.c_void_p] * 3, ctypes.c_int64,
        ctypes.c_void_p, *[ctypes.c_int64] * 5, ctypes.c_double, ctypes.c_int64, ctypes.c_double, ctypes.c_int64,
        ctypes.c_int]),
}, logger)


def load() -> ctypes.CDLL:
    """The compiled kernel: built once per CPU type and compiler into the cache, loaded once per process."""
    return _LIBRARY.load()


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    work: torch.Tensor, block_tables: torch.Tensor, *, scale: float, window: int | None,
                    softcap: float | None, splits: int = 0) -> None:
    """Fill out's rows of each work item [sequence, first row, rows, seq_len]: the rows are the last
    positions of that sequence, attending causally over its blocks (see paged_attention_reference);
    splits > 0 forces that many context ranges per span, 0 chooses. q and out share a dtype, and so do the caches:
    the same one, or float32 q and out over bfloat16 caches."""
    assert out.is_contiguous() and q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    mixed = (q.dtype, k_cache.dtype) == (torch.float32, torch.bfloat16)   # float32 queries over a bfloat16 cache
    assert q.dtype == out.dtype and k_cache.dtype == v_cache.dtype and (q.dtype == k_cache.dtype or mixed)
    assert q.shape[1] % k_cache.shape[2] == 0
    assert work.dtype == block_tables.dtype == torch.int32 and work.is_contiguous() and block_tables.stride(1) == 1
    assert q.device.type == "cpu" and q.shape[2] == k_cache.shape[3]
    _, block_size, kv_heads, dim = k_cache.shape
    load().tgi_paged_attention(
        FLOAT32_OVER_BF16 if mixed else DTYPES[q.dtype], out.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), work.data_ptr(), work.shape[0], block_tables.data_ptr(),
        block_tables.stride(0), block_size, kv_heads, q.shape[1] // kv_heads, dim, scale, window or 0, softcap or 0.0,
        splits, 1 if torch.get_num_threads() < 1 else torch.get_num_threads())

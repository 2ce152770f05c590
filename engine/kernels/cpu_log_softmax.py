"""log_softmax over the vocabulary on CPU, and the greedy pick (argmax + its logprob) in one read of the logits.

Every logprob the sampler reports on CPU float32 comes from here, so that a token's logprob is the same bits
whichever path chose it (the greedy shortcut, the general sampler, the draft verifier) and whatever else is
in the batch: each row's value depends on that row only.

One routine per row (`row_stats`): blocks of 1,024 scores (4 KB) each get their max and its first index, then,
from L1, their sum of exp against the row's max so far, rescaled with one exp when a later block raises the max
(the online softmax). Then lse = log(sum), and
- `greedy`: the first index of the max (NaN counts as the largest, as in torch.argmax) and (x - max) - lse at it,
  i.e. -lse: one read of the scores and nothing written but two numbers a row. The sampler's greedy rows need
  only these; through torch they were an argmax pass, a log_softmax pass writing [rows, vocab] and a gather
  (256 x 128k float32 scores, a Llama 3 vocabulary: 6 ms against 13 ms, two threads);
- `log_softmax`: (x - max) - lse for every score, written in a second pass over the row (in L2);
- `sample`: a row that samples with its temperature alone (an OpenAI request's default: temperature 1, no top-p)
  drawn from softmax(x / t) by the row's uniform: the same pass over x / t (the division torch's `scores / t`
  does) keeps each block's exp sum, the uniform picks a block by those sums and a token inside it by a running
  sum, and its logprob is log_softmax's there, bit for bit. One read of the logits and nothing written, against
  a division, a log_softmax, an exp and block sums over [rows, vocab] through torch (16 x 49,152: 0.4 ms against
  1.7 ms). The draw's float32 exps differ from torch's, so a uniform within rounding of a token boundary may
  pick its neighbour; `sample_reference` (float64) bounds that in `self_check`.
A row with a NaN, a +inf or nothing but -inf gives NaN everywhere, as torch does.

Reference: `log_softmax_reference` / `greedy_reference` (torch.log_softmax and torch.argmax) in float64. Ids agree
exactly; logprobs within RTOL/ATOL (measured: ~3e-6 relative at 128k columns, where torch's own float32
log_softmax is off by up to ~1.5e-4; exp is cephes' polynomial, engine/kernels/cpu_simd.py). `self_check`
compares them at start-up, on hostile rows too.
"""
from __future__ import annotations

import ctypes
import logging
import math

import torch

from engine.kernels.cpp_build import Library, built_and_checked, compiler
from engine.kernels.cpu_simd import VECTORS

logger = logging.getLogger(__name__)

RTOL, ATOL = 1e-5, 1e-6      # the kernel's logprobs against the float64 reference

SOURCE = r"""
#include <omp.h>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

constexpr int64_t BLOCK = 1024;          // scores per block: 4 KB, read from L1 for the block's exp pass
constexpr int64_t PARALLEL_MIN = 1 << 20;
constexpr float NEG = -std::numeric_limits<float>::infinity();
constexpr float NAN_ = std::numeric_limits<float>::quiet_NaN();

""" + VECTORS + r"""

struct Stats {
  float max;       // NaN when the row has one
  int64_t id;      // first index of the max (of the first NaN)
  float lse;       // log(sum(exp(x - max))); NaN when max is not finite or the row has a NaN (torch's values)
};

// DIV: the scores are x / t (a float division per element, as torch's `scores / t`); `blocks` (when given) gets
// each block's exp sum and `refs` the max it was taken against
template <bool DIV>
Stats row_stats_t(const float* x, int64_t n, bool want_lse, float t, float* blocks, float* refs) {
  const i16x lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const f16x tv = f16x{} + t;
  float best = NEG;
  int64_t best_id = 0;
  float sum = 0.0f;                       // of exp(x - best), over the blocks so far
  for (int64_t b = 0; b < n; b += BLOCK) {
    const int64_t end = b + BLOCK < n ? b + BLOCK : n;
    // the block's max and its first index: per lane, then across lanes
    f16x m = f16x{} + NEG;
    i16x at = i16x{} + static_cast<int32_t>(b);
    i16x anynan = i16x{};
    int64_t d = b;
    for (; d + 16 <= end; d += 16) {
      const f16x v = DIV ? load16(x + d) / tv : load16(x + d);
      const i16x gt = v > m;
      m = gt ? v : m;
      at = gt ? lane + static_cast<int32_t>(d) : at;
      anynan |= v != v;
    }
    float bm = NEG;
    int64_t bid = b;
    bool nan = false;
    for (int j = 0; j < 16; ++j) {
      if (m[j] > bm || (m[j] == bm && at[j] < bid)) { bm = m[j]; bid = at[j]; }
      nan |= anynan[j] != 0;
    }
    for (; d < end; ++d) {
      const float v = DIV ? x[d] / t : x[d];
      if (v > bm) { bm = v; bid = d; }
      nan |= v != v;
    }
    if (nan) {                             // torch: NaN is the largest, the first one wins; all logprobs NaN
      int64_t k = 0;
      while ((DIV ? x[k] / t : x[k]) == (DIV ? x[k] / t : x[k])) ++k;
      return Stats{NAN_, k, NAN_};
    }
    if (b == 0 || bm > best) {           // a new max (ties keep the earlier index): rescale the sum so far
      if (want_lse && b > 0 && std::isfinite(best)) sum *= exp1(best - bm);
      best = bm;
      best_id = bid;
    }
    if (!want_lse || !std::isfinite(best)) {
      if (blocks != nullptr) { blocks[b / BLOCK] = 0.0f; refs[b / BLOCK] = best; }
      continue;
    }
    // the block's exp sum against the row's max so far (the block is in L1)
    f16x s = f16x{};
    d = b;
    for (; d + 16 <= end; d += 16) s += exp16((DIV ? load16(x + d) / tv : load16(x + d)) - best);
    float bs = 0.0f;
    for (int j = 0; j < 16; ++j) bs += s[j];
    for (; d < end; ++d) bs += exp1((DIV ? x[d] / t : x[d]) - best);
    sum += bs;
    if (blocks != nullptr) { blocks[b / BLOCK] = bs; refs[b / BLOCK] = best; }
  }
  // +inf or nothing but -inf: torch's x - max is NaN somewhere, so is every logprob
  return Stats{best, best_id, want_lse && std::isfinite(best) ? std::log(sum) : NAN_};
}

inline Stats row_stats(const float* x, int64_t n, bool want_lse) {
  return row_stats_t<false>(x, n, want_lse, 1.0f, nullptr, nullptr);
}

// one row drawn from softmax(x / t) by inverse CDF in index order: u * the total picks a block by the blocks' exp
// sums (rescaled to the row's max, in double), then a token inside it by a running double sum of the same exps;
// the block's last token with a nonzero probability when rounding runs past its end. Its logprob is
// log_softmax's value there, bit for bit: (x / t - max) - lse. A row with a NaN, a +inf or nothing but -inf
// gives row_stats' index (the first NaN, the +inf, 0) and a NaN logprob.
void row_sample(const float* x, int64_t n, float t, double u, float* blocks, float* refs, int64_t* id,
                float* logprob) {
  const Stats st = row_stats_t<true>(x, n, true, t, blocks, refs);
  if (!(st.lse == st.lse)) { *id = st.id; *logprob = NAN_; return; }
  const int64_t nb = (n + BLOCK - 1) / BLOCK;
  double total = 0.0;
  for (int64_t j = 0; j < nb; ++j)
    total += static_cast<double>(blocks[j]) * std::exp(static_cast<double>(refs[j] - st.max));
  double target = u * total;
  if (!(target < total)) target = std::nextafter(total, 0.0);
  double before = 0.0;
  int64_t j = 0, last = 0;
  for (; j < nb; ++j) {
    const double mass = static_cast<double>(blocks[j]) * std::exp(static_cast<double>(refs[j] - st.max));
    if (mass <= 0.0) continue;
    last = j;
    if (before + mass > target) break;
    before += mass;
  }
  if (j == nb) j = last;
  const int64_t lo = j * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
  int64_t pick = -1, positive = -1;
  double c = before;
  for (int64_t d = lo; d < hi; ++d) {
    const float y = x[d] / t;
    if (y == NEG) continue;                // masked: exp1 would give it ~1e-38, enough for a uniform of 0
    const float p = exp1(y - st.max);
    if (p <= 0.0f) continue;
    positive = d;
    c += p;
    if (c > target) { pick = d; break; }
  }
  if (pick < 0) pick = positive >= 0 ? positive : st.id;
  *id = pick;
  *logprob = (x[pick] / t - st.max) - st.lse;
}

}  // namespace

// rows of scores [rows, n] (row stride `stride`): ids[rows] and, with want_logprob, logprobs[rows] (else NaN)
extern "C" void tgi_greedy(const float* scores, int64_t rows, int64_t n, int64_t stride, int want_logprob,
                           int64_t* ids, float* logprobs, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN)
  for (int64_t i = 0; i < rows; ++i) {
    const Stats st = row_stats(scores + i * stride, n, want_logprob != 0);
    ids[i] = st.id;
    logprobs[i] = want_logprob != 0 ? (st.max - st.max) - st.lse : NAN_;  // (x - max) - lse at the argmax
  }
}

// rows of scores [rows, n] (row stride `stride`) drawn from softmax(scores / temps[i]) with uniforms[i] in [0, 1):
// ids[rows], logprobs[rows] (log_softmax of scores / temps at the id)
extern "C" void tgi_sample(const float* scores, int64_t rows, int64_t n, int64_t stride, const float* temps,
                           const double* uniforms, int64_t* ids, float* logprobs, int threads) {
  const int64_t nb = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel num_threads(threads) if (rows * n >= PARALLEL_MIN)
  {
    float* blocks = new float[2 * nb];
#pragma omp for
    for (int64_t i = 0; i < rows; ++i)
      row_sample(scores + i * stride, n, temps[i], uniforms[i], blocks, blocks + nb, ids + i, logprobs + i);
    delete[] blocks;
  }
}

// out [rows, n] (contiguous) = log_softmax of scores [rows, n] (row stride `stride`)
extern "C" void tgi_log_softmax(const float* scores, int64_t rows, int64_t n, int64_t stride, float* out,
                                int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN)
  for (int64_t i = 0; i < rows; ++i) {
    const float* x = scores + i * stride;
    float* y = out + i * n;
    const Stats st = row_stats(x, n, true);
    const float mx = st.max, lse = st.lse;
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) store16(y + d, (load16(x + d) - mx) - lse);
    for (; d < n; ++d) y[d] = (x[d] - mx) - lse;
  }
}
"""

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_LIBRARY = Library("cpu_log_softmax", SOURCE, {
    "tgi_greedy": (None, [_P, _I64, _I64, _I64, _INT, _P, _P, _INT]),
    "tgi_log_softmax": (None, [_P, _I64, _I64, _I64, _P, _INT]),
    "tgi_sample": (None, [_P, _I64, _I64, _I64, _P, _P, _P, _P, _INT]),
}, logger)


def load() -> ctypes.CDLL:
    """The compiled kernel: built once per CPU type and compiler into the cache, loaded once per process."""
    return _LIBRARY.load()


def _check(scores: torch.Tensor) -> None:
    assert scores.dtype == torch.float32 and scores.device.type == "cpu" and scores.dim() == 2
    assert scores.stride(1) == 1 or scores.shape[1] <= 1, "the vocabulary dimension must be contiguous"


def greedy(scores: torch.Tensor, logprobs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [rows] int64, chosen logprobs [rows] float32; NaN without `logprobs`) of scores [rows, vocab]."""
    _check(scores)
    rows, n = scores.shape
    ids = torch.zeros(rows, dtype=torch.int64)
    chosen = torch.full((rows,), math.nan)
    if rows and n:
        load().tgi_greedy(scores.data_ptr(), rows, n, scores.stride(0), int(logprobs), ids.data_ptr(),
                          chosen.data_ptr(), max(1, torch.get_num_threads()))
    return ids, chosen


def log_softmax(scores: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """log_softmax of scores [rows, vocab] over the vocabulary, into `out` (contiguous, same shape) when given."""
    _check(scores)
    rows, n = scores.shape
    if out is None:
        out = torch.empty(rows, n, dtype=torch.float32)
    assert out.shape == scores.shape and out.is_contiguous() and out.dtype == torch.float32
    if rows and n:
        load().tgi_log_softmax(scores.data_ptr(), rows, n, scores.stride(0), out.data_ptr(),
                               max(1, torch.get_num_threads()))
    return out


def sample(scores: torch.Tensor, temps: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [rows] int64, logprobs [rows] float32) drawn from softmax(scores / temps) [rows, vocab], row i by
    uniforms[i] in [0, 1) (float64) through the inverse CDF in vocabulary order; the logprob is log_softmax's."""
    _check(scores)
    rows, n = scores.shape
    temps = temps.to(torch.float32).contiguous()
    uniforms = uniforms.to(torch.float64).contiguous()
    assert temps.shape == (rows,) and uniforms.shape == (rows,)
    ids = torch.zeros(rows, dtype=torch.int64)
    chosen = torch.full((rows,), math.nan)
    if rows and n:
        load().tgi_sample(scores.data_ptr(), rows, n, scores.stride(0), temps.data_ptr(), uniforms.data_ptr(),
                          ids.data_ptr(), chosen.data_ptr(), max(1, torch.get_num_threads()))
    return ids, chosen


def sample_reference(scores: torch.Tensor, temps: torch.Tensor, uniforms: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same in float64 (pass float64 scores): ids, logprobs, and how far (as a fraction of the row's total)
    each row's target lies from the nearest token boundary: a kernel may pick a neighbour only within rounding."""
    scaled = scores / temps.to(scores.dtype)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    cdf = logprobs.exp().cumsum(dim=-1)
    total = cdf[:, -1:]
    target = uniforms.to(cdf.dtype)[:, None] * total
    ids = torch.searchsorted(cdf, target, right=True).clamp(max=scores.shape[-1] - 1)
    margin = ((cdf - target).abs() / total).min(dim=-1).values
    return ids[:, 0], logprobs.gather(1, ids).squeeze(1), margin


def greedy_reference(scores: torch.Tensor, logprobs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The same through torch: argmax, and log_softmax gathered at it (pass float64 scores for the reference
    values)."""
    ids = scores.argmax(dim=-1)
    if not logprobs:
        return ids, torch.full((len(scores),), math.nan, dtype=scores.dtype)
    return ids, torch.log_softmax(scores, dim=-1).gather(1, ids[:, None]).squeeze(1)


def log_softmax_reference(scores: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(scores, dim=-1)


def unusable_reason() -> str | None:
    """Why the kernels cannot serve this CPU (None: they built and passed `self_check`)."""
    return built_and_checked(self_check)


def hostile_rows(generator: torch.Generator) -> torch.Tensor:
    """Rows that break naive kernels: NaN, +-inf, ties (within and across blocks), all equal, huge values."""
    rows = torch.randn(9, 3000, generator=generator)
    rows[0, 2500] = rows[0, 40] = math.nan      # NaN counts as the largest, the first one wins
    rows[1] = -math.inf                         # nothing allowed: index 0, logprobs NaN (as torch)
    rows[2, 2999] = math.inf                    # +inf: its index, logprobs NaN (as torch)
    rows[3] = 0.25                              # all equal: index 0, log(1 / n)
    rows[4, 7] = rows[4, 2050] = 60.0           # a tie across blocks: the first
    rows[5, :2000] = -math.inf                  # masked out (a grammar): the rest decides
    rows[6, 1100], rows[6, 5] = 1e30, -1e30     # huge finite values
    rows[7, 1024] = rows[7, 1023] = 50.0        # a tie on a block edge
    rows[8, ::2] = -math.inf
    return rows


def self_check() -> str | None:
    """Both kernels against the float64 references on odd widths, strided rows, the threaded path and
    `hostile_rows`; None when they agree."""
    generator = torch.Generator().manual_seed(0)
    cases = [torch.randn(rows, n, generator=generator) * 4 for rows, n in ((1, 1), (3, 17), (5, 1023), (2, 3001))]
    cases.append((torch.randn(40, 30000, generator=generator) * 4)[:, 5:29000])   # strided rows, threaded
    cases.append(hostile_rows(generator))
    for scores in cases:
        shape = f"[{scores.shape[0]}, {scores.shape[1]}]"
        for logprobs in (True, False):
            ids, chosen = greedy(scores, logprobs)
            want_ids, want = greedy_reference(scores.double(), logprobs)
            if not torch.equal(ids, want_ids):
                return f"greedy ids disagree with torch.argmax on {shape}"
            if not torch.allclose(chosen.double(), want, rtol=RTOL, atol=ATOL, equal_nan=True):
                return f"greedy logprobs disagree with the float64 log_softmax on {shape}"
        full = log_softmax(scores)
        if not torch.allclose(full.double(), log_softmax_reference(scores.double()), rtol=RTOL, atol=ATOL,
                              equal_nan=True):
            return f"log_softmax disagrees with the float64 log_softmax on {shape}"
        at_argmax = full.gather(1, want_ids[:, None]).squeeze(1)
        if not torch.allclose(at_argmax, greedy(scores, True)[1], rtol=0, atol=0, equal_nan=True):
            return f"greedy logprobs are not log_softmax's at the argmax, bit for bit, on {shape}"
        if (problem := _check_sample(scores, generator)) is not None:
            return f"sample: {problem} on {shape}"
    return None


def _check_sample(scores: torch.Tensor, generator: torch.Generator) -> str | None:
    """`sample` against `sample_reference` on finite rows (ids equal unless the target lies within 1e-5 of a
    boundary), its logprobs bit for bit log_softmax's of scores / temps at its ids; hostile rows give their
    argmax (as `greedy`) and a NaN logprob."""
    rows = scores.shape[0]
    temps = torch.rand(rows, generator=generator) * 1.5 + 0.25
    uniforms = torch.rand(rows, generator=generator, dtype=torch.float64)
    ids, chosen = sample(scores, temps, uniforms)
    finite = torch.isfinite(scores).any(dim=-1) & ~torch.isnan(scores).any(dim=-1) & ~(scores == math.inf).any(dim=-1)
    want_ids, want, margin = sample_reference(scores.double(), temps.double(), uniforms)
    if not torch.equal(ids[finite], want_ids[finite]) and bool(((ids != want_ids) & finite & (margin > 1e-5)).any()):
        return "ids disagree with the float64 inverse CDF"
    if not torch.allclose(chosen[finite].double(), want[finite], rtol=RTOL, atol=ATOL):
        return "logprobs disagree with the float64 log_softmax"
    scaled = scores / temps[:, None]
    at_ids = log_softmax(scaled).gather(1, ids[:, None]).squeeze(1)
    if not torch.allclose(at_ids[finite], chosen[finite], rtol=0, atol=0):
        return "logprobs are not log_softmax's of scores / temps at the ids, bit for bit"
    odd = ~finite
    if odd.any() and (not torch.equal(ids[odd], greedy(scaled, False)[0][odd]) or not chosen[odd].isnan().all()):
        return "a row with a NaN, a +inf or nothing finite does not give its argmax and a NaN logprob"
    return None

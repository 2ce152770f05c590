"""Fused CPU element-wise kernels of the decoder layer, float32 and bfloat16: residual add + RMSNorm, RoPE in place,
SiLU-and-mul. In bfloat16 they compute in float32 and round where eager's ops would (the residual sum, the normalized
value, each RoPE product, SiLU), so a bfloat16 model's layers give what its torch ops give, to about one bfloat16 step.

Eager torch runs each of these as 3-9 separate ops, each a pass over memory and a dispatch: at a
4,096-token prefill of SmolLM2 they cost ~60 ms a layer on one core against ~300 ms of GEMMs, at a
16-row decode step ~0.1 ms a layer. One pass in C++ (no torch headers, engine/kernels/cpp_build.py)
reads and writes each value once; rows are spread over OpenMP threads only when there are enough of
them to pay for waking the threads.

References (the exact formulas the kernels follow) are the torch paths they replace:
RMSNorm.norm / RMSNorm.forward (engine/layers/layernorm.py), RotaryEmbedding.forward
(engine/layers/rotary_embedding.py), SiluAndMul.forward (engine/layers/activation.py). Results agree to
float32 rounding (sums are taken in another order; exp is a Cephes polynomial). `self_check` runs every
kernel against those references at start-up; `install` turns the fused paths on in a model's layers.
"""
from __future__ import annotations

import ctypes
import logging

import torch

from engine.kernels import choice
from engine.kernels.cpp_build import Library, built_and_checked, compiler
from engine.kernels.cpu_simd import BFLOAT16, VECTORS

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

// parallel only when the work pays for waking the threads (a decode step's rows do not)
constexpr int64_t PARALLEL_MIN = 1 << 15;

""" + VECTORS + r"""
""" + BFLOAT16 + r"""
// element access as float for T = float or bfloat16 (uint16_t), and a value rounded as T would store it: eager
// bfloat16 rounds the result of every op, so the kernels round where its ops end and compute in float between
inline float get(const float* p, int64_t i) { return p[i]; }
inline float get(const uint16_t* p, int64_t i) { return widen(p[i]); }
inline void put(float* p, int64_t i, float v) { p[i] = v; }
inline void put(uint16_t* p, int64_t i, float v) { p[i] = narrow(v); }
inline float as_t(float v, const float*) { return v; }
inline float as_t(float v, const uint16_t*) { return widen(narrow(v)); }
inline f16x vget(const float* p) { return load16(p); }
inline f16x vget(const uint16_t* p) { return widen16(p); }
inline void vput(float* p, f16x x) { store16(p, x); }
inline void vput(uint16_t* p, f16x x) { *reinterpret_cast<u16x*>(p) = narrow16(x); }
inline f16x vas_t(f16x x, const float*) { return x; }
inline f16x vas_t(f16x x, const uint16_t*) { return widen16(narrow16(x)); }

// y = x * rsqrt(mean(x^2) + eps) * w over rows of n; with r: x + r first, written to sum_out
template <typename T>
void add_rms_norm(const T* x, int64_t x_stride, const T* r, int64_t r_stride, const T* w, T* y, T* sum_out,
                  int64_t rows, int64_t n, double eps, int threads) {
  const float e = static_cast<float>(eps);
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN)
  for (int64_t i = 0; i < rows; ++i) {
    const T* src = x + i * x_stride;
    if (r != nullptr) {
      const T* ri = r + i * r_stride;
      T* si = sum_out + i * n;
#pragma omp simd
      for (int64_t d = 0; d < n; ++d) put(si, d, get(src, d) + get(ri, d));
      src = si;
    }
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < n; ++d) {
      const float v = get(src, d);
      ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + e);
    T* yi = y + i * n;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) put(yi, d, as_t(get(src, d) * inv, yi) * get(w, d));
  }
}

// x [rows, heads, dim] (strides row_stride, head_stride; dim contiguous), its first `rot` channels rotated in
// place: out = x * cos + rotate_half(x) * sin, with float cos/sin rows [rows, rot] (sin's first half negated)
template <typename T>
void rope(T* x, int64_t rows, int64_t heads, int64_t row_stride, int64_t head_stride, int64_t rot, const float* cos,
          const float* sin, int64_t table_stride, int threads) {
  const int64_t half = rot / 2;
#pragma omp parallel for num_threads(threads) if (rows * heads * rot >= PARALLEL_MIN)
  for (int64_t i = 0; i < rows; ++i) {
    const float* c = cos + i * table_stride;
    const float* s = sin + i * table_stride;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + i * row_stride + h * head_stride;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float a = get(v, j), b = get(v, j + half);
        // eager's addcmul(x * cos, rotate_half(x), sin) with the tables cast to T (`cos.to(x.dtype)`): the first
        // product rounded as T, the second summed unrounded
        const float c0 = as_t(c[j], v), c1 = as_t(c[j + half], v), s0 = as_t(s[j], v), s1 = as_t(s[j + half], v);
        put(v, j, as_t(a * c0, v) + b * s0);
        put(v, j + half, as_t(b * c1, v) + a * s1);
      }
    }
  }
}

// out [rows, n] = silu(gate) * up, x [rows, 2n] = [gate | up] (row stride x_stride)
template <typename T>
void silu_and_mul(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN)
  for (int64_t i = 0; i < rows; ++i) {
    const T* g = x + i * x_stride;
    const T* u = g + n;
    T* o = out + i * n;
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
      const f16x gv = vget(g + d), uv = vget(u + d);
      vput(o + d, vas_t(gv / (1.0f + exp16(-gv)), o) * uv);
    }
    for (; d < n; ++d) {
      const float gd = get(g, d);
      put(o, d, as_t(gd / (1.0f + exp1(-gd)), o) * get(u, d));
    }
  }
}

}  // namespace

// float32 (the fused decode step calls these by address) and bfloat16 (uint16_t bit patterns) entry points
extern "C" void tgi_add_rms_norm(const float* x, int64_t x_stride, const float* r, int64_t r_stride,
                                 const float* w, float* y, float* sum_out, int64_t rows, int64_t n, double eps,
                                 int threads) {
  add_rms_norm(x, x_stride, r, r_stride, w, y, sum_out, rows, n, eps, threads);
}
extern "C" void tgi_add_rms_norm_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* r, int64_t r_stride,
                                      const uint16_t* w, uint16_t* y, uint16_t* sum_out, int64_t rows, int64_t n,
                                      double eps, int threads) {
  add_rms_norm(x, x_stride, r, r_stride, w, y, sum_out, rows, n, eps, threads);
}
extern "C" void tgi_rope(float* x, int64_t rows, int64_t heads, int64_t row_stride, int64_t head_stride, int64_t rot,
                         const float* cos, const float* sin, int64_t table_stride, int threads) {
  rope(x, rows, heads, row_stride, head_stride, rot, cos, sin, table_stride, threads);
}
extern "C" void tgi_rope_bf16(uint16_t* x, int64_t rows, int64_t heads, int64_t row_stride, int64_t head_stride,
                              int64_t rot, const float* cos, const float* sin, int64_t table_stride, int threads) {
  rope(x, rows, heads, row_stride, head_stride, rot, cos, sin, table_stride, threads);
}
extern "C" void tgi_silu_and_mul(const float* x, int64_t x_stride, float* out, int64_t rows, int64_t n,
                                 int threads) {
  silu_and_mul(x, x_stride, out, rows, n, threads);
}
extern "C" void tgi_silu_and_mul_bf16(const uint16_t* x, int64_t x_stride, uint16_t* out, int64_t rows, int64_t n,
                                      int threads) {
  silu_and_mul(x, x_stride, out, rows, n, threads);
}
"""


_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "tgi_add_rms_norm": (None, [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, ctypes.c_double, _INT]),
    "tgi_rope": (None, [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _I64, _INT]),
    "tgi_silu_and_mul": (None, [_P, _I64, _P, _I64, _I64, _INT]),
}
_LIBRARY = Library("cpu_elementwise", SOURCE,
                   {**_SIGNATURES, **{f"{name}_bf16": sig for name, sig in _SIGNATURES.items()}}, logger)
DTYPES = (torch.float32, torch.bfloat16)    # what the kernels take (activations and weights of one dtype)


def _kernel(name: str, dtype: torch.dtype):
    library = load()
    return getattr(library, name if dtype == torch.float32 else f"{name}_bf16")


def load() -> ctypes.CDLL:
    """The compiled kernel: built once per CPU type and compiler into the cache, loaded once per process."""
    return _LIBRARY.load()


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _rows(x: torch.Tensor) -> bool:
    """x is [..., n] with contiguous last dim and rows evenly strided (any 2-D view of contiguous rows)."""
    return x.dim() == 2 and x.stride(1) == 1


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm.forward in one pass: norm(x), or (norm(x + residual), x + residual)."""
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n)
    if not _rows(x2):
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype)
    summed, r2 = None, None
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if not _rows(r2):
            r2 = r2.contiguous()
        summed = torch.empty(x2.shape, dtype=x.dtype)
    assert x.dtype in DTYPES and weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
    _kernel("tgi_add_rms_norm", x.dtype)(x2.data_ptr(), x2.stride(0), None if r2 is None else r2.data_ptr(),
                            0 if r2 is None else r2.stride(0), weight.data_ptr(), out.data_ptr(),
                            None if summed is None else summed.data_ptr(), x2.shape[0], n, eps, _threads())
    if summed is None:
        return out.view(shape)
    return out.view(shape), summed.view(shape)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] in place by its rows of cos/sin [T, 1 or absent, rot] (float32: a bfloat16
    model's tables widened, exactly); returns x."""
    rot = cos.shape[-1]
    assert x.stride(2) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
    assert x.dtype in DTYPES and cos.dtype == sin.dtype == torch.float32
    _kernel("tgi_rope", x.dtype)(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), x.stride(1), rot, cos.data_ptr(),
                    sin.data_ptr(), cos.stride(0), _threads())
    return x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiluAndMul.forward: silu(gate) * up of x [..., 2n] = [gate | up]."""
    shape, n = x.shape, x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    if not _rows(x2):
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype)
    assert x.dtype in DTYPES
    _kernel("tgi_silu_and_mul", x.dtype)(x2.data_ptr(), x2.stride(0), out.data_ptr(), x2.shape[0], n, _threads())
    return out.view(*shape[:-1], n)


def choose(wanted: str, device: torch.device, dtype: torch.dtype) -> str:
    """'fused' or 'aten' for this device and dtype; raises when `wanted` cannot be honoured."""
    return choice.choose(wanted, "fused", "aten", lambda: unusable_reason(device, dtype),
                         what="CPU element-wise backend", flag="--cpu-elementwise", device=device)


def unusable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the fused kernels cannot serve this device and dtype (None: they can, and passed self_check)."""
    if device.type != "cpu":
        return f"device is {device.type}"
    if dtype not in DTYPES:
        return f"dtype {dtype} (the fused kernels cover float32 and bfloat16)"
    return built_and_checked(self_check)


# how close each kernel must come to the torch formula it replaces: float32 to rounding; bfloat16 to about one bfloat16
# step (both round where eager's ops end, but sums run in another order and exp is a polynomial)
CHECK_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def self_check() -> str | None:
    """Each kernel against the torch formula it replaces, in float32 and bfloat16, on odd shapes and strided views;
    None when all agree."""
    from engine.layers.activation import SiluAndMul
    from engine.layers.layernorm import RMSNorm
    from engine.layers.rotary_embedding import RotaryEmbedding

    generator = torch.Generator().manual_seed(0)
    for dtype, tol in CHECK_TOLERANCE.items():
        what = "" if dtype == torch.float32 else " (bfloat16)"
        for rows in (1, 3, 600):  # 600 x 100 rows go through the threaded path
            x = (torch.randn(rows, 100, generator=generator) * 3).to(dtype)
            residual = torch.randn(rows, 100, generator=generator).to(dtype)
            norm = RMSNorm(100, 1e-5)
            norm.weight.data.uniform_(0.5, 1.5, generator=generator)
            norm = norm.to(dtype)
            want, want_sum = norm(x, residual)
            got, got_sum = add_rms_norm(x, residual, norm.weight, 1e-5)
            if not (torch.allclose(got, want, atol=tol, rtol=tol) and torch.equal(got_sum, want_sum)):
                return f"add + RMSNorm disagrees with RMSNorm{what}"
            if not torch.allclose(add_rms_norm(x, None, norm.weight, 1e-5), norm(x), atol=tol, rtol=tol):
                return f"RMSNorm disagrees with RMSNorm{what}"
            rope = RotaryEmbedding(16, 1024, 10000.0, rotary_dim=12).to(dtype)
            qkv = torch.randn(rows, 7 * 16, generator=generator).to(dtype)
            q, k = qkv[:, :64].view(rows, 4, 16), qkv[:, 64:96].view(rows, 2, 16)
            positions = torch.randint(0, 1024, (rows,), generator=generator)
            want_q, want_k = rope(positions, q, k)
            cos, sin = rope.cos[positions].float(), rope.sin[positions].float()
            got_q, got_k = rope_(q.clone(), cos, sin), rope_(k.clone(), cos, sin)
            if not (torch.allclose(got_q, want_q, atol=tol, rtol=tol) and torch.allclose(got_k, want_k, atol=tol,
                                                                                          rtol=tol)):
                return f"RoPE disagrees with RotaryEmbedding{what}"
            gate_up = (torch.randn(rows, 2 * 50, generator=generator) * 4).to(dtype)
            if not torch.allclose(silu_and_mul(gate_up), SiluAndMul()(gate_up.clone()), atol=tol, rtol=tol):
                return f"SiLU-and-mul disagrees with SiluAndMul{what}"
    return None


def install(model: torch.nn.Module) -> int:
    """Turn the fused paths on in `model`'s RMSNorm, RotaryEmbedding and SiluAndMul modules (exact classes)."""
    return choice.install_fused(model, "fused_cpu")

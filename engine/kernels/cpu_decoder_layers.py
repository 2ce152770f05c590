"""The layers of a Llama-layout decoder for one decode step on CPU, float32, in one C++ call.

Why: at a decode step of a small model on CPU, the Python between the kernels is a sixth of the step
(scripts/profile_modules.py: ~9 ms of 54 at 16 rows of SmolLM2: module calls, wrappers, ctypes argument
conversion, ideep's per-call set-up), while the second core waits. This loop runs every layer's kernels
back to back with no Python in between: the fused norms, RoPE and SiLU-and-mul (engine/kernels/cpu_elementwise.py),
the paged decode attention (engine/kernels/cpu_attention.py) and the few-row linears (engine/kernels/cpu_gemv.py),
all called by address, plus the KV write. Per layer, as DecoderLayer + DecoderAttention + DecoderMLP in
engine/models/decoder.py with the pre-norm layout:

    x, residual = add_rms_norm(h, residual)          (layer 0: residual = h, x = rms_norm(h))
    q | k | v = x Wqkv^T (+ b);  RoPE on q and k;  k, v -> their cache slots
    a = paged_attention(q, cache);  h = a Wo^T (+ b)
    x, residual = add_rms_norm(h, residual);  h = silu_and_mul(x Wgu^T (+ b)) Wdown^T (+ b)

and at the end rms_norm(h + residual) with the final norm's weight. No torch headers: plain C++ built by
engine/kernels/cpp_build.py. engine/cpu_decode_step.py decides when it runs and checks it against the eager
forward at start-up.
"""
from __future__ import annotations

import ctypes
import logging

from engine.kernels.cpp_build import Library
from engine.kernels.cpu_simd import BFLOAT16, VECTORS

logger = logging.getLogger(__name__)

# the pointers of one layer in the table `tgi_decoder_layers` reads (`weights + l * 12`), in this order
FIELDS = ("input_norm", "qkv_weight", "qkv_bias", "o_weight", "o_bias", "post_norm", "gate_up_weight",
          "gate_up_bias", "down_weight", "down_bias", "k_cache", "v_cache")
# the kernels it calls, by the name of their C function, in the order of its `kernels` table
KERNELS = ("tgi_add_rms_norm", "tgi_rope", "tgi_silu_and_mul", "tgi_paged_attention", "tgi_gemv")

SOURCE = r"""
#include <cstdint>
#include <cstring>
#include <utility>

namespace {
""" + VECTORS + BFLOAT16 + r"""
}  // namespace

typedef void (*norm_fn)(const float*, int64_t, const float*, int64_t, const float*, float*, float*, int64_t, int64_t,
                        double, int);
typedef void (*rope_fn)(float*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, const float*, int64_t, int);
typedef void (*silu_fn)(const float*, int64_t, float*, int64_t, int64_t, int);
typedef int (*attention_fn)(int, void*, const void*, int64_t, int64_t, const void*, const void*, const int32_t*,
                            int64_t, const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t,
                            double, int64_t, int);
typedef void (*gemv_fn)(const float*, int64_t, int64_t, const float*, const float*, int64_t, int64_t, float*, int64_t,
                        int);

struct Shape {
  int64_t rows, hidden, layers, heads, kv_heads, head_dim, rot, inter;
  int64_t kv_bf16;  // 1: the K/V caches hold bfloat16 (a bfloat16 model); the step itself runs in float32
};

// the new tokens' k and v rows into their cache slots, in the cache's type
inline void store_kv(void* cache, int64_t slot, const float* src, int64_t n, bool bf16) {
  if (!bf16) {
    std::memcpy(static_cast<float*>(cache) + slot * n, src, sizeof(float) * n);
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(cache) + slot * n;
  for (int64_t i = 0; i < n; ++i) dst[i] = narrow(src[i]);
}

struct Step {
  const int64_t* slots;                       // [rows] cache slot of each row's new token
  const float* cos; const float* sin;         // [rows, rot] at the rows' positions
  const int32_t* work; int64_t items;         // the attention's work items [items, 4]
  const int32_t* tables; int64_t table_stride, block_size;
  double eps, scale;
};

// buffers, float32: x, res_a, res_b [rows, hidden]; qkv [rows, (heads + 2 kv) d]; attn [rows, heads d];
// h [rows, hidden]; gate_up [rows, 2 inter]; act [rows, inter]
extern "C" int tgi_decoder_layers(const Shape* s, const Step* st, const int64_t* weights, const float* final_norm,
                                  float* h, float* x, float* res_a, float* res_b, float* qkv, float* attn,
                                  float* gate_up, float* act, const int64_t* kernels, int threads) {
  const norm_fn norm = reinterpret_cast<norm_fn>(kernels[0]);
  const rope_fn rope = reinterpret_cast<rope_fn>(kernels[1]);
  const silu_fn silu = reinterpret_cast<silu_fn>(kernels[2]);
  const attention_fn attention = reinterpret_cast<attention_fn>(kernels[3]);
  const gemv_fn gemv = reinterpret_cast<gemv_fn>(kernels[4]);
  const int64_t B = s->rows, E = s->hidden, D = s->head_dim;
  const int64_t q_size = s->heads * D, kv_size = s->kv_heads * D, qkv_n = q_size + 2 * kv_size;
  float* res = res_a;    // the residual stream
  float* spare = res_b;  // where the next add writes it
  for (int64_t l = 0; l < s->layers; ++l) {
    const int64_t* p = weights + l * 12;
#define TGI_W(i) reinterpret_cast<const float*>(p[i])
    if (l == 0) {
      std::memcpy(res, h, sizeof(float) * B * E);
      norm(h, E, nullptr, 0, TGI_W(0), x, nullptr, B, E, st->eps, threads);
    } else {
      norm(h, E, res, E, TGI_W(0), x, spare, B, E, st->eps, threads);
      std::swap(res, spare);
    }
    gemv(x, E, B, TGI_W(1), TGI_W(2), qkv_n, E, qkv, qkv_n, threads);
    rope(qkv, B, s->heads, qkv_n, D, s->rot, st->cos, st->sin, s->rot, threads);
    rope(qkv + q_size, B, s->kv_heads, qkv_n, D, s->rot, st->cos, st->sin, s->rot, threads);
    void* k_cache = reinterpret_cast<void*>(p[10]);
    void* v_cache = reinterpret_cast<void*>(p[11]);
    for (int64_t b = 0; b < B; ++b) {
      store_kv(k_cache, st->slots[b], qkv + b * qkv_n + q_size, kv_size, s->kv_bf16);
      store_kv(v_cache, st->slots[b], qkv + b * qkv_n + q_size + kv_size, kv_size, s->kv_bf16);
    }
    // dtype 0: float32 everywhere; 3: float32 queries and output over bfloat16 caches (engine/kernels/cpu_attention.py)
    if (attention(s->kv_bf16 ? 3 : 0, attn, qkv, qkv_n, D, k_cache, v_cache, st->work, st->items, st->tables,
                  st->table_stride, st->block_size, s->kv_heads, s->heads / s->kv_heads, D, st->scale, 0, 0.0, 0,
                  threads) != 0)
      return 1;
    gemv(attn, q_size, B, TGI_W(3), TGI_W(4), E, q_size, h, E, threads);
    norm(h, E, res, E, TGI_W(5), x, spare, B, E, st->eps, threads);
    std::swap(res, spare);
    gemv(x, E, B, TGI_W(6), TGI_W(7), 2 * s->inter, E, gate_up, 2 * s->inter, threads);
    silu(gate_up, 2 * s->inter, act, B, s->inter, threads);
    gemv(act, s->inter, B, TGI_W(8), TGI_W(9), E, s->inter, h, E, threads);
#undef TGI_W
  }
  norm(h, E, res, E, final_norm, x, spare, B, E, st->eps, threads);  // the model's output: in x
  return 0;
}
"""


class Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in
                ("rows", "hidden", "layers", "heads", "kv_heads", "head_dim", "rot", "inter", "kv_bf16")]


class Step(ctypes.Structure):
    _fields_ = [("slots", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("work", ctypes.c_void_p), ("items", ctypes.c_int64), ("tables", ctypes.c_void_p),
                ("table_stride", ctypes.c_int64), ("block_size", ctypes.c_int64), ("eps", ctypes.c_double),
                ("scale", ctypes.c_double)]


_P = ctypes.c_void_p
_LIBRARY = Library("cpu_decoder_layers", SOURCE, {
    "tgi_decoder_layers": (ctypes.c_int, [ctypes.POINTER(Shape), ctypes.POINTER(Step), *[_P] * 11, ctypes.c_int]),
}, logger)


def load() -> ctypes.CDLL:
    """The compiled loop: built once per CPU type and compiler into the cache, loaded once per process."""
    return _LIBRARY.load()

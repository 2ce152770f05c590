"""C++ vector helpers shared by the CPU kernels (cpu_attention.py, cpu_prefill_attention.py, cpu_elementwise.py,
cpu_log_softmax.py, cpu_gemv.py), and the bfloat16 conversions of those that store bfloat16 as its bit pattern
(BFLOAT16: cpu_elementwise.py, cpu_gemv.py, cpu_decoder_layers.py; after VECTORS).

GCC vector extensions, not intrinsics: the same source builds for AVX-512, AVX2 or SSE, as `-march=native`
allows. Pasted into each kernel's source inside its anonymous namespace.
"""

VECTORS = r"""
// 16 floats, loaded unaligned; gcc lowers it to one zmm, two ymm or four xmm registers as -march allows
typedef float f16x __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16x __attribute__((vector_size(64), aligned(4)));
typedef float f4x __attribute__((vector_size(16), aligned(4)));
inline f16x load16(const float* p) { return *reinterpret_cast<const f16x*>(p); }
// the target's own vector: 16 floats (one zmm) with AVX-512, else 8 (one ymm with AVX2; older CPUs split it).
// Kernels that keep arrays of accumulators use it: gcc keeps an array of f16x in ymm registers poorly without
// AVX-512 (stack round trips on every FMA; cpu_gemv.py's 16-row linears ran 12x slower than oneDNN on an AVX2 VM)
#if defined(__AVX512F__)
typedef float fnv __attribute__((vector_size(64), aligned(4)));
#else
typedef float fnv __attribute__((vector_size(32), aligned(4)));
#endif
typedef uint32_t unv __attribute__((vector_size(sizeof(fnv)), aligned(4)));
constexpr int NV = sizeof(fnv) / sizeof(float);  // lanes of fnv
constexpr int PER16 = 16 / NV;                   // fnv vectors in 16 floats
inline fnv loadnv(const float* p) { return *reinterpret_cast<const fnv*>(p); }
inline i16x load16i(const int32_t* p) { return *reinterpret_cast<const i16x*>(p); }
inline void store16(float* p, f16x x) { *reinterpret_cast<f16x*>(p) = x; }

// exp on 16 lanes (Cephes' polynomial), x clamped to [-87, 88] so that any x stays finite: -inf gives ~1e-38, not 0.
// In vector extensions because gcc does not vectorize a scalar form's floor and bit cast in a loop
inline f16x exp16(f16x x) {
  x = x < -87.0f ? f16x{} - 87.0f : x;
  x = x > 88.0f ? f16x{} + 88.0f : x;
  const f16x y = x * 1.44269504088896341f + 0.5f;
  f16x n = __builtin_convertvector(__builtin_convertvector(y, i16x), f16x);  // toward zero
  n = n > y ? n - 1.0f : n;                                                  // floor
  const f16x r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f16x p = f16x{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i16x bits = (__builtin_convertvector(n, i16x) + 127) << 23;
  return p * reinterpret_cast<const f16x&>(bits);
}

// exp16 of one float (loop tails)
inline float exp1(float x) {
  f16x v = {};
  v[0] = x;
  return exp16(v)[0];
}

// the sums of the 16 lanes of a0, a1, a2 and a3, in one 4-lane vector: a transpose-and-add tree (12 shuffles and
// adds for the four, where one sum alone takes 6)
inline f4x hsum4(f16x a0, f16x a1, f16x a2, f16x a3) {
  const f16x x = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
               + __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const f16x y = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
               + __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  f16x z = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
         + __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  z += __builtin_shufflevector(z, z, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  z += __builtin_shufflevector(z, z, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return __builtin_shufflevector(z, z, 0, 4, 8, 12);
}

// the sum of the 16 lanes: a tree (gcc's own reduction ends in 16 dependent scalar adds)
inline float hsum(f16x a) {
  a += __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  return a[0] + a[1];
}

// hsum4 and hsum at the native width
#if defined(__AVX512F__)
inline f4x hsum4nv(fnv a0, fnv a1, fnv a2, fnv a3) { return hsum4(a0, a1, a2, a3); }
inline float hsumnv(fnv a) { return hsum(a); }
#else
inline f4x hsum4nv(fnv a0, fnv a1, fnv a2, fnv a3) {
  const fnv x = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11)
              + __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
  const fnv y = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11)
              + __builtin_shufflevector(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
  const fnv z = __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13)
              + __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(z, z, 0, 2, 4, 6) + __builtin_shufflevector(z, z, 1, 3, 5, 7);
}
inline float hsumnv(fnv a) {
  a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3);
  a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 2, 3, 0, 1);
  return a[0] + a[1];
}
#endif
"""

BFLOAT16 = r"""
// bfloat16 as its 16-bit pattern (uint16_t): widened to float exactly (its bits are the float's upper half), narrowed
// rounding to nearest even as torch's .to(torch.bfloat16) (NaN stays NaN)
typedef uint16_t u16x __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x __attribute__((vector_size(64), aligned(4)));
inline float widen(uint16_t b) { return __builtin_bit_cast(float, static_cast<uint32_t>(b) << 16); }
inline uint16_t narrow(float x) {
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline f16x widen16(u16x b) { return __builtin_bit_cast(f16x, __builtin_convertvector(b, u32x) << 16); }
inline f16x widen16(const uint16_t* p) { return widen16(*reinterpret_cast<const u16x*>(p)); }
inline u16x narrow16(f16x x) {
  const u32x u = __builtin_bit_cast(u32x, x);
  const u32x rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const u32x out = (u & 0x7fffffffu) > 0x7f800000u ? u32x{} + 0x7fc0u : rounded;
  return __builtin_convertvector(out, u16x);
}
"""

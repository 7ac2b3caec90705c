// Vector helpers shared by the CPU kernels (attention.cpp, elementwise.cpp, gemm.cpp,
// sampling.cpp): the SCHEDKIT_* macros that say what the build target (-march) has and
// which paths it builds, 8-wide GCC vectors, bfloat16 / float16 widened to float32 and
// float32 rounded back as torch rounds, and the 16-wide AVX-512 loads, stores and exp.
// Everything here has internal linkage: each kernel file gets its own copy, inlined
// where it is used, as when all the kernels were one file.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define SCHEDKIT_AVX512 1  // 16-wide item path (run_item_avx512)
#if defined(__AVX512BF16__)
#define SCHEDKIT_AVX512_BF16 1  // bfloat16 keys read in place by vdpbf16ps
#endif
#endif
#if defined(__FLT16_MAX__)
#define SCHEDKIT_HAVE_FLOAT16 1  // _Float16: GCC >= 12 / clang >= 15 on x86
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define SCHEDKIT_GEMM_AVX2 1  // gemm.cpp: several float32 rows (AVX-512 builds included)
#ifndef SCHEDKIT_AVX512
#define SCHEDKIT_GEMV_AVX2 1  // gemm.cpp: one float32 row in 8-wide halves
#endif
#endif

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }
inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// n values widened to float32
inline void widen(const uint16_t* src, int64_t n, float* dst) {  // bfloat16
  int64_t c = 0;
#if defined(__AVX512F__)
  for (; c + 16 <= n; c += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c));
    _mm512_storeu_si512(dst + c, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#endif
  for (; c + 8 <= n; c += 8) {
    v8u16 h;
    std::memcpy(&h, src + c, sizeof h);
    v8u32 w = __builtin_convertvector(h, v8u32) << 16;
    std::memcpy(dst + c, &w, sizeof w);
  }
  for (; c < n; ++c) {
    const uint32_t w = static_cast<uint32_t>(src[c]) << 16;
    std::memcpy(dst + c, &w, sizeof w);
  }
}
#ifdef SCHEDKIT_HAVE_FLOAT16
inline void widen(const _Float16* src, int64_t n, float* dst) {
  for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<float>(src[c]);
}
#endif

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch's .to(bfloat16)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline void store_as(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_as(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i + 16 <= n; i += 16)  // the same rounding (nearest even, NaN kept quiet)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
  for (; i < n; ++i) dst[i] = to_bf16(src[i]);
}
#ifdef SCHEDKIT_HAVE_FLOAT16
inline void store_as(_Float16* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<_Float16>(src[i]);
}
#endif

// n float32 values written to dst in dtype (0 float32, 1 bfloat16)
inline void store_row(void* dst, int dtype, int64_t offset, const float* src, int64_t n) {
  if (dtype == 0)
    store_as(static_cast<float*>(dst) + offset, src, n);
  else
    store_as(static_cast<uint16_t*>(dst) + offset, src, n);
}

inline float round_bf16(float f) {
  const uint32_t w = static_cast<uint32_t>(to_bf16(f)) << 16;
  float r;
  std::memcpy(&r, &w, sizeof r);
  return r;
}

#ifdef SCHEDKIT_AVX512
// exp of 16 floats as 2^n * p(r): r = x - n ln2 in [-ln2/2, ln2/2] (ln2 in two parts),
// p the Taylor polynomial of exp of degree kDegree (7: relative error below 2e-7, as
// std::exp's float result to about an ulp; 4: below 5e-5, about a fortieth of bfloat16's
// rounding step, for values rounded to bfloat16 next: the tiles' P).
template <int kDegree>
inline __m512 exp16_deg(__m512 x) {
  static_assert(kDegree >= 2 && kDegree <= 7);
  constexpr float kInvFactorial[8] = {1.0f, 1.0f, 0.5f, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720, 1.0f / 5040};
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 y = _mm512_set1_ps(kInvFactorial[kDegree]);
  for (int k = kDegree - 1; k >= 0; --k) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kInvFactorial[k]));
  return _mm512_scalef_ps(y, n);
}
inline __m512 exp16(__m512 x) { return exp16_deg<7>(x); }
inline __m512 exp16_bf16(__m512 x) { return exp16_deg<4>(x); }

inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 widened
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
#ifdef SCHEDKIT_AVX512_BF16
inline __m256i to_bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
inline __m256i to_bf16x16(__m512 v) {  // round to nearest even (finite values)
  __m512i u = _mm512_castps_si512(v);
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                           _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}
#endif
inline __m512 round16(__m512 v) {  // to bfloat16 and back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(v)), 16));
}
inline void store16(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16x16(v)); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
#endif

}  // namespace

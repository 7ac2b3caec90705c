// Row-wise kernels between the matmuls: RMSNorm (with the residual add) and SiLU-and-mul.
// (RoPE is fused into attention.cpp's per-layer call.)
//
// Activations are float32 (dtype 0) or bfloat16 (1); arithmetic is float32. With
// bfloat16, results are rounded where a bfloat16 model in torch rounds them (after each
// op), so that greedy decisions follow transformers' bfloat16 ones.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

#ifdef SCHEDKIT_AVX512
// One row of schedkit_add_rms_norm, 16 columns at a time (dim % 16 == 0). T: the
// activations' type; bfloat16 rounds the sum and the normalised row as torch does.
template <typename T>
void add_rms_norm_row(const T* x, T* res, const float* weight, T* out, int64_t dim, float eps, float* sum) {
  constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    __m512 v = load16(x + i);
    if (res) {
      v = _mm512_add_ps(v, load16(res + i));
      if constexpr (kBf16) v = round16(v);
      store16(res + i, v);
    }
    _mm512_storeu_ps(sum + i, v);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(dim) + eps));
  for (int64_t i = 0; i < dim; i += 16) {
    __m512 n = _mm512_mul_ps(_mm512_loadu_ps(sum + i), inv);
    if constexpr (kBf16) n = round16(n);
    store16(out + i, _mm512_mul_ps(_mm512_loadu_ps(weight + i), n));
  }
}

// One row of schedkit_silu_and_mul, 16 columns at a time (dim % 16 == 0).
template <typename T>
void silu_and_mul_row(const T* g, const T* u, T* out, int64_t dim) {
  for (int64_t i = 0; i < dim; i += 16) {
    const __m512 gv = load16(g + i);
    const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), _mm512_set1_ps(80.0f)));
    __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    silu = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(gv, _mm512_set1_ps(-80.0f), _CMP_GE_OQ), silu);
    if constexpr (std::is_same_v<T, uint16_t>) silu = round16(silu);
    store16(out + i, _mm512_mul_ps(silu, load16(u + i)));
  }
}
#endif

}  // namespace

extern "C" {

// RMSNorm of each row: with `residual` (in x's dtype), first residual += x in place and
// normalise the sum; without, normalise x. out = weight * (row / sqrt(mean(row^2) + eps)),
// weight float32 (for a bfloat16 model, its values).
void schedkit_add_rms_norm(const void* x, int dtype, void* residual, const float* weight, void* out,
                           int64_t rows, int64_t dim, float eps, int num_threads) {
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, rows / 4 + 1)));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> wide(3 * dim);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
#ifdef SCHEDKIT_AVX512
      if (dim % 16 == 0) {
        if (dtype == 0)
          add_rms_norm_row(static_cast<const float*>(x) + r * dim,
                           residual ? static_cast<float*>(residual) + r * dim : nullptr, weight,
                           static_cast<float*>(out) + r * dim, dim, eps, wide.data());
        else
          add_rms_norm_row(static_cast<const uint16_t*>(x) + r * dim,
                           residual ? static_cast<uint16_t*>(residual) + r * dim : nullptr, weight,
                           static_cast<uint16_t*>(out) + r * dim, dim, eps, wide.data());
        continue;
      }
#endif
      float* src;
      if (dtype == 0) {
        src = const_cast<float*>(static_cast<const float*>(x)) + r * dim;
        if (residual) {
          float* res = static_cast<float*>(residual) + r * dim;
          for (int64_t i = 0; i < dim; ++i) res[i] += src[i];
          src = res;
        }
      } else {
        src = wide.data();
        widen(static_cast<const uint16_t*>(x) + r * dim, dim, src);
        if (residual) {
          uint16_t* res = static_cast<uint16_t*>(residual) + r * dim;
          float* other = wide.data() + dim;
          widen(res, dim, other);
          for (int64_t i = 0; i < dim; ++i) src[i] = round_bf16(src[i] + other[i]);
          store_as(res, src, dim);  // exact: already rounded
        }
      }
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < dim; ++i) ss += src[i] * src[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
      if (dtype == 0) {
        float* dst = static_cast<float*>(out) + r * dim;
        for (int64_t i = 0; i < dim; ++i) dst[i] = weight[i] * (src[i] * inv);
      } else {
        float* dst = wide.data() + 2 * dim;
        for (int64_t i = 0; i < dim; ++i) dst[i] = weight[i] * round_bf16(src[i] * inv);
        store_row(out, 1, r * dim, dst, dim);
      }
    }
  }
}

// out[r, i] = silu(x[r, i]) * x[r, dim + i] (the gate / up halves of one projection).
void schedkit_silu_and_mul(const void* x, int dtype, void* out, int64_t rows, int64_t dim, int num_threads) {
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, rows / 4 + 1)));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> wide(3 * dim);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
#ifdef SCHEDKIT_AVX512
      if (dim % 16 == 0) {
        if (dtype == 0) {
          const float* g = static_cast<const float*>(x) + r * 2 * dim;
          silu_and_mul_row(g, g + dim, static_cast<float*>(out) + r * dim, dim);
        } else {
          const uint16_t* g = static_cast<const uint16_t*>(x) + r * 2 * dim;
          silu_and_mul_row(g, g + dim, static_cast<uint16_t*>(out) + r * dim, dim);
        }
        continue;
      }
#endif
      const float* g;
      if (dtype == 0) {
        g = static_cast<const float*>(x) + r * 2 * dim;
      } else {
        widen(static_cast<const uint16_t*>(x) + r * 2 * dim, 2 * dim, wide.data());
        g = wide.data();
      }
      const float* u = g + dim;
      float* dst = dtype == 0 ? static_cast<float*>(out) + r * dim : wide.data() + 2 * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {  // below -80 silu is 0 to float precision; exp's
        // argument is clamped because 1 / inf is not 0 under -ffast-math
        const float e = std::exp(std::min(-g[i], 80.0f));
        dst[i] = (g[i] < -80.0f ? 0.0f : g[i] / (1.0f + e));
      }
      if (dtype == 0) {
        for (int64_t i = 0; i < dim; ++i) dst[i] *= u[i];
      } else {
        for (int64_t i = 0; i < dim; ++i) dst[i] = round_bf16(dst[i]) * u[i];
        store_row(out, 1, r * dim, dst, dim);
      }
    }
  }
}

}  // extern "C"

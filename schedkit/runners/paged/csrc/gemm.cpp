// The linear layers' GEMM on weights packed by schedkit.runners.paged.cpu_linear: one
// row (AVX-512, bfloat16 by vdpbf16ps, or AVX2) and several float32 rows (AVX2 tiles).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

// One activation row times a weight matrix (a decode step of one sequence): out[n] =
// sum_k x[k] * W[n, k] (+ bias[n]). At one row the product is bound by reading W, and
// oneDNN's matmul spends about 15 us a call before it starts; this loop streams W once,
// in the layout schedkit.runners.paged.cpu_linear packs it in:
//   float32:  [N / 16, K, 16]         (16 outputs' weights for each k, side by side)
//   bfloat16: [N / 16, K / 2, 16, 2]  (pairs along k, as vdpbf16ps takes them)
// Each iteration computes two blocks of 16 outputs half the matrix apart: two streams
// through memory keep more reads in flight than one (an LM head of 49,152 x 576 in
// bfloat16 on one core: 4.4 ms, against 5.6 with one stream and 4.8 by oneDNN), each
// prefetched 4 KB ahead into L2. Two accumulators per block break the dependency chain.
// Float32 arithmetic; a bfloat16 result is rounded to nearest even.

// The blocks of 16 outputs over the threads, two half the matrix apart per call of
// two_blocks(a, b); an odd last block alone (a == b).
template <typename F>
void gemv_split(int64_t blocks, int threads, F two_blocks) {
  const int64_t half = blocks / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < half + (blocks & 1); ++i) {
    if (i < half) two_blocks(i, i + half);
    else two_blocks(blocks - 1, blocks - 1);
  }
}

#ifdef SCHEDKIT_AVX512
template <typename T>
inline void gemv_store(T* o, const T* bias, int64_t block, __m512 acc) {
  if (bias != nullptr) acc = _mm512_add_ps(acc, load16(bias + block * 16));
  store16(o + block * 16, acc);
}

// One step of a block of 16 outputs: acc += x[k] * W[k] for one k (float32) or a pair
// of k (kPair: bfloat16, vdpbf16ps); w points at the block's packed weights.
template <typename T, bool kPair>
inline __m512 gemv_step(const T* x, const T* w, int64_t i, __m512 acc) {
  if constexpr (kPair) {
#ifdef SCHEDKIT_AVX512_BF16
    const __m512bh xi = (__m512bh)_mm512_broadcastss_ps(_mm_load_ss(reinterpret_cast<const float*>(x + 2 * i)));
    return _mm512_dpbf16_ps(acc, xi, (__m512bh)_mm512_loadu_si512(w + i * 32));
#else
    (void)x; (void)w; (void)i;
    return acc;
#endif
  } else {
    return _mm512_fmadd_ps(_mm512_set1_ps(x[i]), _mm512_loadu_ps(w + i * 16), acc);
  }
}

// Two blocks (a, b) of 16 outputs at once, two steps at a time.
template <typename T, bool kPair>
inline void gemv_two_blocks(const T* x, const T* w, int64_t K, int64_t a, int64_t b, const T* bias, T* o) {
  constexpr int64_t kStride = kPair ? 32 : 16;  // elements of W per step
  const T* wa = w + a * K * 16;
  const T* wb = w + b * K * 16;
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  const int64_t steps = kPair ? K / 2 : K;
  int64_t i = 0;
  for (; i + 2 <= steps; i += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(wa + i * kStride) + 4096, _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(wb + i * kStride) + 4096, _MM_HINT_T1);
    a0 = gemv_step<T, kPair>(x, wa, i, a0);
    a1 = gemv_step<T, kPair>(x, wa, i + 1, a1);
    b0 = gemv_step<T, kPair>(x, wb, i, b0);
    b1 = gemv_step<T, kPair>(x, wb, i + 1, b1);
  }
  if (i < steps) {  // an odd number of steps
    a0 = gemv_step<T, kPair>(x, wa, i, a0);
    b0 = gemv_step<T, kPair>(x, wb, i, b0);
  }
  gemv_store(o, bias, a, _mm512_add_ps(a0, a1));
  if (b != a) gemv_store(o, bias, b, _mm512_add_ps(b0, b1));
}

template <typename T, bool kPair>
void gemv_run(const T* x, const T* w, int64_t K, int64_t blocks, const T* bias, T* o, int threads) {
  gemv_split(blocks, threads, [&](int64_t a, int64_t b) { gemv_two_blocks<T, kPair>(x, w, K, a, b, bias, o); });
}
#elif defined(SCHEDKIT_GEMV_AVX2)
// float32 on AVX2: the same layout and the same two streams, each block of 16 outputs
// in two 8-wide halves, two accumulators per half (even and odd k).
inline void gemv_store8x2(float* o, const float* bias, int64_t block, v8f lo, v8f hi) {
  if (bias != nullptr) lo += load8(bias + block * 16), hi += load8(bias + block * 16 + 8);
  store8(o + block * 16, lo);
  store8(o + block * 16 + 8, hi);
}

inline void gemv_two_blocks_avx2(const float* x, const float* w, int64_t K, int64_t a, int64_t b,
                                 const float* bias, float* o) {
  const float* wa = w + a * K * 16;
  const float* wb = w + b * K * 16;
  v8f a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  int64_t i = 0;
  for (; i + 2 <= K; i += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(wa + i * 16) + 4096, _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(wb + i * 16) + 4096, _MM_HINT_T1);
    const float x0 = x[i], x1 = x[i + 1];
    const float* pa = wa + i * 16;
    const float* pb = wb + i * 16;
    a0 += x0 * load8(pa), a1 += x0 * load8(pa + 8), a2 += x1 * load8(pa + 16), a3 += x1 * load8(pa + 24);
    b0 += x0 * load8(pb), b1 += x0 * load8(pb + 8), b2 += x1 * load8(pb + 16), b3 += x1 * load8(pb + 24);
  }
  if (i < K) {  // an odd K
    a0 += x[i] * load8(wa + i * 16), a1 += x[i] * load8(wa + i * 16 + 8);
    b0 += x[i] * load8(wb + i * 16), b1 += x[i] * load8(wb + i * 16 + 8);
  }
  gemv_store8x2(o, bias, a, a0 + a2, a1 + a3);
  if (b != a) gemv_store8x2(o, bias, b, b0 + b2, b1 + b3);
}

void gemv_run_avx2(const float* x, const float* w, int64_t K, int64_t blocks, const float* bias, float* o,
                   int threads) {
  gemv_split(blocks, threads, [&](int64_t a, int64_t b) { gemv_two_blocks_avx2(x, w, K, a, b, bias, o); });
}

#endif

#ifdef SCHEDKIT_GEMM_AVX2
// Built wherever AVX2 and FMA are, AVX-512 builds included: whether it or oneDNN takes
// several rows on a given machine is decided at run time (cpu_linear.multi_row_gemm).

// Several rows (a prefill chunk, a decode batch) times the same packed float32 weight,
// out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]). oneDNN reaches 60-65% of this AVX2
// core's FMA peak at SmolLM2's shapes (128 x 576 x 3072: 106 GFLOP/s on two cores); a
// tile of 6 rows x 16 outputs keeps 12 accumulators in registers, each k step reading
// one row of the block's packed weights (two vectors) and broadcasting 6 activations.
// Blocking as in BLIS: the rows in panels of kGemmRowPanel, k in chunks of at most
// kGemmMaxChunk; each thread copies a panel's chunk of x into tiles of 6 rows interleaved
// along k (one stream from L2 instead of six), then for each of its 16-output blocks runs every tile
// over the block's weights of the chunk (from L2 at these sizes: at SmolLM2's K of 576
// one chunk of 36 KB per block was 4-19% faster than two that fit L1, as each extra
// chunk reads and writes the panel's outputs again). The blocks go to the threads in
// groups of kGemmGroup handed out as each thread finishes its last, so a thread that
// another process holds up on its core leaves its share to the others (on two Zen 3
// cores with a process busy 20% of the time on one: a 128-token prefill step of
// SmolLM2 220.5 instead of 232.8 ms; the same 174-175 ms on a quiet machine). Each
// output is still summed by one thread per chunk, the chunks in order: the same bits on
// any thread count.
constexpr int kGemmTileRows = 6;
constexpr int64_t kGemmGroup = 2;
constexpr int64_t kGemmRowPanel = 144;
constexpr int64_t kGemmMaxChunk = 768;

// R rows over k in [0, kc) of one block: xp the rows' packed chunk ([kc][R]), w the
// block's packed weights from the chunk's first k; the accumulators start at zero (first
// chunk) or from o; bias added on the last chunk.
template <int R>
inline void gemm_tile_avx2(const float* xp, const float* w, int64_t kc, float* o, int64_t ldo, bool first,
                           const float* bias, const float* next) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    lo[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o + r * ldo);
    hi[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o + r * ldo + 8);
  }
  for (int64_t k = 0; k < kc; ++k) {
    if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + k * 16), _MM_HINT_T0);
    const __m256 b0 = _mm256_loadu_ps(w + k * 16), b1 = _mm256_loadu_ps(w + k * 16 + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(xp + k * R + r);
      lo[r] = _mm256_fmadd_ps(a, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, b1, hi[r]);
    }
  }
  if (bias != nullptr) {
    const __m256 bl = _mm256_loadu_ps(bias), bh = _mm256_loadu_ps(bias + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) lo[r] = _mm256_add_ps(lo[r], bl), hi[r] = _mm256_add_ps(hi[r], bh);
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(o + r * ldo, lo[r]);
    _mm256_storeu_ps(o + r * ldo + 8, hi[r]);
  }
}

using GemmTile = void (*)(const float*, const float*, int64_t, float*, int64_t, bool, const float*, const float*);
constexpr GemmTile kGemmTiles[kGemmTileRows + 1] = {nullptr, gemm_tile_avx2<1>, gemm_tile_avx2<2>, gemm_tile_avx2<3>,
                                               gemm_tile_avx2<4>, gemm_tile_avx2<5>, gemm_tile_avx2<6>};

void gemm_run_avx2(const float* x, int64_t M, int64_t ldx, const float* w, int64_t K, int64_t blocks,
                   const float* bias, float* o, int threads) {
  const int64_t chunks = (K + kGemmMaxChunk - 1) / kGemmMaxChunk;
  const int64_t kc_max = (K + chunks - 1) / chunks;  // even chunks: 1536 -> 768 + 768
  // the panel's copy, shared by the threads, kept by the calling thread from call to call
  static thread_local std::vector<float> panel;
  if (panel.size() < static_cast<size_t>(std::min(M, kGemmRowPanel) * kc_max))
    panel.resize(static_cast<size_t>(std::min(M, kGemmRowPanel) * kc_max));
  float* const packed = panel.data();
#pragma omp parallel num_threads(threads)
  {
    const int64_t groups = (blocks + kGemmGroup - 1) / kGemmGroup;
    for (int64_t m0 = 0; m0 < M; m0 += kGemmRowPanel) {
      const int64_t m1 = std::min(M, m0 + kGemmRowPanel);
      for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
        const int64_t kc = std::min(kc_max, K - k0);
        const bool first = k0 == 0, last = k0 + kc == K;
#pragma omp barrier  // nobody still reads the last chunk's copy
#pragma omp for schedule(static)  // (its implicit barrier: the copy is whole before use)
        for (int64_t m = m0; m < m1; m += kGemmTileRows) {  // the tiles of the panel's chunk, [kc][rows] each
          const int64_t rows = std::min<int64_t>(kGemmTileRows, m1 - m);
          float* dst = packed + (m - m0) * kc;
          for (int64_t k = 0; k < kc; ++k)
            for (int64_t r = 0; r < rows; ++r) dst[k * rows + r] = x[(m + r) * ldx + k0 + k];
        }
#pragma omp for schedule(dynamic, 1) nowait  // (the next chunk starts with a barrier)
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t nb0 = g * kGemmGroup, nb1 = std::min(blocks, nb0 + kGemmGroup);
          for (int64_t nb = nb0; nb < nb1; ++nb) {
            const float* wk = w + nb * K * 16 + k0 * 16;
            const float* bk = last && bias != nullptr ? bias + nb * 16 : nullptr;
            for (int64_t m = m0; m < m1; m += kGemmTileRows) {
              const int rows = static_cast<int>(std::min<int64_t>(kGemmTileRows, m1 - m));
              // the first tile of a block fetches the next block's weights of the chunk (a
              // few rows leave the weights bound by memory)
              const float* next = m == m0 && nb + 1 < nb1 ? wk + K * 16 : nullptr;
              kGemmTiles[rows](packed + (m - m0) * kc, wk, kc, o + m * blocks * 16 + nb * 16, blocks * 16,
                               first, bk, next);
            }
          }
        }
      }
    }
  }
}
#endif

}  // namespace

extern "C" {

// M rows of x ([M, K], row stride ldx) times a weight packed for the one-row GEMM: out
// [M, N] contiguous. One row: see gemv_run; several: gemm_run_avx2 (float32 wherever
// AVX2 and FMA are). Returns -1 where this build lacks the path for dtype (0 float32,
// 1 bfloat16) at this row count, -2 for shapes it does not take (N not a multiple of 16;
// bfloat16 K odd; M < 1; ldx < K).
int schedkit_gemm(const void* x, int dtype, int64_t M, int64_t ldx, int64_t K, const void* wp, const void* bias,
                  int64_t N, void* out, int num_threads) {
  if (N % 16 != 0 || K <= 0 || M < 1 || ldx < K || (dtype == 1 && K % 2 != 0)) return -2;
  const int64_t blocks = N / 16;
  if (M > 1) {
#if defined(SCHEDKIT_GEMM_AVX2)
    if (dtype == 0) {
      const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, blocks)));
      gemm_run_avx2(static_cast<const float*>(x), M, ldx, static_cast<const float*>(wp), K, blocks,
                    static_cast<const float*>(bias), static_cast<float*>(out), threads);
      return 0;
    }
#endif
    return -1;
  }
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, (blocks + 1) / 2)));
  if (dtype == 0) {
#if defined(SCHEDKIT_AVX512)
    gemv_run<float, false>(static_cast<const float*>(x), static_cast<const float*>(wp), K, blocks,
                           static_cast<const float*>(bias), static_cast<float*>(out), threads);
    return 0;
#elif defined(SCHEDKIT_GEMV_AVX2)
    gemv_run_avx2(static_cast<const float*>(x), static_cast<const float*>(wp), K, blocks,
                  static_cast<const float*>(bias), static_cast<float*>(out), threads);
    return 0;
#endif
  } else if (dtype == 1) {
#ifdef SCHEDKIT_AVX512_BF16
    gemv_run<uint16_t, true>(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(wp), K, blocks,
                             static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), threads);
    return 0;
#endif
  }
  (void)x; (void)wp; (void)bias; (void)out; (void)threads;
  return -1;
}

}  // extern "C"
